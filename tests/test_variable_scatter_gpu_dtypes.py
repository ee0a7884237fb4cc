"""Every variable scatter on GPU copies, for every dtype and op, against TensorFlow's CPU kernels' rule (each
update applied in turn, index by index) written out in NumPy below: repeated rows (the last update wins, sums
and products rounded step by step), wrap-around, NaN in max/min (a NaN held stays, a NaN update is ignored),
bool arithmetic (add: OR, sub: XOR). Marker ``gpu``: on the simulated GPUs without a GPU, whose CuPy stand-in
refuses ``ufunc.at`` where CuPy 14 does and keeps any one value of a repeated index in ``a[rows] = v``."""

import zlib

import numpy as np
import pytest

from gpu_env import SIMULATED, SKIP_REASON, cupy, gpu_pair, mirrored_strategy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from test_variable_scatter_nd import _c_divide  # noqa: E402

DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128")
ROW_OPS = ("add", "sub", "mul", "div", "max", "min", "update")
ND_OPS = ("add", "sub", "update", "max", "min")


def _in_turn(initial, rows, values, op):
    """TF's CPU scatter: ``out[rows[i]] = op(out[rows[i]], values[i])`` for i = 0, 1, ... (NumPy's casts)."""
    out = initial.copy()
    boolean = out.dtype == np.bool_
    with np.errstate(all="ignore"):
        for row, value in zip(rows, values):
            old = out[row]
            if op == "update":
                new = value
            elif op == "add":
                new = old | value if boolean else old + value
            elif op == "sub":
                new = old ^ value if boolean else old - value
            elif op == "mul":
                new = old & value if boolean else old * value
            elif op == "div":
                new = np.true_divide(old, value)
            elif op == "max":
                new = np.where(old < value, value, old)
            else:
                new = np.where(old > value, value, old)
            out[row] = np.asarray(new).astype(out.dtype)
    return out


def _values(rng, dtype, shape, op):
    """Values that make the order matter: wrap-around for integers, sums and products that round for floats."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if op == "div":  # (no division by zero: its integer result is undefined on either side)
            x = rng.integers(1, 5, shape) * rng.choice([-1, 1] if dt.kind == "i" else [1], shape)
            return x.astype(dt)
        return rng.integers(max(info.min, -(2 ** 40)), min(info.max, 2 ** 40), shape, dtype=np.int64).astype(dt)
    part = np.float16 if dt == np.float16 else np.float32 if dt in (np.float32, np.complex64) else np.float64
    scale = 0.7 if op in ("mul", "div") else 300.0
    x = (rng.standard_normal(shape) * scale + (1.0 if op in ("mul", "div") else 0.0)).astype(part)
    if dt.kind == "c":
        x = x + 1j * (rng.standard_normal(shape) * scale).astype(part)
    return x.astype(dt)


def _seed(*names) -> int:
    """A seed of the case's names, the same in every process (str's hash() is not)."""
    return zlib.crc32(repr(names).encode())


def _assert_same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # (NaN equals NaN)
    if want.dtype.kind == "f":  # and -0.0 is not 0.0
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _copies(v):
    return [cupy.asnumpy(c.read_value()) for c in v.values]


def _gpu_variable(strategy, initial):
    with strategy.scope():
        return md.Variable(initial)


@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_scatter_every_dtype_on_gpu_copies(dtype, op):
    if op in ("max", "min") and (dtype.startswith("complex") or dtype == "bool"):
        pytest.skip("TF has no bool or complex max/min (refused before any device work)")
    rng = np.random.default_rng(_seed(dtype, op))
    initial = _values(rng, dtype, (5, 3), "add")
    rows = np.array([3, 1, 3, 3, 0, 1, 3, 4, 3], np.int64)  # row 3 five times, row 1 twice, row 2 never
    values = _values(rng, dtype, (len(rows), 3), op)
    want = _in_turn(initial, rows, values, op)
    with gpu_pair(), mirrored_strategy(2) as strategy:
        v = _gpu_variable(strategy, initial)
        strategy.extended.update(v, lambda c: getattr(c, f"scatter_{op}")(
            md.IndexedSlices(cupy.asarray(values), cupy.asarray(rows))))
        copies = _copies(v)
        _assert_same(copies[1], copies[0])  # the copies stay bit-identical
        if op == "div" and dtype.startswith("complex") and not SIMULATED:
            # A GPU's complex division rounds otherwise than NumPy's (another formula): within a few ulps.
            np.testing.assert_allclose(copies[0], want, rtol=8 * np.finfo(want.dtype).eps, atol=0)
        else:
            _assert_same(copies[0], want)


@pytest.mark.parametrize("op", ND_OPS)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if not d.startswith("complex")])
def test_scatter_nd_every_dtype_on_gpu_copies(dtype, op):
    if op in ("max", "min") and dtype == "bool":
        pytest.skip("TF has no bool max/min (refused before any device work)")
    rng = np.random.default_rng(_seed(dtype, op, "nd"))
    initial = _values(rng, dtype, (3, 4, 2), "add")
    indices = np.array([[[2, 1], [0, 3]], [[2, 1], [2, 1]], [[1, 0], [0, 3]]], np.int32)  # [2, 1] three times
    updates = _values(rng, dtype, (3, 2, 2), op)
    want = _in_turn(initial.reshape(12, 2), (indices[..., 0] * 4 + indices[..., 1]).reshape(-1),
                    updates.reshape(-1, 2), op).reshape(initial.shape)
    with gpu_pair(), mirrored_strategy(2) as strategy:
        v = _gpu_variable(strategy, initial)
        strategy.extended.update(v, lambda c: getattr(c, f"scatter_nd_{op}")(cupy.asarray(indices), updates))
        for copy in _copies(v):
            _assert_same(copy, want)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_max_min_nan_and_signed_zero_rules_on_gpu(dtype):
    nan = np.nan
    initial = np.array([nan, 1.0, -0.0, 0.0, 2.0, -1.0], dtype)
    rows = np.array([0, 1, 1, 2, 3, 4, 4, 5, 5, 0], np.int64)
    values = np.array([5.0, nan, 3.0, 0.0, -0.0, nan, 1.0, -0.0, 0.0, -7.0], dtype)
    with gpu_pair(), mirrored_strategy(2) as strategy:
        for op in ("max", "min"):
            want = _in_turn(initial, rows, values, op)
            v = _gpu_variable(strategy, initial)
            getattr(v, f"scatter_nd_{op}")(cupy.asarray(rows[:, None]), cupy.asarray(values))  # (every copy)
            for copy in _copies(v):
                _assert_same(copy, want)
    assert np.isnan(_in_turn(initial, rows, values, "max")[0]) and _in_turn(initial, rows, values, "max")[1] == 3.0
    assert np.signbit(_in_turn(initial, rows, values, "max")[5])  # -1 < -0.0 first; 0.0 is not above it


def test_complex_max_is_refused_on_gpu():
    with gpu_pair(), mirrored_strategy(2) as strategy:
        v = _gpu_variable(strategy, np.ones(3, np.complex64))
        with pytest.raises(TypeError, match="complex64 has no scatter_max"):
            v.values[0].scatter_max(md.IndexedSlices(cupy.asarray(np.ones(1, np.complex64)),
                                                     cupy.asarray(np.array([1]))))


def test_many_repeats_of_one_row_on_gpu():
    """A row named 300 times among 1000 updates: the sum in turn (float32 rounding) and the last update."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 50, 1000)
    rows[rng.permutation(1000)[:300]] = 17
    values = (rng.standard_normal((1000, 2)) * 1000).astype(np.float32)
    initial = rng.standard_normal((50, 2)).astype(np.float32)
    with gpu_pair(), mirrored_strategy(2) as strategy:
        for op in ("add", "update", "mul"):
            operand = np.float32(1) + values / 4000 if op == "mul" else values
            v = _gpu_variable(strategy, initial)
            strategy.extended.update(v, lambda c: getattr(c, f"scatter_{op}")(
                md.IndexedSlices(cupy.asarray(operand), cupy.asarray(rows))))
            for copy in _copies(v):
                _assert_same(copy, _in_turn(initial, rows, operand, op))


