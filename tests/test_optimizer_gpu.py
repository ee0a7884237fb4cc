"""Keras' optimizers on GPU replicas (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

Every optimizer, its clipping and weight decay, on two logical GPUs: the same weights as the values
recorded from TensorFlow (tests/data/keras_optimizers.npz) and as the same run on CPU replicas.
"""

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from test_optimizer_keras_parity import CONFIGS, DATA  # noqa: E402


def _train(name, devices, xp):
    cls, kwargs, dtype = CONFIGS[name]
    strategy = md.MirroredStrategy(devices)
    with strategy.scope():
        w = md.Variable(DATA["w0"].astype(dtype))
        b = md.Variable(DATA["b0"].astype(dtype))
        opt = getattr(md.optimizers, cls)(**kwargs)
    grads_w, grads_b = DATA["grads_w"].astype(dtype), DATA["grads_b"].astype(dtype)
    for s in range(grads_w.shape[0]):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(xp.asarray(grads_w[s, r]), w), (xp.asarray(grads_b[s, r]), b)])
        strategy.run(step)
    return [np.asarray(c.numpy()) for var in (w, b) for c in var.values]


@pytest.mark.parametrize("name", ["SGD nesterov", "Adam", "AdamW", "RMSprop centered momentum", "Adagrad", "Nadam",
                                  "SGD clipnorm", "Adam weight_decay global_clipnorm", "RMSprop clipvalue weight_decay"])
def test_gpu_replicas_match_keras_and_the_cpu_replicas(name):
    md.config.set_logical_device_configuration("GPU", 0, count=2)
    try:
        on_gpu = _train(name, ["/gpu:0", "/gpu:1"], cupy)
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)
    on_cpu = _train(name, ["/cpu:0", "/cpu:1"], np)
    w, b = DATA[f"{name}|2|w"], DATA[f"{name}|2|b"]
    for got, cpu, expected in zip(on_gpu, on_cpu, (w, w, b, b)):
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-7)
        np.testing.assert_allclose(got, cpu, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(on_gpu[0], on_gpu[1])  # the copies stay bit-identical
    np.testing.assert_array_equal(on_gpu[2], on_gpu[3])
