"""md.data: tf.data's semantics beyond the recorded parity cases — shuffle's buffer, parallel map and prefetch
in the background, clean shutdown, files, cache, checkpointable iterators, and the bad-input rules."""

import gc
import gzip
import itertools
import os
import threading
import traceback

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import mirrored as md

D = md.data.Dataset
WAIT = 60  # generous: the machine is shared; events normally fire in milliseconds


def _data_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("md.data", "mirrored-prefetch"))]


@pytest.fixture(autouse=True)
def no_thread_outlives_its_iterator():
    yield
    gc.collect()
    assert _data_threads() == []


def values(ds):
    return [np.asarray(e).tolist() for e in ds]


# --- shuffle ----------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), buffer_size=st.integers(1, 50), seed=st.integers(0, 2**31))
def test_shuffle_draws_each_output_from_the_buffer_window(n, buffer_size, seed):
    out = values(D.range(n).shuffle(buffer_size, seed=seed))
    assert sorted(out) == list(range(n))
    # The k-th output comes from the first k + buffer_size inputs (tf.data's buffer semantics).
    assert all(x < k + buffer_size for k, x in enumerate(out))


def test_computing_a_spec_does_not_reorder_the_next_epoch(two):
    def make():
        return D.range(20).shuffle(20, seed=5).map(lambda x: x * 2)

    plain = values(make())
    inspected = make()
    assert repr(inspected.element_spec) == "TensorSpec(shape=(), dtype=int64, name=None)"
    assert values(inspected) == plain
    files = D.list_files(__file__.replace("test_data.py", "test_*.py"), seed=2)
    names = values(files)
    assert values(files.map(lambda n: n)) != names  # the next epoch: reshuffled
    files = D.list_files(__file__.replace("test_data.py", "test_*.py"), seed=2)
    assert files.map(lambda n: n).element_spec is not None and values(files) == names
    distributed = two.experimental_distribute_dataset(make().batch(4))
    assert distributed.element_spec is not None
    assert [x for step in distributed for x in np.concatenate(step.values).tolist()] == plain


