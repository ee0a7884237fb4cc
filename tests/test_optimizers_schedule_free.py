"""ScheduleFreeAdamW: Keras 3.15's defaults, config, slots (names, initial values, checkpoint order) and results
under MirroredStrategy at 1, 2 and 4 replicas against tests/data/keras_schedule_free.npz (recorded by
tests/data/record_keras_schedule_free.py on record_keras_optimizers.py's model and gradients)."""

import json
import os

import numpy as np
import pytest

import mirrored as md
from test_optimizer_keras_parity import build

HERE = os.path.dirname(__file__)
DATA = np.load(os.path.join(HERE, "data", "keras_schedule_free.npz"))
INPUTS = np.load(os.path.join(HERE, "data", "keras_optimizers.npz"))  # the same model and gradients
CONFIGS = json.loads(str(DATA["configs"]))
FACTS = json.loads(str(DATA["facts"]))
REPLICAS = (1, 2, 4)
O = md.optimizers


def _model(name, strategy):
    cls, kwargs, dtype = CONFIGS[name]
    with strategy.scope():
        w = md.Variable(INPUTS["w0"].astype(dtype), name="w")
        b = md.Variable(INPUTS["b0"].astype(dtype), name="b")
        opt = build(md.optimizers, cls, kwargs)
    return w, b, opt, INPUTS["grads_w"].astype(dtype), INPUTS["grads_b"].astype(dtype)


def _train(name, n, xp=np, devices=None):
    strategy = md.MirroredStrategy(devices=devices or [f"/cpu:{i}" for i in range(n)])
    w, b, opt, grads_w, grads_b = _model(name, strategy)
    for s in range(grads_w.shape[0]):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(xp.asarray(grads_w[s, r]), w), (xp.asarray(grads_b[s, r]), b)])
        strategy.run(step)
    return opt, w, b


def _rtol(name):
    # float32: the element-wise steps are Keras' own; a clipping norm or the all-reduce sums in another order.
    return {"float16": 4e-3, "float32": 2e-6, "float64": 1e-13}[CONFIGS[name][2]]


def _assert_copies_match(variable, expected, rtol):
    first = np.asarray(variable.values[0])
    assert first.shape == expected.shape and first.dtype == expected.dtype
    np.testing.assert_allclose(first, expected, rtol=rtol, atol=rtol * 1e-1)
    assert all(np.array_equal(np.asarray(c), first) for c in variable.values[1:])  # copies bit-identical


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_and_slots_match_keras(name, n):
    opt, w, b = _train(name, n)
    rtol = _rtol(name)
    for var, key in ((w, "w"), (b, "b")):
        _assert_copies_match(var, DATA[f"{name}|{n}|{key}"], rtol)
        for slot in ("momentum", "velocity", "average"):
            if f"{name}|{n}|{slot}_{key}" in DATA:
                _assert_copies_match(opt.get_slot(var, slot), DATA[f"{name}|{n}|{slot}_{key}"], rtol)
        if f"{name}|{n}|accumulator_{key}" in DATA:  # each replica's own, summed only when applied
            for r, copy in enumerate(opt.get_slot(var, "gradient_accumulator").values):
                np.testing.assert_allclose(np.asarray(copy), DATA[f"{name}|{n}|accumulator_{key}"][r], rtol=rtol,
                                           atol=rtol * 1e-1)
    assert int(opt.iterations.numpy()) == DATA[f"{name}|{n}|iterations"]
    if f"{name}|{n}|final_w" in DATA:  # use_ema: the end of training takes the averages
        with opt._strategy.scope():
            opt.finalize_variable_values([w, b])
        _assert_copies_match(w, DATA[f"{name}|{n}|final_w"], rtol)
        _assert_copies_match(b, DATA[f"{name}|{n}|final_b"], rtol)


