"""Minimal regressions of mismatches that tests/test_optimizer_differential.py found against TF 2.21 + Keras 3."""

import warnings

import numpy as np

import mirrored as md


def _two_replicas():
    return md.MirroredStrategy(["/cpu:0", "/cpu:1"])


def test_loss_scale_optimizer_turns_off_the_wrapped_optimizers_loss_scale_factor():
    # Keras 3's LossScaleOptimizer sets inner_optimizer.loss_scale_factor = None: the gradients are divided by
    # the dynamic scale only. (The wrapped factor used to divide them a second time: case 183, 389.)
    strategy = _two_replicas()
    with strategy.scope():
        w = md.Variable(np.float32(1.0))
        inner = md.optimizers.SGD(learning_rate=1.0, loss_scale_factor=4.0)
        opt = md.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0, dynamic_growth_steps=100)
    assert inner.loss_scale_factor is None

    def step(r):
        opt.apply_gradients([(np.float32(r + 1.0), w)])

    strategy.run(step, args=(strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group),))
    # (1 + 2) summed, / 2 (the scale): w = 1 - 1.5
    assert w.numpy() == np.float32(-0.5)


def test_ftrl_at_learning_rate_zero_gives_keras_nan_without_a_warning():
    # Ftrl divides by the learning rate (Keras' l2_reg + beta / (2 lr), n^p / lr): at a schedule's 0 the weights
    # become NaN as in TensorFlow, in every dtype, and NumPy's divide warning (an error under -W error) is not
    # raised by the element-wise float16 path.
    results = {}
    for dtype in (np.float16, np.float32):
        strategy = md.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            w = md.Variable(np.array([0.5, -1.0], dtype))
            opt = md.optimizers.Ftrl(learning_rate=0.0, beta=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.run(lambda: opt.apply_gradients([(np.array([0.25, 0.5], dtype), w)]))
        results[dtype] = w.numpy()
    assert np.isnan(results[np.float32]).all()
    assert np.isnan(results[np.float16]).all()


def _per_replica(strategy, values):
    return strategy.experimental_distribute_values_from_function(lambda ctx: values[ctx.replica_id_in_sync_group])


def test_loss_scale_optimizer_keeps_each_replicas_gradients_in_its_own_accumulator():
    # Keras accumulates each replica's unscaled gradient in that replica's accumulator and sums them only on the
    # update step (case 26); the sum used to be taken first, so every copy held the sum.
    strategy = _two_replicas()
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32))
        inner = md.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=2)
        opt = md.mixed_precision.LossScaleOptimizer(inner, initial_scale=4.0, dynamic_growth_steps=100)
    grads = [np.array([4.0, 8.0], np.float32), np.array([-12.0, 4.0], np.float32)]
    strategy.run(lambda g: opt.apply_gradients([(g, w)]), args=(_per_replica(strategy, grads),))
    accumulator = opt.get_slot(w, "gradient_accumulator")
    np.testing.assert_array_equal(np.asarray(accumulator.values[0]), [1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(accumulator.values[1]), [-3.0, 1.0])
    np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])
    strategy.run(lambda g: opt.apply_gradients([(g, w)]), args=(_per_replica(strategy, grads),))
    # the update: each replica (accumulated + this step's) / 2, [1, 2] and [-3, 1], summed: w = -[-2, 3]
    np.testing.assert_array_equal(w.numpy(), [2.0, -3.0])
    for copy in accumulator.values:
        np.testing.assert_array_equal(np.asarray(copy), [0.0, 0.0])


def test_a_skipped_first_step_builds_the_wrapped_optimizers_slots():
    # Keras builds the wrapped optimizer before it checks the gradients: after a first step that is skipped
    # (not finite) the slots exist, zeros (case 0); they used to be missing from `variables`.
    strategy = md.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        w = md.Variable(np.ones(3, np.float32))
        # (an optimizer that clips: the path on which a skipped step used to build nothing)
        opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.Adam(0.1, global_clipnorm=0.5), initial_scale=8.0)
    strategy.run(lambda: opt.apply_gradients([(np.array([np.nan, 1.0, 1.0], np.float32), w)]))
    assert int(opt.iterations.numpy()) == 0 and float(opt.dynamic_scale.numpy()) == 4.0
    assert [tuple(v.shape) for v in opt.inner_optimizer.variables] == [(), (3,), (3,)]
    np.testing.assert_array_equal(opt.get_slot(w, "m").numpy(), np.zeros(3, np.float32))
    np.testing.assert_array_equal(w.numpy(), np.ones(3, np.float32))
