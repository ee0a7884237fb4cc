"""The hierarchical engine (docs/hierarchical.md): replicas on several GPUs where some GPUs host several
(logical GPUs), e.g. 2 GPUs x 2 replicas. One kernel per GPU folds its replicas, NCCL (one rank per GPU)
combines the GPUs in place, one kernel per GPU writes its replicas' outputs; no event between GPUs, so
md.function captures such steps. Marker ``gpu``: on the simulated GPUs and stand-in NCCL without a GPU
(gpu_env.py: kernels run at synchronisation in a seeded random order, freed memory poisoned).
"""

import contextlib
import gc

import numpy as np
import pytest

from collective_reference import BFLOAT16, DTYPES, OPS, assert_reduced, batch_reference, make_inputs

import gpu_env
from gpu_env import SIMULATED, cupy, download, gpu_all_reduce, upload

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(gpu_env.SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from mirrored import collectives  # noqa: E402
from mirrored.collective import cuda as cc  # noqa: E402
from mirrored.device import config, gpu as _gpu  # noqa: E402
from mirrored.distribute.function import EagerFallbackWarning  # noqa: E402

# Replicas per GPU: 2 GPUs x 2, 2 x 3, uneven 2 + 1 and 1 + 3, and 4 GPUs x 2.
LAYOUTS = {"2x2": (2, 2), "2x3": (3, 3), "2+1": (2, 1), "1+3": (1, 3), "4x2": (2, 2, 2, 2)}
SIZES = (0, 1, 17, 1001, 40_003)


def ordinals(layout) -> tuple:
    return tuple(g for g, count in enumerate(layout) for _ in range(count))


@contextlib.contextmanager
def gpus_for(layout):
    """The machine for ``layout`` (the test skips without enough GPUs or without NCCL); yields each
    replica's GPU."""
    with gpu_env.physical_gpus(max(len(layout), 2)):
        if not _gpu.nccl_available():
            pytest.skip(f"NCCL is not installed ({_gpu.NCCL_FIX})")
        yield ordinals(layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_all_reduce_matches_numpy_and_is_the_same_bits_on_every_replica(layout, dtype):
    with gpus_for(layout) as devices:
        assert cc._engine(devices, "auto")[0].backend == "nccl-hierarchical"
        rng = np.random.default_rng(len(devices) * 100 + DTYPES.index(dtype))
        for op in OPS:
            for count in SIZES:
                xs = make_inputs(rng, len(devices), (count,), dtype, op)
                results, after = gpu_all_reduce(xs, devices, op)
                for x, a in zip(xs, after):  # out of place leaves the inputs alone
                    np.testing.assert_array_equal(a, x)
                assert_reduced(results, xs, op)
                for r in results[1:]:
                    np.testing.assert_array_equal(r, results[0])
                if op == "mean" and np.dtype(dtype).kind in "iu":
                    continue  # the float64 mean of integers cannot be written in place
                in_place, _ = gpu_all_reduce(xs, devices, op, inplace=True)
                for r in in_place:  # in place: the same kernels, the same bits
                    np.testing.assert_array_equal(r, results[0])


@pytest.mark.skipif(not SIMULATED, reason="the stand-in NCCL's order across GPUs (rank order); NCCL picks its own")
@pytest.mark.parametrize("dtype", [np.float16, np.float32, BFLOAT16], ids=str)
def test_each_gpu_sums_its_replicas_in_replica_order_then_the_gpus_are_summed(dtype):
    """2 x 3: the result is (x0 + x1 + x2) + (x3 + x4 + x5), each GPU's part rounded to the dtype (the
    kernels add in float32 and store the dtype) and the GPUs' parts added in GPU order."""
    layout = (3, 3)
    with gpus_for(layout) as devices:
        rng = np.random.default_rng(5)
        xs = [(rng.standard_normal(999) * 100).astype(dtype) for _ in devices]
        got, _ = gpu_all_reduce(xs, devices, "sum")
        parts = [np.sum([x.astype(np.float32) for x in xs[g * 3:(g + 1) * 3]], axis=0, dtype=np.float32)
                 for g in range(2)]
        want = (parts[0].astype(dtype).astype(np.float32) + parts[1].astype(dtype).astype(np.float32)).astype(dtype)
        for g in got:
            np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("layout", [(2, 2), (3, 1)], ids=["2x2", "3+1"])
def test_broadcast_reaches_every_replica_from_every_root(layout):
    with gpus_for(layout) as devices:
        for root in range(len(devices)):
            xs = [np.full(37, r + 1, np.int32) for r in range(len(devices))]
            arrays = upload(xs, devices)
            got = download(collectives.broadcast(arrays, root), np.int32)
            for g in got:
                np.testing.assert_array_equal(g, xs[root])
            for a, x in zip(download(arrays, np.int32), xs):
                np.testing.assert_array_equal(a, x)
            in_place = download(collectives.broadcast(arrays, root, out=arrays), np.int32)
            for g in in_place:
                np.testing.assert_array_equal(g, xs[root])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32)], ids=str)
