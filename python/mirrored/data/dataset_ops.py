"""``md.data.Dataset``: tf.data's sources and transformations over NumPy/CuPy elements.

Every dataset is an immutable description; ``iter(dataset)`` builds a tree of
iterators, one per transformation. Each iterator can save its state (a tree
of plain values and arrays) and be rebuilt from it, which makes the whole
pipeline checkpointable. ``prefetch`` and ``map(num_parallel_calls=...)``
run in background threads (the work is NumPy/CuPy or I/O, which releases the
GIL; see docs/data.md for the measurement that chose threads).
"""

from __future__ import annotations

import concurrent.futures as futures
import copy
import glob
import inspect
import logging
import math
import os
import shutil
import threading
from collections import deque

import numpy as np

from .._nest import flatten, map_structure, pack_sequence_as
from ..device import device_util
from ..errors import InvalidArgumentError, from_os_error
from .iterator_ops import NumpyIterator, OwnedIterator
from .saved_dataset import (SPEC_FILE, Writer, check_compression, check_path, decode_spec, encode_spec,
                            fingerprint, fresh_directory, publish, read_chunk, read_description, shard_of)
from .options import Options, merge_options
from .structure import (DatasetSpec, TensorSpec, array_module, leaf_spec, map_container, normalize_input,
                        normalize_output, row, spec_of, stack, string_array, to_leaf)

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset"]

AUTOTUNE = -1
DEBUG_MODE = False  # enable_debug_mode(): no threads, input order everywhere
INFINITE_CARDINALITY = -1
UNKNOWN = UNKNOWN_CARDINALITY = -2


def enable_debug_mode() -> None:
    """``md.data.experimental.enable_debug_mode()``: from now on (the whole process, as TF's) parallel ``map``,
    ``interleave`` and ``prefetch`` run in the caller's thread, in order."""
    global DEBUG_MODE
    DEBUG_MODE = True


