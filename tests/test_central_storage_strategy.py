"""md.distribute.experimental.CentralStorageStrategy against TensorFlow 2.21's answers
(tests/central_storage_scenarios.py, recorded by tests/data/record_tf_central_storage.py), training like
MirroredStrategy over the same replicas and like the plain loop, on the CPU and on (simulated) GPUs."""

import inspect
import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
import central_storage_scenarios as scenarios
import test_one_device_strategy as one_device
from gpu_env import SIMULATED, SKIP_REASON, cupy, gpu_pair, needs_gpus, physical_gpus, sim_counters
from mirrored.distribute.function import EagerFallbackWarning

with open(os.path.join(os.path.dirname(__file__), "data", "tf_central_storage_reference.json")) as _f:
    REFERENCE = json.load(_f)

CentralStorageStrategy = md.distribute.experimental.CentralStorageStrategy


class Mirrored(one_device.Mirrored):
    """The scenarios' adapter over mirrored: one_device_scenarios' and CentralStorageStrategy."""

    @staticmethod
    def central(compute_devices=None, parameter_device=None):
        return CentralStorageStrategy(compute_devices, parameter_device)


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE["scenarios"]) == sorted(scenarios.SCENARIOS)


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_strategy_matches_tensorflow(name):
    one_device.assert_scenario_matches(scenarios, REFERENCE, Mirrored(), name)


# --- construction ---------------------------------------------------------------------------------------------

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"


@pytest.mark.parametrize("bad, error, argument", [
    ("/cpu:0", ValueError, "compute_devices"), (3, TypeError, "compute_devices"), ([], ValueError, "compute_devices"),
    (["/foo:0"], ValueError, "compute_devices"), (["/cpu:0/gpu:0"], ValueError, "compute_devices"),
    (["/cpu:0", "cpu:0"], ValueError, "No duplicates"), (["/gpu:7"], ValueError, "not available")])
def test_bad_compute_devices_say_what_to_pass(bad, error, argument):
    with pytest.raises(error, match=argument):
        CentralStorageStrategy(bad)


@pytest.mark.parametrize("bad", [3, ["/cpu:0"], "/foo:0", "/gpu:7"])
def test_bad_parameter_device_names_the_argument(bad):
    with pytest.raises(ValueError, match="parameter_device"):
        CentralStorageStrategy(["/cpu:0", "/cpu:1"], bad)


def test_exported_where_tf_has_it():
    assert "CentralStorageStrategy" in md.distribute.experimental.__all__
    assert isinstance(CentralStorageStrategy(), md.distribute.Strategy)
    assert str(inspect.signature(CentralStorageStrategy)) == "(compute_devices=None, parameter_device=None)"
    v1 = md.compat.v1.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    assert isinstance(v1, CentralStorageStrategy) and v1.num_replicas_in_sync == 2
    rows = list(v1.experimental_distribute_dataset(v1.experimental_make_numpy_dataset(np.arange(4), session=None)
                                                   .batch(4)))
    assert [[c.tolist() for c in v1.experimental_local_results(r)] for r in rows] == [[[0, 1], [2, 3]]]


# --- variables ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("aggregation", ["SUM", "MEAN", "ONLY_FIRST_REPLICA"])
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_updates_in_run_aggregate_then_apply_once(n, aggregation, method):
    s = CentralStorageStrategy([f"/cpu:{i}" for i in range(n)], "/cpu:0")
    start = np.array([[1.0, -2.0], [0.5, 4.0]], np.float64)
    with s.scope():
        v = md.Variable(start, aggregation=md.VariableAggregation[aggregation])
    deltas = [np.full((2, 2), 1.5, np.float64) * (r + 1) + np.eye(2) * r for r in range(n)]
    s.run(lambda: getattr(v, method)(deltas[md.get_replica_context().replica_id_in_sync_group]))
    combined = {"SUM": np.sum(deltas, axis=0), "MEAN": np.mean(deltas, axis=0), "ONLY_FIRST_REPLICA": deltas[0]}
    want = {"assign": combined[aggregation], "assign_add": start + combined[aggregation],
            "assign_sub": start - combined[aggregation]}[method]
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-12)
    assert type(v).__name__ == "AggregatingVariable" and v.device == CPU.format(0)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 4), shape=st.lists(st.integers(0, 3), max_size=3),
       dtype=st.sampled_from(["float32", "float64"]), aggregation=st.sampled_from(["SUM", "MEAN", "ONLY_FIRST_REPLICA"]), seed=st.integers(0, 2 ** 16))
