"""A replica that computes on a non-blocking stream it made (docs/gpu_ordering.md, "A stream a replica
makes"): such a stream is ordered with nothing queued before it, as in CuPy, so the replica orders it after
its own stream once on entry. Its reads then see the variables' last update, its collectives are ordered
by the strategy, and it trains bit for bit as a replica computing on the stream the strategy gave it. On the
simulated GPUs each test id draws its own legal execution order, and freed memory is poisoned: a read left
unordered shows as wrong weights."""

import numpy as np
import pytest

import mirrored as md
from gpu_env import cupy, gpu_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy is None, reason="no GPU and no simulated GPUs")]

SEEDS = range(4)  # (each is another test id: another execution order of the simulated GPUs)
OPTIMIZERS = {"sgd_momentum": lambda: md.optimizers.SGD(0.05, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.05)}


def train(strategy, optimizer, own_stream: bool, steps: int = 4) -> list:
    """The weights after ``steps`` steps whose gradients read the variables; with ``own_stream`` each
    replica computes them, and applies them, on a non-blocking stream it makes, ordered as documented."""
    with strategy.scope():
        ws = [md.Variable(np.linspace(-1, 1, n, dtype=np.float32) + k / 10) for k, n in enumerate((30, 7))]
        opt = optimizer()

    def gradients():
        r = md.get_replica_context().replica_id_in_sync_group
        return [(w.read_value() * (r + 1.0) * 0.5 - 0.1, w) for w in ws]

    def step():
        if not own_stream:
            opt.apply_gradients(gradients())
            return
        mine = cupy.cuda.Stream(non_blocking=True)
        mine.wait_event(cupy.cuda.get_current_stream().record())  # (the documented order on entry)
        with mine:
            opt.apply_gradients(gradients())

    for _ in range(steps):
        strategy.run(step)
    return [np.asarray(md.device_util.to_host(w.read_value())) for w in ws]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["logical", "physical"])
def test_a_replica_on_a_stream_of_its_own_ordered_on_entry_trains_as_on_its_given_stream(layout, name, seed):
    with gpu_pair(layout):
        devices = ["/gpu:0", "/gpu:1"]
        given = train(md.MirroredStrategy(devices), OPTIMIZERS[name], own_stream=False)
        own = train(md.MirroredStrategy(devices), OPTIMIZERS[name], own_stream=True)
    cpu = train(md.MirroredStrategy(["/cpu:0", "/cpu:1"]), OPTIMIZERS[name], own_stream=False)
    for o, g, c in zip(own, given, cpu):
        np.testing.assert_array_equal(o, g)
        np.testing.assert_allclose(o, c, rtol=1e-6, atol=1e-6)
