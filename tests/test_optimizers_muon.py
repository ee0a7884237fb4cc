"""Muon: Keras 3.15's arguments, routing (Muon or AdamW per variable), slots (names, checkpoint order) and results
under MirroredStrategy at 1, 2 and 4 replicas against tests/data/keras_muon.npz (recorded by
tests/data/record_keras_muon.py); the fused update's parts against the reference rules; the GPU path on the
simulated runtime and its launch count."""

import json
import os

import numpy as np
import pytest

import mirrored as md
from mirrored._core import fused_update as host_fused_update
from mirrored.train.optimizers import rules
from test_optimizer_keras_parity import build

HERE = os.path.dirname(__file__)
DATA = np.load(os.path.join(HERE, "data", "keras_muon.npz"))
CONFIGS = json.loads(str(DATA["configs"]))
VARIABLES = [(path, tuple(shape)) for path, shape in json.loads(str(DATA["variables"]))]
STEPS = DATA["grads_0"].shape[0]
REPLICAS = (1, 2, 4)
O = md.optimizers
MUON_ROUTED = {"dense/kernel", "tall/kernel", "wide/kernel", "dense_1/kernel"}


def _model(strategy, name):
    cls, kwargs, dtype = CONFIGS[name]
    with strategy.scope():
        variables = [md.Variable(DATA[f"w0_{i}"].astype(dtype), name=path) for i, (path, _) in enumerate(VARIABLES)]
        opt = build(md.optimizers, cls, kwargs)
    return opt, variables, dtype


def _train(name, n, xp=np, devices=None):
    strategy = md.MirroredStrategy(devices=devices or [f"/cpu:{i}" for i in range(n)])
    opt, variables, dtype = _model(strategy, name)
    grads = [DATA[f"grads_{i}"].astype(dtype) for i in range(len(VARIABLES))]
    for s in range(STEPS):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(xp.asarray(g[s, r]), v) for g, v in zip(grads, variables)])
        strategy.run(step)
    return opt, variables


# float32: the element-wise parts are Keras' own operations; Newton-Schulz's matrix products and the norm add in
# another order than TensorFlow's, and its 5 steps (a = 3.4 > 1) carry that ulp into every element.
RTOL = {"float32": 1e-5, "float64": 1e-12}


@pytest.mark.parametrize("name, n", [(name, n) for name in sorted(CONFIGS) for n in REPLICAS
                                     if f"{name}|{n}|iterations" in DATA])  # (a few at 1 replica only)
def test_weights_and_slots_match_keras(name, n):
    opt, variables = _train(name, n)
    rtol = RTOL[CONFIGS[name][2]]
    for i, var in enumerate(variables):
        first = np.asarray(var.values[0])
        np.testing.assert_allclose(first, DATA[f"{name}|{n}|w_{i}"], rtol=rtol, atol=rtol)
        assert all(np.array_equal(np.asarray(c), first) for c in var.values[1:])  # copies bit-identical
        for slot in ("momentum", "velocity", "average"):
            key = f"{name}|{n}|{slot}_{i}"
            if key in DATA:
                value = np.asarray(opt.get_slot(var, slot).values[0])
                assert value.dtype == DATA[key].dtype
                np.testing.assert_allclose(value, DATA[key], rtol=rtol, atol=rtol)
            elif slot == "velocity":  # Keras gives Muon-routed variables no velocity
                with pytest.raises(KeyError, match="velocity"):
                    opt.get_slot(var, slot)
    assert int(opt.iterations.numpy()) == DATA[f"{name}|{n}|iterations"]


def test_routing_and_slots_follow_keras():
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    opt, variables, _ = _model(strategy, "Muon excluded")
    opt.build(variables)
    routed = {_path(v) for v in variables if not opt._should_use_adamw(v)}
    assert routed == MUON_ROUTED
    # Keras' _variables order: each variable's momentum, then its velocity when AdamW-routed; the recorded
    # paths name them "<optimizer>/<path with _>_<slot>" (the optimizer's name numbered per process: muon_1).
    recorded = [p.split("/", 1)[1] for p in json.loads(str(DATA["Muon excluded|1|slot_paths"]))[2:]]
    ours = [f"{_path(var).replace('/', '_')}_{slot}" for var, slot, _ in opt._keras_variables().values()]
    assert ours == recorded
    default = O.Muon()
    default.build(variables)
    assert not default._should_use_adamw(variables[7])  # output_dense: only excluded by exclude_layers
    assert default._should_use_adamw(variables[8])  # the embedding, excluded by default
    no_embeddings = O.Muon(exclude_embeddings=False, exclude_layers=["^tall", "wide/k.*"])
    assert [no_embeddings._should_use_adamw(v) for v in variables] == [
        False, True, True, True, False, True, True, False, False]