def test_assign_add_in_run_is_numpys_aggregate_over_shapes_dtypes_and_replicas(n, shape, dtype, aggregation, seed):
    rng = np.random.default_rng(seed)
    start = rng.normal(size=shape).astype(dtype)
    deltas = [rng.normal(size=shape).astype(dtype) for _ in range(n)]
    s = CentralStorageStrategy([f"/cpu:{i}" for i in range(n)])
    with s.scope():
        v = md.Variable(start, aggregation=md.VariableAggregation[aggregation])

    def step():
        before = v.read_value() + 0
        v.assign_add(deltas[md.get_replica_context().replica_id_in_sync_group])
        return before

    reads = s.run(step)
    combined = {"SUM": np.sum(deltas, axis=0, dtype=dtype), "MEAN": np.mean(deltas, axis=0, dtype=dtype),
                "ONLY_FIRST_REPLICA": deltas[0]}[aggregation]
    tol = 1e-6 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(v.numpy(), start + combined, rtol=tol, atol=tol)
    assert v.dtype == dtype and v.shape == tuple(shape)
    for r in s.experimental_local_results(reads):
        np.testing.assert_array_equal(r, start)  # each replica read the value before the update


def test_replicas_read_the_value_itself_on_cpus_and_arrays_read_earlier_keep_theirs():
    s = CentralStorageStrategy(["/cpu:1", "/cpu:2"], "/cpu:0")
    with s.scope():
        v = md.Variable(np.arange(3, dtype=np.float32), aggregation=md.VariableAggregation.SUM)
    reads = s.experimental_local_results(s.run(lambda: v.read_value()))
    assert all(r is v.read_value() for r in reads)
    before = v.read_value()
    s.run(lambda: v.assign_add(np.ones(3, np.float32)))
    assert before.tolist() == [0, 1, 2] and v.numpy().tolist() == [2, 3, 4]


def test_checkpoint_restores_into_mirrored_variables_and_back(tmp_path):
    central = CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with central.scope():
        w = md.Variable(np.arange(3, dtype=np.float32))
    one_device.assert_restores_into_mirrored_and_back(w, tmp_path)


# --- training -------------------------------------------------------------------------------------------------

OPTIMIZERS = {"sgd": lambda: md.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.05),
              "lamb": lambda: md.optimizers.Lamb(0.05, weight_decay=0.1),
              "schedule_free_adamw": lambda: md.optimizers.ScheduleFreeAdamW(0.05, warmup_steps=2, weight_decay=0.1)}


