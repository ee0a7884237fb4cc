"""The fused host kernel (csrc/host/fused_update.cc) against its reference, rules.py, bit for bit.

Every rule and variant, float32 and float64, sizes with every vector tail, weight decay on and
off, many variables in one table: the kernel's results must equal the NumPy reference exactly
(both are Keras' element-wise sequences, every operation rounded on its own).
"""

import numpy as np
import pytest

from mirrored._core import fused_update
from mirrored.train.optimizers import rules

RNG = np.random.default_rng(11)

# rule, coefficients (as optimizers compute them: already in the dtype), number of slots
CASES = {
    "sgd": (rules.SGD, (0.01,), 0),
    "sgd_momentum": (rules.SGD_MOMENTUM, (0.01, 0.9), 1),
    "sgd_nesterov": (rules.SGD_NESTEROV, (0.01, 0.9), 1),
    "adam": (rules.ADAM, (0.1, 0.001, 0.0031, 1e-7), 2),
    "rmsprop": (rules.RMSPROP, (0.01, 0.9, 0.1, 1e-7, 0.0, 0.0), 1),
    "rmsprop_momentum": (rules.RMSPROP, (0.01, 0.9, 0.1, 1e-7, 0.5, 0.0), 2),
    "rmsprop_centered": (rules.RMSPROP, (0.01, 0.9, 0.1, 1e-7, 0.0, 1.0), 2),
    "rmsprop_centered_momentum": (rules.RMSPROP, (0.01, 0.9, 0.1, 1e-7, 0.5, 1.0), 3),
    "adagrad": (rules.ADAGRAD, (0.1, 1e-7), 1),
    "nadam": (rules.NADAM, (0.001, 1e-7, 0.1, 0.001, 0.45, 0.8, 0.55, 0.6, 0.002), 2),
    # beta_2 far from 1: the velocity falls below velocity_hat on some elements and rises above on others
    "adam_amsgrad": (rules.ADAM_AMSGRAD, (0.1, 0.5, 0.0031, 1e-7), 3),
    "ema": (rules.EMA, (0.99, 1 - 0.99), 0),
    "adamax": (rules.ADAMAX, (0.1, 0.95, 0.01, 0.19, 1e-7), 2),
    "adadelta": (rules.ADADELTA, (1.0, 0.95, 0.05, 1e-6), 2),
    "lion": (rules.LION, (0.01, 0.9, 0.1, 0.99, 0.01), 1),
    "ftrl": (rules.FTRL, (0.1, 0.5, 0.06, 0.5, 0.01), 2),
    "ftrl_power": (rules.FTRL, (0.05, 0.3, 0.0, 0.0, 0.5), 2),
    # lr, 1-beta_2, 1-beta_2^t, epsilon, 1-beta_1, beta_1, 1-1/t, 1/t (step 3); slots momentum (z), velocity
    "schedule_free_adamw": (rules.SCHEDULE_FREE_ADAMW, (0.01, 0.001, 0.002997, 1e-8, 0.1, 0.9, 2 / 3, 1 / 3), 2),
    # Muon's momentum and its Newton-Schulz input (written over the "weight"), Nesterov or not
    "muon_momentum": (rules.MUON, (0.95 - 1, 0.95, 1.0), 1),
    "muon_momentum_plain": (rules.MUON, (0.9 - 1, 0.9, 0.0), 1),
}
SIZES = [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1000, 4099]