def _int(value, argument: str, what: str) -> int:
    """An int argument; TypeError for any other type, as TF's conversion to an int64 tensor."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{argument}={value!r}: must be {what}, not {type(value).__name__}")
    return int(value)


def _seed_of(seed) -> int:
    """The PCG64 seed of a ``seed`` argument: TF takes any int64, negative ones included (PCG64 takes none, so
    they wrap to their two's-complement value); None draws one at random."""
    if seed is None:
        return int(np.random.SeedSequence().entropy % 2**63)
    return _int(seed, "seed", "an int or None") % 2**64


def _positive_int(value, argument: str, allow=()) -> int:
    _int(value, argument, "a positive int")
    if value <= 0 and value not in allow:
        extra = f" (or {', '.join(map(str, allow))})" if allow else ""
        raise ValueError(f"{argument}={value!r}: must be greater than zero (a positive int{extra})")
    return int(value)


def _count(value, argument: str) -> int:
    """A ``take``/``skip``/``repeat`` count: an int; any negative one means "all" (-1), as in tf.data."""
    return max(_int(value, argument, "an int (>= 0, or -1 for all)"), -1)


def _call(fn, element):
    """tf.data passes a tuple element's components as separate arguments (a namedtuple, dict or list is one
    argument)."""
    return fn(*element) if type(element) is tuple else fn(element)


def _same_state(old, new, argument: str):
    """``new`` (a function's new state) as a structure of arrays; its structure and dtypes must be ``old``'s."""
    new = normalize_output(new, argument)
    if not _same_structure(old, new) or any(np.result_type(a) != np.result_type(b)
                                            for a, b in zip(flatten(old), flatten(new))):
        raise TypeError(f"{argument} must keep the state's structure and dtypes (the new state must match the "
                        f"initial state): the state was {spec_of(old)}, "
                        f"{argument} returned {spec_of(new)}; cast the new state (e.g. np.int64(...))")
    return new


def _scalar_bool(keep) -> bool:
    """A predicate's result: a Python or NumPy boolean scalar (tf.bool), nothing else."""
    if isinstance(keep, np.ndarray) and keep.shape == () and keep.dtype == np.bool_:
        keep = keep[()]
    if not isinstance(keep, (bool, np.bool_)):
        raise ValueError(f"predicate must return a scalar boolean, got {keep!r:.80} ({type(keep).__name__}); it "
                         "must return a `tf.bool` scalar: compare, e.g. x > 0")
    return bool(keep)


def _parallelism_cap() -> int:
    return max(8, 4 * (os.cpu_count() or 1))


def _pipeline_options(ds) -> Options:
    return ds._pipeline_options or ds.options()


def _ordered(ds, deterministic) -> bool:
    """Whether a parallel transformation keeps its input order: its own ``deterministic``, else the
    pipeline's ``Options.deterministic`` (default: ordered)."""
    if deterministic is None:
        deterministic = _pipeline_options(ds).deterministic
    return deterministic is not False


def _thread_limit(ds, wanted: int) -> int:
    """``wanted`` threads, at most ``Options.threading.private_threadpool_size`` when the pipeline sets it."""
    size = _pipeline_options(ds).threading.private_threadpool_size
    return max(1, min(wanted, size)) if size else wanted


class _Iterator:
    """One transformation's iterator: ``next()``, ``save()`` and ``close()`` (the inputs' too)."""

    def __init__(self, *inputs):
        self._inputs = list(inputs)

    def next(self):
        raise NotImplementedError

    def save(self):
        raise NotImplementedError

    def close(self) -> None:
        for it in self._inputs:
            it.close()


class Dataset:
    """A pipeline of elements (``tf.data.Dataset``), built from a source and transformations.

    ``md.data.Dataset(iterable)`` (not a TensorFlow spelling) wraps any Python
    iterable of elements, so existing loaders can take ``with_options``.
    """

    def __new__(cls, *args, **kwargs):
        if cls is Dataset:
            return object.__new__(IterableDataset)
        return object.__new__(cls)

    def __init__(self, *inputs):
        self._inputs = tuple(inputs)
        self._options = None
        self._pipeline_options = None  # set by a with_options downstream
        self._spec = None

    # --- what every dataset has ------------------------------------------------------------------
    def __iter__(self) -> OwnedIterator:
        return OwnedIterator(self)

    def _make_iterator(self, state=None) -> _Iterator:
        raise NotImplementedError

    @property
    def _input(self) -> "Dataset":
        return self._inputs[0]

    def options(self) -> Options:
        """The options of this pipeline: every ``with_options`` upstream merged, a later one winning where both
        set an option (tf.data's rule). A read-only copy, as TF's: change options with ``with_options``."""
        chain = self._options_chain()
        options = copy.deepcopy(merge_options(*chain)) if chain else Options()
        options._set_mutable(False)
        return options

    def _options_chain(self) -> list:
        """The ``with_options`` objects of the pipeline, upstream (and the inputs in order) first."""
        chain = []
        for d in self._inputs:
            chain.extend(o for o in d._options_chain() if not any(o is c for c in chain))
        if self._options is not None and not any(self._options is c for c in chain):
            chain.append(self._options)
        return chain

    @property
    def element_spec(self):
        """The structure of ``TensorSpec``s of the elements (``None`` for dimensions that vary)."""
        if self._spec is None:
            self._spec = self._compute_spec()
        return self._spec

    def _compute_spec(self):
        return self._input.element_spec

    def cardinality(self) -> np.int64:
        """The number of elements, an int64 scalar (TF's is an int64 tensor; this is what its ``.numpy()`` gives):
        ``md.data.INFINITE_CARDINALITY`` (-1) or ``UNKNOWN_CARDINALITY`` (-2) where it is not a count."""
        return np.int64(self._cardinality())

    def _cardinality(self) -> int:
        return UNKNOWN

    def __len__(self):
        n = self._cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if n == UNKNOWN:
            raise TypeError("The dataset length is unknown.")
        return n

    def as_numpy_iterator(self):
        """The elements, as NumPy values (device arrays are copied to the host)."""
        for spec in flatten(self.element_spec):
            if isinstance(spec, DatasetSpec):
                raise TypeError("`Dataset.as_numpy_iterator()` is not supported for datasets that produce datasets "
                                "(window); iterate it, or flat_map(lambda w: w.batch(size)) first")
        return NumpyIterator(self)

    def reduce(self, initial_state, reduce_func):
        """``reduce_func(state, element)`` folded over every element, from ``initial_state``; the state keeps
        its structure and dtypes (Python numbers in it convert as TF's: 0 is int32, 0.0 float32)."""
        state = normalize_input(initial_state, "initial_state")
        for element in self:
            state = _same_state(state, reduce_func(state, element), "reduce_func")
        return state

    def _clone(self, inputs) -> "Dataset":
        clone = copy.copy(self)
        clone._inputs = tuple(inputs)
        clone._spec = None
        return clone

    def _file_sharded(self, num_shards: int, index: int):
        """This pipeline with its file sources read ``1/num_shards`` each; None if it reads no files."""
        new, found = [], False
        for d in self._inputs:
            sharded = d._file_sharded(num_shards, index)
            found |= sharded is not None
            new.append(d if sharded is None else sharded)
        return self._clone(new) if found else None

    def _peek(self, count: int = 1) -> list:
        """The first ``count`` elements (fewer at the end), read without changing what later iterations see:
        the shuffles' epoch counters are put back, so computing a spec does not reorder the first epoch."""
        shuffles = [(d, d._epochs) for d in self._pipeline() if isinstance(d, _Shuffle)]
        it = self._make_iterator()
        try:
            out = []
            for _ in range(count):
                out.append(it.next())
        except StopIteration:
            pass
        finally:
            it.close()
            for d, epochs in shuffles:
                d._epochs = epochs
        return out

    def _pipeline(self):
        """This dataset and every dataset upstream of it."""
        yield self
        for d in self._inputs:
            yield from d._pipeline()

    def _file_count(self):
        """How many files the pipeline's file sources name (None: not known, or no files)."""
        counts = [c for c in (d._file_count() for d in self._inputs) if c is not None]
        return min(counts) if counts else None

    # --- sources ---------------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors, name=None) -> "Dataset":
        """One element per row of ``tensors`` (arrays, or tuples/dicts of arrays with one first dimension)."""
        return _TensorSlices(tensors)

    @staticmethod
    def from_tensors(tensors, name=None) -> "Dataset":
        """A dataset of one element, ``tensors``."""
        return _Tensors(tensors)

    @staticmethod
    def range(*args, output_type=np.int64, name=None) -> "Dataset":
        """``range(stop)``, ``range(start, stop[, step])`` as Python's, int64 scalars."""
        return _Range(*args, output_type=output_type)

    @staticmethod
    def from_generator(generator, output_types=None, output_shapes=None, args=None, output_signature=None,
                       name=None) -> "Dataset":
        """The values ``generator(*args)`` yields; the generator is called afresh for every iteration."""
        return _Generator(generator, output_types, output_shapes, args, output_signature)

    @staticmethod
    def list_files(file_pattern, shuffle=None, seed=None, name=None) -> "Dataset":
        """The file names matching ``file_pattern`` (a glob, or a list of them), shuffled unless ``shuffle=False``."""
        return ListFilesDataset(file_pattern, shuffle, seed)

    @staticmethod
    def zip(*args, datasets=None, name=None) -> "Dataset":
        """Elements of several datasets side by side, as a tuple (or the structure ``datasets`` has)."""
        if datasets is not None and args:
            raise TypeError("zip: pass the datasets either positionally or as datasets=, not both")
        if datasets is None:
            datasets = args[0] if len(args) == 1 else tuple(args)
        return _Zip(datasets)

    # --- transformations -------------------------------------------------------------------------
    def batch(self, batch_size, drop_remainder=False, num_parallel_calls=None, deterministic=None,
              name=None) -> "Dataset":
        """Consecutive elements stacked into batches; a short last batch unless ``drop_remainder``.
        ``num_parallel_calls`` is checked and the batches are stacked in order in the reading thread (one NumPy
        stack per component: put a ``prefetch`` after it to overlap)."""
        if num_parallel_calls is not None:
            _positive_int(num_parallel_calls, "num_parallel_calls", allow=(AUTOTUNE,))
        batched = _Batch(self, _positive_int(batch_size, "batch_size"), bool(drop_remainder))
        batched._parallel = num_parallel_calls is not None
        return batched

    def padded_batch(self, batch_size, padded_shapes=None, padding_values=None, drop_remainder=False,
                     name=None) -> "Dataset":
        """``batch`` of elements whose shapes differ: each component padded to ``padded_shapes`` (``None``/-1
        dimensions, or all of them by default: to the largest in the batch) with ``padding_values`` (0, b"")."""
        return _PaddedBatch(self, _positive_int(batch_size, "batch_size"), bool(drop_remainder), padded_shapes,
                            padding_values)

    def unbatch(self, name=None) -> "Dataset":
        """The rows of every element (the inverse of ``batch``)."""
        unbatched = _Unbatch(self)
        unbatched.element_spec  # noqa: B018  (as tf.data: scalar components are refused here)
        return unbatched

    def map(self, map_func, num_parallel_calls=None, deterministic=None, name=None) -> "Dataset":
        """``map_func(element)`` for every element; in a thread pool when ``num_parallel_calls`` is set."""
        return _Map(self, map_func, num_parallel_calls, deterministic)

    def flat_map(self, map_func, name=None) -> "Dataset":
        """The elements of the dataset ``map_func(element)`` returns, for every element in turn."""
        return _Interleave(self, map_func, cycle_length=1, block_length=1)

    def interleave(self, map_func, cycle_length=None, block_length=None, num_parallel_calls=None,
                   deterministic=None, name=None) -> "Dataset":
        """Elements of ``cycle_length`` datasets ``map_func`` makes, ``block_length`` from each in turn. With
        ``num_parallel_calls`` each open dataset is read ahead in a thread of its own, at most
        ``num_parallel_calls`` reading at once; ``deterministic=False`` then lets a dataset whose element is
        ready go before one that is still reading."""
        fixed_cycle = not (cycle_length is None or cycle_length == AUTOTUNE)
        cycle_length = _positive_int(cycle_length, "cycle_length") if fixed_cycle else os.cpu_count() or 1
        if num_parallel_calls is not None:
            num_parallel_calls = _positive_int(num_parallel_calls, "num_parallel_calls", allow=(AUTOTUNE,))
        interleaved = _Interleave(self, map_func, cycle_length,
                                  _positive_int(1 if block_length is None else block_length, "block_length"),
                                  num_parallel_calls, deterministic)
        if fixed_cycle:  # TF checks a fixed cycle_length at once, the CPU count when the iterator starts
            interleaved._check_parallel_calls()
        return interleaved

    def filter(self, predicate, name=None) -> "Dataset":
        """The elements for which ``predicate(element)`` is True."""
        return _Filter(self, predicate)

    def shuffle(self, buffer_size, seed=None, reshuffle_each_iteration=True, name=None) -> "Dataset":
        """Elements drawn at random from a buffer of ``buffer_size`` that refills from the input."""
        return _Shuffle(self, _positive_int(buffer_size, "buffer_size"), seed, bool(reshuffle_each_iteration))

    def repeat(self, count=None, name=None) -> "Dataset":
        """The input ``count`` times over (forever for ``None`` or -1)."""
        return _Repeat(self, -1 if count is None else _count(count, "count"))

    def take(self, count, name=None) -> "Dataset":
        """The first ``count`` elements (all for -1)."""
        return _Take(self, _count(count, "count"))

    def skip(self, count, name=None) -> "Dataset":
        """All but the first ``count`` elements (none for -1)."""
        return _Skip(self, _count(count, "count"))

    def cache(self, filename="", name=None) -> "Dataset":
        """The first complete pass is kept (in memory, or in ``filename``) and replayed afterwards."""
        return _Cache(self, os.fspath(filename))

    def prefetch(self, buffer_size, name=None) -> "Dataset":
        """A background thread reads up to ``buffer_size`` elements ahead (``AUTOTUNE``: it adapts)."""
        return _Prefetch(self, _positive_int(buffer_size, "buffer_size", allow=(AUTOTUNE, 0)))

    def shard(self, num_shards, index, name=None) -> "Dataset":
        """Every ``num_shards``-th element, starting at ``index``."""
        num_shards = _positive_int(num_shards, "num_shards")
        if not 0 <= _int(index, "index", "an int") < num_shards:
            raise ValueError(f"index={index!r}: Index must be between 0 and {num_shards - 1} "
                             f"(num_shards={num_shards}); pick the shard's position, e.g. the worker's task index")
        return _Shard(self, num_shards, int(index))

    def concatenate(self, dataset, name=None) -> "Dataset":
        """This dataset's elements, then ``dataset``'s (same structure and dtypes)."""
        return _Concatenate(self, dataset)

    def enumerate(self, start=0, name=None) -> "Dataset":
        """``(index, element)`` pairs, the index an int64 counting from ``start``."""
        return _Enumerate(self, _int(start, "start", "an int"))

    def with_options(self, options: Options, name=None) -> "Dataset":
        """This dataset carrying ``options`` (``md.data.Options``)."""
        if not isinstance(options, Options):
            raise TypeError(f"options={options!r}: expected md.data.Options()")
        options = copy.deepcopy(options)  # as TF's, later changes to the caller's object do not reach the pipeline
        options._set_mutable(True)
        clone = self._under(options)
        # Options set on this very dataset before are merged with these (a later one wins where both set one).
        clone._options = options if self._options is None else merge_options(self._options, options)
        return clone

    def _under(self, options: Options) -> "Dataset":
        """A copy of the pipeline whose transformations see ``options`` (tf.data applies a pipeline's options
        to every transformation upstream of ``with_options``, e.g. ``deterministic``)."""
        clone = self._clone([d._under(options) for d in self._inputs])
        clone._pipeline_options = options
        return clone

    def apply(self, transformation_func) -> "Dataset":
        return transformation_func(self)

    def window(self, size, shift=None, stride=1, drop_remainder=False, name=None) -> "Dataset":
        """Windows of ``size`` elements (every ``stride``-th), one starting every ``shift`` (default ``size``)
        inputs; each window is the element's structure of datasets (``flat_map(lambda w: w.batch(size))``)."""
        size = _positive_int(size, "size")
        return _Window(self, size, size if shift is None else _positive_int(shift, "shift"),
                       _positive_int(stride, "stride"), bool(drop_remainder))

    def group_by_window(self, key_func, reduce_func, window_size=None, window_size_func=None,
                        name=None) -> "Dataset":
        """Elements grouped by ``key_func(element)`` (an int); each group's window of ``window_size`` elements
        (or ``window_size_func(key)``) becomes the dataset ``reduce_func(key, window)``, whose elements are the
        output. At the end of the input the unfinished windows follow, by increasing key."""
        if (window_size is None) == (window_size_func is None):
            raise ValueError("Either the `window_size` argument or the `window_size_func` argument must be "
                             "specified (not both).")
        if window_size is not None:
            size = _positive_int(window_size, "window_size")
            window_size_func = lambda key: size  # noqa: E731
        return _GroupByWindow(self, key_func, reduce_func, window_size_func)

    def bucket_by_sequence_length(self, element_length_func, bucket_boundaries, bucket_batch_sizes,
                                  padded_shapes=None, padding_values=None, pad_to_bucket_boundary=False,
                                  no_padding=False, drop_remainder=False, name=None) -> "Dataset":
        """Elements batched with others of similar length: bucket ``i`` holds lengths in
        ``[bucket_boundaries[i-1], bucket_boundaries[i])`` and is batched ``bucket_batch_sizes[i]`` at a time,
        padded (``padded_batch``) to the longest in the batch, or to its boundary minus one with
        ``pad_to_bucket_boundary``."""
        boundaries = [_int(b, "bucket_boundaries", "a list of ints") for b in bucket_boundaries]
        sizes = [_positive_int(b, "bucket_batch_sizes") for b in bucket_batch_sizes]
        if len(sizes) != len(boundaries) + 1:
            raise ValueError(f"len(bucket_batch_sizes) must equal len(bucket_boundaries) + 1, got {len(sizes)} and "
                             f"{len(boundaries)}")
        if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
            raise ValueError(f"bucket_boundaries={boundaries} must be increasing")
        if not callable(element_length_func):
            raise ValueError(f"element_length_func={element_length_func!r} is not callable")

        def bucket(*element):
            length = int(element_length_func(*element))
            return sum(length >= b for b in boundaries)

        def batch(bucket_id, window):
            size = sizes[int(bucket_id)]
            if no_padding:
                return window.batch(size, drop_remainder=drop_remainder)
            shapes = padded_shapes
            if pad_to_bucket_boundary:
                if int(bucket_id) == len(boundaries):
                    raise ValueError("pad_to_bucket_boundary=True: an element's length is at least the last "
                                     f"bucket boundary ({boundaries[-1] if boundaries else 0}); raise the last "
                                     "boundary above the longest element")
                spec = window.element_spec
                shapes = map_structure(lambda s: [boundaries[int(bucket_id)] - 1 if d is None else d
                                                  for d in s.shape], spec) if shapes is None else shapes
            return window.padded_batch(size, shapes, padding_values, drop_remainder=drop_remainder)

        def batched(s, shape):
            return TensorSpec(None if s.shape.rank is None else (None,) + tuple(shape), s.dtype)

        # The spec of every bucket's batches (TF's): batch and padded dimensions unknown unless padded_shapes fixes
        # them.
        spec = self.element_spec
        if no_padding or padded_shapes is None:
            out = map_structure(lambda s: batched(s, s.shape or ()), spec)
        else:
            out = pack_sequence_as(spec, [batched(s, [None if d is None or d == -1 else int(d) for d in shape])
                                          for s, shape in zip(flatten(spec), _flatten_shapes(spec, padded_shapes))])
        return _GroupByWindow(self, bucket, batch, lambda bucket_id: sizes[int(bucket_id)], spec=out)

    def take_while(self, predicate, name=None) -> "Dataset":
        """The elements up to (not including) the first for which ``predicate(element)`` is False."""
        return _TakeWhile(self, predicate)

    def scan(self, initial_state, scan_func, name=None) -> "Dataset":
        """``scan_func(state, element)`` returns ``(new_state, output)``: the outputs, the state carried along."""
        return _Scan(self, initial_state, scan_func)

    def unique(self, name=None) -> "Dataset":
        """Each distinct element once, in order of first appearance (int32, int64 or string components)."""
        return _Unique(self)

    def rebatch(self, batch_size, drop_remainder=False, name=None) -> "Dataset":
        """The rows of the batches regrouped into batches of ``batch_size`` (an int, or a list used in turn)."""
        return _Rebatch(self, batch_size, bool(drop_remainder))

    def ignore_errors(self, log_warning=False, name=None) -> "Dataset":
        """The elements whose computation did not raise (those that did are dropped, logged if asked)."""
        return _IgnoreErrors(self, bool(log_warning))

    def get_single_element(self, name=None):
        """The dataset's only element; ValueError if it has none or more than one."""
        it = self._make_iterator()
        try:
            try:
                element = it.next()
            except StopIteration:
                raise ValueError("Dataset was empty; get_single_element needs exactly one element") from None
            try:
                it.next()
            except StopIteration:
                return element
            raise ValueError("Dataset had more than one element; take(1) or batch the dataset first")
        finally:
            it.close()

    def rejection_resample(self, class_func, target_dist, initial_dist=None, seed=None, name=None) -> "Dataset":
        """``(class, element)`` pairs whose classes (``class_func(element)``, an int in ``[0, num_classes)``) follow
        ``target_dist``: TF's resampler, which takes an element of the input as it is with probability ``m`` and
        otherwise the next element a rejection sampler accepts (class ``i`` with probability ``a_i``), ``m`` and
        ``a`` computed from ``initial_dist`` or, without it, from the class counts seen so far (32 at a time,
        each class starting at 10). The two streams read the input separately, as TF's do, so an element may
        come twice. NumPy's random numbers, not TF's."""
        if not callable(class_func):
            raise TypeError(f"class_func={class_func!r} is not callable; pass a function of the element returning "
                            "its class")
        return _RejectionResample(self, class_func, _distribution(target_dist, "target_dist"),
                                  None if initial_dist is None else _distribution(initial_dist, "initial_dist"), seed)

    def save(self, path, compression=None, shard_func=None, checkpoint_args=None) -> None:
        """Every element written under the directory ``path`` (replacing it), for ``Dataset.load``. md.data's
        own format (docs/data.md): TF's ``load`` does not read it. ``shard_func(element)`` (an int64 scalar)
        spreads the elements over shards, which ``load`` reads in shard order."""
        path = check_path(path)
        compress = check_compression(compression)
        if shard_func is not None and not callable(shard_func):
            raise TypeError(f"shard_func={shard_func!r} is not callable; pass a function of the element returning "
                            "an int64 shard index")
        if checkpoint_args is not None:
            raise TypeError("checkpoint_args: md.data's save does not checkpoint its progress (a save runs to the "
                            "end in one call); leave it None")
        spec = self.element_spec
        encode_spec(spec)  # (refuses datasets of datasets before writing anything)
        fresh_directory(path)
        writer = Writer(path, compress)
        for element in self:
            writer.add(0 if shard_func is None else shard_of(shard_func, element), element)
        writer.finish(spec)

    @staticmethod
    def load(path, element_spec=None, compression=None, reader_func=None, wait=False) -> "Dataset":
        """The dataset ``save`` wrote in ``path``, with its element_spec and cardinality. ``reader_func(datasets)``
        gets the shards as a dataset of datasets and returns the dataset to read (default: the shards in
        order). The compression is read from the files themselves."""
        path = check_path(path)
        check_compression(compression)
        loaded = _Loaded(path)
        if element_spec is not None and flatten(element_spec) != flatten(loaded.element_spec):
            raise ValueError(f"element_spec={element_spec!r} does not match the saved dataset's "
                             f"{loaded.element_spec!r}; pass None to use the saved one")
        if reader_func is None:
            return loaded
        if not callable(reader_func):
            raise TypeError(f"reader_func={reader_func!r} is not callable; pass a function of the dataset of shards")
        return _Counted(reader_func(_Shards(loaded._shards)), loaded._count)

    def snapshot(self, path, compression="AUTO", reader_func=None, shard_func=None, name=None) -> "Dataset":
        """The first complete pass is written under ``path`` (a directory per pipeline fingerprint); every later
        iteration, in this process or another running the same pipeline, reads the snapshot instead."""
        return _Snapshot(self, path, compression, reader_func, shard_func)

    def fingerprint(self) -> np.uint64:
        """A uint64 naming this pipeline: its transformations, their arguments, functions' code and sources'
        values (equal pipelines, equal fingerprints; not TF's numbers)."""
        return np.uint64(int(fingerprint(self)[:16], 16))

    @staticmethod
    def counter(start=0, step=1, dtype=np.int64, name=None) -> "Dataset":
        """``start, start + step, ...`` forever, as ``dtype`` scalars."""
        return _Counter(_int(start, "start", "an int"), _int(step, "step", "an int"), dtype)

    @staticmethod
    def random(seed=None, rerandomize_each_iteration=None, name=None) -> "Dataset":
        """Endless pseudorandom int64 scalars in ``[0, 2**32)``; ``seed`` (or one drawn per dataset) fixes them
        for every iteration unless ``rerandomize_each_iteration``. NumPy's PCG64, not TF's stream."""
        return _Random(seed, bool(rerandomize_each_iteration))

    @staticmethod
    def choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset=True) -> "Dataset":
        """The next element of ``datasets[i]`` for each ``i`` of ``choice_dataset`` (int64 scalars)."""
        return _ChooseFromDatasets(datasets, choice_dataset, bool(stop_on_empty_dataset))

    @staticmethod
    def sample_from_datasets(datasets, weights=None, seed=None, stop_on_empty_dataset=False,
                             rerandomize_each_iteration=None) -> "Dataset":
        """Elements drawn from ``datasets`` at random, dataset ``i`` with probability ``weights[i]`` (uniform by
        default); an exhausted dataset drops out unless ``stop_on_empty_dataset``."""
        datasets = _datasets_argument(datasets)
        if len(datasets) == 1 and weights is None:  # as tf.data: one dataset is returned as it is
            return datasets[0]
        if weights is not None:
            weights = [float(w) for w in np.asarray(weights, np.float64).reshape(-1)]
            if len(weights) != len(datasets):
                raise ValueError(f"Invalid `weights`. `weights` should have the same length as `datasets` but got "
                                 f"`len(weights)={len(weights)}` vs. `len(datasets)={len(datasets)}`.")
            if any(w < 0 for w in weights) or not sum(weights) > 0:
                raise ValueError(f"weights={weights}: must be >= 0 with a positive sum")
            # As tf.data: datasets of weight 0 are never read, and a lone remaining dataset is returned as it is.
            kept = [(d, w) for d, w in zip(datasets, weights) if w > 0]
            if len(kept) == 1:
                return kept[0][0]
            datasets, weights = [d for d, _ in kept], [w for _, w in kept]
        return _SampleFromDatasets(datasets, weights, seed, bool(stop_on_empty_dataset),
                                   bool(rerandomize_each_iteration))


