"""mirrored.collectives against NumPy: every op x dtype x replica count x size x algorithm."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrored import collectives
from collective_reference import DTYPES, OPS, assert_reduced, is_float, make_inputs

ALGOS = ("ring", "direct", "tree", "auto")
REPLICAS = (1, 2, 3, 4, 5, 8)


def sizes_for(dtype, n):
    """0, 1, odd, and ±1 around every boundary the native code has: the ring's
    chunk and slice, the pool's 64 KiB item, and the inline/parallel switch."""
    es = np.dtype(dtype).itemsize
    chunk = 16384 // es
    item = 65536 // es
    parallel = 262144 // (2 * n * es)
    s = {0, 1, 3, 17, 1001}
    for b in (chunk, chunk * n, item, parallel, 2 * item + chunk * n):
        s |= {b - 1, b, b + 1}
    return sorted(x for x in s if x >= 0)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", REPLICAS)
def test_all_reduce_matches_numpy(n, dtype, op, algorithm):
    rng = np.random.default_rng(hash((n, str(dtype), op, algorithm)) % 2**32)
    for count in sizes_for(dtype, n):
        inputs = make_inputs(rng, n, (count,), dtype, op)
        originals = [x.copy() for x in inputs]
        out = collectives.all_reduce(inputs, op, algorithm=algorithm)
        for x, orig in zip(inputs, originals):  # out of place leaves inputs alone
            np.testing.assert_array_equal(x, orig)
        assert_reduced(out, originals, op)
        if op == "mean" and not is_float(dtype):
            continue  # the float64 mean of integers cannot be written in place
        collectives.all_reduce(inputs, op, out=inputs, algorithm=algorithm)
        for x, r in zip(inputs, out):
            np.testing.assert_array_equal(x, r)


@pytest.mark.slow
def test_all_reduce_64_mib_in_place():
    n = 2
    a = [np.full(16 << 20, i + 1, np.float32) for i in range(n)]  # 64 MiB each
    a[1][::4097] = 7.0
    collectives.all_reduce(a, "sum", out=a)
    expect = np.full(16 << 20, 3.0, np.float32)
    expect[::4097] = 8.0
    for x in a:
        np.testing.assert_array_equal(x, expect)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    algorithm=st.sampled_from(ALGOS),
    seed=st.integers(0, 2**32 - 1),
)
def test_all_reduce_property(n, shape, dtype, op, algorithm, seed):
    inputs = make_inputs(np.random.default_rng(seed), n, shape, dtype, op)
    assert_reduced(collectives.all_reduce(inputs, op, algorithm=algorithm), inputs, op)


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_every_root(n, dtype):
    rng = np.random.default_rng(n)
    for count in (0, 1, 4097, 70001):
        inputs = make_inputs(rng, n, (count,), dtype, "sum")
        for root in range(n):
            for r in collectives.broadcast(inputs, root):
                np.testing.assert_array_equal(r, inputs[root])
        buf = [x.copy() for x in inputs]
        collectives.broadcast(buf, n - 1, out=buf)
        for r in buf:
            np.testing.assert_array_equal(r, inputs[n - 1])


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_to_root(n, op, dtype):
    rng = np.random.default_rng(7 * n)
    for count in (0, 1, 4097, 70001):
        inputs = make_inputs(rng, n, (count,), dtype, op)
        root = n // 2
        assert_reduced(collectives.reduce(inputs, op, root), inputs, op)
        if op == "mean" and not is_float(dtype):
            continue  # the float64 mean of integers cannot be written in place
        buf = [x.copy() for x in inputs]
        res = collectives.reduce(buf, op, root, out=buf)
        assert res is buf[root]
        assert_reduced(buf[root], inputs, op)
        for i in range(n):  # only the root's buffer changes
            if i != root:
                np.testing.assert_array_equal(buf[i], inputs[i])


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("axis", (0, 1, -1))
def test_all_gather_sizes_may_differ_along_axis(n, axis):
    rng = np.random.default_rng(n)
    base = [3, 4, 5]
    inputs = []
    for i in range(n):
        shape = list(base)
        shape[axis] = i % 3 + (0 if i else 1)  # includes empty parts
        inputs.append(rng.standard_normal(shape).astype(np.float32))
    for r in collectives.all_gather(inputs, axis):
        np.testing.assert_array_equal(r, np.concatenate(inputs, axis))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_large_and_every_dtype(dtype):
    rng = np.random.default_rng(0)
    inputs = [x for x in make_inputs(rng, 3, (50001,), dtype, "sum")]
    inputs[1] = inputs[1][:1234]
    for r in collectives.all_gather(inputs, 0):
        np.testing.assert_array_equal(r, np.concatenate(inputs))


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("packing", [dict(), dict(bytes_per_pack=1000), dict(num_packs=3), dict(bytes_per_pack=1)])
@pytest.mark.parametrize("n", (1, 2, 4, 7))
def test_batch_all_reduce_equals_one_by_one(n, packing, algorithm):
    rng = np.random.default_rng(n)
    shapes = [(3, 5), (0,), (1,), (4097,), (2, 2, 2), (70001,), (17,)]
    dtypes = [np.float32, np.int32, np.float64, np.float16, np.int8, np.float32, np.int64]
    per_replica = [[make_inputs(rng, 1, s, d, "sum")[0] for s, d in zip(shapes, dtypes)] for _ in range(n)]
    for op in ("sum", "mean", "max"):
        got = collectives.batch_all_reduce(per_replica, op, algorithm=algorithm, **packing)
        assert len(got) == n
        for r in range(n):
            for t in range(len(shapes)):
                assert_reduced(got[r][t], [per_replica[k][t] for k in range(n)], op)


