"""md.data's parallel interleave, options that act, save/load/snapshot, the file readers and writer, the
experimental functions and bad input: the behaviour tests/test_data_tf_parity_29.py cannot record from TF
(threads, ordering under deterministic=False, checkpoints, random resampling)."""

import collections
import os
import threading

import numpy as np
import pytest

import mirrored as md
from mirrored.data import dataset_ops

D = md.data.Dataset
E = md.data.experimental
WAIT = 60  # seconds an event may take on a loaded machine (only reached if something is broken)


def checkpoint_roundtrip(make, taken):
    """The elements after ``taken`` of ``make()``, read by an iterator restored from a checkpoint there."""
    it = iter(make())
    first = [next(it) for _ in range(taken)]
    tensors = it._serialize_to_tensors()
    rest = list(it)
    restored = iter(make())
    restored._restore_from_tensors(tensors)
    return first, rest, list(restored)


def values(ds):
    return [np.asarray(x).tolist() for x in ds.as_numpy_iterator()]


# --- TensorSpec.shape and cardinality ----------------------------------------------------------------------

def test_spec_shapes_are_tensor_shapes_that_still_compare_as_tuples():
    spec = D.range(10).batch(4).element_spec
    assert isinstance(spec.shape, md.TensorShape) and spec.shape == (None,) and spec.shape.as_list() == [None]
    scalar = D.range(3).element_spec.shape
    assert scalar == () and scalar.rank == 0 and bool(scalar)  # TF's: a known shape is true, the scalar one too
    unknown = md.data.TensorSpec(None, np.int64).shape
    assert unknown.rank is None and not unknown and unknown != ()
    with pytest.raises(ValueError, match="unknown TensorShape"):
        unknown.as_list()
    assert hash(md.data.TensorSpec([2, None])) == hash(md.data.TensorSpec((2, None)))


def test_distributed_dataset_specs_carry_tensor_shapes():
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    dist = strategy.experimental_distribute_dataset(D.range(8).batch(4, drop_remainder=True))
    spec = dist.element_spec
    for s in getattr(spec, "_value_specs", None) or getattr(spec, "_specs", None) or [spec]:
        assert isinstance(s.shape, md.TensorShape) and s.shape.as_list() == [2]
    scalars = strategy.experimental_distribute_dataset(D.range(4).map(lambda x: np.float32(x)).batch(2))
    assert [np.asarray(v).tolist() for step in scalars for v in strategy.experimental_local_results(step)] == \
        [[0.0], [1.0], [2.0], [3.0]]


@pytest.mark.parametrize("ds, n", [(D.range(5), 5), (D.range(5).repeat(), -1), (D.range(5).filter(bool), -2),
                                   (D.range(7).batch(2), 4), (D.range(3).apply(E.assert_cardinality(3)), 3)])
def test_cardinality_is_an_int64_scalar(ds, n):
    assert type(ds.cardinality()) is np.int64 and ds.cardinality() == n
    assert type(E.cardinality(ds)) is np.int64


# --- interleave(num_parallel_calls) -------------------------------------------------------------------------

def _jittered(x):
    """A small dataset whose elements take varying times, so readers finish out of order."""
    rng = np.random.default_rng(int(x))
    return D.range(x * 100, x * 100 + int(x) % 4 + 1).map(
        lambda v: (threading.Event().wait(rng.uniform(0, 0.002)), v)[1])


@pytest.mark.parametrize("cycle, block, calls", [(1, 1, 1), (2, 1, 2), (3, 2, 2), (4, 3, md.data.AUTOTUNE),
                                                 (5, 1, 5), (2, 4, 1)])
def test_parallel_interleave_keeps_the_sequential_order(cycle, block, calls):
    sequential = values(D.range(9).interleave(_jittered, cycle_length=cycle, block_length=block))
    for deterministic in (None, True):
        parallel = D.range(9).interleave(_jittered, cycle_length=cycle, block_length=block, num_parallel_calls=calls,
                                         deterministic=deterministic)
        assert values(parallel) == sequential