def test_cross_replica_apply_is_the_same_step():
    name = "weight_decay clipnorm warmup"
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    w, b, opt, grads_w, grads_b = _model(name, strategy)
    for s in range(grads_w.shape[0]):
        per_replica = [strategy.experimental_distribute_values_from_function(
            lambda ctx, g=g: g[s, ctx.replica_id_in_sync_group]) for g in (grads_w, grads_b)]
        with strategy.scope():
            opt.apply_gradients(zip(per_replica, [w, b]))
    _assert_copies_match(w, DATA[f"{name}|2|w"], _rtol(name))
    _assert_copies_match(opt.get_slot(b, "momentum"), DATA[f"{name}|2|momentum_b"], _rtol(name))


def test_keras_defaults_config_and_variables():
    opt = O.ScheduleFreeAdamW()
    keras_config = dict(FACTS["config"])
    # (Keras numbers a default name taken before in the process: schedule_free_adam_w_1)
    assert opt.name == "schedule_free_adam_w" and keras_config.pop("name").startswith(opt.name)
    config = opt.get_config()
    config.pop("name")
    assert config == keras_config
    assert (opt.learning_rate, opt.beta_1, opt.beta_2, opt.epsilon, opt.warmup_steps) == (0.0025, 0.9, 0.999, 1e-8, 0)
    w = md.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
    b = md.Variable(np.ones(4, np.float32), name="b")
    opt.build([w, b])
    # Keras' variables: iterations, the learning rate, then each variable's momentum and velocity in turn
    # (checkpoint keys _variables/2..).
    keras_names = [(path.split("/")[-1], shape, dtype) for path, shape, dtype in FACTS["variables"]]
    assert keras_names[:2] == [("iteration", [], "int64"), ("learning_rate", [], "float32")]
    assert [(slot, list(var.shape), "float32") for var, slot, _ in opt._keras_variables().values()] == [
        (name.rsplit("_", 1)[-1], shape, dtype) for name, shape, dtype in keras_names[2:]]
    # momentum (z) starts as a copy of the variable, velocity at 0 (Keras' build)
    np.testing.assert_array_equal(np.asarray(opt.get_slot(w, "momentum").numpy()), w.numpy())
    np.testing.assert_array_equal(np.asarray(opt.get_slot(b, "velocity").numpy()), 0)
    assert O.get("schedulefreeadamw").get_config() == O.ScheduleFreeAdamW().get_config()


def test_momentum_starts_at_each_variable_on_every_replica():
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        w = md.Variable(np.linspace(-1, 1, 6, dtype=np.float64).reshape(2, 3))
        s = md.Variable(np.float32(2.5))
        opt = O.ScheduleFreeAdamW()
        opt.build([w, s])
    for var in (w, s):
        momentum = opt.get_slot(var, "momentum")
        assert momentum.dtype == var.dtype and momentum.shape == var.shape
        for copy in momentum.values:
            np.testing.assert_array_equal(np.asarray(copy), var.numpy())


def _keras_steps(w0, grads, lr, beta_1, beta_2, epsilon, warmup_steps, weight_decay):
    """Keras 3.15's update_step transcribed in float32 NumPy, independently of md.optimizers.rules."""
    f = np.float32
    y, z, v = w0.copy(), w0.copy(), np.zeros_like(w0)
    b1, b2, eps = f(beta_1), f(beta_2), f(epsilon)
    for t, g in enumerate(grads, 1):
        y = y - y * f(weight_decay) * f(lr)
        step = f(t)
        rate = f(lr) * np.minimum(step / f(warmup_steps), f(1)) if warmup_steps > 0 else f(lr)
        v = v + (g * g - v) * (f(1) - b2)
        z = z - (rate * g) / (np.sqrt(v / (f(1) - np.power(b2, step))) + eps)
        x = (y - (f(1) - b1) * z) / b1
        x = (f(1) - f(1) / step) * x + (f(1) / step) * z
        y = (f(1) - b1) * z + b1 * x
    return y, z, v


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_the_steps_are_keras_update_step(warmup_steps):
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=(4, 5)).astype(np.float32)
    grads = [rng.normal(size=(4, 5)).astype(np.float32) for _ in range(5)]
    var = md.Variable(w0.copy())
    opt = O.ScheduleFreeAdamW(0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-6, warmup_steps=warmup_steps,
                              weight_decay=0.1)
    for g in grads:
        opt.apply_gradients([(g, var)])
    y, z, v = _keras_steps(w0, grads, 0.05, 0.8, 0.95, 1e-6, warmup_steps, 0.1)
    np.testing.assert_allclose(var.numpy(), y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt.get_slot(var, "momentum").numpy(), z, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt.get_slot(var, "velocity").numpy(), v, rtol=1e-6)


