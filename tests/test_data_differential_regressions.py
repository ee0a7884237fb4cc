"""The mismatches between md.data and tf.data that the generated pipelines of tests/test_data_differential.py
found, one focused test each (TF 2.21's answer written out)."""

import numpy as np
import pytest

import mirrored as md

D = md.data.Dataset


def test_a_rank_0_array_is_yielded_as_a_numpy_scalar():
    # TF yields every rank-0 tensor as a NumPy scalar: from_tensors/zip of 0-d arrays, and a map returning one.
    for ds in (D.from_tensors(np.array(2.5)), D.zip(D.from_tensors(np.array(1, np.int32)), D.range(1)).map(
            lambda a, b: a), D.range(1).map(lambda x: np.array(x, np.float32)),
               D.from_tensors({"s": np.array(b"ab")}).map(lambda d: d["s"])):
        (element,) = list(ds.as_numpy_iterator())
        assert not isinstance(element, np.ndarray) and np.ndim(element) == 0, type(element)
    assert list(D.from_tensors(np.array(7, np.uint8))) == [np.uint8(7)]
    assert type(list(D.from_tensors(np.array(7, np.uint8)))[0]) is np.uint8


def test_interleave_refuses_more_parallel_calls_than_its_cycle():
    words = "`num_parallel_calls` must be either `tf.data.AUTOTUNE` or a value less than or equal to `cycle_length`"
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):  # a fixed cycle_length: at once, as TF
        D.range(3).interleave(lambda x: D.range(x), cycle_length=2, num_parallel_calls=3)
    # cycle_length=None is the CPU count, checked when the iterator starts
    ds = D.range(3).interleave(lambda x: D.range(x), num_parallel_calls=10_000)
    with pytest.raises(ValueError, match="`num_parallel_calls` is 10000 and `cycle_length` is"):
        list(ds)
    for parallel in (2, md.data.AUTOTUNE):
        assert list(D.range(3).interleave(lambda x: D.range(x), cycle_length=2, num_parallel_calls=parallel)) == \
            [0, 0, 1]


def spec(shape, dtype):
    return md.data.TensorSpec(shape, dtype)


@pytest.mark.parametrize("make, expected", [
    # TF 2.21's element_spec of each (recorded by hand with /work/venvs/tf/bin/python); every input is empty.
    (lambda: D.range(5, 0).map(lambda x: (x, np.float32(x) * 2)),
     (spec((), np.int64), spec((), np.float32))),
    (lambda: D.from_tensor_slices(np.zeros((0, 3), np.float32)).batch(2).map(lambda x: x[0]), spec((3,), np.float32)),
    (lambda: D.range(0).batch(2).flat_map(lambda x: D.from_tensor_slices(x)), spec((), np.int64)),
    (lambda: D.range(0).scan(np.int64(0), lambda s, x: (s + x, (s, np.float32(x)))),
     (spec((), np.int64), spec((), np.float32))),
    (lambda: D.range(0).batch(3).group_by_window(lambda x: np.int64(x.size), lambda k, w: w.batch(2), 2),
     spec((None, None), np.int64)),
    (lambda: D.range(0).window(2).flat_map(lambda w: w.batch(2, drop_remainder=True)), spec((2,), np.int64)),
])
def test_a_function_over_an_empty_input_still_has_tfs_element_spec(make, expected):
    ds = make()
    assert ds.element_spec == expected
    assert list(ds) == []


def test_a_spec_learnt_from_the_first_element_is_the_traced_one():
    # A component passed through a map keeps its spec (a static 1 is not taken for the batch size 1), and an
    # interleave's datasets have unknown where the input has.
    padded = D.from_tensor_slices(np.zeros((3, 1))).padded_batch(1).map(lambda x: (x, x))
    assert padded.element_spec == (spec((None, 1), np.float64),) * 2
    interleaved = D.from_tensor_slices(np.zeros((5, 3))).batch(2).interleave(lambda x: D.from_tensors(x),
                                                                             cycle_length=1)
    assert interleaved.element_spec == spec((None, 3), np.float64)
    assert [x.shape for x in interleaved] == [(2, 3), (2, 3), (1, 3)]


def test_a_function_that_fails_on_the_stand_in_element_of_an_empty_input_says_so():
    ds = D.range(0).map(lambda x: {"a": 1}[x])
    with pytest.raises(ValueError, match="the input is empty, and the function failed on a stand-in element"):
        ds.element_spec
    assert list(ds) == []