@pytest.mark.parametrize("layout", [(2, 2), (1, 3), (2, 2, 2, 2)], ids=["2x2", "1+3", "4x2"])
def test_reduce_writes_the_roots_output_only(layout, dtype):
    """Each GPU folds its replicas, NCCL reduces to the root's GPU: only out[root] changes."""
    with gpus_for(layout) as devices:
        rng = np.random.default_rng(3)
        n = len(devices)
        for op in OPS:
            xs = make_inputs(rng, n, (129,), dtype, op)
            for root in range(n):
                got = collectives.reduce(upload(xs, devices), op, root=root)
                assert got.device.id == devices[root]
                assert_reduced(cupy.asnumpy(got), xs, op)
                if op == "mean" and dtype.kind in "iu":
                    continue
                outs = upload([np.full_like(x, 7) for x in xs], devices)
                collectives.reduce(upload(xs, devices), op, root=root, out=outs)
                for r, o in enumerate(download(outs, dtype)):
                    if r == root:
                        assert_reduced(o, xs, op)
                    else:
                        np.testing.assert_array_equal(o, np.full_like(xs[0], 7))


@pytest.mark.parametrize("layout", [(2, 2), (3, 3), (2, 1), (2, 2, 2, 2)], ids=["2x2", "2x3", "2+1", "4x2"])
def test_all_gather_matches_numpy_along_every_axis(layout):
    """Axis 0 with equal parts on GPUs hosting as many replicas each: by GPU (a gather kernel, NCCL's
    all-gather, a copy kernel); other axes, sizes and layouts: the native engine. Every replica gets it all."""
    with gpus_for(layout) as devices:
        n = len(devices)
        for rows in ([2] * n, [r + 1 for r in range(n)]):
            parts = [np.arange(rows[r] * 6, dtype=np.float32).reshape(rows[r], 2, 3) + 100 * r for r in range(n)]
            for axis in (0, 1, 2):
                if axis and len(set(rows)) > 1:
                    continue  # (sizes may differ along the axis only)
                for g, d in zip(collectives.all_gather(upload(parts, devices), axis), devices):
                    assert g.device.id == d
                    np.testing.assert_array_equal(cupy.asnumpy(g), np.concatenate(parts, axis))


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches and calls")
def test_an_all_gather_by_gpu_is_two_launches_and_one_nccl_call_per_gpu():
    with gpus_for((2, 2)) as devices:
        xs = upload([np.full(100, r, np.float32) for r in range(4)], devices)
        got = _counted(lambda: collectives.all_gather(xs, 0))
        assert got["launches"] == {0: 2, 1: 2}
        assert got["calls"].get("ncclAllGather") == 2
        assert got["calls"].get("cudaEventRecord", 0) == got["calls"].get("cudaStreamWaitEvent", 0) == 0


