"""Optimizers: the update rules against textbook formulas, and the distributed apply.

Keras rounds its hyperparameters through float32 (the learning rate is a float32 variable, and
``ops.cast`` of a Python float makes a float32 tensor first), so the float64 checks against
textbook formulas use hyperparameters that float32 holds exactly.
"""

import numpy as np
import pytest

import mirrored as md
from mirrored.distribute.mirrored_strategy import MirroredExtended
from mirrored.optimizers import adam_update, sgd_update

RNG = np.random.default_rng(7)


def _grads(steps, shape=(3, 4)):
    return [RNG.normal(size=shape) for _ in range(steps)]


# --- the update rules -----------------------------------------------------------------------------

@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.875, False), (0.875, True), (0.5, True)])
def test_sgd_matches_the_textbook_momentum_form(momentum, nesterov):
    # Textbook (Sutskever et al. 2013 / PyTorch form): b = mu*b + g; w -= lr*b,
    # Nesterov: w -= lr*(g + mu*b). Equal to TF's v = mu*v - lr*g for a constant lr.
    lr, w0 = 0.125, RNG.normal(size=(3, 4))
    w, v = w0.copy(), (np.zeros_like(w0) if momentum else None)
    ref, b = w0.copy(), np.zeros_like(w0)
    for g in _grads(5):
        w, v = sgd_update(w, g, v, lr, momentum, nesterov)
        b = momentum * b + g
        ref -= lr * (g + momentum * b) if nesterov else lr * b
    np.testing.assert_allclose(w, ref, rtol=1e-12, atol=1e-12)


def test_adam_matches_kingma_ba_algorithm_1():
    lr, b1, b2, eps, w0 = 2 ** -6, 0.875, 1 - 2 ** -7, 2 ** -20, RNG.normal(size=(3, 4))
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    ref, rm, rv = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, g in enumerate(_grads(6), start=1):
        w, m, v = adam_update(w, g, m, v, lr, b1, b2, eps, t)
        rm = b1 * rm + (1 - b1) * g
        rv = b2 * rv + (1 - b2) * g ** 2
        m_hat, v_hat = rm / (1 - b1 ** t), rv / (1 - b2 ** t)
        # epsilon is the paper's "epsilon hat" (section 2): it sits outside the
        # bias correction, i.e. eps_hat = eps * sqrt(1 - b2^t) in Algorithm 1's terms.
        ref -= lr * m_hat / (np.sqrt(v_hat) + eps / np.sqrt(1 - b2 ** t))
    np.testing.assert_allclose(w, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m, rm, rtol=1e-12)
    np.testing.assert_allclose(v, rv, rtol=1e-12)


def test_float32_weights_stay_float32():
    w, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    w, m, v = adam_update(w, g, m, v, 0.1, 0.9, 0.999, 1e-7, 1)
    w, _ = sgd_update(w, g, None, 0.1, 0.0, False)
    assert w.dtype == m.dtype == v.dtype == np.float32


@pytest.mark.parametrize("kwargs,needle", [
    ({"learning_rate": -0.1}, "learning_rate"),
    ({"learning_rate": "fast"}, "learning_rate"),
    ({"learning_rate": 0.1, "momentum": 1.5}, "momentum"),
    ({"learning_rate": 0.1, "nesterov": True}, "nesterov"),
])
def test_sgd_rejects_bad_hyperparameters(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        md.optimizers.SGD(**kwargs)


def test_adam_rejects_beta_of_one():
    with pytest.raises(ValueError, match="beta_2"):
        md.optimizers.Adam(0.1, beta_2=1.0)


# --- apply_gradients under MirroredStrategy --------------------------------------------------------

def _strategy(n=2, **kw):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)], **kw)


def _copies_equal(var):
    first = np.asarray(var.values[0])
    return all(np.array_equal(np.asarray(c), first) for c in var.values[1:])