def _path(var):
    return var.name.split(":")[0]


def test_keras_defaults_and_config_round_trip():
    opt = O.Muon()
    assert (opt.name, opt.learning_rate, opt.adam_beta_1, opt.adam_beta_2, opt.adam_weight_decay, opt.epsilon,
            opt.weight_decay, opt.exclude_layers, opt.exclude_embeddings, opt.muon_a, opt.muon_b, opt.muon_c,
            opt.adam_lr_ratio, opt.momentum, opt.ns_steps, opt.nesterov, opt.rms_rate) == (
        "muon", 0.001, 0.9, 0.999, 0.004, 1e-7, 0.004, [], True, 3.4445, -4.775, 2.0315, 1, 0.95, 5, True, 0.2)
    config = O.Muon(learning_rate=0.02, exclude_layers=["head"], ns_steps=3, rms_rate=None).get_config()
    assert list(config)[-14:] == ["adam_beta_1", "adam_beta_2", "epsilon", "exclude_layers", "muon_a", "muon_b",
                                  "muon_c", "adam_lr_ratio", "momentum", "ns_steps", "nesterov",
                                  "exclude_embeddings", "adam_weight_decay", "rms_rate"]
    again = O.Muon.from_config(config)
    assert again.get_config() == config and again.exclude_layers == ["head"] and again.rms_rate is None
    assert type(O.deserialize(O.serialize(again))) is O.Muon and type(O.get("muon")) is O.Muon


