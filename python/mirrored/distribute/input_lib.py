"""Distributed datasets: batches split over the replicas and prefetched onto their devices.

A dataset is any iterable of batches: arrays, or nested tuples/lists/dicts of arrays whose leading dimension is
the global batch. TensorFlow 2.21 splits a batch over the ``N`` replicas (of all workers) in one of two ways,
and so do we (docs/datasets_split.md): into ``batch_sizes_for_worker``'s even sizes, over the stream of rows,
where it finds the pipeline's batch size and no DATA sharding rewrites that; else ``c = ceil(b / N)`` rows per
replica from the first on (``split_batch``). Replicas past the end get empty slices that keep the trailing shape.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import threading

import numpy as np

from .._nest import flatten, map_structure, pack_sequence_as
from ..data import dataset_ops
from ..data.dataset_ops import CountingIterator, Dataset, PrefetchIterator, _Iterator
from ..data.iterator_ops import IteratorProtocol, Optional
from ..data.options import AutoShardPolicy, policy_of
from ..data.structure import TensorSpec, decode_state, encode_state, leaf_spec
from ..device import device_util, gpu
from .options import InputOptions, InputReplicationMode
from .values import DistributedValues, regroup, select_replica

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
        if isinstance(global_batch_size, (bool, np.bool_)) or not isinstance(global_batch_size, (int, float,
                                                                                                 np.number)):
            raise TypeError(f"global_batch_size={global_batch_size!r}: expected a number of examples, e.g. 64")
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


def split_batch(batch, num_global: int, first: int, count: int, argument: str = "dataset"):
    """Replicas ``first .. first+count-1`` of ``num_global``: each one's slice of every leaf of ``batch``, by the
    rule of TF's legacy rebatch (``c = ceil(b / num_global)`` rows each, from the first replica on)."""
    leaves = _host_leaves(batch)
    if num_global == 1:  # one replica takes each element as it is, batched or not (TF's rule)
        return [pack_sequence_as(batch, leaves)]
    b = _batch_rows(leaves, argument)
    c = math.ceil(b / num_global)
    return [pack_sequence_as(batch, [leaf[min(g * c, b):min((g + 1) * c, b)] for leaf in leaves])
            for g in range(first, first + count)]


def _host_leaves(batch) -> list:
    return [device_util.to_host(x) if not device_util.on_gpu(x) else x for x in flatten(batch)]


def _batch_rows(leaves, argument: str) -> int:
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"{argument}: every array of a batch needs the same leading (batch) dimension; got "
                         f"shapes {[tuple(leaf.shape) for leaf in leaves]}")
    return sizes.pop()


def batch_sizes_for_worker(global_batch_size: int, num_workers: int, num_replicas_per_worker: int,
                           worker_index: int) -> list:
    """TF's rebatch sizes for worker ``worker_index``: the N = W*L per-replica batches of a global batch of
    ``global_batch_size`` differ by at most one row, the larger first, and worker ``w`` starts ``w*L`` batches
    into that list, so each step's L batches of all workers add up to the global batch."""
    total = num_workers * num_replicas_per_worker
    floor, larger = divmod(global_batch_size, total)
    sizes = [floor + 1] * larger + [floor] * (total - larger)
    offset = worker_index * num_replicas_per_worker
    return sizes[offset:] + sizes[:offset]


def emitted_batches(rows: int, sizes) -> int:
    """How many of the per-replica batches of ``sizes`` a stream of ``rows`` rows gives (TF's rebatch stops at
    the first batch that needs a row past the end; a batch of 0 rows is given while the end is not reached)."""
    offset = 0
    for j, size in enumerate(sizes):
        if offset > rows or (offset == rows and size > 0):
            return j
        offset += size
    return len(sizes)


# tf.data's compute_batch_size walks up through these transformations: they keep their input's batches.
_BATCH_KEEPING = (dataset_ops._Filter, dataset_ops._Shuffle, dataset_ops._Repeat, dataset_ops._Take,
                  dataset_ops._Skip, dataset_ops._Cache, dataset_ops._Prefetch, dataset_ops._Shard)


def compute_batch_size(dataset) -> int:
    """tf.data's ``compute_batch_size``: the batch size of a pipeline's batches, a short last batch aside, or -1
    where it cannot tell (no ``batch`` found walking up through transformations that keep batches, or inputs of
    ``zip``/``concatenate`` batched differently). A fixed batch dimension shared by every component wins."""
    dims = {spec.shape[0] if spec.shape.rank else None for spec in flatten(dataset.element_spec)}
    if None not in dims:
        return dims.pop() if len(dims) == 1 else -1
    return _batch_size_upstream(dataset)


def _batch_size_upstream(dataset) -> int:
    if isinstance(dataset, dataset_ops._Batch):
        return -1 if dataset._parallel else dataset._batch_size
    if isinstance(dataset, (dataset_ops._Zip, dataset_ops._Concatenate)):
        sizes = {_batch_size_upstream(d) for d in dataset._inputs}
        return sizes.pop() if len(sizes) == 1 else -1
    if type(dataset) in _BATCH_KEEPING:
        return _batch_size_upstream(dataset._input)
    return -1


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