@pytest.mark.parametrize("aggregation,combine", [("sum", np.sum), ("mean", np.mean)])
@pytest.mark.parametrize("make", [
    lambda agg: md.optimizers.SGD(0.125, gradient_aggregation=agg),
    lambda agg: md.optimizers.SGD(0.125, momentum=0.875, nesterov=True, gradient_aggregation=agg),
    lambda agg: md.optimizers.Adam(0.0625, gradient_aggregation=agg),
])
def test_apply_in_replica_context_sums_the_gradients_or_averages_on_request(make, aggregation, combine):
    n, w0 = 3, RNG.normal(size=(2, 3))
    grads = [[RNG.normal(size=(2, 3)) for _ in range(n)] for _ in range(4)]
    strategy = _strategy(n)
    with strategy.scope():
        w = md.Variable(w0.copy(), name="w")
        opt = make(aggregation)
    ref_opt_state = {}
    ref = w0.copy()
    for step, per_replica in enumerate(grads):
        def fn(per_replica=per_replica):
            rid = md.get_replica_context().replica_id_in_sync_group
            return opt.apply_gradients([(per_replica[rid], w)])

        strategy.run(fn)
        ref = _reference_step(opt, ref, combine(per_replica, axis=0), step, ref_opt_state)
        assert _copies_equal(w)
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-10, atol=1e-12)
    assert int(opt.iterations.numpy()) == len(grads)
    for slot in opt._slot_names:
        assert _copies_equal(opt.get_slot(w, slot))
        assert len(opt.get_slot(w, slot).values) == n


def _reference_step(opt, w, g, step, state):
    """The same optimizer's rule on one array (already checked against the textbook above)."""
    lr = opt.learning_rate_at(step)
    if isinstance(opt, md.optimizers.Adam):
        m, v = state.get("m", np.zeros_like(w)), state.get("v", np.zeros_like(w))
        w, state["m"], state["v"] = adam_update(w, g, m, v, lr, opt.beta_1, opt.beta_2, opt.epsilon, step + 1)
    else:
        velocity = state.get("v", np.zeros_like(w)) if opt.momentum else None
        w, state["v"] = sgd_update(w, g, velocity, lr, opt.momentum, opt.nesterov)
    return w


@pytest.mark.parametrize("aggregation,expected", [("sum", -1.5), ("mean", -0.75)])
def test_apply_in_cross_replica_context_with_per_replica_gradients(aggregation, expected):
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.zeros(4), name="w")
        opt = md.optimizers.SGD(0.5, gradient_aggregation=aggregation)
    grads = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(4, float(ctx.replica_id_in_sync_group + 1)))
    with strategy.scope():
        opt.apply_gradients([(grads, w)])
    np.testing.assert_allclose(w.numpy(), np.full(4, expected))  # -0.5 * sum(1, 2) or mean(1, 2)
    assert _copies_equal(w)


def test_the_same_gradient_object_on_every_replica_is_still_summed():
    strategy = _strategy(4)
    one = np.ones(2)
    with strategy.scope():
        w = md.Variable(np.zeros(2), name="w")
        opt = md.optimizers.SGD(0.5)
    strategy.run(lambda: opt.apply_gradients([(one, w)]))  # merge_call sees one object, 4 replicas
    np.testing.assert_allclose(w.numpy(), np.full(2, -2.0))


def test_gradient_aggregation_is_checked():
    assert md.optimizers.SGD(gradient_aggregation=md.ReduceOp.MEAN).gradient_aggregation == "mean"
    assert md.optimizers.Adam(gradient_aggregation="SUM").gradient_aggregation == "sum"
    with pytest.raises(ValueError, match="gradient_aggregation='max'.*'sum'.*'mean'"):
        md.optimizers.SGD(gradient_aggregation="max")


def test_experimental_aggregate_gradients_false_updates_each_copy_with_its_own_gradient():
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.zeros(2), name="w")
        opt = md.optimizers.SGD(1.0)

    def fn():
        ctx = md.get_replica_context()
        g = ctx.all_reduce("SUM", np.full(2, ctx.replica_id_in_sync_group + 1.0))  # the caller aggregates
        return opt.apply_gradients([(g, w)], experimental_aggregate_gradients=False, name="step")

    strategy.run(fn)
    np.testing.assert_allclose(w.numpy(), np.full(2, -3.0))
    assert _copies_equal(w)


