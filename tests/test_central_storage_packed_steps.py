"""CentralStorageStrategy's loss-scaled steps (md.mixed_precision.LossScaleOptimizer, dynamic and fixed) and
accumulate-only steps (``gradient_accumulation_steps``), packed as its plain step is (docs/central_storage.md,
"Training"): MirroredStrategy's weights and loss scale bit for bit, Keras' skip and growth rules, the NumPy sum
in the accumulators, one all-reduce per step, and on the simulated GPUs the same launches, stream operations,
copies and host waits for 20 as for 200 variables."""

import contextlib
import gc
import itertools
import os
import sys
import warnings

import numpy as np
import pytest

import mirrored as md
from gpu_env import SIMULATED, SKIP_REASON, cupy, gpu_pair, machine, sim_counters

CentralStorageStrategy = md.distribute.experimental.CentralStorageStrategy
GPUS = ["/gpu:0", "/gpu:1"]

# (variable dtype, gradient dtype, shape): mixed precision's float16 gradients of float32 variables beside
# float32 and float64 ones (one packed buffer per variable dtype, reduced in the gradients' dtype)
MODEL = [(np.float32, np.float16, (3, 2)), (np.float32, np.float16, (5,)), (np.float64, np.float64, (2, 2)),
         (np.float32, np.float16, (1,))]
FLOAT32_GRADS = [(v, np.float32 if g == np.float16 else g, s) for v, g, s in MODEL]
STEPS = 7
# Per step, what goes wrong in the gradients of the scaled loss (dynamic scaling skips those steps):
# an inf on the second replica only, or float16 values finite on each replica whose sum overflows.
BAD = {2: "inf", 5: "overflow"}


def _grads(step: int, replica: int, model) -> list:
    rng = np.random.default_rng(100 * step + replica)
    grads = [(rng.normal(size=shape) * 8).astype(g) for _, g, shape in model]
    if BAD.get(step) == "inf" and replica == 1:
        grads[1][2] = np.inf
    if BAD.get(step) == "overflow" and model[0][1] == np.float16:
        grads[0][1, 1] = 40000.0  # (40000 + 40000 > 65504, float16's largest)
    return grads


# (SGD's update follows the gradients' scale, where Adam's nearly cancels it)
OPTIMIZERS = {"sgd": lambda: md.optimizers.SGD(0.05, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.05)}


def _loss_scaled_steps(strategy, dynamic: bool, model, optimizer, xp=np) -> list:
    """Per step, the weights, the loss scale, the count of good steps and ``iterations`` after it."""
    with strategy.scope():
        variables = [md.Variable(np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(v)) for v, _, s in model]
        opt = md.mixed_precision.LossScaleOptimizer(OPTIMIZERS[optimizer](), dynamic=dynamic, initial_scale=64.0,
                                                    dynamic_growth_steps=2)

    def step(k):
        rid = md.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients(zip([xp.asarray(g) for g in _grads(k, rid, model)], variables))

    states = []
    for k in range(STEPS):
        strategy.run(step, args=(k,))
        states.append(([np.asarray(md.device_util.to_host(v.read_value())) for v in variables],
                       float(opt.loss_scale), opt.dynamic_counter, int(opt.iterations.numpy())))
    return states


def _assert_same_states(central, mirrored):
    for (cw, cs, cc, ci), (mw, ms, mc, mi) in zip(central, mirrored):
        assert (cs, cc, ci) == (ms, mc, mi)
        for c, m in zip(cw, mw):
            assert c.dtype == m.dtype
            np.testing.assert_array_equal(c, m)


