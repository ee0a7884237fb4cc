"""``md.MirroredStrategy``: synchronous data parallelism over the devices of one machine.

Replicas run on a persistent pool of threads (replica 0 on the caller's
thread); the reductions they need go through the strategy's CrossDeviceOps,
whose built-ins make one native call for all replicas with the GIL released.
"""

from __future__ import annotations

import contextlib
import os

import threading
import weakref

import numpy as np

from . import _logging, config, device_util
from .cross_device_ops import CrossDeviceOps, NcclAllReduce, RingAllReduce
from .distribute_lib import _Aborted, _Context, _Group, _local, ReplicaContext, Strategy, StrategyExtended
from .options import VariableAggregation, VariableSynchronization
from .reduce_util import ReduceOp
from .values import (DeviceVariable, DistributedValues, DistributedVariable, Mirrored, MirroredVariable,
                     SyncOnReadVariable, regroup, select_replica)


class _ReplicaPool:
    """N-1 persistent threads plus the caller's: ``run(replica_fn)`` calls ``replica_fn(i)`` for every i.

    Hand-offs use bare locks (the cheapest CPython primitive) so that a step
    costs a few microseconds per replica. The pool holds no reference to its
    strategy; ``close`` ends the threads when the strategy is collected.
    """

    def __init__(self, n: int):
        self.n = n
        self.group = _Group(n)
        self._go = [threading.Lock() for _ in range(n)]
        for lock in self._go:
            lock.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._count_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._threads = None
        self._closed = False
        self._fn = None
        self._caller = None

    def _start(self):
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True,
                                          name=f"mirrored-replica-{i}") for i in range(1, self.n)]
        for t in self._threads:
            t.start()

    def _worker(self, i: int):
        go = self._go[i]
        while True:
            go.acquire()
            if self._closed:
                return
            self._execute(i)
            with self._count_lock:
                self._pending -= 1
                if self._pending == 0:
                    self._done.release()

    def _execute(self, i: int):
        try:
            self._results[i] = self._fn(i)
        except _Aborted:
            pass
        except BaseException as e:
            with self._count_lock:
                self._errors.append(e)
            self.group.abort()  # release the replicas waiting for this one in a collective
        finally:
            self.group.replica_finished()

    def run(self, replica_fn) -> list:
        me = threading.get_ident()
        if me == self._caller or any(t.ident == me for t in self._threads or ()):
            # e.g. strategy.run inside a merge_fn: waiting for our own replicas would never end.
            raise RuntimeError("strategy.run was called from inside one of its own replicas (or a merge_call's "
                               "merge_fn); call it from the outer program, between steps")
        with self._run_lock:
            self._caller = me
            if self._threads is None and self.n > 1:
                self._start()
            self._fn, self._results, self._errors = replica_fn, [None] * self.n, []
            self._pending = self.n - 1
            for lock in self._go[1:]:
                lock.release()
            try:
                self._execute(0)
            finally:
                if self.n > 1:
                    self._done.acquire()
                self._fn = self._caller = None
                self.group.reset()
            if self._errors:
                raise self._errors[0]
            return self._results

    def close(self):
        self._closed = True
        if self._threads is not None:
            for lock in self._go[1:]:
                lock.release()


def _resolve_devices(devices) -> tuple:
    if devices is None:
        gpus = config.list_logical_devices("GPU")
        devices = [d.name for d in gpus] or [device_util.canonicalize("/cpu:0")]
    if isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError("devices=[]: a MirroredStrategy needs at least one device, e.g. ['/cpu:0'] or "
                         "devices=None for every GPU (else one CPU replica)")
    canonical = tuple(device_util.canonicalize(d, argument="devices") for d in devices)
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"devices={devices!r}: No duplicates allowed in `devices` argument; each replica needs "
                         "its own device (use '/cpu:0', '/cpu:1', ... for several CPU replicas)")
    num_gpus = len(config.list_logical_devices("GPU"))
    for given, d in zip(devices, canonical):
        spec = device_util.parse(d)
        if spec.device_type == "GPU" and spec.device_index >= num_gpus:
            raise ValueError(f"devices: {given!r} is not available; this machine has {num_gpus} GPU(s) "
                             "(md.config.list_logical_devices('GPU')); use CPU devices like '/cpu:0' instead")
    return canonical


