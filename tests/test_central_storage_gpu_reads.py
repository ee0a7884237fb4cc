"""CentralStorageStrategy's replicas on GPUs read the variables on their own GPU while the optimizer updates them
once: every replica's read must see the value the last update (or write) left, whichever replica's read made
the copy, whatever order the GPU runs the replicas' streams in. On the simulated GPUs each test id draws its own
legal execution order, so the seeds below are several orders per case."""

import contextlib
import warnings

import numpy as np
import pytest

import mirrored as md
from gpu_env import cupy, gpu_pair, skip_unless_gpus
from mirrored.device import config
from mirrored.distribute.function import EagerFallbackWarning

pytestmark = pytest.mark.gpu

CentralStorageStrategy = md.distribute.experimental.CentralStorageStrategy
OPTIMIZERS = {"sgd_momentum": lambda: md.optimizers.SGD(0.05, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.05)}
SEEDS = range(4)  # (each is another test id: another execution order of the simulated GPUs)


@contextlib.contextmanager
def gpu_layout(layout: str):
    """The compute devices of ``layout``: two logical GPUs on one, two GPUs, or two logical GPUs on each of two."""
    if layout != "2x2":
        with gpu_pair(layout):
            yield ["/gpu:0", "/gpu:1"]
        return
    skip_unless_gpus(2)
    config.set_logical_device_configuration("GPU", 0, count=2)
    config.set_logical_device_configuration("GPU", 1, count=2)
    try:
        yield [f"/gpu:{i}" for i in range(4)]
    finally:
        config.set_logical_device_configuration("GPU:0", None)
        config.set_logical_device_configuration("GPU:1", None)


def train(strategy, optimizer, compiled: bool = False, steps: int = 4) -> list:
    """The weights after ``steps`` steps whose gradients read the variables (each replica its own multiple)."""
    with strategy.scope():
        ws = [md.Variable(np.linspace(-1, 1, n, dtype=np.float32) + k / 10) for k, n in enumerate((30, 7))]
        opt = optimizer()

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients([(w.read_value() * (r + 1.0) * 0.5 - 0.1, w) for w in ws])

    fn = md.function(step) if compiled else step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)  # (host variables: md.function runs eagerly)
        for _ in range(steps):
            strategy.run(fn)
    return [np.asarray(md.device_util.to_host(w.read_value())) for w in ws]


@pytest.mark.skipif(cupy is None, reason="no GPU and no simulated GPUs")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout, parameter_device", [
    ("logical", "/cpu:0"), ("logical", "/gpu:0"), ("physical", "/cpu:0"), ("physical", "/gpu:0"),
    ("physical", "/gpu:1"), ("2x2", "/cpu:0"), ("2x2", "/gpu:0")])
def test_gradients_that_read_the_variables_train_as_mirrored_on_the_same_gpus(layout, parameter_device, name,
                                                                             compiled, seed):
    """The weights equal MirroredStrategy's on the same GPUs bit for bit (the same all-reduce, the same update;
    its replicas read their own copies while the update writes them, on logical GPUs too), and the CPU replicas'
    to float32 rounding (another sum order on 4 replicas)."""
    with gpu_layout(layout) as devices:
        central = train(CentralStorageStrategy(devices, parameter_device), OPTIMIZERS[name], compiled)
        mirrored = train(md.MirroredStrategy(devices), OPTIMIZERS[name], compiled)
    cpu = train(CentralStorageStrategy([f"/cpu:{i}" for i in range(len(devices))]), OPTIMIZERS[name])
    for c, m, h in zip(central, mirrored, cpu):
        np.testing.assert_array_equal(c, m)
        np.testing.assert_allclose(c, h, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(cupy is None, reason="no GPU and no simulated GPUs")
@pytest.mark.parametrize("layout, parameter_device", [
    ("logical", "/cpu:0"), ("logical", "/gpu:0"), ("physical", "/cpu:0"), ("physical", "/gpu:0"),
    ("physical", "/gpu:1")])
def test_arrays_derived_from_a_read_keep_their_values_when_the_variables_update(layout, parameter_device):
    """TF's promise: a value read is a value. A slice, a reshape, a transpose or a dtype view of a replica's read,
    held over later updates, keeps the values of its step (they hold the copy's buffer, not the read itself)."""
    with gpu_layout(layout) as devices:
        strategy = CentralStorageStrategy(devices, parameter_device)
        with strategy.scope():
            w = md.Variable(np.arange(6, dtype=np.float32))
            u = md.Variable(np.zeros(3, np.float32))
            opt = md.optimizers.SGD(1.0)
        held = {}

        def step():
            rid = md.get_replica_context().replica_id_in_sync_group
            held.setdefault(rid, []).append((w.read_value()[1:4], w.read_value().reshape(2, 3).T,
                                             w.read_value().view(np.int32)[::2], u.read_value()[1:]))
            opt.apply_gradients([(w.read_value() * 0 + 1, w), (u.read_value() * 0 + 0.5, u)])

        for _ in range(3):
            strategy.run(step)
        for rid in range(len(devices)):
            for k, arrays in enumerate(held[rid]):  # (each step moves w by -2 and u by -1: the replicas' sums)
                expected = np.arange(6, dtype=np.float32) - 2 * k
                got = [np.asarray(md.device_util.to_host(a)) for a in arrays]
                np.testing.assert_array_equal(got[0], expected[1:4])
                np.testing.assert_array_equal(got[1], expected.reshape(2, 3).T)
                np.testing.assert_array_equal(got[2], expected.view(np.int32)[::2])
                np.testing.assert_array_equal(got[3], np.full(2, -k, np.float32))