def _assert_keras_scale_rules(states, dynamic: bool, float16: bool):
    """Keras' rules: a step with an inf or nan gradient is skipped (no weight moves, ``iterations`` stays), the
    scale halves and the count restarts; after ``dynamic_growth_steps`` (2) good steps in a row it doubles."""
    scale, counter, iterations, weights = 64.0, 0, 0, None
    for k, (w, s, c, i) in enumerate(states):
        bad = dynamic and (k in BAD and (BAD[k] == "inf" or float16))
        if bad:
            scale, counter = scale / 2, 0
            assert all(np.array_equal(a, b) for a, b in zip(w, weights))
        else:
            iterations += 1
            if dynamic:
                counter += 1
                if counter == 2:
                    scale, counter = scale * 2, 0
            if weights is not None:
                assert not any(np.array_equal(a, b) for a, b in zip(w, weights))
        assert (s, c, i) == (scale, counter, iterations), k
        weights = w


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("grads", ["float16", "float32"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("n", [2, 4])
def test_loss_scaled_steps_on_cpu_replicas_are_mirroreds_bit_for_bit(n, dynamic, grads, optimizer):
    model = MODEL if grads == "float16" else FLOAT32_GRADS
    devices = [f"/cpu:{i}" for i in range(n)]
    central = _loss_scaled_steps(CentralStorageStrategy(devices), dynamic, model, optimizer)
    _assert_same_states(central, _loss_scaled_steps(md.MirroredStrategy(devices), dynamic, model, optimizer))
    _assert_keras_scale_rules(central, dynamic, grads == "float16")


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("grads", ["float16", "float32"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0", "/gpu:1"])
@pytest.mark.parametrize("layout", ["physical", "logical"])
def test_loss_scaled_steps_on_gpu_replicas_are_mirroreds_bit_for_bit(layout, parameter_device, dynamic, grads,
                                                                     optimizer):
    """Variables in host memory (the step decided on the host) or on either GPU (decided there, as
    MirroredStrategy's): the same weights, scale, count and ``iterations`` after every step."""
    model = MODEL if grads == "float16" else FLOAT32_GRADS
    with gpu_pair(layout):
        central = _loss_scaled_steps(CentralStorageStrategy(GPUS, parameter_device), dynamic, model, optimizer, cupy)
        mirrored = _loss_scaled_steps(md.MirroredStrategy(GPUS), dynamic, model, optimizer, cupy)
    _assert_same_states(central, mirrored)
    _assert_keras_scale_rules(central, dynamic, grads == "float16")


def _numpy_fixed_scale_sgd(model) -> list:
    """Per step, the weights of ``_loss_scaled_steps`` with a fixed scale of 64 and SGD (momentum 0.9) in NumPy:
    the two replicas' gradients summed in their dtype (float16 sums overflow to inf, as the all-reduce's do),
    divided by the float32 scale, then Keras' ``m = 0.9 * m - lr * g; w += m`` in the variables' dtype."""
    weights = [np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(v) for v, _, s in model]
    moments = [np.zeros_like(w) for w in weights]
    states = []
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(STEPS):
            for w, m, a, b in zip(weights, moments, _grads(k, 0, model), _grads(k, 1, model)):
                g = ((a + b) / np.float32(64)).astype(w.dtype)
                t = w.dtype.type
                m *= t(np.float32(0.9))
                m -= t(np.float32(0.05)) * g
                w += m
            states.append([w.copy() for w in weights])
    return states


@pytest.mark.gpu
@pytest.mark.skipif(not SIMULATED, reason="replays drain orders of the simulated runtime")
@pytest.mark.parametrize("seed", [23, 25, 39, 1])
def test_loss_scaled_steps_on_logical_gpus_sum_what_each_replica_packed(seed):
    """Two replicas on one GPU pack their float16 gradients into staging buffers, which the first replica to
    pack made for both. Made by an upload of uninitialised host memory on that replica's stream, a buffer got
    a write unordered with the other replica's pack on its own stream: the drain orders of seeds 23, 25 and 39 ran
    it after the pack, and the all-reduce summed garbage in place of one replica's gradients (weights 0.4
    off NumPy's). Made by an allocation alone, every order sums what the replicas packed."""
    with machine(seed), gpu_pair("logical"):  # (this seed's drain order, not the one of the test's id)
        central = _loss_scaled_steps(CentralStorageStrategy(GPUS, "/cpu:0"), False, MODEL, "sgd", cupy)
    for k, ((weights, *_), want) in enumerate(zip(central, _numpy_fixed_scale_sgd(MODEL))):
        for w, x in zip(weights, want):
            np.testing.assert_allclose(w, x, rtol=1e-6, atol=1e-6, err_msg=f"step {k}")


def _accumulated_steps(strategy, xp=np, steps: int = 7, n: int = 3):
    """SGD with ``gradient_accumulation_steps=n`` over ``steps`` steps of two replicas' float32 gradients: per
    step, the weights and accumulators after it."""
    shapes = [(3, 2), (5,)]
    with strategy.scope():
        variables = [md.Variable(np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)) for s in shapes]
        opt = md.optimizers.SGD(0.1, gradient_accumulation_steps=n)

    def step(k):
        rid = md.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients(zip([xp.asarray(g) for g in _grads(k, rid, [(None, np.float32, s) for s in shapes])],
                                variables))

    states = []
    for k in range(steps):
        strategy.run(step, args=(k,))
        states.append([[np.asarray(md.device_util.to_host(x.read_value())) for x in (v, opt.get_slot(
            v, "gradient_accumulator"))] for v in variables])
    return states, shapes


def _numpy_accumulation(shapes, steps: int = 7, n: int = 3) -> list:
    """Keras' rule in float32 NumPy over the two replicas' summed gradients: ``accumulator += g`` on the steps
    that only accumulate; on every n-th ``w -= (g + accumulator) / n * lr`` and the accumulators zeroed."""
    weights = [np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for s in shapes]
    accumulators = [np.zeros(s, np.float32) for s in shapes]
    model = [(None, np.float32, s) for s in shapes]
    states = []
    for k in range(steps):
        summed = [a + b for a, b in zip(_grads(k, 0, model), _grads(k, 1, model))]
        for w, acc, g in zip(weights, accumulators, summed):
            if (k + 1) % n:
                acc += g
            else:
                total = g + acc
                total /= np.float32(n)
                w -= total * np.float32(0.1)
                acc[...] = 0
        states.append([[w.copy(), acc.copy()] for w, acc in zip(weights, accumulators)])
    return states


def _assert_accumulation(states, shapes):
    for got, want in zip(states, _numpy_accumulation(shapes)):
        for (w, acc), (want_w, want_acc) in zip(got, want):
            np.testing.assert_array_equal(acc, want_acc)
            np.testing.assert_array_equal(w, want_w)


def test_accumulate_only_steps_on_cpu_replicas_add_the_replicas_sum_as_numpy():
    _assert_accumulation(*_accumulated_steps(CentralStorageStrategy(["/cpu:0", "/cpu:1"])))


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0", "/gpu:1"])
@pytest.mark.parametrize("layout", ["physical", "logical"])
def test_accumulate_only_steps_on_gpu_replicas_add_the_replicas_sum_as_numpy(layout, parameter_device):
    with gpu_pair(layout):
        _assert_accumulation(*_accumulated_steps(CentralStorageStrategy(GPUS, parameter_device), cupy))


@pytest.mark.parametrize("kind", ["dynamic", "fixed", "accumulate"])
def test_one_all_reduce_and_one_update_per_step(kind, monkeypatch):
    """From the second step on, one all-reduce of one packed buffer per dtype, and the update (or the
    accumulation) applied once, for 10 variables."""
    s = CentralStorageStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with s.scope():
        ws = [md.Variable(np.full(4, k, np.float32)) for k in range(10)]
        if kind == "accumulate":
            opt = md.optimizers.SGD(0.5, gradient_accumulation_steps=4)
        else:
            opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.SGD(0.5), dynamic=kind == "dynamic",
                                                        initial_scale=2.0)
    from mirrored.train.optimizers import base

    applied, reduced = [], []
    apply, batch_reduce = base._Plan.apply, type(s.extended._cross_device_ops).batch_reduce

    def counted_apply(plan, device, *args, **kwargs):
        applied.append(kwargs.get("packed") is not None)
        return apply(plan, device, *args, **kwargs)

    def counted_batch_reduce(cdo, op, pairs, options=None):
        reduced.append(len(pairs))
        return batch_reduce(cdo, op, pairs, options)

    monkeypatch.setattr(base._Plan, "apply", counted_apply)
    monkeypatch.setattr(type(s.extended._cross_device_ops), "batch_reduce", counted_batch_reduce)
    for _ in range(3):
        s.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), w) for w in ws]))
    assert applied == [False, True, True] and reduced == [10, 1, 1]
    if kind == "accumulate":  # three steps of 3 replicas' ones, none applied yet
        assert [w.numpy()[0] for w in ws] == list(range(10))
        assert [opt.get_slot(w, "gradient_accumulator").numpy().tolist() for w in ws] == [[9.0] * 4] * 10
    else:  # (3 replicas' ones divided by the scale 2, times the learning rate, three times)
        assert [w.numpy()[0] for w in ws] == [k - 3 * 0.5 * 1.5 for k in range(10)]


