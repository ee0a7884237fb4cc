"""ScheduleFreeAdamW's fused update on GPUs (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

Its CUDA kernel against the host kernel bit for bit is a case of tests/test_optimizer_gpu.py's kernel test (with
every rule), and its launches per step a case of that file's launch-count test. Here: two GPU replicas against
Keras and the CPU replicas; steps captured by md.function replay the eager steps' bits while the warmup, a
schedule and the average's weight 1/t change at every step (the scalars are uploaded before each replay); a
loss-scaled step decided on the device (skipped, unscaled, its scalars selected from the device's own count)
gives the host-decided bits, eagerly and captured.
"""

import numpy as np
import pytest

from gpu_env import SIMULATED, SKIP_REASON, cupy, gpu_pair

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from test_optimizers_schedule_free import DATA, _train  # noqa: E402


@pytest.mark.parametrize("name", ["weight_decay clipnorm warmup", "use_ema overwrite loss_scale",
                                  "use_ema accumulation warmup", "float64 warmup weight_decay",
                                  "CosineDecay warmup_steps"])
def test_gpu_replicas_match_keras_and_the_cpu_replicas(name):
    with gpu_pair():
        _, w, b = _train(name, 2, cupy, ["/gpu:0", "/gpu:1"])
        on_gpu = [np.asarray(c.numpy()) for var in (w, b) for c in var.values]
    _, w, b = _train(name, 2)
    on_cpu = [np.asarray(c.numpy()) for var in (w, b) for c in var.values]
    rtol = 1e-13 if "float64" in name else 2e-6
    for got, cpu, expected in zip(on_gpu, on_cpu, (DATA[f"{name}|2|w"],) * 2 + (DATA[f"{name}|2|b"],) * 2):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * 1e-1)
        np.testing.assert_allclose(got, cpu, rtol=rtol / 2, atol=rtol * 1e-1)
    np.testing.assert_array_equal(on_gpu[0], on_gpu[1])  # the copies stay bit-identical
    np.testing.assert_array_equal(on_gpu[2], on_gpu[3])


def _steps(captured: bool, steps: int = 7):
    """``steps`` steps on two logical GPUs (a float32 and a float64 variable, a schedule of the step, warmup,
    weight decay), through md.function when ``captured``: every copy of the weights and slots."""
    md.config.set_logical_device_configuration("GPU", 0, count=2)
    try:
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with strategy.scope():
            w = md.Variable(np.linspace(-1, 1, 8, dtype=np.float32))
            b = md.Variable(np.linspace(0, 1, 3, dtype=np.float64))
            opt = md.optimizers.ScheduleFreeAdamW(lambda step: 0.05 * 0.8 ** step, warmup_steps=4, weight_decay=0.1)

        def step(g):
            opt.apply_gradients([(g * g - w.read_value(), w), (b.read_value() * 0.5 - 0.25, b)])

        run = md.function(step) if captured else step
        devices = strategy.extended.worker_devices
        for s in range(steps):
            g = md.PerReplica([md.device_util.place(np.linspace(s, r + 1, 8, dtype=np.float32), d)
                               for r, d in enumerate(devices)], devices)
            replay = captured and s == steps - 1 and SIMULATED
            if replay:
                cupy.sim.drain()
                cupy.sim.reset_counters()
            strategy.run(run, args=(g,))
            if replay:  # the last step was a replay of the captured graph: no launch from Python
                counted = cupy.sim.counters()
                assert counted["graph_launches"] == {0: 1} and sum(counted["launches"].values()) == 0
        assert int(opt.iterations.numpy()) == steps
        return [np.asarray(c.numpy()) for v in (w, b) for s in (v, opt.get_slot(v, "momentum"),
                                                               opt.get_slot(v, "velocity")) for c in s.values]
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


def test_captured_steps_replay_the_eager_steps_bits():
    for got, expected in zip(_steps(captured=True), _steps(captured=False)):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mode", ["device", "captured"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_loss_scaled_step_on_the_device_gives_the_host_decided_bits(replicas, mode, monkeypatch):
    """LossScaleOptimizer(ScheduleFreeAdamW) on GPU replicas: inf and nan steps skipped on the device (which then
    holds the count), the scale halved and grown; eagerly and replayed by md.function, the bits of the steps
    the host decides."""
    from test_mixed_precision_device import _assert_same, _train as _train_loss_scaled

    host = _train_loss_scaled(monkeypatch, replicas, "schedule_free_adamw", mode="host")
    _assert_same(_train_loss_scaled(monkeypatch, replicas, "schedule_free_adamw", mode=mode), host)
    assert host[1][-1][2] == 8  # (two of ten steps skipped)
