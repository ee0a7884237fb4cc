"""GPU collectives against NumPy (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

The host suite's matrix (replicas x dtype x op x size x algorithm) on CUDA
buffers: the native ring and tree with every replica on GPU 0 (logical GPUs)
and spread over the GPUs, and NCCL with one GPU per replica. The ring runs
with 256-byte minimum chunks here so that small buffers cross every boundary
of the schedule: several slices, both channels, a short last slice.
Run with ``pytest -m gpu``.
"""

import numpy as np
import pytest

from collective_reference import DTYPES, OPS, assert_reduced, make_inputs

from gpu_env import NGPU, SIMULATED, SKIP_REASON, cupy, cupy_has, download, gpu_all_reduce, upload

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from mirrored.collective import cuda as cc  # noqa: E402
from mirrored import collectives, config  # noqa: E402
from mirrored.device import device_util, gpu as _gpu  # noqa: E402

REPLICAS = (1, 2, 3, 4)
ALGOS = ("ring", "tree", "auto", "direct")
SMALL_CHUNK = 256


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cc, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(cc, "_engines", {})


def placements(n):
    out = [("logical", (0,) * n)]
    if NGPU > 1 and n > 1:
        out.append(("spread", tuple(i % NGPU for i in range(n))))
    return out


def _skip_without_nccl():
    if not _gpu.nccl_available():
        pytest.skip(f"NCCL is not installed ({_gpu.NCCL_FIX})")


def sizes_for(dtype, n):
    es = np.dtype(dtype).itemsize
    chunk = SMALL_CHUNK // es
    if SIMULATED:  # the simulated runtime's own tests (csrc/cuda/sim/sim_test.cc) walk every boundary
        return sorted({0, 1, 17, chunk * n - 1, chunk * n + 1, 2 * chunk * n + chunk + 1, 5 * chunk * n})
    s = {0, 1, 3, 17, 1001}
    for b in (chunk, chunk * n, 2 * chunk * n + chunk, 5 * chunk * n):
        s |= {b - 1, b, b + 1}
    return sorted(x for x in s if x >= 0)


def check_matrix(n, dtype, op, algorithm, devices):
    rng = np.random.default_rng(hash((n, str(dtype), op, algorithm, devices)) % 2**32)
    for count in sizes_for(dtype, n):
        xs = make_inputs(rng, n, (count,), dtype, op)
        results, after = gpu_all_reduce(xs, devices, op, algorithm)
        for x, a in zip(xs, after):  # out of place leaves the inputs alone
            np.testing.assert_array_equal(a, x)
        assert_reduced(results, xs, op)
        if op == "mean" and np.dtype(dtype).kind in "iu":
            continue  # the float64 mean of integers cannot be written in place
        in_place, _ = gpu_all_reduce(xs, devices, op, algorithm, inplace=True)
        for r, q in zip(in_place, results):
            if len(set(devices)) in (1, n):
                np.testing.assert_array_equal(r, q)
            else:  # GPUs holding several ranks reduce in place by the ring: another rounding order
                assert_reduced(r, xs, op)
                np.testing.assert_array_equal(r, in_place[0])  # still the same on every replica


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", REPLICAS)
def test_native_all_reduce_matches_numpy(small_chunks, n, dtype, op, algorithm):
    for _, devices in placements(n):
        if algorithm == "direct" and not direct_capable(devices):
            continue  # GPUs without peer access: 'direct' refuses (tested below)
        check_matrix(n, dtype, op, algorithm, devices)


def direct_capable(devices) -> bool:
    try:
        collectives.all_reduce(upload([np.ones(1, np.float32)] * len(devices), devices), algorithm="direct")
        return True
    except ValueError as e:
        assert "needs every rank to read every other rank's memory" in str(e)
        return False


