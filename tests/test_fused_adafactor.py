"""Adafactor's fused host kernel (csrc/host/fused_adafactor.cc) against its reference, rules.adafactor, bit for bit.

Variables of every rank Keras factors or not, several in one table, weight decay on and off, IndexedSlices'
squares, and the summed-gradient variant of 2 to 4 in-process replicas; the reference's row, column and RMS sums in
the kernels' orders; bad slots refused with the argument named; and md.optimizers.Adafactor on the fused path
(one kernel call per dtype, no per-variable array operations).
"""

import numpy as np
import pytest

import mirrored as md
from mirrored._core import fused_update
from mirrored.train.optimizers import base, rules

SHAPES = [(), (5,), (8193,), (3, 4), (2, 3, 4), (1, 1), (130, 70), (4, 1, 9), (0, 5), (5, 0)]
# rho_t, epsilon_2, epsilon_1, beta_2_t, 1 - beta_2_t, clip_threshold: a step early on (beta_2_t far from 1),
# and a threshold the update's RMS passes, so the clip divides
COEFFICIENTS = (0.01, 1e-3, 1e-30, 0.2, 0.8, 0.5)


def _variables(dtype, shapes, seed):
    """Weights, gradients and Keras' slots (r, c, velocity; int32 placeholders as r and c below 2 dims), with
    values over several binades, so that another order of a sum rounds differently."""
    rng = np.random.default_rng(seed)

    def values(shape, positive=False):
        x = rng.standard_normal(shape) * 2.0 ** rng.integers(-4, 4, shape)
        return np.asarray(np.abs(x) if positive else x, dtype)

    weights = [values(s) for s in shapes]
    grads = [values(s) for s in shapes]
    slots = [[values(s[:-1], True), values(s[:-2] + s[-1:], True), values(s, True)] if len(s) >= 2 else
             [np.zeros((), np.int32), np.zeros((), np.int32), values(s, True)] for s in shapes]
    return weights, grads, slots


def _reference(weights, grads, slots, decay, c, wd, lr):
    for k in range(len(weights)):
        if decay[k]:
            rules.weight_decay(weights[k], wd, lr)
        rules.apply(rules.ADAFACTOR, weights[k], grads[k], slots[k], c)


def _copies(weights, slots):
    return [w.copy() for w in weights], [[s.copy() for s in ss] for ss in slots]


def _assert_same_bits(weights, slots, ref_weights, ref_slots, shapes):
    for k, shape in enumerate(shapes):
        assert weights[k].tobytes() == ref_weights[k].tobytes(), f"weight {k} {shape}"
        for j in range(3):
            assert slots[k][j].tobytes() == ref_slots[k][j].tobytes(), f"slot {j} of {k} {shape}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_equals_the_reference_bit_for_bit_over_three_steps(dtype):
    t = np.dtype(dtype).type
    c = tuple(t(x) for x in COEFFICIENTS)
    wd, lr = t(0.004), t(0.01)
    weights, _, slots = _variables(dtype, SHAPES, 1)
    decay = [k % 2 == 0 for k in range(len(SHAPES))]
    ref_weights, ref_slots = _copies(weights, slots)
    for step in range(3):
        _, grads, _ = _variables(dtype, SHAPES, 10 + step)
        _reference(ref_weights, grads, ref_slots, decay, c, wd, lr)
        fused_update(rules.ADAFACTOR, weights, grads, slots, decay, [float(x) for x in c], float(wd), float(lr))
        _assert_same_bits(weights, slots, ref_weights, ref_slots, SHAPES)
    # (the variables moved: the test compares updates, not untouched buffers)
    assert not np.array_equal(weights[6], _variables(dtype, SHAPES, 1)[0][6])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squares_replace_g_times_g(dtype):
    """An IndexedSlices gradient's squares (rows squared slice by slice, then added) in place of g * g."""
    t = np.dtype(dtype).type
    c = tuple(t(x) for x in COEFFICIENTS)
    shapes = [(6, 3), (7,), (2, 4, 3)]
    weights, grads, slots = _variables(dtype, shapes, 2)
    squares = [g * g * t(1.5) for g in grads]  # (not g * g: a kernel that squares would differ)
    squares[1] = None  # a dense gradient beside them: squared by the kernel
    ref_weights, ref_slots = _copies(weights, slots)
    for k in range(len(shapes)):
        g = grads[k] if squares[k] is None else rules.SquaredGradient(grads[k], squares[k])
        rules.apply(rules.ADAFACTOR, ref_weights[k], g, ref_slots[k], c)
    fused_update(rules.ADAFACTOR, weights, grads, slots, [False] * 3, [float(x) for x in c], 0.0, 0.0, squares)
    _assert_same_bits(weights, slots, ref_weights, ref_slots, shapes)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_summed_variant_equals_the_reference_on_the_sum_in_replica_order(replicas):
    c = tuple(np.float32(x) for x in COEFFICIENTS)
    wd, lr = np.float32(0.004), np.float32(0.01)
    weights, _, slots = _variables(np.float32, SHAPES, 3)
    decay = [k % 3 == 0 for k in range(len(SHAPES))]
    per_replica = [_variables(np.float32, SHAPES, 20 + r)[1] for r in range(replicas)]
    summed = [g.copy() for g in per_replica[0]]
    for r in range(1, replicas):  # ((g0 + g1) + g2) + ...: the host all-reduce's order
        for k in range(len(SHAPES)):
            summed[k] = summed[k] + per_replica[r][k]
    ref_weights, ref_slots = _copies(weights, slots)
    _reference(ref_weights, summed, ref_slots, decay, c, wd, lr)
    fused_update(rules.ADAFACTOR, weights, tuple(per_replica), slots, decay, [float(x) for x in c], float(wd),
                 float(lr))
    _assert_same_bits(weights, slots, ref_weights, ref_slots, SHAPES)