TRAIN = os.path.join(os.path.dirname(os.path.abspath(md.__file__)), "train") + os.sep


class _TrainEvents:
    """Python call events of the optimizer's code (functions of mirrored/train started, builtins they call),
    counted on each replica's thread while it applies its gradients (:meth:`counting`)."""

    def __init__(self):
        self.events = None  # an itertools.count while counting (its next() is atomic: replica threads share it)
        self.files = {}

    def profile(self, frame, event, arg):
        if event == "call" or event == "c_call":
            name = frame.f_code.co_filename
            ours = self.files.get(name)
            if ours is None:
                ours = self.files[name] = os.path.abspath(name).startswith(TRAIN)
            if ours:
                next(self.events)

    @contextlib.contextmanager
    def counting(self):
        """Counts this thread's events in the block, when a count is on (:meth:`of`)."""
        if self.events is None:
            yield
            return
        sys.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(None)

    def of(self, call, repeat: int = 5) -> float:
        """The median count of ``repeat`` calls (each one's queued kernels drained after it)."""
        counts = []
        for _ in range(repeat):
            self.events = itertools.count()
            try:
                call()
            finally:
                counts.append(next(self.events))
                self.events = None
            cupy.sim.drain()
        return float(np.median(counts))


def _counted_step(kind: str, parameter_device: str, n: int) -> dict:
    """The simulated runtime's counters of one steady step of ``n`` variables (the plan, tables and the
    replicas' copies made by the steps before), and its Python call events. ``kind``: ``plain`` (Adam),
    ``dynamic`` / ``fixed`` (Adam under a LossScaleOptimizer, float16 gradients), ``accumulate`` (Adam
    whose steps only accumulate)."""
    s = CentralStorageStrategy(GPUS, parameter_device)
    shapes = [(16, 8) if k % 2 else (8,) for k in range(n)]
    with s.scope():
        variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
        opt = md.optimizers.Adam(0.01, gradient_accumulation_steps=10 ** 6 if kind == "accumulate" else None)
        if kind in ("dynamic", "fixed"):
            opt = md.mixed_precision.LossScaleOptimizer(opt, dynamic=kind == "dynamic")
    dtype = np.float16 if kind in ("dynamic", "fixed") else np.float32
    grads = s.run(lambda: [cupy.full(shape, 0.25 * (md.get_replica_context().replica_id_in_sync_group + 1), dtype)
                           for shape in shapes])

    events = _TrainEvents()

    def step(replica_grads):
        for v in variables:  # (each replica reads every variable on its GPU, as a forward pass does)
            v.read_value()
        with events.counting():
            opt.apply_gradients(zip(replica_grads, variables))

    def run():
        s.run(step, args=(grads,))

    for _ in range(3):
        run()
    gc.collect()
    c = sim_counters(run)
    counted = {key: c[key] for key in ("launches", "kernels", "stream_ops", "host_waits")}
    counted["copies"] = c["calls"].get("cudaMemcpyAsync", 0)
    return counted, events.of(run)