@pytest.mark.parametrize("algorithm", ALGOS + ("nccl",))
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64"])
def test_integer_mean_of_empty_buffers_is_float64(algorithm, dtype):
    n = min(NGPU, 2) if algorithm == "nccl" else 3
    devices = tuple(range(n)) if algorithm == "nccl" else (0,) * n
    if algorithm == "nccl":
        _skip_without_nccl()
    for shape in ((0,), (2, 0), (5,)):
        xs = upload([np.arange(np.prod(shape), dtype=dtype).reshape(shape) + i for i in range(n)], devices)
        for r in collectives.all_reduce(xs, "mean", algorithm=algorithm):
            assert r.dtype == np.float64 and r.shape == shape
            np.testing.assert_array_equal(cupy.asnumpy(r), sum(cupy.asnumpy(x).astype(np.float64) for x in xs) / n)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nccl_all_reduce_matches_numpy(op, dtype):
    _skip_without_nccl()
    n = min(NGPU, 4)
    check_matrix(n, dtype, op, "nccl", tuple(range(n)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nccl_reduce_matches_numpy_on_the_root_only(op, dtype):
    """NCCL's reduce (NcclAllReduce's reduce to one device): the result on the root's GPU, other outputs untouched."""
    _skip_without_nccl()
    n = min(NGPU, 4)
    if n < 2:
        pytest.skip("needs 2 GPUs")
    if not cupy_has(dtype):
        pytest.skip(f"this CuPy has no {np.dtype(dtype)} arrays")
    rng = np.random.default_rng([OPS.index(op), DTYPES.index(dtype)])
    xs = make_inputs(rng, n, (37,), dtype, op)
    arrays = upload(xs, tuple(range(n)))
    for root in range(n):
        r = collectives.reduce(arrays, op, root, algorithm="nccl")
        assert r.device.id == root
        assert_reduced(download([r], dtype), xs, op)
        if op == "mean" and np.dtype(dtype).kind in "iu":
            continue  # the float64 mean of integers has no out= of the inputs' dtype
        out = []
        for a in arrays:
            with a.device:
                out.append(cupy.full_like(a, 3))
        assert collectives.reduce(arrays, op, root, out=out, algorithm="nccl") is out[root]
        got = download(out, dtype)
        assert_reduced(got[root], xs, op)
        for i, o in enumerate(got):
            if i != root:
                np.testing.assert_array_equal(o, np.full_like(xs[0], 3))


def test_nccl_refuses_two_replicas_on_one_gpu():
    xs = upload([np.ones(4, np.float32)] * 2, (0, 0))
    with pytest.raises(ValueError, match="use algorithm='ring' for logical GPUs"):
        collectives.all_reduce(xs, "sum", algorithm="nccl")


def test_64_mib_in_place_on_logical_gpus():
    n = 2
    a = upload([np.full(16 << 20, i + 1, np.float32) for i in range(n)], (0, 0))
    a[1][::4097] = 7.0
    collectives.all_reduce(a, "mean", out=a)
    expect = np.full(16 << 20, 1.5, np.float32)
    expect[::4097] = 4.0
    for x in download(a, np.float32):
        np.testing.assert_array_equal(x, expect)


@pytest.mark.parametrize("algorithm", ALGOS)
def test_nan_and_inf_propagate(algorithm):
    nan, inf = np.nan, np.inf
    xs = [np.array([nan, 1, 1, inf, -inf, 2], np.float32), np.array([1, nan, 2, 1, 1, -inf], np.float32),
          np.array([0, 0, nan, 1, inf, 0], np.float32)]
    for op, expect in (("min", [nan, nan, nan, 1, -inf, -inf]), ("max", [nan, nan, nan, inf, inf, 2]),
                       ("sum", [nan, nan, nan, inf, nan, -inf])):
        results, _ = gpu_all_reduce(xs, (0, 0, 0), op, algorithm)
        for r in results:
            np.testing.assert_array_equal(r, np.array(expect, np.float32))


def test_unaligned_and_non_contiguous_buffers(small_chunks):
    base = [cupy.arange(4001, dtype=cupy.float32) * (i + 1) for i in range(3)]
    views = [b[1:] for b in base]  # 4 bytes off 16-byte alignment: the scalar path
    strided = [b[::2] for b in base]  # copied to contiguous
    np.testing.assert_array_equal(cupy.asnumpy(collectives.all_reduce(views, "sum")[2]),
                                  np.arange(1, 4001, dtype=np.float32) * 6)
    out = [cupy.zeros(4001, cupy.float32)[::2] for _ in range(3)]  # non-contiguous out: written back
    res = collectives.all_reduce(strided, "max", out=out)
    assert res[0] is out[0]
    for o in out:
        np.testing.assert_array_equal(cupy.asnumpy(o), np.arange(0, 4001, 2, dtype=np.float32) * 3)


@pytest.mark.parametrize("n", REPLICAS)
def test_broadcast_reduce_gather(small_chunks, n):
    for _, devices in placements(n):
        rng = np.random.default_rng(n)
        xs = [rng.standard_normal((7, 5)).astype(np.float32) for _ in range(n)]
        arrays = upload(xs, devices)
        for root in range(n):
            got = download(collectives.broadcast(arrays, root), np.float32)
            for g in got:
                np.testing.assert_array_equal(g, xs[root])
            r = collectives.reduce(arrays, "sum", root)
            assert r.device.id == devices[root]
            np.testing.assert_allclose(cupy.asnumpy(r), np.sum(xs, 0), rtol=1e-5, atol=1e-5)
            out = []
            for a in arrays:
                with a.device:  # CuPy allocates on the current device, not the prototype's
                    out.append(cupy.full_like(a, -1))
            collectives.reduce(arrays, "max", root, out=out)
            for i, o in enumerate(out):  # only the root's output is written
                np.testing.assert_array_equal(cupy.asnumpy(o), np.max(xs, 0) if i == root else -1)
        # all_gather: sizes may differ along the axis
        parts = [rng.standard_normal((3, i + 1, 2)).astype(np.float32) for i in range(n)]
        for axis in (0, 1):
            ps = parts if axis == 1 else [p.transpose(1, 0, 2).copy() for p in parts]
            got = collectives.all_gather(upload(ps, devices), axis)
            for g, d in zip(got, devices):
                assert g.device.id == d
                np.testing.assert_array_equal(cupy.asnumpy(g), np.concatenate(ps, axis))


@pytest.mark.parametrize("packing", [dict(), dict(bytes_per_pack=64), dict(num_packs=2)])
@pytest.mark.parametrize("algorithm", ("auto", "nccl"))
def test_batch_all_reduce(small_chunks, packing, algorithm):
    if algorithm == "nccl":
        _skip_without_nccl()
    n = min(NGPU, 3) if algorithm == "nccl" else 3
    devices = tuple(range(n)) if algorithm == "nccl" else placements(n)[-1][1]
    rng = np.random.default_rng(7)
    shapes = [(3,), (40, 2), (), (0,), (513,), (5, 5)]
    dtypes = [np.float32, np.int32, np.float64, np.float32, np.float16, np.int32]
    host = [[np.asarray(rng.integers(-9, 9, s)).astype(t) for s, t in zip(shapes, dtypes)] for _ in range(n)]
    lists = [upload(h, [d] * len(h)) for h, d in zip(host, devices)]
    out = collectives.batch_all_reduce(lists, "sum", algorithm=algorithm, **packing)
    for r, d in enumerate(devices):
        for t in range(len(shapes)):
            assert out[r][t].device.id == d and out[r][t].dtype == dtypes[t]
            np.testing.assert_array_equal(cupy.asnumpy(out[r][t]),
                                          np.sum([h[t] for h in host], 0, dtype=dtypes[t]).astype(dtypes[t]))


@pytest.mark.parametrize("algorithm", ("auto", "direct", "ring", "nccl"))
def test_batch_of_200_tensors_in_one_buffer_per_replica(algorithm):
    """The O(1) batch path: 200 tensors of mixed sizes (some empty, some not a whole 16-byte vector),
    mixed dtypes and non-contiguous inputs; results are views of one buffer per replica."""
    if algorithm == "nccl":
        _skip_without_nccl()
    n = min(NGPU, 2) if algorithm == "nccl" else 2
    devices = tuple(range(n)) if algorithm == "nccl" else (0,) * n
    rng = np.random.default_rng(11)
    sizes = [int(s) for s in rng.integers(0, 3000, 200)]
    dtypes = [(np.float32, np.int32, np.float16)[t % 3] for t in range(200)]
    host = [[rng.integers(-9, 9, s).astype(t) for s, t in zip(sizes, dtypes)] for _ in range(n)]
    lists = [upload(h, [d] * len(h)) for h, d in zip(host, devices)]
    lists[0][5] = cupy.stack([lists[0][5], -lists[0][5]], axis=1).ravel()[::2]  # a strided view of the same values
    out = collectives.batch_all_reduce(lists, "sum", algorithm=algorithm)
    for r, d in enumerate(devices):
        assert len({int(x.data.mem.ptr) for x in out[r]}) == 1, "one result buffer per replica"
        for t in range(200):
            assert out[r][t].device.id == d and out[r][t].dtype == dtypes[t] and out[r][t].shape == (sizes[t],)
            np.testing.assert_array_equal(cupy.asnumpy(out[r][t]),
                                          np.sum([h[t] for h in host], 0, dtype=dtypes[t]).astype(dtypes[t]))


def test_bad_input_is_rejected_clearly():
    a = upload([np.ones(4, np.float32)], (0,))[0]
    with pytest.raises(TypeError, match=r"buffers\[1\] is a host array"):
        collectives.all_reduce([a, np.ones(4, np.float32)])
    with pytest.raises(TypeError, match="same dtype"):
        collectives.all_reduce([a, a.astype(cupy.float64)])
    with pytest.raises(ValueError, match="same shape"):
        collectives.all_reduce([a, cupy.ones(5, cupy.float32)])
    with pytest.raises(TypeError, match="not supported"):
        collectives.all_reduce([a.astype(cupy.complex64)] * 2)
    with pytest.raises(ValueError, match="not a reduce op"):
        collectives.all_reduce([a, a], "avg")
    with pytest.raises(ValueError, match=r"out\[1\] has shape"):
        collectives.all_reduce([a, a], out=[a, cupy.ones(3, cupy.float32)])
    with pytest.raises(ValueError, match="root=2"):
        collectives.broadcast([a, a], 2)


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_output_on_the_wrong_gpu_is_rejected():
    a, b = upload([np.ones(4, np.float32)] * 2, (0, 1))
    with pytest.raises(ValueError, match=r"out\[1\] is on GPU 0 but buffers\[1\] on GPU 1"):
        collectives.all_reduce([a, b], out=[cupy.empty_like(a), cupy.empty_like(a)])


def test_ordered_on_replica_and_current_streams():
    """Inputs written on per-replica streams, reduced from the main thread, read on another stream."""
    n = 2
    arrays = upload([np.zeros(1 << 20, np.float32)] * n, (0,) * n)
    for r in range(n):
        with _gpu.replica_stream(r, 0):
            arrays[r] += r + 1  # queued on the replica's stream
    out = collectives.all_reduce(arrays, "sum")
    with cupy.cuda.Stream() as s:
        total = float(out[1].sum())
        s.synchronize()
    assert total == 3.0 * (1 << 20)
    with cupy.cuda.Stream(non_blocking=True) as s:  # a user's own stream: the collective is ordered on it
        x = upload([np.ones(1 << 20, np.float32)] * n, (0,) * n)
        y = collectives.all_reduce(x, "sum")
        assert float(y[0].sum()) == 2.0 * (1 << 20)


def test_logical_gpu_configuration_maps_to_physical():
    try:
        config.set_logical_device_configuration("GPU", 0, count=2)
        names = [d.name for d in config.list_logical_devices("GPU")]
        assert names[:2] == ["/device:GPU:0",
                             "/device:GPU:1"]
        assert len(names) == NGPU + 1
        assert [config.physical_gpu_index(i) for i in range(len(names))] == [0] + list(range(NGPU))
        assert device_util.physical_ordinal("/gpu:1") == 0
    finally:
        config.set_logical_device_configuration("GPU:0", None)
    assert len(config.list_logical_devices("GPU")) == NGPU


def test_replica_scope_runs_on_the_replica_stream():
    with _gpu.replica_scope(device_util.physical_ordinal("/gpu:0"), 3):
        assert cupy.cuda.get_current_stream().ptr == _gpu.replica_stream(3, 0).ptr
        assert _gpu.collective_stream(0) == 0  # a merged collective from here meets every replica's stream
    assert _gpu.collective_stream(0) == cupy.cuda.get_current_stream(0).ptr


@pytest.mark.parametrize("where", ["replica stream", "user stream"])
def test_strided_batch_inputs_outlive_nothing(where):
    """A strided input is copied to a temporary that is freed when the call returns: on the
    simulator the free poisons it in its stream's order, so a pack kernel not ordered before
    that free would read poison. From a replica's stream (the engine then uses the legacy
    stream) and from a user's non-blocking stream (the engine uses it too)."""
    n = 2
    rng = np.random.default_rng(5)
    host = [[rng.integers(-9, 9, s).astype(np.float32) for s in (5, 300, 17)] for _ in range(n)]
    stream = _gpu.replica_stream(1, 0) if where == "replica stream" else cupy.cuda.Stream(non_blocking=True)
    with stream:
        lists = [[cupy.asarray(x) for x in h] for h in host]
        for r in range(n):  # strided views of the same values
            lists[r][1] = cupy.stack([lists[r][1], -lists[r][1]], axis=1).ravel()[::2]
        out = collectives.batch_all_reduce(lists, "sum")
        del lists
        got = [[cupy.asnumpy(t) for t in row] for row in out]
    for row in got:
        for t, g in enumerate(row):
            np.testing.assert_array_equal(g, host[0][t] + host[1][t])


def test_broadcast_takes_nccl_or_the_native_engine_and_refuses_other_names():
    """``algorithm="nccl"`` (one GPU per replica: what a CUDA graph of each GPU holds) and the native engine give
    the root's bits to every replica, in place with ``out``; a name that is no algorithm is refused, naming it."""
    n = min(NGPU, 3)
    if n < 2:
        pytest.skip("needs two GPUs")
    xs = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) for r in range(n)]
    for algorithm in ("nccl", "auto", "direct"):
        if algorithm == "nccl":
            _skip_without_nccl()
        for root in range(n):
            arrays = upload(xs, tuple(range(n)))
            got = collectives.broadcast(arrays, root, out=arrays, algorithm=algorithm)
            assert [g is a for g, a in zip(got, arrays)] == [True] * n
            for g in download(got, np.float32):
                np.testing.assert_array_equal(g, xs[root])
    with pytest.raises(ValueError, match="algorithm='rings'"):
        collectives.broadcast(upload(xs, tuple(range(n))), 0, algorithm="rings")
