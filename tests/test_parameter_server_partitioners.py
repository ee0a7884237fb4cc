"""md.distribute.experimental.partitioners against TensorFlow 2.21's answers (tests/data/
tf_partitioners_reference.json, recorded by tests/data/record_tf_partitioners.py)."""

import json
import pathlib

import numpy as np
import pytest

import mirrored as md

partitioners = md.distribute.experimental.partitioners
REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "tf_partitioners_reference.json").read_text())


def test_the_recording_covers_every_partitioner():
    assert REFERENCE["tf_version"].startswith("2.21")
    kinds = {case[0] for case in REFERENCE["cases"]}
    assert kinds == {"FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"}
    assert len(REFERENCE["cases"]) > 4000


def _dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(object) if name == "string" else np.dtype(name)  # (TF's strings: NumPy's objects)


@pytest.mark.parametrize("kind", ["FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"])
def test_shards_match_tensorflow(kind):
    checked = 0
    for cls, kwargs, shape, dtype, axis, want in REFERENCE["cases"]:
        if cls != kind:
            continue
        partitioner = getattr(partitioners, cls)(**kwargs)
        where = (cls, kwargs, shape, dtype, axis)
        if isinstance(want, str):  # TF divides by zero (a variable with no elements): a clear error here
            with pytest.raises(ValueError, match="no elements"):
                partitioner(md.TensorShape(shape), _dtype(dtype), axis=axis)
            continue
        assert partitioner(md.TensorShape(shape), _dtype(dtype), axis=axis) == want, where
        assert partitioner(shape=shape, dtype=_dtype(dtype), axis=axis) == want, where  # (any sequence as shape)
        checked += 1
    assert checked > 500


@pytest.mark.parametrize("refused", REFERENCE["refused"], ids=lambda r: f"{r['cls']}-{r['kwargs']}")
def test_bad_arguments_are_refused_as_tf(refused):
    with pytest.raises(ValueError) as raised:
        getattr(partitioners, refused["cls"])(**refused["kwargs"])
    assert refused["raises"] == "ValueError"
    argument = refused["msg"].split("`")[1]
    assert f"`{argument}` must be positive" in str(raised.value)


def test_default_arguments_and_examples_of_the_docs():
    assert partitioners.FixedShardsPartitioner(2)([10, 3], np.float32) == [2, 1]
    assert partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2)([6, 1], np.float32) == [2, 1]
    assert partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=10)([6, 1], np.float32) == [6, 1]
    assert partitioners.MinSizePartitioner()([1024, 1024], np.float32) == [1, 1]  # (max_shards=1 by default)
    assert partitioners.MaxSizePartitioner(max_shard_bytes=4)([6, 1], np.float32) == [6, 1]
    assert partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)([6, 1], np.float32) == [2, 1]
    assert partitioners.MaxSizePartitioner(max_shard_bytes=1024)([6, 1], np.float32) == [1, 1]
    with pytest.raises(NotImplementedError):
        partitioners.Partitioner()([2], np.float32)
    with pytest.raises(ValueError, match="axis 2"):
        partitioners.MinSizePartitioner()([2, 2], np.float32, axis=2)
    with pytest.raises(ValueError, match="dtype="):
        partitioners.MinSizePartitioner()([2, 2], object())