def test_shuffle_seed_and_reshuffle_each_iteration():
    assert values(D.range(10).shuffle(1)) == list(range(10))
    ds = D.range(50).shuffle(50, seed=7)
    first, second = values(ds), values(ds)
    assert first != second and sorted(first) == sorted(second)  # a new order every iteration
    assert values(D.range(50).shuffle(50, seed=7)) == first  # the same seed: the same sequence of orders
    fixed = D.range(50).shuffle(50, seed=7, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    epochs = values(D.range(20).shuffle(20, seed=1).repeat(2))
    assert sorted(epochs[:20]) == sorted(epochs[20:]) == list(range(20)) and epochs[:20] != epochs[20:]
    unseeded = D.range(50).shuffle(50)
    assert values(unseeded) != values(D.range(50).shuffle(50))


# --- map, prefetch: background work and shutdown ------------------------------------------------------------

def test_parallel_map_keeps_order_and_runs_calls_concurrently():
    started, release = threading.Barrier(4, timeout=WAIT), threading.Event()

    def slow(x):
        if x < 4:
            started.wait()  # only passes when 4 calls are in flight at once
        return x * 10

    assert values(D.range(30).map(slow, num_parallel_calls=4)) == [x * 10 for x in range(30)]
    release.set()
    got = values(D.range(30).map(lambda x: x + 1, num_parallel_calls=md.data.AUTOTUNE, deterministic=False))
    assert sorted(got) == list(range(1, 31))


def test_map_passes_tuple_components_as_arguments_and_keeps_dicts():
    ds = D.from_tensor_slices(({"a": np.arange(4)}, np.arange(4) * 2)).map(
        lambda d, y: {"sum": d["a"] + y, "y": y}, num_parallel_calls=2)
    assert [(int(e["sum"]), int(e["y"])) for e in ds] == [(0, 0), (3, 2), (6, 4), (9, 6)]
    batched = D.from_tensor_slices({"x": np.ones((5, 2)), "y": np.arange(5)}).batch(2).unbatch().batch(5)
    (element,) = list(batched)
    assert element["x"].shape == (5, 2) and element["y"].tolist() == list(range(5))


def test_an_error_in_map_reaches_the_caller_with_its_traceback():
    def parse(x):
        if x == 5:
            raise KeyError("bad record 5")
        return x

    for parallel in (None, 3):
        it = iter(D.range(10).map(parse, num_parallel_calls=parallel).prefetch(2))
        assert [int(next(it)) for _ in range(5)] == list(range(5))
        with pytest.raises(KeyError, match="bad record 5") as info:
            next(it)
        assert any(frame.name == "parse" for frame in traceback.extract_tb(info.value.__traceback__))
        del it


def test_prefetch_runs_ahead_while_the_consumer_works():
    produced = []
    ahead = threading.Event()

    def gen():
        for i in range(4):
            produced.append(i)
            if i == 1:
                ahead.set()  # element 1 was made while the consumer still holds element 0
            yield i

    it = iter(D.from_generator(gen, output_signature=md.data.TensorSpec((), np.int32)).prefetch(1))
    assert int(next(it)) == 0
    assert ahead.wait(WAIT)
    assert [int(x) for x in it] == [1, 2, 3]


def test_no_thread_outlives_an_abandoned_or_failed_iterator():
    ds = D.range(1000).map(lambda x: x, num_parallel_calls=4).prefetch(8).map(
        lambda x: x, num_parallel_calls=md.data.AUTOTUNE).prefetch(md.data.AUTOTUNE)
    it = iter(ds)
    next(it)
    assert _data_threads()
    del it
    gc.collect()
    assert _data_threads() == []
    for _ in ds:
        break
    gc.collect()
    assert _data_threads() == []
    failing = D.range(10).map(lambda x: 1 // (int(x) - 3), num_parallel_calls=2).prefetch(2)
    with pytest.raises(ZeroDivisionError):
        list(failing)


# --- sources ----------------------------------------------------------------------------------------------

def test_from_generator_is_reiterable_and_checks_its_signature():
    calls = []

    def gen(n):
        calls.append(n)
        for i in range(n):
            yield i, np.full(2, i, np.float32)

    ds = D.from_generator(gen, args=(3,), output_signature=(md.data.TensorSpec((), np.int64),
                                                            md.data.TensorSpec((None,), np.float32)))
    assert [int(a) for a, _ in ds] == [0, 1, 2] and [int(a) for a, _ in ds] == [0, 1, 2]
    assert calls == [3, 3]
    assert repr(ds.element_spec[1]) == "TensorSpec(shape=(None,), dtype=float32, name=None)"
    wrong = D.from_generator(lambda: iter([np.zeros(3)]), output_signature=md.data.TensorSpec((2,), np.float64))
    with pytest.raises(TypeError, match=r"shape \(3,\) where an element of shape \(2,\)"):  # TF's TypeError
        list(wrong)
    legacy = D.from_generator(lambda: ((i, [i, i]) for i in range(2)), output_types=(np.int64, np.float32),
                              output_shapes=((), (2,)))
    assert [(type(a), b.dtype, b.tolist()) for a, b in legacy] == [(np.int64, np.float32, [0.0, 0.0]),
                                                                   (np.int64, np.float32, [1.0, 1.0])]
    strings = D.from_generator(lambda: iter(["ab", "c"]), output_signature=md.data.TensorSpec((), np.bytes_))
    assert list(strings) == [b"ab", b"c"] and repr(strings.element_spec).endswith("dtype=string, name=None)")
    with pytest.raises(TypeError, match=r"yielded \(1, 2\) where a tensor of TensorSpec"):
        list(D.from_generator(lambda: iter([(1, 2)]), output_signature=md.data.TensorSpec((), np.int64)))
    with pytest.raises(TypeError, match="generator.*callable"):
        D.from_generator(gen(3), output_signature=md.data.TensorSpec((), np.int64))


def test_list_files_and_text_lines(tmp_path):
    for name, text in (("b.txt", b"3\n4\n"), ("a.txt", b"1\r\n2"), ("c.csv", b"x\n")):
        (tmp_path / name).write_bytes(text)
    with gzip.open(tmp_path / "d.gz", "wb") as f:
        f.write(b"g1\ng2\n")
    pattern = str(tmp_path / "*.txt")
    names = [os.path.basename(n.decode()) for n in D.list_files(pattern, shuffle=False)]
    assert names == ["a.txt", "b.txt"]
    assert sorted(os.path.basename(n.decode()) for n in D.list_files(pattern, seed=1)) == names
    lines = md.data.TextLineDataset(D.list_files(pattern, shuffle=False))
    assert [bytes(x) for x in lines] == [b"1", b"2", b"3", b"4"]
    assert [bytes(x) for x in md.data.TextLineDataset(str(tmp_path / "d.gz"), compression_type="GZIP")] == \
        [b"g1", b"g2"]
    with pytest.raises(FileNotFoundError, match=r"file_pattern=.*No files matched pattern"):
        D.list_files(str(tmp_path / "*.json"))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        list(md.data.TextLineDataset(str(tmp_path / "missing.txt")))


def test_cache_reads_its_input_once(tmp_path):
    calls = []
    ds = D.range(4).map(lambda x: calls.append(int(x)) or x).cache()
    assert values(ds) == values(ds) == [0, 1, 2, 3]
    assert calls == [0, 1, 2, 3]
    path = str(tmp_path / "cache")
    assert values(D.range(3).map(lambda x: x * 2).cache(path)) == [0, 2, 4]
    never = D.range(3).map(lambda x: 1 // 0).cache(path)  # a new pipeline over the same file reads the file
    assert values(never) == [0, 2, 4]


def test_nested_structures_cardinality_and_reduce():
    ds = D.zip({"a": D.range(5), "b": D.from_tensor_slices(np.ones((5, 3), np.float32))}).batch(2)
    assert ds.cardinality() == 3 and len(ds) == 3
    assert D.range(5).repeat().cardinality() == md.data.INFINITE_CARDINALITY
    assert D.range(5).filter(lambda x: True).cardinality() == md.data.UNKNOWN_CARDINALITY
    assert int(D.range(5).reduce(np.int64(0), lambda s, x: s + x)) == 10
    it = iter(D.range(1))
    assert it.get_next_as_optional().has_value() and not it.get_next_as_optional().has_value()


# --- bad input ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,error,match", [
    (lambda: D.range(3).batch(0), ValueError, "batch_size=0"),
    (lambda: D.range(3).batch(-2), ValueError, "batch_size=-2"),
    (lambda: D.range(3).shuffle(0), ValueError, "buffer_size=0"),
    (lambda: D.range(3).prefetch(-5), ValueError, "buffer_size=-5"),
    (lambda: D.from_tensor_slices((np.ones(3), np.ones(2))), ValueError, "tensors: .*same size in the first"),
    (lambda: D.from_tensor_slices(np.float32(1)), ValueError, "rank >= 1"),
    (lambda: D.range(6).shard(3, 3), ValueError, r"index=3: Index must be between 0 and 2 \(num_shards=3\)"),
    (lambda: D.range(6).shard(0, 0), ValueError, "num_shards=0"),
    (lambda: D.range(3).map(42), ValueError, "map_func=42"),
    (lambda: D.range(3).unbatch(), ValueError, "Cannot unbatch an input with scalar components"),
    (lambda: D.range(3).take(1.5), TypeError, "count=1.5"),
    (lambda: D.range(3).concatenate(D.range(3).map(lambda x: (x, x))).element_spec, TypeError, "Incompatible"),
])
def test_bad_arguments_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("result", [None, object(), {1, 2}])
def test_a_map_function_returning_an_unsupported_type_is_named(result):
    for parallel in (None, 2):
        with pytest.raises(TypeError, match="map_func"):
            list(D.range(3).map(lambda x: result, num_parallel_calls=parallel))


def test_negative_counts_mean_all_as_in_tf():
    assert values(D.range(3).take(-2)) == [0, 1, 2] and values(D.range(3).skip(-2)) == []
    assert values(D.range(2).repeat(-3).take(5)) == [0, 1, 0, 1, 0]


def test_filter_needs_a_boolean():
    with pytest.raises(ValueError, match="predicate must return a scalar boolean"):
        list(D.range(3).filter(lambda x: x))


def test_padded_batch_refuses_elements_larger_than_the_padded_shape():
    ragged = D.range(1, 5).map(lambda x: np.ones(int(x)))
    assert [b.shape for b in ragged.padded_batch(2)] == [(2, 2), (2, 4)]
    with pytest.raises(ValueError, match=r"shape \[3\], larger than its padded shape \[2\]"):
        list(ragged.padded_batch(2, padded_shapes=[2]))


def test_batching_ragged_elements_names_the_shapes():
    with pytest.raises(ValueError, match=r"different shapes in component 0.*\[1\].*\[2\]"):
        list(D.range(1, 3).map(lambda x: np.zeros(int(x))).batch(2))


# --- checkpointable iterators -----------------------------------------------------------------------------

def _pipeline(tmp_path):
    files = []
    for i in range(3):
        path = tmp_path / f"part{i}.txt"
        path.write_bytes(b"".join(b"%d\n" % (100 * i + j) for j in range(7)))
        files.append(str(path))
    lines = D.from_tensor_slices(files).interleave(md.data.TextLineDataset, cycle_length=2, block_length=3)
    numbers = lines.map(lambda s: np.int64(int(s)), num_parallel_calls=3)
    return (D.zip(numbers, D.range(1000)).shuffle(5, seed=11).repeat(2).batch(4)
            .map(lambda a, b: a * 1000 + b, num_parallel_calls=md.data.AUTOTUNE).prefetch(2).enumerate())


@pytest.mark.parametrize("position", [0, 1, 5, 9, 10, 11])
def test_a_restored_iterator_continues_with_the_element_after_the_save(tmp_path, position):
    expected = [(int(i), b.tolist()) for i, b in _pipeline(tmp_path)]
    it = iter(_pipeline(tmp_path))
    for _ in range(position):
        next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt" / "it"))
    next(it, None)  # the saved iterator moves on; the restored one starts at the save
    restored = iter(_pipeline(tmp_path))
    md.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert [(int(i), b.tolist()) for i, b in restored] == expected[position:]


def test_a_finished_iterator_restores_finished(tmp_path):
    it = iter(D.range(2))
    list(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "c"))
    fresh = iter(D.range(2))
    md.train.Checkpoint(iterator=fresh).restore(path)
    assert list(fresh) == []