@pytest.mark.parametrize("make, match", [
    (lambda: O.Muon(ns_steps=2.5), "ns_steps"),
    (lambda: O.Muon(ns_steps=-1), "ns_steps"),
    (lambda: O.Muon(learning_rate=-0.1), "learning_rate"),
    (lambda: O.Muon(momentum=1.5), "momentum"),
    (lambda: O.Muon(adam_beta_1=1.0), "adam_beta_1"),
    (lambda: O.Muon(muon_a=float("nan")), "muon_a"),
    (lambda: O.Muon(rms_rate=-0.2), "rms_rate"),
    (lambda: O.Muon(adam_weight_decay="x"), "adam_weight_decay"),
    (lambda: O.Muon(exclude_layers="dense"), "exclude_layers"),
    (lambda: O.Muon(exclude_layers=["("]), "exclude_layers"),
    (lambda: O.Muon(amsgrad=True), "not recognized"),
])
def test_bad_arguments_name_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _keras_step(w, g, m, opt, lr, decay=True):
    """Keras' Muon step of one 2-D variable, transcribed with NumPy (float64 products: an independent check)."""
    if decay and opt.weight_decay is not None:
        w = w - w * np.float32(opt.weight_decay) * np.float32(lr)
    m = m + (g + m * np.float32(opt.momentum - 1))
    x = (g + np.float32(opt.momentum) * m) if opt.nesterov else m
    x = x.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(opt.ns_steps):
        a = x @ x.T
        x = opt.muon_a * x + (opt.muon_b * a + opt.muon_c * a @ a) @ x
    if tall:
        x = x.T
    update = lr * x * np.sqrt(max(x.shape)) * opt.rms_rate
    return (w - update).astype(np.float32), m


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fused_step_is_keras_update_step(dtype):
    """Three steps of square, tall and wide matrices (two of one shape: one stack) against the NumPy
    transcription of Keras' update_step; float16 takes the array path variable by variable."""
    rng = np.random.RandomState(5)
    shapes = [(4, 4), (6, 3), (3, 5), (4, 4)]
    w0 = [rng.randn(*s).astype(np.float32) for s in shapes]
    grads = [[rng.randn(*s).astype(np.float32) for s in shapes] for _ in range(3)]
    variables = [md.Variable(w.astype(dtype), name=f"layer{k}/kernel") for k, w in enumerate(w0)]
    opt = O.Muon(learning_rate=0.05, weight_decay=0.1)
    expected, momentums = list(w0), [np.zeros(s, np.float32) for s in shapes]
    for step in grads:
        opt.apply_gradients([(g.astype(dtype), v) for g, v in zip(step, variables)])
        for k, g in enumerate(step):
            expected[k], momentums[k] = _keras_step(expected[k], g, momentums[k], opt, 0.05)
    rtol = 1e-5 if dtype == np.float32 else 2e-2
    for var, want, m in zip(variables, expected, momentums):
        np.testing.assert_allclose(np.asarray(var.numpy(), np.float32), want, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(np.asarray(opt.get_slot(var, "momentum").numpy(), np.float32), m, rtol=rtol,
                                   atol=rtol)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_muon_rule_kernel_is_the_reference_bit_for_bit(dtype, nesterov):
    """rules.MUON on the host kernel (sizes with vector tails, several variables) equals rules.muon_momentum."""
    rng = np.random.RandomState(1)
    sizes = (1, 7, 64, 1000)
    grads = [rng.randn(n).astype(dtype) for n in sizes]
    momentums = [rng.randn(n).astype(dtype) for n in sizes]
    t = np.dtype(dtype).type
    c = (t(0.95 - 1), t(0.95), t(nesterov))
    out = [np.empty(n, dtype) for n in sizes]
    kernel_m = [m.copy() for m in momentums]
    host_fused_update(rules.MUON, out, grads, [[m] for m in kernel_m], [False] * len(sizes), [float(x) for x in c],
                      0.0, 0.0)
    for o, g, m, km in zip(out, grads, momentums, kernel_m):
        want = np.empty_like(o)
        rules.apply(rules.MUON, want, g, (m,), c)
        np.testing.assert_array_equal(o, want)
        np.testing.assert_array_equal(km, m)


def test_newton_schulz_batches_each_matrix_as_alone():
    rng = np.random.RandomState(2)
    stack = rng.randn(3, 5, 2).astype(np.float32)
    together = rules.newton_schulz(stack, 5, 3.4445, -4.775, 2.0315)
    for i in range(3):
        alone = rules.newton_schulz(stack[i:i + 1].copy(), 5, 3.4445, -4.775, 2.0315)
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-6, atol=1e-7)
    # Orthogonalised: the singular values pulled towards 1 (Keras' coefficients leave them in about [0.7, 1.2]).
    singular = np.linalg.svd(together.astype(np.float64), compute_uv=False)
    assert singular.min() > 0.5 and singular.max() < 1.3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 16, 16), (9, 16, 16), (7, 24, 10), (7, 10, 24), (1, 1, 7), (5, 7, 1),
                                   (40, 12, 12)])
def test_host_newton_schulz_in_chunks_is_the_batched_one_bit_for_bit(shape, dtype):
    """The host step's Newton-Schulz, in place a chunk of matrices at a time (one matrix, chunks that do not
    divide the stack, the whole stack) then scaled, equals the batched newton_schulz and the scaling after it."""
    rng = np.random.RandomState(3)
    stack = rng.randn(*shape).astype(dtype)
    t = np.dtype(dtype).type
    scales = (t(0.01), t(np.sqrt(np.float32(max(shape[1:])))), t(0.2))
    want = rules.newton_schulz(stack, 5, 3.4445, -4.775, 2.0315)
    for s in scales:
        want = want * s
    _, rows, cols = shape
    per_matrix = (3 * min(rows, cols) ** 2 + 2 * rows * cols) * stack.itemsize
    for chunk_bytes in (1, 2 * per_matrix, 3 * per_matrix, 1 << 40):
        got = stack.copy()
        rules.newton_schulz_host(got, 5, 3.4445, -4.775, 2.0315, scales, chunk_bytes=chunk_bytes)
        np.testing.assert_array_equal(got, want)
    got = stack.copy()  # (no scales, no steps: the normalised stack)
    rules.newton_schulz_host(got, 0, 3.4445, -4.775, 2.0315)
    np.testing.assert_array_equal(got, rules.newton_schulz(stack, 0, 3.4445, -4.775, 2.0315))