def test_cupy_stand_in_refuses_ufunc_at_as_cupy_does():
    """ufunc.at refuses what CuPy 14 refuses, with its words, and keeps its NaN rule (the stand-in as CuPy)."""
    a = cupy.zeros(4, np.int8)
    with pytest.raises(TypeError, match=r"^cupy.add.at only supports int32, int64, float16, float32, float64, "
                                        r"uint32, uint64 as data type$"):
        cupy.add.at(a, cupy.asarray(np.array([0])), cupy.asarray(np.ones(1, np.int8)))
    with pytest.raises(TypeError, match=r"^cupy.subtract.at only supports int32, uint32, as data type$"):
        cupy.subtract.at(cupy.zeros(4, np.int64), cupy.asarray(np.array([0])), 1)
    with pytest.raises(TypeError, match=r"^cupy.maximum.at only supports int32, int64, float32, float64, uint32, "
                                        r"uint64 as data type$"):
        cupy.maximum.at(cupy.zeros(4, np.float16), cupy.asarray(np.array([0])), 1)
    for name in ("multiply", "true_divide"):
        with pytest.raises(NotImplementedError, match=rf"^`cupy_{name}.at` is not supported yet$"):
            getattr(cupy, name).at(cupy.zeros(4, np.float32), cupy.asarray(np.array([0])), 1)
    for dtype in (np.float32, np.float64):  # (as an H100 gave with CuPy 14.2)
        held = cupy.asarray(np.array([np.nan, 1.0, 1.0], dtype))
        cupy.maximum.at(held, cupy.asarray(np.array([0, 1, 2])), cupy.asarray(np.array([5.0, np.nan, 1 + 2.0 ** -40],
                                                                                    dtype)))
        np.testing.assert_array_equal(cupy.asnumpy(held), [5.0, 1.0, 1.0])  # fmaxf: a NaN loses, float64 rounds


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint64"])
def test_integer_div_on_gpu_copies_rounds_toward_zero_exactly(dtype):
    """Large integers divided in turn on the copies' GPUs: C's quotient exactly (a float64 one is not)."""
    info = np.iinfo(dtype)
    initial = np.array([info.max, info.min, info.max - 12345, 7], dtype)
    divisors = np.array([3, 7, 5, 2, 3], dtype) if info.min == 0 else np.array([3, -7, 5, -2, 3], dtype)
    rows = np.array([0, 1, 2, 0, 3])
    want = [int(x) for x in initial]
    for r, d in zip(rows, divisors):
        want[r] = _c_divide(want[r], int(d))
    with gpu_pair(), mirrored_strategy(2) as strategy:
        v = _gpu_variable(strategy, initial)
        strategy.extended.update(v, lambda c: c.scatter_div(md.IndexedSlices(cupy.asarray(divisors),
                                                                           cupy.asarray(rows))))
        for copy in _copies(v):
            assert copy.tolist() == want
