"""``md.data.experimental``: ``tf.data.experimental``'s names for NumPy/CuPy pipelines.

Most are TF 1.x spellings of ``Dataset`` methods, kept by TF as functions
returning a transformation for ``dataset.apply(...)``
(``dataset.apply(md.data.experimental.unique())``); they do what the method
does. New here: ``assert_cardinality``, ``at``, ``from_list``,
``pad_to_cardinality``, ``group_by_reducer``/``Reducer``, ``get_structure``
and the debug switch ``enable_debug_mode``. What TF has and md.data does not
is listed, with the reason, in docs/data.md.
"""

from __future__ import annotations

import collections
import csv
import gzip

import numpy as np

from .._nest import flatten, map_structure, pack_sequence_as
from ..errors import OutOfRangeError
from .dataset_ops import (AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset, ListFilesDataset, _call,
                          _int, _Iterator, _ListIterator, _not_empty, _same_state, _same_structure, enable_debug_mode)
from .iterator_ops import IteratorProtocol, Optional
from .options import (AutoShardPolicy, AutotuneAlgorithm, AutotuneOptions, DistributeOptions, ExternalStatePolicy,
                      OptimizationOptions, ServiceOptions, ThreadingOptions)
from .readers import CsvDataset, TFRecordWriter
from .structure import normalize_input, normalize_output, spec_of

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "SHARD_HINT", "AutoShardPolicy",
           "AutotuneAlgorithm", "AutotuneOptions", "DistributeOptions", "ExternalStatePolicy", "OptimizationOptions",
           "ServiceOptions", "ThreadingOptions", "Optional", "TFRecordWriter", "CsvDataset", "make_csv_dataset",
           "Counter", "RandomDataset", "Reducer",
           "assert_cardinality", "at", "bucket_by_sequence_length", "cardinality", "choose_from_datasets",
           "copy_to_device", "enable_debug_mode", "enumerate_dataset", "from_list", "get_next_as_optional",
           "get_single_element", "get_structure", "group_by_reducer", "group_by_window", "ignore_errors", "load",
           "map_and_batch", "pad_to_cardinality", "parallel_interleave", "prefetch_to_device", "rejection_resample",
           "sample_from_datasets", "save", "scan", "shuffle_and_repeat", "snapshot", "take_while", "unbatch",
           "unique"]

SHARD_HINT = -1  # shard(SHARD_HINT, SHARD_HINT) under AutoShardPolicy.HINT (TF's placeholder value)


# --- functions of a dataset --------------------------------------------------------------------------------

def cardinality(dataset: Dataset) -> np.int64:
    """``dataset.cardinality()``."""
    return dataset.cardinality()


def get_single_element(dataset: Dataset):
    """``dataset.get_single_element()``."""
    return dataset.get_single_element()


def get_structure(dataset_or_iterator):
    """The ``element_spec`` of a dataset or of an iterator (``TensorSpec``s in the elements' structure)."""
    if not isinstance(dataset_or_iterator, (Dataset, IteratorProtocol)):
        raise TypeError(f"Invalid `dataset_or_iterator`. `dataset_or_iterator` must be a `tf.data.Dataset` or "
                        f"tf.data.Iterator object, but got {type(dataset_or_iterator)}.")
    return dataset_or_iterator.element_spec


def get_next_as_optional(iterator) -> Optional:
    """``iterator.get_next_as_optional()``."""
    return iterator.get_next_as_optional()


def at(dataset: Dataset, index):
    """The element at ``index`` (from 0); ``md.errors.OutOfRangeError`` outside ``[0, cardinality)``."""
    index = _int(index, "index", "an int")
    n = dataset._cardinality()
    if index < 0 or 0 <= n <= index:
        raise OutOfRangeError(None, None, f"Index out of range [0, {n if n >= 0 else '?'}):{index}")
    it = dataset.skip(index)._make_iterator()
    try:
        return it.next()
    except StopIteration:
        raise OutOfRangeError(None, None, f"Index out of range [0, {index}):{index}") from None
    finally:
        it.close()


