"""Distributed datasets: batches split over the replicas and prefetched onto their devices.

A dataset is any iterable of batches: arrays, or nested tuples/lists/dicts of
arrays whose leading dimension is the global batch. A batch of ``b`` rows over
``N`` replicas (of all workers) gives replica ``i`` the rows
``[i*c, min((i+1)*c, b))`` with ``c = ceil(b / N)``, as TensorFlow 2.x does;
replicas past the end get empty slices that keep the trailing shape.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading

import numpy as np

from .. import _nest
from ..device import device_util
from .options import InputOptions, InputReplicationMode
from .values import regroup

_log = logging.getLogger("mirrored")


class InputContext:
    """What an input function needs to know to build this worker's pipeline."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    num_input_pipelines = property(lambda self: self._num_input_pipelines)
    input_pipeline_id = property(lambda self: self._input_pipeline_id)
    num_replicas_in_sync = property(lambda self: self._num_replicas_in_sync)

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; raises when it does not divide evenly."""
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                             f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}; pick a multiple of it")
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self) -> str:
        return f"tf.distribute.InputContext(input pipeline id {self._input_pipeline_id}, " \
               f"total: {self._num_input_pipelines})"


class ValueContext:
    """What ``experimental_distribute_values_from_function``'s ``value_fn`` gets: its replica."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    replica_id_in_sync_group = property(lambda self: self._replica_id_in_sync_group)
    num_replicas_in_sync = property(lambda self: self._num_replicas_in_sync)

    def __str__(self) -> str:
        return f"tf.distribute.ValueContext(replica id {self._replica_id_in_sync_group}, " \
               f"total replicas in sync: {self._num_replicas_in_sync})"


class TensorSpec:
    """Shape (``None`` for a batch dimension that varies) and dtype of one element leaf."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    def __eq__(self, other):
        return isinstance(other, TensorSpec) and (self.shape, self.dtype) == (other.shape, other.dtype)

    def __hash__(self):
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype.name}, name=None)"


class PerReplicaSpec:
    """The element spec of a ``PerReplica`` leaf: one spec per replica."""

    def __init__(self, *specs):
        self._specs = specs

    def __eq__(self, other):
        return isinstance(other, PerReplicaSpec) and self._specs == other._specs

    def __hash__(self):
        return hash(self._specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(map(repr, self._specs))})"


def split_batch(batch, num_global: int, first: int, count: int, argument: str = "dataset"):
    """Replicas ``first .. first+count-1`` of ``num_global``: each one's slice of every leaf of ``batch``."""
    leaves = [device_util.to_host(x) if not device_util.on_gpu(x) else x for x in _nest.flatten(batch)]
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"{argument}: every array of a batch needs the same leading (batch) dimension; got "
                         f"shapes {[tuple(leaf.shape) for leaf in leaves]}")
    b = sizes.pop()
    c = math.ceil(b / num_global)
    out = []
    for g in range(first, first + count):
        lo, hi = min(g * c, b), min((g + 1) * c, b)
        out.append(_nest.pack_sequence_as(batch, [leaf[lo:hi] for leaf in leaves]))
    return out


class _Prefetcher:
    """A background thread that keeps up to ``depth`` steps ready; errors surface on ``next``."""

    _END = object()

    def __init__(self, source, make_step, depth: int):
        self._queue = queue.Queue(maxsize=max(depth, 1))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source, make_step), daemon=True,
                                        name="mirrored-prefetch")
        self._thread.start()

    def _fill(self, source, make_step):
        try:
            for item in make_step(source):
                if not self._put(item):
                    return
        except BaseException as e:  # delivered to the consumer, in order
            self._put(_Failure(e))
            return
        self._put(self._END)

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self):
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)  # later calls stop too
            raise StopIteration
        if isinstance(item, _Failure):
            self._queue.put(self._END)
            raise item.error
        return item

    def close(self):
        self._closed.set()


class _Failure:
    def __init__(self, error):
        self.error = error


class DistributedIterator:
    """Iterator over a distributed dataset: each ``next`` is one step, ``PerReplica`` leaves."""

    def __init__(self, prefetcher: _Prefetcher, element_spec):
        self._prefetcher = prefetcher
        self._element_spec = element_spec

    def __iter__(self):
        return self

    def __next__(self):
        return self._prefetcher.next()

    def get_next(self):
        return next(self)

    def get_next_as_optional(self) -> "Optional":
        """The next element wrapped in an :class:`Optional` that is empty at the end of the data."""
        try:
            return Optional(next(self), True)
        except StopIteration:
            return Optional(None, False)

    @property
    def element_spec(self):
        return self._element_spec

    def __del__(self):
        self._prefetcher.close()