def _train(strategy, optimizer, xp=np, steps=4, loss_scale=False, cross_replica=False):
    """Weights after ``steps`` steps of a least-squares fit over a global batch of 8 rows split over the replicas
    (``strategy`` None: the whole batch in one plain loop)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)
    scale = 128.0 if loss_scale else 1.0

    def build():
        w = md.Variable(np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1), name="w")
        b = md.Variable(np.zeros(1, np.float32), name="b")
        opt = optimizer()
        if loss_scale:
            opt = md.mixed_precision.LossScaleOptimizer(opt, dynamic=False, initial_scale=scale)
        return w, b, opt

    def grads(xb, yb):
        xb, yb = xp.asarray(xb), xp.asarray(yb)
        err = xb @ w.read_value() + b.read_value() - yb
        g = [(xb.T @ err) * (2 * scale / len(x)), err.sum(axis=0) * (2 * scale / len(x))]
        return opt.get_unscaled_gradients(g) if loss_scale else g

    def step(xb, yb):
        opt.apply_gradients(zip(grads(xb, yb), [w, b]))

    if strategy is None:
        w, b, opt = build()
        for _ in range(steps):
            step(x, y)
    else:
        with strategy.scope():
            w, b, opt = build()
        batch = next(iter(strategy.experimental_distribute_dataset(md.data.Dataset.from_tensors((x, y)))))
        for _ in range(steps):
            if cross_replica:
                with strategy.scope():
                    opt.apply_gradients(zip(strategy.run(grads, args=batch), [w, b]))
            else:
                strategy.run(step, args=batch)
    return [np.asarray(md.device_util.to_host(v.read_value())) for v in (w, b)]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_trains_as_mirrored_on_the_same_replicas_and_as_the_plain_loop(name, loss_scale, n):
    devices = [f"/cpu:{i}" for i in range(n)]
    optimizer = OPTIMIZERS[name]
    central = _train(CentralStorageStrategy(devices), optimizer, loss_scale=loss_scale)
    mirrored = _train(md.MirroredStrategy(devices), optimizer, loss_scale=loss_scale)
    plain = _train(None, optimizer, loss_scale=loss_scale)
    for c, m, p in zip(central, mirrored, plain):
        np.testing.assert_array_equal(c, m)
        np.testing.assert_allclose(c, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_apply_gradients_in_cross_replica_context_takes_per_replica_gradients(name):
    devices = ["/cpu:0", "/cpu:1", "/cpu:2"]
    central = _train(CentralStorageStrategy(devices), OPTIMIZERS[name], cross_replica=True)
    mirrored = _train(md.MirroredStrategy(devices), OPTIMIZERS[name], cross_replica=True)
    for c, m in zip(central, mirrored):
        np.testing.assert_array_equal(c, m)


@pytest.mark.parametrize("cross_replica", [False, True], ids=["in_run", "cross_replica"])
def test_gradient_accumulation_applies_the_sum_over_replicas_every_nth_step(cross_replica):
    devices = ["/cpu:0", "/cpu:1"]
    sgd = lambda: md.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)  # noqa: E731
    central = _train(CentralStorageStrategy(devices), sgd, steps=5, cross_replica=cross_replica)
    mirrored = _train(md.MirroredStrategy(devices), sgd, steps=5, cross_replica=cross_replica)
    for c, m in zip(central, mirrored):
        np.testing.assert_allclose(c, m, rtol=1e-6)


@pytest.mark.parametrize("clip", [{"clipnorm": 0.5}, {"global_clipnorm": 0.5}, {"clipvalue": 0.1}],
                         ids=["clipnorm", "global_clipnorm", "clipvalue"])
@pytest.mark.parametrize("n", [2, 4])
def test_gradient_accumulation_with_clipping_clips_the_accumulated_average_as_the_plain_loop(n, clip):
    """Keras 3 clips ``(g + accumulator) / steps`` on the update step (recorded on one compute device:
    gradient_accumulation_clips_the_accumulated_average; with several TF's Keras fails). Several replicas: their
    sum is the step's gradient, accumulated once, so the weights are the plain loop's over the global batch."""
    sgd = lambda: md.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2, **clip)  # noqa: E731
    plain = _train(None, sgd, steps=5)
    for cross_replica in (False, True):
        central = _train(CentralStorageStrategy([f"/cpu:{i}" for i in range(n)]), sgd, steps=5,
                         cross_replica=cross_replica)
        for c, p in zip(central, plain):
            np.testing.assert_allclose(c, p, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0", "/gpu:1"])
def test_gpu_apply_gradients_not_aggregated_applies_the_first_replicas_gradients(parameter_device, dtype):
    """``experimental_aggregate_gradients=False``: the caller's all-reduced gradients of the first replica update
    the variables wherever they are (packed from the second step on for the kernel's dtypes), alternating with
    aggregated steps."""
    s = CentralStorageStrategy(GPUS, parameter_device)
    with s.scope():
        w = md.Variable(np.ones(4, dtype))
        opt = md.optimizers.SGD(0.5)

    def step(aggregate):
        g = w.read_value() * 0 + (md.get_replica_context().replica_id_in_sync_group + 1)
        if not aggregate:
            g = md.get_replica_context().all_reduce("SUM", g)
        opt.apply_gradients([(g, w)], experimental_aggregate_gradients=aggregate)
        return md.device_util.to_host(w.read_value())

    for k, aggregate in enumerate((True, True, False, False, True)):  # each step: w -= 0.5 * (1 + 2)
        reads = s.experimental_local_results(s.run(step, args=(aggregate,)))
        assert [np.asarray(r).tolist() for r in reads] == [[1 - 1.5 * (k + 1)] * 4] * 2


def _dynamic_loss_scale_steps(devices, parameter_device, xp):
    s = CentralStorageStrategy(devices, parameter_device)
    with s.scope():
        w = md.Variable(np.ones(2, np.float32))
        opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.SGD(0.5), initial_scale=4.0)

    def step(bad):
        rid = md.get_replica_context().replica_id_in_sync_group
        g = np.full(2, 4.0 * (rid + 1), np.float32)
        if bad and rid == 1:
            g[0] = np.inf
        opt.apply_gradients([(xp.asarray(g), w)])

    s.run(step, args=(True,))
    assert w.numpy().tolist() == [1, 1] and float(opt.loss_scale) == 2.0 and int(opt.iterations.numpy()) == 0
    s.run(step, args=(False,))  # (4 + 8) / 2 = 6, times the learning rate
    assert w.numpy().tolist() == [-2, -2] and int(opt.iterations.numpy()) == 1


def test_dynamic_loss_scale_skips_a_step_whose_gradients_are_not_finite_on_any_replica():
    _dynamic_loss_scale_steps(["/cpu:0", "/cpu:1"], None, np)


def test_one_fused_update_on_the_parameter_device_per_step(monkeypatch):
    """The replicas' gradients of every variable are all-reduced in one call (from the second step on, one packed
    buffer per dtype, as MirroredStrategy's), and the update runs once."""
    s = CentralStorageStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with s.scope():
        ws = [md.Variable(np.full(4, k, np.float32)) for k in range(10)]
        opt = md.optimizers.SGD(0.5)
    from mirrored.train.optimizers import base

    applied, reduced = [], []
    apply, batch_reduce = base._Plan.apply, type(s.extended._cross_device_ops).batch_reduce

    def counted_apply(plan, device, *args, **kwargs):
        applied.append(device)
        return apply(plan, device, *args, **kwargs)

    def counted_batch_reduce(cdo, op, pairs, options=None):
        reduced.append(len(pairs))
        return batch_reduce(cdo, op, pairs, options)

    monkeypatch.setattr(base._Plan, "apply", counted_apply)
    monkeypatch.setattr(type(s.extended._cross_device_ops), "batch_reduce", counted_batch_reduce)
    for _ in range(3):
        s.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), w) for w in ws]))
    assert applied == [0, 0, 0] and reduced == [10, 1, 1]
    assert [w.numpy()[0] for w in ws] == [k - 4.5 for k in range(10)]


