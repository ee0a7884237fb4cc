"""Strategy, StrategyExtended, ReplicaContext and the default strategy.

The context stack (which strategy and replica context are current on a
thread) is :mod:`mirrored.distribute.context`; this module installs the
default strategy's context there.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Mapping
from types import FunctionType as _FunctionType

import numpy as np

from .._core import Rendezvous as _Rendezvous, replica_all_reduce_method as _replica_all_reduce_method  # (private)
from .._nest import flatten, is_nested, map_structure, pack_sequence_as
from ..timeline import HOST_ROW, enabled_flag as _tracing, replica_wait, set_row_source
from ..device import device_util, gpu as _gpu
from ..device.dtypes import dtype_code
from ..device.indexed_slices import IndexedSlices, convert_to_tensor, map_arrays
from .name_scope import scoped_name
from .options import InputReplicationMode, VariableAggregation, VariableSynchronization, check_options
from .reduce_util import ReduceOp, as_reduce_op
from .values import (DeviceVariable, DistributedValues, Mirrored, PerReplica, _read, regroup, select_replica,
                     value_container)

HOST = "/job:localhost/replica:0/task:0/device:CPU:0"


from .context import (_Context, _entered, _local, _new_tuple, _stack, _top, get_cross_replica_context,
                      get_replica_context, get_strategy, has_strategy, in_cross_replica_context, set_default_context)


def _require_cross_replica_or_default(strategy: "Strategy", method: str):
    top = _top()
    if top is _DEFAULT or (top.strategy is strategy and top.replica_context is None):
        return  # outside any strategy, or in this one's cross-replica context
    if top.strategy is not strategy and top.strategy is not _default_context().strategy:
        raise RuntimeError(f"Mixing different md strategies: {method} of {strategy!r} called while "
                         f"{top.strategy!r} is current; leave the other strategy's scope first")
    if top.replica_context not in (None, default_replica_context()) and top.strategy is strategy:
        raise RuntimeError(f"{method} requires being in cross-replica context; inside strategy.run use "
                           "md.get_replica_context().merge_call(...) or the replica context's all_reduce")


def _timeline_row() -> int:
    """The timeline row of the calling thread: its local replica, or the host row outside replica context."""
    ctx = get_replica_context()
    if ctx is None or not has_strategy():
        return HOST_ROW
    return int(getattr(ctx, "_local_replica_id", 0))


set_row_source(_timeline_row)


# --- replica rendezvous ------------------------------------------------------------------


class _Aborted(Exception):
    """A replica was released from a collective because another replica failed."""


class _Group(_Rendezvous):
    """Where the replicas of one ``run`` meet for each collective call (native: csrc/bindings/rendezvous_binding.cc).

    Every replica hands in its payload (``exchange(rid, kind, payload,
    combine)``); the last one to arrive runs ``combine`` once for all of them
    (the single native call), and each replica takes back its own part. A
    replica that fails breaks the group (``abort``), so no replica waits
    forever for it; one that returns without calling a collective the others
    wait in (``replica_finished``) breaks it with an error naming them.

    A replica on a thread of its own sleeps until the combine, the GIL
    released. On the caller's thread (after ``cooperate``, see
    mirrored_strategy's ``_ReplicaPool``) a replica never sleeps there: the
    caller's own replica runs the other replicas, as greenlets, until the
    collective completes, and one running as a greenlet parks, handing the
    thread on, until the combine makes it ready again. ``order``: GPU
    replicas' MergeOrder (device/gpu.py), which each replica tells of its
    arrival and every combine runs in; None for CPU replicas.
    """

    def __init__(self, n: int):
        # (`stack`: where exchange()'s `context` is checked to be the thread's current replica context; the
        # timeline's `_trace`, true while it records, is read from its module's dict at each exchange.)
        super().__init__(n, _Aborted, _tracing, _traced_exchange, (_local, "stack"))


def _traced_exchange(group, rid, kind, payload, combine, context=None):
    with replica_wait(rid, kind):  # shows each replica's wait for the slowest one
        return group._exchange(rid, kind, payload, combine, context)


# --- replica context -----------------------------------------------------------------------


def _may_hand_arrays(result, array_type) -> bool:
    """Whether a merge_fn's ``result`` may hand the replicas arrays: it holds one, or a distributed value
    (whose components each replica gets). Most hold neither (None, a number, a step count), and
    then the replicas' arguments, which may be long lists (a step's gradients), are not walked."""
    if result is None:
        return False
    return any(isinstance(leaf, (array_type, DistributedValues)) for leaf in flatten(result))


class ReplicaContext:
    """The context of one replica inside ``strategy.run``: its id and the collectives across replicas."""

    # The replicas' own array type besides NumPy's (GPU strategies: CuPy's), taken as one leaf without
    # walking it as a structure.
    _array_type = np.ndarray

    def __init__(self, strategy: "Strategy", replica_id_in_sync_group: int, _local_replica_id: int = 0,
                 _group: _Group | None = None):
        self._strategy = strategy
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._local_replica_id = _local_replica_id
        self._group = _group if _group is not None else _Group(1)
        self._all_reduces = {}  # op name -> the combine of an all_reduce without options (made once per op)
        self._latest = (None, None)  # (op name, combine) of the latest such all_reduce

    @property
    def strategy(self) -> "Strategy":
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple:
        return (self._strategy.extended.worker_devices[self._local_replica_id],)

    def __enter__(self):
        _stack().append(_Context(self._strategy, self))
        return self

    def __exit__(self, *exc):
        _stack().pop()

    def _require_current(self, method: str):
        # A saved context used later (or from another thread) would wait forever for its replicas.
        if _top().replica_context is not self:
            raise RuntimeError(f"ReplicaContext.{method} must be called inside the replica function that owns "
                               "this context; call md.get_replica_context() inside strategy.run and use that")

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Pause every replica, run ``merge_fn(strategy, *merged_args)`` once in cross-replica context.

        Each argument becomes a ``PerReplica`` of the replicas' values (or stays
        as is when every replica passed the same object); every replica gets
        its own part of the result.
        """
        self._require_current("merge_call")
        _check_call("merge_call", merge_fn, "merge_fn", args, kwargs)
        kwargs = kwargs or {}
        strategy = self._strategy
        devices = strategy.extended.worker_devices

        def combine(per_replica):
            merged_args = regroup([a for a, _ in per_replica], devices=devices)
            merged_kwargs = regroup([k for _, k in per_replica], devices=devices)
            with _entered(_Context(strategy, None)):
                result = merge_fn(strategy, *merged_args, **merged_kwargs)
            results = [select_replica(r, result) for r in range(len(per_replica))]
            order = self._group.order
            if order is not None and _may_hand_arrays(result, self._array_type):
                order.hand_over(per_replica, results)  # GPU replicas: orders one replica's array handed to others
            return results

        return self._group.exchange(self._local_replica_id, "merge_call", (tuple(args), dict(kwargs)), combine)

    def _combiner(self, kind: str, reduce_leaves, native=None):
        """The combine of a collective (run once, by the last replica to arrive): ``slots[r]`` (replica r's
        one array, or its list of leaves) -> each replica's results in the same form, from
        ``reduce_leaves(list of PerReplica) -> list of per-device results``. ``native(slots)`` (one array
        per replica, or lists of leaves) -> the results, if given, is tried first; it returns None for
        values it does not take."""
        # (Weak: a context keeps its all_reduce combines, so a strong reference would be a cycle that keeps a
        # dropped strategy's contexts and cross-device ops until the garbage collector runs.)
        context = weakref.ref(self)

        def combine(slots):
            # (A slot is one array, or the list of a structure's leaves: see _collective.)
            if native and type(slots[0]) is not list:  # the common case: one array each, one native call
                results = native(slots)  # (None unless every slot is an array native takes as it is)
                if results is not None:
                    return results
            single = [type(s) is not list for s in slots]
            per_replica = [[s] if one else s for s, one in zip(slots, single)]
            count = len(per_replica[0])
            for leaves_r in per_replica:
                if len(leaves_r) != count:
                    raise ValueError(f"value: replicas passed structures with different numbers of arrays to "
                                     f"{kind} ({[len(x) for x in per_replica]}); pass the same structure on "
                                     "every replica")
            results = native(per_replica) if native and not any(single) else None
            if results is None:
                devices = context()._strategy.extended.worker_devices
                per_leaf = [PerReplica([r[t] for r in per_replica], devices) for t in range(count)]
                outs = reduce_leaves(per_leaf)
                local = [out.values if isinstance(out, DistributedValues) else (out,) * len(per_replica)
                         for out in outs]
                results = [[out[r] for out in local] for r in range(len(per_replica))]
            return [r[0] if one else r for r, one in zip(results, single)]

        return combine

    def _collective(self, kind: str, value, combine):
        """Runs ``combine`` (see :meth:`_combiner`) on ``value``'s leaves, with every replica's."""
        if type(value) is self._array_type or type(value) is np.ndarray:  # the common case: one array
            # (The exchange checks that this context is the thread's current one, natively: _require_current.)
            return self._group.exchange(self._local_replica_id, kind, value, combine, self)
        if _top().replica_context is not self:
            self._require_current(kind)
        # A variable is read here, in its replica (its own copy, as TF converts it to a tensor), not by the
        # replica that combines.
        leaves = [_read(leaf) for leaf in flatten(value)]
        return pack_sequence_as(value, self._group.exchange(self._local_replica_id, kind, leaves, combine))

    def _all_reduce(self, reduce_op, value, options=None):
        """Reduce ``value`` (an array or a nested structure of arrays) across replicas; all get the result.

        All leaves go through one fused batch all-reduce of the strategy's cross-device ops. ``options``: this
        call's ``CommunicationOptions``, merged over the strategy's (docs/multi_worker.md).

        (``all_reduce``, the public name, is a builtin method, see below: it takes a call that repeats the latest
        one straight to the exchange, and hands every other call here.)
        """
        # A repeated call first: its combine is kept by the op's name as given (a ReduceOp by its value; not
        # by the ReduceOp: its hash is Python code).
        name = reduce_op._value_ if type(reduce_op) is ReduceOp else reduce_op
        if options is None and type(name) is str:
            if name is self._latest[0]:  # (the same string object as the latest call's: no lookup)
                combine = self._latest[1]
            else:
                combine = self._all_reduces.get(name)
                if combine is not None:
                    self._latest = name, combine
            if combine is not None:
                if type(value) is self._array_type or type(value) is np.ndarray:  # (_collective's first case)
                    return self._group.exchange(self._local_replica_id, "all_reduce", value, combine, self)
                return self._collective("all_reduce", value, combine)
        op = as_reduce_op(reduce_op)
        check_options(options)
        # Made once per op: the built-in native ops take the replicas' arrays straight, as batch_reduce_to
        # would hand them over (none: through batch_reduce_to).
        extended = self._strategy.extended
        native = extended._native_replica_all_reduce(op, options)
        extended = weakref.ref(extended)  # (kept by this context: see _combiner)
        combine = self._combiner("all_reduce", lambda per_leaf: extended()._batch_reduce_to(
            op, [(v, v) for v in per_leaf], options), native)
        if native is not None:
            combine = native.combine_first(combine)
        if options is None:  # (an op's names are few: bounded)
            self._all_reduces[op._value_] = self._all_reduces[name] = combine
        return self._collective("all_reduce", value, combine)

    def all_gather(self, value, axis: int, options=None):
        """Concatenate every replica's ``value`` along ``axis`` (sizes may differ along ``axis`` only)."""
        check_options(options)
        if IndexedSlices in map(type, flatten(value)):  # (TF's words)
            raise NotImplementedError("all_gather does not support IndexedSlices; gather their values and "
                                      "indices (two arrays) instead, or all_reduce them (their rows concatenate)")
        ext = self._strategy.extended
        return self._collective("all_gather", value, self._combiner(
            "all_gather", lambda per_leaf: [ext._gather_to(v, v, axis, options) for v in per_leaf]))

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._replica_id_in_sync_group})"