def _blocked_first(release: threading.Event):
    """Dataset 0 waits for ``release``; dataset 1 yields 10, 11 and then sets it."""
    def gen(i):
        if i == 0:
            assert release.wait(WAIT), "dataset 0 was never released"
            yield np.int64(0)
        else:
            yield np.int64(10)
            yield np.int64(11)
            release.set()
    return lambda i: D.from_generator(gen, args=(i,), output_signature=md.data.TensorSpec((), np.int64))


def test_nondeterministic_interleave_takes_a_ready_dataset_first():
    ds = D.range(2).interleave(_blocked_first(threading.Event()), cycle_length=2, num_parallel_calls=2,
                               deterministic=False)
    assert values(ds) == [10, 11, 0]


def test_options_deterministic_false_reaches_interleave():
    options = md.data.Options()
    options.deterministic = False
    ds = D.range(2).interleave(_blocked_first(threading.Event()), cycle_length=2,
                               num_parallel_calls=2).with_options(options)
    assert values(ds) == [10, 11, 0]


def test_nondeterministic_interleave_yields_every_element_once():
    ds = D.range(12).interleave(_jittered, cycle_length=4, block_length=2, num_parallel_calls=3,
                                deterministic=False)
    assert sorted(values(ds)) == sorted(values(D.range(12).interleave(_jittered, cycle_length=4)))


def test_at_most_num_parallel_calls_datasets_read_at_once():
    lock, active, peak = threading.Lock(), [0], [0]

    def slow(v):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        threading.Event().wait(0.003)  # room for overlap; the assertion is only an upper bound
        with lock:
            active[0] -= 1
        return v

    ds = D.range(6).interleave(lambda x: D.range(4).map(slow), cycle_length=6, num_parallel_calls=2)
    assert len(values(ds)) == 24 and 1 <= peak[0] <= 2


def test_parallel_interleave_checkpoints_mid_cycle():
    def make():
        return D.range(7).interleave(lambda x: D.range(x * 10, x * 10 + 3), cycle_length=3, block_length=2,
                                     num_parallel_calls=2)
    first, rest, restored = checkpoint_roundtrip(make, 8)
    assert first + rest == list(make()) and restored == rest


