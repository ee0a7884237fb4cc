"""MirroredStrategy's steps under ``gradient_accumulation_steps``, packed (docs/training.md, "Gradient
accumulation"): an accumulate-only step is one fused accumulate per dtype and device, an update step's
``(g + accumulator) / steps`` is taken over the packed gradients, reduced as one buffer per dtype and applied by
the fused update, and the accumulators are zeroed by one copy. The same bits as the per-variable path (which
clipping still takes), NumPy's sums in the accumulators, identical copies across replicas, and on the simulated
GPUs the same launches, kernels, stream operations, copies and host waits for 20 as for 200 variables."""

import gc
import itertools

import numpy as np
import pytest

import mirrored as md
from gpu_env import NGPU, SIMULATED, SKIP_REASON, cupy, mirrored_strategy, sim_counters
from test_central_storage_packed_steps import _TrainEvents

STEPS, N = 7, 3  # seven steps, every third one an update
# float32 and float64 variables (one packed buffer each), an empty one and a scalar among them
SHAPES = [((3, 2), np.float32), ((5,), np.float64), ((0,), np.float32), ((), np.float32), ((4, 4), np.float32)]
# A clip no gradient reaches: the values of the unclipped step, through the per-variable path that clipping takes.
PER_VARIABLE = {"clipvalue": 1e30}


def _grads(step: int, replica: int) -> list:
    rng = np.random.default_rng(100 * step + replica)
    return [np.asarray(rng.normal(size=shape) * 4, dtype) for shape, dtype in SHAPES]


def _accumulated_steps(strategy, optimizer: str, xp=np, aggregate: bool = True, **kwargs) -> list:
    """Per step, every replica's copies of the weights and accumulators (host arrays) after it."""
    with strategy.scope():
        variables = [md.Variable(np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(d)) for s, d in SHAPES]
        make = md.optimizers.SGD if optimizer == "sgd" else md.optimizers.Adam
        opt = make(0.1, gradient_accumulation_steps=N, **kwargs)

    def step(k):
        rid = md.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients(zip([xp.asarray(g) for g in _grads(k, rid)], variables),
                            experimental_aggregate_gradients=aggregate)

    states = []
    for k in range(STEPS):
        strategy.run(step, args=(k,))
        states.append([[np.asarray(md.device_util.to_host(c)) for x in (v, opt.get_slot(v, "gradient_accumulator"))
                        for c in x.values] for v in variables])
    return states


def _numpy_sgd(replicas: int) -> list:
    """Keras' rule in NumPy: each replica adds its gradients to its accumulators; every N-th step each replica's
    ``(g + accumulator) / N`` is summed across replicas (in replica order) and applied, and the accumulators
    zeroed."""
    weights = [np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(d) for s, d in SHAPES]
    accumulators = [[np.zeros(s, d) for s, d in SHAPES] for _ in range(replicas)]
    states = []
    for k in range(STEPS):
        grads = [_grads(k, r) for r in range(replicas)]
        if (k + 1) % N:
            for r in range(replicas):
                for acc, g in zip(accumulators[r], grads[r]):
                    acc += g
        else:
            for j, w in enumerate(weights):
                averages = [(grads[r][j] + accumulators[r][j]) / w.dtype.type(N) for r in range(replicas)]
                total = averages[0]
                for a in averages[1:]:
                    total = total + a
                w -= total * w.dtype.type(np.float32(0.1))  # (Keras keeps the rate in float32)
            for acc in (a for replica in accumulators for a in replica):
                acc[...] = 0
        states.append([[w.copy()] * replicas + [accumulators[r][j].copy() for r in range(replicas)]
                       for j, w in enumerate(weights)])
    return states


def _assert_same(got, want):
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            for x, y in zip(a, b):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_cpu_replicas_accumulate_numpys_sums_and_apply_keras_average(replicas):
    devices = [f"/cpu:{i}" for i in range(replicas)]
    _assert_same(_accumulated_steps(md.MirroredStrategy(devices), "sgd"), _numpy_sgd(replicas))