# --- a model: random pipelines against the same steps on Python lists -----------------------------------------

_STEPS = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.integers(1, 5), st.booleans()),
    st.tuples(st.just("take"), st.integers(-1, 12)),
    st.tuples(st.just("skip"), st.integers(-1, 12)),
    st.tuples(st.just("shard"), st.integers(1, 4), st.integers(0, 3)),
    st.tuples(st.just("repeat"), st.integers(0, 3)),
    st.tuples(st.just("map"), st.sampled_from([None, 1, 3])),
    st.tuples(st.just("filter")),
    st.tuples(st.just("prefetch"), st.sampled_from([1, 3, md.data.AUTOTUNE])),
    st.tuples(st.just("enumerate")),
), max_size=5)


def _model(rows, steps):
    for step in steps:
        kind = step[0]
        if kind == "batch":
            n, drop = step[1], step[2]
            rows = [rows[i:i + n] for i in range(0, len(rows), n) if not drop or i + n <= len(rows)]
        elif kind == "take":
            rows = rows if step[1] == -1 else rows[:step[1]]
        elif kind == "skip":
            rows = [] if step[1] == -1 else rows[step[1]:]
        elif kind == "shard":
            rows = rows[min(step[2], step[1] - 1)::step[1]]
        elif kind == "repeat":
            rows = rows * step[1]
        elif kind == "filter":
            rows = [r for r in rows if np.sum(r) % 2 == 0]
        elif kind == "map":
            rows = [np.asarray(r) * 3 for r in rows]
        elif kind == "enumerate":
            rows = [r[1] if isinstance(r, tuple) else r for r in enumerate(rows)]
    return [np.asarray(r).tolist() for r in rows]