def test_wrong_gradient_shapes_name_the_variable_and_both_shapes():
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.zeros((2, 3)), name="dense/w")
        s = md.Variable(np.zeros(()), name="scale")
        opt = md.optimizers.SGD(0.1)
    for bad in (np.ones(1), np.float64(1.0), np.ones((3, 2)), np.ones((1, 3))):
        with pytest.raises(ValueError, match=r"'dense/w:0'.*shape \(" + ",? ?".join(
                str(d) for d in np.shape(bad)) + r",?\).*variable has shape \(2, 3\)"):
            strategy.run(lambda bad=bad: opt.apply_gradients([(bad, w)]))
    with pytest.raises(ValueError, match=r"'scale:0'.*shape \(1,\).*shape \(\)"):
        strategy.run(lambda: opt.apply_gradients([(np.ones(1), s)]))
    np.testing.assert_array_equal(w.numpy(), np.zeros((2, 3)))  # nothing applied
    assert opt._iterations is None


def test_apply_outside_run_and_scope_says_so():
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.zeros(2), name="w")
        opt = md.optimizers.SGD(0.1)
    with pytest.raises(RuntimeError, match="outside strategy.run and outside strategy.scope"):
        opt.apply_gradients([(np.ones(2), w)])
    other = _strategy(2)
    with other.scope():
        v = md.Variable(np.zeros(2), name="v")
    with pytest.raises(ValueError, match="was created for .* and is now asked to update variables under"):
        other.run(lambda: opt.apply_gradients([(np.ones(2), v)]))


def test_learning_rate_schedule_is_called_with_the_step():
    strategy = _strategy(2)
    seen = []
    with strategy.scope():
        w = md.Variable(np.zeros(1), name="w")
        opt = md.optimizers.SGD(lambda step: seen.append(step) or 0.1 * (step + 1))
    for _ in range(3):
        strategy.run(lambda: opt.apply_gradients([(np.ones(1), w)]))
    assert seen == [0, 1, 2]
    np.testing.assert_allclose(w.numpy(), [-2 * (0.1 + 0.2 + 0.3)])  # two replicas' gradients summed


class _RecordingOps(md.cross_device_ops.ReductionToOneDevice):
    def __init__(self):
        super().__init__()
        self.batches = []

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.batches.append((reduce_op, len(value_destination_pairs), options))
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


def test_all_gradients_go_through_one_batch_reduce_with_the_options():
    ops = _RecordingOps()
    strategy = _strategy(2, cross_device_ops=ops)
    with strategy.scope():
        variables = [md.Variable(np.zeros(s), name=f"v{i}") for i, s in enumerate([(3,), (2, 2), (5,)])]
        opt = md.optimizers.Adam(0.01)
    options = md.CommunicationOptions(bytes_per_pack=16)
    strategy.run(lambda: opt.apply_gradients([(np.ones(v.shape), v) for v in variables], options=options))
    grad_batches = [b for b in ops.batches if b[1] == 3]
    assert len(grad_batches) == 1
    reduce_op, _, seen = grad_batches[0]
    assert md.ReduceOp(reduce_op) is md.ReduceOp.SUM
    assert seen is not None and seen.bytes_per_pack == 16
    for v in variables:
        assert _copies_equal(v)


def test_the_native_core_sees_one_batch_all_reduce_with_bytes_per_pack(monkeypatch):
    calls = []
    real = md.collectives.batch_all_reduce

    def recording(per_replica_lists, op="sum", **kwargs):
        calls.append((len(per_replica_lists), len(per_replica_lists[0]), op, kwargs.get("bytes_per_pack")))
        return real(per_replica_lists, op, **kwargs)

    monkeypatch.setattr(md.collectives, "batch_all_reduce", recording)
    # (CPU replicas of one process skip the all-reduce, test_optimizer_summed_update.py; the strategies
    # that all-reduce, GPUs and workers, take the options this way.)
    monkeypatch.setattr(MirroredExtended, "_sums_host_replicas_in_order", lambda self: False)
    strategy = _strategy(4, cross_device_ops=md.RingAllReduce())
    with strategy.scope():
        variables = [md.Variable(np.zeros(s, np.float32)) for s in [(64, 32), (32,), (32, 10), (10,)]]
        opt = md.optimizers.SGD(0.1, momentum=0.9)
    strategy.run(lambda: opt.apply_gradients([(np.ones(v.shape, np.float32), v) for v in variables],
                                             options=md.CommunicationOptions(bytes_per_pack=4096)))
    assert calls == [(4, 4, "SUM", 4096)]  # 4 replicas x 4 gradients, one native call