def test_an_error_in_an_interleaved_dataset_reaches_the_caller_in_order():
    def inner(x):
        if x == 2:
            return D.range(3).map(lambda v: np.int64(1 // (int(v) - 1)))  # fails at its second element
        return D.range(3)
    it = iter(D.range(4).interleave(inner, cycle_length=4, num_parallel_calls=4))
    assert [next(it) for _ in range(6)] == [0, 0, -1, 0, 1, 1]
    with pytest.raises(ZeroDivisionError):
        next(it)


# --- options that act -------------------------------------------------------------------------------------

def test_private_threadpool_size_caps_the_map_threads():
    names = set()
    options = md.data.Options()
    options.threading.private_threadpool_size = 1
    ds = D.range(40).map(lambda x: (names.add(threading.current_thread().name), x)[1],
                         num_parallel_calls=8).with_options(options)
    assert values(ds) == list(range(40))
    assert len(names - {"MainThread"}) == 1  # (element_spec runs map_func once in the caller's thread)


def test_options_are_read_only_copies_and_merge_as_tf():
    options = md.data.Options()
    options.deterministic = False
    ds = D.range(2).with_options(options)
    options.deterministic = True  # later changes do not reach the pipeline (TF serializes them)
    assert ds.options().deterministic is False
    with pytest.raises(ValueError, match="Mutating"):
        ds.options().deterministic = True
    other = md.data.Options()
    other.threading.private_threadpool_size = 2
    merged = ds.with_options(other).options()
    assert merged.deterministic is False and merged.threading.private_threadpool_size == 2
    assert merged.experimental_threading.private_threadpool_size == 2  # TF's older name


@pytest.mark.parametrize("name, value, error", [("deterministic", 1, TypeError), ("no_such", 1, AttributeError),
                                                ("dataset_name", 3, TypeError), ("framework_type", "x", TypeError),
                                                ("experimental_optimization", True, TypeError)])
def test_options_refuse_wrong_names_and_types(name, value, error):
    with pytest.raises(error, match=name):
        setattr(md.data.Options(), name, value)


def test_debug_mode_runs_parallel_work_in_the_callers_thread(monkeypatch):
    monkeypatch.setattr(dataset_ops, "DEBUG_MODE", False)
    E.enable_debug_mode()
    assert dataset_ops.DEBUG_MODE
    threads = set()
    ds = D.range(6).map(lambda x: (threads.add(threading.current_thread()), x)[1], num_parallel_calls=4)
    ds = ds.interleave(lambda x: D.from_tensors(x), cycle_length=2, num_parallel_calls=2).prefetch(2)
    assert values(ds) == list(range(6)) and threads == {threading.current_thread()}


# --- save / load / snapshot ------------------------------------------------------------------------------

P = collections.namedtuple("P", ["x", "y"])


@pytest.mark.parametrize("make", [
    lambda: D.range(2500).map(lambda x: P(x, {"s": str(int(x)).encode(), "v": np.full(int(x) % 3, x, np.float16)})),
    lambda: D.from_tensor_slices(np.arange(24, dtype=np.float32).reshape(6, 2, 2)).batch(4),
    lambda: D.from_tensor_slices(np.array([b"a\x00b", b"", b"ccc"])),
    lambda: D.range(5).map(lambda x: (x, np.bool_(x % 2))),
])
@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_save_then_load_gives_the_elements_specs_and_count(tmp_path, make, compression):
    make().save(str(tmp_path / "d"), compression=compression)
    loaded = D.load(str(tmp_path / "d"))
    expected = list(make())
    got = list(loaded)
    assert len(got) == len(expected) == loaded.cardinality()
    for a, b in zip(got, expected):
        for x, y in zip(dataset_ops.flatten(a), dataset_ops.flatten(b)):
            assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
    assert dataset_ops.flatten(loaded.element_spec) == dataset_ops.flatten(make().element_spec)


def test_load_of_shards_interleaves_them_and_checkpoints(tmp_path):
    D.range(50).save(str(tmp_path / "d"), shard_func=lambda x: x % 3)
    assert sorted(values(D.load(str(tmp_path / "d")))) == list(range(50))
    first, rest, restored = checkpoint_roundtrip(lambda: D.load(str(tmp_path / "d")), 17)
    assert restored == rest and len(first + rest) == 50


def test_save_replaces_what_was_there_and_refuses_what_it_cannot_store(tmp_path):
    path = str(tmp_path / "d")
    D.range(3).save(path)
    D.range(7, 9).save(path)
    assert values(D.load(path)) == [7, 8]
    with pytest.raises(TypeError, match="window"):
        D.range(4).window(2).save(str(tmp_path / "w"))
    with pytest.raises(TypeError, match="checkpoint_args"):
        D.range(3).save(str(tmp_path / "c"), checkpoint_args={"max_to_keep": 1})
    with pytest.raises(ValueError, match="shard_func"):
        D.range(3).save(str(tmp_path / "s"), shard_func=lambda x: 1)  # a Python int is int32 (TF's rule)
    with pytest.raises(ValueError, match="compression"):
        D.range(3).save(str(tmp_path / "z"), compression="LZ4")
    with pytest.raises(FileNotFoundError, match="Dataset.save"):
        D.load(str(tmp_path / "none"))


def test_snapshot_is_written_once_then_read_by_the_same_pipeline(tmp_path):
    calls = []

    def make():
        return D.range(6).map(lambda x: (calls.append(int(x)), x * 2)[1]).snapshot(str(tmp_path / "s"))
    ds = make()
    it = iter(ds)
    next(it)
    it.close()  # an unfinished pass leaves no snapshot
    assert not any(os.path.exists(os.path.join(tmp_path, "s", d, "dataset_spec.json"))
                   for d in os.listdir(tmp_path / "s"))
    assert values(ds) == [0, 2, 4, 6, 8, 10]
    calls.clear()
    # Read from the snapshot: map_func runs only once, on the first element, for element_spec.
    assert values(make()) == [0, 2, 4, 6, 8, 10] and calls in ([], [0])
    other = D.range(6).map(lambda x: x * 3).snapshot(str(tmp_path / "s"))  # another pipeline, its own snapshot
    assert values(other) == [0, 3, 6, 9, 12, 15] and len(os.listdir(tmp_path / "s")) == 2
    first, rest, restored = checkpoint_roundtrip(make, 2)
    assert restored == rest == [4, 6, 8, 10]


# --- file readers and writer ---------------------------------------------------------------------------

@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_tfrecord_writer_and_reader_round_trip(tmp_path, compression):
    rng = np.random.default_rng(3)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 5000, 40)] + [b"", b"x" * 300000]
    path = str(tmp_path / "r.tfrecord")
    E.TFRecordWriter(path, compression).write(
        D.from_generator(lambda: iter(records), output_signature=md.data.TensorSpec((), np.bytes_)))
    assert list(md.data.TFRecordDataset(path, compression)) == records
    first, rest, restored = checkpoint_roundtrip(lambda: md.data.TFRecordDataset([path, path], compression), 50)
    assert first + rest == records + records and restored == rest