@pytest.mark.gpu
@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches and copies")
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0", "/gpu:1"])
@pytest.mark.parametrize("layout", ["physical", "logical"])
def test_loss_scaled_and_accumulate_only_steps_cost_the_same_for_20_and_200_variables(layout, parameter_device):
    """Launches per GPU, CuPy kernels, stream operations, copies and host waits of a loss-scaled step (dynamic or
    fixed) and of an accumulate-only step: the same for 20 as for 200 variables, with the variables in host
    memory or on either GPU. The Python call events of their apply_gradients (and the plain step's) do not grow
    with the variables: the gradients' checks, dtypes and pack sources are C loops over the lists (one event per
    variable would add 180; the replica threads' waits vary the count by a few, the margin allowed)."""
    with gpu_pair(layout):
        counted = {kind: {n: _counted_step(kind, parameter_device, n) for n in (20, 200)}
                   for kind in ("plain", "dynamic", "fixed", "accumulate")}
    for kind in ("plain", "dynamic", "fixed", "accumulate"):
        if kind != "plain":
            assert counted[kind][20][0] == counted[kind][200][0], (kind, counted[kind])
        assert counted[kind][200][1] <= 1.25 * counted[kind][20][1], (kind, counted)
    # One look at the sums on the host where the variables live there (the plain step's copy to the host), none
    # with them on a GPU, where the dynamic step is decided too.
    for kind in ("dynamic", "fixed", "accumulate"):
        assert counted[kind][200][0]["host_waits"] == (parameter_device == "/cpu:0"), (kind, counted[kind])
    # Beyond the plain step, per GPU: the check of the sums and the scale's step (dynamic), the conversion of the
    # float16 sums (dynamic, fixed) and the scale's step (fixed: it counts iterations).
    for kind, extra in (("dynamic", 3), ("fixed", 2), ("accumulate", 0)):
        for gpu, launches in counted[kind][200][0]["launches"].items():
            assert launches <= counted["plain"][200][0]["launches"][gpu] + extra, (kind, counted)