def save(dataset: Dataset, path, compression=None, shard_func=None, checkpoint_args=None) -> None:
    """``dataset.save(path, ...)``."""
    dataset.save(path, compression, shard_func, checkpoint_args)


def load(path, element_spec=None, compression=None, reader_func=None) -> Dataset:
    """``md.data.Dataset.load(path, ...)``."""
    return Dataset.load(path, element_spec, compression, reader_func)


# --- sources ---------------------------------------------------------------------------------------------

def Counter(start=0, step=1, dtype=np.int64) -> Dataset:  # noqa: N802  (TF's name)
    """``md.data.Dataset.counter(start, step, dtype)``."""
    return Dataset.counter(start, step, dtype)


def RandomDataset(seed=None, rerandomize_each_iteration=None, name=None) -> Dataset:  # noqa: N802  (TF's name)
    """``md.data.Dataset.random(seed, rerandomize_each_iteration)``."""
    return Dataset.random(seed, rerandomize_each_iteration)


def choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset=False) -> Dataset:
    """``Dataset.choose_from_datasets``, with this spelling's default ``stop_on_empty_dataset=False`` (TF's)."""
    return Dataset.choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset)


def sample_from_datasets(datasets, weights=None, seed=None, stop_on_empty_dataset=False) -> Dataset:
    """``Dataset.sample_from_datasets``."""
    return Dataset.sample_from_datasets(datasets, weights, seed, stop_on_empty_dataset)


class _FromList(Dataset):
    """``from_list(elements)``: one element per item, each converted as ``from_tensors`` converts; all of one
    structure and dtypes (shapes may differ: the spec has ``None`` where they do)."""

    def __init__(self, elements):
        super().__init__()
        if not isinstance(elements, (list, tuple)) or not len(elements):
            raise ValueError("Invalid `elements`. `elements` should not be empty. If you want an empty dataset, use "
                             "`tf.data.Dataset.range(0)`.")
        for e in elements:
            _not_empty(e, "from_list")
        self._elements = [normalize_input(e, "from_list(elements)") for e in elements]
        spec = spec_of(self._elements[0])
        for i, e in enumerate(self._elements[1:], 1):
            other = spec_of(e)
            if not _same_structure(spec, other) or any(
                    a.dtype != b.dtype for a, b in zip(flatten(spec), flatten(other))):
                raise TypeError(f"from_list: element {i} ({other}) does not match the structure and dtypes of "
                                f"element 0 ({spec}); give every element the same structure and dtypes")
            spec = pack_sequence_as(spec, [a.most_specific_compatible(b) for a, b in zip(flatten(spec),
                                                                                        flatten(other))])
        self._list_spec = spec

    def _compute_spec(self):
        return self._list_spec

    def _cardinality(self):
        return len(self._elements)

    def _make_iterator(self, state=None):
        return _ListIterator(self._elements, 0 if state is None else state["i"])


def from_list(elements, name=None) -> Dataset:
    """A dataset of the items of ``elements`` (a non-empty list), in order."""
    return _FromList(elements)


# --- transformations (for dataset.apply) ------------------------------------------------------------------

class _AssertCardinality(Dataset):
    """The input, whose cardinality is stated to be ``expected``; checked as it is read."""

    def __init__(self, input_ds, expected: int):
        super().__init__(input_ds)
        self._expected = expected

    def _cardinality(self):
        return self._expected

    def _make_iterator(self, state=None):
        return _AssertCardinalityIterator(self, state)


def _expected_words(n: int) -> str:
    return "an infinite number of elements" if n == INFINITE_CARDINALITY else f"{n} element{'s' * (n != 1)}"


class _AssertCardinalityIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._expected = ds._expected
        self._count = 0 if state is None else state["count"]

    def next(self):
        try:
            element = self._inputs[0].next()
        except StopIteration:
            if self._expected != self._count:
                raise ValueError(f"Input dataset was expected to contain {_expected_words(self._expected)} but "
                                 f"contained only {self._count} element{'s' * (self._count != 1)}.") from None
            raise
        self._count += 1
        if self._expected != INFINITE_CARDINALITY and self._count > self._expected:
            raise ValueError(f"Input dataset was expected to contain {_expected_words(self._expected)} but "
                             f"contained at least {self._count} element{'s' * (self._count != 1)}.")
        return element

    def save(self):
        return {"input": self._inputs[0].save(), "count": self._count}