# --- sources -------------------------------------------------------------------------------------------

def _not_empty(tensors, method: str) -> None:
    if tensors is None or (isinstance(tensors, (tuple, dict)) and not flatten(tensors)):
        raise ValueError(f"{method}: Invalid `element`. `element` should not be empty (got {tensors!r}); pass an "
                         "array, or a tuple/dict of them")


class _TensorSlices(Dataset):
    def __init__(self, tensors):
        super().__init__()
        _not_empty(tensors, "from_tensor_slices")
        self._structure = normalize_input(tensors, "from_tensor_slices(tensors)")
        self._leaves = flatten(self._structure)
        shapes = [tuple(leaf.shape) for leaf in self._leaves]
        if not self._leaves or any(len(s) == 0 for s in shapes):
            raise ValueError(f"tensors: from_tensor_slices needs components of rank >= 1 to slice; got shapes "
                             f"{shapes}; use from_tensors for a single element")
        sizes = sorted({s[0] for s in shapes})
        if len(sizes) != 1:
            raise ValueError(f"tensors: all components need the same size in the first dimension; got shapes "
                             f"{shapes} (first dimensions {sizes})")
        self._rows = sizes[0]

    def _compute_spec(self):
        return pack_sequence_as(self._structure, [TensorSpec(leaf.shape[1:], leaf.dtype)
                                                         for leaf in self._leaves])

    def _cardinality(self):
        return self._rows

    def _make_iterator(self, state=None):
        return _SliceIterator(self, 0 if state is None else state["i"])


class _SliceIterator(_Iterator):
    def __init__(self, ds, i):
        super().__init__()
        self._ds, self._i = ds, i

    def next(self):
        if self._i >= self._ds._rows:
            raise StopIteration
        i, self._i = self._i, self._i + 1
        return pack_sequence_as(self._ds._structure, [row(leaf, i) for leaf in self._ds._leaves])

    def save(self):
        return {"i": self._i}


class NumpyDataset(_TensorSlices):
    """``experimental_make_numpy_dataset``'s result: the rows of host arrays (``from_tensor_slices``)."""

    def __init__(self, arrays):
        leaves = flatten(arrays)
        if not leaves or any(np.ndim(a) == 0 for a in leaves):
            raise ValueError("numpy_input: expected arrays with a leading dimension of rows, got "
                             f"{[np.shape(a) for a in leaves]}")
        sizes = {len(a) for a in leaves}
        if len(sizes) != 1:
            raise ValueError(f"numpy_input: all arrays need the same number of rows; got {sorted(sizes)}")
        super().__init__(arrays)


def _stack_lists(value):
    """Lists are tensors (stacked), tuples and dicts are structures: ``tf.data``'s rule for NumPy input."""
    if isinstance(value, list):
        try:
            return np.stack([np.asarray(device_util.to_host(v)) for v in value]) if value else np.asarray(value)
        except ValueError as e:
            raise ValueError(f"numpy_input: a list is stacked into one array (tf.data's rule), but its items "
                             f"differ in shape ({e}); pass a tuple for a structure of arrays") from None
    if isinstance(value, (dict, tuple)):
        return map_container(_stack_lists, value)
    return value


def make_numpy_dataset(numpy_input) -> NumpyDataset:
    """The rows of ``numpy_input`` (an array, or tuples/dicts of arrays; lists are stacked), copied to the host."""
    arrays = _stack_lists(numpy_input)
    return NumpyDataset(map_structure(lambda a: np.array(device_util.to_host(a), copy=True), arrays))


class _Tensors(Dataset):
    def __init__(self, tensors):
        super().__init__()
        _not_empty(tensors, "from_tensors")
        self._element = normalize_input(tensors, "from_tensors(tensors)")

    def _compute_spec(self):
        return spec_of(self._element)

    def _cardinality(self):
        return 1

    def _make_iterator(self, state=None):
        return _ListIterator([self._element], 0 if state is None else state["i"])


class _ListIterator(_Iterator):
    def __init__(self, elements, i):
        super().__init__()
        self._elements, self._i = elements, i

    def next(self):
        if self._i >= len(self._elements):
            raise StopIteration
        self._i += 1
        return self._elements[self._i - 1]

    def save(self):
        return {"i": self._i}


class _Range(Dataset):
    def __init__(self, *args, output_type=np.int64):
        super().__init__()
        if not 1 <= len(args) <= 3:
            raise ValueError(f"range{args!r}: expected range(stop), range(start, stop) or range(start, stop, "
                             f"step); the length of `args` should be between 1 and 3 but was {len(args)}")
        self._range = range(*(_int(a, "range argument", "an int") for a in args))
        if self._range.step == 0:
            raise ValueError("step=0: range's step must not be zero")
        self._dtype = np.dtype(output_type)

    def _compute_spec(self):
        return TensorSpec((), self._dtype)

    def _cardinality(self):
        return len(self._range)

    def _make_iterator(self, state=None):
        return _RangeIterator(self, 0 if state is None else state["i"])


class _RangeIterator(_SliceIterator):
    def next(self):
        r = self._ds._range
        if self._i >= len(r):
            raise StopIteration
        self._i += 1
        return self._ds._dtype.type(r[self._i - 1])


class _Generator(Dataset):
    def __init__(self, generator, output_types, output_shapes, args, output_signature):
        super().__init__()
        if not callable(generator):
            raise TypeError(f"generator={generator!r} must be callable (a generator function); pass the function, "
                            "not the generator object, so every iteration starts afresh")
        if output_signature is not None and (output_types is not None or output_shapes is not None):
            raise TypeError("The `output_types` and `output_shapes` arguments can not be used together with the "
                            "`output_signature` argument; pass only output_signature")
        if output_signature is None:
            if output_types is None:
                raise TypeError("from_generator: pass output_signature (a structure of md.data.TensorSpec), "
                                "or the deprecated output_types")
            shapes = output_shapes
            if shapes is None:
                shapes = map_structure(lambda _: None, output_types)
            output_signature = pack_sequence_as(output_types, [
                TensorSpec(s, t)  # no output_shapes: any rank
                for t, s in zip(flatten(output_types), _flatten_shapes(output_types, shapes))])
        for spec in flatten(output_signature):
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"output_signature: every leaf must be an md.data.TensorSpec, got {spec!r}")
        self._generator, self._args = generator, tuple(args or ())
        self._signature = output_signature

    def _compute_spec(self):
        return self._signature

    def _make_iterator(self, state=None):
        return _GeneratorIterator(self, 0 if state is None else state["count"])


def _flatten_shapes(types, shapes):
    """One shape per leaf of ``types`` (a shape is itself a tuple, so it cannot be flattened with them)."""
    if isinstance(types, dict):
        return [s for k in sorted(types) for s in _flatten_shapes(types[k], shapes[k])]
    if isinstance(types, (tuple, list)):
        return [s for t, sh in zip(types, shapes) for s in _flatten_shapes(t, sh)]
    return [shapes]


def _conform(value, signature):
    """A generator's value in the structure of ``output_signature``, each leaf converted to its dtype (as
    tf.data does: ``np.asarray(value, dtype)``) and checked against its shape."""
    if isinstance(signature, TensorSpec):
        if value is None or isinstance(value, (dict, tuple, set)):
            raise TypeError(f"`generator` yielded {value!r:.100} where a tensor of {signature!r} was expected")
        if device_util.on_gpu(value):
            leaf = value if value.dtype == signature.dtype else value.astype(signature.dtype)
        else:
            if signature.dtype.kind == "S" and (isinstance(value, (str, bytes, list)) or
                                                isinstance(value, np.ndarray) and value.dtype.kind in "SUO"):
                value = normalize_input(value, "generator")  # (string_array's form, trailing NUL bytes kept)
                if signature.is_compatible_with(value):
                    return value
            try:
                leaf = np.asarray(value, dtype=signature.dtype)
            except (TypeError, ValueError) as e:
                raise TypeError(f"`generator` yielded {value!r:.100}, which is not a {signature.dtype} tensor "
                                f"({e})") from None
            leaf = leaf[()] if leaf.ndim == 0 else to_leaf(leaf, "generator") if leaf.dtype.kind == "S" else leaf
        if not signature.is_compatible_with(leaf):
            raise TypeError(f"`generator` yielded an element of shape {tuple(np.shape(leaf))} where an element of "
                             f"shape {signature.shape} was expected")
        return leaf
    if isinstance(signature, dict):
        if not isinstance(value, dict) or set(value) != set(signature):
            raise TypeError(f"`generator` yielded {value!r:.100}, which does not match the structure of "
                            f"output_signature {signature!r}")
        return type(signature)((k, _conform(value[k], signature[k])) for k in signature)
    if not isinstance(value, tuple) or len(value) != len(signature):  # as tf.data: a list is not a tuple
        raise TypeError(f"`generator` yielded {value!r:.100}, which does not match the structure of "
                        f"output_signature {signature!r}")
    items = [_conform(v, s) for v, s in zip(value, signature)]
    return type(signature)(*items) if hasattr(signature, "_fields") else tuple(items)