def _function_loss_scaled_steps(parameter_device: str, compiled: bool, dynamic: bool):
    """Six Adam steps under a LossScaleOptimizer of float16 gradients, eagerly or through md.function (the fourth
    one's gradients infinite): the weights, the losses, the scale and ``iterations``, and the last call's
    simulated runtime counters."""
    from mirrored.distribute.function import EagerFallbackWarning

    s = CentralStorageStrategy(GPUS, parameter_device)
    with s.scope():
        w = md.Variable(np.linspace(-1, 1, 6, dtype=np.float32))
        b = md.Variable(np.ones(3, np.float32))
        opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.Adam(0.1), dynamic=dynamic, initial_scale=8.0,
                                                    dynamic_growth_steps=2)

    def step(x):
        opt.apply_gradients([((w.read_value() * x).astype(np.float16), w), ((b.read_value() * x).astype(np.float16),
                                                                              b)])
        return md.get_replica_context().all_reduce("SUM", (w.read_value() ** 2).sum())

    fn = md.function(step) if compiled else step
    losses, counted = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        for k in range(6):
            x = s.experimental_distribute_values_from_function(
                lambda ctx: cupy.full((), np.inf if k == 3 else k + 1, np.float32))
            if k == 5 and SIMULATED:
                counted = sim_counters(lambda: losses.append(s.run(fn, args=(x,))))
            else:
                losses.append(s.run(fn, args=(x,)))
            losses[-1] = float(md.device_util.to_host(s.experimental_local_results(losses[-1])[0]))
    return (np.asarray(md.device_util.to_host(w.read_value())), losses, float(opt.loss_scale),
            int(opt.iterations.numpy()), counted)


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("layout, parameter_device", [("logical", "/gpu:0"), ("physical", "/gpu:0"),
                                                      ("physical", "/gpu:1")])
def test_md_function_captures_the_packed_loss_scaled_step_and_replays_the_eager_bits(layout, parameter_device,
                                                                                    dynamic):
    """The packed step's first run is the general one (it makes the plan), and md.function captures the second:
    the buffers its packs need were made before (a capture cannot upload). Replays give the eager weights,
    losses, scale and ``iterations`` (a skipped step included), one graph launch per GPU and nothing else."""
    with gpu_pair(layout):
        eager = _function_loss_scaled_steps(parameter_device, False, dynamic)
        compiled = _function_loss_scaled_steps(parameter_device, True, dynamic)
    np.testing.assert_array_equal(eager[0], compiled[0])
    np.testing.assert_array_equal(eager[1], compiled[1])  # (NaN where the fixed scale applied the inf)
    assert eager[2:4] == compiled[2:4]
    if SIMULATED:
        counted = compiled[4]
        assert counted["graph_launches"] == ({0: 1} if layout == "logical" else {0: 1, 1: 1})
        assert sum(counted["launches"].values()) == 0 and sum(counted["kernels"].values()) == 0
