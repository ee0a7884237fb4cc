"""Lamb and Adafactor: Keras 3.15's defaults, slots (names, shapes, dtypes, checkpoint order) and results under
MirroredStrategy at 1, 2 and 4 replicas against tests/data/keras_lamb_adafactor.npz (recorded by
tests/data/record_keras_lamb_adafactor.py on record_keras_optimizers.py's model and gradients)."""

import json
import os

import numpy as np
import pytest

import mirrored as md
from test_optimizer_keras_parity import build

HERE = os.path.dirname(__file__)
DATA = np.load(os.path.join(HERE, "data", "keras_lamb_adafactor.npz"))
INPUTS = np.load(os.path.join(HERE, "data", "keras_optimizers.npz"))  # the same model and gradients
CONFIGS = json.loads(str(DATA["configs"]))
REPLICAS = (1, 2, 4)
O = md.optimizers


def _train(name, n, xp=np, devices=None):
    cls, kwargs, dtype = CONFIGS[name]
    strategy = md.MirroredStrategy(devices=devices or [f"/cpu:{i}" for i in range(n)])
    with strategy.scope():
        w = md.Variable(INPUTS["w0"].astype(dtype), name="w")
        b = md.Variable(INPUTS["b0"].astype(dtype), name="b")
        opt = build(md.optimizers, cls, kwargs)
    grads_w, grads_b = INPUTS["grads_w"].astype(dtype), INPUTS["grads_b"].astype(dtype)
    for s in range(grads_w.shape[0]):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(xp.asarray(grads_w[s, r]), w), (xp.asarray(grads_b[s, r]), b)])
        strategy.run(step)
    return opt, w, b


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_and_slots_match_keras(name, n):
    opt, w, b = _train(name, n)
    dtype = np.dtype(CONFIGS[name][2])
    # float32: the element-wise steps are Keras' own; the norms and means are sums in another order (an ulp),
    # which the trust ratio and the factored moments carry into every element, over 12 steps.
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for var, key in ((w, "w"), (b, "b")):
        expected = DATA[f"{name}|{n}|{key}"]
        first = np.asarray(var.values[0])
        np.testing.assert_allclose(first, expected, rtol=rtol, atol=rtol * 1e-1)
        assert all(np.array_equal(np.asarray(c), first) for c in var.values[1:])  # copies bit-identical
        for slot in ("momentum", "velocity", "r", "c"):
            recorded = f"{name}|{n}|{slot}_{key}"
            if recorded in DATA:
                value = np.asarray(opt.get_slot(var, slot).values[0])
                assert value.shape == DATA[recorded].shape and value.dtype == DATA[recorded].dtype
                np.testing.assert_allclose(value, DATA[recorded], rtol=rtol, atol=rtol * 1e-1)
        if f"{name}|{n}|average_{key}" in DATA:
            np.testing.assert_allclose(np.asarray(opt.get_slot(var, "average").values[0]),
                                       DATA[f"{name}|{n}|average_{key}"], rtol=rtol, atol=rtol * 1e-1)
    assert int(opt.iterations.numpy()) == DATA[f"{name}|{n}|iterations"]


@pytest.mark.parametrize("name", ["Lamb weight_decay clipnorm", "Adafactor weight_decay global_clipnorm"])
def test_cross_replica_apply_is_the_same_step(name):
    one, _, _ = _train(name, 2)
    cls, kwargs, dtype = CONFIGS[name]
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = md.Variable(INPUTS["w0"].astype(dtype), name="w")
        b = md.Variable(INPUTS["b0"].astype(dtype), name="b")
        opt = build(md.optimizers, cls, kwargs)
    grads = [INPUTS["grads_w"].astype(dtype), INPUTS["grads_b"].astype(dtype)]
    for s in range(grads[0].shape[0]):
        per_replica = [strategy.experimental_distribute_values_from_function(
            lambda ctx, g=g: g[s, ctx.replica_id_in_sync_group]) for g in grads]
        with strategy.scope():
            opt.apply_gradients(zip(per_replica, [w, b]))
    np.testing.assert_allclose(np.asarray(w.values[0]), DATA[f"{name}|2|w"], rtol=1e-5)
    assert int(opt.iterations.numpy()) == int(one.iterations.numpy())


def test_keras_defaults_and_slots():
    lamb = O.Lamb()
    assert (lamb.name, lamb.learning_rate, lamb.beta_1, lamb.beta_2, lamb.epsilon) == ("lamb", 0.001, 0.9, 0.999,
                                                                                       1e-7)
    ada = O.Adafactor()
    assert (ada.name, ada.learning_rate, ada.beta_2_decay, ada.epsilon_1, ada.epsilon_2, ada.clip_threshold,
            ada.relative_step) == ("adafactor", 0.001, -0.8, 1e-30, 1e-3, 1.0, True)
    w3 = md.Variable(np.ones((2, 3, 4), np.float32), name="w3")
    w, b = md.Variable(np.ones((3, 4), np.float32), name="w"), md.Variable(np.ones(4, np.float32), name="b")
    ada.build([w3, w, b])
    shapes = {(v.name, tuple(v.shape), np.dtype(v.dtype).name) for v in ada.variables}
    assert shapes == {("adafactor/iterations:0", (), "int64"),
                      ("w3/r:0", (2, 3), "float32"), ("w3/c:0", (2, 4), "float32"),
                      ("w3/velocity:0", (2, 3, 4), "float32"),
                      ("w/r:0", (3,), "float32"), ("w/c:0", (4,), "float32"), ("w/velocity:0", (3, 4), "float32"),
                      ("b/r:0", (), "int32"), ("b/c:0", (), "int32"), ("b/velocity:0", (4,), "float32")}
    # Keras' _variables order: each variable's r, c and velocity in turn (checkpoint keys _variables/2..).
    assert [(var.name, slot) for var, slot, _ in ada._keras_variables().values()] == [
        (v.name, s) for v in (w3, w, b) for s in ("r", "c", "velocity")]
    lamb.build([w, b])
    assert [(var.name, slot) for var, slot, _ in lamb._keras_variables().values()] == [
        (v.name, s) for v in (w, b) for s in ("momentum", "velocity")]