# --- GPUs (simulated without one) -----------------------------------------------------------------------------

GPUS = ["/gpu:0", "/gpu:1"]


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:1"])
def test_gpu_replicas_read_copies_on_their_own_gpu(parameter_device):
    s = CentralStorageStrategy(GPUS, parameter_device)
    with s.scope():
        v = md.Variable(np.arange(3, dtype=np.float32), aggregation=md.VariableAggregation.MEAN)
    assert v.device == md.device_util.canonicalize(parameter_device)

    def step():
        value = v.read_value()
        rid = md.get_replica_context().replica_id_in_sync_group
        v.assign_add(value * 0 + float(rid + 1))
        return value, value.device.id

    values, ordinals = step_results = s.run(step)
    assert [type(r) for r in s.experimental_local_results(values)] == [cupy.ndarray] * 2
    assert list(s.experimental_local_results(ordinals)) == [0, 1]
    assert [np.asarray(md.device_util.to_host(r)).tolist() for r in s.experimental_local_results(values)] == \
        [[0, 1, 2]] * 2
    assert v.numpy().tolist() == [1.5, 2.5, 3.5] and step_results
    rows = s.experimental_local_results(s.run(lambda: v.sparse_read(np.array([2, 0]))))
    assert [(type(r), r.device.id, md.device_util.to_host(r).tolist()) for r in rows] == \
        [(cupy.ndarray, 0, [3.5, 1.5]), (cupy.ndarray, 1, [3.5, 1.5])]


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0"])
@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gpu_compute_devices_train_as_mirrored_on_them(name, loss_scale, parameter_device):
    central = _train(CentralStorageStrategy(GPUS, parameter_device), OPTIMIZERS[name], cupy, loss_scale=loss_scale)
    mirrored = _train(md.MirroredStrategy(GPUS), OPTIMIZERS[name], cupy, loss_scale=loss_scale)
    for c, m in zip(central, mirrored):
        np.testing.assert_array_equal(c, m)


