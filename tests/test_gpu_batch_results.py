"""GPU batch all-reduce on replicas sharing a GPU (one multi-tensor kernel straight from the inputs
to the results) and across GPUs (the pack path), against NumPy; and the results a plan hands out
again (csrc/bindings/result_ring.h, docs/collectives_results.md): a result nobody holds is reused,
one that anything still references (the result, a view, its memory pointer, a DLPack import) never
is. On real GPUs or the simulated ones (gpu_env.py)."""

import gc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from collective_reference import batch_reference
from gpu_env import NGPU, SIMULATED, SKIP_REASON, check_batch, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from mirrored import collectives  # noqa: E402
from mirrored.collective import cuda as cc  # noqa: E402
from mirrored.device.dtypes import dtype_code, op_code  # noqa: E402

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]


def on(device, host, offset=0):
    """host on `device`; offset > 0: as a contiguous slice starting `offset` elements into a buffer
    (a pointer that is not 16-byte aligned)."""
    with cupy.cuda.Device(device):
        if not offset:
            return cupy.asarray(host)
        buf = cupy.asarray(np.concatenate([np.zeros(offset, host.dtype), host.ravel()]))
        return buf[offset:].reshape(host.shape)


def make(devices, sizes, dtypes, seed, offsets=None):
    rng = np.random.default_rng(seed)
    host = [[rng.integers(-3, 4, size).astype(dt) for size, dt in zip(sizes, dtypes)] for _ in devices]
    offsets = offsets or [0] * len(sizes)
    return host, [[on(d, x, o) for x, o in zip(row, offsets)] for d, row in zip(devices, host)]


# --- one pass on a shared GPU, and the pack path across GPUs -------------------------------

DEVICE_SETS = [(0,) * n for n in range(1, 9)] + ([(0, 1), (0, 1, 1, 0)] if NGPU > 1 else [])


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
def test_batches_match_numpy_for_every_dtype_size_and_alignment(devices, op):
    # empty, odd tails, one element, a vector and a half, unaligned starts; mixed dtypes in one batch
    sizes = [0, 1, 3, 7, 12, 33, 129, 1000]
    offsets = [0, 1, 0, 3, 0, 1, 2, 0]
    dtypes = [np.float32 if op == "mean" else DTYPES[t % len(DTYPES)] for t in range(len(sizes))]
    if op == "mean":
        dtypes = [(np.float32, np.float64, np.float16)[t % 3] for t in range(len(sizes))]
    for seed in range(2):  # the planning call, then the plan
        host, lists = make(devices, sizes, dtypes, seed, offsets)
        check_batch(collectives.batch_all_reduce(lists, op), host, op, devices)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), sizes=st.lists(st.integers(0, 300), min_size=1, max_size=40),
       dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "max", "min"]), seed=st.integers(0, 2**16))
def test_any_batch_on_one_gpu_matches_numpy(n, sizes, dtype, op, seed):
    devices = (0,) * n
    rng = np.random.default_rng(seed)
    offsets = [int(rng.integers(0, 4)) for _ in sizes]
    host, lists = make(devices, sizes, [dtype] * len(sizes), seed, offsets)
    check_batch(collectives.batch_all_reduce(lists, op), host, op, devices)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("packing", [(0, 0), (0, 3), (256, 0)], ids=str)
