"""LossScaleOptimizer decided on the GPUs (gpu marker: on the simulated GPUs without a GPU, see gpu_env.py).

On GPU replicas the finiteness check, the skip, the unscaling and the scale's update run on the devices
(csrc/cuda/fused_update.h), so a step waits for nothing and md.function captures it. Both must give the
bits of the host-decided step (the same optimizer with the device path switched off), over steps with
injected inf and nan gradients (skip and halve), growth after dynamic_growth_steps, and a fixed scale.
"""

import gc
import warnings

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy
from mirrored.train import mixed_precision

pytestmark = pytest.mark.gpu

_rng = np.random.default_rng(11)
_W0 = _rng.standard_normal((6, 3)).astype(np.float32)
_B0 = _rng.standard_normal(3).astype(np.float32)
_X = _rng.standard_normal((10, 8, 6)).astype(np.float32)  # (step, global batch, features)
_Y = _rng.standard_normal((10, 8, 3)).astype(np.float32)
_X[3, 1, 2] = np.inf  # step 3: an inf gradient on replica 0's part (skipped, the scale halves)
_X[7, 7, 0] = np.nan  # step 7: a nan on the last replica's part
_X[8] *= 3e4  # step 8: finite inputs whose scaled float16 gradients overflow


def _model(strategy, inner, dynamic, variable_dtype, initial_scale=2.0 ** 10):
    with strategy.scope():
        w, b = md.Variable(_W0.astype(variable_dtype)), md.Variable(_B0.astype(variable_dtype))
        opt = mixed_precision.LossScaleOptimizer(
            {"sgd": lambda: md.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.01),
             "lamb": lambda: md.optimizers.Lamb(0.01, weight_decay=0.1),
             "schedule_free_adamw": lambda: md.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=3, weight_decay=0.1),
             }[inner](),
            dynamic=dynamic, initial_scale=initial_scale, dynamic_growth_steps=2)
    return w, b, opt


def _step_fn(w, b, opt, grad_dtype, seed=False):
    """Least squares with hand-written gradients of the scaled loss, cast to ``grad_dtype`` (float16: as a
    mixed-precision backward pass gives them); ``seed``: scaled by the backward pass's seed
    ``scale_loss(1.0)`` rather than by ``scale_loss`` of the loss's gradient."""
    def step(x, y):
        xp = cupy if isinstance(x, cupy.ndarray) else np
        x, y = x.astype(w.dtype, copy=False), y.astype(w.dtype, copy=False)
        err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
        c = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
        scaled = err * c * opt.scale_loss(1.0) if seed else opt.scale_loss(err * c)
        opt.apply_gradients([(md.linalg.matmul(x, scaled, transpose_a=True).astype(grad_dtype), w),
                             (scaled.sum(axis=0).astype(grad_dtype), b)])
        return xp.sum(err * err)
    return step


def _train(monkeypatch, replicas, inner="sgd", dynamic=True, grad_dtype=np.float32, variable_dtype=np.float32,
           mode="device", steps=10, seed=False, initial_scale=2.0 ** 10, one_gpu=True):
    """Every copy of the weights and slots, and (loss scale, counter, iterations) after each step. ``mode``:
    "device" (the host-decided step switched off), "captured" (the same under md.function), "host" (the
    device-decided one switched off), "auto" (either, as the optimizer chooses)."""
    if mode == "host":  # the host-decided step this replaces, as it runs on GPU replicas
        monkeypatch.setattr(mixed_precision.LossScaleOptimizer, "_device_plan", lambda *a: None)
        monkeypatch.setattr(mixed_precision.LossScaleOptimizer, "_device_scale", lambda *a: None)
    elif mode != "auto":  # nothing of the host-decided step may run
        monkeypatch.setattr(mixed_precision.LossScaleOptimizer, "_unscaled", None)
        monkeypatch.setattr(mixed_precision, "_is_finite", None)
    try:
        with gpu_env.mirrored_strategy(replicas, one_gpu) as strategy:
            w, b, opt = _model(strategy, inner, dynamic, variable_dtype, initial_scale)
            step = _step_fn(w, b, opt, grad_dtype, seed)
            run = md.function(step) if mode == "captured" else step
            history = []
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a captured step must not fall back to eager
                for s in range(steps):
                    replay = mode == "captured" and s == steps - 1 and gpu_env.SIMULATED
                    if replay:
                        cupy.sim.drain()
                        cupy.sim.reset_counters()
                    strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y))
                    if replay:  # the step was a replay of the graph, with no launch from Python
                        counted = cupy.sim.counters()
                        assert counted["graph_launches"] == ({0: 1} if one_gpu else {0: 1, 1: 1})
                        assert sum(counted["launches"].values()) == 0
                    history.append((float(opt.loss_scale), opt.dynamic_counter, int(opt.iterations.numpy())))
            return _state(w, b, opt), history
    finally:
        monkeypatch.undo()