def assert_cardinality(expected_cardinality):
    """A transformation stating the input's cardinality: ``cardinality()`` is ``expected_cardinality``, and
    reading raises ``ValueError`` (TF's FailedPreconditionError) as soon as the count proves it wrong."""
    expected = _int(expected_cardinality, "expected_cardinality", "an int (or INFINITE_CARDINALITY)")
    if expected < 0 and expected != INFINITE_CARDINALITY:
        raise ValueError(f"expected_cardinality={expected}: must be >= 0 or md.data.INFINITE_CARDINALITY")
    return lambda dataset: _AssertCardinality(dataset, expected)


def pad_to_cardinality(cardinality, mask_key="valid"):
    """A transformation padding a dataset of dicts to ``cardinality`` elements: the elements, each with
    ``mask_key: True``, then elements of zeros (and empty strings) with ``mask_key: False``."""
    target = _int(cardinality, "cardinality", "an int")

    def apply(dataset):
        spec = dataset.element_spec
        if not isinstance(spec, dict):
            raise ValueError("`pad_to_cardinality` requires its input dataset to be a dictionary.")
        n = dataset._cardinality()
        if n > target:
            raise ValueError(f"The dataset passed into `pad_to_cardinality` must have a cardinalty less than the "
                             f"target cardinality ({target}), but has cardinality {n}")
        if n < 0:
            raise ValueError(f"The dataset passed into `pad_to_cardinality` must have a known and finite "
                             f"cardinality, but has cardinality {n}")
        if any(s.shape.rank is None or None in s.shape for s in flatten(spec)):
            raise ValueError(f"pad_to_cardinality: every component needs a fully known shape to pad with, got {spec}")

        def zeros(s):
            return np.zeros(tuple(s.shape), s.dtype)[()] if s.shape.rank else np.zeros((), s.dtype)[()]

        padding = {**{k: map_structure(zeros, v) for k, v in spec.items()}, mask_key: np.False_}
        valid = dataset.map(lambda element: {**element, mask_key: np.True_})
        return valid.concatenate(Dataset.from_tensors(padding).repeat(target - n))
    return apply


class Reducer:
    """``group_by_reducer``'s reduction: ``init_func(key)`` makes a group's state, ``reduce_func(state, element)``
    the next state, ``finalize_func(state)`` the group's output element."""

    def __init__(self, init_func, reduce_func, finalize_func):
        for argument, fn in (("init_func", init_func), ("reduce_func", reduce_func),
                             ("finalize_func", finalize_func)):
            if not callable(fn):
                raise TypeError(f"{argument}={fn!r} is not callable")
        self.init_func, self.reduce_func, self.finalize_func = init_func, reduce_func, finalize_func


class _GroupByReducer(Dataset):
    def __init__(self, input_ds, key_func, reducer: Reducer):
        super().__init__(input_ds)
        if not callable(key_func):
            raise TypeError(f"key_func={key_func!r} is not callable")
        self._key_func, self._reducer = key_func, reducer

    def _key(self, element) -> np.int64:
        key = _call(self._key_func, element)
        if isinstance(key, np.ndarray) and key.shape == ():
            key = key[()]
        if not isinstance(key, np.int64):
            raise ValueError(f"Invalid `key_func`. Expected `key_func` to return a scalar tf.int64 tensor, but "
                             f"instead `key_func` returned {key!r:.80} ({type(key).__name__}); return e.g. x % 3 "
                             "of an int64 element, or np.int64(...)")
        return key

    def _compute_spec(self):
        first = self._input._peek()
        if not first:
            raise ValueError("element_spec of group_by_reducer: the input is empty, so finalize_func's output is "
                             "unknown")
        reducer = self._reducer
        state = normalize_input(reducer.init_func(self._key(first[0])), "init_func")
        state = _same_state(state, reducer.reduce_func(state, first[0]), "reduce_func")
        return spec_of(normalize_output(_call(reducer.finalize_func, state), "finalize_func"))

    def _make_iterator(self, state=None):
        return _GroupByReducerIterator(self, state)