def test_an_engine_batch_on_a_stream_per_replica_is_ordered_after_and_before_each(in_place, packing):
    # Each replica writes its inputs on its own stream, the batch runs on those streams, and each reads
    # its results back on its own: the one launch must wait for every stream and every stream for it.
    # (Several rounds: the simulator's drain order is random, so a missing dependency shows in some.)
    devices = (0, 0, 0)
    # (blocking streams: ordered after the inputs' upload on the legacy default stream)
    streams = [cupy.cuda.Stream(non_blocking=False) for _ in devices]
    engine, _ = cc._engine(devices, "auto")
    for seed in range(6):
        host, lists = make(devices, [5, 0, 64, 17, 300], [np.float32, np.float64, np.int32, np.float32, np.float32],
                           seed)
        for r, (s, row) in enumerate(zip(streams, lists)):
            with s:
                for a in row:
                    a *= 2
                    for _ in range(4 * r):  # more work queued on the other ranks' streams than on rank 0's
                        a += 0
        outs = lists if in_place else [[cupy.empty_like(a) for a in row] for row in lists]
        engine.batch_all_reduce([[a.data.ptr for a in row] for row in lists],
                                [[a.data.ptr for a in row] for row in outs], [a.size for a in lists[0]],
                                [dtype_code(a.dtype, "x") for a in lists[0]], op_code("sum"), packing[0], packing[1],
                                0, [s.ptr for s in streams])
        doubled = [[2 * x for x in row] for row in host]
        for s, row in reversed(list(zip(streams, outs))):  # (rank 0's stream, which runs the batch, last)
            with s:
                got = [a.copy() for a in row]
            for g, w in zip(got, batch_reference(doubled, "sum")):
                np.testing.assert_array_equal(cupy.asnumpy(g, stream=s), w)


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated machine's launches and host waits")
def test_replicas_on_one_gpu_take_one_launch_per_dtype_and_the_host_never_waits():
    devices = (0, 0, 0, 0)
    host, lists = make(devices, [10, 0, 300, 7, 64] * 40, [np.float32, np.float64] * 100, 0)
    for _ in range(5):  # plans it, and fills the engine's table ring with tables this large
        check_batch(collectives.batch_all_reduce(lists, "sum"), host, "sum", devices)
    cupy.sim.drain()
    cupy.sim.reset_counters()
    # fewer calls than the table ring holds, the GPU never catching up meanwhile
    results = [collectives.batch_all_reduce(lists, "sum") for _ in range(3)]
    counted = cupy.sim.counters()
    assert counted["host_waits"] == 0, counted
    assert counted["launches"] == {0: 3 * 2}, counted  # one multi-tensor kernel per dtype and call
    for out in results:
        check_batch(out, host, "sum", devices)


# --- results handed out again ---------------------------------------------------------------

def batch(devices, seed):
    host, lists = make(devices, [5, 300, 0, 33], [np.float32, np.float32, np.float64, np.int32], seed)
    return host, lists


def pointers(out):
    return [a.data.ptr for row in out for a in row if a.size]


@pytest.mark.parametrize("devices", [(0, 0)] + ([(0, 1)] if NGPU > 1 else []), ids=str)
def test_a_dropped_batch_result_is_reused_and_a_held_one_is_never_overwritten(devices):
    host1, lists1 = batch(devices, 1)
    host2, lists2 = batch(devices, 2)
    first = collectives.batch_all_reduce(lists1, "sum")  # plans; the plan keeps nothing yet
    old = pointers(first)
    del first
    gc.collect()
    again = collectives.batch_all_reduce(lists1, "sum")
    assert pointers(again) == old  # nobody held it: the same memory again
    check_batch(again, host1, "sum", devices)
    held = again  # held across the next calls
    for k in range(4):
        out = collectives.batch_all_reduce(lists2, "sum")
        assert not set(pointers(out)) & set(old)
        check_batch(out, host2, "sum", devices)
        if k % 2:
            del out  # dropped every other call: the held set still stays out of reuse
    check_batch(held, host1, "sum", devices)


def held_by(kind, a):
    """Something holding (part of) result array ``a`` the way users do."""
    if kind == "view":
        return a[1:]
    if kind == "element_view":
        return a.reshape(-1)[2:3]
    if kind == "memory_pointer":
        return a.data
    if kind == "offset_pointer":
        return a.data + 4
    if kind == "dlpack":
        return cupy.from_dlpack(a)
    if kind == "list":
        return [a]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["view", "element_view", "memory_pointer", "offset_pointer", "dlpack", "list"])
def test_anything_holding_part_of_a_result_keeps_it_out_of_reuse(kind):
    devices = (0, 0)
    host1, lists1 = batch(devices, 1)
    host2, lists2 = batch(devices, 2)
    collectives.batch_all_reduce(lists1, "sum")  # plans
    out = collectives.batch_all_reduce(lists1, "sum")
    keeper = held_by(kind, out[1][1])
    base = out[1][1].data.ptr
    del out
    gc.collect()
    for _ in range(3):
        fresh = collectives.batch_all_reduce(lists2, "sum")
        assert base not in pointers(fresh)
        check_batch(fresh, host2, "sum", devices)
    if kind in ("view", "element_view", "dlpack"):
        whole = batch_reference(host1, "sum")[1]
        got = cupy.asnumpy(keeper)
        expected = whole[1:] if kind == "view" else whole[2:3] if kind == "element_view" else whole
        np.testing.assert_array_equal(got, expected)
    del keeper
    gc.collect()
    freed = pointers(collectives.batch_all_reduce(lists2, "sum"))  # dropped at once
    again = collectives.batch_all_reduce(lists2, "sum")
    assert pointers(again) == freed  # nothing holds any set now: reuse resumes
    check_batch(again, host2, "sum", devices)