def test_packed_gradients_are_read_in_table_order():
    c = [float(np.float32(x)) for x in COEFFICIENTS]
    weights, grads, slots = _variables(np.float32, SHAPES, 4)
    ref_weights, ref_slots = _copies(weights, slots)
    fused_update(rules.ADAFACTOR, ref_weights, grads, ref_slots, [False] * len(SHAPES), c, 0.0, 0.0)
    fused_update(rules.ADAFACTOR, weights, np.concatenate([g.reshape(-1) for g in grads]), slots,
                 [False] * len(SHAPES), c, 0.0, 0.0)
    _assert_same_bits(weights, slots, ref_weights, ref_slots, SHAPES)


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_references_means_add_in_index_order(axis, dtype):
    """rules._sequential_mean, the row and column means' order, against the same sum written element by element
    (NumPy's mean over the last axis adds pairwise: another order, other bits)."""
    rng = np.random.default_rng(5)
    x = np.asarray((rng.standard_normal((3, 200, 300)) * 2.0 ** rng.integers(-8, 8, (3, 200, 300))) ** 2, dtype)
    moved = np.moveaxis(x, axis, 0)
    total = moved[0].copy()
    for i in range(1, moved.shape[0]):
        total = np.asarray(total + moved[i], dtype)
    expected = total / dtype(moved.shape[0])
    got = rules._sequential_mean(x, axis)
    assert got.dtype == dtype and got.tobytes() == expected.tobytes()
    if axis == -1:  # (over axis -2 NumPy's reduction already adds row after row)
        assert got.tobytes() != np.mean(x, axis=axis, dtype=dtype).tobytes()


def test_bad_slots_are_refused_naming_the_argument():
    c = [1e-2, 1e-3, 1e-30, 0.2, 0.8, 1.0]
    w, g = np.zeros((3, 4, 5), np.float32), np.ones((3, 4, 5), np.float32)
    good = [np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32), np.zeros((3, 4, 5), np.float32)]
    for j, wrong in [(0, np.zeros((3, 5), np.float32)), (1, np.zeros((4, 5), np.float32)),
                     (2, np.zeros((3, 4), np.float32))]:
        slots = list(good)
        slots[j] = wrong
        with pytest.raises(ValueError, match=rf"slots\[0\]\[{j}\]: \d+ elements, Adafactor's .* of a \(3, 4, 5\) "
                                             r"variable has \d+"):
            fused_update(rules.ADAFACTOR, [w], [g], [slots], [False], c, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"slots\[0\]\[0\]: dtype float64, expected float32"):
        fused_update(rules.ADAFACTOR, [w], [g], [[good[0].astype(np.float64)] + good[1:]], [False], c, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"slots\[0\]: 2 slots, the rule has 3"):
        fused_update(rules.ADAFACTOR, [w], [g], [good[:2]], [False], c, 0.0, 0.0)
    with pytest.raises(ValueError, match="coefficients: 5 given, the rule takes 6"):
        fused_update(rules.ADAFACTOR, [w], [g], [good], [False], c[:5], 0.0, 0.0)
    # A variable of fewer than 2 dims: its r and c are placeholders, never read or written.
    v = np.zeros((), np.float32)
    placeholders = [np.full((), 7, np.int32), np.full((), 9, np.int32), np.ones((), np.float32)]
    fused_update(rules.ADAFACTOR, [v], [np.full((), 3, np.float32)], [placeholders], [False], c, 0.0, 0.0)
    assert placeholders[0] == 7 and placeholders[1] == 9 and placeholders[2] != 1