class _GroupByReducerIterator(_Iterator):
    """Reads the whole input, one state per key; then each key's finalized state, by increasing key."""

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["input"]))
        self._ds = ds
        self._states: dict = {}
        self._done, self._out = False, 0
        if state is not None:
            self._done, self._out = state["done"], state["out"]
            self._states = {int(k): s for k, s in state["states"]}

    def next(self):
        reducer = self._ds._reducer
        while not self._done:
            try:
                element = self._inputs[0].next()
            except StopIteration:
                self._done = True
                break
            key = self._ds._key(element)
            old = self._states.get(int(key))
            if old is None:
                old = normalize_input(reducer.init_func(key), "init_func")
            self._states[int(key)] = _same_state(old, reducer.reduce_func(old, element), "reduce_func")
        if self._out >= len(self._states):
            raise StopIteration
        state = self._states[sorted(self._states)[self._out]]  # by increasing key (TF's order)
        self._out += 1
        return normalize_output(_call(reducer.finalize_func, state), "finalize_func")

    def save(self):
        return {"input": self._inputs[0].save(), "done": self._done, "out": self._out,
                "states": [[k, s] for k, s in self._states.items()]}


def group_by_reducer(key_func, reducer: Reducer):
    """A transformation grouping elements by ``key_func(element)`` (an int64 scalar) and reducing each group
    with ``reducer``: one output element per key."""
    if not isinstance(reducer, Reducer):
        raise TypeError(f"reducer={reducer!r}: expected md.data.experimental.Reducer(init_func, reduce_func, "
                        "finalize_func)")
    return lambda dataset: _GroupByReducer(dataset, key_func, reducer)


def group_by_window(key_func, reduce_func, window_size=None, window_size_func=None):
    return lambda dataset: dataset.group_by_window(key_func, reduce_func, window_size, window_size_func)


def bucket_by_sequence_length(element_length_func, bucket_boundaries, bucket_batch_sizes, padded_shapes=None,
                              padding_values=None, pad_to_bucket_boundary=False, no_padding=False,
                              drop_remainder=False):
    return lambda dataset: dataset.bucket_by_sequence_length(
        element_length_func, bucket_boundaries, bucket_batch_sizes, padded_shapes, padding_values,
        pad_to_bucket_boundary, no_padding, drop_remainder)


def ignore_errors(log_warning=False):
    return lambda dataset: dataset.ignore_errors(log_warning)


def scan(initial_state, scan_func):
    return lambda dataset: dataset.scan(initial_state, scan_func)


def take_while(predicate):
    return lambda dataset: dataset.take_while(predicate)


def unbatch():
    return lambda dataset: dataset.unbatch()


def unique():
    return lambda dataset: dataset.unique()


def enumerate_dataset(start=0):
    return lambda dataset: dataset.enumerate(start)


def snapshot(path, compression="AUTO", reader_func=None, shard_func=None):
    return lambda dataset: dataset.snapshot(path, compression, reader_func, shard_func)


def rejection_resample(class_func, target_dist, initial_dist=None, seed=None):
    return lambda dataset: dataset.rejection_resample(class_func, target_dist, initial_dist, seed)


def shuffle_and_repeat(buffer_size, count=None, seed=None):
    """``shuffle(buffer_size, seed)`` then ``repeat(count)`` (each epoch its own order)."""
    return lambda dataset: dataset.shuffle(buffer_size, seed).repeat(count)


def map_and_batch(map_func, batch_size, num_parallel_batches=None, drop_remainder=False, num_parallel_calls=None):
    """``map(map_func, num_parallel_calls)`` then ``batch(batch_size, drop_remainder)``; ``num_parallel_batches``
    ``n`` means ``n * batch_size`` calls in flight, as TF's."""
    if num_parallel_batches is not None and num_parallel_calls is not None:
        raise ValueError("`map_and_batch` allows only one of `num_parallel_batches` and `num_parallel_calls` to be "
                         "set.")
    if num_parallel_batches is not None:
        num_parallel_calls = _int(num_parallel_batches, "num_parallel_batches", "a positive int") * \
            _int(batch_size, "batch_size", "a positive int")
    return lambda dataset: dataset.map(map_func, num_parallel_calls).batch(batch_size, drop_remainder)