def test_batch_of_nothing():
    assert collectives.batch_all_reduce([[], []]) == [[], []]


def test_non_contiguous_inputs_and_outputs():
    rng = np.random.default_rng(1)
    base = [rng.standard_normal((64, 64)) for _ in range(3)]
    views = [b[::2, 1::3] for b in base]
    expect = sum(v.copy() for v in views)
    for r in collectives.all_reduce(views):
        np.testing.assert_allclose(r, expect)
    collectives.all_reduce(views, out=views)  # in place on strided views
    for v in views:
        np.testing.assert_allclose(v, expect)
    for b in base:  # the untouched parts of the parents are intact
        assert np.isfinite(b).all()


def test_nan_and_inf_propagate_like_numpy():
    a = np.array([np.nan, 1.0, np.inf, -np.inf, 2.0], np.float32)
    b = np.array([1.0, np.nan, 1.0, np.inf, -np.inf], np.float32)
    with np.errstate(invalid="ignore"):
        refs = (("sum", a + b), ("max", np.maximum(a, b)), ("min", np.minimum(a, b)), ("prod", a * b))
    for op, ref in refs:
        for algorithm in ("ring", "direct", "tree"):
            np.testing.assert_array_equal(collectives.all_reduce([a, b], op, algorithm=algorithm)[0], ref)


def test_scalars_and_array_likes():
    out = collectives.all_reduce([np.float32(1.5), np.array(2.5, np.float32)])
    assert out[0].shape == () and out[0] == 4.0
    out = collectives.all_reduce([[1, 2], (3, 4)])  # lists become int64 arrays
    np.testing.assert_array_equal(out[1], [4, 6])
    mv = memoryview(np.arange(4, dtype=np.int32))  # buffer protocol
    np.testing.assert_array_equal(collectives.all_reduce([mv, mv])[0], [0, 2, 4, 6])


def test_op_names_any_case_and_enum_values():
    class Op:
        value = "MAX"

    a, b = np.array([1, 5]), np.array([4, 2])
    np.testing.assert_array_equal(collectives.all_reduce([a, b], "SUM")[0], [5, 7])
    np.testing.assert_array_equal(collectives.all_reduce([a, b], "Mean")[0], [2.5, 3.5])
    np.testing.assert_array_equal(collectives.all_reduce([a, b], Op())[0], [4, 5])


def test_gil_released_during_collective():
    bufs = [np.ones(8 << 20, np.float32) for _ in range(4)]
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0)

    t = threading.Thread(target=count)
    t.start()
    try:
        before = len(ticks)
        for _ in range(3):
            collectives.all_reduce(bufs, out=bufs)
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
    assert during > 10, "another Python thread could not run while the collective ran"


def test_concurrent_callers_get_their_own_results():
    errors = []

    def worker(k):
        try:
            rng = np.random.default_rng(k)
            for _ in range(20):
                inputs = [rng.standard_normal(100003) for _ in range(3)]
                for r in collectives.all_reduce(inputs):
                    np.testing.assert_allclose(r, inputs[0] + inputs[1] + inputs[2])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_integer_mean_is_numpy_true_division():
    a, b = np.array([3, -3, 7], np.int32), np.array([0, 0, 0], np.int32)
    for r in collectives.all_reduce([a, b], "mean"):
        assert r.dtype == np.float64
        np.testing.assert_array_equal(r, [1.5, -1.5, 3.5])
    assert collectives.reduce([a, b], "MEAN", 1).dtype == np.float64
    out = [np.zeros(3), np.zeros(3)]
    collectives.all_reduce([a, b], "mean", out=out)
    np.testing.assert_array_equal(out[1], [1.5, -1.5, 3.5])
    with pytest.raises(TypeError, match="float64"):
        collectives.all_reduce([a, b], "mean", out=[a, b])  # integers cannot hold the mean
    got = collectives.batch_all_reduce([[a, np.float32(1.0)], [b, np.float32(2.0)]], "mean")
    assert got[0][0].dtype == np.float64 and got[1][1] == np.float32(1.5)
    assert is_float(np.float16)