# ReplicaContext.all_reduce as a builtin method (csrc/bindings/rendezvous_binding.cc): a call that repeats the
# latest one (the same op name, no options, one array of the replicas' own type or NumPy's) goes straight to the
# exchange, as _all_reduce's first branch does, with no Python frame (every replica of every step makes it);
# every other call is _all_reduce's.
ReplicaContext.all_reduce = _replica_all_reduce_method(ReplicaContext, ReplicaContext._all_reduce, ReduceOp, np.ndarray)


# --- strategy ------------------------------------------------------------------------------


class _Scope:
    def __init__(self, strategy: "Strategy"):
        self._strategy = strategy
        self._pushed = False

    def __enter__(self) -> "Strategy":
        top = _top()
        default = _default_context().strategy
        if top.strategy is not self._strategy and top.strategy is not default:
            raise RuntimeError(
                f"Mixing different md strategies: cannot enter the scope of {self._strategy!r} inside the scope "
                f"of {top.strategy!r}; leave the outer strategy's scope first")
        _require_cross_replica_or_default(self._strategy, "scope()")
        if top.strategy is not self._strategy or top.replica_context is default_replica_context():
            _stack().append(_Context(self._strategy, None))
            self._pushed = True
        return self._strategy

    def __exit__(self, *exc):
        if self._pushed:
            _stack().pop()
            self._pushed = False