def test_adafactor_factors_the_last_two_axes_of_a_3d_variable():
    """One step on a (2, 3, 4) variable against the NumPy transcription of Keras' update_step."""
    rng = np.random.RandomState(3)
    w0, g = rng.randn(2, 3, 4).astype(np.float32), rng.randn(2, 3, 4).astype(np.float32)
    var = md.Variable(w0.copy())
    opt = O.Adafactor(learning_rate=0.5)
    opt.apply_gradients([(g, var)])
    one, step = np.float32(1), np.float32(1)
    rho = np.minimum(np.float32(0.5), one / np.sqrt(step))
    alpha = np.maximum(np.float32(1e-3), np.sqrt(np.mean(w0 * w0))) * rho
    reg = g * g + np.float32(1e-30)
    beta = one - step ** np.float32(-0.8)  # 0 at the first step: the moments are this step's means
    r = beta * 0 + (one - beta) * reg.mean(-1)
    c = beta * 0 + (one - beta) * reg.mean(-2)
    v = (r / r.mean(-1, keepdims=True))[..., None] * c[..., None, :]
    u = g / np.sqrt(v)
    u = u / np.maximum(one, np.sqrt(np.mean(u * u)) / np.float32(1.0))
    np.testing.assert_allclose(np.asarray(var.numpy()), w0 - alpha * u, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(opt.get_slot(var, "r").numpy()), r, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(opt.get_slot(var, "c").numpy()), c, rtol=1e-6)


def test_lamb_trust_ratio_is_one_for_a_zero_variable():
    var = md.Variable(np.zeros(3, np.float32))
    O.Lamb(learning_rate=0.1).apply_gradients([(np.array([1.0, -2.0, 0.0], np.float32), var)])
    # |w| = 0: ratio 1, the step is Adam's first (m_hat / (sqrt(v_hat) + eps) = sign(g) up to eps).
    np.testing.assert_allclose(np.asarray(var.numpy()), [-0.1, 0.1, 0.0], rtol=1e-5)


@pytest.mark.parametrize("make, match", [
    (lambda: O.Lamb(beta_1=1.0), "beta_1"),
    (lambda: O.Lamb(epsilon=-1.0), "epsilon"),
    (lambda: O.Adafactor(clip_threshold=0.0), "clip_threshold"),
    (lambda: O.Adafactor(epsilon_2=-1.0), "epsilon_2"),
    (lambda: O.Adafactor(beta_2_decay=float("nan")), "beta_2_decay"),
    (lambda: O.Lamb(amsgrad=True), "not recognized"),
])
def test_bad_arguments_name_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_checkpoint_round_trip(tmp_path):
    opt, w, b = _train("Adafactor", 2)
    path = md.train.Checkpoint(optimizer=opt, w=w, b=b).write(str(tmp_path / "ck"))
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w2 = md.Variable(np.zeros((3, 4), np.float32), name="w")
        b2 = md.Variable(np.zeros(4, np.float32), name="b")
        fresh = O.Adafactor(0.05)
        fresh.build([w2, b2])
    md.train.Checkpoint(optimizer=fresh, w=w2, b=b2).read(path).assert_consumed()
    for var, other in ((w, w2), (b, b2)):
        for slot in ("r", "c", "velocity"):
            np.testing.assert_array_equal(np.asarray(fresh.get_slot(other, slot).numpy()),
                                          np.asarray(opt.get_slot(var, slot).numpy()))
    assert int(fresh.iterations.numpy()) == 12


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Lamb weight_decay clipnorm", "Lamb use_ema accumulation", "Lamb float64",
                                  "Adafactor weight_decay global_clipnorm", "Adafactor use_ema accumulation"])
def test_gpu_replicas_match_keras_and_the_cpu_replicas(name):
    """On two (simulated) GPUs: Lamb's fused kernels, Adafactor's CuPy array operations variable by variable."""
    from gpu_env import cupy, gpu_pair

    with gpu_pair():
        _, w, b = _train(name, 2, cupy, ["/gpu:0", "/gpu:1"])
        on_gpu = [np.asarray(c.numpy()) for var in (w, b) for c in var.values]
    _, w, b = _train(name, 2)
    on_cpu = [np.asarray(c.numpy()) for var in (w, b) for c in var.values]
    for got, cpu, expected in zip(on_gpu, on_cpu, (DATA[f"{name}|2|w"],) * 2 + (DATA[f"{name}|2|b"],) * 2):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, cpu, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(on_gpu[0], on_gpu[1])  # the copies stay bit-identical
    np.testing.assert_array_equal(on_gpu[2], on_gpu[3])


@pytest.mark.parametrize("cls", ["Lamb", "Adafactor"])
def test_indexed_slices_square_slice_by_slice_as_keras(cls):
    """A row named twice adds the squares of its slices (Keras' TF backend squares IndexedSlices values)."""
    w = md.Variable(np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5)
    opt = getattr(O, cls)(0.1)
    values = np.array([[1., 2., 3.], [0.5, -1., 2.], [4., 0., -2.]], np.float32)
    for _ in range(3):
        opt.apply_gradients([(md.IndexedSlices(values, np.array([1, 1, 3]), (4, 3)), w)])
    np.testing.assert_allclose(np.asarray(w.numpy()), DATA[f"sparse|{cls}"], rtol=2e-6, atol=1e-7)