class _GeneratorIterator(_Iterator):
    def __init__(self, ds, count):
        super().__init__()
        self._ds, self._count = ds, 0
        self._gen = iter(ds._generator(*ds._args))
        for _ in range(count):  # a restored position: the generator must yield the same values again
            self.next()

    def next(self):
        value = next(self._gen)
        self._count += 1
        return _conform(value, self._ds._signature)

    def save(self):
        return {"count": self._count}

    def close(self):
        close = getattr(self._gen, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # "generator already executing" in another thread: it ends with it
                pass


class IterableDataset(Dataset):
    """``md.data.Dataset(iterable)``: the items of any Python iterable, as they are.

    Checkpointing counts the items taken and, on restore, iterates afresh
    and skips them (so the iterable must be re-iterable and give the same
    items again).
    """

    def __init__(self, iterable=None, options: Options | None = None):
        super().__init__()
        if iterable is not None:
            try:
                iter(iterable)
            except TypeError:
                raise TypeError(f"iterable={iterable!r} is not iterable; pass an iterable of elements") from None
        self._iterable = () if iterable is None else iterable
        self._options = options

    @property
    def files(self):
        """The files the items come from, when the wrapped iterable names them (for FILE sharding)."""
        return getattr(self._iterable, "files", None)

    def _compute_spec(self):
        first = next(iter(self._iterable), None)
        if first is None:
            raise ValueError("element_spec: the dataset is empty, so its elements' structure is unknown")
        return spec_of(normalize_output(first, "dataset element"))

    def _cardinality(self):
        return len(self._iterable) if isinstance(self._iterable, (list, tuple)) else UNKNOWN

    def _make_iterator(self, state=None):
        return _IterableIterator(self._iterable, 0 if state is None else state["count"])



# md.data.Dataset(iterable, options) makes an IterableDataset (Dataset.__new__): inspect and help() show
# that class's parameters rather than __new__'s (*args, **kwargs).
Dataset.__new__.__signature__ = inspect.signature(IterableDataset.__init__)

class CountingIterator(_Iterator):
    """A Python iterator's items; its position is the count taken (a restore iterates afresh and skips)."""

    def __init__(self, it, count: int):
        super().__init__()
        self._it, self._count = it, 0
        for _ in range(count):
            self.next()

    def next(self):
        value = next(self._it)
        self._count += 1
        return value

    def save(self):
        return {"count": self._count}


class _IterableIterator(CountingIterator):
    def __init__(self, iterable, count):
        it = iter(iterable)
        if count and it is iterable:
            raise ValueError(f"cannot restore a position in a one-shot iterator ({type(iterable).__name__}); "
                             "wrap a re-iterable (a list, or an object whose __iter__ starts afresh)")
        super().__init__(it, count)


# --- transformations -----------------------------------------------------------------------------------

class _Batch(Dataset):
    # tf.data's parallel batch is another transformation (distributed datasets cannot see its batch size)
    _parallel = False

    def __init__(self, input_ds, batch_size, drop_remainder):
        super().__init__(input_ds)
        self._batch_size, self._drop = batch_size, drop_remainder

    def _compute_spec(self):
        first = self._batch_size if self._drop else None
        return map_structure(lambda s: TensorSpec(None if s.shape.rank is None else (first,) + s.shape, s.dtype),
                             self._input.element_spec)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return n // self._batch_size if self._drop else math.ceil(n / self._batch_size)

    def _make_iterator(self, state=None):
        # Batches of rows of arrays (optionally shuffled) are gathered with one indexing per component
        # instead of a slice per row and a stack: the same elements, many times faster.
        source = self._input
        if isinstance(source, _Shuffle) and isinstance(source._input, _TensorSlices):
            rows = source._input
            indices = _ShuffleIterator(source, None if state is None else state["indices"],
                                       _Range(rows._rows)._make_iterator(None if state is None else
                                                                         state["indices"]["input"]))
            return _GatherBatchIterator(self, rows, indices, state)
        if isinstance(source, _TensorSlices):
            return _SliceBatchIterator(self, source, 0 if state is None else state["i"])
        return _BatchIterator(self, state)


class _TakingIterator(_Iterator):
    """A batch's worth of its input at a time: ``_take()`` reads up to ``batch_size`` items, the last batch
    short (or none, with ``drop_remainder``); ``_done`` once the input has ended."""

    def __init__(self, ds, source, state):
        super().__init__(source)
        self._ds = ds
        self._done = False if state is None else state["done"]

    def _take(self) -> list:
        items = []
        while not self._done and len(items) < self._ds._batch_size:
            try:
                items.append(self._inputs[0].next())
            except StopIteration:
                self._done = True
        if not items or (self._ds._drop and len(items) < self._ds._batch_size):
            raise StopIteration
        return items


class _BatchIterator(_TakingIterator):
    def __init__(self, ds, state, pad=None):
        super().__init__(ds, ds._input._make_iterator(None if state is None else state["input"]), state)
        self._pad = pad

    def next(self):
        elements = self._take()
        leaves = [flatten(e) for e in elements]
        for i, lv in enumerate(leaves[1:], 1):
            if len(lv) != len(leaves[0]):
                raise ValueError(f"batch: element {i} has {len(lv)} components, element 0 has {len(leaves[0])}")
        columns = [list(column) for column in zip(*leaves)]
        if self._pad is not None:
            columns = [_pad(column, c, target, value)
                       for c, (column, target, value) in enumerate(zip(columns, *self._pad))]
        return pack_sequence_as(elements[0], [stack(column, c) for c, column in enumerate(columns)])

    def save(self):
        return {"input": self._inputs[0].save(), "done": self._done}


class _PaddedBatch(_Batch):
    def __init__(self, input_ds, batch_size, drop_remainder, padded_shapes, padding_values):
        super().__init__(input_ds, batch_size, drop_remainder)
        self._padded_shapes, self._padding_values = padded_shapes, padding_values

    def _targets(self, spec) -> list:
        """One shape per component: a size, or None (the largest in the batch) per dimension."""
        leaves = flatten(spec)
        if self._padded_shapes is None:
            return [[None] * len(s.shape) for s in leaves]
        shapes = _flatten_shapes(spec, self._padded_shapes)
        if len(shapes) != len(leaves):
            raise ValueError(f"padded_shapes={self._padded_shapes!r} does not match the structure of the elements "
                             f"{spec!r}")
        out = []
        for s, shape in zip(leaves, shapes):
            shape = [None if d is None or d == -1 else int(d) for d in (() if shape is None else shape)]
            if len(shape) != len(s.shape):
                raise ValueError(f"padded_shapes: {tuple(shape)} has rank {len(shape)}, the component has rank "
                                 f"{len(s.shape)} ({s!r})")
            out.append(shape)
        return out

    def _values(self, spec) -> list:
        leaves = flatten(spec)
        if self._padding_values is None:
            return [b"" if s.dtype.kind == "S" else 0 for s in leaves]
        values = flatten(self._padding_values)
        if len(values) == 1 and len(leaves) > 1:
            values = values * len(leaves)
        if len(values) != len(leaves):
            raise ValueError(f"padding_values={self._padding_values!r} does not match the structure of the "
                             f"elements {spec!r}")
        values = [to_leaf(v, "padding_values") for v in values]
        for v, s in zip(values, leaves):
            if TensorSpec((), v.dtype).dtype != s.dtype:  # tf.data converts as tf.constant: 0 is int32, 0.0 float32
                raise TypeError(f"Invalid `padding_values`. `padding_values` values type {v.dtype} does not match type "
                                f"{s.dtype} of the corresponding input component; pass e.g. np.{s.dtype}({v!r})")
        return values

    def _compute_spec(self):
        # TF's spec is the padded shape: without padded_shapes the input's, with them exactly those (a None or
        # -1 dimension unknown, even where the input's is static).
        spec = self._input.element_spec
        first = self._batch_size if self._drop else None
        return pack_sequence_as(spec, [
            TensorSpec((first,) + (tuple(s.shape) if self._padded_shapes is None else tuple(target)), s.dtype)
            for s, target in zip(flatten(spec), self._targets(spec))])

    def _make_iterator(self, state=None):
        return _BatchIterator(self, state, pad=(self._targets(self._input.element_spec),
                                                 self._values(self._input.element_spec)))


class _GatherBatchIterator(_TakingIterator):
    """``batch`` over the rows of ``from_tensor_slices`` (read in the order ``indices`` gives)."""

    def __init__(self, ds, rows, indices, state):
        super().__init__(ds, indices, state)
        self._rows = rows

    def next(self):
        index = np.asarray(self._take(), dtype=np.int64)
        return pack_sequence_as(self._rows._structure, [row(leaf, index) for leaf in self._rows._leaves])

    def save(self):
        return {"indices": self._inputs[0].save(), "done": self._done}


class _SliceBatchIterator(_Iterator):
    """``batch`` straight over the rows of ``from_tensor_slices``: each batch a copy of a slice."""

    def __init__(self, ds, rows, i):
        super().__init__()
        self._ds, self._rows, self._i = ds, rows, i

    def next(self):
        lo, hi = self._i, min(self._i + self._ds._batch_size, self._rows._rows)
        if lo >= hi or (self._ds._drop and hi - lo < self._ds._batch_size):
            raise StopIteration
        self._i = hi
        return pack_sequence_as(self._rows._structure, [leaf[lo:hi].copy() for leaf in self._rows._leaves])

    def save(self):
        return {"i": self._i}


def _pad(column: list, component: int, target: list, value) -> list:
    """The leaves of one component padded at the end of each dimension to ``target`` (None: the batch's
    largest)."""
    shapes = [tuple(np.shape(x)) for x in column]
    if any(len(s) != len(target) for s in shapes):
        raise ValueError(f"padded_batch: component {component} has elements of ranks {sorted({len(s) for s in shapes})}"
                         f", expected rank {len(target)}")
    size = [max(s[d] for s in shapes) if t is None else t for d, t in enumerate(target)]
    out = []
    for x, shape in zip(column, shapes):
        if any(n > m for n, m in zip(shape, size)):
            raise ValueError(f"padded_batch: component {component} has an element of shape {list(shape)}, larger "
                             f"than its padded shape {size}; raise padded_shapes")
        xp = array_module(x)
        out.append(xp.pad(x, [(0, m - n) for n, m in zip(shape, size)], constant_values=value) if shape != tuple(size)
                   else x)
    return out


def _check_batch_sizes(leaves) -> None:
    """TF's check of an element that unbatch or rebatch splits: every component has the same first dimension."""
    for c, leaf in enumerate(leaves):
        if leaf.ndim == 0:
            raise ValueError(f"Cannot unbatch an input with scalar components (component {c} is a scalar)")
        if leaf.shape[0] != leaves[0].shape[0]:
            raise ValueError(f"Input element must have the same batch size in each component. Component 0 had size "
                             f"{leaves[0].shape[0]} but component {c} had size, {leaf.shape[0]}.")


class _Unbatch(Dataset):
    def __init__(self, input_ds):
        super().__init__(input_ds)
        known = [s.shape[0] for s in flatten(input_ds.element_spec) if s.shape.rank and s.shape[0] is not None]
        if len(set(known)) > 1:
            raise ValueError("`unbatch()` is only supported for datasets of elements whose components have a "
                             f"matching leading dimension. Encountered both {known[0]} and "
                             f"{next(k for k in known if k != known[0])}.")

    def _cardinality(self):
        """Known when the input's is and its batch dimension is (one size above 0 for every component), as in
        tf.data: an unknown batch dimension makes even an empty input's unknown."""
        n = self._input._cardinality()
        rows = {s.shape[0] if s.shape.rank else None for s in flatten(self._input.element_spec)}
        if n < 0:
            return n
        if len(rows) != 1 or None in rows or 0 in rows:
            return UNKNOWN
        return n * rows.pop()

    def _compute_spec(self):
        def row(s):
            if s.shape.rank is None:
                return s
            if s.shape.rank == 0:
                raise ValueError("Cannot unbatch an input with scalar components; unbatch needs every component "
                                 "to have rank >= 1 (batch the dataset first)")
            return TensorSpec(s.shape[1:], s.dtype)
        return map_structure(row, self._input.element_spec)

    def _make_iterator(self, state=None):
        return _UnbatchIterator(self, state)


class _UnbatchIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._current = None if state is None else state["current"]
        self._row = 0 if state is None else state["row"]

    def next(self):
        while True:
            if self._current is not None:
                leaves = flatten(self._current)
                if self._row < leaves[0].shape[0]:
                    self._row += 1
                    return pack_sequence_as(self._current, [row(leaf, self._row - 1) for leaf in leaves])
            element = self._inputs[0].next()
            _check_batch_sizes(flatten(element))
            self._current, self._row = element, 0

    def save(self):
        return {"input": self._inputs[0].save(), "current": self._current, "row": self._row}


STAND_IN_SIZE = 7  # an unknown dimension's size in a stand-in element (a size few static dimensions have)


def _filled(shape, dtype):
    """A leaf of ``shape``: empty strings, or ones."""
    if dtype.kind == "S":
        return np.bytes_(b"") if shape == () else string_array([b""] * int(np.prod(shape)), shape)
    return np.ones(shape, dtype)[()]


def _stand_in(spec):
    """An element of ``spec`` for a function to run on when the input gives none (tf.data traces the function
    over the spec instead): ones (less likely than zeros to be what a function fails on) and empty strings, each
    unknown dimension of ``STAND_IN_SIZE`` (an unknown rank: a scalar), an empty dataset for a dataset component."""
    def leaf(s):
        if isinstance(s, DatasetSpec):
            return _WindowComponent([], s.element_spec)
        shape = () if s.shape.rank is None else tuple(STAND_IN_SIZE if d is None else d for d in s.shape)
        return _filled(shape, s.dtype)
    return map_structure(leaf, spec)


def _run_for_spec(input_ds, run, what: str, count: int = 1):
    """(``run(element)``, element) for the first of the input's first ``count`` elements that ``run`` accepts,
    else for a stand-in element of the input's spec: tf.data traces the function over the spec, so neither an
    empty input nor data the function (or the input) fails on leaves the spec unknown."""
    error = None
    try:
        elements = input_ds._peek(count)
    except Exception as e:  # noqa: BLE001  (the input's error comes at its place when iterating)
        elements, error = [], e
    for element in elements:
        try:
            return run(element), element
        except Exception as e:  # noqa: BLE001  (so may the function's)
            error = error or e
    element = _stand_in(input_ds.element_spec)
    try:
        return run(element), element
    except Exception as e:
        if error is not None:
            raise error from None  # the data's own error says more than the stand-in's
        raise ValueError(f"element_spec of {what}: the input is empty, and the function failed on a stand-in "
                         f"element of its spec ({type(e).__name__}: {e})") from e


def _resized(element, input_spec, size):
    """``element`` with each dimension its spec leaves unknown of ``size(n)`` for its size ``n`` (those leaves ones
    or empty strings), or None for device arrays: a function's result for it shows which output dimensions
    follow those sizes."""
    def leaf(x, s):
        if not isinstance(x, (np.ndarray, np.generic)):
            raise TypeError
        if not isinstance(s, TensorSpec) or s.shape.rank is None or None not in tuple(s.shape):
            return x
        shape = tuple(size(n) if d is None else n for n, d in zip(np.shape(x), s.shape))
        return _filled(shape, s.dtype)
    try:
        return pack_sequence_as(element, [leaf(x, s) for x, s in zip(flatten(element), flatten(input_spec))])
    except TypeError:
        return None


def _traced_spec(out_spec, element, input_spec, respec, out=None):
    """``out_spec``, the spec ``respec(element)`` gave, as tf.data's tracing over ``input_spec`` has it. A leaf of
    the result ``out`` that is a leaf of the element passed unchanged keeps the element's spec of it. Where the
    input spec leaves dimensions unknown, ``respec`` runs again on the element with them one longer and empty:
    an output dimension that changes with them is unknown (as TF's shape inference has ``x[:1]`` of an unknown
    length); when the longer run fails, a dimension equal to one of their sizes is."""
    inputs = [(leaf, s) for leaf, s in zip(flatten(element), flatten(input_spec)) if isinstance(s, TensorSpec)]
    passed = {id(leaf): s for leaf, s in inputs}
    unknown = {leaf.shape[d] for leaf, s in inputs if s.shape.rank is not None
               for d in range(len(s.shape)) if s.shape[d] is None}
    count = len(flatten(out_spec))
    probes = []
    for size in ((lambda n: n + 1), (lambda n: 0)) if unknown else ():
        resized = _resized(element, input_spec, size)
        try:
            probe = flatten(respec(resized)) if resized is not None else []
        except Exception:  # noqa: BLE001  (a function may not take made-up values)
            probe = []
        if len(probe) != count:
            break  # the longer run decides alone; without it, the sizes do
        probes.append(probe)

    def general(i, s):
        if not isinstance(s, TensorSpec) or s.shape.rank is None:
            return s
        if probes:
            dims = list(s.shape)
            for probe in probes:
                p = probe[i]
                if not isinstance(p, TensorSpec) or p.shape.rank != s.shape.rank:
                    return TensorSpec(None, s.dtype)
                dims = [d if d == q else None for d, q in zip(dims, p.shape)]
            return TensorSpec(dims, s.dtype)
        return TensorSpec([None if d in unknown else d for d in s.shape], s.dtype)
    leaves = flatten(out) if out is not None else [None] * count
    return pack_sequence_as(out_spec, [passed[id(leaf)] if leaf is not None and id(leaf) in passed else general(i, s)
                                       for i, (leaf, s) in enumerate(zip(leaves, flatten(out_spec)))])


class _Map(Dataset):
    def __init__(self, input_ds, fn, num_parallel_calls, deterministic):
        super().__init__(input_ds)
        if not callable(fn):
            raise ValueError(f"map_func={fn!r} is not callable; pass a function of the element")
        if num_parallel_calls is not None:
            num_parallel_calls = _positive_int(num_parallel_calls, "num_parallel_calls", allow=(AUTOTUNE,))
        self._fn, self._parallel, self._deterministic = fn, num_parallel_calls, deterministic

    def _compute_spec(self):
        # tf.data traces map_func over the input's spec; here it runs once on the first input element.
        run = lambda e: normalize_output(_call(self._fn, e), "map_func")  # noqa: E731
        out, element = _run_for_spec(self._input, run, "map")
        return _traced_spec(spec_of(out), element, self._input.element_spec, lambda e: spec_of(run(e)), out)

    def _cardinality(self):
        return self._input._cardinality()

    def _make_iterator(self, state=None):
        if self._parallel is None or DEBUG_MODE:
            return _MapIterator(self, state)
        return _ParallelMapIterator(self, state)


class _MapIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._fn = ds._fn

    def next(self):
        return normalize_output(_call(self._fn, self._inputs[0].next()), "map_func")

    def save(self):
        return {"input": self._inputs[0].save()}


def _apply(fn, element):
    return normalize_output(_call(fn, element), "map_func")


class _ParallelMapIterator(_Iterator):
    """Up to ``num_parallel_calls`` calls in flight in a thread pool; results in input order unless
    ``deterministic=False``. AUTOTUNE starts at the CPU count and doubles the calls in flight whenever the
    consumer has to wait for a result (up to 4 per CPU, at least 8): I/O-bound functions get the overlap
    they need."""

    _POOL_NAME = "md.data-map"

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._fn = ds._fn
        self._autotune = ds._parallel == AUTOTUNE
        cap = _parallelism_cap()
        self._target = min(os.cpu_count() or 1, cap) if self._autotune else ds._parallel
        # autotune.enabled=False: AUTOTUNE stays at its first value, as TF's fixed default parallelism.
        self._cap = (cap if _pipeline_options(ds).autotune.enabled is not False else self._target) \
            if self._autotune else ds._parallel
        self._workers = _thread_limit(ds, self._cap)
        self._ordered = _ordered(ds, ds._deterministic)
        self._ready = deque(() if state is None else state["ready"])
        self._input_done = False if state is None else state["input_done"]
        self._pending = deque()
        self._pool = None

    def _fill(self):
        while len(self._pending) < self._target and not self._input_done:
            try:
                element = self._inputs[0].next()
            except StopIteration:
                self._input_done = True
                return
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(self._workers, thread_name_prefix=self._POOL_NAME)
            self._pending.append(self._pool.submit(_apply, self._fn, element))

    def next(self):
        if self._ready:
            return self._ready.popleft()
        self._fill()
        if not self._pending:
            raise StopIteration
        if self._ordered:
            head = self._pending[0]
            if not head.done() and self._autotune and self._target < self._cap:
                self._target = min(2 * self._target, self._cap)
                self._fill()
            self._pending.popleft()
            return head.result()
        done, _ = futures.wait(self._pending, return_when=futures.FIRST_COMPLETED)
        first = next(f for f in self._pending if f in done)
        self._pending.remove(first)
        return first.result()

    def save(self):
        # Finish the calls in flight: their results are part of the state, the input is past them.
        while self._pending:
            self._ready.append(self._pending.popleft().result())
        return {"input": self._inputs[0].save(), "ready": list(self._ready), "input_done": self._input_done}

    def close(self):
        if self._pool is not None:
            # A pool thread cannot wait for itself (garbage collection may close an iterator anywhere).
            in_pool = threading.current_thread().name.startswith(self._POOL_NAME)
            self._pool.shutdown(wait=not in_pool, cancel_futures=True)
        super().close()


class _Interleave(Dataset):
    def __init__(self, input_ds, fn, cycle_length, block_length, num_parallel_calls=None, deterministic=None):
        super().__init__(input_ds)
        if not callable(fn):
            raise ValueError(f"map_func={fn!r} is not callable; pass a function of the element")
        self._fn, self._cycle, self._block = fn, cycle_length, block_length
        self._parallel, self._deterministic = num_parallel_calls, deterministic

    def _check_parallel_calls(self) -> None:
        if self._parallel is not None and self._parallel != AUTOTUNE and self._parallel > self._cycle:
            raise ValueError("If `cycle_length` is set to a fixed value, `num_parallel_calls` must be either "
                             "`tf.data.AUTOTUNE` or a value less than or equal to `cycle_length`. However, "
                             f"`num_parallel_calls` is {self._parallel} and `cycle_length` is {self._cycle}")

    def _inner(self, element) -> Dataset:
        ds = _call(self._fn, element)
        if not isinstance(ds, Dataset):
            raise TypeError(f"map_func must return an md.data.Dataset, got {type(ds).__name__}")
        return ds

    def _compute_spec(self):
        # The first of map_func's datasets whose spec is known (an empty one may not know it: its own map never
        # ran), as tracing over the input's spec gives it.
        respec = lambda e: self._inner(e).element_spec  # noqa: E731
        out, element = _run_for_spec(self._input, respec, "interleave", 16)
        return _traced_spec(out, element, self._input.element_spec, respec)

    def _make_iterator(self, state=None):
        self._check_parallel_calls()
        if self._parallel is None or DEBUG_MODE:
            return _InterleaveIterator(self, state)
        return _ParallelInterleaveIterator(self, state)


class _InterleaveIterator(_Iterator):
    """tf.data's order: ``cycle_length`` open datasets, ``block_length`` elements from each in turn; a dataset
    that ends is replaced by the next input element's in the same place of the cycle."""

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        self._slots = [None] * ds._cycle  # (input element, its dataset's iterator)
        self._index, self._taken, self._input_done = 0, 0, False
        if state is not None:
            self._index, self._taken, self._input_done = state["index"], state["taken"], state["input_done"]
            for i, slot in enumerate(state["slots"]):
                if slot is not None:
                    element = _element_from_state(slot[0], ds._input.element_spec)
                    self._slots[i] = (element, self._open_inner(element, slot[1]))

    def _open_inner(self, element, state=None) -> _Iterator:
        return self._ds._inner(element)._make_iterator(state)

    def _open(self, i) -> bool:
        if self._input_done:
            return False
        try:
            element = self._inputs[0].next()
        except StopIteration:
            self._input_done = True
            return False
        self._slots[i] = (element, self._open_inner(element))
        return True

    def next(self):
        while True:
            if self._input_done and all(s is None for s in self._slots):
                raise StopIteration
            i = self._index
            if self._slots[i] is None and not self._open(i):
                self._advance()
                continue
            try:
                value = self._take(i)
            except StopIteration:
                self._advance()
                continue
            self._taken += 1
            if self._taken >= self._ds._block:
                self._advance()
            return value

    def _take(self, i):
        """The next element of slot ``i``; at its end the slot is closed and emptied (StopIteration)."""
        try:
            return self._slots[i][1].next()
        except StopIteration:
            self._slots[i][1].close()
            self._slots[i] = None
            raise

    def _advance(self):
        self._index, self._taken = (self._index + 1) % len(self._slots), 0

    def save(self):
        return {"input": self._inputs[0].save(), "index": self._index, "taken": self._taken,
                "input_done": self._input_done,
                "slots": [None if s is None else (_element_state(s[0]), s[1].save()) for s in self._slots]}

    def close(self):
        for slot in self._slots:
            if slot is not None:
                slot[1].close()
        super().close()


class _Throttled(_Iterator):
    """An iterator whose ``next()`` waits for one of the interleave's ``num_parallel_calls`` permits."""

    def __init__(self, source, permits: threading.Semaphore):
        super().__init__(source)
        self._permits = permits

    def next(self):
        with self._permits:
            return self._inputs[0].next()

    def save(self):
        return self._inputs[0].save()


class _ParallelInterleaveIterator(_InterleaveIterator):
    """``interleave(num_parallel_calls=...)``: every open dataset is read ahead (``block_length`` elements) by
    a thread of its own, at most ``num_parallel_calls`` reading at a time. In order (tf.data's), unless
    ``deterministic=False``: then, when the dataset whose turn it is has nothing ready, the first other open
    dataset with an element ready gives it."""

    def __init__(self, ds, state):
        calls = ds._cycle if ds._parallel == AUTOTUNE else ds._parallel
        self._permits = threading.Semaphore(_thread_limit(ds, calls))
        self._ready = threading.Condition()  # notified whenever a slot's reader has an element (or its end)
        self._ordered = _ordered(ds, ds._deterministic)
        super().__init__(ds, state)

    def _open_inner(self, element, state=None) -> _Iterator:
        inner = self._ds._inner(element)._make_iterator(None if state is None else state["input"])
        return PrefetchIterator(_Throttled(inner, self._permits), self._ds._block,
                                () if state is None else state["buffer"], name="md.data-interleave",
                                on_ready=self._notify)

    def _notify(self) -> None:
        with self._ready:
            self._ready.notify_all()

    def next(self):
        if self._ordered:
            return super().next()
        while True:
            while not self._input_done and any(s is None for s in self._slots):
                self._open(self._slots.index(None))  # every place of the cycle reading
            if self._input_done and all(s is None for s in self._slots):
                raise StopIteration
            i = self._index
            if self._slots[i] is None or not self._slots[i][1].ready():
                with self._ready:
                    while not any(s is not None and s[1].ready() for s in self._slots):
                        self._ready.wait()
                i = next(j for j, s in enumerate(self._slots) if s is not None and s[1].ready())
            try:
                value = self._take(i)
            except StopIteration:
                if i == self._index:
                    self._advance()
                continue
            if i == self._index:
                self._taken += 1
                if self._taken >= self._ds._block:
                    self._advance()
            return value


def _element_state(element) -> list:
    """An input element of interleave/flat_map as checkpoint state: its leaves, a window's as its values."""
    return [x._values if isinstance(x, _WindowComponent) else x for x in flatten(element)]


def _element_from_state(leaves: list, spec):
    return pack_sequence_as(spec, [_WindowComponent(list(v), s.element_spec) if isinstance(s, DatasetSpec) else v
                                   for v, s in zip(leaves, flatten(spec))])


class _Filter(Dataset):
    def __init__(self, input_ds, predicate):
        super().__init__(input_ds)
        if not callable(predicate):
            raise ValueError(f"predicate={predicate!r} is not callable; pass a function of the element")
        self._fn = self._predicate = predicate

    def _make_iterator(self, state=None):
        return _FilterIterator(self, state)


class _FilterIterator(_MapIterator):
    def __init__(self, ds, state):
        super().__init__(ds, state)
        self._predicate = ds._predicate

    def next(self):
        while True:
            element = self._inputs[0].next()
            if _scalar_bool(_call(self._predicate, element)):
                return element


class _Shuffle(Dataset):
    def __init__(self, input_ds, buffer_size, seed, reshuffle):
        super().__init__(input_ds)
        self._buffer_size, self._reshuffle = buffer_size, reshuffle
        # seed=None: a random seed, drawn once per dataset (its iterations differ by their epoch number).
        self._seeded = seed is not None
        self._seed = _seed_of(seed)
        self._epochs = 0  # iterations started so far: each reshuffles with its own stream

    def _cardinality(self):
        return self._input._cardinality()

    def _clone(self, inputs):
        clone = super()._clone(inputs)
        clone._epochs = 0
        return clone

    def _make_iterator(self, state=None):
        return _ShuffleIterator(self, state)


class _ShuffleIterator(_Iterator):
    """tf.data's buffer: the first ``buffer_size`` inputs fill it; each output is a uniformly random buffer
    entry, whose place the next input takes."""

    def __init__(self, ds, state, source=None):
        super().__init__(source if source is not None else
                         ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        if state is None:
            epoch = ds._epochs if ds._reshuffle else 0
            ds._epochs += 1
            self._rng = np.random.Generator(np.random.PCG64([ds._seed, epoch]))
            self._buffer, self._input_done = [], False
        else:
            ds._epochs = state["epochs"]
            self._rng = np.random.Generator(np.random.PCG64())
            self._rng.bit_generator.state = state["rng"]
            self._buffer, self._input_done = list(state["buffer"]), state["input_done"]

    def _pull(self) -> None:
        if self._input_done:
            return
        try:
            self._buffer.append(self._inputs[0].next())
        except StopIteration:
            self._input_done = True

    def next(self):
        while len(self._buffer) < self._ds._buffer_size and not self._input_done:
            self._pull()
        if not self._buffer:
            raise StopIteration
        j = int(self._rng.integers(len(self._buffer)))
        element = self._buffer[j]
        self._buffer[j] = self._buffer[-1]
        self._buffer.pop()
        return element

    def save(self):
        return {"input": self._inputs[0].save(), "rng": self._rng.bit_generator.state, "buffer": self._buffer,
                "input_done": self._input_done, "epochs": self._ds._epochs}


class _Repeat(Dataset):
    def __init__(self, input_ds, count):
        super().__init__(input_ds)
        self._times = count

    def _cardinality(self):
        n = self._input._cardinality()
        if self._times == 0:
            return 0
        if self._times == -1:
            return 0 if n == 0 else INFINITE_CARDINALITY
        return n * self._times if n >= 0 else n

    def _make_iterator(self, state=None):
        return _RepeatIterator(self, state)


class _RepeatIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__()
        self._ds = ds
        self._epoch = 0 if state is None else state["epoch"]
        self._seen = False if state is None else state["seen"]  # this epoch produced an element
        if self._ds._times == -1 or self._epoch < self._ds._times:
            self._inputs = [ds._input._make_iterator(None if state is None else state["input"])]

    def next(self):
        while self._inputs:
            try:
                element = self._inputs[0].next()
                self._seen = True
                return element
            except StopIteration:
                self._inputs.pop().close()
                empty_epoch = not self._seen
                self._epoch, self._seen = self._epoch + 1, False
                # An epoch without elements ends an endless repeat instead of spinning forever.
                if (self._ds._times == -1 and not empty_epoch) or self._epoch < self._ds._times:
                    self._inputs = [self._ds._input._make_iterator()]
        raise StopIteration

    def save(self):
        return {"epoch": self._epoch, "seen": self._seen,
                "input": self._inputs[0].save() if self._inputs else None}


class _Take(Dataset):
    def __init__(self, input_ds, count):
        super().__init__(input_ds)
        self._n = count

    def _cardinality(self):
        n = self._input._cardinality()
        if self._n == -1:
            return n
        return self._n if n in (INFINITE_CARDINALITY,) or n >= self._n else (n if n >= 0 else UNKNOWN)

    def _make_iterator(self, state=None):
        return _TakeIterator(self, state)


class _TakeIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._left = ds._n if state is None else state["left"]

    def next(self):
        if self._left == 0:
            raise StopIteration
        element = self._inputs[0].next()
        if self._left > 0:
            self._left -= 1
        return element

    def save(self):
        return {"input": self._inputs[0].save(), "left": self._left}


class _Skip(_Take):
    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return 0 if self._n == -1 else max(n - self._n, 0)

    def _make_iterator(self, state=None):
        return _SkipIterator(self, state)


class _SkipIterator(_TakeIterator):
    def next(self):
        if self._left == -1:  # tf.data's skip(-1) is empty without reading its input (which may be endless)
            raise StopIteration
        while self._left != 0:
            self._inputs[0].next()
            if self._left > 0:
                self._left -= 1
        return self._inputs[0].next()


class _Cache(Dataset):
    def __init__(self, input_ds, filename):
        super().__init__(input_ds)
        self._filename = filename
        self._elements = None  # the complete first pass, once one finished

    def _cardinality(self):
        return self._input._cardinality()

    def _clone(self, inputs):
        clone = super()._clone(inputs)
        clone._elements = None
        return clone

    @property
    def _path(self) -> str:
        return f"{self._filename}.md-cache.npz"

    def _cached(self):
        if self._elements is None and self._filename and os.path.exists(self._path):
            from .structure import decode_state

            with np.load(self._path, allow_pickle=False) as f:
                self._elements = decode_state(dict(f))
        return self._elements

    def _store(self, elements) -> None:
        if self._filename:
            from .structure import encode_state

            tmp = f"{self._filename}.md-cache.tmp-{os.getpid()}.npz"
            np.savez(tmp, **encode_state(elements))
            os.replace(tmp, self._path)
        self._elements = elements

    def _make_iterator(self, state=None):
        cached = self._cached()
        if cached is None and state is not None and state["read"]:
            # Restored in a new process whose cache is empty: refill it from the (deterministic) input.
            rebuild = self._make_iterator()
            try:
                while True:
                    rebuild.next()
            except StopIteration:
                pass
            cached = self._cached()
        if cached is not None:
            return _CacheReadIterator(cached, 0 if state is None else state["i"])
        if self._filename:
            # As TF, which takes its lock file first: a cache file that cannot be written fails before the
            # first element, not after a whole pass.
            tmp = f"{self._filename}.md-cache.tmp-{os.getpid()}.npz"
            try:
                open(tmp, "wb").close()
                os.remove(tmp)
            except OSError as e:
                raise from_os_error(e, f"cache(filename={self._filename!r}): cannot write {tmp}; {e.strerror} "
                                       "(pass a filename in an existing, writable directory)") from None
        return _CacheFillIterator(self, state)


class _CacheFillIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        self._elements = [] if state is None else list(state["elements"])

    def next(self):
        try:
            element = self._inputs[0].next()
        except StopIteration:
            if self._ds._elements is None:
                self._ds._store(self._elements)
            raise
        self._elements.append(element)
        return element

    def save(self):
        return {"read": False, "input": self._inputs[0].save(), "elements": self._elements}


class _CacheReadIterator(_ListIterator):
    def save(self):
        return {"read": True, "i": self._i}


class _Prefetch(Dataset):
    def __init__(self, input_ds, buffer_size):
        super().__init__(input_ds)
        self._buffer_size = buffer_size

    def _cardinality(self):
        return self._input._cardinality()

    def _make_iterator(self, state=None):
        if self._buffer_size == 0 or DEBUG_MODE:
            return self._input._make_iterator(state)
        return PrefetchIterator(self._input._make_iterator(None if state is None else state["input"]),
                                self._buffer_size, () if state is None else state["buffer"])


class PrefetchIterator(_Iterator):
    """A background thread keeps up to ``buffer_size`` elements of ``source`` ready (AUTOTUNE: the buffer
    grows by one, up to 16, whenever the consumer finds it empty). Errors arrive in order; a save pauses the
    thread and stores the buffered elements with the source's state. ``transform`` (optional) runs on each
    element in the thread; the buffer keeps both forms and a save stores the untransformed one."""

    _AUTOTUNE_CAP = 16

    def __init__(self, source, buffer_size, buffered=(), transform=None, name="md.data-prefetch", on_ready=None):
        super().__init__(source)
        self._transform, self._on_ready = transform, on_ready
        self._size = 1 if buffer_size == AUTOTUNE else buffer_size
        self._autotune = buffer_size == AUTOTUNE
        self._cond = threading.Condition()
        self._buffer = deque((e, self._apply(e), None) for e in buffered)
        self._end = self._stop = self._paused = self._busy = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def _apply(self, element):
        return element if self._transform is None else self._transform(element)

    def _run(self):
        cond = self._cond
        while True:
            with cond:
                while not self._stop and (self._paused or len(self._buffer) >= self._size):
                    cond.wait()
                if self._stop:
                    return
                self._busy = True
            try:
                element = self._inputs[0].next()
                item = (element, self._apply(element), None)
            except StopIteration:
                item = None
            except BaseException as e:  # delivered to the consumer in order, with its traceback
                item = (None, None, e)
            with cond:
                self._busy = False
                if item is None or item[2] is not None:
                    self._end = True
                if item is not None:
                    self._buffer.append(item)
                cond.notify_all()
            if self._on_ready is not None:
                self._on_ready()
            if self._end:
                return

    def next(self):
        with self._cond:
            while not self._buffer and not self._end:
                if self._autotune and self._size < self._AUTOTUNE_CAP:
                    self._size += 1
                    self._cond.notify_all()
                self._cond.wait()
            if not self._buffer:
                raise StopIteration
            _, element, error = self._buffer.popleft()
            self._cond.notify_all()
        if error is not None:
            raise error
        return element

    def ready(self) -> bool:
        """Whether ``next()`` would return (an element, an error or the end) without waiting."""
        with self._cond:
            return bool(self._buffer) or self._end

    def save(self):
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()
            try:
                return {"input": self._inputs[0].save(),
                        "buffer": [raw for raw, _, error in self._buffer if error is None]}
            finally:
                self._paused = False
                self._cond.notify_all()

    def close(self):
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        super().close()


class _Shard(Dataset):
    def __init__(self, input_ds, num_shards, index):
        super().__init__(input_ds)
        self._n, self._index = num_shards, index

    def _cardinality(self):
        n = self._input._cardinality()
        return n if n < 0 else len(range(self._index, n, self._n))

    def _make_iterator(self, state=None):
        return _ShardIterator(self, state)


class _ShardIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds

    def next(self):
        # Skip the other shards' elements before and after this shard's one, so the position is a whole round.
        for _ in range(self._ds._index):
            self._inputs[0].next()
        element = self._inputs[0].next()
        for _ in range(self._ds._n - self._ds._index - 1):
            try:
                self._inputs[0].next()
            except StopIteration:
                break
        return element

    def save(self):
        return {"input": self._inputs[0].save()}


def _same_structure(a, b) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b) and all(
            _same_structure(a[k], b[k]) for k in a)
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(
            _same_structure(x, y) for x, y in zip(a, b))
    return True


class _Concatenate(Dataset):
    def __init__(self, first, second):
        if not isinstance(second, Dataset):
            raise TypeError(f"dataset={second!r}: expected an md.data.Dataset")
        super().__init__(first, second)
        self._spec = self._compute_spec()  # (refuses incompatible elements now, as TF does, not at a later pass)

    def _compute_spec(self):
        a, b = self._inputs[0].element_spec, self._inputs[1].element_spec
        if not _same_structure(a, b) or any(x.dtype != y.dtype for x, y in zip(flatten(a), flatten(b))):
            raise TypeError(f"Incompatible dataset elements:\n  {a} vs.\n  {b}; concatenate needs the same "
                            "structure (tuple lengths, dict keys) and dtypes")
        # Shapes may differ: dimensions that differ become None, and the whole shape where the ranks differ.
        return pack_sequence_as(a, [x.most_specific_compatible(y) for x, y in zip(flatten(a), flatten(b))])

    def _cardinality(self):
        a, b = (d._cardinality() for d in self._inputs)
        if INFINITE_CARDINALITY in (a, b):
            return INFINITE_CARDINALITY
        return UNKNOWN if UNKNOWN in (a, b) else a + b

    def _make_iterator(self, state=None):
        return _ConcatenateIterator(self, state)


class _ConcatenateIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__()
        self._ds = ds
        self._which = 0 if state is None else state["which"]
        self._inputs = [ds._inputs[self._which]._make_iterator(None if state is None else state["input"])]

    def next(self):
        try:
            return self._inputs[0].next()
        except StopIteration:
            if self._which == 1:
                raise
            self._inputs.pop().close()
            self._which = 1
            self._inputs = [self._ds._inputs[1]._make_iterator()]
            return self._inputs[0].next()

    def save(self):
        return {"which": self._which, "input": self._inputs[0].save()}


class _Zip(Dataset):
    def __init__(self, datasets):
        flat = flatten(datasets)
        for d in flat:
            if not isinstance(d, Dataset):
                raise TypeError(f"zip: every item must be an md.data.Dataset, got {type(d).__name__}")
        if not flat:
            raise TypeError("Must pass at least one dataset to `zip`.")
        super().__init__(*flat)
        self._structure = datasets

    def _compute_spec(self):
        return pack_sequence_as(self._structure, [d.element_spec for d in self._inputs])

    def _cardinality(self):
        counts = [d._cardinality() for d in self._inputs]
        known = [c for c in counts if c >= 0]
        if known:
            return min(known) if UNKNOWN not in counts else UNKNOWN
        return UNKNOWN if UNKNOWN in counts else INFINITE_CARDINALITY

    def _make_iterator(self, state=None):
        return _ZipIterator(self, state)


class _ZipIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(*(d._make_iterator(None if state is None else s)
                           for d, s in zip(ds._inputs, [None] * len(ds._inputs) if state is None else state)))
        self._structure = ds._structure

    def next(self):
        return pack_sequence_as(self._structure, [it.next() for it in self._inputs])

    def save(self):
        return [it.save() for it in self._inputs]


class _Enumerate(Dataset):
    def __init__(self, input_ds, start):
        super().__init__(input_ds)
        self._start = start

    def _compute_spec(self):
        return (TensorSpec((), np.int64), self._input.element_spec)

    def _cardinality(self):
        return self._input._cardinality()

    def _make_iterator(self, state=None):
        return _EnumerateIterator(self, state)


class _EnumerateIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._i = ds._start if state is None else state["i"]

    def next(self):
        element = self._inputs[0].next()
        self._i += 1
        return (np.int64(self._i - 1), element)

    def save(self):
        return {"input": self._inputs[0].save(), "i": self._i}


def _patterns(file_pattern) -> list:
    if isinstance(file_pattern, (str, bytes, os.PathLike)):
        file_pattern = [file_pattern]
    elif isinstance(file_pattern, Dataset):
        file_pattern = list(file_pattern)
    elif isinstance(file_pattern, np.ndarray):
        file_pattern = file_pattern.reshape(-1).tolist()
    out = []
    for p in file_pattern:
        p = os.fsdecode(os.fspath(p) if not isinstance(p, np.bytes_) else bytes(p))
        out.append(p)
    if not out:
        raise ValueError("file_pattern=[]: pass at least one glob pattern")
    return out


class NoMatchingFilesError(InvalidArgumentError, FileNotFoundError):
    """``Dataset.list_files`` of patterns that match no file: TF's ``InvalidArgumentError`` ("No files matched
    pattern"), and the ``FileNotFoundError`` mirrored raised before, so either ``except`` catches it."""


class ListFilesDataset(Dataset):
    """``Dataset.list_files``: the names matching the patterns, sorted, then shuffled (seeded) per iteration.

    Under FILE auto-sharding each worker keeps every W-th name of the sorted
    list before the shuffle, so the workers' files never overlap whatever the
    seed.
    """

    def __init__(self, file_pattern, shuffle, seed):
        super().__init__()
        patterns = _patterns(file_pattern)
        files = sorted({f for p in patterns for f in glob.glob(p)})
        if not files:
            raise NoMatchingFilesError(None, None, f"file_pattern={file_pattern!r}: No files matched pattern: "
                                       f"{', '.join(patterns)}; check the path (glob syntax: *, ?, [...])")
        self._shuffle = True if shuffle is None else bool(shuffle)
        self._seed = seed
        self._set_files([np.bytes_(os.fsencode(f)) for f in files])

    def _set_files(self, files: list) -> None:
        self._files = files
        names = Dataset.from_tensor_slices(np.array(files))
        # One shuffle dataset for all iterations, so each reshuffles.
        self._names = names.shuffle(len(files), seed=self._seed) if self._shuffle else names

    def _pipeline(self):
        yield self
        yield from self._names._pipeline()

    def _compute_spec(self):
        return TensorSpec((), np.dtype("S"))

    def _cardinality(self):
        return len(self._files)

    def _make_iterator(self, state=None):
        return self._names._make_iterator(state)

    def _file_sharded(self, num_shards, index):
        clone = self._clone(())
        clone._set_files(self._files[index::num_shards])
        return clone

    def _file_count(self):
        return len(self._files)


# --- take_while, scan, unique, rebatch, ignore_errors, counter, choose/sample_from_datasets ---------------

class _TakeWhile(_Filter):
    def _cardinality(self):
        return UNKNOWN  # as tf.data, even for an endless input

    def _make_iterator(self, state=None):
        return _TakeWhileIterator(self, state)


class _TakeWhileIterator(_MapIterator):
    def __init__(self, ds, state):
        super().__init__(ds, state)
        self._predicate = ds._predicate
        self._done = False if state is None else state["done"]

    def next(self):
        if self._done:
            raise StopIteration
        element = self._inputs[0].next()
        if not _scalar_bool(_call(self._predicate, element)):
            self._done = True
            raise StopIteration
        return element

    def save(self):
        return {"input": self._inputs[0].save(), "done": self._done}


def _scan_step(fn, state, element):
    """``fn(state, element)``: the new state (same structure and dtypes) and the output."""
    result = fn(state, element)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"Invalid `scan_func`. `scan_func` should return a pair consisting of new state and the "
                        f"output value, got {result!r:.80}")
    return _same_state(state, result[0], "scan_func"), normalize_output(result[1], "scan_func")