_run_observer = None  # set while md.function warms a step up: told of every strategy.run (distribute/function.py)


class Strategy:
    """A way to run one computation on several replicas (``tf.distribute.Strategy``)."""

    def __init__(self, extended: "StrategyExtended"):
        self._extended = extended

    @property
    def extended(self) -> "StrategyExtended":
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        return self._extended._num_replicas_in_sync

    @property
    def cluster_resolver(self):
        return None

    def scope(self) -> _Scope:
        """Make this strategy current and enter cross-replica context; variables created inside are distributed."""
        return _Scope(self)

    def run(self, fn, args=(), kwargs=None, options=None):
        """Call ``fn(*args, **kwargs)`` once per replica, concurrently, in replica context.

        ``PerReplica``/``Mirrored`` arguments are unwrapped to each replica's
        component; the results come back as one structure with ``PerReplica``
        leaves (plain values with one replica).
        """
        try:  # (_top() and _stack() inlined, and no getattr call: every step calls run)
            stack = _local.stack
        except AttributeError:  # (this thread's first)
            stack = None
        top = stack[-1] if stack else _DEFAULT
        if top is not _DEFAULT and (top.strategy is not self or top.replica_context is not None):
            _require_cross_replica_or_default(self, "run")
        if type(args) is not tuple and not isinstance(args, (list, tuple)):
            raise ValueError(f"args={args!r}: pass the arguments of fn as a tuple, e.g. args=(x,)")
        if not callable(fn) or kwargs and type(kwargs) is not dict:
            _check_call("run", fn, "fn", (), kwargs)
        # strategy.run(md.function(step), ...): md.function's objects have it; a plain function has not.
        captured = None if type(fn) is _FunctionType else getattr(fn, "_run_in_strategy", None)
        if captured is not None:
            return captured(self, args, dict(kwargs or {}))
        if _run_observer is not None:
            _run_observer(self)
            stack = _stack()  # (the observer may have entered a scope)
            top = stack[-1] if stack else _DEFAULT
        if top.strategy is self and top.replica_context is None:  # in this strategy's scope already
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs) if kwargs else {})
        if stack is None:
            stack = _stack()
        # What scope() does, once the check above has passed (`+=` and `del`: no list method calls).
        stack += (_new_tuple(_Context, (self, None)),)
        try:
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs) if kwargs else {})
        finally:
            del stack[-1]

    experimental_run_v2 = run

    def reduce(self, reduce_op, value, axis=None):
        """Reduce ``value`` across replicas (and along ``axis`` in each replica) to a NumPy value on the host.

        With ``axis``, ``MEAN`` divides by the total number of elements along
        ``axis`` over all replicas, so a partial last batch is weighted right.
        """
        op = as_reduce_op(reduce_op)
        _require_cross_replica_or_default(self, "reduce")
        if axis is None:
            result = self._extended._reduce(op, value)
            if op is not ReduceOp.MEAN:
                return result
            if isinstance(value, DistributedValues):  # (the common case: one value)
                return _as_tf_mean(value, result)
            return pack_sequence_as(result, [_as_tf_mean(v, m) for v, m in zip(flatten(value), flatten(result))])
        ext = self._extended
        n = len(ext.worker_devices)
        comps = [[_read(select_replica(i, leaf)) for i in range(n)] for leaf in flatten(value)]
        if any(type(c) is IndexedSlices for cs in comps for c in cs):
            raise ValueError(f"axis={axis!r}: IndexedSlices reduce across replicas only; pass axis=None (their "
                             "rows are concatenated), or densify them first (md.convert_to_tensor)")
        _check_axis(axis, comps)

        def along_axis(fn):
            def local(c, d):
                v = device_util.place(c, d)
                with device_util.array_device(v):  # on v's GPU, ordered after the work that wrote v
                    return fn(v)

            leaves = [PerReplica([local(c, d) for c, d in zip(cs, ext.worker_devices)], ext.worker_devices)
                      for cs in comps]
            return pack_sequence_as(value, leaves)

        if op is not ReduceOp.MEAN:
            return ext._reduce(op, along_axis(lambda v: _reduce_along(v, op, axis)))
        numer = ext._reduce(ReduceOp.SUM, along_axis(lambda v: _reduce_along(v, ReduceOp.SUM, axis)))
        if ext._num_workers == 1:  # every count is here: the shapes' (no collective, no upload to a GPU)
            denom = [np.int64(sum(np.shape(c)[axis] for c in cs)) for cs in comps]
        else:
            denom = flatten(ext._reduce(ReduceOp.SUM, along_axis(lambda v: np.asarray(v.shape[axis], np.int64))))
        return pack_sequence_as(numer, [_divide(a, b) for a, b in zip(flatten(numer), denom)])

    def gather(self, value, axis: int):
        """Concatenate the replicas' components of ``value`` along ``axis``, on the host."""
        _require_cross_replica_or_default(self, "gather (use get_replica_context().all_gather() in replicas)")
        return map_structure(lambda v: self._extended._gather_to_host(v, axis), value)

    def experimental_local_results(self, value) -> tuple:
        """The components of ``value`` on this worker's replicas; ``(value,)`` for a non-distributed value."""
        return self._extended._local_results(value)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Split each batch of ``dataset`` over the replicas (TF's rule), prefetching in the background."""
        from .input_lib import DistributedDataset

        return DistributedDataset(dataset, self._extended, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``dataset_fn(InputContext)`` gives per-replica batches; each replica takes one per step."""
        from .input_lib import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(dataset_fn, self._extended, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_make_numpy_dataset(self, numpy_input):
        """A dataset of the rows of ``numpy_input`` (TF 2.0/2.1), to pass to ``experimental_distribute_dataset``.

        Tuples and dicts are structures of arrays; a list of arrays is stacked
        into one array (tf.data's rule). The result has ``batch``, ``repeat``
        and ``with_options`` (md.data.NumpyDataset).
        """
        from ..data import make_numpy_dataset

        return make_numpy_dataset(numpy_input)

    def experimental_distribute_values_from_function(self, value_fn) -> PerReplica:
        """``PerReplica`` of ``value_fn(ValueContext)`` for each of this worker's replicas."""
        from .input_lib import ValueContext

        _check_call("experimental_distribute_values_from_function", value_fn, "value_fn")
        ext = self._extended
        local = len(ext.worker_devices)
        results = []
        for i, device in enumerate(ext.worker_devices):
            ctx = ValueContext(ext._worker_index * local + i, ext._num_replicas_in_sync)
            results.append(map_structure(lambda x: _place_arrays(x, device), value_fn(ctx)))
        return regroup(results, always_wrap=True, devices=ext.worker_devices)

    # TF 1.x names that TF 2's strategies keep (deprecated there): one step from an iterator, session config

    def experimental_run(self, fn, input_iterator=None):
        """Run ``fn`` on every replica, with the next element of ``input_iterator`` as its argument if given."""
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(input_iterator.get_next(),))

    def make_dataset_iterator(self, dataset):
        """An iterator whose elements are the batches of ``dataset`` split over the replicas."""
        from .input_lib import DatasetIterator, DistributedDataset

        return DatasetIterator(DistributedDataset(dataset, self.extended))

    def make_input_fn_iterator(self, input_fn, replication_mode=InputReplicationMode.PER_WORKER):
        """An iterator over ``input_fn(InputContext)``'s per-replica batches (one per replica per step)."""
        if replication_mode != InputReplicationMode.PER_WORKER:
            raise ValueError(f"replication_mode={replication_mode!r}: only InputReplicationMode.PER_WORKER is "
                             "supported here (use distribute_datasets_from_function for PER_REPLICA)")
        from .input_lib import DatasetIterator, DistributedDatasetsFromFunction

        return DatasetIterator(DistributedDatasetsFromFunction(input_fn, self.extended))

    def update_config_proto(self, config_proto):
        """A copy of ``config_proto`` (the strategies here need no session settings)."""
        return copy.deepcopy(config_proto)

    def unwrap(self, value) -> tuple:
        """Deprecated TF 1.x name of ``experimental_local_results``."""
        return self.experimental_local_results(value)

    def group(self, value, name=None):
        """TF's: a single local result (without ``name``) is returned as it is; else a ``tf.group`` of them,
        which eagerly is None (the results are computed already)."""
        results = flatten(self.experimental_local_results(value))
        return results[0] if len(results) == 1 and name is None else None

    def colocate_vars_with(self, colocate_with_variable):
        return self.extended.colocate_vars_with(colocate_with_variable)

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None):
        """Keep ``session_config``; a strategy here takes its cluster when it is built, not from here."""
        if cluster_spec:
            raise ValueError("cluster_spec: a strategy takes its cluster when it is built; use "
                             "md.MultiWorkerMirroredStrategy with TF_CONFIG (or cluster_resolver=...) for a cluster")
        self._session_config = session_config


def _place_arrays(x, device):
    # Scalars stay as they are (TF leaves Python numbers alone); arrays go to the replica's device.
    if x is None or isinstance(x, (int, float, bool, complex, str, np.generic)):
        return x
    if type(x) is IndexedSlices:
        return map_arrays(lambda a: device_util.place(a, device), x)
    return device_util.place(x, device)


def _as_tf_mean(value, mean):
    """The mean of ``value``'s components in TF's dtype: the collectives divide integers in float64 (NumPy's
    rule); TF divides integers of up to 16 bits in float32."""
    if isinstance(value, DistributedValues) and getattr(mean, "dtype", None) == np.float64:
        dtype = getattr(_read(value.values[0]), "dtype", None)
        if dtype is not None and np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize <= 2:
            return mean.astype(np.float32)
    return mean


def _divide(numer, denom):
    """TensorFlow's ``truediv(numer, cast(denom, numer.dtype))``: integers divide in float32 up to 16 bits,
    in float64 beyond; floats keep their dtype. ``denom`` is a count on the host; a GPU ``numer`` (a reduce
    inside md.function's capture) is divided on its GPU, by a scalar: nothing waits for the GPU."""
    if not device_util.on_gpu(numer):
        numer = np.asarray(numer)
    denom = np.asarray(denom).astype(numer.dtype)[()]
    with np.errstate(invalid="ignore", divide="ignore"):  # no rows at all: NaN, as TF's 0 / 0, no warning
        if numer.dtype.kind in "iu":
            real = np.float32 if numer.dtype.itemsize <= 2 else np.float64
            return numer.astype(real) / real(denom)
        return numer / denom


# --- extended ------------------------------------------------------------------------------


class StrategyExtended:
    """Operations on distributed values for code that needs more than ``Strategy`` offers.

    Subclasses implement ``_call_for_each_replica``, ``_reduce_to``,
    ``_batch_reduce_to``, ``_broadcast_to``, ``_gather_to``, ``_update`` and
    ``_create_variable``. ``_num_workers``/``_worker_index`` describe the job:
    one worker here, more in MultiWorkerMirroredStrategy.
    """

    _num_workers = 1
    _worker_index = 0

    def __init__(self, container_strategy: Strategy, devices):
        # Weak, as TF's: a strong reference would make strategy <-> extended a
        # cycle, and a dropped strategy (with its replica threads) would live
        # until the garbage collector ran.
        self._container_strategy_weakref = weakref.ref(container_strategy)
        self._local_devices = tuple(devices)

    @property
    def _container_strategy(self) -> Strategy:
        return self._container_strategy_weakref()

    @property
    def _num_replicas_in_sync(self) -> int:
        return self._num_workers * len(self._local_devices)

    @property
    def worker_devices(self) -> tuple:
        return self._local_devices

    @property
    def worker_devices_by_replica(self) -> list:
        """Each replica's devices: one device per replica here (TF's list of lists)."""
        return [[d] for d in self.worker_devices]

    def non_slot_devices(self, var_list) -> tuple:
        """Where variables that are not slots of ``var_list`` live: every replica's device."""
        return tuple(self.worker_devices)

    def read_var(self, var):
        """``var``'s value in cross-replica context (an ON_READ variable's aggregate)."""
        return var.read_value()

    # (TF's flag for input pipelines that may end with a partial batch: the input here always handles them)
    experimental_enable_get_next_as_optional = True
    # Whether distribute_datasets_from_function makes a pipeline per replica under InputReplicationMode.PER_REPLICA
    # (TF's CentralStorageStrategy makes one per worker whatever the mode).
    _per_replica_pipelines = True

    def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
        """``fn(*args, **kwargs)`` once per device of ``colocate_with`` (``non_slot_devices``' answer), each
        with its own components of distributed arguments; the results as one ``Mirrored`` value
        (``group=False``: a tuple of them)."""
        _require_cross_replica_or_default(self._container_strategy, "update_non_slot")
        devices, kwargs = tuple(colocate_with), dict(kwargs or {})
        results = []
        for i, device in enumerate(devices):
            with device_util.device_scope(device):
                results.append(fn(*select_replica(i, tuple(args)), **select_replica(i, kwargs)))
        regrouped = regroup(results, Mirrored, devices=devices)
        return regrouped if group else self._local_results(regrouped)

    def experimental_make_numpy_dataset(self, numpy_input):
        return self._container_strategy.experimental_make_numpy_dataset(numpy_input)

    @property
    def parameter_devices(self) -> tuple:
        return self._local_devices

    @property
    def experimental_between_graph(self) -> bool:
        return False

    @property
    def should_checkpoint(self) -> bool:
        return True

    @property
    def should_save_summary(self) -> bool:
        return True

    @property
    def experimental_should_init(self) -> bool:
        return True

    @property
    def experimental_require_static_shapes(self) -> bool:
        return False

    # public API: checks, then the subclass's implementation

    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduce ``value`` (distributed, or a nested structure of them) to ``destinations``; ``options``: this
        call's ``CommunicationOptions`` (merged over the strategy's)."""
        op = as_reduce_op(reduce_op)
        check_options(options)
        _require_cross_replica_or_default(self._container_strategy, "reduce_to")
        destinations = self._with_devices(destinations, "destinations")
        return map_structure(
            lambda v: self._reduce_to(op, self._with_devices(v, "value"), destinations, options), value)

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """Reduce several ``(value, destinations)`` pairs in one fused call; one result per pair (``options``: as
        :meth:`reduce_to`'s)."""
        op = as_reduce_op(reduce_op)
        if options is not None:  # (the hot path: None, the common case, is checked without a call)
            check_options(options)
        strategy = self._container_strategy
        top = _top()  # (the common cases, outside any scope or in this strategy's, checked without a call)
        if top is not _DEFAULT and (top.strategy is not strategy or top.replica_context is not None):
            _require_cross_replica_or_default(strategy, "batch_reduce_to")
        pairs = []
        for pair in value_destination_pairs if isinstance(value_destination_pairs, (list, tuple)) else (None,):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"value_destination_pairs={value_destination_pairs!r}: expected a list of "
                                 "(value, destinations) tuples")
            v, d = pair
            # (the same value twice, TF's usual call, is one object after _with_devices too)
            if isinstance(v, DistributedValues) and v._devices is None:
                v = self._with_devices(v, "value")
            pairs.append((v, v if d is pair[0] else self._with_devices(d, "destinations")))
        return self._batch_reduce_to(op, pairs, options)

    def broadcast_to(self, tensor, destinations):
        """``tensor`` copied to every device of ``destinations``."""
        _require_cross_replica_or_default(self._container_strategy, "broadcast_to")
        return self._broadcast_to(tensor, self._with_devices(destinations, "destinations"))

    def update(self, var, fn, args=(), kwargs=None, group: bool = True):
        """Run ``fn(copy, *args, **kwargs)`` on every copy of ``var``, with the args' matching components.

        In replica context this is a ``merge_call``: the replicas' arguments
        are merged first.
        """
        _check_call("update", fn, "fn", args, kwargs)
        kwargs = dict(kwargs or {})
        ctx = get_replica_context()
        if ctx is not None and ctx.strategy is self._container_strategy:
            return ctx.merge_call(lambda strategy, *a, **k: strategy.extended.update(var, fn, a, k, group),
                                  args=tuple(args), kwargs=kwargs)
        _require_cross_replica_or_default(self._container_strategy, "update")
        with self._container_strategy.scope():
            return self._update(var, fn, tuple(args), kwargs, group)

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        """Same as ``strategy.run(fn, args, kwargs)``."""
        return self._container_strategy.run(fn, args, kwargs)

    def colocate_vars_with(self, colocate_with_variable):
        """Scope in which new variables share ``colocate_with_variable``'s devices.

        Every variable of a mirrored strategy already lives on all replica
        devices, so this only checks that the variable belongs to this strategy.
        """
        owner = getattr(colocate_with_variable, "distribute_strategy", None)
        if owner is not self._container_strategy and not (
                self._container_strategy is _default_context().strategy and isinstance(colocate_with_variable,
                                                                                       DeviceVariable)):
            raise ValueError("`colocate_vars_with` must only be passed a variable created in this "
                             f"strategy's scope(), not {colocate_with_variable!r}")
        return contextlib.nullcontext()

    def variable_created_in_scope(self, v) -> bool:
        """Whether ``v`` was created in this strategy's scope."""
        return getattr(v, "distribute_strategy", None) is self._container_strategy

    def value_container(self, value):
        """The distributed variable that ``value`` is a copy of, else ``value``."""
        return value_container(value)

    def experimental_distribute_values_from_function(self, value_fn):
        return self._container_strategy.experimental_distribute_values_from_function(value_fn)

    # helpers shared by the strategies

    def _local_results(self, value) -> tuple:
        if isinstance(value, DistributedValues):
            return value.values
        if is_nested(value):
            # A structure: one per replica, as TF returns it (its plain leaves repeated on each), even where
            # none of its leaves is distributed; only a single plain value comes back once.
            return tuple(select_replica(i, value) for i in range(len(self._local_devices)))
        return (value,)

    def _native_replica_all_reduce(self, op, options):
        """``native(per_replica) -> per_replica results or None`` for a replica context's all_reduce that
        skips batch_reduce_to's wrapping, or None (the default: every all_reduce goes through it)."""
        return None

    def _capture_refusal(self) -> str | None:
        """Why md.function cannot capture this strategy's GPU step as CUDA graphs beyond where its replicas run
        (e.g. where its variables live), or None (the default: nothing more)."""
        return None

    def _sums_host_replicas_in_order(self) -> bool:
        """Whether a SUM batch_reduce_to of this strategy's replicas is, bit for bit, each element summed
        over the replicas in their order (``((r0 + r1) + r2) + ...``), all of them NumPy arrays in this
        process: then an optimizer may sum the replicas' gradients inside its fused update instead of
        all-reducing them first (optimizers/base.py, ``_Summands``). The default: no."""
        return False

    def _with_devices(self, value, argument: str):
        """``value`` with its replicas' devices known (a user-built PerReplica gets this worker's devices)."""
        if isinstance(value, DistributedValues) and value._devices is None:
            if len(value.values) != len(self._local_devices):
                raise ValueError(
                    f"{argument}: a {type(value).__name__} with {len(value.values)} components was given to a "
                    f"strategy with {len(self._local_devices)} local replicas; pass one component per replica")
            return type(value)(value.values, self._local_devices)
        return value

    def _reduce(self, op: ReduceOp, value):
        step = _gpu.step_scope()
        if step is not None and step.capturing:
            # Inside md.function's capture nothing may wait for the GPU: the result stays on the first
            # replica's GPU (an array the next replay overwrites, as a tf.function's output tensor is).
            result = self.reduce_to(op, value, self.worker_devices[0])
            return map_structure(lambda v: _read(self._local_results(v)[0]), result)
        result = self.reduce_to(op, value, HOST)
        # A Python number that comes back as it went in (MEAN of a non-distributed value) stays one, as in TF.
        return map_structure(lambda v: v if type(v) in (int, float) else
                             _to_host(_read(self._local_results(v)[0])), result)

    def _gather_to_host(self, value, axis):
        if not isinstance(value, DistributedValues):
            return value
        return device_util.to_host(self._local_results(self._gather_to(self._with_devices(value, "value"),
                                                                       HOST, axis, None))[0])

    def _make_initial_values_identical(self, value):
        """Hook: make every worker start from the same initial value (one worker: nothing to do)."""
        return value

    def _create_variable(self, initial_value=None, trainable=None, validate_shape=True, caching_device=None,
                         name=None, variable_def=None, dtype=None, import_scope=None, constraint=None,
                         synchronization=VariableSynchronization.AUTO, aggregation=VariableAggregation.NONE,
                         shape=None, experimental_enable_variable_lifting=True):
        """``md.Variable(...)``: ``tf.Variable``'s arguments in its positional order.

        ``name`` gets the current ``md.name_scope`` as prefix. ``trainable=None``
        means True unless ``synchronization`` is ON_READ. ``dtype`` converts the
        initial value as ``md.convert_to_tensor`` does (a Python float is no int).
        ``constraint`` (a callable of the variable's value) is kept as
        ``variable.constraint`` for optimizers, which apply it after their update
        in Keras; ``assign`` ignores it, as TensorFlow's does. ``caching_device``,
        ``import_scope`` (without ``variable_def``) and
        ``experimental_enable_variable_lifting`` have no effect, and neither has
        ``validate_shape=False``, as in eager TensorFlow (the variable keeps its
        initial shape). ``shape`` must be compatible with the initial value's;
        shapes with unknown dimensions are refused (variables here keep their
        shape), and so is ``variable_def`` (graph-mode protocol buffers).
        """
        _check_arguments(initial_value, trainable, variable_def, caching_device, constraint)
        if name is not None and not isinstance(name, str):  # (TF's words: "name for name_scope must be a string")
            raise ValueError(f"name={name!r}: the name of a variable must be a string, e.g. name='kernel'")
        name = scoped_name(name or "Variable")
        ctx = get_replica_context()
        if ctx is not None and ctx.strategy is self._container_strategy and ctx is not default_replica_context():
            # Created inside run: one variable for all replicas, made once in cross-replica context.
            return ctx.merge_call(lambda strategy: strategy.extended._create_variable_named(
                initial_value, trainable, name, dtype, constraint, synchronization, aggregation, shape))
        try:
            return self._create_variable_named(initial_value, trainable, name, dtype, constraint, synchronization,
                                               aggregation, shape)
        except MemoryError as error:  # its copies did not fit their GPUs: TF's ResourceExhaustedError
            _gpu.raise_if_out_of_memory(error, shape=getattr(initial_value, "shape", None),
                                        dtype=getattr(initial_value, "dtype", None))
            raise

    def _create_variable_named(self, initial_value, trainable, name, dtype, constraint, synchronization,
                               aggregation, shape):
        synchronization, aggregation, trainable = _check_variable_args(name, trainable, synchronization,
                                                                      aggregation)
        if callable(initial_value):
            initial_value = initial_value()
        if dtype is not None and not hasattr(initial_value, "dtype"):  # Python values: TF's conversions only
            initial_value = convert_to_tensor(initial_value, dtype=dtype)
        value = device_util.to_host(_read(initial_value))
        if dtype is not None:
            value = value.astype(np.dtype(dtype), copy=False)
        _check_shape(name, shape, value.shape)
        variable = self._make_variable(value, name, trainable, synchronization, aggregation)
        variable._constraint = constraint
        return variable

    def _make_variable(self, value, name, trainable, synchronization, aggregation):
        return DeviceVariable(value, f"{name}:0", HOST, trainable, synchronization, aggregation)


