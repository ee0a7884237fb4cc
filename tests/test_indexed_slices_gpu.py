"""md.IndexedSlices on GPU replicas (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

CuPy values stay on their GPU: densifying, the reductions (each replica's result on its own GPU) and
Keras' optimizers fed CuPy IndexedSlices give what the CPU replicas and TensorFlow give.
"""

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy, gpu_pair, mirrored_strategy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from test_indexed_slices import REF, _check_optimizer, _sparse_inputs, _train  # noqa: E402


def _on_gpu(s: md.IndexedSlices, ordinal: int = 0) -> md.IndexedSlices:
    with cupy.cuda.Device(ordinal):
        return md.IndexedSlices(cupy.asarray(s.values), cupy.asarray(s.indices), s.dense_shape)


def _device_of(x) -> int:
    return x.data.device_id


@pytest.mark.parametrize("ordinal", [0, 1])
def test_densifying_stays_on_the_values_gpu(ordinal):
    host = md.IndexedSlices(np.arange(12, dtype=np.float32).reshape(4, 3), np.array([3, 0, 3, 5]), (7, 3))
    with gpu_pair():
        s = _on_gpu(host, ordinal)
        assert s.device.endswith(f"GPU:{ordinal}")
        dense = md.convert_to_tensor(s)
        assert isinstance(dense, cupy.ndarray) and _device_of(dense) == ordinal
        np.testing.assert_array_equal(cupy.asnumpy(dense), md.convert_to_tensor(host))
        # Out of range on a GPU: dropped, as TensorFlow's GPU kernel drops it (no host sync to raise).
        wild = md.IndexedSlices(s.values, cupy.asarray(np.array([3, -1, 3, 9])), (7, 3))
        expected = np.zeros((7, 3), np.float32)
        np.add.at(expected, [3, 3], host.values[[0, 2]])
        np.testing.assert_array_equal(cupy.asnumpy(md.convert_to_tensor(wild)), expected)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [2, 3])
def test_reductions_on_gpu_replicas_match_the_cpu_replicas(n, op):
    with gpu_pair(), mirrored_strategy(n) as strategy:
        def step():
            ctx = md.get_replica_context()
            s = _sparse_inputs(ctx.replica_id_in_sync_group, "float32", "int32")
            return ctx.all_reduce(op, md.IndexedSlices(cupy.asarray(s.values), cupy.asarray(s.indices),
                                                       s.dense_shape))
        per_replica = strategy.run(step)
        reduced = strategy.reduce(op, strategy.run(
            lambda: _on_gpu(_sparse_inputs(md.get_replica_context().replica_id_in_sync_group, "float32", "int32"))),
            axis=None)
        got = [(cupy.asnumpy(c.values), cupy.asnumpy(c.indices)) for c in per_replica.values]
        for c in per_replica.values:
            assert isinstance(c.values, cupy.ndarray)
    cpu = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    expected = cpu.reduce(op, cpu.run(lambda: _sparse_inputs(md.get_replica_context().replica_id_in_sync_group,
                                                             "float32", "int32")), axis=None)
    for values, indices in got:
        np.testing.assert_array_equal(values, expected.values)
        np.testing.assert_array_equal(indices, expected.indices)
    assert isinstance(reduced.values, np.ndarray)  # strategy.reduce: on the host, as TF's
    np.testing.assert_array_equal(reduced.values, expected.values)


@pytest.mark.parametrize("name", ["SGD momentum", "Adam", "RMSprop centered momentum", "Adagrad", "SGD clipnorm"])
def test_optimizers_on_gpu_replicas_match_keras(name):
    with gpu_pair():
        opt, e, w = _train(name, 2, xp=cupy)
        _check_optimizer(name, 2, opt, e, w)


def _sparse_train(xp, devices, wrap, name="Adam", steps=6, counted_step=None):
    """A step of Keras optimizer ``name`` on a (7, 3) embedding and a dense (3,) bias whose IndexedSlices
    repeat a row (its squares are a*a + b*b, not (a + b)**2), ``steps`` times; returns the copies of both and
    the simulator's counters of step ``counted_step`` (None: none counted)."""
    import gc

    from gpu_env import SIMULATED

    with gpu_pair():
        strategy = md.MirroredStrategy(devices)
        with strategy.scope():
            e = md.Variable(np.linspace(-1, 1, 21, dtype=np.float32).reshape(7, 3))
            b = md.Variable(np.zeros(3, np.float32))
            opt = {"Adam": md.optimizers.Adam, "RMSprop": md.optimizers.RMSprop,
                   "Adagrad": md.optimizers.Adagrad, "Nadam": md.optimizers.Nadam}[name](0.01)

        def step(values, indices, bias_grad):
            opt.apply_gradients([(md.IndexedSlices(values, indices, (7, 3)), e), (bias_grad, b)])
        step = wrap(step)
        counted = None
        batches = [(xp.asarray(np.arange(9, dtype=np.float32).reshape(3, 3) * (s + 1) - 4),
                    xp.asarray(np.array([1, 4, 1]) if s % 2 else np.array([6, 6, 0])),
                    xp.asarray(np.full(3, 0.5 - s, np.float32))) for s in range(steps)]
        for s, batch in enumerate(batches):
            if s == counted_step and SIMULATED:
                cupy.sim.drain()
                gc.collect()  # earlier arrays freed now, not inside the counted step (a free waits)
                gc.disable()
                cupy.sim.reset_counters()
            try:
                strategy.run(step, args=batch)
            finally:
                if s == counted_step and SIMULATED:
                    counted = cupy.sim.counters()
                    gc.enable()
        state = [cupy.asnumpy(c.read_value()) if xp is cupy else c.numpy() for v in (e, b) for c in v.values]
        return state, counted, step


@pytest.mark.parametrize("name", ["Adam", "RMSprop", "Adagrad", "Nadam"])
def test_md_function_captures_a_sparse_step_of_a_squaring_rule(name):
    # The squares are scattered beside the gradient (no cupy.unique, no host wait): the step captures, and
    # every replay gives the eager step's bits (and the CPU replicas').
    import warnings

    from mirrored.distribute.function import EagerFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        captured, _, run = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], md.function, name)
    assert run.experimental_get_tracing_count() == 1
    eager, _, _ = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], lambda f: f, name)
    on_cpus, _, _ = _sparse_train(np, ["/cpu:0", "/cpu:1"], lambda f: f, name)
    for got, gpu, cpu in zip(captured, eager, on_cpus):
        np.testing.assert_array_equal(got, gpu)
        np.testing.assert_array_equal(got, cpu)


@pytest.mark.parametrize("captured", [False, True])
def test_a_sparse_adam_step_on_gpus_makes_no_host_wait(captured):
    from gpu_env import SIMULATED

    if not SIMULATED:
        pytest.skip("host waits are counted by the simulated CUDA runtime")
    wrap = md.function if captured else (lambda f: f)
    _, counted, _ = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], wrap, counted_step=4)
    assert counted["host_waits"] == 0
    if captured:
        assert counted["graph_launches"] == {0: 1}