def _tables(dtype, n_slots, sizes):
    weights = [RNG.normal(size=s).astype(dtype) for s in sizes]
    grads = [RNG.normal(size=s).astype(dtype) for s in sizes]
    # Slots start positive, as after a few steps; the first (a velocity, an accumulator) above 1 and the
    # others below 0.1, so that a centered RMSprop's velocity stays above its squared average gradient.
    slots = [[(np.abs(RNG.normal(size=s)) * 0.1 + (1.0 if j == 0 else 0.0)).astype(dtype) for j in range(n_slots)]
             for s in sizes]
    return weights, grads, slots


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_the_reference_bit_for_bit(case, dtype):
    rule, coefficients, n_slots = CASES[case]
    t = np.dtype(dtype).type
    c = tuple(t(x) for x in coefficients)
    weights, grads, slots = _tables(dtype, n_slots, SIZES)
    decay = [k % 2 == 0 for k in range(len(SIZES))]
    wd, lr = t(0.004), t(c[0])
    ref_w, ref_s = [w.copy() for w in weights], [[s.copy() for s in ss] for ss in slots]
    for k in range(len(SIZES)):
        if decay[k]:
            rules.weight_decay(ref_w[k], wd, lr)
        rules.apply(rule, ref_w[k], grads[k], ref_s[k], c)
    fused_update(rule, weights, grads, slots, decay, [float(x) for x in c], float(wd), float(lr))
    for k in range(len(SIZES)):
        np.testing.assert_array_equal(weights[k], ref_w[k], err_msg=f"{case} weight {k} (size {SIZES[k]})")
        for j in range(n_slots):
            np.testing.assert_array_equal(slots[k][j], ref_s[k][j], err_msg=f"{case} slot {j} of {k}")


@pytest.mark.parametrize("case", ["adam", "nadam", "rmsprop_centered_momentum", "adam_amsgrad", "schedule_free_adamw"])
def test_several_steps_stay_bit_identical(case):
    rule, coefficients, n_slots = CASES[case]
    c = tuple(np.float32(x) for x in coefficients)
    weights, _, slots = _tables(np.float32, n_slots, [5, 130])
    ref_w, ref_s = [w.copy() for w in weights], [[s.copy() for s in ss] for ss in slots]
    for _ in range(5):
        grads = [RNG.normal(size=w.shape).astype(np.float32) for w in weights]
        fused_update(rule, weights, grads, slots, [False, False], [float(x) for x in c], 0.0, 0.0)
        for k in range(2):
            rules.apply(rule, ref_w[k], grads[k], ref_s[k], c)
    for k in range(2):
        np.testing.assert_array_equal(weights[k], ref_w[k])