class _Scan(Dataset):
    def __init__(self, input_ds, initial_state, fn):
        super().__init__(input_ds)
        if not callable(fn):
            raise ValueError(f"scan_func={fn!r} is not callable; pass a function of (state, element)")
        self._initial, self._fn = normalize_input(initial_state, "initial_state"), fn

    def _compute_spec(self):
        run = lambda e: _scan_step(self._fn, self._initial, e)[1]  # noqa: E731
        out, element = _run_for_spec(self._input, run, "scan")
        return _traced_spec(spec_of(out), element, self._input.element_spec, lambda e: spec_of(run(e)), out)

    def _cardinality(self):
        return self._input._cardinality()

    def _make_iterator(self, state=None):
        return _ScanIterator(self, state)


class _ScanIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._fn = ds._fn
        self._state = ds._initial if state is None else state["state"]

    def next(self):
        self._state, output = _scan_step(self._fn, self._state, self._inputs[0].next())
        return output

    def save(self):
        return {"input": self._inputs[0].save(), "state": self._state}


class _Unique(Dataset):
    def __init__(self, input_ds):
        super().__init__(input_ds)
        leaves = flatten(input_ds.element_spec)
        if len(leaves) != 1:
            raise ValueError("unique only supports inputs with a single component (not a tuple or dict); map "
                             "the element to one component first")
        if leaves[0].dtype.kind != "S" and leaves[0].dtype not in (np.int32, np.int64):
            raise TypeError(f"`Dataset.unique` does not support type {leaves[0].dtype} -- only int32, int64, and "
                            "string are supported")

    def _make_iterator(self, state=None):
        return _UniqueIterator(self, state)