def test_none_gradients_are_skipped_and_bad_pairs_named():
    strategy = _strategy(2)
    with strategy.scope():
        a, b = md.Variable(np.ones(2), name="a"), md.Variable(np.ones(2), name="b")
        frozen = md.Variable(np.ones(2), name="frozen", trainable=False)
        opt = md.optimizers.SGD(1.0)
        opt.apply_gradients([(None, a), (np.ones(2), b)])
        np.testing.assert_allclose(a.numpy(), [1, 1])
        np.testing.assert_allclose(b.numpy(), [0, 0])
        with pytest.raises(ValueError, match="no gradient"):
            opt.apply_gradients([(None, a)])
        with pytest.raises(ValueError, match="trainable"):
            opt.apply_gradients([(np.ones(2), frozen)])
        with pytest.raises(TypeError, match="md.Variable"):
            opt.apply_gradients([(np.ones(2), np.ones(2))])


def test_works_without_a_strategy():
    w = md.Variable(np.ones(3))  # the default strategy: one plain variable
    opt = md.optimizers.SGD(0.5, momentum=0.5)
    for _ in range(2):
        opt.apply_gradients([(np.ones(3), w)])
    np.testing.assert_allclose(w.numpy(), np.full(3, 1 - 0.5 - 0.75))  # v = -0.5, then -0.75
    assert int(opt.iterations.numpy()) == 2


# --- the fused step: packed gradients, one update per device, in place ------------------------------

def test_from_the_second_step_each_replica_sends_one_packed_buffer_per_dtype():
    ops = _RecordingOps()
    strategy = _strategy(2, cross_device_ops=ops)
    shapes = [(3,), (2, 2), (5,)]
    with strategy.scope():
        variables = [md.Variable(np.zeros(s, np.float32), name=f"v{i}") for i, s in enumerate(shapes)]
        variables.append(md.Variable(np.zeros(4, np.float64), name="v64"))
        opt = md.optimizers.Adam(0.01)
    options = md.CommunicationOptions(bytes_per_pack=64)
    for _ in range(3):
        strategy.run(lambda: opt.apply_gradients([(np.ones(v.shape, v.dtype), v) for v in variables],
                                                 options=options))
    sizes = [b[1] for b in ops.batches]
    assert sizes == [4, 2, 2]  # the first step per variable; then a float32 and a float64 buffer
    assert all(b[2].bytes_per_pack == 64 for b in ops.batches)
    reference = md.optimizers.Adam(0.01)
    for v in variables:
        w, m, vv = np.zeros(v.shape, v.dtype), np.zeros(v.shape, v.dtype), np.zeros(v.shape, v.dtype)
        for step in range(3):
            w, m, vv = md.optimizers.adam_update(w, np.full(v.shape, 2.0, v.dtype), m, vv, np.float32(0.01),
                                                 reference.beta_1, reference.beta_2, reference.epsilon, step + 1)
        np.testing.assert_array_equal(v.numpy(), w)
        assert _copies_equal(v)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 3])
