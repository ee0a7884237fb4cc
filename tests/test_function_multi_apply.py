"""md.function over steps that apply gradients more than once (gpu marker: on the simulated GPUs without a
GPU, see gpu_env.py): two optimizers in one step (a GAN's generator and discriminator), one optimizer
applied to two variable lists, or to the same variables twice, with a LossScaleOptimizer among them.

Each ``apply_gradients`` is one step of its optimizer, as in TensorFlow: it counts ``iterations`` once, and
a second apply of the same optimizer in one step sees the step the first one counted (Adam's bias
correction). The captured step must give the eager step's bits, and count as it does. A loss-scaled Adam
applied twice in one step is captured too: each apply's GPU picks its scalars by its own count, which the
first apply moved or not (tests/test_loss_scale_no_wait.py injects the skips).
"""

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy

pytestmark = pytest.mark.gpu

_rng = np.random.default_rng(21)
_INITIAL = [(_rng.standard_normal((6, 3)).astype(np.float32), _rng.standard_normal(3).astype(np.float32))
            for _ in range(2)]
_X = _rng.standard_normal((10, 8, 6)).astype(np.float32)  # (step, global batch, features)
_Y = _rng.standard_normal((10, 8, 3)).astype(np.float32)

_OPTIMIZERS = {"sgd": lambda: md.optimizers.SGD(0.1),
               "momentum": lambda: md.optimizers.SGD(0.05, momentum=0.9),
               "adam": lambda: md.optimizers.Adam(0.01),
               # (the rules with more scalars of the step: Nadam's momentum schedule, weight decay, RMSprop's)
               "nadam": lambda: md.optimizers.Nadam(0.01),
               "adamw": lambda: md.optimizers.AdamW(0.01, weight_decay=0.1),
               "rmsprop": lambda: md.optimizers.RMSprop(0.01, momentum=0.5, centered=True)}

# Which optimizer applies which layer's gradients, in order: (optimizer index, layer index, loss-scaled).
# A pair of one layer after another layer's pair recomputes the gradients from the updated weights.
_CASES = {
    "two optimizers": [(0, 0, False), (1, 1, False)],
    "one optimizer, two variable lists": [(0, 0, False), (0, 1, False)],
    "one optimizer twice on the same variables": [(0, 0, False), (0, 0, False)],
    "a loss-scaled optimizer and a plain one": [(0, 0, True), (1, 1, False)],
    "a loss-scaled optimizer twice on the same variables": [(0, 0, True), (0, 0, True)],
}


def _model(strategy, case, optimizer):
    applies = _CASES[case]
    with strategy.scope():
        layers = [(md.Variable(w), md.Variable(b)) for w, b in _INITIAL]
        optimizers = []
        for index in sorted({o for o, _, _ in applies}):
            opt = _OPTIMIZERS[optimizer]()
            if any(scaled for o, _, scaled in applies if o == index):
                opt = md.mixed_precision.LossScaleOptimizer(opt, initial_scale=2.0 ** 8, dynamic_growth_steps=3)
            optimizers.append(opt)
    return layers, optimizers


def _step_fn(case, layers, optimizers):
    """Each apply of ``case`` in order: least squares of one layer towards ``y`` minus half the other layer's
    output (read after the updates before it, as a GAN's generator step reads the updated discriminator),
    with hand-written gradients of the layer's own weights."""
    def step(x, y):
        xp = cupy if isinstance(x, cupy.ndarray) else np
        loss = None
        for o, layer, scaled in _CASES[case]:
            (w, b), (v, c) = layers[layer], layers[1 - layer]
            opt = optimizers[o]
            target = y - (md.linalg.matmul(x, v.read_value()) + c.read_value()) * np.float32(0.5)
            err = md.linalg.matmul(x, w.read_value()) + b.read_value() - target
            c = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
            g = opt.scale_loss(err * c) if scaled else err * c
            opt.apply_gradients([(md.linalg.matmul(x, g, transpose_a=True), w), (g.sum(axis=0), b)])
            part = xp.sum(err * err)
            loss = part if loss is None else loss + part
        return loss
    return step


def _train(replicas, one_gpu, case, optimizer, captured, steps=10):
    """Every copy of the weights and of the optimizers' variables, the losses and the optimizers' iterations."""
    with gpu_env.mirrored_strategy(replicas, one_gpu) as strategy:
        layers, optimizers = _model(strategy, case, optimizer)
        step = _step_fn(case, layers, optimizers)
        run = md.function(step) if captured else step
        replays = captured
        losses, counts = [], []
        for s in range(steps):
            if replays and gpu_env.SIMULATED and s == steps - 1:
                cupy.sim.drain()
                cupy.sim.reset_counters()
            loss = strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y))
            if replays and gpu_env.SIMULATED and s == steps - 1:  # a replay, with no launch from Python
                counted = cupy.sim.counters()
                assert counted["graph_launches"] == ({0: 1} if one_gpu else {0: 1, 1: 1})
                assert sum(counted["launches"].values()) == 0
            losses.append(strategy.reduce(md.ReduceOp.SUM, loss, axis=None))
            counts.append([int(opt.iterations.numpy()) for opt in optimizers])
        if captured:
            assert run.experimental_get_tracing_count() == 1
        state = [c.numpy() for layer in layers for v in layer for c in v.values]
        state += [c.numpy() for opt in optimizers for v in opt.variables for c in v.values]
        return state, losses, counts


def _check(case, optimizer, replicas, one_gpu):
    """The captured step gives the eager step's bits (weights, slots, counts, losses), counting as TensorFlow."""
    eager, eager_losses, eager_counts = _train(replicas, one_gpu, case, optimizer, captured=False)
    captured, captured_losses, captured_counts = _train(replicas, one_gpu, case, optimizer, captured=True)
    assert len(captured) == len(eager)
    for got, want in zip(captured, eager):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(captured_losses, eager_losses)
    assert np.all(np.isfinite(captured_losses))
    # TensorFlow's count: one per apply_gradients of each optimizer (every step here is finite).
    per_step = [sum(1 for o, _, _ in _CASES[case] if o == index) for index in range(len(eager_counts[0]))]
    assert eager_counts == [[n * (s + 1) for n in per_step] for s in range(10)]
    assert captured_counts == eager_counts


@pytest.mark.parametrize("replicas, one_gpu", [(1, True), (2, True), (4, True), (2, False)],
                         ids=["1 replica", "2 logical GPUs", "4 logical GPUs", "2 GPUs"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("case", list(_CASES))
def test_a_captured_step_with_several_applies_gives_the_eager_steps_bits_and_counts(case, optimizer, replicas,
                                                                                    one_gpu):
    if not one_gpu and gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    _check(case, optimizer, replicas, one_gpu)


@pytest.mark.parametrize("optimizer", ["nadam", "adamw", "rmsprop"])
@pytest.mark.parametrize("case", ["one optimizer twice on the same variables",
                                  "a loss-scaled optimizer and a plain one",
                                  "a loss-scaled optimizer twice on the same variables"])
def test_the_other_rules_in_a_captured_step_with_several_applies_give_the_eager_steps_bits(case, optimizer):
    _check(case, optimizer, 2, True)