def _counted_adam_steps(parameter_device, n: int, steps: int = 3):
    """``steps`` Adam steps of ``n`` variables on the GPUs; returns the simulated runtime's counters of the last
    (the plan, slots and tables are made by the first two) and the variables."""
    s = CentralStorageStrategy(GPUS, parameter_device)
    shapes = [(16, 8) if k % 2 else (8,) for k in range(n)]
    with s.scope():
        variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
        opt = md.optimizers.Adam(0.01)
    grads = s.run(lambda: [cupy.full(shape, 0.25 * (md.get_replica_context().replica_id_in_sync_group + 1),
                                     np.float32) for shape in shapes])

    def step(replica_grads):
        for v in variables:  # (each replica reads every variable on its GPU, as a forward pass does)
            v.read_value()
        opt.apply_gradients(zip(replica_grads, variables))

    for _ in range(steps - 1):
        s.run(step, args=(grads,))
    return sim_counters(lambda: s.run(step, args=(grads,))), shapes, variables


@pytest.mark.gpu
@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches and copies")
@pytest.mark.parametrize("layout", ["logical", "physical"])
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0", "/gpu:1"])
def test_gpu_apply_gradients_costs_the_same_launches_and_copies_for_10_and_200_variables(layout, parameter_device):
    """Each replica reads every variable and packs its gradients (one launch), one all-reduce sums the packed
    buffers, one copy per dtype takes the sum to the variables' device (none when a replica shares its GPU), one
    fused update runs there, and the replicas on other GPUs get the new values in one transfer per GPU (their
    reads copy nothing): the same launches, stream operations (copies, event waits) and host waits for 10 as for
    200 variables."""
    counted = {}
    with gpu_pair(layout):
        update_gpu = None if parameter_device == "/cpu:0" else md.device_util.physical_ordinal(parameter_device)
        for n in (10, 200):
            c, shapes, variables = _counted_adam_steps(parameter_device, n)
            counted[n] = {key: c[key] for key in ("launches", "stream_ops", "host_waits", "graph_launches")}
            counted[n]["copies"] = c["calls"].get("cudaMemcpyAsync", 0)
            # The update is Adam's on the summed gradients (0.25 + 0.5), bit for bit the host kernel's.
            host = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
            host_opt = md.optimizers.Adam(0.01)
            for _ in range(3):
                host_opt.apply_gradients([(np.full(shape, 0.75, np.float32), v) for shape, v in zip(shapes, host)])
            for k in (0, 1, n - 1):
                np.testing.assert_array_equal(variables[k].numpy(), host[k].numpy())
    assert counted[10] == counted[200]
    assert counted[200]["host_waits"] == (update_gpu is None)  # (the sum's copy to the host, read by its kernel)
    # Per GPU, beyond its replicas' packs (two logical replicas share GPU 0): at most the all-reduce's kernel, the
    # fused update, and the refresh of what replicas on another GPU than the variables' read (a pack of the
    # variables on theirs, a broadcast's kernel on the others).
    packs = {0: 2} if layout == "logical" else {0: 1, 1: 1}
    for gpu, launches in counted[200]["launches"].items():
        assert launches - packs[gpu] <= 3, counted[200]["launches"]


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0"])
def test_gpu_dynamic_loss_scale_skips_a_step_whose_gradients_are_not_finite(parameter_device):
    _dynamic_loss_scale_steps(GPUS, parameter_device, cupy)


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("layout, parameter_device", [("physical", "/cpu:0"), ("physical", "/gpu:0"),
                                                      ("logical", "/cpu:0"), ("logical", "/gpu:1")])