def test_readers_shard_by_file_and_check_their_arguments(tmp_path):
    names = []
    for i in range(4):
        names.append(str(tmp_path / f"{i}.tfrecord"))
        E.TFRecordWriter(names[-1]).write(D.from_tensors(f"file{i}".encode()))
    ds = md.data.TFRecordDataset(names)
    assert ds._file_count() == 4 and list(ds._file_sharded(2, 1)) == [b"file1", b"file3"]
    with pytest.raises(ValueError, match="compression_type"):
        md.data.TFRecordDataset(names, compression_type="LZMA")
    with pytest.raises(ValueError, match="num_parallel_reads"):
        md.data.TFRecordDataset(names, num_parallel_reads=0)
    with pytest.raises(ValueError, match="record_bytes"):
        md.data.FixedLengthRecordDataset(names, 0)
    with pytest.raises(TypeError, match="scalar `tf.string`"):
        E.TFRecordWriter(str(tmp_path / "x")).write(D.range(3))


# --- experimental functions ----------------------------------------------------------------------------

def test_assert_cardinality_checks_as_it_reads_and_checkpoints():
    ds = D.range(10).filter(lambda x: x < 5).apply(E.assert_cardinality(5))
    assert ds.cardinality() == 5 and len(ds) == 5
    first, rest, restored = checkpoint_roundtrip(lambda: ds, 2)
    assert restored == rest == [2, 3, 4]
    with pytest.raises(ValueError, match="expected to contain 4 elements but contained at least 5"):
        list(D.range(6).apply(E.assert_cardinality(4)))
    with pytest.raises(ValueError, match="expected_cardinality"):
        E.assert_cardinality(-7)


def test_group_by_reducer_and_from_list():
    reducer = E.Reducer(lambda key: (key, np.int64(0)), lambda s, x: (s[0], s[1] + x), lambda k, s: (k, s))
    assert values(D.range(10).apply(E.group_by_reducer(lambda x: x % 3, reducer))) == [[0, 18], [1, 12], [2, 15]]
    with pytest.raises(TypeError, match="Reducer"):
        E.group_by_reducer(lambda x: x, lambda s, x: s)
    ds = E.from_list([np.arange(2), np.arange(5)])
    assert ds.element_spec == md.data.TensorSpec([None], np.int64) and len(ds) == 2
    with pytest.raises(TypeError, match="element 1"):
        E.from_list([1, "a"])


@pytest.mark.parametrize("initial", [None, [0.5, 0.5]])
def test_rejection_resample_reaches_the_target_distribution(initial):
    ds = D.range(4000).rejection_resample(lambda x: np.int32(x % 2), [0.8, 0.2], initial_dist=initial, seed=5)
    classes = np.array([int(c) for c, _ in ds.as_numpy_iterator()])
    assert len(classes) > 1000 and abs((classes == 0).mean() - 0.8) < 0.05
    assert all(int(c) == int(x) % 2 for c, x in ds.take(50).as_numpy_iterator())
    first, rest, restored = checkpoint_roundtrip(
        lambda: D.range(300).rejection_resample(lambda x: np.int32(x % 2), [0.8, 0.2], initial_dist=initial,
                                                seed=5), 40)
    assert restored == rest
    with pytest.raises(ValueError, match="class_func"):
        list(D.range(4).rejection_resample(lambda x: np.int32(5), [0.5, 0.5], initial_dist=[0.5, 0.5]))


