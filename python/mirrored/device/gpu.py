"""GPU helpers: which CUDA ordinal a (logical) GPU device is, the streams
replicas and collectives run on, where NCCL comes from and when to use it,
and asynchronous host-to-device copies for dataset prefetch.

Importing this module needs neither CuPy nor a driver; the functions that do
raise an error naming the fix.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import importlib
import importlib.util
import logging
import os
import sys
import threading

from ..errors import from_gpu_out_of_memory, is_gpu_out_of_memory
from .._nest import flatten
from .engine import extension, name as engine_name

NCCL_FIX = "pip install nvidia-nccl-cu13"
CUBLAS_FIX = ("pip install nvidia-cublas-cu13 (the cuBLAS CuPy uses), or set MIRRORED_CUBLAS_LIBRARY to "
              "libcublas.so's path")
CUPY_FIX = "pip install cupy-cuda13x"


def cuda_module():
    """The CUDA extension (``mirrored._cuda``, or the simulator's when :mod:`.engine` selects it),
    or a RuntimeError naming the fix."""
    try:
        return extension()
    except ImportError as e:
        raise RuntimeError(
            f"GPU collectives need mirrored's CUDA extension, which this build lacks ({e}); reinstall mirrored "
            "on a machine with the CUDA toolkit (nvcc on PATH)"
        ) from None


def cuda_module_having(name: str):
    """The CUDA extension when it has ``name`` (a kernel of a newer build than the one loaded), else None; also
    None where there is no CUDA extension at all."""
    try:
        module = cuda_module()
    except RuntimeError:
        return None
    return module if hasattr(module, name) else None


def cupy_module():
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"GPU replicas hold CuPy arrays; install CuPy: {CUPY_FIX}") from None
    return cupy


def raise_if_out_of_memory(error: BaseException, ordinal: int | None = None, *, shape=None, dtype=None) -> None:
    """Raises CuPy's OutOfMemoryError ``error`` as ``md.errors.ResourceExhaustedError`` (still CuPy's class too)
    naming GPU ``ordinal`` (None: the current one), the tensor's ``shape`` and ``dtype`` where known, the bytes and
    the fix; returns for any other error. Called in an ``except MemoryError`` of mirrored's GPU paths, before
    ``raise``."""
    if not is_gpu_out_of_memory(error):
        return
    if ordinal is None:
        ordinal = sys.modules["cupy"].cuda.runtime.getDevice()
    raise from_gpu_out_of_memory(error, ordinal, shape=shape, dtype=dtype) from error


# --- streams -----------------------------------------------------------------

_lock = threading.Lock()
_replica_streams: dict = {}
_replica_stream_ptrs: set = set()


def replica_stream(replica_id: int, ordinal: int):
    """Replica ``replica_id``'s own CuPy stream on GPU ``ordinal``, made once.

    Blocking streams (not ``non_blocking``) on purpose: the device's legacy
    default stream orders them with each other, which is what collectives
    use to meet every replica's work (see :func:`collective_stream`).
    """
    return _made_once(_replica_streams, (int(replica_id), int(ordinal)), ordinal, False, _replica_stream_ptrs)


_step_streams: dict = {}
_fork_streams: dict = {}
_fork_stream_ptrs: set = set()


def _made_once(table: dict, key, ordinal: int, non_blocking: bool, ptrs: set | None = None):
    """``table[key]``, a stream of GPU ``ordinal`` made on first use (its handle added to ``ptrs``)."""
    with _lock:
        s = table.get(key)
        if s is None:
            cupy = cupy_module()
            with cupy.cuda.Device(ordinal):
                s = table[key] = cupy.cuda.Stream(non_blocking=non_blocking)
            if ptrs is not None:
                ptrs.add(s.ptr)
        return s


def step_stream(ordinal: int):
    """GPU ``ordinal``'s stream for the steps ``md.function`` captures and replays, made once and
    shared by all of them (captures run one at a time; replays are ordered with the legacy default
    stream both ways). One stream, not one per capture: each stream that runs a matrix product
    keeps a cuBLAS workspace for good (docs/linalg.md). Non-blocking: the legacy stream's
    implicit synchronisation cannot be captured."""
    return _made_once(_step_streams, int(ordinal), ordinal, True)


def fork_stream(replica_id: int, ordinal: int):
    """Replica ``replica_id``'s stream on GPU ``ordinal`` inside ``md.function``'s steps when it shares
    that GPU with other replicas: forked from :func:`step_stream` and joined back (see
    :class:`StepScope`), so that the replicas' work is parallel branches of the GPU's graph. Made once
    per (replica, GPU) and shared by every capture, as ``step_stream`` is: the cuBLAS workspaces stay
    one per replica and GPU. Non-blocking, as ``step_stream``."""
    return _made_once(_fork_streams, (int(replica_id), int(ordinal)), ordinal, True, _fork_stream_ptrs)


@contextlib.contextmanager
def replica_scope(ordinal: int, replica_id: int):
    """Run a replica's code on CUDA device ``ordinal`` and its own stream (made by :func:`replica_stream`)::

        with _gpu.replica_scope(device_util.physical_ordinal("/gpu:1"), 1):
            fn()   # CuPy work lands on replica 1's stream of GPU 1's physical device
    """
    cupy = cupy_module()
    with cupy.cuda.Device(ordinal), replica_stream(replica_id, ordinal):
        yield


class StepScope:
    """The streams and memory of a step that ``md.function`` runs (eagerly to warm up, or under capture).

    ``streams[ordinal]``: GPU ``ordinal``'s step stream (:func:`step_stream`; the legacy default
    stream, which ordered replica streams and merges eagerly, cannot be captured). A replica that
    has its GPU to itself runs there. Replicas that share a GPU (logical GPUs) each run on a
    stream of their own (:func:`fork_stream`), so that the GPU's graph holds them as parallel
    branches, which a replay can run concurrently: entering the replica, its stream waits for the
    step stream's work so far (the fork); leaving, the step stream waits for the replica stream's
    work (the join, which CUDA requires of every forked stream before the capture ends).
    Cross-replica work runs on the step stream: the step's code outside ``strategy.run``, and
    every combine of :class:`MergeOrder` (collectives, merge_fns, the optimizer's update), which
    first joins every replica stream of the GPU and is waited for by each before its later work.

    ``allocator``: the step's private memory pool (``MemoryPool().malloc``), so that a
    captured graph owns its memory and replays never write into an array that lives
    outside it. The pool, as CuPy's, files a block under the stream current at its allocation
    and hands it out again, without a wait, only to that stream's later allocations; a block is
    safe when every read of it on another stream is ordered before that stream's later work:

    * allocated on a step stream (a combine's results, code outside ``strategy.run``), read by
      replicas: the step stream's next work is a combine, which joins every replica stream
      first, or code after ``strategy.run``, when every replica has joined;
    * allocated on a replica's stream, read on the step stream (a combine's inputs, the
      replica's results read after ``strategy.run``): the replica stream's later work waits
      for the step stream (after the combine; at its next fork);
    * allocated on replica A's stream, read on replica B's: only when a combine hands one
      replica's input array to others (a merge_fn returning it), and B may read it, and drop
      it last, long after; A's next allocation is not ordered after those reads until the next
      combine. So :class:`MergeOrder` keeps the memory of every combine's input arrays until
      every replica of the ``run`` has finished (joined): A's stream then reuses the block
      only after its next fork, which follows B's join.

    ``capturing``: the work is being recorded, not run. ``replay_hooks``:
    host work (``hook()``) that must run before every replay, e.g. an optimizer's scalars
    of the step uploaded into the device buffers the graph reads. ``host_written``: the
    allocator of such buffers (and of the input buffers): a pool of their own, because a
    block the step's pool hands out again inside the capture is written by the graph's
    earlier kernels, after the upload.
    """

    def __init__(self, streams: dict, allocator, capturing: bool, host_written=None):
        self.streams, self.allocator, self.capturing = streams, allocator, capturing
        self.host_written = host_written or allocator
        self.replay_hooks: list = []
        self.captured: dict = {}  # owner -> device state the captured work reads (kept as long as the graphs)


_step: StepScope | None = None


def step_scope() -> StepScope | None:
    """The step ``md.function`` is running now, on any thread (replica threads see it too), else None."""
    return _step


@contextlib.contextmanager
def running_step(scope: StepScope):
    global _step
    _step = scope
    try:
        yield scope
    finally:
        _step = None


def merge_stream(ordinal: int):
    """The stream cross-replica work on GPU ``ordinal`` goes to: the legacy default stream, ordered
    after every replica stream's queued work and before their later work; inside ``md.function``
    the stream the caller's data is ordered on (:func:`_step_stream_of_caller`)."""
    if _step is not None:
        return _step_stream_of_caller(ordinal)
    return cupy_module().cuda.Stream.null


def _step_stream_of_caller(ordinal: int):
    """Inside ``md.function``: the calling replica's fork stream on GPU ``ordinal`` when that is the
    thread's current stream there (a replica sharing the GPU, outside a combine), else the GPU's step
    stream (a replica alone on its GPU, a combine, the step's code outside ``strategy.run``)."""
    current = cupy_module().cuda.get_current_stream(ordinal)
    return current if current.ptr in _fork_stream_ptrs else _step.streams[ordinal]


def step_memory():
    """A context in which this thread's CuPy allocations come from the running step's private pool
    (a null context outside ``md.function``)."""
    if _step is None:
        return contextlib.nullcontext()
    return cupy_module().cuda.using_allocator(_step.allocator)


class MergeOrder:
    """Orders the cross-replica work of a group's combine (one collective call, or one merge_fn)
    with every replica's stream; ``ordinals[r]``: replica r's CUDA ordinal (None: not a GPU replica).

    The combine runs on whichever replica arrives last, and hands arrays to every replica. CuPy's
    memory pool files each block under the stream current at its allocation and hands it out
    again to that stream's next allocation as soon as it is freed, with no wait
    (cupy/cuda/memory.pyx: ``_arena(stream_ptr)``): an array allocated on the combining replica's
    stream, read by another replica's kernels on that replica's stream and then dropped, is
    rewritten by the combining stream's next work while those reads may still be queued. So the
    combine runs with each GPU's merge stream current (:func:`merge_stream`, the legacy default
    stream): what it allocates is filed under that stream, whose later work (the reuse) waits for
    every blocking stream's queued work (every replica stream's reads), and its collectives and
    kernels are ordered after every replica's queued work and before their next work.

    A replica whose current stream is one of the user's (``with cupy.cuda.Stream(non_blocking=True)``
    inside the replica: not ordered by the legacy stream) is ordered with events instead: the merge
    stream waits for that stream's queued work before the combine (the inputs), that stream waits
    for the combine's work after it (the results), and the results handed to that replica are kept
    until the work its stream queued before the replica returned is done (a free on the merge
    stream would not wait for those reads). An array of one replica's arguments that a merge_fn
    hands to another replica is ordered and kept the same way (:meth:`hand_over`).

    Inside ``md.function`` the merge stream is each GPU's step stream (:class:`StepScope`): a
    combine first joins the streams of the replicas that share a GPU (forked from it), and each of
    them waits for the combine after it; the memory of the combine's input arrays is kept until
    every replica of the run has finished (StepScope says why).
    """

    __slots__ = ("_ordinals", "_gpus", "_arrived", "_foreign", "_any_foreign", "_held", "_cuda", "_ndarray", "_null",
                 "_shared", "_forks", "_kept", "_finished", "pending", "_one_gpu")

    def __init__(self, ordinals):
        self._ordinals = tuple(ordinals)
        self._gpus = tuple(sorted({o for o in self._ordinals if o is not None}))
        self._one_gpu = len(self._gpus) == 1
        n = len(self._ordinals)
        self._arrived = [None] * n  # replica -> its current stream at its latest arrival (eager steps)
        self._foreign = [None] * n  # replica -> its current stream at arrival, when not ordered by the legacy one
        self._any_foreign = False  # whether any is (the common case, none, costs the combine no walk)
        self._held = [[] for _ in range(n)]  # replica -> [(ordinal, its stream, results handed to it)] of this run
        cupy = cupy_module()
        self._cuda, self._ndarray = cupy.cuda, cupy.ndarray
        self._null = self._cuda.Stream.null  # (merge_stream outside md.function, looked up once)
        # (replica, ordinal) of the replicas that share their GPU: inside md.function each runs on a fork stream
        self._shared = tuple((r, o) for r, o in enumerate(self._ordinals)
                             if o is not None and self._ordinals.count(o) > 1)
        self._forks = None  # [(ordinal, fork stream)] of those, made at the first step that forks
        self._kept = []  # memory of this run's combine inputs inside md.function (see StepScope)
        self._finished = set()  # the replicas of this run that finished since the first kept (a set: replica
        # threads may finish at once)
        self.pending = False  # whether finish() has work: something held or kept (else replicas skip the call)

    def arrival_parts(self) -> tuple:
        """What the rendezvous reads to note each replica's arrival natively (``rendezvous_binding.cc``
        ``note_arrival``, no Python frame a replica): each replica's ordinal, ``get_current_stream``, the
        replica streams' handles and this module (its ``_step``). An arrival notes the stream the replica
        queued its inputs on in ``_arrived`` (and in ``_foreign`` when not ordered by the legacy stream), and
        hands the current device's current stream, when that is on the replica's GPU, to the park and to
        :meth:`combine` (it says the current device and that GPU's current stream: CuPy files a stream only
        under its own device)."""
        return self._ordinals, self._cuda.get_current_stream, _replica_stream_ptrs, sys.modules[__name__]

    def _merge_stream(self, ordinal: int):
        return self._null if _step is None else _step.streams[ordinal]

    def combine(self, combine, slots, arrival=None):
        """``combine(slots)`` (a list of per-replica results) on the merge streams, ordered with every replica.
        ``arrival``: the combining replica's arrival (the last, just before: see :meth:`arrival_parts`), or None."""
        cuda = self._cuda
        runtime = cuda.runtime
        foreign = ()
        if self._any_foreign:
            foreign = [(r, s) for r, s in enumerate(self._foreign) if s is not None]
            self._foreign, self._any_foreign = [None] * len(self._ordinals), False
            for r, stream in foreign:
                with cuda.Device(self._ordinals[r]):
                    self._merge_stream(self._ordinals[r]).wait_event(stream.record())
        forks = ()
        if _step is not None and self._shared:
            forks = self._fork_streams()
            self._join(forks)
            self._keep(slots)
        entered = ()  # (a stream is entered with its device current, and left so; entered as `with` does)
        # Leaving a `with` block makes the top of CuPy's per-thread stack current again, not a stream the
        # combining replica chose with use(): that one (`current`, per GPU) is made current again after the
        # combine. On one GPU the combining replica's arrival says the current device and stream; when that
        # stream is a replica's, its scope pushed it on top of the stack (scopes push their replica's own), so
        # leaving makes it current again by itself.
        if arrival is not None and self._one_gpu:
            device, current = self._gpus[0], None if arrival.ptr in _replica_stream_ptrs else (arrival,)
        else:
            device = runtime.getDevice()
            current = tuple(map(cuda.get_current_stream, self._gpus))
        on = device  # the current device: switched only to another one (logical GPUs share one: no switch)
        results = None
        try:
            for ordinal in self._gpus:
                if on != ordinal:
                    runtime.setDevice(ordinal)
                    on = ordinal
                stream = self._null if _step is None else _step.streams[ordinal]  # (_merge_stream(), inlined)
                stream.__enter__()
                entered += ((ordinal, stream),)
            if on != device:
                runtime.setDevice(device)
            if _step is None:
                results = combine(slots)
            else:
                with step_memory():
                    results = combine(slots)
            return results
        finally:
            on = runtime.getDevice()
            for ordinal, stream in reversed(entered):
                if on != ordinal:
                    runtime.setDevice(ordinal)
                    on = ordinal
                stream.__exit__(None, None, None)
            for ordinal, stream in zip(self._gpus, current or ()):
                now = cuda.get_current_stream(ordinal)
                if now is not stream and now != stream:
                    if on != ordinal:
                        runtime.setDevice(ordinal)
                        on = ordinal
                    stream.use()
            for r, stream in foreign:
                ordinal = self._ordinals[r]
                if on != ordinal:
                    runtime.setDevice(ordinal)
                    on = ordinal
                stream.wait_event(self._merge_stream(ordinal).record())
                if results is not None:
                    self._held[r].append((ordinal, stream, results[r]))
                    self.pending = True
            if forks:
                self._fork(forks)
            if on != device:
                runtime.setDevice(device)

    def hand_over(self, slots, results) -> None:
        """A merge_fn's results, ``results[r]`` handed to replica r, where ``slots[k]`` holds replica k's
        arguments: orders each array (or view) of replica k's arguments handed to a replica r != k.

        Replica k wrote it on its own stream, and CuPy's pool filed its block under that stream
        (:class:`MergeOrder`); replica r reads it on its own, which nothing else orders with k's when
        the merge_fn queued no work. So r's stream waits for k's queued work (the write), and the
        array's memory is kept, as results handed to a stream of the user's are, until the work r's
        stream queued before replica r returned is done: k's stream hands the block out again only
        after r's reads, whoever drops the array last. Every other result is either new (allocated
        on the merge stream) or was the replica's own already: nothing is done for it.

        Inside ``md.function`` replicas that share a GPU are joined at every combine and StepScope
        keeps the memory instead; between GPUs, whose graphs are captured apart, nothing can order
        one GPU's reads after another's writes: the capture fails, naming the fix, and the step runs
        eagerly (where the above holds).
        """
        handed = self._handed(slots, results)
        if _step is not None:
            for r, sources, _ in handed:
                for k in sources:
                    if self._ordinals[k] != self._ordinals[r]:
                        raise RuntimeError(
                            f"a merge_fn handed replica {k}'s array (on GPU {self._ordinals[k]}) to replica {r} "
                            f"(on GPU {self._ordinals[r]}), which md.function's per-GPU graphs cannot order after "
                            "its writes; share values between GPUs through a collective in replica context "
                            "(ReplicaContext.all_reduce or all_gather, which the graphs hold), or call the step "
                            "without md.function")
            return
        written = {}  # replica k -> an event after the work its stream had queued (recorded once)
        waited = set()  # (r, k): replica r's stream waits for replica k's
        for r, sources, mem in handed:
            ordinal, reader = self._ordinals[r], self._arrived[r]
            for k in sources:
                writer = self._arrived[k]
                if (r, k) in waited or (writer == reader and self._ordinals[k] == ordinal):
                    continue
                waited.add((r, k))
                if k not in written:
                    with self._cuda.Device(self._ordinals[k]):
                        written[k] = writer.record()
                with self._cuda.Device(ordinal):
                    reader.wait_event(written[k])
            self._held[r].append((ordinal, reader, mem))
            self.pending = True

    def _handed(self, slots, results) -> list:
        """``[(r, replicas whose arguments hold it, memory)]`` of each array ``results[r]`` holds whose
        memory (its allocation's base pointer: views count) other replicas' arguments hold, r's not."""
        ndarray = self._ndarray
        owners = {}  # base pointer of an argument array's memory -> the replicas whose arguments hold it
        for k, slot in enumerate(slots):
            if self._ordinals[k] is None:
                continue
            for leaf in flatten(slot):
                if isinstance(leaf, ndarray) and leaf.data.mem.ptr:  # (a zero-size array has no memory)
                    owners.setdefault(leaf.data.mem.ptr, set()).add(k)
        if not owners:
            return []
        handed = []
        for r, result in enumerate(results):
            if self._ordinals[r] is None:
                continue
            for leaf in flatten(result):
                if isinstance(leaf, ndarray):
                    sources = owners.get(leaf.data.mem.ptr)
                    if sources is not None and r not in sources:
                        handed.append((r, sources, leaf.data.mem))
        return handed

    def _fork_streams(self) -> list:
        if self._forks is None:
            self._forks = [(o, fork_stream(r, o)) for r, o in self._shared]
        return self._forks

    def _join(self, forks) -> None:
        """Each GPU's step stream waits for the queued work of its replicas' fork streams."""
        for ordinal, stream in forks:
            with self._cuda.Device(ordinal):
                _step.streams[ordinal].wait_event(stream.record())

    def _fork(self, forks) -> None:
        """The replicas' fork streams wait for their GPU's step stream (the combine's work)."""
        combined = {}
        for ordinal, stream in forks:
            with self._cuda.Device(ordinal):
                if ordinal not in combined:
                    combined[ordinal] = _step.streams[ordinal].record()
                stream.wait_event(combined[ordinal])

    def _keep(self, slots) -> None:
        """Keeps the memory of the combine's input arrays until the run's replicas have all finished."""
        ndarray = self._ndarray
        self._kept.extend(leaf.data.mem for leaf in flatten(slots) if isinstance(leaf, ndarray))
        if self._kept:
            self.pending = True

    def finish(self, replica: int) -> None:
        """Replica ``replica`` returned: what was handed to it on a stream of the user's goes once
        that stream's work queued so far is done. Inside ``md.function`` the memory of the run's
        combine inputs goes once every replica has finished (and so joined its GPU's step stream)."""
        if self._kept:  # (every replica finishes after the run's last combine: all of them are counted)
            self._finished.add(replica)
            if len(self._finished) == len(self._ordinals):
                self._kept, self._finished = [], set()
        held = self._held[replica]
        if held:
            self._held[replica] = []
            for ordinal, stream in {s.ptr: (o, s) for o, s, _ in held}.values():
                with self._cuda.Device(ordinal):
                    _inflight.add(stream.record(), held)
        self.pending = bool(self._kept) or any(self._held)


class CrossGpuOrder:
    """Orders the work of several physical GPUs at the boundaries of an eager ``strategy.run`` (and of
    an ``md.function`` replay): :meth:`join` makes each GPU's legacy default stream wait for the work
    every one of the GPUs had queued so far on its legacy stream and its blocking streams (and on the
    caller's current stream there, where that is another).

    CUDA orders a device's legacy stream with that device's blocking streams only. A replica's results
    on GPU 1, written on its replica stream, are ordered for GPU 1's legacy stream, but not for GPU 0's,
    where the caller's code reads them (``sum(strategy.experimental_local_results(out))``, a copy onto
    GPU 0); nor is the caller's work on GPU 0 (an array a replica on GPU 1 reads, or frees) for GPU 1's
    replica streams. TensorFlow orders every such read by the tensor's producer; we cannot see the
    reads, so the run orders the GPUs both ways: a join at entry (each GPU's replica streams, blocking,
    start after its legacy stream, which is then after every GPU's caller work) and one at exit (each
    GPU's legacy stream, and the caller's current stream there, after every GPU's replica work).

    A join is a chain over the GPUs, not all pairs: down the chain each legacy stream waits for the
    previous GPU's event, recorded after its own wait; the last GPU's event is then after every GPU's
    work, and the others wait for it on the way back. For G GPUs: G event records, 2(G - 1) waits,
    2(G - 1) device switches, one device read (docs/gpu_ordering.md). A strategy on one physical GPU
    makes none of this (its logical GPUs share a legacy stream). Inside ``md.function``'s capture
    nothing is done: the replicas run on the step's streams, the legacy streams cannot be captured,
    and the replay joins the GPUs around its graphs instead. One join at a time (runs of the
    strategy from several threads): each re-records the events.
    """

    __slots__ = ("_ordinals", "_chains", "_events", "_runtime", "_null", "_current", "_cuda", "_lock")

    def __init__(self, ordinals):
        self._ordinals = tuple(sorted(set(ordinals)))
        self._cuda = cuda = cupy_module().cuda
        self._runtime, self._null, self._current = cuda.runtime, cuda.Stream.null, cuda.get_current_stream
        self._chains = {}  # the current device at the join -> ((ordinal, its event), ...) in the chain's order
        self._events = {}  # ordinal -> its event (re-recorded at every join: a wait takes the latest record)
        self._lock = threading.Lock()

    def _chain(self, device: int) -> tuple:
        """The GPUs in the order a join from ``device`` visits them: ``device`` first when it is one of
        them (no switch to begin with, and the way back ends there)."""
        chain = self._chains.get(device)
        if chain is None:
            order = sorted(self._ordinals, key=lambda o: o != device)
            for o in order:
                if o not in self._events:
                    with self._cuda.Device(o):
                        self._events[o] = self._cuda.Event(disable_timing=True)
            chain = self._chains[device] = tuple((o, self._events[o]) for o in order)
        return chain

    def join(self) -> None:
        if _step is not None:
            return
        with self._lock:
            self._join()

    def _join(self) -> None:
        runtime, null, current = self._runtime, self._null, self._current
        device = runtime.getDevice()
        chain = self._chain(device)
        users = {}  # ordinal -> the caller's current stream there, where that is not the legacy stream
        on, before = device, None
        for ordinal, event in chain:  # down the chain: each GPU's legacy stream after every GPU before it
            if on != ordinal:
                runtime.setDevice(ordinal)
                on = ordinal
            stream = current(ordinal)
            if stream.ptr:  # the caller's work there joins too
                event.record(stream)
                null.wait_event(event)
                users[ordinal] = stream
            if before is not None:
                null.wait_event(before)
            event.record(null)
            before = event
        if on in users:  # the last GPU's: its legacy stream is where the last event was recorded
            users[on].wait_event(before)
        for ordinal, _ in reversed(chain[:-1]):  # and back: each after the last, which is after every one
            runtime.setDevice(ordinal)
            on = ordinal
            null.wait_event(before)
            if ordinal in users:
                users[ordinal].wait_event(before)
        if on != device:
            runtime.setDevice(device)


def collective_stream(ordinal: int) -> int:
    """Handle of the stream a collective over a buffer on GPU ``ordinal`` is ordered on.

    The calling thread's current CuPy stream, as for any CuPy operation;
    except when that is a replica stream (a merged call from inside a
    replica): then the legacy default stream, which waits for every
    replica's queued work on the device and is waited for by their next work.
    (A replica context's collectives run in :meth:`MergeOrder.combine`, with that stream current.)
    Inside ``md.function``: the step's stream the caller's data is ordered on (see :class:`StepScope`).
    """
    if _step is not None:
        return _step_stream_of_caller(ordinal).ptr
    import cupy  # (cupy_module(), inlined: a call on GPU buffers has CuPy, and every planned call asks)

    s = cupy.cuda.get_current_stream(ordinal)
    return 0 if s.ptr in _replica_stream_ptrs else s.ptr


# --- cuBLAS ------------------------------------------------------------------

_cublas: dict = {}  # engine name -> the loaded library's path, or the error text


def cublas_library_candidates() -> list[str]:
    """Where libcublas is looked for: $MIRRORED_CUBLAS_LIBRARY, the copy CuPy has loaded (the same
    cuBLAS as its ``@``), the nvidia-cublas wheels, the system.

    The simulated engine is its own libcublas (a stand-in over the simulated GPUs).
    """
    if engine_name() == "sim":
        return [cuda_module().__file__]
    # (the CUDA 13 wheels' layout, and the CUDA 12 one)
    return _library_candidates("MIRRORED_CUBLAS_LIBRARY", _cupys_cublas(), ("nvidia.cu13", "nvidia.cublas"),
                               "libcublas.so.*", ["libcublas.so.13", "libcublas.so.12", "libcublas.so"])


def _library_candidates(variable: str, loaded: list, packages: tuple, pattern: str, system: list) -> list[str]:
    """A run-time library's candidate paths, in order: $variable, those this process has ``loaded``
    already, the files matching ``pattern`` in lib/ of each pip wheel of ``packages``, the system's."""
    out = [os.environ[variable]] if os.environ.get(variable) else []
    out += loaded
    for package in packages:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            out += sorted(glob.glob(os.path.join(root, "lib", pattern)))
    return list(dict.fromkeys(out + system))


def _cupys_cublas() -> list[str]:
    """The libcublas files mapped into this process once CuPy's cuBLAS module is imported (it links them)."""
    try:
        importlib.import_module("cupy_backends.cuda.libs.cublas")
    except Exception:  # no CuPy, or one that cannot load cuBLAS: the other candidates remain
        return []
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6]
    except OSError:
        return []
    return [p for p in dict.fromkeys(paths) if os.path.basename(p).startswith("libcublas.so")]


def load_cublas() -> str:
    """The path of the loaded libcublas; RuntimeError naming the fix if none loads."""
    with _lock:
        key = engine_name()
        if key not in _cublas:
            try:
                _cublas[key] = ("loaded", cuda_module().blas_load(cublas_library_candidates()))
            except RuntimeError as e:
                _cublas[key] = ("failed", str(e))
        state, text = _cublas[key]
    if state == "failed":
        fix = "" if "MIRRORED_CUBLAS_LIBRARY" in text else f"; {CUBLAS_FIX}"  # (the loader's own text names it)
        raise RuntimeError(f"md.linalg.matmul on GPU arrays needs cuBLAS: {text}{fix}")
    return text


# --- NCCL --------------------------------------------------------------------

_nccl: dict = {}  # engine name -> (path, version) once loaded, or the error text


def nccl_library_candidates() -> list[str]:
    """Where libnccl is looked for: $MIRRORED_NCCL_LIBRARY, the nvidia-nccl-cu13 wheel, the system.

    The simulated engine is its own libnccl (a stand-in over the simulated GPUs).
    """
    if engine_name() == "sim":
        return [cuda_module().__file__]
    return _library_candidates("MIRRORED_NCCL_LIBRARY", [], ("nvidia.nccl",), "libnccl.so.2", ["libnccl.so.2"])


def load_nccl() -> tuple[str, int]:
    """(path, version code) of the loaded libnccl; RuntimeError naming ``pip install nvidia-nccl-cu13`` if none loads."""
    with _lock:
        key = engine_name()
        if key not in _nccl:
            try:
                _nccl[key] = tuple(cuda_module().nccl_load(nccl_library_candidates()))
            except RuntimeError as e:
                _nccl[key] = str(e)
        loaded = _nccl[key]
        if isinstance(loaded, str):
            if NCCL_FIX not in loaded:
                raise RuntimeError(f"NCCL is not available: {loaded}; {NCCL_FIX}")
            raise RuntimeError(loaded)
        return loaded


def nccl_available() -> bool:
    try:
        load_nccl()
        return True
    except RuntimeError:
        return False


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) for ``_cuda.nccl_rank`` in multi-worker jobs."""
    load_nccl()
    return cuda_module().nccl_unique_id()


_warned: set = set()


def default_gpu_algorithm(ordinals) -> str:
    """The all-reduce algorithm for GPU replicas on CUDA ``ordinals`` by default.

    ``"nccl"`` when NCCL loads and the replicas span several GPUs (one GPU
    per replica: NCCL itself; GPUs hosting several replicas: the
    hierarchical engine, docs/hierarchical.md); else ``"auto"`` (the native
    engine: one-pass kernels where every replica's GPU reads the others',
    else the ring or tree), with a one-line warning saying why
    (logged once per reason on the ``mirrored`` logger, as TensorFlow logs it).
    """
    ordinals = [int(o) for o in ordinals]
    if len(set(ordinals)) == 1 < len(ordinals):
        reason = "several replicas share a GPU (logical GPUs), which NCCL refuses"
    elif not nccl_available():
        reason = f"NCCL is not installed ({NCCL_FIX})"
    else:
        return "nccl"
    if reason not in _warned:
        _warned.add(reason)
        logging.getLogger("mirrored").warning("GPU all-reduce uses the native engine (one-pass kernels, "
                                              "native ring or tree): %s", reason)
    return "auto"


# --- host -> device ----------------------------------------------------------

class _Inflight:
    """Memory kept alive until the stream work reading it finishes (an event per entry)."""

    def __init__(self):
        self._q = collections.deque()
        self._lock = threading.Lock()

    def add(self, event, pinned):
        with self._lock:
            self._q.append((event, pinned))
            while self._q and self._q[0][0].done:
                self._q.popleft()


_inflight = _Inflight()