def _apply(ds, steps):
    for step in steps:
        kind = step[0]
        if kind == "batch":
            ds = ds.batch(step[1], drop_remainder=step[2])
        elif kind in ("take", "skip", "repeat"):
            ds = getattr(ds, kind)(step[1])
        elif kind == "shard":
            ds = ds.shard(step[1], min(step[2], step[1] - 1))
        elif kind == "filter":
            ds = ds.filter(lambda x: np.sum(x) % 2 == 0)
        elif kind == "map":
            ds = ds.map(lambda x: x * 3, num_parallel_calls=step[1])
        elif kind == "prefetch":
            ds = ds.prefetch(step[1])
        elif kind == "enumerate":
            ds = ds.enumerate().map(lambda i, x: x)
    return ds


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 30), steps=_STEPS, cut=st.integers(0, 40))
def test_random_pipelines_match_the_list_model_and_restore_anywhere(n, steps, cut):
    assume(sum(step[0] == "batch" for step in steps) <= 1)  # batches of ragged batches cannot be stacked
    expected = _model(list(range(n)), steps)
    ds = _apply(D.from_tensor_slices(np.arange(n)), steps)
    assert [np.asarray(e).tolist() for e in ds] == expected
    cardinality = ds.cardinality()
    assert cardinality in (len(expected), md.data.UNKNOWN_CARDINALITY)
    it = iter(ds)
    taken = [np.asarray(e).tolist() for e in itertools.islice(it, cut)]
    state = it._serialize_to_tensors()
    restored = iter(_apply(D.from_tensor_slices(np.arange(n)), steps))
    restored._restore_from_tensors(state)
    assert taken + [np.asarray(e).tolist() for e in restored] == expected
    del it


