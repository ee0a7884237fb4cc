"""``strategy.reduce`` inside an ``md.function`` step (gpu marker: on the simulated GPUs without a GPU, see
gpu_env.py): every reduce path (across replicas, along an axis, SUM, MEAN, MIN, MAX, at 1 replica as at
several logical GPUs) stays on the GPU, so the step is captured (a fallback warning would fail the test:
pytest turns warnings into errors), and gives the eager step's bits.
"""

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy

pytestmark = pytest.mark.gpu

_rng = np.random.default_rng(5)
_W0 = _rng.standard_normal((6, 3)).astype(np.float32)
_X = _rng.standard_normal((10, 8, 6)).astype(np.float32)  # (step, global batch, features)
_Y = _rng.standard_normal((10, 8, 3)).astype(np.float32)


def _host(x):
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


def _reduced(replicas, op, axis, captured, dtype=np.float32, steps=4):
    """Each step's ``strategy.reduce(op, errors, axis)`` (on the host), with a model that trains between steps."""
    with gpu_env.mirrored_strategy(replicas) as strategy:
        with strategy.scope():
            w = md.Variable(_W0)
            opt = md.optimizers.SGD(0.1)

        def replica_step(x, y):
            err = md.linalg.matmul(x, w.read_value()) - y
            c = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
            opt.apply_gradients([(md.linalg.matmul(x, err * c, transpose_a=True), w)])
            return err.astype(dtype)

        def step(x, y):
            return strategy.reduce(op, strategy.run(replica_step, args=(x, y)), axis=axis)

        run = md.function(step) if captured else step
        results = [_host(run(*gpu_env.replica_batches(strategy, s, _X, _Y))) for s in range(steps)]
        if captured:
            assert run.experimental_get_tracing_count() == 1
        return results, w.numpy()


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX"])
def test_a_reduce_inside_a_captured_step_is_captured_and_gives_the_eager_bits(op, axis, replicas):
    eager, eager_w = _reduced(replicas, op, axis, captured=False)
    captured, captured_w = _reduced(replicas, op, axis, captured=True)
    for got, want in zip(captured, eager):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(captured_w, eager_w)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
@pytest.mark.parametrize("op, axis", [("SUM", None), ("MEAN", None), ("SUM", 0), ("MEAN", 0)])
def test_a_captured_reduce_keeps_tensorflows_dtypes(op, axis, dtype, replicas):
    """MEAN along an axis divides in the value's dtype (integers: float32 up to 16 bits, float64 beyond)."""
    eager, _ = _reduced(replicas, op, axis, captured=False, dtype=dtype)
    captured, _ = _reduced(replicas, op, axis, captured=True, dtype=dtype)
    for got, want in zip(captured, eager):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
