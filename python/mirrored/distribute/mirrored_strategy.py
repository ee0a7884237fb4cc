"""``md.MirroredStrategy``: synchronous data parallelism over the devices of one machine.

Replicas run on a persistent pool of threads (replica 0 on the caller's
thread, and so does any replica no pool thread has picked up by the time
replica 0 returned); the reductions they need go through the strategy's CrossDeviceOps,
whose built-ins make one native call for all replicas with the GIL released.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import numpy as np

try:
    import greenlet as _greenlet
except ImportError:  # optional: without it every replica but the caller's own runs on a thread
    _greenlet = None

from .._core import replica_array_handler as _replica_array_handler, set_array_handler as _set_array_handler
from .._logging import logger
from .._nest import flatten, is_nested, map_structure, pack_sequence_as
from ..device import config, device_util, gpu as _gpu
from ..device.device_util import _current as _device_local
from ..device.indexed_slices import IndexedSlices
from ..timeline import enabled_native as _tracing
from .cross_device_ops import CrossDeviceOps, NcclAllReduce, RingAllReduce, _ReplicaAllReduce, describe
from .context import _Context, _local
from .distribute_lib import _Group, ReplicaContext, Strategy, StrategyExtended
from .name_scope import _state as _scope_local
from .options import VariableAggregation, VariableSynchronization
from .reduce_util import ReduceOp
from .values import (DeviceVariable, DistributedValues, DistributedVariable, Mirrored, MirroredVariable, PerReplica,
                     SyncOnReadVariable, regroup, select_replica)


_NOT_FOUND = (None, None)

# A step that computes longer than this on the caller's thread runs its replicas on their threads,
# in parallel: longer than a thread hand-off costs even on a loaded machine, short enough that
# NumPy's GIL-free work overlaps. CPU time, not wall time: a loaded machine preempts short steps
# for longer than this.
HANDOFF_SECONDS = 0.005
# ... or that has waited this long (sleeping, blocked in I/O): longer than any preemption.
BLOCKED_SECONDS = 0.1


def _is_long(started: float, started_cpu: float | None, launch_only: bool = False) -> bool:
    """Whether a step begun at ``started`` (perf_counter) / ``started_cpu`` (thread_time) is long.
    Without ``started_cpu`` (not read: see _ReplicaPool.run) only a blocked step counts as long.

    ``launch_only`` (every replica on a GPU): the replicas' host work is launching kernels, which
    holds the GIL, so threads would only take turns at it, with a GIL hand-off per released call
    (measured on an H100, same run: two logical GPUs' eager 200-tensor step 55.5 ms with the replicas
    on threads, 48.2 ms on the caller's thread). Only a step that mostly waits (host synchronisations, I/O: less than
    half its wall time on the CPU) then counts as long: threads overlap the waits."""
    wall = time.perf_counter() - started
    if wall <= HANDOFF_SECONDS:
        return False
    if launch_only:
        return started_cpu is not None and time.thread_time() - started_cpu < wall / 2
    return wall > BLOCKED_SECONDS or started_cpu is not None and time.thread_time() - started_cpu > HANDOFF_SECONDS


class _ThreadState:
    """What a replica keeps on its thread: the context stack, the current device and md.name_scope.

    Replicas that share a thread (greenlets, see _Group) take it along: the rendezvous reads and sets it
    natively (``save_state`` when one hands the thread on, ``restore_state`` when it is resumed), as
    ``native()`` describes it.
    """

    # The thread-locals of context.py, device_util.current() and current_scope(): (object, name, default).
    LOCALS = ((_local, "stack", None), (_device_local, "device", None), (_scope_local, "scope", ""))

    def native(self) -> tuple:
        """What _Group.cooperate takes: the LOCALS triples, and the CUDA part (None: none)."""
        return self.LOCALS, None


class _GpuThreadState(_ThreadState):
    """... and, for GPU replicas, CuPy's per-thread CUDA state: the current CUDA device (the runtime's, per
    host thread), the current stream of each of the strategy's GPUs, and the running replica's entry on the
    thread's ``with stream`` stack (CuPy's, per thread: cupy/cuda/stream.pyx).

    Only the running replica's stream is on that stack: a replica handing the thread on takes its
    entry off and puts it back when resumed, so the ``with`` blocks that library code opens and closes
    inside a replica unwind to that replica's stream, never to another's. The rendezvous does that
    natively (csrc/bindings/rendezvous_binding.cc save_gpu/restore_gpu), with the CuPy calls below: a
    park and a resume cost no Python call of mirrored's own.
    """

    def __init__(self, ordinals):
        self._ordinals = tuple(sorted(set(ordinals)))
        cuda = _gpu.cupy_module().cuda
        self._runtime, self._current_stream = cuda.runtime, cuda.get_current_stream

    def native(self) -> tuple:
        # _running.scope: the running replica's _GpuReplicaScope, whose ``_entry[0]`` (its stream) leaves
        # the `with` stack at a park and comes back at a resume, and whose ``_ordinal`` is made current.
        return self.LOCALS, (_running, self._runtime.getDevice, self._runtime.setDevice, self._current_stream,
                             self._ordinals)


_running = threading.local()  # .scope: the _GpuReplicaScope of the replica running on this thread, if any


# .idle: this thread's greenlets waiting for a replica to run (a greenlet only runs on its own thread;
# each runs the rendezvous' native body, which runs replicas one per start for as long as its thread lives)
_threads_greenlets = threading.local()


def _signal(lock):
    """Leaves a wake-up in ``lock`` (a released lock) unless one is already waiting there."""
    try:
        lock.release()
    except RuntimeError:  # released already: the thread it wakes has not taken the last wake-up yet
        pass


class _ReplicaPool:
    """N-1 persistent threads plus the caller's: ``run(replica_fn)`` calls ``replica_fn(i)`` for every i.

    Hand-offs are few and cheap (bare locks, CPython's cheapest primitive):
    the caller wakes replica thread 1 only, each replica thread wakes the
    next before it works, and the caller, once replica 0 returned, runs
    itself every replica that no thread has claimed yet, so a short step
    costs no thread switch at all. Each replica is claimed exactly once per
    run, with an atomic ``dict.setdefault`` (the caller's claims and the
    count of arrivals are the rendezvous', native); the last one to finish
    wakes the caller if it is not the caller.

    The pool holds no reference to its strategy, and its group lets go of
    what a run held (the function, the collectives' results) when the run
    ends: ``close`` ends the threads when the strategy goes. Runs are serialised (a second thread's ``run``
    waits for the first). A KeyboardInterrupt in the caller's thread may
    leave a run's replicas still running; the next ``run`` waits for them
    (and drops their results) before it starts, so the pool never mixes two
    runs.
    """

    def __init__(self, n: int, cooperative: bool = False, blas=None, state: _ThreadState | None = None,
                 launch_only: bool = False, arrays=None):
        self.n = n
        self._launch_only = launch_only  # every replica on a GPU: see _is_long
        # NumPy's array allocator (a mem_handler capsule) for the replicas on the pool's threads and on the
        # caller's during a run after a long one, or None for NumPy's own. (Replicas that run as greenlets
        # keep NumPy's: a greenlet starts with a context of its own, and only short steps run replicas that way.)
        self._arrays = arrays
        self.group = _Group(n)
        self._blas = blas or _BlasCap(())
        self._state = state or _ThreadState()
        self._long_steps = False  # the latest run was long (_is_long)
        # Whether runs read the thread's CPU clock (a system call, ~1.5 us: a tenth of a short run) when
        # they start: only after a run that took longer than HANDOFF_SECONDS, which may have computed
        # that long. So the first of a series of long computing steps runs its replicas one after
        # another; the next ones hand off to the threads as before.
        self._read_cpu = False
        # The caller runs the replicas it claims on its own thread, as greenlets when one must wait in a
        # collective (see _Group), when greenlet is installed: then _coop is the group.
        self._coop = self.group if cooperative and n > 1 and _greenlet else None
        # The rendezvous claims replicas for the caller, counts the arrivals, and saves and restores the
        # thread state natively: no Python call per replica for any of that.
        self.group.pool(self._complete, self._wake, HANDOFF_SECONDS)
        self.group.cooperate(*self._state.native(), _greenlet if self._coop is not None else None)
        self._go = [threading.Lock() for _ in range(n)]
        for lock in self._go:
            lock.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._state_lock = threading.Lock()  # the last replica's "run g is complete" and its release of _done
        self._run_lock = threading.Lock()
        self._threads = None
        self._worker_ids = frozenset()
        self._closed = False
        self._caller = None
        self._generation = 0  # of the latest run started
        self._completed = 0   # of the latest run whose replicas all returned
        self._inflight = False  # replicas of the latest run may still be running
        self._claims = {}  # replica index -> the token of whoever runs it, this run
        self._mine = None  # the caller's token
        self._arrived = None  # this run's [whether replica i arrived], set by the rendezvous (arrive)
        self._results = self._errors = None

    def _start(self):
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True,
                                          name=f"mirrored-replica-{i}") for i in range(1, self.n)]
        for t in self._threads:
            t.start()
        self._worker_ids = frozenset(t.ident for t in self._threads)

    def _worker(self, i: int):
        if self._arrays is not None:  # (this thread's context, for its life)
            _set_array_handler(self._arrays)
        go = self._go[i]
        following = self._go[i + 1] if i + 1 < self.n else None
        while True:
            go.acquire()
            if following is not None:
                _signal(following)
            if self._closed:
                return
            token = object()
            if self._claims.setdefault(i, token) is not token:
                continue  # the caller runs it, or a late wake-up of a finished run
            self.group.run_replica(i, False)
            # Its replica's context stack goes with it: it holds the strategy, which a sleeping thread
            # would keep alive, and with it this thread, after the program dropped it.
            _local.stack = None

    def _wake_threads(self):
        """The replica threads take the replicas not started yet, in parallel (BLAS capped for that: OpenBLAS
        takes its thread count from the caller's thread only)."""
        self._blas.cap()
        _signal(self._go[1])

    def _wake(self) -> bool:
        """The rendezvous asks (at a claim, once the step has taken longer than HANDOFF_SECONDS) whether the
        step is long (_is_long): then the threads are woken to take the replicas not started yet, in parallel."""
        if _is_long(self._started, self._started_cpu, self._launch_only):
            self._wake_threads()
            return True
        return False

    def _complete(self):
        """The last of replicas 1..n-1 arrived, on a replica thread (told by the rendezvous; one that arrives
        on the caller's thread is the rendezvous' ``completed``, which the caller reads when it ends the run)."""
        with self._state_lock:
            self._completed = self._generation
            self._done.release()

    def _settle(self):
        """After an interruption: replicas the caller claimed but never ran, and those nobody claimed (the
        caller claims them now), count as finished."""
        claims, mine = self._claims, self._mine
        for i in range(1, self.n):
            if claims.setdefault(i, mine) is mine and not self._arrived[i]:
                self.group.abort()
                self.group.arrive(i, True)

    def _wait_for_replicas(self):
        """Blocks until every replica of the latest run returned (interruptible; may be called again)."""
        generation = self._generation
        group = self.group
        if self._completed != generation and not group.completed:  # (else every replica has arrived)
            self._settle()
        while True:
            with self._state_lock:
                # (The last arrival on this thread is the rendezvous' `completed`; on a replica thread,
                # _complete's `_completed`.)
                if self._completed == generation or group.completed:
                    self._done.acquire(False)  # consume that run's wake-up if still there
                    break
            self._done.acquire()
        self._inflight = False

    def run(self, replica_fn, body=None) -> list:
        """``[replica_fn(i) for every i]``; or, with ``body`` (_Group.reset's: the run's part of the replicas'
        body, MirroredExtended._call_for_each_replica), replica i's result in that body (``replica_fn``: the
        step's function, which the body calls)."""
        me = threading.get_ident()
        if me == self._caller or me in self._worker_ids:
            # e.g. strategy.run inside a merge_fn: waiting for our own replicas would never end.
            raise RuntimeError("strategy.run was called from inside one of its own replicas (or a merge_call's "
                               "merge_fn); call it from the outer program, between steps")
        with self._run_lock:  # another thread's run finishes first
            if self._inflight:  # an interrupted run's replicas are still running: let them finish
                self._wait_for_replicas()
            if self._threads is None and self.n > 1:
                self._start()
            group, coop = self.group, self._coop
            idle = None
            if coop is not None:
                try:
                    idle = _threads_greenlets.idle
                except AttributeError:  # this thread's first cooperative run
                    idle = _threads_greenlets.idle = []
            # Short steps run on this thread alone; once steps are long, the threads take replicas from
            # the start, in parallel (and the claims need not ask whether to wake them).
            woken = coop is None or self._long_steps
            self._results, self._errors = [None] * self.n, []
            self._generation += 1
            mine, claims, arrived = object(), {}, [False] * self.n
            # The rendezvous runs each replica (run_replica: the result, or the error, kept in these lists)
            # and claims replicas for the caller, woken threads claiming theirs in `claims`.
            group.reset(idle, replica_fn, self._results, self._errors, claims, mine, arrived, woken, body)
            self._mine, self._arrived = mine, arrived
            self._claims = claims  # last: a thread that sees it sees the rest of this run
            # From here on every path leaves the pool consistent, whatever a
            # KeyboardInterrupt interrupts: plain stores do not check for
            # signals; a call may raise one only after it returned (see _settle).
            self._caller = me
            started, started_cpu = time.perf_counter(), time.thread_time() if self._read_cpu else None
            self._started, self._started_cpu = started, started_cpu  # (for _wake)
            # The caller's context takes the replicas' allocator after a long run only: a short step
            # allocates little, and the two calls would add a tenth to a trivial run.
            arrays, callers_arrays = self._arrays if self._read_cpu else None, None
            try:
                if arrays is not None:
                    callers_arrays = _set_array_handler(arrays)
                if self.n > 1:
                    # (Always: a thread woken late for an earlier run may claim a replica of this one.)
                    self._inflight = True
                    if woken:
                        self._wake_threads()
                state = group.save_state()
                try:
                    group.run_replica(0)
                    # The replicas not claimed by a thread (nor started as greenlets) yet: run here, no
                    # hand-off. (`unclaimed` is an attribute, not a call: mostly false by now.)
                    while group.unclaimed:
                        i = group.claim()
                        if i is None:
                            break
                        group.run_replica(i)
                    if coop is not None and coop.unfinished:  # (greenlets waiting for replicas on other threads)
                        coop.drain()
                finally:
                    group.restore_state(state)
            except BaseException:  # interrupted outside a replica's function: free the others
                self.group.abort()
                if coop is not None:
                    coop.finish_aborted()
                raise
            finally:
                self._caller = None
                if self._inflight:
                    if group.completed:  # (the last of replicas 1..n-1 arrived on this thread: mostly so)
                        self._completed, self._inflight = self._generation, False
                    else:
                        self._wait_for_replicas()
                if self._blas.capped is not None:  # (threads were woken: mostly not)
                    self._blas.restore()
                if callers_arrays is not None:
                    _set_array_handler(callers_arrays)
                if not self._inflight:
                    group.end_run()  # (what the run held goes: see _worker)
            # Then the next step starts on the threads (the wall time first: a clock read saved).
            self._read_cpu = time.perf_counter() - started > HANDOFF_SECONDS
            self._long_steps = self._read_cpu and _is_long(started, started_cpu, self._launch_only)
            results, errors = self._results, self._errors
            self._results = self._errors = None
            if errors:
                raise errors[0]
            return results

    def close(self):
        self._closed = True
        if self._threads is not None:
            _signal(self._go[1])  # each replica thread wakes the next, then ends


def _resolve_devices(devices) -> tuple:
    if isinstance(devices, str):
        devices = [devices]
    if devices is None or isinstance(devices, (list, tuple)) and not devices:
        # TF's default for None or empty: every logical GPU, else every logical CPU (one unless split)
        devices = [d.name for d in config.list_logical_devices("GPU") or config.list_logical_devices("CPU")]
    try:
        devices = list(devices)
    except TypeError:
        raise TypeError(f"devices={devices!r}: expected a list of device strings such as ['/cpu:0', '/cpu:1'], "
                        "or None for every GPU (else one CPU)") from None
    if not devices:  # (an empty iterator)
        raise ValueError("devices: no device given; pass a list such as ['/cpu:0', '/cpu:1'], or None for TF's "
                         "default (every GPU, else every logical CPU)")
    canonical = tuple(device_util.canonicalize(d, argument="devices") for d in devices)
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"devices={devices!r}: No duplicates allowed in `devices` argument; each replica needs "
                         "its own device (use '/cpu:0', '/cpu:1', ... for several CPU replicas)")
    num_gpus = len(config.list_logical_devices("GPU"))
    for given, d in zip(devices, canonical):
        spec = device_util.parse(d)
        if spec.device_type == "GPU" and spec.device_index >= num_gpus:
            raise ValueError(f"devices: {given!r} is not available; this machine has {num_gpus} GPU(s) "
                             f"(md.config.list_logical_devices('GPU'){config.hidden_note('GPU')}); use CPU devices "
                             "like '/cpu:0' instead")
    return canonical


def _default_cross_device_ops(devices) -> CrossDeviceOps:
    """TF's choice: NCCL when every replica has a GPU of its own and NCCL loads, else the native ring."""
    if not device_util.all_gpu(devices):
        return RingAllReduce()

    if _gpu.default_gpu_algorithm([device_util.physical_ordinal(d) for d in devices]) == "nccl":
        return NcclAllReduce()
    return RingAllReduce()


_blas = None  # the BLAS libraries' threadpoolctl controllers NumPy loaded (found once), or False


class _BlasCap:
    """Caps BLAS threads while CPU replicas run in parallel, so N replicas x BLAS threads fit the cores.

    Each replica thread's matmuls would otherwise start the BLAS library's own
    threads: 4 replicas on 2 cores then run ~4x slower than with one BLAS
    thread each (bench/train_step.py). Capped when the caller wakes the
    replica threads (replicas the caller runs one after another need no cap,
    and setting it costs tens of microseconds), restored after the step. The
    libraries are found once.
    """

    def __init__(self, devices):
        cpu_replicas = sum(device_util.parse(d).device_type == "CPU" for d in devices)
        self._cap = max(1, len(os.sched_getaffinity(0)) // cpu_replicas) if cpu_replicas >= 2 else 0
        self.capped = None  # [(library, threads before the cap)] while capped, else None

    def cap(self) -> None:
        """Caps the libraries above the cap, once per step. Called on the caller's thread only: a
        pthreads OpenBLAS ignores a count set on any other thread."""
        if not self._cap or self.capped is not None:
            return
        saved = []
        for lib in _blas_controllers():
            threads = lib.get_num_threads()
            if threads is not None and threads > self._cap:
                lib.set_num_threads(self._cap)
                saved.append((lib, threads))
        self.capped = saved

    def restore(self) -> None:
        """Undoes :meth:`cap` (the caller, once the step's replicas all returned)."""
        if self.capped is not None:
            for lib, threads in self.capped:
                lib.set_num_threads(threads)
            self.capped = None


def _blas_controllers() -> list:
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController().select(user_api="blas").lib_controllers
        except ImportError:  # optional: without it BLAS keeps its own thread count
            _blas = False
    return _blas or []


class _GpuReplicaScope:
    """A GPU replica's device and CUDA device and stream, made once (entered by one replica at a time,
    and only by the replica pool's runs: the replicas' body in the rendezvous enters it, runs the replica's
    function and leaves it, natively: ``_Group.replica_body``, csrc/bindings/rendezvous_binding.cc ``run_body``).

    Its stream is entered as CuPy's ``with stream`` does (pushed on the
    thread's stack), so that ``with`` blocks inside the replica unwind to it.
    Replicas that share a thread (greenlets) take their entry off the stack
    while another runs (_GpuThreadState's ``cuda``).

    Leaving takes the stream off the stack and nothing else: the thread's CUDA device and md device
    stay as the replica left them, like a CPU replica's device (the pool puts the caller's back once
    the run ends, and the next replica on the thread sets its own), which saves a device read a replica.

    Inside md.function the replica runs on the step's memory, and on its GPU's step stream, or, when
    replicas share the GPU, on a stream forked from it (device/gpu.py StepScope; _step_streams). The step's allocator
    is the same for every replica and the md.function caller's own, so interleaved enters and exits of
    its (per-thread) scope leave it as it was.
    """

    __slots__ = ("_ordinal", "_device", "_stream", "_replica_id", "_shares_gpu", "_entry")

    # What a replica sets on its thread ((local, name) pairs, in the order the rendezvous' replica_body takes
    # them): its context stack, md device and name scope, and (a GPU replica) the running scope (_GpuThreadState).
    LOCALS = ((_local, "stack"), (_device_local, "device"), (_scope_local, "scope"), (_running, "scope"))

    def __init__(self, device, replica_id: int, shares_gpu: bool):
        self._ordinal = device_util.physical_ordinal(device)
        self._device = device
        self._stream = _gpu.replica_stream(replica_id, self._ordinal)
        self._replica_id, self._shares_gpu = replica_id, shares_gpu
        # While entered inside md.function: (stream entered, memory scope, the step stream it forked from or
        # None); None otherwise, and while entered outside md.function, on its own stream (the park and the
        # resume find that by the scope: a write each way saved). One slot: a run enters each replica's scope
        # once, and runs do not overlap.
        self._entry = None


def _step_streams(scope: _GpuReplicaScope, step) -> tuple:
    """``(stream, memory, origin)`` a GPU replica runs on inside md.function (the replicas' body asks, see
    _GpuReplicaScope): its GPU's step stream, or, when replicas share the GPU, a fork of it (``origin``: the step
    stream, which the fork waits for first and which waits for the fork after the replica), and the step's memory."""
    ordinal = scope._ordinal
    if scope._shares_gpu:
        return _gpu.fork_stream(scope._replica_id, ordinal), _gpu.step_memory(), step.streams[ordinal]
    return step.streams[ordinal], _gpu.step_memory(), None


class _MirroredReplicaContext(ReplicaContext):
    # The strategy caches its replica contexts: a weak reference back keeps
    # a dropped strategy free of cycles (it goes, with its threads, at once).
    @property
    def _strategy(self):
        return self._strategy_ref()

    @_strategy.setter
    def _strategy(self, strategy):
        self._strategy_ref = weakref.ref(strategy)

    @property
    def devices(self) -> list:
        """``[[device]]``: TF's MirroredStrategy nests the replica's device list this way."""
        return [[self._strategy.extended.worker_devices[self._local_replica_id]]]


class MirroredExtended(StrategyExtended):
    """``MirroredStrategy.extended``: replicas on local devices, reductions through ``_cross_device_ops``."""

    def __init__(self, container_strategy: Strategy, devices=None, cross_device_ops=None):
        super().__init__(container_strategy, _resolve_devices(devices))
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"cross_device_ops={cross_device_ops!r}: expected an instance of "
                             "md.cross_device_ops.CrossDeviceOps (e.g. RingAllReduce())")
        self._cross_device_ops = cross_device_ops or _default_cross_device_ops(self._local_devices)
        # Replicas share the caller's thread (greenlets): GPU replicas too, as their kernels are
        # asynchronous; each takes its CUDA device and stream along when it hands the thread on.
        # Each replica's CUDA ordinal (None: not a GPU replica).
        self._ordinals = ordinals = [device_util.physical_ordinal(d) if device_util.parse(d).device_type == "GPU"
                                     else None for d in self._local_devices]
        gpus = [o for o in ordinals if o is not None]
        # CPU replicas allocate their arrays from the process's replica array pool (csrc/host/array_pool.h):
        # a step's arrays come back every step, which glibc would otherwise fault in afresh each time.
        self._pool = _ReplicaPool(len(self._local_devices), cooperative=True, blas=_BlasCap(self._local_devices),
                                  state=_GpuThreadState(gpus) if gpus else _ThreadState(),
                                  launch_only=len(gpus) == len(ordinals),
                                  arrays=None if gpus else _replica_array_handler)
        if gpus:  # collectives and merge_fns run on the merge streams, ordered with every replica's stream
            self._pool.group.order = _gpu.MergeOrder(ordinals)
        # Replicas on several physical GPUs: each run joins them at entry and exit (device/gpu.py), so that
        # the caller's work on any GPU and the replicas' results are ordered for readers on every other one.
        self._across_gpus = _gpu.CrossGpuOrder(gpus) if len(set(gpus)) > 1 else None
        weakref.finalize(container_strategy, self._pool.close)
        self._replica_contexts = None
        self._scopes = None
        # id(ReduceOp) -> (the cross-device ops, their _native_replica_all_reduce answer): batch_reduce_to's
        # route, asked again when the ops are others
        self._native_all_reduces = {}

    def _contexts(self) -> list:
        if self._replica_contexts is None:
            local = len(self._local_devices)
            self._replica_contexts = [
                _MirroredReplicaContext(self._container_strategy, self._worker_index * local + i, i,
                                        self._pool.group)
                for i in range(local)]
            if self._pool.group.order is not None:  # GPU replicas: a CuPy array is one leaf too
                for context in self._replica_contexts:
                    context._array_type = _gpu.cupy_module().ndarray
        return self._replica_contexts

    def _replica_scopes(self) -> list:
        """Each replica's _GpuReplicaScope (None: a CPU replica, whose device is all it enters), made once, when
        the rendezvous is told the replicas' body (csrc/bindings/rendezvous_binding.cc ``run_body``)."""
        if self._scopes is None:
            ordinals = self._ordinals
            scopes = [_GpuReplicaScope(d, i, ordinals.count(o) > 1) if o is not None else None
                      for i, (d, o) in enumerate(zip(self._local_devices, ordinals))]
            gpus = any(scope is not None for scope in scopes)
            self._pool.group.replica_body(_Context, _GpuReplicaScope.LOCALS, scopes, list(self._local_devices),
                                          _gpu if gpus else None, _gpu.raise_if_out_of_memory, _step_streams)
            self._scopes = scopes
        return self._scopes

    def _call_for_each_replica(self, fn, args, kwargs):
        # Each replica's arguments: `column[i]` alone (the commonest case: one distributed batch), else
        # `arguments[i]`, (args, kwargs) as replica i sees them, else none.
        column = arguments = None
        if args and not args[1:] and not kwargs and type(args[0]) in (PerReplica, Mirrored) and \
                len(args[0]._values) == self._pool.n:  # (args[1:], not len(args): a call less every step)
            column = args[0]._values
        elif args or kwargs:
            arguments = self._replica_arguments(args, kwargs)
        contexts = self._replica_contexts or self._contexts()
        if self._scopes is None:
            self._replica_scopes()
        # Every replica starts in the caller's md.name_scope, as TF's replica threads do, and keeps its
        # own: a thread that runs another replica while this one waits in a merge_call must not see it.
        try:  # (current_scope(), inlined)
            name_scope = _scope_local.scope
        except AttributeError:
            name_scope = ""
        # The rendezvous runs each replica in the replicas' one body (run_body): its context, name scope and
        # device set, a GPU replica's stream entered (inside md.function, the step's: _step_streams), fn called
        # with its arguments, and the stream left.
        body = (fn, column, arguments, self._container_strategy_weakref(), contexts, name_scope)
        across = self._across_gpus
        if across is None:
            results = self._pool.run(fn, body)
        else:
            across.join()
            try:
                results = self._pool.run(fn, body)
            finally:  # (also when a replica raised: the caller may drop arrays replicas still read)
                across.join()
        return regroup(results, devices=self._local_devices, array_type=contexts[0]._array_type)

    def _replica_arguments(self, args, kwargs) -> list:
        """``(args, kwargs)`` as each replica sees them (select_replica's rule), the structure walked once."""
        n = len(self._local_devices)
        flat = not kwargs and not any(is_nested(a) for a in args)  # the common case: no re-packing
        leaves = args if flat else flatten((args, kwargs))
        split = []  # per leaf: whether each replica takes its own component
        for leaf in leaves:
            distributed = isinstance(leaf, DistributedValues)
            if distributed and len(leaf._values) != n:
                self._check_components([leaf])
            split.append(distributed and not isinstance(leaf, DistributedVariable))
        if not any(split):  # every replica sees the same arguments
            return [(args, kwargs)] * n
        if flat:  # each argument's per-replica column, transposed into each replica's tuple
            return [(row, kwargs) for row in zip(*[a._values if s else (a,) * n for a, s in zip(args, split)])]
        return [pack_sequence_as((args, kwargs), [leaf._values[i] if s else leaf
                                                  for leaf, s in zip(leaves, split)]) for i in range(n)]

    def _check_components(self, leaves):
        n = len(self._local_devices)
        for leaf in leaves:
            if isinstance(leaf, DistributedValues) and len(leaf.values) != n:
                raise ValueError(f"args: a {type(leaf).__name__} with {len(leaf.values)} components was passed to "
                                 f"a strategy with {n} replicas; pass one component per replica")

    # reductions: every one goes through the CrossDeviceOps object

    def _reduce_to(self, op, value, destinations, options):
        if op is ReduceOp.MEAN and isinstance(value, Mirrored):  # MirroredVariable is Mirrored too
            return value
        if not isinstance(value, DistributedValues):
            return self._reduce_non_distributed(op, value, destinations)
        return self._cross_device_ops.reduce(op, value, destinations, options)

    def _reduce_non_distributed(self, op, value, destinations):
        """TensorFlow's ``reduce_non_distributed_value``. Its shortcut for a value of 0 is taken for host values
        only, as TensorFlow takes it for non-tensors only: a GPU array is not read back (inside md.function's
        capture nothing may wait for the GPU), and is reduced as TensorFlow reduces a tensor."""
        read = value.read_value() if isinstance(value, DeviceVariable) else value
        if not device_util.on_gpu(read) and type(read) is not IndexedSlices:  # (TF's shortcut skips tensors)
            host = device_util.to_host(read)
            if np.all(host == 0):
                return np.zeros(host.shape, host.dtype)
        if op is ReduceOp.MEAN:
            return value
        if self._num_replicas_in_sync != 1:
            raise ValueError(
                f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op {op} over "
                f"{self._num_replicas_in_sync} replicas (it would be counted once per replica); pass a "
                "PerReplica value (e.g. a result of strategy.run) or use ReduceOp.MEAN")
        return self._cross_device_ops.broadcast(value, destinations)

    def _batch_reduce_to(self, op, pairs, options):
        if options is None:
            # (by id: a ReduceOp's hash is Python code; the ops kept beside the answer, which is theirs)
            ops, native = self._native_all_reduces.get(id(op), _NOT_FOUND)
            if ops is not self._cross_device_ops:
                ops = self._cross_device_ops
                native = self._native_replica_all_reduce(op, None)
                self._native_all_reduces[id(op)] = ops, native
            if native is not None:
                results = self._fused_all_reduce(native, pairs)
                if results is not None:
                    return results
        return self._cross_device_ops.batch_reduce(op, pairs, options)

    def _fused_all_reduce(self, native, pairs):
        """``batch_reduce_to`` of ``(v, v)`` pairs of host arrays on this strategy's devices, straight to the
        native fused all-reduce the cross-device ops' batch_reduce ends in (the same call, the same
        results, without its per-pair checks and wrapping); None for any other pairs. One pair is one
        all-reduce of one array per replica, whose plan ``native`` keeps for the next call."""
        devices = self._local_devices
        if len(pairs) == 1:
            v, d = pairs[0]
            if d is not v or not isinstance(v, DistributedValues) or v._devices != devices or \
                    type(v._values[0]) is list:  # (a list is a replica's leaves to native: not one array)
                return None
            # Repeated: the kept plan of its all-reduce runs the arrays (the native run checks each one's type,
            # dtype and shape; None: they do not fit it, and the all-reduce plans them afresh).
            plan = native._plan
            reduced = plan.run(v._values, None) if plan is not None and not _tracing() else None
            if reduced is None:
                reduced = native(v._values)
            return None if reduced is None else [Mirrored(reduced, devices)]
        columns = []
        for v, d in pairs:
            if d is not v or not isinstance(v, DistributedValues) or v._devices != devices:
                return None
            columns.append(v._values)
        if not columns:
            return None
        reduced = native.bound([list(replica) for replica in zip(*columns)])
        if reduced is None:  # not all NumPy arrays (variables, ...)
            return None
        return [Mirrored(column, devices) for column in zip(*reduced)]

    def _native_replica_all_reduce(self, op, options):
        cdo = self._cross_device_ops
        devices = self._local_devices
        if type(self)._batch_reduce_to is not MirroredExtended._batch_reduce_to or len(devices) < 2 or \
                not cdo._native_batch_reduce(devices):
            # A subclass, a user's CrossDeviceOps, or one replica (whose value is the result as it is):
            # through batch_reduce_to
            return None
        if device_util.all_cpu(devices):
            return _ReplicaAllReduce(cdo, op, options, None, np.ndarray)
        if device_util.all_gpu(devices):
            return _ReplicaAllReduce(cdo, op, options, tuple(self._ordinals), _gpu.cupy_module().ndarray,
                                     self._pool.group.order)
        return None  # CPU and GPU replicas mixed

    def _sums_host_replicas_in_order(self) -> bool:
        # CPU replicas whose reductions end in the host engine's direct fold (csrc/host/host_communicator.cc:
        # `auto` is `direct` there at every size), which sums the replicas in their order.
        cdo = self._cross_device_ops
        devices = self._local_devices
        return (type(self)._batch_reduce_to is MirroredExtended._batch_reduce_to and len(devices) > 1
                and device_util.all_cpu(devices) and isinstance(cdo, RingAllReduce)
                and cdo._algorithm in ("auto", "direct") and cdo._native_batch_reduce(devices))

    def _broadcast_to(self, tensor, destinations):
        return self._cross_device_ops.broadcast(tensor, destinations)

    def _gather_to(self, value, destinations, axis, options):
        return self._cross_device_ops._gather(value, destinations, axis, options)

    def _update(self, var, fn, args, kwargs, group):
        if not isinstance(var, DistributedVariable) or var.distribute_strategy is not self._container_strategy:
            raise ValueError(f"var: {var!r} was not created in this strategy's scope(); update only takes "
                             "its variables")
        self._check_components(flatten((args, kwargs)))
        updates = []
        for i, copy in enumerate(var.values):
            with device_util.device_scope(copy.device), device_util.cross_replica_gpu_scope(copy.device):
                updates.append(fn(copy, *select_replica(i, args), **select_replica(i, kwargs)))
        regrouped = regroup(updates, Mirrored, devices=var._devices)
        if group:
            return regrouped
        return map_structure(self._local_results, regrouped)

    def _make_variable(self, value, name, trainable, synchronization, aggregation):
        if synchronization == VariableSynchronization.NONE:
            raise ValueError("`NONE` variable synchronization mode is not supported with md strategies; use "
                             f"ON_WRITE (default) or ON_READ for variable {name!r}")
        if aggregation == VariableAggregation.MEAN and value.dtype.kind in "iub":
            raise ValueError(
                f"variable {name!r} of integer dtype {value.dtype} cannot use aggregation MEAN (the mean of "
                "integers is not an integer); use a float dtype or aggregation SUM / ONLY_FIRST_REPLICA")
        if synchronization == VariableSynchronization.AUTO:
            synchronization = VariableSynchronization.ON_WRITE
        value = self._make_initial_values_identical(value)
        copies = [DeviceVariable(value, f"{name}:0" if i == 0 else f"{name}/replica_{i}:0", d, trainable,
                                 synchronization, aggregation)
                  for i, d in enumerate(self._local_devices)]
        cls = SyncOnReadVariable if synchronization == VariableSynchronization.ON_READ else MirroredVariable
        return cls(self._container_strategy, copies, aggregation)


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine (``tf.distribute.MirroredStrategy``).

    ``devices``: device strings in any TensorFlow spelling; CPU replicas
    (``'/cpu:0'``, ``'/cpu:1'``, ...) are logical devices with their own NumPy
    buffers. ``None``: every GPU, else one CPU replica. ``cross_device_ops``:
    how values are reduced (default: the native ``RingAllReduce``).
    """

    def __init__(self, devices=None, cross_device_ops=None):
        super().__init__(MirroredExtended(self, devices, cross_device_ops))
        logger.info("MirroredStrategy: %d replica(s) on %s; reductions: %s",
                    len(self.extended.worker_devices), list(self.extended.worker_devices),
                    describe(self.extended._cross_device_ops, self.extended.worker_devices))