def test_gpu_replicas_read_the_current_value_and_arrays_read_earlier_keep_theirs(layout, parameter_device):
    """What a replica read stays as it was after the update (copy-on-write), the next read sees the update, an
    assign (in run, or in cross-replica context) and the optimizer's slots are read as written."""
    with gpu_pair(layout):
        s = CentralStorageStrategy(GPUS, parameter_device)
        with s.scope():
            w = md.Variable(np.arange(4, dtype=np.float32), aggregation=md.VariableAggregation.MEAN)
            opt = md.optimizers.SGD(0.5, momentum=0.5)
        held = {}

        def step():
            rid = md.get_replica_context().replica_id_in_sync_group
            before = w.read_value()
            opt.apply_gradients([(before * 0 + 1, w)])
            held.setdefault(rid, []).append(before)
            return md.device_util.to_host(w.read_value()), md.device_util.to_host(
                opt.get_slot(w, "momentum").read_value())

        # (the gradients' sum is 2: momentum = 0.5 * momentum - 0.5 * 2, w += momentum)
        for expected, momentum in (([-1, 0, 1, 2], -1), ([-2.5, -1.5, -0.5, 0.5], -1.5)):
            results = s.experimental_local_results(s.run(step))
            for value, slot in results:
                assert np.asarray(value).tolist() == expected and np.asarray(slot).tolist() == [momentum] * 4
        for rid in (0, 1):
            assert [np.asarray(md.device_util.to_host(a)).tolist() for a in held[rid]] == \
                [[0, 1, 2, 3], [-1, 0, 1, 2]]
        s.run(lambda: w.assign(w.read_value() * 0 + 7))  # (MEAN of the replicas' 7s, on their GPUs)
        reads = s.experimental_local_results(s.run(lambda: md.device_util.to_host(w.read_value())))
        assert [np.asarray(r).tolist() for r in reads] == [[7] * 4] * 2
        w.assign(np.full(4, 9, np.float32))
        reads = s.experimental_local_results(s.run(lambda: md.device_util.to_host(w.sparse_read([3, 0]))))
        assert [np.asarray(r).tolist() for r in reads] == [[9, 9]] * 2


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
@pytest.mark.parametrize("parameter_device", ["/cpu:0", "/gpu:0"])
def test_gpu_replicas_read_every_dtype_as_the_update_left_it(parameter_device):
    """Variables of several dtypes in one update (one buffer per dtype on each GPU; float16, which the fused kernel
    does not take, updated variable by variable): every replica reads each value as the update left it."""
    s = CentralStorageStrategy(GPUS, parameter_device)
    dtypes = [np.float32, np.float64, np.float16, np.float32]
    with s.scope():
        variables = [md.Variable(np.linspace(-1, 1, 5 + k).astype(dtype)) for k, dtype in enumerate(dtypes)]
        opt = md.optimizers.Adam(0.1)

    def step():
        reads = [v.read_value() for v in variables]
        opt.apply_gradients([(r * r - 0.5, v) for r, v in zip(reads, variables)])
        return [md.device_util.to_host(v.read_value()) for v in variables]

    for _ in range(3):
        per_replica = s.experimental_local_results(s.run(step))
        assert [len(reads) for reads in per_replica] == [len(variables)] * 2
        for reads in per_replica:
            for read, v in zip(reads, variables):
                assert read.dtype == v.dtype
                np.testing.assert_array_equal(read, v.numpy())


def test_md_function_with_variables_on_the_cpu_runs_eagerly_and_says_why():
    eager = one_device.function_steps(CentralStorageStrategy(["/cpu:0", "/cpu:1"]), False, np)
    with pytest.warns(EagerFallbackWarning, match="not on GPUs"):
        compiled = one_device.function_steps(CentralStorageStrategy(["/cpu:0", "/cpu:1"]), True, np)
    np.testing.assert_array_equal(eager[0], compiled[0])
    assert eager[1] == compiled[1]


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
def test_md_function_with_gpu_compute_devices_and_a_cpu_parameter_device_runs_eagerly():
    eager = one_device.function_steps(CentralStorageStrategy(GPUS, "/cpu:0"), False, np)
    with pytest.warns(EagerFallbackWarning, match="host memory .* a CUDA graph of GPU work cannot hold"):
        compiled = one_device.function_steps(CentralStorageStrategy(GPUS, "/cpu:0"), True, np)
    np.testing.assert_array_equal(eager[0], compiled[0])
    assert eager[1] == compiled[1]


@pytest.mark.gpu
@pytest.mark.skipif(not SIMULATED, reason="needs three GPUs: the simulated machine makes them")
def test_md_function_with_no_replica_on_the_variables_gpu_runs_eagerly_and_says_why():
    with physical_gpus(3):
        devices, parameter_device = ["/gpu:1", "/gpu:2"], "/gpu:0"
        eager = one_device.function_steps(CentralStorageStrategy(devices, parameter_device), False, np)
        with pytest.warns(EagerFallbackWarning, match="no replica runs on the GPU of its variables"):
            compiled = one_device.function_steps(CentralStorageStrategy(devices, parameter_device), True, np)
    np.testing.assert_array_equal(eager[0], compiled[0])
    assert eager[1] == compiled[1]


