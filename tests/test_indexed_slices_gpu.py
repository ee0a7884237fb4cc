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


def test_md_function_runs_a_step_with_sparse_squares_eagerly_saying_why():
    # Finding the rows the slices name (cupy.unique) waits for the GPU: no capture, the step runs eagerly.
    from mirrored.distribute.function import EagerFallbackWarning

    def train(xp, devices, wrap):
        with gpu_pair():
            strategy = md.MirroredStrategy(devices)
            with strategy.scope():
                e = md.Variable(np.zeros((7, 3), np.float32))
                opt = md.optimizers.Adam(0.01)

            def step(values, indices):
                opt.apply_gradients([(md.IndexedSlices(values, indices, (7, 3)), e)])
            step = wrap(step)
            for s in range(3):
                strategy.run(step, args=(xp.asarray(np.full((2, 3), s + 1, np.float32)),
                                         xp.asarray(np.array([1, 1]))))
            return [cupy.asnumpy(c.read_value()) if xp is cupy else c.numpy() for c in e.values]

    with pytest.warns(EagerFallbackWarning, match="summed_rows"):
        on_gpu = train(cupy, ["/gpu:0", "/gpu:1"], md.function)
    for got, expected in zip(on_gpu, train(np, ["/cpu:0", "/cpu:1"], lambda f: f)):
        np.testing.assert_array_equal(got, expected)
