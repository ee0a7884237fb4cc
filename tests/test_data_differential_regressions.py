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