def test_bad_tables_are_refused_with_the_argument_named():
    w, g = np.zeros(4, np.float32), np.ones(4, np.float32)
    m = np.zeros(4, np.float32)
    args = dict(decay=[False], coefficients=[0.1, 0.9], weight_decay=0.0, lr=0.0)
    with pytest.raises(ValueError, match=r"grads\[0\]: dtype float64"):
        fused_update(rules.SGD_MOMENTUM, [w], [g.astype(np.float64)], [[m]], **args)
    with pytest.raises(ValueError, match=r"grads\[0\]: expected a C-contiguous"):
        fused_update(rules.SGD_MOMENTUM, [w], [np.ones(8, np.float32)[::2]], [[m]], **args)
    with pytest.raises(ValueError, match=r"slots\[0\]\[0\]: 3 elements, the variable has 4"):
        fused_update(rules.SGD_MOMENTUM, [w], [g], [[np.zeros(3, np.float32)]], **args)
    with pytest.raises(ValueError, match=r"slots\[0\]: 0 slots, the rule has 1"):
        fused_update(rules.SGD_MOMENTUM, [w], [g], [[]], **args)
    with pytest.raises(ValueError, match="coefficients: 1 given, the rule takes 2"):
        fused_update(rules.SGD_MOMENTUM, [w], [g], [[m]], [False], [0.1], 0.0, 0.0)
    unknown = len(rules.RULES)  # (the first code past the rules)
    with pytest.raises(ValueError, match=f"rule={unknown}: no such rule"):
        fused_update(unknown, [w], [g], [[m]], **args)
    with pytest.raises(ValueError, match="rule=-1: no such rule"):
        fused_update(-1, [w], [g], [[m]], **args)
    with pytest.raises(ValueError, match="float32 and float64"):
        fused_update(rules.SGD, [w.astype(np.float16)], [g.astype(np.float16)], [[]], [False], [0.1], 0.0, 0.0)
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fused_update(rules.SGD, [read_only], [g], [[]], [False], [0.1], 0.0, 0.0)
    np.testing.assert_array_equal(w, 0)  # nothing was applied


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_amsgrad_keeps_the_largest_velocity_and_propagates_nan_as_tf_maximum(dtype):
    """velocity_hat = maximum(velocity_hat, velocity) after the velocity's update, then the step divides by
    its root; a NaN on either side propagates (tf.maximum and np.maximum do)."""
    t = np.dtype(dtype).type
    w = np.ones(5, dtype)
    g = np.array([0.0, 2.0, 0.0, np.nan, 1.0], dtype)
    m = np.zeros(5, dtype)
    v = np.array([4.0, 0.0, 1.0, 0.0, 1.0], dtype)
    v_hat = np.array([16.0, 0.0, np.nan, 0.0, 0.5], dtype)
    c = [0.5, 0.5, 1.0, 0.0]  # 1 - beta_1, 1 - beta_2, alpha, epsilon
    fused_update(rules.ADAM_AMSGRAD, [w], [g], [[m, v, v_hat]], [False], c, 0.0, 0.0)
    np.testing.assert_array_equal(v, [2.0, 2.0, 0.5, np.nan, 1.0])
    np.testing.assert_array_equal(v_hat, [16.0, 2.0, np.nan, np.nan, 1.0])
    np.testing.assert_array_equal(m, [0.0, 1.0, 0.0, np.nan, 0.5])
    np.testing.assert_array_equal(w, [1.0, t(1) - t(1) / np.sqrt(t(2)), np.nan, np.nan, 0.5])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lion_sign_of_signed_zeros_and_nan_is_tf_signs_in_vector_loops(dtype):
    """Lion steps by sign(m * beta_1 + g * (1 - beta_1)) as tf.sign: +0 for a zero of either sign (tf.sign(-0.0)
    is 0.0; seen on a -0 weight, which -0 - (+0 * lr) leaves -0 where a -0 step would make it +0) and NaN for a
    NaN. 41 elements mix the cases so the vector body and its tail both meet each; the bits (zero signs
    included) equal the reference rule's."""
    t = np.dtype(dtype).type
    m0 = np.array([-0.0, 0.0, 1.0, -1.0, 0.0, 2.0, -0.0], dtype)
    g0 = np.array([-0.0, 0.0, 3.0, -3.0, np.nan, -30.0, 0.5], dtype)
    m, g = np.resize(m0, 41), np.resize(g0, 41)
    w = np.full(41, -0.0, dtype)
    c = tuple(t(x) for x in (0.25, 0.9, 0.1, 0.99, 0.01))
    ref_w, ref_m = w.copy(), m.copy()
    rules.apply(rules.LION, ref_w, g, [ref_m], c)
    fused_update(rules.LION, [w], [g], [[m]], [False], [float(x) for x in c], 0.0, 0.0)
    bits = np.uint32 if dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(w.view(bits), ref_w.view(bits))
    np.testing.assert_array_equal(m.view(bits), ref_m.view(bits))
    step = np.resize(np.array([-0.0, -0.0, -0.25, 0.25, np.nan, 0.25, -0.25], dtype), 41)
    np.testing.assert_array_equal(w, step)
    np.testing.assert_array_equal(np.signbit(w), np.signbit(step))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_arrays_with_an_equal_dtype_of_their_own_are_taken(dtype):
    """An unpickled array (a parameter server's, multiprocessing's) has a dtype object equal to, not the same
    as, NumPy's own; the kernel takes it. A non-native byte order is refused with the argument named."""
    import pickle
    w, g = pickle.loads(pickle.dumps(np.zeros(4, dtype))), pickle.loads(pickle.dumps(np.ones(4, dtype)))
    assert w.dtype is not np.dtype(dtype) and w.dtype == np.dtype(dtype)
    fused_update(rules.SGD, [w], [g], [[]], [False], [0.5], 0.0, 0.0)
    np.testing.assert_array_equal(w, -0.5)
    swapped = np.ones(4, np.dtype(dtype).newbyteorder())
    with pytest.raises(ValueError, match=r"grads\[0\]: dtype"):
        fused_update(rules.SGD, [w], [swapped], [[]], [False], [0.5], 0.0, 0.0)
    np.testing.assert_array_equal(w, -0.5)