class Optional:
    """A value that may be absent (``tf.experimental.Optional``): ``has_value()``, ``get_value()``."""

    def __init__(self, value, has_value: bool):
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self):
        if not self._has_value:
            raise ValueError("this Optional has no value (the iterator is exhausted); check has_value() first")
        return self._value


class _DistributedInput:
    """Common to both dataset kinds: prefetching iterators and the element spec."""

    def __init__(self, extended, options):
        if options is not None and not isinstance(options, InputOptions):
            raise ValueError(f"options={options!r}: expected md.InputOptions or None")
        self._extended = extended
        self._options = options or InputOptions()
        self._first = None

    @property
    def _devices(self):
        return self._extended.worker_devices

    def _steps(self, source):
        """Yield each step's per-replica structures, as lists (one per local replica)."""
        raise NotImplementedError

    def _to_step(self, per_replica: list):
        if self._options.experimental_fetch_to_device is not False:
            per_replica = [_nest.map_structure(lambda x: device_util.place(x, d, copy=True), s)
                           for s, d in zip(per_replica, self._devices)]
        if len(per_replica) == 1:
            return per_replica[0]
        return regroup(per_replica, always_wrap=True, devices=self._devices)

    def _source(self):
        raise NotImplementedError

    def __iter__(self) -> DistributedIterator:
        depth = len(self._devices) * self._options.experimental_per_replica_buffer_size
        prefetcher = _Prefetcher(self._source(), lambda src: (self._to_step(s) for s in self._steps(src)), depth)
        return DistributedIterator(prefetcher, self._spec_or_none())

    def reduce(self, initial_state, reduce_func):
        """``reduce_func(state, element)`` folded over every element, starting from ``initial_state``."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def _spec_or_none(self):
        return None if self._first is None else self._spec(self._first)

    @property
    def element_spec(self):
        """Structure of ``TensorSpec`` (one replica) or ``PerReplicaSpec`` leaves, batch dimension ``None``."""
        if self._first is None:
            self._first = self._peek()
        return self._spec(self._first)

    def _spec(self, per_replica: list):
        def leaf_spec(x):
            x = device_util.to_host(x) if not device_util.on_gpu(x) else x
            return TensorSpec((None,) + tuple(x.shape[1:]), x.dtype)

        specs = [_nest.map_structure(leaf_spec, s) for s in per_replica]
        if len(specs) == 1:
            return specs[0]
        return _nest.pack_sequence_as(specs[0], [PerReplicaSpec(*leaves)
                                                 for leaves in zip(*(_nest.flatten(s) for s in specs))])

    def _peek(self):
        return next(iter(self._steps(self._source())))


class _Reiterable:
    """A dataset's items; a one-shot iterator is consumed once, with peeked items kept for later."""

    def __init__(self, dataset, argument: str):
        try:
            iter(dataset)
        except TypeError:
            raise TypeError(f"{argument}={dataset!r} is not iterable; pass an iterable of batches (a list, a "
                            "generator, a dataset object)") from None
        self._dataset = dataset
        self._argument = argument
        self._one_shot = iter(dataset) is dataset
        self._buffered = []
        self._exhausted = False  # a one-shot source ran to its end: another pass would be empty

    def __call__(self):
        if not self._one_shot:
            return iter(self._dataset)
        if self._exhausted and not self._buffered:
            raise ValueError(
                f"{self._argument} is a one-shot iterator ({type(self._dataset).__name__}) that an earlier pass "
                "consumed to its end, so this pass would yield no batch; pass something iterable again "
                "(a list, or an object whose __iter__ returns a fresh iterator, e.g. a class wrapping the "
                "generator function), or distribute a new generator for every epoch")
        buffered, self._buffered = self._buffered, []
        return self._track(itertools.chain(buffered, self._dataset))

    def _track(self, items):
        yield from items
        self._exhausted = True

    def peek(self, count: int) -> list:
        """The first ``count`` items (fewer at the end), still there for the next iteration."""
        if not self._one_shot:
            return list(itertools.islice(iter(self._dataset), count))
        # Read the source directly: closing a generator that delegates to it would close it too.
        more = list(itertools.islice(self._dataset, max(count - len(self._buffered), 0)))
        self._buffered.extend(more)
        return self._buffered[:count]