class _StepIterator(_Iterator):
    """Source items -> steps, as ``(item, k)``: step ``k`` of the ``count(item)`` steps the item makes (FILE and
    OFF sharding make several of one batch). The split itself happens later, in the prefetch thread, so what is
    buffered and saved is the same on every worker (the source's items), whichever worker's checkpoint is
    restored.

    The state is the source's, the item being split and how many of its steps were taken, so a restored
    iterator continues with the step that followed the save.
    """

    def __init__(self, source: _Iterator, count, state=None):
        super().__init__(source)
        self._count = count
        self._item, self._taken = (None, None) if state is None or state["item"] is None else \
            (state["item"], state["taken"])

    def next(self):
        while self._item is None or self._taken >= self._count(self._item):
            self._item, self._taken = self._inputs[0].next(), 0
        self._taken += 1
        return (self._item, self._taken - 1)

    def save(self):
        return {"source": self._inputs[0].save(), "item": self._item, "taken": self._taken}


class _PythonSource(CountingIterator):
    """A plain Python iterable's items; its position is the count taken (a restore iterates afresh and skips)."""

    def __init__(self, items: "_Reiterable", count: int = 0):
        it = items()
        if count and items._one_shot:
            raise ValueError(f"cannot restore a position in {items._argument}: it is a one-shot iterator; pass an "
                             "md.data.Dataset or a re-iterable (a list) to checkpoint the iterator")
        super().__init__(it, count)


def _source_iterator(items, state=None) -> _Iterator:
    """An iterator over ``items`` (an md.data.Dataset or a ``_Reiterable``) that can save its position."""
    if isinstance(items, Dataset):
        return items._make_iterator(state)
    return _PythonSource(items, 0 if state is None else state["count"])


class _FileRounds(_Iterator):
    """FILE sharding of a plain iterable: item ``index`` of every round of ``workers`` items (an empty batch
    for a worker short of an item in the last round)."""

    def __init__(self, source: _Iterator, workers: int, index: int, state=None):
        super().__init__(source)
        self._workers, self._index = workers, index
        self._done = False if state is None else state["done"]

    def next(self):
        if self._done:
            raise StopIteration
        round_ = []
        for _ in range(self._workers):
            try:
                round_.append(self._inputs[0].next())
            except StopIteration:
                self._done = True
                break
        if not round_:
            raise StopIteration
        if self._index < len(round_):
            return round_[self._index]
        return map_structure(lambda x: device_util.to_host(x)[:0], round_[0])

    def save(self):
        return {"source": self._inputs[0].save(), "done": self._done}


class _ShardedSteps(_Iterator):
    """``auto_shard``: the replicas' batches in the order the replicas take them (step by step, replica by
    replica), the ``shard_ix``-th of every ``num_shards`` kept (each pair of ``shards`` in turn), dealt to the
    local replicas again; a short last step gets empty batches (or ends the input where ``partial`` is False)."""

    def __init__(self, steps: _StepIterator, split, local: int, shards: tuple, partial: bool, state=None):
        super().__init__(steps)
        self._split, self._local, self._shards, self._partial = split, local, shards, partial
        self._pending, self._count = ([], 0) if state is None else (list(state["pending"]), state["count"])

    def _kept(self, position: int) -> bool:
        for num_shards, shard_ix in self._shards:
            if position % num_shards != shard_ix:
                return False
            position //= num_shards
        return True

    def next(self):
        step = []
        while len(step) < self._local:
            if not self._pending:
                try:
                    self._pending = list(self._split(self._inputs[0].next()))
                except StopIteration:
                    break
            batch, self._count = self._pending.pop(0), self._count + 1
            if self._kept(self._count - 1):
                step.append(batch)
        if not step or (len(step) < self._local and not self._partial):
            raise StopIteration
        empty = map_structure(lambda x: device_util.to_host(x)[:0], step[-1])
        return step + [empty] * (self._local - len(step))

    def save(self):
        return {"source": self._inputs[0].save(), "pending": self._pending, "count": self._count}


class _ShortRound(list):
    """A step's items from the pipelines, fewer than the replicas, where padding them is off (see
    _pads_short_steps): ``next()`` ends there, ``get_next_as_optional()`` still gives it, padded."""


class _ShortStep:
    def __init__(self, value):
        self.value = value


class _UnbufferedSteps(_Iterator):
    """``experimental_per_replica_buffer_size=0``: no prefetching, each step is prepared when it is asked for.
    Saves as the prefetching iterator does, with nothing buffered."""

    def __init__(self, steps: _Iterator, transform):
        super().__init__(steps)
        self._transform = transform

    def next(self):
        return self._transform(self._inputs[0].next())

    def save(self):
        return {"input": self._inputs[0].save(), "buffer": []}