def _default_cross_device_ops(devices) -> CrossDeviceOps:
    """TF's choice: NCCL when every replica has a GPU of its own and NCCL loads, else the native ring."""
    if not device_util.all_gpu(devices):
        return RingAllReduce()
    from . import _gpu

    if _gpu.default_gpu_algorithm([_gpu.physical_ordinal(d) for d in devices]) == "nccl":
        return NcclAllReduce()
    return RingAllReduce()


_blas = None  # threadpoolctl's controller of the BLAS libraries NumPy loaded (found once)


def _blas_threads_for(devices):
    """Cap BLAS threads while CPU replicas run, so N replicas x BLAS threads fit the cores.

    Each replica thread's matmuls would otherwise start the BLAS library's own
    threads: 4 replicas on 2 cores then run ~4x slower than with one BLAS
    thread each (bench/train_step.py). Restored after the step.
    """
    global _blas
    cpu_replicas = sum(device_util.parse(d).device_type == "CPU" for d in devices)
    if cpu_replicas < 2:
        return contextlib.nullcontext()
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController()
        except ImportError:  # optional: without it BLAS keeps its own thread count
            _blas = False
    if not _blas:
        return contextlib.nullcontext()
    cap = max(1, len(os.sched_getaffinity(0)) // cpu_replicas)
    if all(lib.num_threads <= cap for lib in _blas.select(user_api="blas").lib_controllers):
        return contextlib.nullcontext()
    return _blas.limit(limits=cap, user_api="blas")


def _replica_stream_scope(device, replica_id: int):
    """GPU replicas queue their CuPy work on their own device and stream."""
    if device_util.parse(device).device_type != "GPU":
        return contextlib.nullcontext()
    from . import _gpu

    return _gpu.replica_scope(device, replica_id)


class _MirroredReplicaContext(ReplicaContext):
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
        self._pool = _ReplicaPool(len(self._local_devices))
        weakref.finalize(container_strategy, self._pool.close)
        self._replica_contexts = None

    def _contexts(self) -> list:
        if self._replica_contexts is None:
            local = len(self._local_devices)
            self._replica_contexts = [
                _MirroredReplicaContext(self._container_strategy, self._worker_index * local + i, i,
                                        self._pool.group)
                for i in range(local)]
        return self._replica_contexts

    def _call_for_each_replica(self, fn, args, kwargs):
        if args or kwargs:
            self._check_components((args, kwargs))
        strategy, devices, contexts = self._container_strategy, self._local_devices, self._contexts()

        def replica(i):
            saved = getattr(_local, "stack", None)
            _local.stack = [_Context(strategy, contexts[i])]
            try:
                with device_util.device_scope(devices[i]), _replica_stream_scope(devices[i], i):
                    if args or kwargs:
                        return fn(*select_replica(i, args), **select_replica(i, kwargs))
                    return fn()
            finally:
                _local.stack = saved

        with _blas_threads_for(devices):
            return regroup(self._pool.run(replica), devices=devices)

    def _check_components(self, structure):
        from . import _nest

        n = len(self._local_devices)
        for leaf in _nest.flatten(structure):
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
        host = device_util.to_host(value.read_value() if isinstance(value, DeviceVariable) else value)
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
        return self._cross_device_ops.batch_reduce(op, pairs, options)

    def _broadcast_to(self, tensor, destinations):
        return self._cross_device_ops.broadcast(tensor, destinations)

    def _gather_to(self, value, destinations, axis, options):
        return self._cross_device_ops._gather(value, destinations, axis, options)

    def _update(self, var, fn, args, kwargs, group):
        if not isinstance(var, DistributedVariable) or var.distribute_strategy is not self._container_strategy:
            raise ValueError(f"var: {var!r} was not created in this strategy's scope(); update only takes "
                             "its variables")
        self._check_components((args, kwargs))
        updates = []
        for i, copy in enumerate(var.values):
            with device_util.device_scope(copy.device):
                updates.append(fn(copy, *select_replica(i, args), **select_replica(i, kwargs)))
        regrouped = regroup(updates, Mirrored, devices=var._devices)
        if group:
            return regrouped
        from . import _nest

        return _nest.map_structure(self._local_results, regrouped)

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
        _logging.logger.info("MirroredStrategy: %d replica(s) on %s; reductions: %s",
                             len(self.extended.worker_devices), list(self.extended.worker_devices),
                             _logging.reductions(self.extended._cross_device_ops, self.extended.worker_devices))