def test_indexed_slices_square_slice_by_slice_as_keras():
    """A row named twice adds the squares of its slices (Keras' TF backend squares IndexedSlices values)."""
    w = md.Variable(np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5)
    opt = O.ScheduleFreeAdamW(0.1, warmup_steps=2)
    values = np.array([[1., 2., 3.], [0.5, -1., 2.], [4., 0., -2.]], np.float32)
    for _ in range(3):
        opt.apply_gradients([(md.IndexedSlices(values, np.array([1, 1, 3]), (4, 3)), w)])
    np.testing.assert_allclose(w.numpy(), DATA["sparse|w"], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(opt.get_slot(w, "momentum").numpy(), DATA["sparse|momentum"], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(opt.get_slot(w, "velocity").numpy(), DATA["sparse|velocity"], rtol=2e-6)


@pytest.mark.parametrize("make, match", [
    (lambda: O.ScheduleFreeAdamW(beta_1=0.0), "beta_1"),
    (lambda: O.ScheduleFreeAdamW(beta_1=1.5), "beta_1"),
    (lambda: O.ScheduleFreeAdamW(beta_2=1.0), "beta_2"),
    (lambda: O.ScheduleFreeAdamW(epsilon=-1e-8), "epsilon"),
    (lambda: O.ScheduleFreeAdamW(warmup_steps=-1), "warmup_steps"),
    (lambda: O.ScheduleFreeAdamW(warmup_steps="10"), "warmup_steps"),
    (lambda: O.ScheduleFreeAdamW(warmup_steps=float("inf")), "warmup_steps"),
    (lambda: O.ScheduleFreeAdamW(weight_decay=-0.1), "weight_decay"),
    (lambda: O.ScheduleFreeAdamW(clipnorm=1.0, clipvalue=1.0), "Only one of"),
    (lambda: O.ScheduleFreeAdamW(amsgrad=True), "not recognized"),
])
def test_bad_arguments_name_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_checkpoint_round_trip_continues_the_same_steps(tmp_path):
    name = "weight_decay clipnorm warmup"
    opt, w, b = _train(name, 2)
    path = md.train.Checkpoint(optimizer=opt, w=w, b=b).write(str(tmp_path / "ck"))
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w2 = md.Variable(np.zeros((3, 4), np.float32), name="w")
        b2 = md.Variable(np.zeros(4, np.float32), name="b")
        fresh = build(md.optimizers, *CONFIGS[name][:2])
        fresh.build([w2, b2])
    md.train.Checkpoint(optimizer=fresh, w=w2, b=b2).read(path).assert_consumed()
    for var, other in ((w, w2), (b, b2)):
        for slot in ("momentum", "velocity"):
            np.testing.assert_array_equal(fresh.get_slot(other, slot).numpy(), opt.get_slot(var, slot).numpy())
    assert int(fresh.iterations.numpy()) == 12
    # Both continue with the same gradients (the warmup long over, the weights' average at 1/13, 1/14, ...).
    g = [np.full((3, 4), 0.5, np.float32), np.full(4, -0.25, np.float32)]
    for optimizer, variables, run in ((opt, (w, b), opt._strategy.run), (fresh, (w2, b2), strategy.run)):
        for _ in range(2):
            run(lambda: optimizer.apply_gradients(zip(g, variables)))
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    np.testing.assert_array_equal(b2.numpy(), b.numpy())