@pytest.mark.parametrize("aggregate", [True, False], ids=["aggregated", "own"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_cpu_replicas_packed_steps_are_the_per_variable_steps_bit_for_bit(replicas, optimizer, aggregate):
    devices = [f"/cpu:{i}" for i in range(replicas)]
    packed = _accumulated_steps(md.MirroredStrategy(devices), optimizer, aggregate=aggregate)
    _assert_same(packed, _accumulated_steps(md.MirroredStrategy(devices), optimizer, aggregate=aggregate,
                                            **PER_VARIABLE))
    if aggregate:  # (each replica's copy of a variable the same bits)
        for state in packed:
            for copies in state:
                for c in copies[1:replicas]:
                    np.testing.assert_array_equal(c, copies[0])


GPU_LAYOUTS = ["logical-1", "logical-2", "logical-4", "physical-2"]


def _gpu_strategy(layout: str):
    kind, n = layout.split("-")
    if kind == "physical" and NGPU < int(n):
        pytest.skip(f"needs {n} GPUs")
    return mirrored_strategy(int(n), one_gpu=kind == "logical")


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_replicas_packed_steps_are_the_per_variable_steps_bit_for_bit(layout, optimizer):
    with _gpu_strategy(layout) as strategy:
        packed = _accumulated_steps(strategy, optimizer, cupy)
    with _gpu_strategy(layout) as strategy:
        per_variable = _accumulated_steps(strategy, optimizer, cupy, **PER_VARIABLE)
    _assert_same(packed, per_variable)
    if optimizer == "sgd":
        _assert_same(packed, _numpy_sgd(int(layout.split("-")[1])))


def _named(variables) -> dict:
    return {f"v{k}": v for k, v in enumerate(variables)}


def test_accumulators_checkpoint_mid_accumulation_and_resume_packed(tmp_path):
    """A checkpoint taken between accumulate-only steps holds the accumulated sums; restored into a fresh model
    (whose packed steps then run over the restored accumulators), the next steps give the same weights. (The
    replicas' gradients are the same: a checkpoint holds the first replica's accumulators, restored to all.)"""
    devices = ["/cpu:0", "/cpu:1"]

    def model():
        strategy = md.MirroredStrategy(devices)
        with strategy.scope():
            variables = [md.Variable(np.full(s, 0.5, d)) for s, d in SHAPES]
            opt = md.optimizers.Adam(0.1, gradient_accumulation_steps=N)
        return strategy, variables, opt

    def run(strategy, variables, opt, steps):
        for k in steps:
            strategy.run(lambda: opt.apply_gradients(zip(_grads(k, 0), variables)))

    strategy, variables, opt = model()
    run(strategy, variables, opt, range(N + 1))  # an update, then one accumulate-only step
    path = md.train.Checkpoint(optimizer=opt, **_named(variables)).save(str(tmp_path / "ckpt"))
    saved = [opt.get_slot(v, "gradient_accumulator").numpy() for v in variables]
    np.testing.assert_array_equal(saved[0], _grads(N, 0)[0])  # (a checkpoint holds the first replica's copy)
    run(strategy, variables, opt, range(N + 1, 2 * N + 1))

    restored = model()
    md.train.Checkpoint(optimizer=restored[2], **_named(restored[1])).restore(path)
    run(*restored, range(N + 1, 2 * N + 1))
    for a, b in zip(variables, restored[1]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _counted_steps(layout: str, n: int) -> dict:
    """Per kind of steady step (``plain`` Adam; Adam under accumulation: ``accumulate`` only, ``update``), the
    simulated runtime's counters and the Python call events of its apply_gradients, for ``n`` variables."""
    counted = {}
    for kind in ("plain", "accumulate", "update"):
        with _gpu_strategy(layout) as strategy:
            shapes = [(16, 8) if k % 2 else (8,) for k in range(n)]
            with strategy.scope():
                variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
                opt = md.optimizers.Adam(0.01, gradient_accumulation_steps=None if kind == "plain" else 2)
            grads = strategy.run(lambda: [
                cupy.full(shape, 0.25 * (md.get_replica_context().replica_id_in_sync_group + 1), np.float32)
                for shape in shapes])
            events = _TrainEvents()

            def step(replica_grads):
                with events.counting():
                    opt.apply_gradients(zip(replica_grads, variables))

            def run():
                strategy.run(step, args=(grads,))

            for _ in range(4):  # (steps 1 and 3 update; step 4 accumulates only, step 5 updates)
                run()
            if kind == "update":
                run()
            gc.collect()
            c = sim_counters(run)
            counts = {key: c[key] for key in ("launches", "kernels", "stream_ops", "host_waits")}
            counts["copies"] = c["calls"].get("cudaMemcpyAsync", 0)
            # (Python events: the median of 5 calls of two steps, under accumulation one of each kind)
            counted[kind] = counts, events.of(lambda: (run(), run()))
    return counted


@pytest.mark.gpu
@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches and copies")
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_accumulate_only_and_update_steps_cost_the_same_for_20_and_200_variables(layout):
    """Launches per GPU, kernels, stream operations, copies and host waits of an accumulate-only step and of an
    update step: the same for 20 as for 200 variables. Their Python call events (and the plain step's) do not grow
    with the variables: one event per variable and replica would add 180 per replica; the replica threads' waits
    vary the count by a few dozen, the margin allowed."""
    counted = {n: _counted_steps(layout, n) for n in (20, 200)}
    for kind in ("plain", "accumulate", "update"):
        if kind != "plain":
            assert counted[20][kind][0] == counted[200][kind][0], (kind, counted)
        assert counted[200][kind][1] <= 1.25 * counted[20][kind][1], (kind, counted)
    kind, n = layout.split("-")
    replicas_per_gpu = int(n) if kind == "logical" else 1
    plain = counted[200]["plain"][0]
    for gpu, launches in plain["launches"].items():
        # Per replica, beyond the plain step: the update step's accumulate, copy back and zeroing of the
        # accumulators (native launches) and the division (a kernel); the accumulate-only step (one pack and
        # one accumulate) no more than the plain step (a pack and the update).
        assert counted[200]["update"][0]["launches"][gpu] <= launches + 3 * replicas_per_gpu, counted
        assert counted[200]["update"][0]["kernels"][gpu] <= plain["kernels"][gpu] + replicas_per_gpu, counted
        assert counted[200]["accumulate"][0]["launches"][gpu] <= launches, counted


def _cpu_step_events(replicas: int, n: int, accumulate: bool) -> int:
    """Python call events of apply_gradients (every replica's thread) over two steady steps of ``n`` variables on
    ``replicas`` CPU replicas: plain Adam, or under accumulation one accumulate-only and one update step."""
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    shapes = [(16, 8) if k % 2 else (8,) for k in range(n)]
    with strategy.scope():
        variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
        opt = md.optimizers.Adam(0.01, gradient_accumulation_steps=2 if accumulate else None)
    grads = [np.full(shape, 0.25, np.float32) for shape in shapes]
    events = _TrainEvents()

    def step():
        with events.counting():
            opt.apply_gradients(zip(grads, variables))

    for _ in range(4):
        strategy.run(step)
    events.events = itertools.count()
    strategy.run(step)
    strategy.run(step)
    return next(events.events)


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_cpu_steps_python_events_do_not_grow_with_the_variables(replicas, accumulate):
    """The variables' and gradients' checks, the pack and the fused update of host replicas run C loops over the
    lists: no Python call event per variable. One event per variable on one replica alone would add 360 over the
    two steps; the replica threads' waits on a loaded machine vary the count by a few dozen (seen: 270 against
    308 beside two busy processes), so the counts may differ by less than one event per added variable."""
    few, many = _cpu_step_events(replicas, 20, accumulate), _cpu_step_events(replicas, 200, accumulate)
    assert abs(many - few) < 180, (few, many)


def test_steady_steps_still_check_each_gradient():
    """After steps whose checks ran as C loops over the lists, a gradient of another shape, a None (skipped, as
    TF skips it) or a list gradient of the right shape take the per-gradient checks: named, skipped, converted."""
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        a, b = md.Variable(np.zeros(3, np.float32), name="a"), md.Variable(np.zeros((2, 2), np.float32), name="b")
        opt = md.optimizers.SGD(1.0)
    for _ in range(3):
        strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), a), (np.ones((2, 2), np.float32), b)]))
    with pytest.raises(ValueError, match=r"grads_and_vars\[1\]: the gradient of variable 'b:0' has shape \(4,\)"):
        strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), a), (np.ones(4, np.float32), b)]))
    strategy.run(lambda: opt.apply_gradients([(None, a), (np.ones((2, 2), np.float32), b)]))
    strategy.run(lambda: opt.apply_gradients([([1.0, 1.0, 1.0], a), (np.ones((2, 2), np.float64), b)]))
    # (two replicas' ones summed, three steady steps, then a step for b alone, then one for both)
    np.testing.assert_array_equal(a.numpy(), np.full(3, -8.0, np.float32))
    np.testing.assert_array_equal(b.numpy(), np.full((2, 2), -10.0, np.float32))
