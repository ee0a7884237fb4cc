"""strategy.reduce(op, value, axis=...) keeps TensorFlow's dtypes (issue 20 item 5).

TensorFlow sums along the axis with reduce_sum in the value's own dtype
(integers wrap around), all-reduces that, and for MEAN divides with
``truediv(numer, cast(count, numer.dtype))``: float32 for 8- and 16-bit
integers, float64 for wider ones. The first table was recorded with
TensorFlow 2.21 (MirroredStrategy on two logical CPUs).
"""

import numpy as np
import pytest

import mirrored as md

# x = (arange(12).reshape(2, 3, 2) * 37 % 251); replica r holds x[r]; reduce(op, ., axis=0) in TF 2.21:
TF_RECORDED = {
    ("int8", "SUM"): ("int8", [96, 67]),
    ("int8", "MEAN"): ("float32", [16.0, 11.166666984558105]),
    ("uint8", "SUM"): ("uint8", [96, 67]),
    ("uint8", "MEAN"): ("float32", [16.0, 11.166666984558105]),
    ("int32", "SUM"): ("int32", [608, 579]),
    ("int32", "MEAN"): ("float64", [101.33333333333333, 96.5]),
    ("int64", "SUM"): ("int64", [608, 579]),
    ("int64", "MEAN"): ("float64", [101.33333333333333, 96.5]),
}


def _strategy(n):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])


@pytest.mark.parametrize("dtype,op", sorted(TF_RECORDED))
def test_matches_tensorflow(dtype, op):
    x = (np.arange(12).reshape(2, 3, 2) * 37 % 251).astype(dtype)
    strategy = _strategy(2)
    value = strategy.run(lambda: x[md.get_replica_context().replica_id_in_sync_group])
    out = strategy.reduce(op, value, axis=0)
    want_dtype, want = TF_RECORDED[(dtype, op)]
    assert out.dtype == np.dtype(want_dtype)
    np.testing.assert_array_equal(out, np.asarray(want, want_dtype))


def test_int8_wraps_around_as_in_tensorflow():
    strategy = _strategy(2)
    value = strategy.run(lambda: np.full((2,), 100 + md.get_replica_context().replica_id_in_sync_group * 27, np.int8))
    out = strategy.reduce("SUM", value, axis=0)  # 100 + 100 + 127 + 127 = 454, which is -58 in int8
    assert out.dtype == np.int8 and int(out) == -58


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64", "float16", "float32", "float64"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_sum_and_mean_in_the_values_dtype(replicas, dtype, axis):
    rng = np.random.default_rng(replicas)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    parts = [(rng.integers(info.min, info.max, size=(5, 3), endpoint=True) if info else rng.normal(size=(5, 3)))
             .astype(dtype) for _ in range(replicas)]
    strategy = _strategy(replicas)
    value = strategy.run(lambda: parts[md.get_replica_context().replica_id_in_sync_group])

    total = strategy.reduce("SUM", value, axis=axis)
    local = [p.sum(axis=axis, dtype=dtype) for p in parts]
    expected = local[0]
    for part in local[1:]:
        expected = (expected + part).astype(dtype)  # the all-reduce adds in the dtype too
    assert total.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(total, expected) if info else \
        np.testing.assert_allclose(total, expected, rtol=2e-3 if dtype == "float16" else 1e-6)

    mean = strategy.reduce("MEAN", value, axis=axis)
    count = np.asarray(sum(p.shape[axis] for p in parts)).astype(dtype)
    real = (np.float32 if np.dtype(dtype).itemsize <= 2 else np.float64) if info else np.dtype(dtype)
    assert mean.dtype == np.dtype(real)
    np.testing.assert_allclose(mean, expected.astype(real) / count.astype(real), rtol=1e-6 if info else 2e-3)