def parallel_interleave(map_func, cycle_length, block_length=1, sloppy=False, buffer_output_elements=None,
                        prefetch_input_elements=None):
    """``interleave(map_func, cycle_length, block_length, num_parallel_calls=cycle_length,
    deterministic=not sloppy)`` (the buffer sizes are TF's tuning and change nothing here)."""
    return lambda dataset: dataset.interleave(map_func, cycle_length, block_length, num_parallel_calls=cycle_length,
                                              deterministic=None if not sloppy else False)


class _CopyToDevice(Dataset):
    """The input's elements as they are, its cardinality unknown (as TF's copy to a device states it)."""

    def _cardinality(self):
        return UNKNOWN_CARDINALITY

    def _make_iterator(self, state=None):
        return self._input._make_iterator(state)


def copy_to_device(target_device, source_device="/cpu:0"):
    """The elements as they are: md.data elements are copied to a replica's device by distributed input
    (``experimental_distribute_dataset`` with ``InputOptions(experimental_fetch_to_device=True)``)."""
    _check_device(target_device, "target_device")
    return _CopyToDevice


def prefetch_to_device(device, buffer_size=None):
    """``copy_to_device`` then ``prefetch(buffer_size or AUTOTUNE)``."""
    _check_device(device, "device")
    return lambda dataset: _CopyToDevice(dataset).prefetch(AUTOTUNE if buffer_size is None else buffer_size)


def _check_device(device, argument: str) -> None:
    if not isinstance(device, str):
        raise TypeError(f"{argument}={device!r}: expected a device string such as '/gpu:0'")


# --- make_csv_dataset ------------------------------------------------------------------------------------

def _csv_rows(filenames, field_delim, use_quote_delim, compression_type, encoding):
    """Each file's rows as Python's csv reads them (header included), for the column names and types."""
    for name in filenames:
        if compression_type == "ZLIB":
            raise ValueError(f"`compression_type` {compression_type} is not supported for probing columns.")
        opener = gzip.open if compression_type == "GZIP" else open
        with opener(name, "rt", newline="", encoding=encoding) as f:
            yield csv.reader(f, delimiter=field_delim,
                             quoting=csv.QUOTE_MINIMAL if use_quote_delim else csv.QUOTE_NONE)


def _inferred_type(value: str, na_value: str, previous):
    """TF's inference: the narrowest of int32, int64, float32, float64, string that holds every value seen."""
    if value in ("", na_value):
        return previous
    order = [np.int32, np.int64, np.float32, np.float64, np.bytes_]
    for i, dtype in enumerate(order):
        if previous is not None and previous not in order[:i + 1]:
            continue
        try:
            if dtype is np.int32 and np.int64(value) != np.int32(int(value)):
                continue
            if dtype in (np.int32, np.int64):
                np.int64(value)
            elif dtype is not np.bytes_:
                with np.errstate(over="ignore"):
                    if not float(np.dtype(dtype).type(value)) < np.inf:  # (TF's check: too large for the type)
                        continue
        except (ValueError, OverflowError):
            continue
        return dtype