def test_every_dtype_gives_the_reference_rule_bit_for_bit(dtype, n):
    # float32/float64 go through the fused kernel, float16 through the NumPy rule: the same bits.
    strategy = _strategy(n)
    w0 = RNG.normal(size=(7, 3)).astype(dtype)
    with strategy.scope():
        w = md.Variable(w0.copy(), name="w")
        opt = md.optimizers.RMSprop(0.01, momentum=0.5, centered=True, weight_decay=0.1)
    grads = [[RNG.normal(size=(7, 3)).astype(dtype) for _ in range(n)] for _ in range(3)]
    for per_replica in grads:
        strategy.run(lambda g=per_replica: opt.apply_gradients(
            [(g[md.get_replica_context().replica_id_in_sync_group], w)]))
    t = np.dtype(dtype).type
    ref, (v, a, mom) = w0.copy(), (np.zeros_like(w0) for _ in range(3))
    for step, per_replica in enumerate(grads):
        g = per_replica[0].copy()
        for other in per_replica[1:]:
            g += other
        lr = t(np.float32(0.01))
        md.optimizers.rules.weight_decay(ref, t(np.float32(0.1)), lr)
        md.optimizers.rules.rmsprop(ref, g, (v, a, mom), opt._coefficients(t, lr, step))
    np.testing.assert_array_equal(w.numpy(), ref)
    assert _copies_equal(w)


def test_updates_write_in_place_and_never_change_an_array_still_held():
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.ones(4, np.float32), name="w")
        opt = md.optimizers.SGD(0.5, momentum=0.5)
    step = lambda: opt.apply_gradients([(np.ones(4, np.float32), w)])  # noqa: E731
    strategy.run(step)
    address = w.values[0].read_value().ctypes.data
    strategy.run(step)
    assert w.values[0].read_value().ctypes.data == address  # nobody held it: updated in place
    held = w.values[1].read_value()
    before = held.copy()
    strategy.run(step)
    np.testing.assert_array_equal(held, before)  # TF's promise: a read value keeps its value
    assert not np.array_equal(w.values[1].read_value(), before)
    assert _copies_equal(w)
    slot = opt.get_slot(w, "momentum").values[0].read_value()
    kept = slot.copy()
    strategy.run(step)
    np.testing.assert_array_equal(slot, kept)


def test_build_creates_the_slots_in_scope_and_apply_uses_the_built_variables():
    strategy = _strategy(2)
    with strategy.scope():
        a, b = md.Variable(np.ones(2, np.float32), name="a"), md.Variable(np.ones(3, np.float32), name="b")
        opt = md.optimizers.Adagrad(0.1, initial_accumulator_value=0.25)
        opt.build([a, b])
    assert opt.built
    assert [v.name for v in opt.variables] == ["adagrad/iterations:0", "a/accumulator:0", "b/accumulator:0"]
    assert isinstance(opt.get_slot(b, "accumulator"), md.MirroredVariable)
    np.testing.assert_array_equal(opt.get_slot(a, "accumulator").numpy(), [0.25, 0.25])
    opt.build([a, b])  # a second build changes nothing (Keras: a no-op once built)
    assert len(opt.variables) == 3
    with strategy.scope():
        opt.apply([np.ones(2, np.float32), np.ones(3, np.float32)])
    # A plain gradient in cross-replica context is the final gradient (nothing to sum).
    np.testing.assert_allclose(a.numpy(), 1 - 0.1 / np.sqrt(0.25 + 1), rtol=1e-6)
    with pytest.raises(ValueError, match="built"):
        md.optimizers.SGD().apply([np.ones(2)])