def _state(w, b, opt):
    """Every copy of the weights, of the optimizers' variables (scale, counter, iterations) and of the slots."""
    return [c.numpy() for v in (w, b, *opt.variables) for c in v.values]


def _assert_same(got, expected):
    (state, history), (want_state, want_history) = got, expected
    assert history == want_history
    for g, e in zip(state, want_state):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("grad_dtype", [np.float32, np.float16], ids=["float32 grads", "float16 grads"])
def test_the_device_decided_step_gives_the_host_decided_steps_bits(replicas, inner, grad_dtype, monkeypatch):
    host = _train(monkeypatch, replicas, inner, grad_dtype=grad_dtype, mode="host")
    device = _train(monkeypatch, replicas, inner, grad_dtype=grad_dtype)
    _assert_same(device, host)
    scales = [h[0] for h in host[1]]
    # Keras' rules at work: growth after 2 good steps, halving on each bad step (3, 7, and 8 in float16).
    assert scales[:3] == [1024.0, 2048.0, 2048.0] and scales[3] == scales[2] / 2
    assert host[1][-1][2] == (7 if grad_dtype == np.float16 else 8)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_a_fixed_scale_applies_every_step_on_the_device_as_on_the_host(replicas, inner, monkeypatch):
    host = _train(monkeypatch, replicas, inner, dynamic=False, mode="host", steps=3)
    device = _train(monkeypatch, replicas, inner, dynamic=False, steps=3)
    _assert_same(device, host)
    assert [h[0] for h in device[1]] == [1024.0] * 3 and device[1][-1][2] == 3


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("seed", [False, True], ids=["scale_loss(loss)", "scale_loss(1.0)"])
def test_a_captured_loss_scaled_step_replays_the_eager_steps_bits(replicas, inner, seed, monkeypatch):
    host = _train(monkeypatch, replicas, inner, mode="host", seed=seed)
    eager = _train(monkeypatch, replicas, inner, seed=seed)
    captured = _train(monkeypatch, replicas, inner, mode="captured", seed=seed)
    _assert_same(eager, host)
    _assert_same(captured, eager)


@pytest.mark.parametrize("kernel_order", range(3))  # each test id draws its own order of the kernels
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_on_two_gpus_each_gpu_decides_with_its_own_copy_of_the_scale(inner, kernel_order, monkeypatch):
    if gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    gpu_env.nccl_strategy(2)  # (skips without NCCL)
    # Two replicas on two GPUs (NCCL) sum the same two float16 values as on two logical GPUs of one. (The
    # host-decided step once divided on one stream and updated on another here: weights from garbage.)
    logical = _train(monkeypatch, 2, inner, grad_dtype=np.float16)
    host = _train(monkeypatch, 2, inner, grad_dtype=np.float16, mode="host", one_gpu=False)
    eager = _train(monkeypatch, 2, inner, grad_dtype=np.float16, one_gpu=False)
    captured = _train(monkeypatch, 2, inner, grad_dtype=np.float16, mode="captured", one_gpu=False)
    _assert_same(host, logical)
    _assert_same(eager, host)
    _assert_same(captured, eager)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("grad_dtype", [np.float32, np.float16], ids=["float32 grads", "float16 grads"])
def test_a_scale_whose_reciprocal_is_inexact_divides_as_the_host_step(inner, grad_dtype, monkeypatch):
    host = _train(monkeypatch, 2, inner, grad_dtype=grad_dtype, mode="host", initial_scale=1000.0)
    _assert_same(_train(monkeypatch, 2, inner, grad_dtype=grad_dtype, initial_scale=1000.0), host)