def test_cross_replica_apply_is_the_same_step():
    name = "Muon decay"
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    opt, variables, dtype = _model(strategy, name)
    grads = [DATA[f"grads_{i}"].astype(dtype) for i in range(len(VARIABLES))]
    for s in range(STEPS):
        per_replica = [strategy.experimental_distribute_values_from_function(
            lambda ctx, g=g: g[s, ctx.replica_id_in_sync_group]) for g in grads]
        with strategy.scope():
            opt.apply_gradients(zip(per_replica, variables))
    for i, var in enumerate(variables):
        np.testing.assert_allclose(np.asarray(var.values[0]), DATA[f"{name}|2|w_{i}"], rtol=2e-5, atol=2e-5)


def test_checkpoint_round_trip(tmp_path):
    opt, variables = _train("Muon excluded", 2)
    named = {f"v{i}": v for i, v in enumerate(variables)}
    path = md.train.Checkpoint(optimizer=opt, **named).write(str(tmp_path / "ck"))
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        fresh_vars = [md.Variable(np.zeros(shape, np.float32), name=p) for p, shape in VARIABLES]
        fresh = O.Muon(0.02, exclude_layers=["output_dense"])
        fresh.build(fresh_vars)
    md.train.Checkpoint(optimizer=fresh, **{f"v{i}": v for i, v in enumerate(fresh_vars)}).read(
        path).assert_consumed()
    for var, other in zip(variables, fresh_vars):
        for slot in ("momentum", "velocity") if opt._should_use_adamw(var) else ("momentum",):
            np.testing.assert_array_equal(np.asarray(fresh.get_slot(other, slot).numpy()),
                                          np.asarray(opt.get_slot(var, slot).numpy()))
    assert int(fresh.iterations.numpy()) == STEPS