class _DeviceFetcher:
    """Copies each replica's batch onto its device; runs in the prefetch thread, one step ahead of training.

    Host-to-GPU copies are asynchronous: staged in pinned host memory and issued on a side stream of each
    GPU, so they overlap the replicas' kernels on their own streams; the prefetch thread waits for its stream
    before the step is handed over, so training never sees a batch still in flight.
    """

    def __init__(self, devices):
        self._devices = devices
        self._gpu = [device_util.is_gpu(d) for d in devices]
        self._streams = {}

    def __call__(self, per_replica: list) -> list:
        if not any(self._gpu):
            return [map_structure(lambda x: device_util.place(x, d, copy=True), s)
                    for s, d in zip(per_replica, self._devices)]
        import cupy

        out, staged = [], []
        for structure, device, gpu in zip(per_replica, self._devices, self._gpu):
            if not gpu:
                out.append(map_structure(lambda x: device_util.place(x, device, copy=True), structure))
                continue
            ordinal = device_util._gpu_ordinal(device_util.parse(device))
            with cupy.cuda.Device(ordinal):
                stream = self._streams.get(ordinal)
                if stream is None:
                    stream = self._streams[ordinal] = cupy.cuda.Stream(non_blocking=True)
                out.append(map_structure(lambda x: self._copy(x, stream, staged), structure))
        for ordinal, stream in self._streams.items():
            with cupy.cuda.Device(ordinal):
                stream.synchronize()
        return out

    @staticmethod
    def _copy(x, stream, staged: list):
        import cupy

        if device_util.on_gpu(x):
            stream.wait_event(device_util.written_event(cupy, x))  # (x's producer may be on another stream)
            with stream:
                return cupy.array(x, copy=True)
        if isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "SO":
            return x  # strings stay on the host as they are, as TF keeps string tensors off GPUs
        host = device_util.to_host(x)
        memory = cupy.cuda.alloc_pinned_memory(host.nbytes)
        pinned = np.frombuffer(memory, host.dtype, host.size).reshape(host.shape)
        pinned[...] = host
        staged.append(memory)  # alive until the stream is synchronised
        out = cupy.empty(host.shape, host.dtype)
        out.set(pinned, stream=stream)
        return out


class DatasetIterator:
    """TF 1.x input iterator: ``initialize()`` then ``get_next()`` once per step."""

    def __init__(self, distributed):
        self._distributed = distributed
        self._iterator = None

    def initialize(self) -> list:
        """(Re)start from the first batch; returns the (empty, eager) list of initializer ops."""
        self._iterator = iter(self._distributed)
        return []

    def get_next(self):
        if self._iterator is None:
            self.initialize()
        return next(self._iterator)

    @property
    def element_spec(self):
        return self._distributed.element_spec


_function_body = threading.local()


@contextlib.contextmanager
def function_body():
    """While an md.function's Python body runs in this thread. TF's autograph turns a ``for`` loop over a
    distributed dataset or iterator inside a tf.function into a loop on ``get_next_as_optional``: such a loop
    then takes the short last step (the missing replicas padded) that ``next()`` ends the input on."""
    # (A count, not a saved value: replica steps may enter and leave interleaved on one thread.)
    _function_body.depth = getattr(_function_body, "depth", 0) + 1
    try:
        yield
    finally:
        _function_body.depth -= 1


class _FunctionLoop:
    """``for x in iterator`` inside an md.function: the steps of ``get_next_as_optional`` until it is empty."""

    def __init__(self, iterator):
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        optional = self._iterator.get_next_as_optional()
        if not optional.has_value():
            raise StopIteration
        return optional.get_value()


class DistributedIterator(IteratorProtocol):
    """Iterator over a distributed dataset: each ``next`` is one step, ``PerReplica`` leaves.

    A background thread prepares the next steps (split, copied onto the replicas' devices). It is
    checkpointable: ``md.train.Checkpoint(iterator=it)`` saves the position of the dataset's pipeline, the
    steps prepared but not taken included, and a restore continues with the step that followed the save.
    """

    _last = None  # the latest step taken (the template of an empty one)

    def __init__(self, distributed, state=None):
        super().__init__(distributed, distributed._build(state))

    def _next_step(self):
        """The next step. Where each worker reads its own input (FILE sharding, one pipeline per worker) the
        workers agree on the end, as TF's get_next_as_optional does across workers: while any of them has a
        step, one that has run out takes a step of empty batches, so every worker runs the same steps (and
        the same collectives)."""
        if not self._dataset._agrees_on_end():
            return IteratorProtocol.__next__(self)
        try:
            step = IteratorProtocol.__next__(self)
        except StopIteration:
            step = None
        if not self._dataset._any_worker_has(step is not None):
            raise StopIteration
        if step is None:
            return self._dataset._empty_step(self._last)
        self._last = step
        return step

    def __next__(self):
        try:
            step = self._next_step()
        except MemoryError as error:  # a step placed on GPUs without room: TF's ResourceExhaustedError
            gpu.raise_if_out_of_memory(error)
            raise
        if isinstance(step, _ShortStep):  # (see get_next_as_optional)
            self._end()
            raise StopIteration
        return step

    next = __next__

    def __iter__(self):
        return _FunctionLoop(self) if getattr(_function_body, "depth", 0) else self

    def get_next_as_optional(self) -> Optional:
        """The next step wrapped in an :class:`Optional`, empty at the end. Where a short last step ends
        ``next()`` (TF turns its padding off for inputs of fixed shapes), this still gives that step, the
        missing replicas' batches empty, as TF's does."""
        try:
            step = self._next_step()
        except StopIteration:
            return Optional(None, False, lambda: self.element_spec)
        if isinstance(step, _ShortStep):
            self._end()
            step = step.value
        return Optional(step, True, lambda: self._spec_of(step))

    def _end(self):
        self._done = True
        self._source.close()

    @staticmethod
    def _spec_of(element):
        return map_structure(lambda x: PerReplicaSpec(*(leaf_spec(c) for c in x.values))
                             if isinstance(x, DistributedValues) else leaf_spec(x), element)

    def _serialize_to_tensors(self) -> dict:
        return encode_state(self._dataset._check_checkpointable(self._source.save()))

    def _restore_from_tensors(self, tensors: dict) -> None:
        state = decode_state(tensors)
        self._source.close()
        self._source, self._done = self._dataset._build(state), False