class _UniqueIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._kept = [] if state is None else list(state["seen"])
        self._seen = {self._key(x) for x in self._kept}

    @staticmethod
    def _key(x):
        if isinstance(x, np.bytes_):  # (its bytes: as an S array, b"" and b"\0" would be one key)
            return bytes(x)
        if isinstance(x, np.ndarray) and x.dtype == object:  # string_array's form
            return x.shape, tuple(x.reshape(-1).tolist())
        x = np.asarray(device_util.to_host(x) if device_util.on_gpu(x) else x)
        return (x.shape, x.tobytes())

    def next(self):
        while True:
            element = self._inputs[0].next()
            key = self._key(element)
            if key not in self._seen:
                self._seen.add(key)
                self._kept.append(element)
                return element

    def save(self):
        return {"input": self._inputs[0].save(), "seen": self._kept}


def _batch_sizes(batch_size) -> list:
    sizes = list(batch_size) if isinstance(batch_size, (list, tuple, np.ndarray)) else [batch_size]
    if not sizes:
        raise ValueError("batch_size=[]: pass a batch size, or a list of them")
    return [_positive_int(b, "batch_size") for b in sizes]


class _Rebatch(Dataset):
    def __init__(self, input_ds, batch_size, drop_remainder):
        super().__init__(input_ds)
        self._sizes, self._drop = _batch_sizes(batch_size), drop_remainder
        if any(s.shape.rank == 0 for s in flatten(input_ds.element_spec)):
            raise ValueError("Invalid `batch_sizes`. Expected dataset with rank of >= 1 but found a dataset with "
                             "scalar elements. Fix the issue by adding the `batch` transformation to the dataset.")
        # TF compares the components' static batch dimensions when it may form partial batches.
        known = [s.shape[0] for s in flatten(input_ds.element_spec) if s.shape.rank and s.shape[0] is not None]
        if not drop_remainder and len(set(self._sizes)) == 1 and len(set(known)) > 1:
            raise ValueError(f"Invalid `input_dataset.` The batch dimension of component 0 is {known[0]}, while the "
                             f"batch dimension of component i is {np.asarray(known)}.")

    def _compute_spec(self):
        # Every batch has the one size when the remainder is dropped, or when each input batch splits evenly.
        inputs = {s.shape[0] if s.shape.rank else None for s in flatten(self._input.element_spec)}
        size = self._sizes[0] if len(set(self._sizes)) == 1 else None
        even = len(inputs) == 1 and None not in inputs and size is not None and inputs.pop() % size == 0
        first = size if self._drop or even else None
        return map_structure(lambda s: TensorSpec(None if s.shape.rank is None else (first,) + s.shape[1:], s.dtype),
                             self._input.element_spec)

    def _cardinality(self):
        return UNKNOWN  # as tf.data

    def _make_iterator(self, state=None):
        return _RebatchIterator(self, state)