@pytest.mark.parametrize("packing", [dict(), dict(bytes_per_pack=256), dict(num_packs=2)], ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", [(2, 2), (2, 1), (2, 2, 2, 2)], ids=["2x2", "2+1", "4x2"])
def test_batch_all_reduce_matches_numpy(layout, op, packing):
    with gpus_for(layout) as devices:
        rng = np.random.default_rng(17)
        shapes = [(3,), (40, 2), (), (0,), (513,), (5, 5), (1000,)]
        types = [np.float32, np.int32, np.float64, np.float32, np.float16, np.int32, np.float32]
        host = [[np.asarray(rng.integers(-9, 9, s)).astype(t) for s, t in zip(shapes, types)] for _ in devices]
        lists = [upload(h, [d] * len(h)) for h, d in zip(host, devices)]
        got = collectives.batch_all_reduce(lists, op, **packing)
        gpu_env.check_batch(got, host, op, devices)
        for t in range(len(shapes)):  # the same bits on every replica
            for r in range(1, len(devices)):
                np.testing.assert_array_equal(cupy.asnumpy(got[r][t]), cupy.asnumpy(got[0][t]))


def _counted(call):
    call()  # (the first call plans and makes what it keeps)
    gc.collect()
    return gpu_env.sim_counters(call)


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches and calls")
@pytest.mark.parametrize("layout", [(2, 2), (3, 3), (2, 2, 2, 2)], ids=["2x2", "2x3", "4x2"])
def test_a_repeated_all_reduce_is_one_fold_one_nccl_call_and_one_copy_per_gpu_and_no_event(layout):
    """Per GPU: the fold, NCCL, the copy to the other replicas. The native ring over the same replicas
    (algorithm='ring') takes many launches and orders the GPUs with events."""
    with gpus_for(layout) as devices:
        xs = upload([np.full(1000, r, np.float32) for r in range(len(devices))], devices)
        outs = upload([np.zeros(1000, np.float32)] * len(devices), devices)
        new = _counted(lambda: collectives.all_reduce(xs, "sum", out=outs))
        assert new["launches"] == {g: 2 for g in range(len(layout))}
        assert new["calls"].get("ncclAllReduce") == len(layout)
        assert new["calls"].get("cudaEventRecord", 0) == new["calls"].get("cudaStreamWaitEvent", 0) == 0
        old = _counted(lambda: collectives.all_reduce(xs, "sum", out=outs, algorithm="ring"))
        assert sum(old["launches"].values()) > sum(new["launches"].values())
        assert old["calls"].get("cudaStreamWaitEvent", 0) > 0 and "ncclAllReduce" not in old["calls"]
        for o in download(outs, np.float32):
            np.testing.assert_array_equal(o, np.full(1000, sum(range(len(devices))), np.float32))


def test_a_repeated_call_on_a_mix_costs_no_more_python_steps_than_one_gpu_per_replica():
    """The plan cache serves the hierarchical engine as any other: a repeated all_reduce on 2 GPUs x 2
    replicas makes no more Python calls than one on 4 GPUs with NCCL (one binding call, the streams looked
    up once per GPU: two lookups fewer here)."""
    with gpus_for((1, 1, 1, 1)):
        counts = {}
        for devices in ((0, 0, 1, 1), (0, 1, 2, 3)):
            xs = upload([np.ones(16, np.float32)] * 4, devices)
            outs = upload([np.zeros(16, np.float32)] * 4, devices)
            counts[devices] = gpu_env.python_calls(
                lambda: collectives.all_reduce(xs, "sum", out=outs, algorithm="nccl"), repeat=20)["mirrored"]
        assert counts[(0, 0, 1, 1)] <= counts[(0, 1, 2, 3)]


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches")
def test_a_batch_costs_the_same_launches_whatever_its_tensor_count():
    with gpus_for((2, 2)) as devices:
        def counted(tensors):
            lists = [upload([np.full(7 + t, r, np.float32) for t in range(tensors)], [d] * tensors)
                     for r, d in enumerate(devices)]
            got = _counted(lambda: collectives.batch_all_reduce(lists, "sum"))
            return got["launches"], got["calls"].get("ncclAllReduce")
        few, many = counted(4), counted(100)
        assert few == many
        # One fused pack: per GPU the pack, the fold and the unpack (every replica's results read from the
        # GPU's one reduced pack), and one NCCL call.
        assert few == ({0: 3, 1: 3}, 2)


def test_algorithm_names_pick_the_engine(monkeypatch):
    with gpus_for((2, 2)) as devices:
        assert cc._engine(devices, "auto")[0].backend == "nccl-hierarchical"
        assert cc._engine(devices, "nccl")[0].backend == "nccl-hierarchical"
        for name in ("ring", "tree", "direct"):
            assert cc._engine(devices, name)[0].backend == "cuda-ring"
        assert cc._engine((0, 1), "nccl")[0].backend == "nccl"
        assert cc._engine((0, 0), "auto")[0].backend == "cuda-ring"
        with pytest.raises(ValueError, match="algorithm='nccl': every replica shares GPU 0.*use algorithm='ring'"):
            cc._engine((0, 0), "nccl")
        crowded = (0,) * 33 + (1,)  # more replicas on GPU 0 than one fold kernel takes: the native engine
        assert cc._engine(crowded, "auto")[0].backend == "cuda-ring"
        with pytest.raises(ValueError, match="NCCL cannot place two ranks on one GPU.*use algorithm='ring'"):
            cc._engine(crowded, "nccl")
        monkeypatch.setattr(_gpu, "nccl_available", lambda: False)
        assert cc._engine(devices, "auto")[0].backend == "cuda-ring"  # no NCCL: the native engine


# --- strategies and md.function ------------------------------------------------------

_rng = np.random.default_rng(7)
_W0 = _rng.standard_normal((6, 3)).astype(np.float32)
_B0 = _rng.standard_normal(3).astype(np.float32)
_X = _rng.standard_normal((6, 8, 6)).astype(np.float32)  # (step, global batch, features)
_Y = _rng.standard_normal((6, 8, 3)).astype(np.float32)


@contextlib.contextmanager
def mix_strategy(layout, **kwargs):
    """A MirroredStrategy over every logical GPU of ``layout`` (replicas per physical GPU)."""
    with gpus_for(layout):
        try:
            for gpu, count in enumerate(layout):
                if count > 1:
                    config.set_logical_device_configuration("GPU", gpu, count=count)
            yield md.MirroredStrategy([f"/gpu:{i}" for i in range(sum(layout))], **kwargs)
        finally:
            for gpu in range(len(layout)):
                config.set_logical_device_configuration(f"GPU:{gpu}", None)


def strategy_gpus(strategy) -> list:
    return [md.device_util.physical_ordinal(d) for d in strategy.extended.worker_devices]


def _train(strategy, captured: bool, steps: int = 5, replays: bool = True):
    """A linear least-squares model trained with Adam (md.function'd when ``captured``): (losses, w, b)."""
    with strategy.scope():
        w, b = md.Variable(_W0), md.Variable(_B0)
        opt = md.optimizers.Adam(0.01)

    def step(x, y):
        err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
        scale = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
        opt.apply_gradients([(md.linalg.matmul(x, err, transpose_a=True) * scale, w), (err.sum(axis=0) * scale, b)])
        return cupy.sum(err * err)

    run = md.function(step) if captured else step
    losses = []
    for s in range(steps):
        if SIMULATED:
            cupy.sim.reset_counters()
        loss = strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y))
        replayed = cupy.sim.counters()["graph_launches"] if SIMULATED else None
        losses.append(float(strategy.reduce(md.ReduceOp.SUM, loss, axis=None)))
    if captured:
        assert run.experimental_get_tracing_count() == 1
        if SIMULATED and replays:  # the last step was one graph launch per GPU
            assert replayed == {g: 1 for g in range(len(set(strategy_gpus(strategy))))}
    return losses, w.values[0].numpy(), b.values[0].numpy(), [v.numpy() for v in (*w.values, *b.values)]


