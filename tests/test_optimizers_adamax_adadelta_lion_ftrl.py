"""Adamax, Adadelta, Lion and Ftrl: Keras 3.15's defaults, slots and argument checks. (Their results against
Keras are in tests/test_optimizer_keras_parity.py, their kernels against the reference rules in
tests/test_fused_update.py, their checkpoints in tests/test_checkpoint_keras_optimizer.py.)"""

import numpy as np
import pytest

import mirrored as md

O = md.optimizers


@pytest.mark.parametrize("cls, defaults, slots", [
    (O.Adamax, {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}, ("momentum", "norm")),
    (O.Adadelta, {"learning_rate": 0.001, "rho": 0.95, "epsilon": 1e-7}, ("accumulated_grad", "accumulated_delta_var")),
    (O.Lion, {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.99}, ("momentum",)),
    (O.Ftrl, {"learning_rate": 0.001, "learning_rate_power": -0.5, "initial_accumulator_value": 0.1,
              "l1_regularization_strength": 0.0, "l2_regularization_strength": 0.0,
              "l2_shrinkage_regularization_strength": 0.0, "beta": 0.0}, ("accumulator", "linear")),
])
def test_keras_defaults_and_slots(cls, defaults, slots):
    opt = cls()
    for name, value in defaults.items():
        assert getattr(opt, name) == value, name
    assert opt.name == cls.__name__.lower()  # Keras 3's default names
    var = md.Variable(np.ones((2, 3), np.float32))
    opt.build([var])
    assert tuple(name for name, _ in opt._slot_specs) == slots
    start = np.float32(0.1) if cls is O.Ftrl else np.float32(0.0)  # Ftrl's accumulator starts at its initial value
    np.testing.assert_array_equal(np.asarray(opt.get_slot(var, slots[0]).numpy()), np.full((2, 3), start))


@pytest.mark.parametrize("make, match", [
    (lambda: O.Lion(beta_1=0.0), "beta_1.*degenerates to SignSGD"),
    (lambda: O.Lion(beta_1=1.5), "beta_1.*degenerates to SignSGD"),
    (lambda: O.Lion(beta_2=-0.1), "beta_2"),
    (lambda: O.Ftrl(learning_rate_power=0.5), "learning_rate_power"),
    (lambda: O.Ftrl(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    (lambda: O.Ftrl(l1_regularization_strength=-0.1), "l1_regularization_strength"),
    (lambda: O.Ftrl(l2_regularization_strength=-0.1), "l2_regularization_strength"),
    (lambda: O.Ftrl(l2_shrinkage_regularization_strength=-0.1), "l2_shrinkage_regularization_strength"),
    (lambda: O.Ftrl(beta="x"), "beta"),
    (lambda: O.Adamax(beta_1=1.0), "beta_1"),
    (lambda: O.Adamax(epsilon=-1.0), "epsilon"),
    (lambda: O.Adadelta(rho=2.0), "rho"),
    (lambda: O.Adadelta(learning_rate="fast"), "learning_rate"),
    (lambda: O.Lion(no_such=1), "not recognized"),
])
def test_bad_arguments_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("cls", [O.Adamax, O.Adadelta, O.Lion, O.Ftrl])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_scalar_and_tail_shapes_step_like_the_reference_rule(cls, dtype):
    """Variables of shapes (), (7,), (33,), (5, 3) (tails off the vector width) in one fused step per dtype give
    the reference rule's bits (md.optimizers.rules, applied variable by variable)."""
    rng = np.random.default_rng(3)
    shapes = [(), (7,), (33,), (5, 3)]
    start = [rng.normal(size=s).astype(dtype) for s in shapes]
    variables = [md.Variable(w.copy()) for w in start]
    opt = cls(learning_rate=0.05, weight_decay=0.01)
    expected = [w.copy() for w in start]
    # (Keras' Constant initializer casts through float32, as the optimizer does.)
    slots = [[np.full(s, np.float32(value), dtype) for _, value in opt._slot_specs] for s in shapes]
    t = np.dtype(dtype).type
    for step in range(3):
        grads = [rng.normal(size=s).astype(dtype) for s in shapes]
        opt.apply_gradients(zip(grads, variables))
        lr = t(np.float32(0.05))
        c = opt._coefficients(t, lr, step)
        for w, g, ss in zip(expected, grads, slots):
            w_arr, g_arr = np.atleast_1d(w), np.atleast_1d(g)
            ss_arr = [np.atleast_1d(s) for s in ss]
            O.rules.weight_decay(w_arr, t(np.float32(0.01)), lr)
            O.rules.apply(opt._rule, w_arr, g_arr, ss_arr, c)
            w[...] = w_arr.reshape(w.shape)
            for s, a in zip(ss, ss_arr):
                s[...] = a.reshape(s.shape)
    for var, w in zip(variables, expected):
        assert np.asarray(var.numpy()).dtype == dtype
        np.testing.assert_array_equal(np.asarray(var.numpy()), w)
