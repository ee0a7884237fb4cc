"""md.linalg.matmul's fast path on CuPy arrays (2-D and 3-D operands whose matrices are row- or
column-major, read in place with cuBLAS's op flags) and its cuBLAS handle's per-stream state, which
is set again only when the stream changes (gpu marker: real GPUs, or the simulated ones).

Products are checked against NumPy over shapes, dtypes, transposes, batch broadcasting and layouts
(C- and F-contiguous matrices, strided batches, rows further apart than their length, reversed
batches, broadcast views), each layout also through the general path's rank (4-D).
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
import gpu_env
from gpu_env import cupy
from mirrored.device import gpu

pytestmark = pytest.mark.gpu
TOLERANCE = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}
LAYOUTS = ["C", "F", "every other matrix", "reversed batch", "rows apart", "broadcast batch"]


def _swap_last(x):
    return x.transpose(tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2))


def _stored(host, layout):
    """``host`` on GPU 0 with its matrices laid out as ``layout`` says (a view where it is one)."""
    if layout == "F":
        return _swap_last(cupy.asarray(np.ascontiguousarray(_swap_last(host))))
    if layout == "every other matrix":  # batch items two matrices apart
        doubled = np.repeat(host[..., None, :, :], 2, axis=-3).reshape(host.shape[:-3] + (-1,) + host.shape[-2:])
        return cupy.asarray(doubled)[..., ::2, :, :]
    if layout == "reversed batch":  # a negative batch stride: copied first
        return cupy.asarray(np.ascontiguousarray(host[..., ::-1, :, :]))[..., ::-1, :, :]
    if layout == "rows apart":  # each row of a wider matrix: read in place with its leading dimension
        wide = np.concatenate([host, np.zeros(host.shape[:-1] + (3,), host.dtype)], axis=-1)
        return cupy.asarray(wide)[..., :host.shape[-1]]
    if layout == "broadcast batch":  # one matrix for every batch item: stride 0
        return cupy.broadcast_to(cupy.asarray(np.ascontiguousarray(host[..., :1, :, :])), host.shape)
    return cupy.asarray(np.ascontiguousarray(host))


@st.composite
def products(draw):
    """(host a, host b as stored, matmul's flags, layouts): op(a) @ op(b) with broadcasting batches."""
    m, k, n = (draw(st.integers(1, 9)) for _ in range(3))
    items = draw(st.sampled_from([2, 3]))
    batch_a, batch_b = draw(st.sampled_from([((), ()), ((items,), ()), ((), (items,)), ((items,), (items,)),
                                             ((1,), (items,)), ((items,), (1,)), ((2, items), (items,))]))
    ta, tb = draw(st.booleans()), draw(st.booleans())
    dtype = draw(st.sampled_from(sorted(TOLERANCE)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    a = rng.standard_normal(batch_a + ((k, m) if ta else (m, k))).astype(dtype)
    b = rng.standard_normal(batch_b + ((n, k) if tb else (k, n))).astype(dtype)
    layouts = []
    for x in (a, b):
        batched = [lay for lay in LAYOUTS if x.ndim > 2 or lay in ("C", "F", "rows apart")]
        layouts.append(draw(st.sampled_from(batched)))
    return a, b, {"transpose_a": ta, "transpose_b": tb}, layouts


def _reference(a, b, flags):
    x = _swap_last(a) if flags["transpose_a"] else a
    y = _swap_last(b) if flags["transpose_b"] else b
    return np.matmul(x.astype(np.float64), y.astype(np.float64))


@settings(max_examples=120, deadline=None)
@given(case=products())
def test_products_of_any_layout_are_numpys(case):
    a, b, flags, layouts = case
    if "broadcast batch" in layouts:  # (a broadcast view holds the first matrix for every item)
        a, b = (x[..., :1, :, :].repeat(x.shape[-3], axis=-3) if lay == "broadcast batch" else x
                for x, lay in zip((a, b), layouts))
    got = md.linalg.matmul(_stored(a, layouts[0]), _stored(b, layouts[1]), **flags)
    want = _reference(a, b, flags)
    assert got.shape == want.shape and got.dtype == a.dtype
    tol = TOLERANCE[a.dtype.name]
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol * 4)


def test_bfloat16_products_accumulate_in_float32_when_cupy_has_it():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((3, 16, 5), (3, 16, 4)))
    try:
        x, y = cupy.asarray(a), _stored(b, "F")
    except (TypeError, ValueError):
        pytest.skip("this CuPy has no bfloat16 arrays")
    for _ in range(2):  # the first call through the general path, the second through the fast one
        got = cupy.asnumpy(md.linalg.matmul(x, y, transpose_a=True))
        assert got.dtype == a.dtype
        want = np.matmul(_swap_last(a).astype(np.float32), b.astype(np.float32))
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_after_the_first_product_a_call_loads_and_looks_up_nothing(monkeypatch):
    x, w = cupy.asarray(np.ones((4, 3), np.float32)), cupy.asarray(np.full((4, 2), 2.0, np.float32))
    md.linalg.matmul(x, w, transpose_a=True)

    def refuse(*args, **kwargs):
        raise AssertionError("the fast path looked the engine or cuBLAS up again")

    monkeypatch.setattr(gpu, "load_cublas", refuse)
    monkeypatch.setattr(gpu, "cuda_module", refuse)
    got = md.linalg.matmul(_swap_last(x), w[None])  # (F-contiguous a, a batch of one)
    np.testing.assert_array_equal(cupy.asnumpy(got), np.full((1, 3, 2), 8.0, np.float32))


@pytest.mark.skipif(not gpu_env.SIMULATED, reason="copies are counted by the simulated CUDA runtime")
@pytest.mark.parametrize("layout", ["C", "F", "every other matrix", "rows apart", "broadcast batch"])
def test_layouts_cublas_reads_are_not_copied(layout):
    a = _stored(np.ones((3, 4, 5), np.float32), layout)
    w = _stored(np.ones((3, 5, 2), np.float32), "F")
    cupy.sim.drain()
    cupy.sim.reset_counters()
    md.linalg.matmul(a, w)
    counted = cupy.sim.counters()
    assert counted["blas"] == {0: 1} and not counted["kernels"]


def test_products_alternating_between_streams_each_run_on_their_own():
    rng = np.random.default_rng(2)
    host = [rng.standard_normal((6, 5)) for _ in range(3)]
    a, b, c = (cupy.asarray(x) for x in host)
    cupy.cuda.Device(0).synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = []
    for i in range(6):  # the handle's stream (and workspace) set again at each change
        stream = streams[i % 2]
        with stream:
            outs.append((stream, md.linalg.matmul((a, b, c)[i % 3], (a, b, c)[(i + 1) % 3], transpose_b=True)))
    for i, (stream, out) in enumerate(outs):
        want = host[i % 3] @ host[(i + 1) % 3].T
        np.testing.assert_allclose(cupy.asnumpy(out, stream=stream), want, rtol=1e-12)


def test_a_stream_that_ran_products_eagerly_captures_one():
    # The handle stays set to the stream (and its workspace) from the eager product: the captured
    # one sets nothing, and still has the workspace that makes cuBLAS capturable.
    x, w = cupy.asarray(np.ones((3, 4), np.float32)), cupy.asarray(np.full((4, 2), 2.0, np.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.Stream.null.record())
    pool = cupy.cuda.MemoryPool()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        eager = md.linalg.matmul(x, w)
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            out = md.linalg.matmul(x, w)
        finally:
            graph = stream.end_capture()
    np.testing.assert_array_equal(cupy.asnumpy(eager, stream=stream), np.full((3, 2), 8.0))
    x.fill(3.0)
    stream.wait_event(cupy.cuda.Stream.null.record())
    graph.launch(stream)
    np.testing.assert_array_equal(cupy.asnumpy(out, stream=stream), np.full((3, 2), 24.0))