@pytest.mark.parametrize("make, error, words", [
    (lambda: D.range(7).batch(3, num_parallel_calls=0), ValueError, "num_parallel_calls"),
    (lambda: D.range(7).batch(3, num_parallel_calls=-3), ValueError, "num_parallel_calls"),
    (lambda: D.range(7).batch(3, num_parallel_calls=2.0), TypeError, "num_parallel_calls"),
    (lambda: D.range(3).interleave(D.range, cycle_length=2, num_parallel_calls=0), ValueError, "num_parallel_calls"),
    (lambda: E.at(D.range(3), 3), md.errors.OutOfRangeError, "Index out of range"),
    (lambda: E.pad_to_cardinality(5)(D.range(3)), ValueError, "dictionary"),
    (lambda: E.map_and_batch(lambda x: x, 2, num_parallel_batches=1, num_parallel_calls=2), ValueError, "only one"),
    (lambda: E.copy_to_device(0), TypeError, "target_device"),
    (lambda: E.get_structure([1]), TypeError, "dataset_or_iterator"),
    (lambda: D.range(3).rejection_resample(lambda x: x, [[0.5, 0.5]]), ValueError, "target_dist"),
])
def test_bad_input_is_refused_with_the_argument_named(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_numpy_iterator_and_iterator_spec():
    it = D.range(3).map(lambda x: str(int(x))).as_numpy_iterator()
    assert isinstance(it, md.data.NumpyIterator) and next(it) == b"0" and type(it.next()) is bytes
    spec = md.data.IteratorSpec.from_value(iter(D.range(2)))
    assert spec == md.data.IteratorSpec(md.data.TensorSpec([], np.int64))
    assert iter(D.range(2).batch(2)).output_shapes == md.TensorShape([None])


def test_csv_dataset_checkpoints_inside_a_file_and_refuses_bad_arguments(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('id,text\n1,"a\nb"\n2,"c,d"\n3,\n', newline="")
    make = lambda: E.CsvDataset([str(path), str(path)], [np.int64(0), "-"], header=True)  # noqa: E731
    first, rest, restored = checkpoint_roundtrip(make, 2)
    assert [int(r[0]) for r in first + rest] == [1, 2, 3, 1, 2, 3] and restored == rest
    assert rest[0] == (3, b"-") and first[0][1] == b"a\nb"
    with pytest.raises(ValueError, match="field_delim"):
        E.CsvDataset(str(path), [0], field_delim="ab")
    with pytest.raises(ValueError, match="select_cols or exclude_cols"):
        E.CsvDataset(str(path), [0], select_cols=[0], exclude_cols=[1])
    with pytest.raises(TypeError, match="record_defaults"):
        E.CsvDataset(str(path), [np.complex64(0)])
    with pytest.raises(ValueError, match="monotonically"):
        E.CsvDataset(str(path), [0, 0], select_cols=[1, 0])


def test_make_csv_dataset_shuffles_every_row_once_per_epoch(tmp_path):
    for k in range(3):
        (tmp_path / f"{k}.csv").write_text("id,x\n" + "".join(f"{k * 100 + i},{i / 2}\n" for i in range(20)))
    ds = E.make_csv_dataset(str(tmp_path / "*.csv"), 7, label_name="x", num_epochs=2, shuffle_seed=3,
                            num_parallel_reads=2)
    ids = [int(i) for features, label in ds for i in features["id"]]
    assert sorted(ids) == sorted(2 * [k * 100 + i for k in range(3) for i in range(20)])
    assert ids[:60] != sorted(ids[:60])  # shuffled
    features, label = next(iter(ds))
    assert list(features) == ["id"] and features["id"].dtype == np.int32 and label.dtype == np.float32