def _dummy(x):
    host = device_util.to_host(x)
    return np.zeros((), host.dtype) if np.ndim(host) == 0 else host[:0]


class _DistributedInput:
    """Common to both dataset kinds: prefetching iterators and the element spec."""

    # (num_shards, shard_ix) of each auto_shard that made this input, the first first
    _shards = ()

    def __init__(self, extended, options):
        if options is not None and not isinstance(options, InputOptions):
            raise ValueError(f"options={options!r}: expected md.InputOptions or None")
        self._extended = extended
        self._options = options or InputOptions()
        self._first = None
        self._fetcher = None

    def _refuse_build(self):
        # TF's `assert not self._built`: its MirroredStrategy-family strategies build the input when they make
        # it; only ParameterServerStrategy makes one unbuilt, for ClusterCoordinator.create_per_worker_dataset.
        raise AssertionError(f"{type(self).__name__}.build(): the input is already built (the strategy builds it "
                             "when it distributes the dataset); iterate it as it is")

    def auto_shard(self, num_shards, shard_ix):
        """TF's ``auto_shard``: an input of the same class reading shard ``shard_ix`` of ``num_shards``, by the
        dataset's AutoShardPolicy as tf.data's auto-sharding reads it: its files (FILE, or AUTO over enough
        files), its batches (DATA, or AUTO otherwise), or all of it (OFF). The element spec stays the parent's."""
        for argument, value in (("num_shards", num_shards), ("shard_ix", shard_ix)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{argument}={value!r}: expected an int")
        if num_shards < 1:
            raise ValueError(f"num_shards={num_shards}: num_workers must be greater than zero (TF's words); pass "
                             "the number of shards, >= 1")
        if not 0 <= shard_ix < num_shards:
            raise ValueError(f"shard_ix={shard_ix}: index must be between 0 and {num_shards - 1} (TF's words), the "
                             f"shards of num_shards={num_shards}")
        sharded = copy.copy(self)
        sharded._first = sharded._fetcher = None
        sharded._shard(int(num_shards), int(shard_ix))
        return sharded

    def _shard(self, num_shards: int, shard_ix: int) -> None:
        """Makes this (new) copy read its shard (see auto_shard)."""
        raise NotImplementedError

    @property
    def _devices(self):
        return self._extended.worker_devices

    def _source(self, state=None) -> _Iterator:
        """The items this worker reads, as a checkpointable iterator."""
        raise NotImplementedError

    def _steps_of(self, item) -> list:
        """The steps (lists of per-replica structures, one per local replica) one source item makes."""
        raise NotImplementedError

    def _step_count(self, item) -> int:
        """How many steps ``item`` makes (see _steps_of)."""
        return 1

    def _to_step(self, per_replica: list):
        if self._options.experimental_fetch_to_device is not False:
            if self._fetcher is None:
                self._fetcher = _DeviceFetcher(self._devices)
            per_replica = self._fetcher(per_replica)
        if len(per_replica) == 1 and self._extended._num_workers == 1:
            return per_replica[0]
        # Across workers TF wraps even one local replica's batch: each is one replica's part of the step.
        return regroup(per_replica, always_wrap=True, devices=self._devices)

    def _build(self, state=None) -> PrefetchIterator:
        depth = len(self._devices) * self._options.experimental_per_replica_buffer_size
        saved = sharded = None if state is None else state["input"]
        if self._shards and saved is not None:
            saved = sharded["source"]  # (the step iterator's state, inside the sharding one's)
        steps = _StepIterator(self._source(None if saved is None else saved["source"]), self._step_count, saved)
        split = self._split_step
        if self._shards:
            steps = _ShardedSteps(steps, split, len(self._devices), self._shards,
                                  self._extended.experimental_enable_get_next_as_optional, sharded)
            split = list  # (already split)
        def transform(step):
            value = self._to_step(split(step))
            return _ShortStep(value) if isinstance(step[0], _ShortRound) else value

        if depth == 0:
            return _UnbufferedSteps(steps, transform)
        return PrefetchIterator(steps, depth, () if state is None else state["buffer"], transform=transform,
                                name="mirrored-prefetch")

    def _split_step(self, step) -> list:
        """``(item, k)`` of _StepIterator: the local replicas' batches of step ``k`` of the item."""
        return self._steps_of(step[0])[step[1]]

    def _check_checkpointable(self, state):
        """The chief writes the checkpoint and every worker restores it: the workers' states must agree."""
        if self._extended._num_workers > 1 and self._per_worker_input():
            raise ValueError(
                "iterator: each worker of this job reads different input (FILE sharding, or one pipeline per "
                "worker from distribute_datasets_from_function), but a checkpoint holds the chief's position "
                "only; checkpoint iterators of datasets sharded by AutoShardPolicy.DATA or OFF")
        return state

    def _per_worker_input(self) -> bool:
        return True

    def _agrees_on_end(self) -> bool:
        """Whether this worker's iterators agree with the other workers' on the end of the input (see
        DistributedIterator._next_step): where each reads its own input, and short steps are padded."""
        ext = self._extended
        return ext._num_workers > 1 and ext.experimental_enable_get_next_as_optional and \
            getattr(ext, "_group", None) is not None and self._per_worker_input()

    def _any_worker_has(self, have: bool) -> bool:
        flags = [np.array([int(have)], np.int32) for _ in self._devices]
        return bool(self._extended._group.all_reduce(flags, op="max")[0][0])

    def _empty_step(self, last):
        """A step of empty batches, each replica's of the trailing shape of ``last`` (a step taken before), or
        of the input's element spec where this worker took none (its unknown trailing dimensions 0)."""
        if last is not None:
            per_replica = [map_structure(lambda x: np.asarray(device_util.to_host(x))[:0], select_replica(i, last))
                           for i in range(len(self._devices))]
        else:
            specs = self._static_specs()
            if specs is None:
                raise ValueError("dataset: this worker's input ended before its first step while other workers "
                                 "go on, and its element spec is unknown, so it cannot make their empty batches; "
                                 "give every worker at least one batch (e.g. as many files as workers)")
            per_replica = [map_structure(lambda spec: np.zeros((0,) + tuple(d or 0 for d in tuple(spec.shape)[1:]),
                                                               spec.dtype), s) for s in specs]
        return self._to_step(per_replica)

    def __iter__(self) -> DistributedIterator:
        return iter(DistributedIterator(self))

    def reduce(self, initial_state, reduce_func):
        """``reduce_func(state, element)`` folded over every element, starting from ``initial_state``."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    @property
    def element_spec(self):
        """Structure of ``TensorSpec`` (one replica) or ``PerReplicaSpec`` leaves; the batch dimension is
        ``None`` unless every replica's batch has a known, fixed size (see :meth:`_static_batch`). A pipeline's
        spec is known without reading it; a plain iterable's is read from its first step."""
        specs = self._static_specs()
        if specs is None:
            if self._first is None:
                self._first = self._peek()
            batch = self._static_batch()
            specs = [map_structure(lambda x: TensorSpec((batch,) + tuple(_host_leaves(x)[0].shape[1:]), x.dtype), s)
                     for s in self._first]
        if self._extended._num_workers > 1 and self._extended.experimental_enable_get_next_as_optional:
            # TF's multi-worker rule: the workers pad a short step with empty batches, so no batch size is
            # fixed, and every leaf is a PerReplicaSpec, even of one local replica.
            specs = [map_structure(_dynamic_batch, s) for s in specs]
        elif len(specs) == 1:
            return specs[0]
        return pack_sequence_as(specs[0], [PerReplicaSpec(*leaves) for leaves in zip(*(flatten(s) for s in specs))])

    def _static_specs(self):
        """Each local replica's element spec where the input's element_spec gives it, else None."""
        return None

    def _static_batch(self):
        """The size of every replica's batch where it is fixed and known before reading, else None."""
        return None

    @property
    def cardinality(self) -> np.int64:
        """How many elements the input has (TF's: global batches; with distribute_datasets_from_function, the
        pipeline's own count), or ``md.data.INFINITE_CARDINALITY`` (-1) / ``UNKNOWN_CARDINALITY`` (-2)."""
        items = self._counted_input()
        if isinstance(items, _Reiterable):
            items = items._dataset
        if isinstance(items, Dataset):
            count = int(items.cardinality())
        else:
            count = len(items) if isinstance(items, (list, tuple)) else dataset_ops.UNKNOWN_CARDINALITY
        return np.int64(self._sharded_count(count) if self._shards and count >= 0 else count)

    def _counted_input(self):
        """The input whose elements :attr:`cardinality` counts."""
        raise NotImplementedError

    @staticmethod
    def _batch_of(dataset):
        """A pipeline's batch size where its element_spec fixes it (``batch(..., drop_remainder=True)``)."""
        if not _is_pipeline(dataset):
            return None
        sizes = {spec.shape[0] if spec.shape.rank else None for spec in flatten(dataset.element_spec)}
        return sizes.pop() if len(sizes) == 1 else None


def _dynamic_batch(spec):
    if spec.shape.rank is None or spec.shape.rank == 0:
        return spec
    return TensorSpec((None,) + tuple(spec.shape)[1:], spec.dtype)


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
        self._policy = self._shard_policy(dataset)
        if _is_pipeline(dataset) and extended._num_workers > 1 and self._policy != AutoShardPolicy.FILE \
                and any(isinstance(d, dataset_ops._Shuffle) and not d._seeded for d in dataset._pipeline()):
            _log.warning("dataset: every worker reads the whole dataset and keeps its slices of each batch, but "
                         "its shuffle has no seed, so the workers shuffle differently (examples are repeated or "
                         "missed, and a checkpointed iterator cannot be restored on every worker); pass "
                         "shuffle(..., seed=...)")
        self._sizes = None  # this worker's per-replica batch sizes where TF's rebatch cuts by size
        if _is_pipeline(dataset):
            if self._policy == AutoShardPolicy.FILE and extended._num_workers > 1:
                dataset = dataset._file_sharded(extended._num_workers, extended._worker_index)
            self._items = dataset
            self._cut_by_size(dataset)
        else:
            self._items = _Reiterable(dataset, "dataset")
        self._partial = _pads_short_steps(extended, dataset)

    def _cut_by_size(self, dataset) -> None:
        """TF rebatches a pipeline whose batch size it finds into the sizes of ``batch_sizes_for_worker``,
        a stream of per-replica batches that runs across the global batches; its DATA sharding (AUTO's
        fallback, and one worker's DATA and AUTO) rewrites that to the legacy split (see split_batch),
        which is also the split of a batch size it cannot find."""
        ext = self._extended
        local, total = len(ext.worker_devices), ext._num_replicas_in_sync
        if total == 1:
            return
        if any(spec.shape.rank == 0 for spec in flatten(dataset.element_spec)):
            # (TF fails here with the IndexError of reading a scalar's batch dimension)
            raise IndexError(f"dataset: its elements have scalar components ({dataset.element_spec}), which have no "
                             f"batch dimension to split over {total} replicas; batch the dataset first "
                             "(dataset.batch(global_batch_size))")
        if self._policy == AutoShardPolicy.DATA:
            return
        size = compute_batch_size(dataset)
        if size >= 0:
            self._global_batch = size
            self._sizes = batch_sizes_for_worker(size, ext._num_workers, local, ext._worker_index)

    def _shard_policy(self, dataset):
        """DATA, FILE or OFF: how this worker takes its share of ``dataset`` (see md.data)."""
        policy = policy_of(dataset)
        workers = self._extended._num_workers
        if workers == 1:
            # One worker reads everything. TF's DATA sharding (AUTO's too, over a pipeline without files) still
            # rewrites the strategy's rebatch into the legacy split; FILE, OFF and HINT leave it as it is.
            if policy == AutoShardPolicy.AUTO:
                has_files = _is_pipeline(dataset) and dataset._file_count() is not None
                return AutoShardPolicy.FILE if has_files else AutoShardPolicy.DATA
            return policy if policy in (AutoShardPolicy.DATA, AutoShardPolicy.FILE) else AutoShardPolicy.OFF
        if _is_pipeline(dataset):
            return _pipeline_policy(dataset, policy, workers)
        files = getattr(dataset, "files", None)
        if policy == AutoShardPolicy.AUTO:
            if files:
                return AutoShardPolicy.FILE
            _warn_data_fallback(f"Found an unshardable source dataset: {type(dataset).__name__}")
            return AutoShardPolicy.DATA
        if policy == AutoShardPolicy.FILE:
            inner = getattr(dataset, "_iterable", dataset)  # md.data.Dataset(iterable) wraps the iterable
            count = len(files) if files is not None else (len(inner) if isinstance(inner, (list, tuple)) else None)
            if count is not None and count < workers:
                raise ValueError(_too_few_files(count, workers))
        if policy == AutoShardPolicy.HINT:
            return AutoShardPolicy.OFF  # (see _pipeline_policy)
        return policy

    def _per_worker_input(self) -> bool:
        return self._policy == AutoShardPolicy.FILE

    def _source(self, state=None):
        if self._policy == AutoShardPolicy.FILE and not isinstance(self._items, Dataset):
            source = _source_iterator(self._items, None if state is None else state["source"])
            return _FileRounds(source, self._extended._num_workers, self._extended._worker_index, state)
        if self._sizes is not None:
            # The stream of per-replica batches, a global batch's rows at a time: the same on every worker.
            return _source_iterator(self._items.rebatch(self._global_batch), state)
        last = self._items
        while isinstance(last, dataset_ops._Prefetch):
            last = last._input
        if isinstance(last, dataset_ops._Rebatch) and self._extended._num_replicas_in_sync == 1 \
                and self._policy == AutoShardPolicy.DATA:
            # TF's DATA sharding turns the rebatch at the end of the pipeline (prefetches aside) into a legacy
            # rebatch over the replicas; with one replica, and no rebatch of the strategy's own, that is the
            # dataset's: its input batches come unsplit.
            return _source_iterator(last._input, state)
        return _source_iterator(self._items, state)

    def _step_count(self, item) -> int:
        ext = self._extended
        local, workers = len(ext.worker_devices), ext._num_workers
        if self._sizes is not None:
            rows = _batch_rows(_host_leaves(item), "dataset")
            if rows == self._global_batch:  # (all but the last: every worker's N batches, L a step)
                return workers
            if not self._partial:  # a step short of a batch ends the input
                return emitted_batches(rows, self._sizes) // local
            if self._agrees_on_end():
                # Each worker read its own rows (FILE): it takes the steps its own batches make, and its
                # iterators give empty ones while another worker still has a step (DistributedIterator).
                return math.ceil(emitted_batches(rows, self._sizes) / local)
            # Every worker takes a step while any of them has a batch for it.
            return max(math.ceil(emitted_batches(rows, batch_sizes_for_worker(self._global_batch, workers, local,
                                                                              w)) / local)
                       for w in range(workers))
        return 1 if self._policy == AutoShardPolicy.DATA else workers

    def _steps_of(self, batch):
        ext = self._extended
        local, total = len(ext.worker_devices), ext._num_replicas_in_sync
        if self._sizes is not None:
            return self._cut(batch)
        if self._policy == AutoShardPolicy.DATA:
            # TF's DATA sharding keeps every W-th of the N per-replica batches, from the worker's index on.
            return [split_batch(batch, total, 0, total)[ext._worker_index::ext._num_workers]]
        # FILE and OFF: this worker splits each batch it reads over all N replicas and runs the
        # N per-replica batches L at a time, so every worker takes the same number of steps.
        parts = split_batch(batch, total, 0, total)
        return [parts[first:first + local] for first in range(0, total, local)]

    def _cut(self, rows_of_batch):
        """A global batch's rows (or the last, fewer) cut in this worker's sizes, L per-replica batches a step;
        the batches past the end of the rows are empty, of the same trailing shape."""
        local = len(self._extended.worker_devices)
        leaves = _host_leaves(rows_of_batch)
        rows = _batch_rows(leaves, "dataset")
        given = emitted_batches(rows, self._sizes)
        bounds = np.cumsum([0] + self._sizes)
        parts = [pack_sequence_as(rows_of_batch, [leaf[min(bounds[j], rows):min(bounds[j + 1], rows)] if j < given
                                                  else leaf[:0] for leaf in leaves])
                 for j in range(len(self._sizes))]
        return [parts[first:first + local] for first in range(0, len(parts), local)][:self._step_count(rows_of_batch)]

    def build(self, dataset_to_replace=None):
        """TF's: built already (AssertionError)."""
        self._refuse_build()

    def _shard(self, num_shards: int, shard_ix: int) -> None:
        items = self._items._dataset if isinstance(self._items, _Reiterable) else self._items
        policy = _auto_shard_policy(items, num_shards)
        if policy == AutoShardPolicy.FILE:
            self._items = self._items._file_sharded(num_shards, shard_ix)
        elif policy != AutoShardPolicy.OFF:  # the replicas' batches, in the order they take them
            self._shards = self._shards + ((num_shards, shard_ix),)

    def _sharded_count(self, count: int) -> int:
        """How many of ``count`` global batches the batch sharding keeps: known with one replica (a replica's
        batch is a global batch); with more, TF rebatches first and no longer knows the count."""
        if self._extended._num_replicas_in_sync > 1:
            return dataset_ops.UNKNOWN_CARDINALITY
        for num_shards, shard_ix in self._shards:
            count = len(range(shard_ix, count, num_shards))
        return count

    def _counted_input(self):
        return self._items

    def _static_specs(self):
        if not _is_pipeline(self._items):
            return None
        spec, local = self._items.element_spec, len(self._devices)
        if self._extended._num_replicas_in_sync == 1:  # (no rebatch: the elements as they are)
            return [spec] * local
        batch = self._static_batch()
        return [map_structure(lambda s: s if s.shape.rank is None else TensorSpec((batch,) + tuple(s.shape)[1:],
                                                                                  s.dtype), spec)] * local

    def _static_batch(self):
        # TF's rule: a fixed global batch that the replicas (of all workers) share evenly.
        size, total = self._batch_of(self._items), self._extended._num_replicas_in_sync
        return size // total if size is not None and size % total == 0 else None

    def _peek(self):
        first = self._items._peek() if isinstance(self._items, Dataset) else self._items.peek(1)
        if not first:
            raise ValueError("dataset is empty: element_spec needs at least one batch")
        return self._steps_of(first[0])[0]


def _pads_short_steps(extended, dataset) -> bool:
    """TF's get_next_as_optional handling (a short last step padded with empty batches): on, but off for a
    pipeline of fixed shapes read by one worker (such a step then ends the input)."""
    if not extended.experimental_enable_get_next_as_optional:
        return False
    if extended._num_workers > 1 or not _is_pipeline(dataset):
        return True
    return not all(s.shape.rank is not None and None not in s.shape.as_list() for s in flatten(dataset.element_spec))


def _pipeline_policy(dataset, policy, workers: int) -> AutoShardPolicy:
    """tf.data's rules for a pipeline read by ``workers``: FILE shards its list_files/TextLineDataset sources by
    file; AUTO does where there are as many files as workers, else falls back to DATA (and says so)."""
    if policy in (AutoShardPolicy.AUTO, AutoShardPolicy.FILE):
        count = dataset._file_count()
        if count is None:
            if policy == AutoShardPolicy.FILE:
                raise ValueError("dataset: AutoShardPolicy.FILE found no file source (Dataset.list_files or "
                                 "TextLineDataset) in the pipeline to shard; use AutoShardPolicy.DATA or OFF")
            _warn_data_fallback("Did not find a shardable source, walked to a node which is not a dataset")
            return AutoShardPolicy.DATA
        if count < workers:
            if policy == AutoShardPolicy.FILE:
                raise ValueError(_too_few_files(count, workers))
            _warn_data_fallback(f"Could not apply FILE based sharding: the dataset only has {count} file(s), "
                                f"which is not enough for the required {workers} shards/workers.")
            return AutoShardPolicy.DATA
        return AutoShardPolicy.FILE
    # HINT shards only where the pipeline says so (tf.data's shard(SHARD_HINT, SHARD_HINT)); md.data pipelines
    # carry no such hint, and tf.data without one reads everything on every worker, as OFF.
    return AutoShardPolicy.OFF if policy == AutoShardPolicy.HINT else policy


def _auto_shard_policy(dataset, num_shards: int) -> AutoShardPolicy:
    """How auto_shard reads its shard of ``dataset`` (a pipeline or a plain iterable): FILE, DATA or OFF."""
    policy = policy_of(dataset)
    if policy == AutoShardPolicy.OFF:
        return policy
    if _is_pipeline(dataset):
        return _pipeline_policy(dataset, policy, num_shards)
    return AutoShardPolicy.DATA


def _is_pipeline(dataset) -> bool:
    """An md.data pipeline (``md.data.Dataset(iterable)`` is a plain iterable in a wrapper)."""
    return isinstance(dataset, Dataset) and not isinstance(dataset, dataset_ops.IterableDataset)


def _warn_data_fallback(reason: str) -> None:
    # TensorFlow's words (its auto-shard rewrite logs them when it falls back).
    _log.warning("AUTO sharding policy will apply DATA sharding policy as it failed to apply FILE sharding policy "
                 "because of the following reason: %s", reason)


def _too_few_files(count: int, workers: int) -> str:
    return (f"dataset: AutoShardPolicy.FILE needs at least as many files (items) as workers: Could not apply FILE "
            f"based sharding: the dataset only has {count} file(s), which is not enough for the required {workers} "
            "shards/workers; use AutoShardPolicy.DATA or OFF")


class _Pipelines(_Iterator):
    """One step's items from the worker's pipelines: one item from each (one pipeline per replica), or the
    next L items of the single pipeline (a short last step is padded with empty batches, or ends the input
    where ``partial`` is False: TF's strategies without ``experimental_enable_get_next_as_optional``)."""

    def __init__(self, pipelines: list, local: int, state=None, partial: bool = True):
        super().__init__(*(_source_iterator(p, None if state is None else s)
                           for p, s in zip(pipelines, [None] * len(pipelines) if state is None else state)))
        self._local = local
        self._partial = partial

    def next(self):
        if len(self._inputs) > 1:
            return [it.next() for it in self._inputs]
        step = []
        for _ in range(self._local):
            try:
                step.append(self._inputs[0].next())
            except StopIteration:
                break
        if not step:
            raise StopIteration
        if len(step) < self._local and not self._partial:
            return _ShortRound(step)
        return step

    def save(self):
        return [it.save() for it in self._inputs]


def _sharded_pipeline(dataset, num_shards: int, shard_ix: int):
    """Shard ``shard_ix`` of one pipeline (each pipeline is sharded on its own, as TF shards each)."""
    policy = _auto_shard_policy(dataset, num_shards)
    if policy == AutoShardPolicy.OFF:
        return dataset
    if policy == AutoShardPolicy.FILE:
        return dataset._file_sharded(num_shards, shard_ix)
    return (dataset if isinstance(dataset, Dataset) else Dataset(dataset)).shard(num_shards, shard_ix)


class DistributedDatasetsFromFunction(_DistributedInput):
    """``strategy.distribute_datasets_from_function(dataset_fn)``: each replica takes one batch per step."""

    def __init__(self, dataset_fn, extended, options=None):
        super().__init__(extended, options)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn={dataset_fn!r} is not callable; pass a function of an md.InputContext "
                            "that returns an iterable of per-replica batches")
        local = len(extended.worker_devices)
        total = extended._num_replicas_in_sync
        per_replica = self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA
        if self._options.experimental_place_dataset_on_device and not per_replica:
            raise ValueError("When `experimental_place_dataset_on_device` is set for dataset placement, you must "
                             "also specify `PER_REPLICA` for the replication mode")
        if self._options.experimental_place_dataset_on_device and self._options.experimental_fetch_to_device:
            raise ValueError("`experimental_place_dataset_on_device` can not be set to True when "
                             "experimental_fetch_to_device is True and replication mode is set to `PER_REPLICA`; "
                             "pass experimental_fetch_to_device=False")
        if per_replica and extended._per_replica_pipelines:
            first = extended._worker_index * local
            contexts = [InputContext(total, first + i, total) for i in range(local)]
        else:
            contexts = [InputContext(extended._num_workers, extended._worker_index, total)]
        self._pipelines = [self._pipeline(dataset_fn(ctx)) for ctx in contexts]

    @staticmethod
    def _pipeline(dataset):
        return dataset if isinstance(dataset, Dataset) else _Reiterable(dataset, "dataset_fn()")

    def _source(self, state=None):
        return _Pipelines(self._pipelines, len(self._devices), state,
                          _pads_short_steps(self._extended, self._pipelines[0]))

    def build(self):
        """TF's: built already (AssertionError)."""
        self._refuse_build()

    def _shard(self, num_shards: int, shard_ix: int) -> None:
        self._pipelines = [self._pipeline(_sharded_pipeline(p._dataset if isinstance(p, _Reiterable) else p,
                                                            num_shards, shard_ix)) for p in self._pipelines]

    def _counted_input(self):
        return self._pipelines[0]

    def _static_specs(self):
        if not all(_is_pipeline(p) for p in self._pipelines):
            return None
        specs = [p.element_spec for p in self._pipelines]
        return specs * len(self._devices) if len(specs) == 1 else specs

    def _static_batch(self):
        sizes = {self._batch_of(p) for p in self._pipelines}
        return sizes.pop() if len(sizes) == 1 else None

    def _steps_of(self, step):
        local = len(self._devices)
        if len(step) < local:
            # The replicas without data get TF's dummies: empty batches of the same trailing shape, and a zero
            # of the dtype where an element is a scalar (it has no batch dimension to empty).
            empty = map_structure(_dummy, step[-1])
            step = step + [empty] * (local - len(step))
        return [step]

    def _peek(self):
        # Take the first step's items (one-shot pipelines keep them, so no batch is lost).
        take = len(self._devices) if len(self._pipelines) == 1 else 1
        peeked = [p._peek(take) if isinstance(p, Dataset) else p.peek(take) for p in self._pipelines]
        if any(not items for items in peeked):
            raise ValueError("dataset_fn() returned an empty dataset: element_spec needs at least one batch")
        return self._steps_of(peeked[0] if len(peeked) == 1 else [items[0] for items in peeked])[0]