@pytest.mark.parametrize("layout", [(2, 2), (2, 1)], ids=["2x2", "2+1"])
def test_a_training_step_on_a_mix_is_captured_and_gives_the_eager_bits(layout):
    """The default cross-device ops on a mix take the hierarchical engine; md.function captures the step
    (no EagerFallbackWarning: pytest turns warnings into errors) and replays the eager steps' bits; every
    replica's copy of the variables holds the same bits."""
    results = []
    for captured in (False, True):
        with mix_strategy(layout) as strategy:
            assert isinstance(strategy.extended._cross_device_ops, md.NcclAllReduce)
            results.append(_train(strategy, captured))
    (eager_losses, w, b, copies), (captured_losses, cw, cb, ccopies) = results
    assert captured_losses == eager_losses
    np.testing.assert_array_equal(cw, w)
    np.testing.assert_array_equal(cb, b)
    for c in copies + ccopies:
        assert any(np.array_equal(c, ref) for ref in (w, b))


def test_the_outer_step_with_its_reduce_to_one_device_is_captured_on_a_mix():
    """TF's canonical outer step (strategy.run, then strategy.reduce to one device inside md.function): the
    reduce is hierarchical too (each GPU folds, NCCL reduces to the root's GPU), so the whole step is captured
    and a replay is one graph launch per GPU, with the eager steps' bits."""
    results = []
    for captured in (False, True):
        with mix_strategy((2, 2)) as strategy:
            with strategy.scope():
                w = md.Variable(_W0)
                opt = md.optimizers.SGD(0.1)

            def replica_step(x, y):
                err = md.linalg.matmul(x, w.read_value()) - y
                scale = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
                opt.apply_gradients([(md.linalg.matmul(x, err, transpose_a=True) * scale, w)])
                return err * err

            def outer(x, y):
                return strategy.reduce(md.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)

            step = md.function(outer) if captured else outer
            losses = []
            for s in range(5):
                if SIMULATED:
                    cupy.sim.reset_counters()
                loss = step(*gpu_env.replica_batches(strategy, s, _X, _Y))
                replayed = cupy.sim.counters()["graph_launches"] if SIMULATED else None
                losses.append(cupy.asnumpy(loss))
            if captured:
                assert step.experimental_get_tracing_count() == 1
                if SIMULATED:
                    assert replayed == {0: 1, 1: 1}
            results.append((losses, w.values[0].numpy()))
    (eager_losses, eager_w), (captured_losses, captured_w) = results
    for e, c in zip(eager_losses, captured_losses):
        np.testing.assert_array_equal(c, e)
    np.testing.assert_array_equal(captured_w, eager_w)