@pytest.mark.parametrize("kwargs, error, needle", [
    ({"clipnorm": 0.0}, ValueError, "clipnorm=0.0"),
    ({"clipnorm": -1.0}, ValueError, "clipnorm=-1.0"),
    ({"clipvalue": 0}, ValueError, "clipvalue=0"),
    ({"global_clipnorm": -0.5}, ValueError, "global_clipnorm=-0.5"),
    ({"clipnorm": float("inf")}, ValueError, "clipnorm=inf"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay=-0.1"),
    ({"clipnorm": 1.0, "clipvalue": 1.0}, ValueError, "Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"),
    ({"nonsense": 1}, ValueError, "Argument\\(s\\) not recognized"),
    ({"use_ema": True, "ema_momentum": 1.5}, ValueError, "ema_momentum=1.5"),
    ({"use_ema": True, "ema_overwrite_frequency": 0}, ValueError, "ema_overwrite_frequency=0"),
    ({"use_ema": True, "ema_overwrite_frequency": 2.5}, ValueError, "ema_overwrite_frequency=2.5"),
    ({"gradient_accumulation_steps": 1}, ValueError, "gradient_accumulation_steps=1"),
    ({"gradient_accumulation_steps": 2.0}, ValueError, "gradient_accumulation_steps=2.0"),
    ({"loss_scale_factor": 0.0}, ValueError, "loss_scale_factor=0.0"),
    ({"loss_scale_factor": float("nan")}, ValueError, "loss_scale_factor=nan"),
])
@pytest.mark.parametrize("cls", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam"])
def test_bad_arguments_name_themselves(cls, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        getattr(md.optimizers, cls)(**kwargs)


def test_keras_defaults():
    assert md.optimizers.AdamW().weight_decay == 0.004
    with pytest.raises(ValueError, match="weight_decay=None"):
        md.optimizers.AdamW(weight_decay=None)
    rms = md.optimizers.RMSprop()
    assert (rms.learning_rate, rms.rho, rms.momentum, rms.epsilon, rms.centered) == (0.001, 0.9, 0.0, 1e-7, False)
    assert md.optimizers.Adagrad().initial_accumulator_value == 0.1
    nadam = md.optimizers.Nadam()
    assert (nadam.learning_rate, nadam.beta_1, nadam.beta_2, nadam.epsilon) == (0.001, 0.9, 0.999, 1e-7)
    for cls in ("SGD", "Adam", "RMSprop", "Adagrad", "Nadam"):
        opt = getattr(md.optimizers, cls)(decay=0.5)  # Keras ignores the old `decay`
        assert (opt.weight_decay, opt.clipnorm, opt.clipvalue, opt.global_clipnorm) == (None, None, None, None)


def test_excluded_variables_get_no_weight_decay():
    strategy = _strategy(2)
    with strategy.scope():
        w, bias = md.Variable(np.ones(2, np.float32), name="dense/w"), md.Variable(np.ones(2, np.float32),
                                                                                   name="dense/bias")
        opt = md.optimizers.SGD(0.5, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=["bias"])
    strategy.run(lambda: opt.apply_gradients([(np.zeros(2, np.float32), w), (np.zeros(2, np.float32), bias)]))
    np.testing.assert_array_equal(w.numpy(), [0.75, 0.75])  # w - w * 0.5 * 0.5
    np.testing.assert_array_equal(bias.numpy(), [1, 1])
    with pytest.raises(ValueError, match="before the optimizer is built"):
        opt.exclude_from_weight_decay(var_list=[w])


def test_nadam_resumes_from_a_checkpoint_as_if_never_stopped(tmp_path):
    def train(opt, w, steps, first):
        for s in range(first, first + steps):
            strategy.run(lambda s=s: opt.apply_gradients([(np.full(3, 0.1 * (s + 1), np.float32), w)]))

    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.ones(3, np.float32), name="w")
        opt = md.optimizers.Nadam(0.01)
    train(opt, w, 4, 0)
    path = md.train.Checkpoint(w=w, optimizer=opt).save(str(tmp_path / "ckpt"))
    train(opt, w, 3, 4)
    with strategy.scope():
        w2 = md.Variable(np.zeros(3, np.float32), name="w")
        opt2 = md.optimizers.Nadam(0.01)
        opt2.build([w2])
    md.train.Checkpoint(w=w2, optimizer=opt2).restore(path)
    train(opt2, w2, 3, 4)
    np.testing.assert_array_equal(w2.numpy(), w.numpy())


def test_200_variables_take_one_collective_and_one_kernel_call_per_device_and_step(monkeypatch):
    from mirrored.train.optimizers import base

    kernel = base._host_kernel
    calls = []

    def counting(rule, weights, grads, *args):
        calls.append((len(weights), isinstance(grads, np.ndarray)))
        return kernel(rule, weights, grads, *args)

    monkeypatch.setattr(base, "_host_kernel", counting)
    ops = _RecordingOps()
    strategy = _strategy(2, cross_device_ops=ops)
    with strategy.scope():
        variables = [md.Variable(np.zeros((4, 3) if i % 2 else (3,), np.float32)) for i in range(200)]
        opt = md.optimizers.Adam(0.01)
    grads = [np.ones(v.shape, np.float32) for v in variables]
    for _ in range(3):
        strategy.run(lambda: opt.apply_gradients(zip(grads, variables)))
    assert [b[1] for b in ops.batches] == [200, 1, 1]  # then one packed float32 buffer per replica
    assert calls == [(200, False)] * 2 + [(200, True)] * 4  # one kernel call per device and step
    for v in variables[:3]:
        assert _copies_equal(v)


@pytest.mark.parametrize("replicas", [1, 2])
def test_iterations_assigned_from_outside_is_the_next_step(replicas):
    """The optimizer counts its steps without reading ``iterations`` back, until someone assigns it."""
    strategy = _strategy(replicas)
    with strategy.scope():
        w = md.Variable(np.zeros(3, np.float32))
        opt = md.optimizers.SGD(0.1)
    grad = np.ones(3, np.float32)
    steps = [strategy.run(lambda: opt.apply_gradients([(grad, w)])) for _ in range(2)]
    assert [strategy.experimental_local_results(s)[0] for s in steps] == [1, 2]
    with strategy.scope():
        opt.iterations.assign(np.int64(10))
        assert opt.apply_gradients([(grad, w)]) == 11
    assert int(opt.iterations.numpy()) == 11
    assert [int(c.numpy()) for c in opt.iterations.values] == [11] * replicas
    opt.learning_rate = lambda step: 1.0 if step == 11 else 0.0  # the schedule sees the assigned step
    before = w.numpy().copy()
    strategy.run(lambda: opt.apply_gradients([(grad, w)]))
    np.testing.assert_array_equal(w.numpy(), before - replicas * grad)  # the gradients are summed


# -- Keras 3's amsgrad, use_ema, loss_scale_factor and gradient_accumulation_steps (their values against
# -- Keras' are in test_optimizer_keras_parity.py) --

@pytest.mark.parametrize("kwargs", [
    {"amsgrad": True}, {"use_ema": True, "ema_overwrite_frequency": 2}, {"gradient_accumulation_steps": 3}])
def test_keras_state_is_checkpointed_under_keras_slot_names_and_resumes_exactly(tmp_path, kwargs):
    def train(opt, w, steps, first):
        for s in range(first, first + steps):
            strategy.run(lambda s=s: opt.apply_gradients(
                [(np.full(3, 0.1 * (s + 1) * (md.get_replica_context().replica_id_in_sync_group + 1), np.float32),
                  w)]))

    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.ones(3, np.float32), name="w")
        opt = md.optimizers.Adam(0.01, **kwargs)
    # 6 steps: an update step's end, where the accumulators are zero (a checkpoint holds one copy of a
    # variable, the first replica's, as TensorFlow's does, and each replica accumulates its own gradients)
    train(opt, w, 6, 0)
    path = md.train.Checkpoint(w=w, optimizer=opt).save(str(tmp_path / "ckpt"))
    # Keras' _variables numbering for one variable: iterations 0, learning rate 1, then the moving average and
    # gradient accumulator (built first), momentum, velocity, then velocity_hat.
    names = {"amsgrad": ("velocity_hat", 4), "use_ema": ("average", 2),
             "gradient_accumulation_steps": ("gradient_accumulator", 2)}
    slot, index = next(names[k] for k in kwargs if k in names)
    np.testing.assert_array_equal(md.train.load_checkpoint(path)[f"optimizer/_variables/{index}"],
                                  opt.get_slot(w, slot).values[0].numpy())
    train(opt, w, 5, 6)
    with strategy.scope():
        w2 = md.Variable(np.zeros(3, np.float32), name="w")
        opt2 = md.optimizers.Adam(0.01, **kwargs)
        opt2.build([w2])
    md.train.Checkpoint(w=w2, optimizer=opt2).restore(path)
    train(opt2, w2, 5, 6)
    for copy, copy2 in zip(w.values, w2.values):
        np.testing.assert_array_equal(np.asarray(copy2), np.asarray(copy))


def test_gradient_accumulation_counts_updates_and_applies_every_nth_step():
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32))
        opt = md.optimizers.SGD(1.0, gradient_accumulation_steps=3)
    seen = []
    for s in range(7):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            return opt.apply_gradients([(np.full(2, float(s + 1 + 10 * r), np.float32), w)])
        seen.append(strategy.experimental_local_results(strategy.run(step))[0])
        if s == 1:
            np.testing.assert_array_equal(w.numpy(), [0, 0])  # nothing applied yet
            # each replica keeps its own sum until the update (Keras under a strategy)
            acc = opt.get_slot(w, "gradient_accumulator")
            np.testing.assert_array_equal([np.asarray(c) for c in acc.values], [[3, 3], [23, 23]])
    assert seen == list(range(1, 8))  # apply_gradients returns the real count, as Keras' _iterations
    # steps 0-2 and 3-5 applied: (sum over replicas of the replica's mean over 3 steps) * lr
    np.testing.assert_array_equal(w.numpy(), -((2 + 12) + (5 + 15)) * np.ones(2))
    assert int(opt.iterations) == 2 and int(opt.iterations.numpy()) == 2
    assert int(opt._iterations.numpy()) == 7
    np.testing.assert_array_equal(opt.get_slot(w, "gradient_accumulator").values[1].numpy(), [17, 17])