def test_a_result_is_reused_only_on_the_stream_it_was_written_on():
    devices = (0, 0)
    host, lists = batch(devices, 1)
    collectives.batch_all_reduce(lists, "sum")  # plans
    old = pointers(collectives.batch_all_reduce(lists, "sum"))  # made and dropped on the current stream
    with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=False):
        other = collectives.batch_all_reduce(lists, "sum")
        assert not set(pointers(other)) & set(old)
        check_batch(other, host, "sum", devices)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("size", [1, 5000])  # small results share one allocation per GPU; large ones do not
def test_all_reduce_outputs_are_reused_once_dropped_and_never_while_held(n, size):
    devices = (0,) * n
    rng = np.random.default_rng(size)
    host1 = [rng.integers(-3, 4, size).astype(np.float32) for _ in devices]
    host2 = [rng.integers(-3, 4, size).astype(np.float32) for _ in devices]
    xs1 = [on(d, h) for d, h in zip(devices, host1)]
    xs2 = [on(d, h) for d, h in zip(devices, host2)]
    collectives.all_reduce(xs1)  # plans
    out = collectives.all_reduce(xs1)
    old = [a.data.ptr for a in out]
    del out
    gc.collect()
    held = collectives.all_reduce(xs1)
    assert [a.data.ptr for a in held] == old
    view = held[1][:1]
    del held
    gc.collect()
    for _ in range(3):
        out = collectives.all_reduce(xs2)
        assert not set(a.data.ptr for a in out) & set(old)
        for a in out:
            np.testing.assert_array_equal(cupy.asnumpy(a), np.sum(host2, 0))
    np.testing.assert_array_equal(cupy.asnumpy(view), np.sum(host1, 0)[:1])


def test_results_of_a_captured_batch_are_never_handed_out_again():
    import mirrored as md

    devices = (0, 0)
    host1, lists1 = batch(devices, 1)
    host2, lists2 = batch(devices, 2)
    eager = collectives.batch_all_reduce(lists1, "sum")  # plans; held through the capture
    collectives.batch_all_reduce(lists1, "sum")  # a second set, dropped: free for the next eager call

    @md.function
    def step(lists):
        return collectives.batch_all_reduce(lists, "sum")

    step(lists1)  # the warm-up (eager)
    captured = step(lists2)  # captured, then replayed
    check_batch(captured, host2, "sum", devices)
    check_batch(eager, host1, "sum", devices)  # the capture took no kept set
    graph = set(pointers(captured))
    for _ in range(3):
        out = collectives.batch_all_reduce(lists1, "sum")
        assert not set(pointers(out)) & graph  # the graph's results are its own for good
        check_batch(out, host1, "sum", devices)
        del out
    check_batch(captured, host2, "sum", devices)
    if SIMULATED:
        cupy.sim.drain()
        cupy.sim.reset_counters()
    assert set(pointers(step(lists1))) == graph  # a replay writes them again
    if SIMULATED:
        assert cupy.sim.counters()["graph_launches"] == {0: 1}
    check_batch(captured, host1, "sum", devices)


@pytest.mark.parametrize("kind", ["all_reduce", "batch_all_reduce"])
def test_a_set_is_never_handed_out_twice_when_python_runs_inside_the_ring(kind):
    """Replacing a kept set frees its arrays, which runs Python (finalizers; on a busy process,
    another thread's call through the same plan while the GIL changes hands). A call made then must
    find the ring whole: the set being kept is the calling one's alone, not also the other call's."""
    import weakref

    devices = (0, 0)
    host, lists = batch(devices, 1)
    xs = [row[1] for row in lists]
    call = (lambda: collectives.all_reduce(xs, "sum")) if kind == "all_reduce" else \
        (lambda: [a for row in collectives.batch_all_reduce(lists, "sum") for a in row])
    call()  # plans
    with cupy.cuda.Device(0):
        first = call()  # a set kept for the legacy stream
        inner = []
        weakref.finalize(first[0], lambda: inner.append(call()))
        del first  # free, but for another stream than the calls below
        with cupy.cuda.Stream(non_blocking=False):
            held = call()  # the ring's second set, held
            outer = call()  # a third set replaces the first, whose finalizer calls again
    assert len(inner) == 1
    ptrs = {id(x): {a.data.ptr for a in x if a.size} for x in (held, outer, inner[0])}
    assert not ptrs[id(outer)] & ptrs[id(inner[0])], "one set handed to two calls"
    assert not ptrs[id(held)] & (ptrs[id(outer)] | ptrs[id(inner[0])])
    for got in (held, outer, inner[0]):
        want_all = batch_reference(host, "sum")
        expected = [want_all[1]] * len(devices) if kind == "all_reduce" else want_all * len(devices)
        for g, w in zip(got, expected):
            np.testing.assert_array_equal(cupy.asnumpy(g), w)