def test_indexed_slices_of_an_embedding_take_keras_adamw_step():
    """The embedding's IndexedSlices (AdamW-routed: squared slice by slice, as Keras' TF backend) beside a dense
    Muon-routed kernel."""
    emb = md.Variable(np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5, name="embedding/embeddings")
    kernel = md.Variable(np.ones((5, 3), np.float32), name="dense/kernel")
    opt = O.Muon(0.1)
    values = np.array([[1., 2., 3.], [0.5, -1., 2.], [4., 0., -2.]], np.float32)
    kernel_grad = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
    for _ in range(3):
        opt.apply_gradients([(md.IndexedSlices(values, np.array([1, 1, 3]), (4, 3)), emb), (kernel_grad, kernel)])
    np.testing.assert_allclose(np.asarray(emb.numpy()), DATA["sparse|embeddings"], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(kernel.numpy()), DATA["sparse|kernel"], rtol=2e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Muon decay", "Muon use_ema accumulation", "Muon float64", "Muon clipnorm"])
def test_gpu_replicas_match_keras_and_the_cpu_replicas(name):
    from gpu_env import cupy, gpu_pair

    with gpu_pair():
        _, variables = _train(name, 2, cupy, ["/gpu:0", "/gpu:1"])
        on_gpu = [[np.asarray(c.numpy()) for c in var.values] for var in variables]
    _, variables = _train(name, 2)
    rtol = RTOL[CONFIGS[name][2]]
    for i, (copies, var) in enumerate(zip(on_gpu, variables)):
        if f"{name}|2|w_{i}" in DATA:
            np.testing.assert_allclose(copies[0], DATA[f"{name}|2|w_{i}"], rtol=rtol, atol=rtol)
        np.testing.assert_allclose(copies[0], np.asarray(var.values[0]), rtol=rtol, atol=rtol)
        np.testing.assert_array_equal(copies[0], copies[1])  # the copies stay bit-identical


def _launches_per_gpu(monkeypatch, variables: int, shapes: list) -> tuple:
    """(engine launches, CuPy stand-in launches besides the step's own gradients) per GPU of one step over
    ``variables`` variables: every fourth a bias, the others of ``shapes`` in turn."""
    from gpu_env import cupy
    from test_optimizer_gpu import _count_launches

    shape_of = [shapes[k % len(shapes)] if k % 4 else (8,) for k in range(variables)]
    strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
    with strategy.scope():
        params = [md.Variable(np.full(s, 0.5, np.float32), name=f"layer{k}/w") for k, s in enumerate(shape_of)]
        opt = O.Muon(0.01)

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        grads = [cupy.full(s, 0.25 * (r + 1), np.float32) for s in shape_of]
        opt.apply_gradients(zip(grads, params), experimental_aggregate_gradients=False)

    for _ in range(2):  # the plan, the slots, the tables and the stacking buffer made outside the count
        strategy.run(step)
    engine, stand_in = _count_launches(monkeypatch, lambda: strategy.run(step))
    blas = cupy.sim.counters()["blas"]  # (md.linalg.matmul's products, counted apart)
    per_gpu = [(engine[g], stand_in[g] - variables, blas.get(g, 0)) for g in (0, 1)]
    assert per_gpu[0] == per_gpu[1]
    return per_gpu[0]


@pytest.mark.gpu
def test_gpu_launches_grow_with_the_shapes_not_the_variables(monkeypatch):
    """The engine's launches per GPU (the pack, ADAM, MUON, SGD) are 4 whatever the variables; the CuPy
    stand-in's are the step count's one plus a fixed number per distinct Muon shape (Newton-Schulz on its stack,
    lr_adjust), and so are its cuBLAS products (3 per Newton-Schulz step), for 20 or 200 variables alike."""
    from gpu_env import SIMULATED

    if not SIMULATED:
        pytest.skip("counts the simulated runtime's launches")
    few = _launches_per_gpu(monkeypatch, 20, [(16, 8)])
    many = _launches_per_gpu(monkeypatch, 200, [(16, 8)])
    mixed = _launches_per_gpu(monkeypatch, 24, [(16, 8), (8, 16), (12, 12)])
    assert few == many
    engine, one_shape, products = few
    assert engine == 4 and mixed[0] == 4
    assert one_shape == 1 + NS_KERNELS and mixed[1] == 1 + 3 * NS_KERNELS
    assert products == NS_PRODUCTS and mixed[2] == 3 * NS_PRODUCTS


# Newton-Schulz on one stack at ns_steps=5: CuPy kernels for the norm (5), 5 per step, lr_adjust (3); batched
# cuBLAS products, 3 per step.
NS_KERNELS = 5 + 5 * 5 + 3
NS_PRODUCTS = 3 * 5


def _steps_on_two_gpus(steps: int, captured: bool, **kwargs):
    """``steps`` Muon steps (a square, a tall kernel, a bias) on two logical GPUs, through md.function when
    ``captured``; every copy of every variable."""
    md.config.set_logical_device_configuration("GPU", 0, count=2)
    try:
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        shapes = [(4, 4), (6, 3), (4,)]
        with strategy.scope():
            variables = [md.Variable(np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s),
                                     name=f"layer{k}/w") for k, s in enumerate(shapes)]
            opt = O.Muon(0.05, weight_decay=0.1, **kwargs)

        def step(g):
            opt.apply_gradients([(g[: int(np.prod(v.shape))].reshape(v.shape) * (k + 1) - v.read_value(), v)
                                 for k, v in enumerate(variables)])

        run = md.function(step) if captured else step
        devices = strategy.extended.worker_devices
        for s in range(steps):
            g = md.PerReplica([md.device_util.place(np.linspace(s, r + 1, 18, dtype=np.float32) ** 2, d)
                               for r, d in enumerate(devices)], devices)
            strategy.run(run, args=(g,))
        return [np.asarray(c.numpy()) for v in variables for c in v.values]
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [{}, {"nesterov": False, "rms_rate": None, "loss_scale_factor": 2.0}])
def test_md_function_replays_are_the_eager_steps(kwargs):
    captured, eager = _steps_on_two_gpus(4, True, **kwargs), _steps_on_two_gpus(4, False, **kwargs)
    for c, e in zip(captured, eager):
        np.testing.assert_array_equal(c, e)