def test_loss_scale_factor_scales_the_loss_and_divides_the_gradients():
    opt = md.optimizers.SGD(0.5, loss_scale_factor=4.0)
    assert opt.scale_loss(np.float32(3.0)) == np.float32(12.0)
    assert md.optimizers.SGD().scale_loss(3.0) == 3.0
    w = md.Variable(np.ones(2, np.float32))
    opt.apply_gradients([(np.full(2, 8.0, np.float32), w)])
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])  # 1 - 0.5 * 8 / 4


def test_ema_on_float16_variables_and_finalize_variable_values():
    # float16 takes the element-wise path (no kernel), float32 the fused one: both are Keras' EMA.
    strategy = _strategy(2)
    with strategy.scope():
        a = md.Variable(np.ones(3, np.float16), name="a")
        b = md.Variable(np.ones(3, np.float32), name="b")
        opt = md.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5)
    for _ in range(2):
        strategy.run(lambda: opt.apply_gradients([(np.full(3, 0.25, np.float16), a),
                                                   (np.full(3, 0.25, np.float32), b)]))
    # w: 1 -> 0.75 -> 0.5 (the sum of 2 replicas' 0.25); average: 0.75 (first step: w), then 0.5*0.75+0.5*0.5
    for var, dtype in ((a, np.float16), (b, np.float32)):
        average = opt.get_slot(var, "average")
        assert average.dtype == dtype
        for copy in average.values:
            np.testing.assert_array_equal(np.asarray(copy), np.full(3, 0.625, dtype))
        np.testing.assert_array_equal(var.numpy(), np.full(3, 0.5, dtype))
    with strategy.scope():
        opt.finalize_variable_values([a, b])
    for var in (a, b):
        for copy in var.values:
            np.testing.assert_array_equal(np.asarray(copy), np.full(3, 0.625))
    with strategy.scope():
        stranger = md.Variable(np.ones(3, np.float32), name="stranger")
    with pytest.raises(ValueError, match=r"var_list\[0\]: variable 'stranger.*no moving average"):
        opt.finalize_variable_values([stranger])
    md.optimizers.SGD().finalize_variable_values([stranger])  # without use_ema: nothing to do
    np.testing.assert_array_equal(stranger.numpy(), 1)


def test_amsgrad_slot_and_get_slot_names():
    strategy = _strategy(2)
    with strategy.scope():
        w = md.Variable(np.ones(2, np.float32), name="dense/w")
        opt = md.optimizers.AdamW(amsgrad=True)
        opt.build([w])
    assert [v.name for v in opt.variables] == ["adam_w/iterations:0", "dense/w/momentum:0", "dense/w/velocity:0",
                                               "dense/w/velocity_hat:0"]
    assert opt.get_slot(w, "vhat") is opt.get_slot(w, "velocity_hat")
    with pytest.raises(KeyError, match="'average'.*'velocity_hat'"):
        opt.get_slot(w, "average")