class DistributedDataset(_DistributedInput):
    """``strategy.experimental_distribute_dataset(dataset)``: each global batch split over the replicas."""

    def __init__(self, dataset, extended, options=None):
        super().__init__(extended, options)
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in "
                                      "distribute_datasets_from_function")
        self._items = _Reiterable(dataset, "dataset")
        self._policy = self._shard_policy(dataset)

    def _shard_policy(self, dataset):
        """DATA, FILE or OFF: how this worker takes its share of ``dataset`` (see md.data)."""
        from ..data import AutoShardPolicy, policy_of

        policy = policy_of(dataset)
        if self._extended._num_workers == 1:
            return AutoShardPolicy.DATA  # one worker: every policy splits each batch over its replicas
        files = getattr(dataset, "files", None)
        if policy == AutoShardPolicy.AUTO:
            if files:
                return AutoShardPolicy.FILE
            # TensorFlow's words (its auto-shard rewrite logs them when it falls back).
            _log.warning("AUTO sharding policy will apply DATA sharding policy as it failed to apply FILE sharding "
                         "policy because of the following reason: Found an unshardable source dataset: %s",
                         type(dataset).__name__)
            return AutoShardPolicy.DATA
        if policy == AutoShardPolicy.FILE:
            inner = getattr(dataset, "_iterable", dataset)  # md.data.Dataset wraps the iterable
            count = len(files) if files is not None else (len(inner) if isinstance(inner, (list, tuple)) else None)
            if count is not None and count < self._extended._num_workers:
                raise ValueError(
                    f"dataset: AutoShardPolicy.FILE needs at least as many files (items) as workers; it has {count} "
                    f"for {self._extended._num_workers} workers: use AutoShardPolicy.DATA or OFF")
        if policy == AutoShardPolicy.HINT:
            return AutoShardPolicy.DATA
        return policy

    def _source(self):
        return self._items()

    def _steps(self, source):
        from ..data import AutoShardPolicy

        ext = self._extended
        local, workers, total = len(ext.worker_devices), ext._num_workers, ext._num_replicas_in_sync
        if self._policy == AutoShardPolicy.DATA:
            for batch in source:
                yield split_batch(batch, total, ext._worker_index * local, local)
            return
        # FILE and OFF: this worker splits each batch it reads over all N replicas and runs the
        # N per-replica batches L at a time, so every worker takes the same number of steps.
        for batch in self._worker_items(source, workers, ext._worker_index):
            parts = split_batch(batch, total, 0, total)
            for first in range(0, total, local):
                yield parts[first:first + local]

    def _worker_items(self, source, workers: int, index: int):
        from ..data import AutoShardPolicy

        if self._policy == AutoShardPolicy.OFF:
            yield from source
            return
        while True:  # FILE: item `index` of every round of `workers` items
            round_ = list(itertools.islice(source, workers))
            if not round_:
                return
            yield round_[index] if index < len(round_) else _nest.map_structure(
                lambda x: device_util.to_host(x)[:0], round_[0])
            if len(round_) < workers:
                return

    def _peek(self):
        first = self._items.peek(1)
        if not first:
            raise ValueError("dataset is empty: element_spec needs at least one batch")
        return next(self._steps(iter(first)))


class DistributedDatasetsFromFunction(_DistributedInput):
    """``strategy.distribute_datasets_from_function(dataset_fn)``: each replica takes one batch per step."""

    def __init__(self, dataset_fn, extended, options=None):
        super().__init__(extended, options)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn={dataset_fn!r} is not callable; pass a function of an md.InputContext "
                            "that returns an iterable of per-replica batches")
        local = len(extended.worker_devices)
        total = extended._num_replicas_in_sync
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            first = extended._worker_index * local
            self._pipelines = [_Reiterable(dataset_fn(InputContext(total, first + i, total)), "dataset_fn()")
                               for i in range(local)]
        else:
            self._pipelines = [_Reiterable(dataset_fn(InputContext(extended._num_workers, extended._worker_index,
                                                                   total)), "dataset_fn()")]

    def _source(self):
        return [p() for p in self._pipelines]

    def _steps(self, sources):
        local = len(self._devices)
        if len(sources) == local and local > 1:  # one pipeline per replica
            for step in zip(*sources):
                yield list(step)
            return
        source = sources[0]
        while True:
            step = []
            for item in source:
                step.append(item)
                if len(step) == local:
                    break
            if not step:
                return
            # A short last step: the replicas without data get empty batches of the same trailing shape.
            empty = _nest.map_structure(lambda x: device_util.to_host(x)[:0], step[-1])
            yield step + [empty] * (local - len(step))
            if len(step) < local:
                return

    def _peek(self):
        # Take the first step's items, and keep them for one-shot pipelines so no batch is lost.
        take = len(self._devices) if len(self._pipelines) == 1 else 1
        step = next(self._steps([iter(p.peek(take)) for p in self._pipelines]), None)
        if step is None:
            raise ValueError("dataset_fn() returned an empty dataset: element_spec needs at least one batch")
        return step
