"""LossScaleOptimizer on GPU replicas: float16 CuPy gradients reduced on the GPUs, checked, unscaled into float32
updates of the copies (marker ``gpu``; skipped without a GPU)."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (pip install cupy-cuda13x)")

import mirrored as md  # noqa: E402
from gpu_env import gpu_pair  # noqa: E402

if not md.config.list_physical_devices("GPU"):
    pytest.skip("no GPU visible", allow_module_level=True)


@pytest.fixture
def two_logical_gpus():
    with gpu_pair():
        yield md.MirroredStrategy(["/gpu:0", "/gpu:1"])


def test_float16_gradients_on_gpu_replicas(two_logical_gpus):
    strategy = two_logical_gpus
    with strategy.scope():
        w = md.Variable(np.zeros(4, np.float32))
        opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.SGD(1.0), initial_scale=8.0)

    def step(overflow):
        g = cupy.full(4, 8.0, cupy.float16)
        if overflow and md.get_replica_context().replica_id_in_sync_group == 1:
            g[2] = cupy.inf
        return opt.apply_gradients([(g, w)])

    assert int(strategy.run(step, args=(False,))) == 1  # iterations (Keras 3 returns the variable)
    assert w.numpy().tolist() == [-2.0] * 4  # (8 + 8) / 8
    assert int(strategy.run(step, args=(True,))) == 1  # skipped on both replicas
    assert w.numpy().tolist() == [-2.0] * 4 and float(opt.loss_scale) == 4.0
    for copy in w.values:
        value = copy.read_value()
        assert isinstance(value, cupy.ndarray) and value.dtype == cupy.float32
