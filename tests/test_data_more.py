"""md.data behaviour that tf.data leaves to its RNG or to runtime state, so tests/test_data_tf_parity_more.py cannot
record it: shuffle and sample_from_datasets properties, ignore_errors, and checkpointing the iterators of
take_while / scan / unique / rebatch / counter / choose_from_datasets / sample_from_datasets."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mirrored as md

D = md.data.Dataset


def plain(element):
    """An element as Python lists and numbers (tuples and dicts kept)."""
    if isinstance(element, tuple):
        return tuple(plain(e) for e in element)
    if isinstance(element, dict):
        return {k: plain(v) for k, v in element.items()}
    return np.asarray(element).tolist()


def values(ds):
    return [plain(e) for e in ds.as_numpy_iterator()]


# --- shuffle --------------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), buffer_size=st.integers(1, 50), seed=st.integers(0, 2**31))
def test_shuffle_is_a_permutation_reproducible_by_seed(n, buffer_size, seed):
    ds = D.range(n).shuffle(buffer_size, seed=seed)
    first = values(ds)
    assert sorted(first) == list(range(n))
    assert values(D.range(n).shuffle(buffer_size, seed=seed)) == first  # same seed, same first epoch


def test_shuffle_of_buffer_one_is_the_identity_and_reshuffles_only_when_asked():
    assert values(D.range(20).shuffle(1, seed=3)) == list(range(20))
    fixed = D.range(50).shuffle(50, seed=3, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed) != list(range(50))
    epochs = values(D.range(50).shuffle(50, seed=3).repeat(2))
    assert sorted(epochs[:50]) == sorted(epochs[50:]) == list(range(50)) and epochs[:50] != epochs[50:]
    kept = values(D.range(50).shuffle(50, seed=3, reshuffle_each_iteration=False).repeat(2))
    assert kept[:50] == kept[50:]


def test_a_small_shuffle_buffer_only_moves_elements_forward_by_less_than_the_buffer():
    # tf.data's buffer: output i is one of the first i + buffer_size inputs.
    out = values(D.range(200).shuffle(4, seed=1))
    assert all(x < i + 4 for i, x in enumerate(out))


# --- sample_from_datasets / choose_from_datasets ---------------------------------------------------------------

def test_sample_from_datasets_uses_every_element_once_and_follows_the_weights():
    ds = D.sample_from_datasets([D.range(0, 3000), D.range(10000, 11000)], weights=[0.75, 0.25], seed=7)
    out = values(ds)
    assert sorted(out) == list(range(3000)) + list(range(10000, 11000))
    first = out[:2000]  # while both last, about 3:1
    share = sum(x < 10000 for x in first) / len(first)
    assert 0.70 < share < 0.80
    assert values(D.sample_from_datasets([D.range(0, 3000), D.range(10000, 11000)], [0.75, 0.25], seed=7)) == out


def test_sample_from_datasets_stops_at_the_first_empty_dataset_when_asked():
    out = values(D.sample_from_datasets([D.range(5), D.range(100, 200)], seed=1, stop_on_empty_dataset=True))
    assert sum(x < 5 for x in out) == 5 and len(out) < 105
    taken = [x for x in out if x >= 100]
    assert taken == list(range(100, 100 + len(taken)))  # each input read in order


def test_choose_from_datasets_follows_the_choices_and_refuses_bad_ones():
    choices = D.from_tensor_slices(np.int64([1, 0, 1, 1]))
    assert values(D.choose_from_datasets([D.range(3), D.range(10, 13)], choices)) == [10, 0, 11, 12]
    with pytest.raises(TypeError, match="int64"):
        D.choose_from_datasets([D.range(3)], D.range(2, output_type=np.int32))
    with pytest.raises(ValueError, match="Selector index out of range: 5 >= 2"):
        values(D.choose_from_datasets([D.range(3), D.range(3)], D.from_tensor_slices(np.int64([0, 5]))))


# --- ignore_errors, take_while, get_single_element, bad input --------------------------------------------------

def _parse(s):
    return np.int64(int(s))


@pytest.mark.parametrize("parallel", [None, 3])
def test_ignore_errors_drops_the_elements_that_raise(parallel, caplog):
    ds = D.from_tensor_slices(["1", "x", "3", "", "5"]).map(_parse, num_parallel_calls=parallel)
    with pytest.raises(ValueError, match="invalid literal"):
        values(ds)
    assert values(ds.ignore_errors()) == [1, 3, 5]
    with caplog.at_level("WARNING", logger="mirrored.data"):
        assert values(ds.ignore_errors(log_warning=True)) == [1, 3, 5]
    assert sum("ignore_errors dropped an element" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize("make,error,match", [
    (lambda: D.range(3).take_while(lambda x: x), ValueError, "predicate must return a scalar boolean"),
    (lambda: D.range(3).scan(np.int64(0), lambda s, x: s), TypeError, "pair consisting of new state"),
    (lambda: D.range(3).scan(np.int64(0), lambda s, x: (s * 0.5, s)), TypeError, "scan_func must keep the state"),
    (lambda: D.range(3).reduce(0, lambda s, x: s + x), TypeError, "reduce_func must keep the state"),
    (lambda: D.range(3).unique().rebatch(2), ValueError, "rank of >= 1"),
    (lambda: D.range(4).batch(2).rebatch(0), ValueError, "batch_size=0"),
    (lambda: D.range(4).batch(2).rebatch(1.5), TypeError, "batch_size=1.5"),
    (lambda: D.from_tensor_slices([0.5]).unique(), TypeError, "does not support type float"),
    (lambda: D.range(0).get_single_element(), ValueError, "Dataset was empty"),
    (lambda: D.range(2).get_single_element(), ValueError, "more than one element"),
    (lambda: D.counter(step=0.5), TypeError, "step=0.5"),
    (lambda: D.sample_from_datasets([D.range(2)], weights=[-1.0]), ValueError, "weights"),
    (lambda: D.sample_from_datasets([D.range(2), 3]), TypeError, "md.data.Dataset"),
])
def test_bad_arguments_of_the_added_methods_are_named(make, error, match):
    with pytest.raises(error, match=match):
        v = make()
        values(v) if isinstance(v, D) else v


def test_unique_and_take_while_keep_structure_and_order():
    assert values(D.from_tensor_slices(np.array([[1, 2], [1, 2], [2, 1]])).unique()) == [[1, 2], [2, 1]]
    assert values(D.from_tensor_slices(["b", "a", "b"]).unique()) == [b"b", b"a"]
    P = collections.namedtuple("P", "x y")
    got = list(D.range(5).map(lambda x: P(x, -x)).take_while(lambda p: p.x < 2).as_numpy_iterator())
    assert got == [P(0, 0), P(1, -1)] and type(got[0]) is P


def test_scan_carries_a_structured_state():
    ds = D.range(1, 6).scan({"sum": np.int64(0), "n": np.int64(0)},
                            lambda s, x: ({"sum": s["sum"] + x, "n": s["n"] + 1}, (s["sum"] + x) / (s["n"] + 1)))
    assert values(ds) == [1.0, 1.5, 2.0, 2.5, 3.0] and ds.element_spec == md.data.TensorSpec((), np.float64)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 30), batch=st.integers(1, 7), sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       drop=st.booleans())
def test_rebatch_regroups_the_rows_in_order(rows, batch, sizes, drop):
    out = values(D.range(rows).batch(batch).rebatch(sizes, drop_remainder=drop))
    flat = [x for b in out for x in b]
    want, k, i = [], 0, 0
    while i < rows:
        size = sizes[k % len(sizes)]
        if drop and rows - i < size:
            break
        want.append(list(range(i, min(i + size, rows))))
        i, k = i + size, k + 1
    assert out == want and flat == list(range(len(flat)))


# --- checkpoints of the added iterators ------------------------------------------------------------------------

PIPELINES = {
    "take_while": lambda: D.range(30).take_while(lambda x: x < 17),
    "scan": lambda: D.range(20).scan(np.int64(0), lambda s, x: (s + x, s * 2)),
    "unique": lambda: D.from_tensor_slices(np.arange(40) % 7).unique(),
    "rebatch": lambda: D.range(23).batch(5).rebatch([3, 4]),
    "counter": lambda: D.counter(5, 3).take(12),
    "choose": lambda: D.choose_from_datasets([D.range(6), D.range(100, 110)],
                                             D.from_tensor_slices(np.int64([0, 1, 1, 0] * 5)), False),
    "sample": lambda: D.sample_from_datasets([D.range(8), D.range(100, 112)], seed=4),
    "window": lambda: D.from_tensor_slices((np.arange(20), np.arange(20) * 10)).window(4, 3, 2).flat_map(
        lambda a, b: D.zip(a.batch(4), b)),
    "group_by_window": lambda: D.range(30).group_by_window(lambda x: x % 4, lambda k, w: w.batch(2), window_size=3),
    "bucket_by_sequence_length": lambda: D.from_generator(
        lambda: (np.arange(n) for n in [1, 5, 2, 7, 3, 3, 8, 1, 6, 2]),
        output_signature=md.data.TensorSpec((None,), np.int64)).bucket_by_sequence_length(len, [3, 6], [2, 2, 2]),
    "random": lambda: D.random(seed=8).take(9),
    "ignore_errors": lambda: D.from_tensor_slices(["1", "x", "3", "4", "y", "6"]).map(_parse).ignore_errors(),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("position", [0, 1, 3])
def test_a_restored_iterator_of_an_added_method_continues_after_the_save(tmp_path, name, position):
    make = PIPELINES[name]
    expected = values(make())
    it = iter(make())
    for _ in range(position):
        next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt" / "it"))
    restored = iter(make())
    md.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert [plain(e) for e in restored] == expected[position:]


def test_as_numpy_iterator_gives_bytes_and_numpy_scalars_as_tf():
    assert [type(x) for x in D.from_tensor_slices(["a", "b"]).as_numpy_iterator()] == [bytes, bytes]
    assert [type(x) for x in D.from_tensors(3).as_numpy_iterator()] == [np.int32]
    assert [type(x) for x in D.range(4).map(lambda x: 1.5).as_numpy_iterator()] == [np.float32] * 4


def test_random_is_tfs_int64_stream_of_32_bit_values_fixed_by_seed():
    ds = D.random(seed=4)
    assert ds.element_spec == md.data.TensorSpec((), np.int64) and ds.cardinality() == md.data.INFINITE_CARDINALITY
    v = np.array(values(ds.take(20000)))
    assert v.dtype == np.int64 and 0 <= v.min() and v.max() < 2**32 and v.max() > 2**31 and len(set(v.tolist())) > 19000
    first = values(D.random(seed=4).take(5))
    assert values(D.random(seed=4).take(5)) == first
    fixed = D.random().take(5)  # no seed: one seed per dataset, the same draws each iteration (TF's default)
    assert values(fixed) == values(fixed)
    again = D.random(seed=4, rerandomize_each_iteration=True).take(5)
    assert values(again) != values(again)
