"""Lamb on the fused host kernel (csrc/host/fused_update.cc over csrc/core/lamb.h) against its reference,
rules.lamb, bit for bit: both norms are added up in rules.variable_sum's order (lanes of 8192, groups of 64),
so every size around a lane block's edge, several variables in one table, weight decay on some, IndexedSlices'
squares and the in-process replicas' summed gradients give the reference's bits."""

import numpy as np
import pytest

from mirrored._core import fused_update
from mirrored.train.optimizers import rules

LANES = rules.SUM_LANES
SIZES = [0, 1, 7, LANES - 1, LANES, LANES + 1, 3 * LANES + 5]
SIZES_ALONE = [[n] for n in SIZES]


def coefficients(dtype, step=3, lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Lamb's scalars as the optimizer makes them (keras.py's Lamb._coefficients), in the dtype."""
    t = np.dtype(dtype).type
    return (t(1 - beta_1), t(1 - beta_2), t(lr), t(1) - t(beta_1) ** t(step), t(1) - t(beta_2) ** t(step),
            t(epsilon))


def _state(rng, dtype, sizes):
    weights = [rng.normal(size=n).astype(dtype) for n in sizes]
    slots = [[(rng.normal(size=n) * 0.1).astype(dtype), (np.abs(rng.normal(size=n)) * 0.01).astype(dtype)]
             for n in sizes]
    return weights, slots


def _reference(weights, grads, slots, decay, c, wd):
    for k, w in enumerate(weights):
        if decay[k]:
            rules.weight_decay(w, wd, c[2])
        rules.apply(rules.LAMB, w, grads[k], slots[k], c)


def _copy(weights, slots):
    return [w.copy() for w in weights], [[s.copy() for s in ss] for ss in slots]


def _assert_same(weights, slots, ref_w, ref_s, what=""):
    for k in range(len(weights)):
        np.testing.assert_array_equal(weights[k], ref_w[k], err_msg=f"{what} weight {k} ({weights[k].size})")
        for j in range(2):
            np.testing.assert_array_equal(slots[k][j], ref_s[k][j], err_msg=f"{what} slot {j} of {k}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sizes", SIZES_ALONE + [SIZES, [5, 0, LANES + 3, 64, 65]],
                         ids=lambda sizes: "+".join(map(str, sizes)))
def test_host_kernel_equals_the_reference_bit_for_bit(sizes, dtype):
    """Three steps; weight decay on every other variable (Keras decays first: the norm is the decayed w's)."""
    rng = np.random.default_rng(len(sizes) * 7 + sizes[0])
    weights, slots = _state(rng, dtype, sizes)
    ref_w, ref_s = _copy(weights, slots)
    decay = [k % 2 == 1 or len(sizes) == 1 for k in range(len(sizes))]
    wd = np.dtype(dtype).type(0.05)
    for step in range(1, 4):
        c = coefficients(dtype, step)
        grads = [rng.normal(size=n).astype(dtype) for n in sizes]
        fused_update(rules.LAMB, weights, grads, slots, decay, [float(x) for x in c], float(wd), float(c[2]))
        _reference(ref_w, grads, ref_s, decay, c, wd)
    _assert_same(weights, slots, ref_w, ref_s)


def test_the_norms_are_added_in_variable_sum_order_not_numpy_s():
    """The test above can tell the order: with NumPy's own (pairwise) sum the reference's bits differ."""
    rng = np.random.default_rng(5)
    n = 3 * LANES + 5
    weights, slots = _state(rng, np.float32, [n])
    ref_w, ref_s = _copy(weights, slots)
    c = coefficients(np.float32)
    grads = [rng.normal(size=n).astype(np.float32)]
    fused_update(rules.LAMB, weights, grads, slots, [False], [float(x) for x in c], 0.0, float(c[2]))
    _reference(ref_w, grads, ref_s, [False], c, 0.0)
    _assert_same(weights, slots, ref_w, ref_s)
    w = ref_w[0] * ref_w[0]
    assert rules.variable_sum(w) != np.sum(w)  # (the data tells the two orders apart)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_norms_give_a_ratio_of_one(dtype):
    """|w| = 0 (a zero variable) or |update| = 0 (no gradient, no moments yet): the plain Adam step, ratio 1."""
    c = coefficients(dtype, 1, lr=0.1)
    weights = [np.zeros(5, dtype), np.full(4, 0.5, dtype)]
    slots = [[np.zeros(5, dtype), np.zeros(5, dtype)], [np.zeros(4, dtype), np.zeros(4, dtype)]]
    ref_w, ref_s = _copy(weights, slots)
    grads = [np.array([1, -2, 0, 3, -0.5], dtype), np.zeros(4, dtype)]
    fused_update(rules.LAMB, weights, grads, slots, [False, False], [float(x) for x in c], 0.0, float(c[2]))
    _reference(ref_w, grads, ref_s, [False, False], c, 0.0)
    _assert_same(weights, slots, ref_w, ref_s)
    np.testing.assert_allclose(weights[0], [-0.1, 0.1, 0, -0.1, 0.1], rtol=1e-5)
    np.testing.assert_array_equal(weights[1], 0.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squares_take_the_place_of_g_squared(dtype):
    """IndexedSlices' SquaredGradient: the velocity takes the rows' squares added up, not the sum squared."""
    rng = np.random.default_rng(3)
    sizes = [LANES + 9, 12, 7]
    weights, slots = _state(rng, dtype, sizes)
    ref_w, ref_s = _copy(weights, slots)
    c = coefficients(dtype)
    a = [rng.normal(size=n).astype(dtype) for n in sizes]
    b = [rng.normal(size=n).astype(dtype) for n in sizes]
    grads = [x + y for x, y in zip(a, b)]
    squares = [a[0] * a[0] + b[0] * b[0], None, a[2] * a[2] + b[2] * b[2]]
    decay = [True, False, True]
    fused_update(rules.LAMB, weights, grads, slots, decay, [float(x) for x in c], 0.01, float(c[2]), squares)
    given = [rules.SquaredGradient(g, s) if s is not None else g for g, s in zip(grads, squares)]
    _reference(ref_w, given, ref_s, decay, c, np.dtype(dtype).type(0.01))
    _assert_same(weights, slots, ref_w, ref_s)
    plain_w, plain_s = _copy(*_state(np.random.default_rng(3), dtype, sizes))
    _reference(plain_w, grads, plain_s, decay, c, np.dtype(dtype).type(0.01))
    assert not np.array_equal(plain_s[0][1], ref_s[0][1])  # (the squares did change the velocity)


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_summed_variant_equals_the_reference_on_the_sum(replicas, dtype):
    """The in-process replicas' update (a tuple of gradient lists): their sum in replica order, then Lamb;
    sizes that cross the kernel's sum blocks (8 KiB) and lane blocks."""
    rng = np.random.default_rng(replicas)
    sizes = [1, 2047, 2049, LANES + 1, 3 * LANES + 5, 0]
    weights, slots = _state(rng, dtype, sizes)
    ref_w, ref_s = _copy(weights, slots)
    decay = [k % 2 == 0 for k in range(len(sizes))]
    wd = np.dtype(dtype).type(0.1)
    for step in range(1, 3):
        c = coefficients(dtype, step)
        per_replica = [[rng.normal(size=n).astype(dtype) for n in sizes] for _ in range(replicas)]
        total = [_in_order([g[k] for g in per_replica]) for k in range(len(sizes))]
        fused_update(rules.LAMB, weights, tuple(per_replica), slots, decay, [float(x) for x in c], float(wd),
                     float(c[2]))
        _reference(ref_w, total, ref_s, decay, c, wd)
    _assert_same(weights, slots, ref_w, ref_s)


def _in_order(gradients):
    """((g0 + g1) + g2) + ...: the host all-reduce's order."""
    total = gradients[0] + gradients[1]
    for g in gradients[2:]:
        total = total + g
    return total


def test_lamb_tables_are_refused_with_the_argument_named():
    w, g = np.zeros(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="coefficients: 4 given, the rule takes 6"):
        fused_update(rules.LAMB, [w], [g], [[w.copy(), w.copy()]], [False], [0.1, 0.1, 0.1, 0.1], 0.0, 0.0)
    with pytest.raises(ValueError, match=r"slots\[0\]: 1 slots, the rule has 2"):
        fused_update(rules.LAMB, [w], [g], [[w.copy()]], [False], [0.1] * 6, 0.0, 0.0)