def _to_host(x):
    """A reduced value on the host: an array as NumPy, IndexedSlices as IndexedSlices of NumPy arrays."""
    return map_arrays(device_util.to_host, x) if type(x) is IndexedSlices else device_util.to_host(x)


def _check_call(api: str, fn, fn_arg: str, args=(), kwargs=None) -> None:
    """A TypeError naming the argument when ``fn`` is not callable, ``args`` not a sequence of arguments or
    ``kwargs`` not a mapping of keyword arguments (Python's own errors would name none of them)."""
    if not callable(fn):
        raise TypeError(f"{api}: {fn_arg}={fn!r} is not callable; pass a function (the function itself, not "
                        "the result of calling it)")
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"{api}: args={args!r}: pass the positional arguments as a tuple, e.g. args=(x,)")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{api}: kwargs={kwargs!r}: pass the keyword arguments as a dict, e.g. kwargs={{'x': x}}")


def _check_axis(axis, components) -> None:
    """A TypeError for an ``axis`` that is no int, then a ValueError naming ``axis`` and the rank when some
    component has no such axis (as TF refuses it); before the range, bool values, which TF's reduction kernels
    refuse before they look at the axis (the collectives' TypeError)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        # (TF: "Value passed to parameter 'reduction_indices' has DataType string not in list of allowed values")
        raise TypeError(f"axis={axis!r}: expected an int (a dimension of each replica's value) or None to "
                        "reduce across replicas only")
    for cs in components:
        for c in cs:
            if getattr(c, "dtype", None) == np.bool_:
                dtype_code(c.dtype, "value")
            ndim = len(np.shape(c))
            if not -ndim <= axis < ndim:
                valid = f"use {-ndim}..{ndim - 1}, or" if ndim else "a scalar has no axis: use"
                # (TF's words first: "Invalid reduction dimension 0 for input with 0 dimensions")
                raise ValueError(f"Invalid reduction dimension: axis={axis!r} is out of range for a value of rank "
                                 f"{ndim} (shape {tuple(np.shape(c))}); {valid} axis=None to reduce across "
                                 "replicas only")


def _reduce_along(v, op: ReduceOp, axis: int):
    """``v`` reduced along ``axis`` with ``op``; an empty slice (a replica with no rows of a
    partial batch) gives the op's identity, as TensorFlow's reduce_min/reduce_max do."""
    local = {ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max", ReduceOp.PROD: "prod"}[op]
    if op in (ReduceOp.SUM, ReduceOp.PROD):
        # In v's own dtype, wrapping around as TensorFlow's reduce_sum does (NumPy would widen small ints).
        return getattr(v, local)(axis=axis, dtype=v.dtype)
    if v.shape[axis]:
        return getattr(v, local)(axis=axis)
    dtype = np.dtype(v.dtype)
    info = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    identity = (np.inf if op is ReduceOp.MIN else -np.inf) if dtype.kind == "f" else \
        (info.max if op is ReduceOp.MIN else info.min)
    shape = tuple(d for k, d in enumerate(v.shape) if k != axis % v.ndim)
    if device_util.on_gpu(v):  # CuPy: the identity goes on v's own GPU
        import cupy

        with v.device:
            return cupy.full(shape, identity, dtype)
    return np.full(shape, identity, dtype)


def _check_arguments(initial_value, trainable, variable_def, caching_device, constraint) -> None:
    """Refuses the ``tf.Variable`` arguments that have no meaning here, naming each (TF's words first)."""
    if trainable is not None and not isinstance(trainable, (bool, np.bool_)):
        # Most likely a name given second, in the order md.Variable had before it took tf.Variable's.
        raise ValueError(f"trainable={trainable!r}: expected True, False or None; md.Variable takes tf.Variable's "
                         "order (initial_value, trainable, validate_shape, caching_device, name, ...): pass the "
                         "other arguments by keyword, e.g. md.Variable(x, name='w')")
    if variable_def is not None and initial_value is not None:
        raise ValueError(f"The variable_def and initial_value args to `tf.Variable` are mutually exclusive, but got "
                         f"both: variable_def={variable_def!r}, initial_value={initial_value!r:.80} (pass "
                         "initial_value only)")
    if variable_def is not None:
        raise ValueError(f"Creating a `tf.Variable` with a `variable_def` arg is not supported when eager execution "
                         f"is enabled. Got: variable_def={variable_def!r} (md.Variable has no graph protocol "
                         "buffers: pass initial_value)")
    if initial_value is None:
        raise ValueError("The `initial_value` arg to `tf.Variable` must be specified except when you are not "
                         "providing a `variable_def`. You provided neither. (pass the initial value: an array, a "
                         "number, or a callable that returns one)")
    if caching_device is not None and not isinstance(caching_device, str):
        raise ValueError(f"caching_device={caching_device!r}: expected a device string or None")
    if constraint is not None and not callable(constraint):
        raise ValueError(f"constraint={constraint!r}: Argument `constraint` must be None or a callable (a "
                         "function of the variable's value that returns the projected value)")


def _check_shape(name, shape, actual) -> None:
    """``shape=`` must be the initial value's (``None`` dimensions are unknown ones, which cannot change here)."""
    if shape is None:
        return
    try:
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    except TypeError:
        dims = None
    if dims is None or isinstance(shape, str) or not all(d is None or isinstance(d, (int, np.integer))
                                                         for d in dims):
        raise ValueError(f"shape={shape!r} for variable {name!r}: expected a tuple of ints")
    if None in dims or any(isinstance(d, (int, np.integer)) and d < 0 for d in dims):
        raise ValueError(f"shape={shape!r} for variable {name!r}: unknown dimensions are not supported (a "
                         f"variable keeps its initial shape {tuple(actual)}); pass the full shape or shape=None")
    if dims != tuple(actual):
        raise ValueError(f"In this `tf.Variable` creation, the initial value's shape ({tuple(actual)}) is not "
                         f"compatible with the explicitly supplied `shape` argument ({list(dims)}). (variable "
                         f"{name!r}: pass shape={tuple(actual)} or leave shape None)")


def _check_variable_args(name, trainable, synchronization, aggregation):
    if not isinstance(synchronization, VariableSynchronization):
        raise ValueError(f"synchronization={synchronization!r} for variable {name!r}: expected a "
                         "md.VariableSynchronization (AUTO, ON_WRITE, ON_READ or NONE)")
    if not isinstance(aggregation, VariableAggregation):
        raise ValueError(f"Invalid variable aggregation mode: {aggregation!r} for variable {name!r}; expected a "
                         "md.VariableAggregation (NONE, SUM, MEAN or ONLY_FIRST_REPLICA)")
    if trainable is None:  # (an explicit trainable=True with ON_READ stands, as in TF 2.x)
        trainable = synchronization != VariableSynchronization.ON_READ
    return synchronization, aggregation, trainable


# --- the default strategy ------------------------------------------------------------------


class _DefaultExtended(StrategyExtended):
    """No distribution: one replica on the host; reductions return their input."""

    def _call_for_each_replica(self, fn, args, kwargs):
        with _entered(_Context(self._container_strategy, default_replica_context())):
            return fn(*args, **kwargs)

    def _reduce_to(self, op, value, destinations, options):
        return value

    def _batch_reduce_to(self, op, pairs, options):
        return [v for v, _ in pairs]

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _gather_to(self, value, destinations, axis, options):
        return value

    def _update(self, var, fn, args, kwargs, group):
        return fn(var, *args, **kwargs)

    def variable_created_in_scope(self, v) -> bool:
        return isinstance(v, DeviceVariable) and v._distributed_container is None


class _DefaultDistributionStrategy(Strategy):  # (TF's class name: users print type(get_strategy()))
    def __init__(self):
        super().__init__(_DefaultExtended(self, (HOST,)))

    def __repr__(self) -> str:
        return "<mirrored default strategy>"


def _default_context() -> _Context:
    return _DEFAULT


def default_replica_context() -> ReplicaContext:
    return _DEFAULT.replica_context


def experimental_set_strategy(strategy) -> None:
    """Make ``strategy`` current on this thread without a ``with`` block (``tf.distribute``'s name); ``None``
    goes back to the default strategy. A strategy set earlier this way is replaced."""
    old = getattr(_local, "set_scope", None)
    if old is not None:
        _local.set_scope = None
        old.__exit__(None, None, None)
    if has_strategy():
        raise RuntimeError("Must not be called inside a `tf.distribute.Strategy` scope: leave the `with "
                           "strategy.scope()` block first")
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _local.set_scope = scope


_DefaultStrategy = _DefaultDistributionStrategy  # (the name train/ tests against)
_default_strategy = _DefaultDistributionStrategy()
_DEFAULT = _Context(_default_strategy, ReplicaContext(_default_strategy, 0))
set_default_context(_DEFAULT)


__all__ = [
    "Strategy", "StrategyExtended", "ReplicaContext", "get_strategy", "has_strategy",
    "in_cross_replica_context", "get_replica_context", "get_cross_replica_context", "experimental_set_strategy",
]