def make_csv_dataset(file_pattern, batch_size, column_names=None, column_defaults=None, label_name=None,
                     select_columns=None, field_delim=",", use_quote_delim=True, na_value="", header=True,
                     num_epochs=None, shuffle=True, shuffle_buffer_size=10000, shuffle_seed=None,
                     prefetch_buffer_size=None, num_parallel_reads=None, sloppy=False, num_rows_for_inference=100,
                     compression_type=None, ignore_errors=False, encoding="utf-8"):
    """Batches of CSV records as ``{column name: batch}`` dicts (``(features, label)`` with ``label_name``), as
    TF's: column names from the header, types inferred from the first ``num_rows_for_inference`` rows unless
    ``column_defaults`` gives them, files read ``num_parallel_reads`` at a time, shuffled and repeated
    ``num_epochs`` times (forever: ``None``, the last short batch then dropped)."""
    files = ListFilesDataset(file_pattern, False, None)._files
    names = [f.decode() for f in map(bytes, files)]
    if column_names is None:
        if not header:
            raise ValueError("Expected `column_names` or `header` arguments. Neither is provided.")
        headers = [next(rows, None)
                   for rows in _csv_rows(names, field_delim, use_quote_delim, compression_type, encoding)]
        if any(h is None for h in headers):
            raise ValueError(f"Failed when reading the header line of {names[headers.index(None)]}. Is it an "
                             "empty file?")
        if any(h != headers[0] for h in headers):
            raise ValueError("All input CSV files should have the same column names in the header row.")
        column_names = headers[0]
    column_names = list(column_names)
    if len(set(column_names)) != len(column_names):
        raise ValueError("Either `column_names` argument or CSV header row contains duplicate column names: "
                         f"{sorted({n for n in column_names if column_names.count(n) > 1})}.")
    if select_columns is not None:
        indices = []
        for v in select_columns:
            if isinstance(v, int) and not isinstance(v, bool):
                if not 0 <= v < len(column_names):
                    raise ValueError(f"Column index {v} specified in `select_columns` should be > 0  and <= "
                                     f"{len(column_names)}, which is the number of columns.")
                indices.append(v)
            elif v in column_names:
                indices.append(column_names.index(v))
            else:
                raise ValueError(f"Column {v} specified in `select_columns` must be of one of the columns: "
                                 f"{column_names}.")
        if len(set(indices)) != len(indices):
            raise ValueError("The `select_columns` argument contains duplicate columns.")
        select_columns = sorted(indices)
    if column_defaults is None:
        selected = select_columns if select_columns is not None else range(len(column_names))
        types = [None] * len(selected)
        seen = 0
        for rows in _csv_rows(names, field_delim, use_quote_delim, compression_type, encoding):
            if header:
                next(rows, None)
            for row in rows:
                if num_rows_for_inference is not None and seen >= num_rows_for_inference:
                    break
                if len(row) != len(column_names):
                    raise ValueError(f"Problem inferring types: CSV row has {len(row)} number of fields. Expected: "
                                     f"{len(column_names)}.")
                types = [_inferred_type(row[c], na_value, t) for c, t in zip(selected, types)]
                seen += 1
        column_defaults = [b"" if t in (None, np.bytes_) else np.zeros((), t)[()] for t in types]
    if select_columns is not None and len(column_defaults) != len(select_columns):
        raise ValueError(f"If specified, `column_defaults` and `select_columns` must have the same length: "
                         f"`column_defaults` has length {len(column_defaults)}, `select_columns` has length "
                         f"{len(select_columns)}.")
    if select_columns is not None and len(column_names) > len(select_columns):
        column_names = [column_names[i] for i in select_columns]
    if label_name is not None and label_name not in column_names:
        raise ValueError(f"`label_name` provided must be one of the columns: {column_names}. Received: {label_name}.")

    def read(filename):
        ds = CsvDataset(filename, column_defaults, compression_type, header=header, field_delim=field_delim,
                        use_quote_delim=use_quote_delim, na_value=na_value, select_cols=select_columns)
        return ds.ignore_errors() if ignore_errors else ds

    def features(*columns):
        out = collections.OrderedDict(zip(column_names, columns))
        return (out, out.pop(label_name)) if label_name is not None else out

    dataset = Dataset.from_tensor_slices(np.array(files))
    if shuffle:
        dataset = dataset.shuffle(len(files), shuffle_seed)
    reads = 1 if num_parallel_reads is None else num_parallel_reads
    dataset = dataset.interleave(read, cycle_length=None if reads == AUTOTUNE else reads, block_length=1,
                                 num_parallel_calls=reads, deterministic=False if sloppy else None)
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer_size, shuffle_seed)
    if num_epochs != 1:
        dataset = dataset.repeat(num_epochs)
    dataset = dataset.batch(batch_size, drop_remainder=num_epochs is None).map(features)
    return dataset.prefetch(AUTOTUNE if prefetch_buffer_size is None else prefetch_buffer_size)