@pytest.mark.parametrize("chunk_bytes", (1, 4, 60, 1000, 1 << 20))
def test_ring_chunk_bytes_changes_the_schedule_not_the_result(chunk_bytes):
    rng = np.random.default_rng(chunk_bytes)
    for n in (2, 3, 5):
        inputs = make_inputs(rng, n, (12345,), np.int32, "sum")
        assert_reduced(collectives.all_reduce(inputs, "sum", algorithm="ring", chunk_bytes=chunk_bytes), inputs, "sum")
        lists = [[x, x[:77]] for x in inputs]
        got = collectives.batch_all_reduce(lists, "max", algorithm="ring", chunk_bytes=chunk_bytes)
        np.testing.assert_array_equal(got[0][1], np.max([x[:77] for x in inputs], axis=0))
    with pytest.raises(ValueError, match="chunk_bytes"):
        collectives.all_reduce(inputs, chunk_bytes=-1)


def test_batch_results_are_independent_writeable_arrays():
    per_replica = [[np.full(5, r, np.float32), np.full((2, 3), r, np.int64)] for r in range(3)]
    got = collectives.batch_all_reduce(per_replica, "sum")
    for r in range(3):
        assert got[r][0].flags.c_contiguous and got[r][0].flags.writeable
        assert got[r][1].shape == (2, 3) and got[r][1].dtype == np.int64
    got[0][0][:] = 99  # results of different replicas never share memory
    np.testing.assert_array_equal(got[1][0], np.full(5, 3, np.float32))
    np.testing.assert_array_equal(per_replica[2][0], np.full(5, 2, np.float32))  # inputs untouched


def test_batch_mixes_plain_arrays_with_ones_that_need_converting():
    per_replica = [[np.arange(6.0)[::2], [1, 2], np.float32(r)] for r in range(2)]  # strided, list, 0-d
    got = collectives.batch_all_reduce(per_replica, "sum")
    np.testing.assert_array_equal(got[1][0], [0.0, 4.0, 8.0])
    np.testing.assert_array_equal(got[1][1], [2, 4])
    assert got[0][2].shape == () and got[0][2] == 1.0


def test_large_results_reuse_buffers_only_once_dropped():
    from mirrored.collective.rules import recycler as _recycler

    big = [np.full(1 << 19, float(i + 1), np.float32) for i in range(2)]  # 2 MiB each
    first = collectives.all_reduce(big)
    second = collectives.all_reduce(big)
    live = first + second
    assert not any(np.shares_memory(a, b) for i, a in enumerate(live) for b in live[i + 1:])
    del live
    kept = len(_recycler._buffers)
    addresses = {a.__array_interface__["data"][0] for a in first}
    del first
    third = collectives.all_reduce(big)  # takes the buffers `first` left
    assert {a.__array_interface__["data"][0] for a in third} == addresses
    assert len(_recycler._buffers) == kept
    for _ in range(50):  # dropped results never pile up
        collectives.all_reduce(big)
    assert len(_recycler._buffers) <= kept + 2
    np.testing.assert_array_equal(third[1], np.full(1 << 19, 3.0, np.float32))
    view = second[0][:10]  # a view keeps its buffer out of reuse
    del second
    fourth = collectives.all_reduce(big)
    assert not any(np.shares_memory(view, a) for a in fourth)


def test_recycler_holds_bounded_memory():
    from mirrored.collective.rules import _Recycler

    r = _Recycler()
    for size in range(1, 40):  # many distinct sizes, each dropped at once
        r.empty(size << 20)
    assert len(r._buffers) <= _Recycler.MAX_FREE
    assert sum(b.nbytes for b in r._buffers) <= _Recycler.MAX_FREE_BYTES + (40 << 20)
    kept = r.empty(2 << 20)
    assert r.empty(2 << 20) is not kept  # in use: never handed out twice


def test_broadcast_names_a_bad_algorithm_and_nccl_on_host_buffers():
    xs = [np.arange(3, dtype=np.float32), np.zeros(3, np.float32)]
    for got in collectives.broadcast(xs, 0, algorithm="direct"):
        np.testing.assert_array_equal(got, xs[0])
    with pytest.raises(ValueError, match="algorithm='nccl' needs GPU"):
        collectives.broadcast(xs, 0, algorithm="nccl")
    with pytest.raises(ValueError, match="algorithm='bogus' is unknown"):
        collectives.broadcast(xs, 0, algorithm="bogus")