@pytest.mark.parametrize("where", ["map", "options"])
def test_deterministic_false_yields_results_as_they_complete(where):
    one_taken = threading.Event()

    def fn(x):
        if x == 0:
            assert one_taken.wait(WAIT)  # element 0 finishes only once element 1 was delivered
        return x

    if where == "map":
        ds = D.range(4).map(fn, num_parallel_calls=2, deterministic=False)
    else:
        options = md.data.Options()
        options.deterministic = False
        ds = D.range(4).map(fn, num_parallel_calls=2).take(4).with_options(options)
    it = iter(ds)
    first = int(next(it))
    one_taken.set()
    assert first == 1 and sorted([first] + [int(x) for x in it]) == [0, 1, 2, 3]
    assert values(D.range(4).map(lambda x: x, num_parallel_calls=2)) == [0, 1, 2, 3]


@pytest.mark.parametrize("pipeline", ["prefetch", "parallel_map", "interleave", "distributed"])
def test_next_after_close_raises_instead_of_waiting_on_stopped_threads(pipeline):
    """close() stops the background threads; a later next() must say so, not wait for them forever."""
    base = md.data.Dataset.from_tensor_slices(np.arange(1000.0))
    if pipeline == "prefetch":
        it = iter(base.prefetch(2))
    elif pipeline == "parallel_map":
        it = iter(base.map(lambda x: x * 2, num_parallel_calls=4).prefetch(4))
    elif pipeline == "interleave":
        it = iter(md.data.Dataset.range(4).interleave(lambda i: md.data.Dataset.range(10), num_parallel_calls=2))
    else:
        strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        it = iter(strategy.experimental_distribute_dataset(base.batch(4).prefetch(2)))
    next(it)
    it.close()
    for call in (lambda: next(it), it.get_next, it.get_next_as_optional):
        with pytest.raises(ValueError, match=r"closed iterator.*iter\(dataset\)"):
            call()