def test_float64_variables_with_float64_gradients_take_the_device_path_too(monkeypatch):
    host = _train(monkeypatch, 2, "adam", grad_dtype=np.float64, variable_dtype=np.float64, mode="host",
                  initial_scale=1000.0)
    _assert_same(_train(monkeypatch, 2, "adam", grad_dtype=np.float64, variable_dtype=np.float64,
                        initial_scale=1000.0), host)


def test_float32_gradients_of_float64_variables_keep_the_host_steps_float32_division(monkeypatch):
    # The host step divides a float32 gradient in float32 and then widens it: the device path, which would
    # divide in float64, is not taken (here nothing is switched off, and the bits are the host step's).
    host = _train(monkeypatch, 2, "adam", variable_dtype=np.float64, mode="host", initial_scale=1000.0)
    _assert_same(_train(monkeypatch, 2, "adam", variable_dtype=np.float64, mode="auto", initial_scale=1000.0), host)


def test_a_skipped_step_leaves_weights_and_slots_bit_identical():
    with gpu_env.mirrored_strategy(2) as strategy:
        w, b, opt = _model(strategy, "adam", True, np.float32)
        step = _step_fn(w, b, opt, np.float32)
        for s in range(3):
            strategy.run(step, args=gpu_env.replica_batches(strategy, s, _X, _Y))
        before = _state(w, b, opt.inner_optimizer)
        strategy.run(step, args=gpu_env.replica_batches(strategy, 3, _X, _Y))  # the inf step
        for a, e in zip(_state(w, b, opt.inner_optimizer), before):
            assert a.tobytes() == e.tobytes()
        assert int(opt.iterations.numpy()) == 3 and opt.dynamic_counter == 0


def _counted_step(n, inner, grad_dtype=np.float32, replicas=2):
    """The simulator's counters of an eager loss-scaled step (the third) of ``n`` variables."""
    with gpu_env.mirrored_strategy(replicas) as strategy:
        with strategy.scope():
            variables = [md.Variable(np.ones(5, np.float32)) for _ in range(n)]
            opt = mixed_precision.LossScaleOptimizer(inner())
        grads = [md.PerReplica([md.device_util.place(np.full(5, 2.0, grad_dtype), d)
                                for d in strategy.extended.worker_devices], strategy.extended.worker_devices)
                 for _ in range(n)]

        def step(*gs):
            opt.apply_gradients(zip(gs, variables))

        for _ in range(2):  # the plan, its tables and its packs are made on the first steps
            strategy.run(step, args=grads)
        cupy.sim.drain()
        gc.collect()  # earlier tests' arrays freed now, not inside the counted step (a free waits)
        gc.disable()
        try:
            cupy.sim.reset_counters()
            strategy.run(step, args=grads)
            counted = cupy.sim.counters()
        finally:
            gc.enable()
        cupy.sim.drain()
        assert int(opt.iterations.numpy()) == 3
        return counted


@pytest.mark.parametrize("inner", [lambda: md.optimizers.SGD(0.1), lambda: md.optimizers.Adam(0.01)],
                         ids=["sgd", "adam"])
@pytest.mark.parametrize("grad_dtype", [np.float32, np.float16], ids=["float32 grads", "float16 grads"])
def test_the_step_is_a_constant_number_of_launches_whatever_the_number_of_variables(inner, grad_dtype):
    if not gpu_env.SIMULATED:
        pytest.skip("launches are counted by the simulated CUDA runtime (run under nsys on a GPU)")
    # Native launches (pack, all-reduce, check, update, scale step) and CuPy kernels (float16 gradients:
    # one conversion of each packed buffer) alike.
    few, many = _counted_step(2, inner, grad_dtype), _counted_step(12, inner, grad_dtype)
    assert few["launches"] == many["launches"] and sum(few["launches"].values()) > 0
    assert few["kernels"] == many["kernels"]


def test_neither_an_sgd_step_nor_an_adam_step_waits_for_the_gpu():
    if not gpu_env.SIMULATED:
        pytest.skip("host waits are counted by the simulated CUDA runtime")
    # SGD's scalars do not follow the step; Adam's bias corrections follow `iterations`, which a skipped
    # step leaves where it was: the GPU picks them by its own count (tests/test_loss_scale_no_wait.py).
    for grad_dtype in (np.float32, np.float16):
        assert _counted_step(4, lambda: md.optimizers.SGD(0.1), grad_dtype)["host_waits"] == 0
        assert _counted_step(4, lambda: md.optimizers.Adam(0.01), grad_dtype)["host_waits"] == 0