class _RebatchIterator(_Iterator):
    """Rows taken from the input batches in order, ``sizes[k % len(sizes)]`` for the k-th batch."""

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        self._current, self._row, self._k = (None, 0, 0) if state is None else (state["current"], state["row"],
                                                                                   state["k"])

    def _rows_left(self) -> int:
        return 0 if self._current is None else flatten(self._current)[0].shape[0] - self._row

    def next(self):
        size = self._ds._sizes[self._k % len(self._ds._sizes)]
        parts, rows = [], 0
        while rows < size:
            if self._rows_left() == 0:
                try:
                    self._current, self._row = self._inputs[0].next(), 0
                except StopIteration:
                    self._current = None
                    break
                _check_batch_sizes(flatten(self._current))
                continue
            take = min(size - rows, self._rows_left())
            parts.append([leaf[self._row:self._row + take] for leaf in flatten(self._current)])
            self._row, rows = self._row + take, rows + take
        if not parts or (self._ds._drop and rows < size):
            raise StopIteration
        self._k += 1
        leaves = [parts[0][c] if len(parts) == 1 else array_module(parts[0][c]).concatenate([p[c] for p in parts])
                  for c in range(len(parts[0]))]
        return pack_sequence_as(self._ds._input.element_spec, leaves)

    def save(self):
        return {"input": self._inputs[0].save(), "current": self._current, "row": self._row, "k": self._k}


class _IgnoreErrors(Dataset):
    def __init__(self, input_ds, log_warning):
        super().__init__(input_ds)
        self._log = log_warning

    def _cardinality(self):
        return UNKNOWN  # as tf.data: any element may be dropped

    def _make_iterator(self, state=None):
        return _IgnoreErrorsIterator(self, state)


class _IgnoreErrorsIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._log = ds._log

    def next(self):
        while True:
            try:
                return self._inputs[0].next()
            except StopIteration:
                raise
            except Exception as e:  # noqa: BLE001  (dropping failed elements is the point)
                if self._log:
                    logging.getLogger("mirrored.data").warning("ignore_errors dropped an element: %s: %s",
                                                               type(e).__name__, e)

    def save(self):
        return {"input": self._inputs[0].save()}


class _Counter(Dataset):
    def __init__(self, start, step, dtype):
        super().__init__()
        self._start, self._step, self._dtype = start, step, np.dtype(dtype)

    def _compute_spec(self):
        return TensorSpec((), self._dtype)

    def _cardinality(self):
        return INFINITE_CARDINALITY

    def _make_iterator(self, state=None):
        return _CounterIterator(self, 0 if state is None else state["i"])


class _CounterIterator(_SliceIterator):
    def next(self):
        self._i += 1
        return self._ds._dtype.type(self._ds._start + (self._i - 1) * self._ds._step)


def _datasets_argument(datasets) -> list:
    datasets = list(datasets)
    if not datasets:
        raise ValueError("Invalid `datasets`. `datasets` should not be empty.")
    for d in datasets:
        if not isinstance(d, Dataset):
            raise TypeError(f"datasets: every item must be an md.data.Dataset, got {type(d).__name__}")
    return datasets


class _Selecting(Dataset):
    """Elements of ``datasets`` (all of one structure and dtypes), one dataset picked per element."""

    def __init__(self, datasets, extra_inputs, stop_on_empty):
        datasets = _datasets_argument(datasets)
        super().__init__(*datasets, *extra_inputs)
        self._count, self._stop = len(datasets), stop_on_empty
        self.element_spec  # noqa: B018  (incompatible datasets are refused here, as tf.data does)

    def _compute_spec(self):
        specs = [d.element_spec for d in self._inputs[:self._count]]
        spec = specs[0]
        for i, other in enumerate(specs[1:], 1):
            if not _same_structure(spec, other) or any(a.dtype != b.dtype for a, b in zip(flatten(spec),
                                                                                         flatten(other))):
                raise TypeError(f"Invalid `datasets`. `datasets` must have compatible element specs.\n Dataset 0 "
                                f"element_spec={specs[0]}.\nDataset {i} element_spec={other}.")
            spec = pack_sequence_as(spec, [a.most_specific_compatible(b) for a, b in zip(flatten(spec),
                                                                                         flatten(other))])
        return spec


class _SelectingIterator(_Iterator):
    """The inputs' iterators and which are exhausted; ``_choose()`` gives the next index (StopIteration: done)."""

    def __init__(self, ds, state):
        states = [None] * ds._count if state is None else state["inputs"]
        super().__init__(*(d._make_iterator(s) for d, s in zip(ds._inputs[:ds._count], states)))
        self._ds = ds
        self._empty = [False] * ds._count if state is None else list(state["empty"])

    def next(self):
        while True:
            i = self._choose()
            if not self._empty[i]:
                try:
                    return self._inputs[i].next()
                except StopIteration:
                    self._empty[i] = True
            if self._ds._stop or all(self._empty):
                raise StopIteration

    def save(self):
        return {"inputs": [it.save() for it in self._inputs[:self._ds._count]], "empty": self._empty}


class _ChooseFromDatasets(_Selecting):
    def __init__(self, datasets, choice_dataset, stop_on_empty):
        if not isinstance(choice_dataset, Dataset):
            raise TypeError(f"choice_dataset={choice_dataset!r}: expected an md.data.Dataset of int64 scalars")
        if choice_dataset.element_spec != TensorSpec((), np.int64):
            raise TypeError("Invalid `choice_dataset`. Elements of `choice_dataset` must be scalar int64 tensors "
                            f"but are {choice_dataset.element_spec}")
        super().__init__(datasets, [choice_dataset], stop_on_empty)

    def _cardinality(self):
        return UNKNOWN

    def _make_iterator(self, state=None):
        return _ChooseIterator(self, state)


class _ChooseIterator(_SelectingIterator):
    def __init__(self, ds, state):
        super().__init__(ds, state)
        self._inputs.append(ds._inputs[-1]._make_iterator(None if state is None else state["choice"]))

    def _choose(self):
        i = int(self._inputs[-1].next())
        if not 0 <= i < self._ds._count:
            raise ValueError(f"Selector index out of range: {i} >= {self._ds._count}; choice_dataset's values "
                             f"must be in [0, {self._ds._count})")
        return i

    def save(self):
        return {**super().save(), "choice": self._inputs[-1].save()}


class _SampleFromDatasets(_Selecting):
    def __init__(self, datasets, weights, seed, stop_on_empty, rerandomize):
        super().__init__(datasets, [], stop_on_empty)
        self._weights = np.full(self._count, 1.0) if weights is None else np.asarray(weights, np.float64)
        self._reshuffle = rerandomize or seed is None
        self._seed = _seed_of(seed)
        self._epochs = 0

    def _cardinality(self):
        endless = [d._cardinality() == INFINITE_CARDINALITY for d in self._inputs]
        return INFINITE_CARDINALITY if (all(endless) if self._stop else any(endless)) else UNKNOWN

    def _make_iterator(self, state=None):
        return _SampleIterator(self, state)


class _SampleIterator(_SelectingIterator):
    def __init__(self, ds, state):
        super().__init__(ds, state)
        if state is None:
            epoch = ds._epochs if ds._reshuffle else 0
            ds._epochs += 1
            self._rng = np.random.Generator(np.random.PCG64([ds._seed, epoch]))
        else:
            self._rng = np.random.Generator(np.random.PCG64())
            self._rng.bit_generator.state = state["rng"]

    def _choose(self):
        # tf.data skips a draw that lands on an exhausted dataset; drawing among the others gives the same
        # distribution without spinning.
        weights = np.where(self._empty, 0.0, self._ds._weights)
        return int(self._rng.choice(len(weights), p=weights / weights.sum()))

    def save(self):
        return {**super().save(), "rng": self._rng.bit_generator.state}