def test_apply_gradients_runs_one_kernel_call_per_dtype_and_no_per_variable_rule(monkeypatch):
    """md.optimizers.Adafactor takes the fused path: 20 variables of two dtypes, one kernel call each, and the
    same bits as the reference variable by variable."""
    shapes = [(4, 3) if k % 2 else (5,) for k in range(20)]
    dtypes = [np.float32 if k < 12 else np.float64 for k in range(20)]
    rng = np.random.default_rng(6)
    initial = [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]
    grads = [[rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)] for _ in range(3)]

    def run(fused):
        variables = [md.Variable(x.copy()) for x in initial]
        opt = md.optimizers.Adafactor(0.05, weight_decay=0.01)
        calls = []
        if fused:
            monkeypatch.setattr(base, "_host_kernel", lambda *a, **k: (calls.append(a[0]), fused_update(*a, **k)))
        else:
            monkeypatch.setattr(base, "PER_VARIABLE", frozenset((rules.LAMB, rules.ADAFACTOR)))
        for step in grads:
            opt.apply_gradients(zip(step, variables))
        monkeypatch.undo()
        return [np.asarray(v.numpy()) for v in variables], calls

    fused, calls = run(True)
    assert calls == [rules.ADAFACTOR] * 6  # 3 steps, 2 dtypes
    per_variable, none = run(False)
    assert none == []
    for got, expected in zip(fused, per_variable):
        assert got.tobytes() == expected.tobytes()


def train(make_strategy, fused, monkeypatch, steps=4, **kwargs):
    """``steps`` steps of Adafactor (options ``kwargs``) in ``make_strategy()``'s replicas, on the fused path or
    variable by variable (``fused=False``: the reference, rules.adafactor, on each variable); every copy of the
    variables and the optimizer's variables. One variable has a constraint (Keras applies it after the update).
    Checks that the path taken is the one asked for."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(base, "PER_VARIABLE", frozenset((rules.LAMB, rules.ADAFACTOR)))
        strategy = make_strategy()
        shapes = [(6, 5), (7,), (2, 3, 4), ()]
        with strategy.scope():
            ws = [md.Variable(np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) + k / 10,
                              constraint=(lambda x: x * 0.5) if k == 2 else None)
                  for k, s in enumerate(shapes)]
            opt = md.optimizers.Adafactor(0.05, weight_decay=0.01, **kwargs)
        devices = strategy.extended.worker_devices
        rng = np.random.default_rng(8)

        def step(grads):
            opt.apply_gradients(zip(grads, ws))

        for _ in range(steps):
            grads = [md.PerReplica([md.device_util.place(rng.standard_normal(s).astype(np.float32), d)
                                    for d in devices], devices) for s in shapes]
            strategy.run(step, args=(grads,))
        assert [plan.packable for plan in opt._plans.values()] == [fused]
        return [np.asarray(c.numpy()) for v in ws + list(opt.variables)
                for c in (v.values if hasattr(v, "values") else (v,))]


STRATEGIES = {
    "mirrored": lambda: md.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    "central storage": lambda: md.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"]),
    "one device": lambda: md.distribute.OneDeviceStrategy("/cpu:0"),
}
OPTIONS = {"plain": {}, "accumulation": {"gradient_accumulation_steps": 2},
           "ema": {"use_ema": True, "ema_overwrite_frequency": 3}, "clipnorm": {"clipnorm": 0.5}}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_strategies_and_options_give_the_reference_bits(strategy, options, monkeypatch):
    """Gradient accumulation, Keras' moving average, clipping, constraints and central storage keep working on the
    fused path: the same bits as the reference variable by variable."""
    fused = train(STRATEGIES[strategy], True, monkeypatch, **OPTIONS[options])
    reference = train(STRATEGIES[strategy], False, monkeypatch, **OPTIONS[options])
    assert len(fused) == len(reference)
    for got, expected in zip(fused, reference):
        assert got.tobytes() == expected.tobytes()
