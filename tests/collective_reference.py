"""NumPy references for the collectives, with NumPy's own integer rules."""

import numpy as np

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    BFLOAT16 = None

DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")]
if BFLOAT16 is not None:
    DTYPES.insert(1, BFLOAT16)
OPS = ("sum", "prod", "min", "max", "mean")


def is_float(dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == BFLOAT16


def make_inputs(rng, n, shape, dtype, op):
    """Per-replica inputs whose reductions are representable (prod stays near 1)."""
    dtype = np.dtype(dtype)
    out = []
    for _ in range(n):
        if is_float(dtype):
            x = rng.uniform(0.5, 1.5, shape) if op == "prod" else rng.standard_normal(shape) * 8
        elif op == "prod":
            x = rng.integers(-2 if dtype.kind == "i" else 0, 3, shape)
        else:
            info = np.iinfo(dtype)
            x = rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True)
        out.append(np.asarray(x).astype(dtype))
    return out


def reference(inputs, op):
    """What every replica must hold after all_reduce(inputs, op)."""
    dtype = inputs[0].dtype
    n = len(inputs)
    if is_float(dtype):
        st = np.stack([x.astype(np.float64) for x in inputs])
        ref = {"sum": st.sum(0), "prod": st.prod(0), "min": st.min(0), "max": st.max(0), "mean": st.mean(0)}[op]
        return ref
    st = np.stack(inputs)
    if op == "sum":
        return st.sum(0, dtype=dtype)
    if op == "prod":
        return st.prod(0, dtype=dtype)
    if op == "min":
        return st.min(0)
    if op == "max":
        return st.max(0)
    # mean: NumPy true division of the (wrapped) sum: float64, as TensorFlow's MEAN of integers
    return st.sum(0, dtype=dtype).astype(np.float64) / n


def assert_reduced(results, inputs, op):
    """``results`` (one array, or every replica's) hold the reduction of ``inputs``: exactly for
    integers, within the roundings a combine order may add for floats. The reference is made once."""
    if not isinstance(results, (list, tuple)):
        results = [results]
    ref = reference(inputs, op)
    dtype = inputs[0].dtype
    for result in results:
        assert result.dtype == ref.dtype if not is_float(dtype) else result.dtype == dtype
        assert result.shape == inputs[0].shape
    if not is_float(dtype):
        for result in results:
            np.testing.assert_array_equal(result, ref)
        return
    # Each combine rounds once in the dtype: allow n roundings of the magnitudes involved.
    eps = 2.0 ** -7 if dtype == BFLOAT16 else float(np.finfo(dtype).eps)
    mags = np.stack([np.abs(x.astype(np.float64)) for x in inputs])
    scale = mags.sum(0) if op in ("sum", "mean") else (mags.prod(0) if op == "prod" else mags.max(0))
    if op == "mean":
        scale = scale / len(inputs)
    tol = len(inputs) * eps * scale + 1e-30
    for result in results:
        err = np.abs(result.astype(np.float64) - ref)
        assert np.all(err <= tol), f"max error {err.max()} (tolerance {tol.flat[np.argmax(err - tol)]})"


_NP_OPS = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def batch_reference(host, op):
    """What every replica must hold after batch_all_reduce of ``host`` (host[replica][tensor]): per
    tensor, the replicas' reduction in its dtype (an integer mean: float64, as TensorFlow's MEAN)."""
    out = []
    for t in range(len(host[0])):
        stacked = np.stack([row[t] for row in host])
        if op == "mean":
            dtype = np.float64 if stacked.dtype.kind in "iu" else stacked.dtype
            out.append((np.sum(stacked, axis=0, dtype=stacked.dtype) / len(host)).astype(dtype))
        else:
            out.append(_NP_OPS[op](stacked, axis=0).astype(stacked.dtype))
    return out