class _Window(Dataset):
    def __init__(self, input_ds, size, shift, stride, drop_remainder):
        super().__init__(input_ds)
        self._size, self._shift, self._stride, self._drop = size, shift, stride, drop_remainder

    def _compute_spec(self):
        return map_structure(DatasetSpec, self._input.element_spec)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        if self._drop:
            return max(0, (n - (self._size - 1) * self._stride - 1) // self._shift + 1)
        return math.ceil(n / self._shift)

    def _make_iterator(self, state=None):
        return _WindowIterator(self, state)


class _WindowIterator(_Iterator):
    """Window k holds inputs ``k*shift + j*stride`` (j < size); ``buffer`` starts at input ``k*shift``."""

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        self._buffer = [] if state is None else list(state["buffer"])
        self._skip, self._done = (0, False) if state is None else (state["skip"], state["done"])

    def _read(self) -> bool:
        try:
            element = self._inputs[0].next()
        except StopIteration:
            self._done = True
            return False
        if self._skip:
            self._skip -= 1
        else:
            self._buffer.append(element)
        return True

    def next(self):
        ds = self._ds
        span = (ds._size - 1) * ds._stride + 1
        while not self._done and (self._skip or len(self._buffer) < span):
            self._read()
        window = self._buffer[:span:ds._stride]
        if not window or (ds._drop and len(window) < ds._size):
            raise StopIteration
        self._skip = max(0, ds._shift - len(self._buffer))
        del self._buffer[:ds._shift]
        spec = ds._input.element_spec
        columns = zip(*(flatten(e) for e in window))
        return pack_sequence_as(spec, [_WindowComponent(list(column), s)
                                       for column, s in zip(columns, flatten(spec))])

    def save(self):
        return {"input": self._inputs[0].save(), "buffer": self._buffer, "skip": self._skip, "done": self._done}


class _WindowComponent(Dataset):
    """One component of a window: a dataset of the window's values of it."""

    def __init__(self, values, spec):
        super().__init__()
        self._values, self._component_spec = values, spec

    def _compute_spec(self):
        return self._component_spec

    def _cardinality(self):
        return len(self._values)

    def _make_iterator(self, state=None):
        return _ListIterator(self._values, 0 if state is None else state["i"])


class _GroupByWindow(Dataset):
    def __init__(self, input_ds, key_func, reduce_func, window_size_func, spec=None):
        super().__init__(input_ds)
        self._given_spec = spec  # bucket_by_sequence_length's, which no single bucket shows
        for argument, fn in (("key_func", key_func), ("reduce_func", reduce_func),
                             ("window_size_func", window_size_func)):
            if not callable(fn):
                raise ValueError(f"{argument}={fn!r} is not callable")
        self._key_func, self._reduce_func, self._size_func = key_func, reduce_func, window_size_func

    def _cardinality(self):
        n = self._input._cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN

    def _key(self, element) -> int:
        key = _call(self._key_func, element)
        if isinstance(key, np.ndarray) and key.shape == ():
            key = key[()]
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise ValueError(f"key_func must return a scalar int (a `tf.int64` key), got {key!r:.80}")
        return int(key)

    def _window_size(self, key: int) -> int:
        size = self._size_func(np.int64(key))
        if isinstance(size, np.ndarray) and size.shape == ():
            size = size[()]
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size <= 0:
            raise ValueError(f"Window size must be greater than zero, but got {size!r} (window_size_func({key}))")
        return int(size)

    def _reduced(self, key: int, window: list) -> Dataset:
        out = self._reduce_func(np.int64(key), _WindowComponent(window, self._input.element_spec))
        if not isinstance(out, Dataset):
            raise TypeError(f"Invalid `reduce_func`. `reduce_func` must return a single `tf.data.Dataset` object, "
                            f"got {type(out).__name__}")
        return out

    def _compute_spec(self):
        if self._given_spec is not None:
            return self._given_spec
        # reduce_func's window is a dataset of the input's spec, so its result's spec is tracing's; an empty
        # input's: reduce_func(0, an empty window).
        first = self._input._peek()
        return self._reduced(self._key(first[0]) if first else 0, first).element_spec

    def _make_iterator(self, state=None):
        return _GroupByWindowIterator(self, state)


class _GroupByWindowIterator(_Iterator):
    """``groups``: key -> its window so far; ``current``: the (key, window) being read out, with its iterator."""

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        self._groups = {} if state is None else {int(k): list(v) for k, v in state["groups"]}
        self._input_done = False if state is None else state["input_done"]
        self._current = None
        if state is not None and state["current"] is not None:
            key, window, inner = state["current"]
            self._current = (key, window, ds._reduced(key, window)._make_iterator(inner))

    def _next_window(self):
        """The next full window from the input, or at its end the unfinished ones by increasing key."""
        while not self._input_done:
            try:
                element = self._inputs[0].next()
            except StopIteration:
                self._input_done = True
                break
            key = self._ds._key(element)
            group = self._groups.setdefault(key, [])
            group.append(element)
            if len(group) >= self._ds._window_size(key):
                return key, self._groups.pop(key)
        if not self._groups:
            raise StopIteration
        key = min(self._groups)
        return key, self._groups.pop(key)

    def next(self):
        while True:
            if self._current is None:
                key, window = self._next_window()
                self._current = (key, window, self._ds._reduced(key, window)._make_iterator())
            try:
                return self._current[2].next()
            except StopIteration:
                self._current[2].close()
                self._current = None

    def save(self):
        current = None if self._current is None else (self._current[0], self._current[1], self._current[2].save())
        return {"input": self._inputs[0].save(), "groups": [[k, v] for k, v in self._groups.items()],
                "input_done": self._input_done, "current": current}

    def close(self):
        if self._current is not None:
            self._current[2].close()
        super().close()


class _Random(Dataset):
    def __init__(self, seed, rerandomize):
        super().__init__()
        self._seed = _seed_of(seed)
        self._reshuffle, self._epochs = rerandomize, 0

    def _compute_spec(self):
        return TensorSpec((), np.int64)

    def _cardinality(self):
        return INFINITE_CARDINALITY

    def _make_iterator(self, state=None):
        return _RandomIterator(self, state)


class _RandomIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__()
        self._rng = np.random.Generator(np.random.PCG64([ds._seed, ds._epochs if ds._reshuffle else 0]))
        ds._epochs += 1
        if state is not None:
            self._rng.bit_generator.state = state["rng"]

    def next(self):
        return np.int64(self._rng.integers(0, 2**32))

    def save(self):
        return {"rng": self._rng.bit_generator.state}


# --- saved datasets and snapshots (the files: saved_dataset.py) --------------------------------------------

class _SavedShard(Dataset):
    """One shard of a saved dataset: its chunks' elements in order."""

    def __init__(self, path: str, shard: int, chunks: int, spec):
        super().__init__()
        self._path, self._shard, self._chunks, self._saved_spec = path, shard, chunks, spec

    def _compute_spec(self):
        return self._saved_spec

    def _make_iterator(self, state=None):
        return _SavedShardIterator(self, (0, 0) if state is None else tuple(state))


class _SavedShardIterator(_Iterator):
    def __init__(self, ds, position):
        super().__init__()
        self._ds = ds
        self._chunk, self._i = position
        self._elements = None

    def next(self):
        while self._chunk < self._ds._chunks:
            if self._elements is None:
                self._elements = read_chunk(
                    os.path.join(self._ds._path, f"shard_{self._ds._shard}", f"{self._chunk}.npz"),
                    self._ds._saved_spec)
            if self._i < len(self._elements):
                self._i += 1
                return self._elements[self._i - 1]
            self._chunk, self._i, self._elements = self._chunk + 1, 0, None
        raise StopIteration

    def save(self):
        return [self._chunk, self._i]


class _Shards(Dataset):
    """The shards of a saved dataset as a dataset of datasets (what ``load``'s ``reader_func`` receives)."""

    def __init__(self, shards: list):
        super().__init__()
        self._shards = shards

    def _compute_spec(self):
        return DatasetSpec(self._shards[0].element_spec if self._shards else None)

    def _cardinality(self):
        return len(self._shards)

    def _make_iterator(self, state=None):
        return _ListIterator(self._shards, 0 if state is None else state["i"])


class _Loaded(Dataset):
    """A saved dataset: its shards one after the other, with the saved element_spec and cardinality (``spec``
    gives the structure to rebuild instead of the saved one: a snapshot's elements keep their pipeline's
    namedtuple classes)."""

    def __init__(self, path: str, spec=None):
        super().__init__()
        description = read_description(path)
        self._saved_spec = decode_spec(description["element_spec"]) if spec is None else spec
        self._count = description["cardinality"]
        self._shards = [_SavedShard(path, int(k), n, self._saved_spec) for k, n in description["shards"].items()]

    def _compute_spec(self):
        return self._saved_spec

    def _cardinality(self):
        return self._count

    def _make_iterator(self, state=None):
        return _LoadedIterator(self, state)


class _LoadedIterator(_Iterator):
    """TF's default reader: the shards interleaved, one element from each of ``cycle`` open shards in turn (the
    CPU count, as TF's), a finished shard replaced by the next one. One shard (no ``shard_func``): in order."""

    def __init__(self, ds, state):
        super().__init__()
        self._ds = ds
        cycle = min(os.cpu_count() or 1, max(1, len(ds._shards)))
        if state is None:
            self._slots, self._next_shard, self._index = [None] * cycle, 0, 0
        else:
            self._next_shard, self._index = state["next_shard"], state["index"]
            self._slots = [None if s is None else (s[0], ds._shards[s[0]]._make_iterator(s[1]))
                           for s in state["slots"]]

    def next(self):
        while True:
            if self._next_shard >= len(self._ds._shards) and all(s is None for s in self._slots):
                raise StopIteration
            i = self._index
            if self._slots[i] is None and self._next_shard < len(self._ds._shards):
                shard = self._next_shard
                self._slots[i] = (shard, self._ds._shards[shard]._make_iterator())
                self._next_shard += 1
            self._index = (i + 1) % len(self._slots)
            if self._slots[i] is None:
                continue
            try:
                return self._slots[i][1].next()
            except StopIteration:
                self._slots[i] = None
                self._index = i  # the next shard takes this place of the cycle at once

    def save(self):
        return {"next_shard": self._next_shard, "index": self._index,
                "slots": [None if s is None else [s[0], s[1].save()] for s in self._slots]}


class _Counted(Dataset):
    """A dataset whose element count is known from elsewhere (a loaded dataset read by a ``reader_func``)."""

    def __init__(self, input_ds, count: int):
        super().__init__(input_ds)
        self._count = count

    def _cardinality(self):
        return self._count

    def _make_iterator(self, state=None):
        return self._input._make_iterator(state)


class _Snapshot(Dataset):
    def __init__(self, input_ds, path, compression, reader_func, shard_func):
        super().__init__(input_ds)
        self._path = check_path(path)
        self._compress = check_compression(compression)
        for argument, fn in (("reader_func", reader_func), ("shard_func", shard_func)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{argument}={fn!r} is not callable")
        self._reader_func, self._shard_func = reader_func, shard_func

    def _cardinality(self):
        return self._input._cardinality()

    def _directory(self) -> str:
        return os.path.join(self._path, fingerprint(self._input))

    def _written(self):
        """The finished snapshot of this pipeline, as the dataset to read (None: not written yet)."""
        directory = self._directory()
        if not os.path.exists(os.path.join(directory, SPEC_FILE)):
            return None
        loaded = _Loaded(directory, self._input.element_spec)
        return loaded if self._reader_func is None else self._reader_func(_Shards(loaded._shards))

    def _make_iterator(self, state=None):
        written = self._written()
        if written is not None:
            return _SnapshotReadIterator(written, None if state is None else state["written"])
        if state is not None:
            raise ValueError(f"the snapshot under {self._path!r} that this iterator was reading is gone; restore "
                             "where the snapshot's files are")
        return _SnapshotWriteIterator(self)


class _SnapshotReadIterator(_Iterator):
    def __init__(self, written, state):
        super().__init__(written._make_iterator(state))

    def next(self):
        return self._inputs[0].next()

    def save(self):
        return {"written": self._inputs[0].save()}


class _SnapshotWriteIterator(_Iterator):
    """The input's elements, written as they pass into a directory of this iterator's that becomes the
    snapshot when the pass completes (a pass stopped early leaves no snapshot)."""

    def __init__(self, ds):
        super().__init__(ds._input._make_iterator())
        self._ds = ds
        self._target = ds._directory()
        self._tmp = f"{self._target}.tmp-{os.getpid()}-{id(self)}"
        fresh_directory(self._tmp)
        self._writer = Writer(self._tmp, ds._compress)

    def next(self):
        try:
            element = self._inputs[0].next()
        except StopIteration:
            if self._writer is not None:
                self._writer.finish(self._ds._input.element_spec)
                self._writer = None
                publish(self._tmp, self._target)
            raise
        shard_func = self._ds._shard_func
        self._writer.add(0 if shard_func is None else shard_of(shard_func, element), element)
        return element

    def save(self):
        raise ValueError("an iterator of a snapshot that is still being written cannot be checkpointed; finish "
                         "one pass first (later iterations read the snapshot, and checkpoint)")

    def close(self):
        if self._writer is not None:  # an unfinished pass leaves no snapshot
            self._writer = None
            shutil.rmtree(self._tmp, ignore_errors=True)
        super().close()


# --- rejection_resample ---------------------------------------------------------------------------------

def _distribution(value, argument: str) -> np.ndarray:
    dist = np.asarray(value, np.float32)
    if dist.ndim != 1 or not len(dist) or (dist < 0).any():
        raise ValueError(f"{argument}={value!r}: expected a 1-D list of class probabilities (>= 0), one per class")
    return dist


def _acceptance_and_mixing(initial: np.ndarray, target: np.ndarray):
    """TF's ``_calculate_acceptance_probs_with_mixing``: per-class acceptance ``a`` and the probability ``m`` of
    taking an input element as it is (the least rejection that reaches ``target``)."""
    ratio = target / (initial + np.finfo(np.float32).tiny)
    m = ratio.min()
    with np.errstate(invalid="ignore", divide="ignore"):
        accept = (ratio - m) / (ratio.max() - m)
    return accept, float(m)


class _ClassEstimate:
    """The class distribution as TF estimates it along the input: counts starting at 10 per class, updated 32
    class values at a time; ``next()`` is the estimate for the next element."""

    _BATCH, _SMOOTHING = 32, 10

    def __init__(self, ds, state):
        self._ds = ds
        self._classes = ds._input._make_iterator(None if state is None else state["input"])
        self._counts = (np.full(len(ds._target), self._SMOOTHING, np.int64) if state is None
                        else np.asarray(state["counts"], np.int64))
        self._left = 0 if state is None else state["left"]
        self._estimate = None if state is None else np.asarray(state["estimate"], np.float32)

    def next(self) -> np.ndarray:
        if self._left == 0:
            values = []
            for _ in range(self._BATCH):
                try:
                    values.append(self._ds._class_of(self._classes.next()))
                except StopIteration:
                    break
            if not values:
                raise StopIteration
            self._counts = self._counts + np.bincount(values, minlength=len(self._counts))[:len(self._counts)]
            self._estimate = (self._counts / self._counts.sum()).astype(np.float32)
            self._left = len(values)
        self._left -= 1
        return self._estimate

    def save(self):
        return {"input": self._classes.save(), "counts": self._counts, "left": self._left,
                "estimate": self._estimate}

    def close(self) -> None:
        self._classes.close()


class _RejectionResample(Dataset):
    def __init__(self, input_ds, class_func, target, initial, seed):
        super().__init__(input_ds)
        if initial is not None and len(initial) != len(target):
            raise ValueError(f"initial_dist has {len(initial)} classes, target_dist {len(target)}; give both one "
                             "probability per class")
        self._class_func, self._target, self._initial = class_func, target, initial
        self._seed = _seed_of(seed)
        # As TF: with initial_dist known and equal to the target, the input as it is; none mixed in when m is 0.
        self._static = None if initial is None else float(np.min(target / initial))

    def _class_of(self, element) -> int:
        return self._check_class(normalize_output(_call(self._class_func, element), "class_func"))

    def _check_class(self, value) -> int:
        if np.ndim(value) or not np.issubdtype(np.result_type(value), np.integer) or \
                not 0 <= int(value) < len(self._target):
            raise ValueError(f"class_func must return a scalar int class in [0, {len(self._target)}), got "
                             f"{value!r:.80}")
        return int(value)

    def _with_class(self, element):
        value = normalize_output(_call(self._class_func, element), "class_func")
        self._check_class(value)
        return (value, element)

    def _compute_spec(self):
        first = self._input._peek()
        if not first:
            raise ValueError("element_spec of rejection_resample: the input is empty, so class_func's output is "
                             "unknown")
        return (leaf_spec(self._with_class(first[0])[0]), self._input.element_spec)

    def _cardinality(self):
        return self._input._cardinality() if self._static == 1 else UNKNOWN

    def _make_iterator(self, state=None):
        return _RejectionResampleIterator(self, state)


class _RejectionResampleIterator(_Iterator):
    def __init__(self, ds, state):
        sub = (lambda key: None) if state is None else state.get
        super().__init__(ds._input._make_iterator(sub("original")), ds._input._make_iterator(sub("filtered")))
        self._ds = ds
        dynamic = ds._initial is None
        self._filter_estimate = _ClassEstimate(ds, sub("filter_estimate")) if dynamic else None
        self._mix_estimate = _ClassEstimate(ds, sub("mix_estimate")) if dynamic else None
        self._rngs = []
        for i, key in enumerate(("filter_rng", "mix_rng")):
            rng = np.random.Generator(np.random.PCG64([ds._seed, i]))
            if state is not None:
                rng.bit_generator.state = state[key]
            self._rngs.append(rng)

    def _mixing(self):
        if self._mix_estimate is None:
            return _acceptance_and_mixing(self._ds._initial, self._ds._target)[1]
        return _acceptance_and_mixing(self._mix_estimate.next(), self._ds._target)[1]

    def next(self):
        ds = self._ds
        if ds._static == 1 or (ds._static != 0 and self._rngs[1].random() < self._mixing()):
            return ds._with_class(self._inputs[0].next())
        while True:  # the rejection sampler's next accepted element
            element = self._inputs[1].next()
            initial = ds._initial if self._filter_estimate is None else self._filter_estimate.next()
            accept, _ = _acceptance_and_mixing(initial, ds._target)
            cls = ds._class_of(element)
            if self._rngs[0].random() < accept[cls]:
                return ds._with_class(element)

    def save(self):
        state = {"original": self._inputs[0].save(), "filtered": self._inputs[1].save(),
                 "filter_rng": self._rngs[0].bit_generator.state, "mix_rng": self._rngs[1].bit_generator.state}
        if self._filter_estimate is not None:
            state.update(filter_estimate=self._filter_estimate.save(), mix_estimate=self._mix_estimate.save())
        return state

    def close(self):
        for estimate in (self._filter_estimate, self._mix_estimate):
            if estimate is not None:
                estimate.close()
        super().close()