def test_a_mix_trains_as_the_native_ring_and_one_gpu_per_replica_do_within_rounding():
    """2 GPUs x 2 replicas (hierarchical) against the same model on 4 GPUs with NCCL and on the 2 x 2 mix
    with the native ring: the same training within float32 rounding (another order of summation)."""
    with mix_strategy((2, 2)) as strategy:
        losses, w, b, _ = _train(strategy, False)
    with mix_strategy((2, 2), cross_device_ops=md.RingAllReduce(algorithm="ring")) as strategy:
        ring_losses, ring_w, ring_b, _ = _train(strategy, False)
    with mix_strategy((1, 1, 1, 1)) as strategy:
        nccl_losses, nccl_w, nccl_b, _ = _train(strategy, False)
    for other_losses, ow, ob in ((ring_losses, ring_w, ring_b), (nccl_losses, nccl_w, nccl_b)):
        np.testing.assert_allclose(other_losses, losses, rtol=1e-5)
        np.testing.assert_allclose(ow, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ob, b, rtol=1e-5, atol=1e-6)


def test_the_native_ring_on_a_mix_still_runs_eagerly_with_a_warning():
    """algorithm='ring' keeps the native engine, whose events between GPUs per-GPU graphs cannot hold."""
    with mix_strategy((2, 2), cross_device_ops=md.RingAllReduce(algorithm="ring")) as strategy:
        with pytest.warns(EagerFallbackWarning, match="recorded outside the capture"):
            _train(strategy, True, steps=3, replays=False)