def _captured_adam_steps(strategy, compiled: bool, steps: int = 5):
    """``steps`` Adam steps of a two-variable least-squares fit, each replica reading the variables on its GPU,
    eagerly or through md.function: the weights, the losses and the last call's simulated runtime counters."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)
    with strategy.scope():
        w = md.Variable(np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1), name="w")
        b = md.Variable(np.zeros(1, np.float32), name="b")
        opt = md.optimizers.Adam(0.05)

    def step(xb, yb):
        err = md.linalg.matmul(xb, w.read_value()) + b.read_value() - yb
        grads = [md.linalg.matmul(xb.T, err) * np.float32(2 / len(x)), err.sum(axis=0) * np.float32(2 / len(x))]
        opt.apply_gradients(zip(grads, [w, b]))
        return md.get_replica_context().all_reduce("SUM", (err * err).sum())

    fn = md.function(step) if compiled else step
    batch = next(iter(strategy.experimental_distribute_dataset(md.data.Dataset.from_tensors((x, y)))))
    losses, counted = [], None
    for s in range(steps):
        if s == steps - 1 and SIMULATED:
            counted = sim_counters(lambda: losses.append(strategy.run(fn, args=batch)))
        else:
            losses.append(strategy.run(fn, args=batch))
        # (read now: a replay's outputs are the captured buffers, which the next replay writes)
        losses[-1] = float(md.device_util.to_host(strategy.experimental_local_results(losses[-1])[0]))
    return [np.asarray(md.device_util.to_host(v.read_value())) for v in (w, b)], losses, counted


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("layout, parameter_device", [("logical", "/gpu:0"), ("physical", "/gpu:0"),
                                                      ("physical", "/gpu:1")])
def test_md_function_captures_the_step_and_replays_the_eager_bits(layout, parameter_device):
    """Replicas on the variables' GPU (logical GPUs) or on other GPUs too: the step is captured (the gradients'
    all-reduce, the update, the broadcast of the new values to the other GPUs' reads) and replays the eager
    step's weights and losses bit for bit, one graph launch per GPU and nothing else."""
    with gpu_pair(layout):
        eager = _captured_adam_steps(CentralStorageStrategy(GPUS, parameter_device), False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerFallbackWarning)
            compiled = _captured_adam_steps(CentralStorageStrategy(GPUS, parameter_device), True)
    for e, c in zip(eager[0], compiled[0]):
        np.testing.assert_array_equal(e, c)
    assert eager[1] == compiled[1]
    if SIMULATED:
        counted = compiled[2]
        assert counted["graph_launches"] == ({0: 1} if layout == "logical" else {0: 1, 1: 1})
        assert sum(counted["launches"].values()) == 0 and sum(counted["kernels"].values()) == 0


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
def test_md_function_step_on_other_gpus_matches_the_one_device_step():
    """The function_steps scenario of OneDeviceStrategy's tests, on two GPUs with the variables on GPU 0."""
    eager = one_device.function_steps(CentralStorageStrategy(GPUS, "/gpu:0"), False, np)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        compiled = one_device.function_steps(CentralStorageStrategy(GPUS, "/gpu:0"), True, np)
    np.testing.assert_array_equal(eager[0], compiled[0])
    assert eager[1] == compiled[1]


@pytest.mark.gpu
@needs_gpus(2)  # GPUS are two GPUs of their own
def test_md_function_refuses_a_read_on_another_gpu_of_a_variable_assigned_in_the_step_and_runs_it_eagerly():
    """The copy of a value written in the step outside the optimizer's update is a transfer between GPUs that the
    capture cannot order: md.function says so and runs the step eagerly, with the eager results."""
    def steps(compiled):
        s = CentralStorageStrategy(GPUS, "/gpu:0")
        with s.scope():
            c = md.Variable(np.zeros(2, np.float32), aggregation=md.VariableAggregation.MEAN)

        def step():
            c.assign_add(c.read_value() * 0 + 1)
            return c.read_value() * 1  # (not the variable's own buffer, which the next step's assign writes)

        fn = md.function(step) if compiled else step
        return [[md.device_util.to_host(r).tolist() for r in s.experimental_local_results(s.run(fn))]
                for _ in range(3)]

    eager = steps(False)
    with pytest.warns(EagerFallbackWarning, match="written in this step outside the optimizer's update"):
        compiled = steps(True)
    assert compiled == eager == [[[k, k]] * 2 for k in (1, 2, 3)]