def test_rebatch_checks_that_the_components_share_their_batch_size():
    # TF 2.21: static batch dimensions that differ are refused at once (when partial batches may form), an
    # element whose components differ when it is read.
    with pytest.raises(ValueError, match=r"The batch dimension of component 0 is 2, while the batch dimension of "
                                         r"component i is \[2 3\]"):
        D.zip(D.range(4).batch(2, True), D.range(6).batch(3, True)).rebatch(2)
    for ds in (D.zip(D.range(4).batch(2, True), D.range(6).batch(3, True)).rebatch(2, drop_remainder=True),
               D.zip(D.range(4).batch(2), D.range(6).batch(3)).rebatch(2)):
        with pytest.raises(ValueError, match="Component 0 had size 2 but component 1 had size, 3"):
            list(ds)
    got = list(D.zip(D.range(4).batch(2), D.range(4).batch(2)).rebatch(3))
    assert [(a.tolist(), b.tolist()) for a, b in got] == [([0, 1, 2], [0, 1, 2]), ([3], [3])]


@pytest.mark.parametrize("padded_shapes, expected", [(None, (None, 1)), ([None], (None, None)), ([-1], (None, None)),
                                                     ([3], (None, 3))])
def test_padded_batch_spec_is_the_padded_shape(padded_shapes, expected):
    # TF 2.21: an explicit padded_shapes dimension of None/-1 is unknown in the spec, even over a static input
    # dimension; without padded_shapes the input's shape is kept.
    ds = D.from_tensor_slices(np.zeros((4, 1), np.int32)).padded_batch(2, padded_shapes=padded_shapes)
    assert ds.element_spec == spec(expected, np.int32)
    assert [x.shape for x in ds] == [(2, expected[1] or 1)] * 2


def test_unbatch_checks_batch_sizes_as_tf():
    # TF 2.21: static leading dimensions that differ are refused at once; an element's when it is read, in TF's
    # words (rebatch's too); the cardinality is unknown whenever the batch dimension is, even of an empty input.
    with pytest.raises(ValueError, match="matching leading dimension. Encountered both 1 and 2"):
        D.zip(D.from_tensors(np.zeros((1, 3))), D.from_tensors(np.zeros((2,)))).unbatch()
    ragged = D.from_generator(lambda: iter([(np.zeros((2, 3)), np.zeros((1,)))]),
                              output_signature=(spec((None, 3), np.float64), spec((1,), np.float64)))
    with pytest.raises(ValueError, match="Component 0 had size 2 but component 1 had size, 1"):
        list(ragged.unbatch())
    assert D.range(0).batch(2).unbatch().cardinality() == md.data.UNKNOWN_CARDINALITY
    assert D.from_tensor_slices(np.zeros((3, 0))).unbatch().cardinality() == md.data.UNKNOWN_CARDINALITY
    assert D.from_tensor_slices(np.zeros((0, 2))).unbatch().cardinality() == 0
    assert D.range(3).batch(4).repeat().unbatch().cardinality() == md.data.INFINITE_CARDINALITY


def test_a_function_that_fails_on_the_first_element_still_has_a_spec():
    # TF traces the function, so data it fails on does not matter to element_spec: TF 2.21 gives float32 and
    # [1.0, 0.5] for range(3).map(1 / x checked).ignore_errors(); an upstream failure likewise.
    def inverse(x):
        if x == 0:
            raise ValueError("x == 0")
        return np.float32(1) / np.float32(x)
    ds = D.range(3).map(inverse).ignore_errors()
    assert ds.element_spec == spec((), np.float32)
    assert list(ds) == [1.0, 0.5]
    later = D.range(3).map(inverse).map(lambda y: (y, y * 2)).scan(np.float32(0), lambda s, t: (s + t[0], s))
    assert later.element_spec == spec((), np.float32)
    interleaved = D.range(3).map(inverse).interleave(lambda y: D.from_tensors(y), cycle_length=1)
    assert interleaved.element_spec == spec((), np.float32)
    with pytest.raises(ValueError, match="x == 0"):
        list(interleaved)
    with pytest.raises(TypeError, match="map_func returned None"):  # failing on the stand-in too: the data's error
        D.range(3).map(lambda x: None).element_spec


def test_a_static_dimension_equal_to_the_batch_size_stays_static():
    # 32x32 images in batches of 32: TF 2.21 traces (None, 32, 32, 3); a size that follows the batch is unknown,
    # and so is a slice of an unknown length (x[:, :1] is (None, 1, 32, 3), x[:1] of a (None,) vector (None,)).
    images = D.from_tensor_slices(np.zeros((64, 32, 32, 3), np.float32)).batch(32)
    assert images.map(lambda x: x * 2).element_spec == spec((None, 32, 32, 3), np.float32)
    assert images.map(lambda x: (x[:, :1], x.mean(0))).element_spec == (spec((None, 1, 32, 3), np.float32),
                                                                        spec((32, 32, 3), np.float32))
    assert images.interleave(lambda x: D.from_tensors(x), cycle_length=1).element_spec == \
        spec((None, 32, 32, 3), np.float32)
    assert images.scan(np.float32(0), lambda s, x: (s, x[0])).element_spec == spec((32, 32, 3), np.float32)
    ragged = D.from_generator(lambda: (np.arange(n) for n in [1, 2]), output_signature=spec((None,), np.int64))
    assert ragged.map(lambda x: x[:1]).element_spec == spec((None,), np.int64)
