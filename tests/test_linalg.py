"""md.linalg.matmul (md.matmul): tf.linalg.matmul's contract on NumPy arrays (np.matmul underneath)
and on CuPy arrays (mirrored's own cuBLAS handle, which stream capture records; gpu marker: on the
simulated GPUs and their stand-in cuBLAS without a GPU, see gpu_env.py).

Results are checked against NumPy over shapes (2-D, batched, broadcast batch dimensions, 1-sized
and empty dimensions, K=1), the four transpose/adjoint combinations, layouts (F-contiguous,
strided) and dtypes; against TensorFlow's recorded outputs; and the bad-input rules.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy

DATA = pathlib.Path(__file__).parent / "data" / "linalg_matmul_tf.npz"
OPS = {"n": {}, "t": {"transpose": True}, "h": {"adjoint": True}}
# (shape of op(a), shape of op(b)): what the product multiplies, before any transpose is stored.
SHAPES = [
    ((3, 4), (4, 5)),
    ((1, 1), (1, 1)),
    ((5, 1), (1, 6)),          # K = 1
    ((1, 7), (7, 1)),          # a 1 x 1 result
    ((2, 3, 4), (2, 4, 5)),    # a batch
    ((2, 1, 3, 4), (3, 4, 5)),  # batch dimensions that broadcast both ways
    ((3, 4), (2, 4, 5)),       # a matrix against a batch
    ((1, 3, 4), (2, 4, 5)),
    ((4, 2, 3, 4), (4, 1, 4, 5)),  # a broadcast over part of the batch (copied)
    ((0, 4), (4, 5)),          # empty dimensions
    ((3, 0), (0, 5)),          # an empty sum: zeros
    ((3, 4), (4, 0)),
    ((2, 0, 3, 4), (1, 4, 5)),  # an empty batch
]
TOLERANCE = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12, "complex64": 1e-5, "complex128": 1e-12}


def _operands(shape_a, shape_b, op_a, op_b, dtype, seed=0):
    """Host inputs whose op(a), op(b) have the given shapes, as stored for the ops, and NumPy's product
    (computed in float64/complex128, rounded once to ``dtype``)."""
    rng = np.random.default_rng(seed)

    def draw(shape):
        x = rng.standard_normal(shape)
        if np.dtype(dtype).kind == "c":
            x = x + 1j * rng.standard_normal(shape)
        return x

    effective = [draw(shape_a), draw(shape_b)]
    stored = [np.swapaxes(x, -1, -2) if op != "n" else x for x, op in zip(effective, (op_a, op_b))]
    stored = [np.conj(x) if op == "h" else x for x, op in zip(stored, (op_a, op_b))]
    stored = [x.astype(dtype) for x in stored]
    # The reference reads the rounded inputs back the way the ops do.
    back = [np.swapaxes(x, -1, -2) if op != "n" else x for x, op in zip(stored, (op_a, op_b))]
    back = [np.conj(x) if op == "h" else x for x, op in zip(back, (op_a, op_b))]
    wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
    want = np.matmul(back[0].astype(wide), back[1].astype(wide)).astype(dtype)
    return stored[0], stored[1], want


def _kwargs(op_a, op_b):
    out = {f"{k}_a": v for k, v in OPS[op_a].items()}
    out.update({f"{k}_b": v for k, v in OPS[op_b].items()})
    return out


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOLERANCE[np.dtype(dtype).name]
    np.testing.assert_allclose(got.astype(want.dtype), want, rtol=tol, atol=tol * 4)


# --- NumPy arrays ---------------------------------------------------------------------

@pytest.mark.parametrize("shape_a, shape_b", SHAPES)
@pytest.mark.parametrize("op_a, op_b", [("n", "n"), ("t", "n"), ("n", "t"), ("h", "h"), ("t", "h")])
def test_host_product_is_numpys(shape_a, shape_b, op_a, op_b):
    a, b, want = _operands(shape_a, shape_b, op_a, op_b, np.complex128)
    _close(md.linalg.matmul(a, b, **_kwargs(op_a, op_b)), want, np.complex128)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "int32", "int64"])
def test_host_dtypes_keep_their_dtype(dtype):
    rng = np.random.default_rng(3)
    a, b = (rng.integers(-9, 9, s).astype(dtype) for s in ((2, 3, 4), (4, 5)))
    got = md.matmul(a, b)
    assert got.dtype == np.dtype(dtype)
    wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64  # exact for these small integers
    np.testing.assert_array_equal(got, np.matmul(a.astype(wide), b.astype(wide)).astype(dtype))


def test_host_bfloat16_accumulates_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    a, b = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((3, 16), (16, 2)))
    got = md.linalg.matmul(a, b)
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype))


# What tf.linalg.matmul (TF 2.21) returns for Python values: they convert as tf.convert_to_tensor
# converts them (floats to float32, ints to int32, or int64 beyond int32), b with a's dtype as its hint.
PYTHON_VALUES = [
    ([[1, 2]], [[3], [4]], np.int32, [[11]]),
    ([[1.0, 2.0]], [[3.0], [4.0]], np.float32, [[11.0]]),
    (((1.0, 2.0),), ((1.0,), (2.0,)), np.float32, [[5.0]]),
    ([[np.float64(1.5), 2.0]], [[1.0], [2.0]], np.float64, [[5.5]]),  # (a NumPy scalar keeps its dtype)
    ([[2**40, 1], [1, 1]], [[1, 1], [1, 1]], np.int64, [[2**40 + 1] * 2, [2, 2]]),
    ([[1 + 1j, 1]], [[1], [1]], np.complex128, [[2 + 1j]]),
    (np.ones((1, 2)), [[1], [2]], np.float64, [[3.0]]),
    (np.ones((1, 2), np.float16), [[1], [2]], np.float16, [[3.0]]),
    (np.ones((1, 2), np.complex64), [[1.5], [2]], np.complex64, [[3.5]]),
    (np.ones((1, 2), np.float32), [[1], [2**40]], np.float32, [[1.0 + 2**40]]),
]


@pytest.mark.parametrize("a, b, dtype, want", PYTHON_VALUES)
def test_python_values_convert_as_tensorflow_converts_them(a, b, dtype, want):
    got = md.matmul(a, b)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, np.array(want, dtype))


def test_python_values_that_do_not_fit_the_hint_keep_their_own_dtype():
    # Floats are no int32 (TF: InvalidArgumentError, the dtypes differ) ...
    with pytest.raises(TypeError, match="a is int32 and b is float32"):
        md.matmul([[1, 2]], [[1.5], [2.0]])
    # ... and where TF wraps 2**40 into int32 and truncates 1.5, mirrored converts exactly or not at all.
    with pytest.raises(TypeError, match="a is int32 and b is int64"):
        md.matmul(np.ones((1, 2), np.int32), [[1], [2**40]])
    with pytest.raises(TypeError, match="a is int32 and b is float32"):
        md.matmul(np.ones((1, 2), np.int32), [[1.5], [2.0]])


def test_matmul_is_the_same_function_under_both_names():
    assert md.matmul is md.linalg.matmul
    import mirrored.linalg

    assert mirrored.linalg.matmul is md.matmul


@pytest.mark.parametrize("case", sorted({k.split("/")[0] for k in np.load(DATA).files}))
def test_recorded_tensorflow_outputs(case):
    data = np.load(DATA)
    kwargs = json.loads(str(data[f"{case}/kwargs"]))
    got = md.linalg.matmul(data[f"{case}/a"], data[f"{case}/b"], **kwargs)
    want = data[f"{case}/out"]
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = TOLERANCE[want.dtype.name]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_tensorflows_hints_are_accepted_and_change_nothing():
    a, b = np.eye(2, dtype=np.float32), np.ones((2, 2), np.float32)
    got = md.linalg.matmul(a, b, a_is_sparse=True, b_is_sparse=True, grad_a=True, grad_b=True, name="mm",
                           output_type=np.float32)
    np.testing.assert_array_equal(got, b)


def test_a_cpu_strategys_replicas_multiply_with_it(two):
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = two.run(lambda: md.linalg.matmul(np.full((1, 3), md.get_replica_context().replica_id_in_sync_group + 1,
                                                    np.float32), w))
    np.testing.assert_array_equal(out.values[1], 2 * w.sum(axis=0, keepdims=True))


@pytest.mark.parametrize("call, error, match", [
    (lambda: md.matmul(np.ones((2, 3)), np.ones((3, 2)), transpose_a=True, adjoint_a=True), ValueError,
     r"Only one of `transpose_a` and `adjoint_a` can be True"),
    (lambda: md.matmul(np.ones((2, 3)), np.ones((3, 2)), transpose_b=True, adjoint_b=True), ValueError,
     r"Only one of `transpose_b` and `adjoint_b`"),
    (lambda: md.matmul(np.ones(3), np.ones((3, 2))), ValueError, r"a has shape \[3\].*ndims must be >= 2.*v\[None, :\]"),
    (lambda: md.matmul(np.ones((2, 3)), np.ones((2, 3))), ValueError, r"Matrix size-incompatible.*transpose"),
    (lambda: md.matmul(np.ones((2, 3, 2, 3)), np.ones((4, 3, 2))), ValueError, r"compatible batch dimensions"),
    (lambda: md.matmul(np.ones((2, 3), np.float32), np.ones((3, 2))), TypeError,
     r"a is float32 and b is float64.*same dtype"),
    (lambda: md.matmul(np.ones((2, 3), np.int8), np.ones((3, 2), np.int8)), TypeError,
     r"int8 is not supported.*output_type=int32"),
    (lambda: md.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), output_type=np.float64), TypeError,
     r"output_type=float64.*only for int8/uint8"),
    (lambda: md.matmul(np.ones((2, 3), np.uint16), np.ones((3, 2), np.uint16)), TypeError, r"uint16 is not supported"),
])
def test_host_bad_input_names_the_argument_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- CuPy arrays: mirrored's cuBLAS -----------------------------------------------------

def _swap_last(x):
    return x.transpose(tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2))


def _on_gpu(*arrays, device=0, order="C"):
    """The arrays on GPU ``device``, each matrix row-major (``order="C"``) or column-major ("F")."""
    with cupy.cuda.Device(device):
        if order == "F":
            return [_swap_last(cupy.asarray(np.ascontiguousarray(_swap_last(x)))) for x in arrays]
        return [cupy.asarray(np.ascontiguousarray(x)) for x in arrays]


@pytest.mark.gpu
@pytest.mark.parametrize("shape_a, shape_b", SHAPES)
@pytest.mark.parametrize("op_a", ["n", "t", "h"])
@pytest.mark.parametrize("op_b", ["n", "t", "h"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_gpu_product_is_numpys(shape_a, shape_b, op_a, op_b, order):
    a, b, want = _operands(shape_a, shape_b, op_a, op_b, np.complex128)
    got = md.linalg.matmul(*_on_gpu(a, b, order=order), **_kwargs(op_a, op_b))
    _close(cupy.asnumpy(got), want, np.complex128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("op_a, op_b", [("n", "n"), ("t", "n"), ("n", "t"), ("h", "t")])
def test_gpu_dtypes(dtype, op_a, op_b):
    a, b, want = _operands((2, 5, 17), (17, 3), op_a, op_b, dtype, seed=5)
    got = md.linalg.matmul(*_on_gpu(a, b), **_kwargs(op_a, op_b))
    assert got.dtype == np.dtype(dtype)
    _close(cupy.asnumpy(got), want, dtype)


@pytest.mark.gpu
def test_gpu_bfloat16_when_cupy_has_it():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    try:
        a = cupy.asarray(np.random.default_rng(6).standard_normal((4, 8)).astype(ml_dtypes.bfloat16))
    except (TypeError, ValueError):
        pytest.skip("this CuPy has no bfloat16 arrays")
    got = cupy.asnumpy(md.linalg.matmul(a, a, transpose_b=True))
    host = cupy.asnumpy(a).astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), host @ host.T, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["f-contiguous", "transposed batch", "rows apart", "every other row",
                                    "every other column", "every other matrix", "reversed", "broadcast view"])
def test_gpu_layouts_of_the_inputs(layout):
    rng = np.random.default_rng(8)
    host = rng.standard_normal((4, 6, 10))
    big = _on_gpu(host)[0]
    a, a_host = {
        "f-contiguous": (big[0].T, host[0].T),
        "transposed batch": (big.transpose(0, 2, 1), host.transpose(0, 2, 1)),
        "rows apart": (big[:, :, :5], host[:, :, :5]),
        "every other row": (big[:, ::2], host[:, ::2]),
        "every other column": (big[:, :, ::2], host[:, :, ::2]),
        "every other matrix": (big[::2], host[::2]),
        "reversed": (big[::-1], host[::-1]),
        "broadcast view": (cupy.broadcast_to(big[0], (3, 6, 10)), np.broadcast_to(host[0], (3, 6, 10))),
    }[layout]
    b_host = rng.standard_normal((a_host.shape[-1], 3))
    got = md.linalg.matmul(a, _on_gpu(b_host)[0])
    np.testing.assert_allclose(cupy.asnumpy(got), np.matmul(a_host, b_host), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_env.SIMULATED, reason="copies are counted by the simulated CUDA runtime")
def test_gpu_transposed_inputs_take_the_op_flag_not_a_copy():
    x, w = _on_gpu(np.ones((6, 4)), np.ones((5, 4)))
    cupy.sim.drain()
    cupy.sim.reset_counters()
    md.linalg.matmul(x.T, w.T, transpose_a=True)  # x, and w's transpose read transposed: no copy
    counted = cupy.sim.counters()
    assert counted["blas"] == {0: 1} and not counted["kernels"]
    cupy.sim.drain()
    cupy.sim.reset_counters()
    md.linalg.matmul(x[:, ::2], w[:, ::2], transpose_b=True)  # every other column: copied first
    assert cupy.sim.counters()["kernels"] == {0: 2}


@pytest.mark.gpu
def test_gpu_product_runs_on_the_current_stream():
    a, b, want = _operands((30, 20), (20, 10), "n", "n", np.float64)
    a, b = _on_gpu(a, b)
    cupy.cuda.Device(0).synchronize()  # the inputs, uploaded on the legacy stream, are there
    stream = cupy.cuda.Stream(non_blocking=True)  # unordered with the legacy stream: only its own order counts
    with stream:
        got = md.linalg.matmul(a, b)
        host = cupy.asnumpy(got, stream=stream)
    np.testing.assert_allclose(host, want, rtol=1e-12)


@pytest.mark.gpu
def test_gpu_product_on_device_1_runs_there_whatever_device_is_current():
    if gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    a, b, want = _operands((2, 3, 4), (4, 5), "t", "n", np.float32)
    a, b = _on_gpu(a, b, device=1)
    with cupy.cuda.Device(0):
        got = md.linalg.matmul(a, b, transpose_a=True)
    assert got.data.device_id == 1
    with cupy.cuda.Device(1):
        host = cupy.asnumpy(got)
    _close(host, want, np.float32)


@pytest.mark.gpu
def test_a_captured_product_replays_on_new_inputs_where_cupys_is_refused():
    x, w = _on_gpu(np.ones((3, 4), np.float32), np.full((4, 2), 2.0, np.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.Stream.null.record())
    pool = cupy.cuda.MemoryPool()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        # Relaxed, as md.function's: the stream's first product allocates its cuBLAS workspace.
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            with pytest.raises(NotImplementedError, match="calling cuBLAS API during stream capture"):
                x @ w
            out = md.linalg.matmul(x, w)
        finally:
            graph = stream.end_capture()
    for value in (1.0, 3.0):
        x.fill(value)
        stream.wait_event(cupy.cuda.Stream.null.record())
        graph.launch(stream)
        np.testing.assert_array_equal(cupy.asnumpy(out, stream=stream), np.full((3, 2), 8.0 * value))


@pytest.mark.gpu
@pytest.mark.parametrize("call, error, match", [
    (lambda x: md.matmul(x, np.ones((4, 2))), TypeError, r"a is a CuPy array and b is not.*cupy.asarray\(b\)"),
    (lambda x: md.matmul(np.ones((2, 3)), x), TypeError, r"b is a CuPy array and a is not"),
    (lambda x: md.matmul(x, x), ValueError, r"Matrix size-incompatible: In\[0\]: \[3, 4\], In\[1\]: \[3, 4\]"),
    (lambda x: md.matmul(x[0], x), ValueError, r"a has shape \[4\].*ndims must be >= 2"),
    (lambda x: md.matmul(x, x.astype(np.float32), transpose_b=True), TypeError, r"a is float64 and b is float32"),
    (lambda x: md.matmul(x.astype(np.int32), x.astype(np.int32), transpose_b=True), TypeError,
     r"int32 is not supported for GPU arrays"),
    (lambda x: md.matmul(x, x, transpose_a=True, adjoint_a=True), ValueError, r"Only one of `transpose_a`"),
])
def test_gpu_bad_input_names_the_argument_and_the_fix(call, error, match):
    x = _on_gpu(np.ones((3, 4)))[0]
    with pytest.raises(error, match=match):
        call(x)


@pytest.mark.gpu
def test_gpu_operands_on_two_devices_are_refused():
    if gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    a = _on_gpu(np.ones((3, 4)), device=0)[0]
    b = _on_gpu(np.ones((4, 2)), device=1)[0]
    with pytest.raises(ValueError, match=r"a is on GPU 0 and b on GPU 1.*one GPU"):
        md.matmul(a, b)


def test_a_missing_cublas_names_every_path_tried_and_the_fix():
    try:
        from mirrored import _cuda  # noqa: F401  (the real engine: nothing loaded it in a fresh process)
    except ImportError:
        pytest.skip("this build has no CUDA extension")
    libm = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6", "/lib64/libm.so.6")
                 if pathlib.Path(p).exists()), "/lib64/libm.so.6")
    code = ("from mirrored import _cuda\n"
            f"try:\n    _cuda.blas_load(['/nonexistent/libcublas.so.13', {libm!r}])\n"
            "except RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "cuBLAS is not available" in out.stdout, out.stdout + out.stderr
    assert "/nonexistent/libcublas.so.13" in out.stdout and "MIRRORED_CUBLAS_LIBRARY" in out.stdout
    if pathlib.Path(libm).exists():  # a library without cuBLAS's entry points is named and refused
        assert f"{libm}: lacks cublasCreate_v2" in out.stdout


def test_the_library_is_looked_for_first_where_the_environment_says(monkeypatch):
    from mirrored.device import engine, gpu

    monkeypatch.setenv("MIRRORED_CUBLAS_LIBRARY", "/opt/cublas/libcublas.so.13")
    engine.select("cuda")
    try:
        candidates = gpu.cublas_library_candidates()
    finally:
        engine.select(None)
    assert candidates[0] == "/opt/cublas/libcublas.so.13"
    assert "libcublas.so.13" in candidates
