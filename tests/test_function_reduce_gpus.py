"""TensorFlow's canonical outer step on one replica per physical GPU (NCCL), captured by ``md.function``
(gpu marker: on 2 and 4 simulated GPUs without a GPU, see gpu_env.py)::

    @md.function
    def train_step(x, y):
        per_replica_losses = strategy.run(step_fn, args=(x, y))
        return strategy.reduce("SUM", per_replica_losses, axis=None)

The reduce to one device inside the step is NCCL's reduce, which each GPU's graph holds, so the step is
captured (a fallback warning would fail the test: pytest turns warnings into errors), a replay is one graph
launch per GPU, and 10 steps give the eager steps' bits and TensorFlow's values. So do
``extended.reduce_to`` / ``batch_reduce_to`` to any replica's GPU, and a reduce of
``experimental_local_results``.
"""

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy

pytestmark = pytest.mark.gpu

_rng = np.random.default_rng(13)
_W0 = _rng.standard_normal((6, 3)).astype(np.float32)
_B0 = _rng.standard_normal(3).astype(np.float32)
_X = _rng.standard_normal((10, 8, 6)).astype(np.float32)  # (step, global batch, features)
_Y = _rng.standard_normal((10, 8, 3)).astype(np.float32)
_OPTIMIZERS = {"sgd": lambda: md.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.01)}


def _host(x):
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


def _replica_step(w, b, opt):
    """A least-squares step: per-example squared errors (rows, 3), after applying the gradients of their mean."""
    def step(x, y):
        err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
        scale = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
        opt.apply_gradients([(md.linalg.matmul(x, err, transpose_a=True) * scale, w), (err.sum(axis=0) * scale, b)])
        return err * err
    return step


def _reference(w, b, step, op, axis, gpus):
    """NumPy's value of TF's ``strategy.reduce(op, per-example squared errors, axis)`` for weights (w, b)."""
    squares = (_X[step] @ w + b - _Y[step]) ** 2
    if axis is not None:  # MEAN along the axis: over the global batch, every replica's rows counted
        return squares.sum(axis=0) if op == "SUM" else squares.mean(axis=0)
    per_replica = squares.reshape(gpus, -1, 3)
    return per_replica.sum(axis=0) if op == "SUM" else per_replica.sum(axis=0) / gpus


def _train(gpus, op, axis, optimizer, captured, steps=10):
    """Each step's reduced loss (copied to the host) and the weights before it, the final weights, and the
    replay's counters (captured) on the simulator."""
    strategy = gpu_env.nccl_strategy(gpus)
    with strategy.scope():
        w, b = md.Variable(_W0), md.Variable(_B0)
        opt = _OPTIMIZERS[optimizer]()
    step_fn = _replica_step(w, b, opt)

    def train_step(x, y):
        return strategy.reduce(op, strategy.run(step_fn, args=(x, y)), axis=axis)

    run = md.function(train_step) if captured else train_step
    losses, before, counted, results = [], [], None, []
    for s in range(steps):
        before.append((w.numpy(), b.numpy()))
        x, y = gpu_env.replica_batches(strategy, s, _X, _Y)
        count = captured and gpu_env.SIMULATED and s == 3  # a replay (step 0 warms up and captures)
        if count:
            cupy.sim.drain()
            cupy.sim.reset_counters()
        loss = run(x, y)
        if count:
            counted = cupy.sim.counters()
        results.append(loss)
        losses.append(_host(loss).copy())
    if captured:
        assert run.experimental_get_tracing_count() == 1
        # TF's canonical step returns the reduce's result: on the first replica's GPU inside the graph, the
        # same buffer each replay (a view the next replay overwrites, docs/function.md)
        assert all(isinstance(r, cupy.ndarray) and r.device.id == 0 for r in results[1:])
        assert len({r.data.ptr for r in results[1:]}) == 1
    else:
        assert all(type(r) is np.ndarray for r in results)  # eagerly on the host, as TF's default device
    return losses, before, [w.numpy(), b.numpy()], counted


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("op, axis", [("SUM", None), ("MEAN", None), ("SUM", 0), ("MEAN", 0)])
def test_the_canonical_outer_step_is_captured_and_gives_the_eager_bits_and_tensorflows_values(op, axis, optimizer,
                                                                                            gpus):
    with gpu_env.physical_gpus(gpus):
        eager, before, eager_weights, _ = _train(gpus, op, axis, optimizer, captured=False)
        captured, _, captured_weights, counted = _train(gpus, op, axis, optimizer, captured=True)
    for got, want in zip(captured, eager):
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    for got, want in zip(captured_weights, eager_weights):
        np.testing.assert_array_equal(got, want)
    for s, (got, (w, b)) in enumerate(zip(eager, before)):
        np.testing.assert_allclose(got, _reference(w, b, s, op, axis, gpus), rtol=2e-5, atol=1e-5)
    if counted is not None:
        assert counted["graph_launches"] == {g: 1 for g in range(gpus)}
        assert sum(counted["launches"].values()) == 0 and sum(counted["kernels"].values()) == 0


def _reduce_patterns(strategy, gpus, step_fn):
    """TF's other ways to reduce a step's PerReplica result in cross-replica context, to GPUs."""
    last = f"/gpu:{gpus - 1}"

    def patterns(x, y):
        per_replica = strategy.run(step_fn, args=(x, y))
        ext = strategy.extended
        return (ext.reduce_to("SUM", per_replica, "/gpu:0"),
                ext.reduce_to("MEAN", per_replica, last),
                ext.reduce_to("MAX", per_replica, per_replica),
                ext.batch_reduce_to("SUM", [(per_replica, last), (per_replica, per_replica),
                                            (per_replica, "/gpu:1")]),
                strategy.reduce("SUM", md.PerReplica(list(strategy.experimental_local_results(per_replica))),
                                axis=None))
    return patterns


def _flat(result):
    """(device ordinal, host copy) of every array in ``result``, in order; a Mirrored's components each."""
    if isinstance(result, (list, tuple)):
        return [leaf for r in result for leaf in _flat(r)]
    if isinstance(result, md.Mirrored):
        return _flat(list(result.values))
    return [(result.device.id if isinstance(result, cupy.ndarray) else "host", _host(result).copy())]


@pytest.mark.parametrize("gpus", [2, 4])
def test_reduce_to_batch_reduce_to_and_local_results_are_captured_on_their_destinations(gpus):
    runs = {}
    with gpu_env.physical_gpus(gpus):
        for captured in (False, True):
            strategy = gpu_env.nccl_strategy(gpus)
            with strategy.scope():
                w, b = md.Variable(_W0), md.Variable(_B0)
                opt = md.optimizers.SGD(0.1)
            patterns = _reduce_patterns(strategy, gpus, _replica_step(w, b, opt))
            run = md.function(patterns) if captured else patterns
            runs[captured] = [_flat(run(*gpu_env.replica_batches(strategy, s, _X, _Y))) for s in range(5)]
            if captured:
                assert run.experimental_get_tracing_count() == 1
    last = gpus - 1
    every = list(range(gpus))
    # where TF puts each result: the destination's device (the local results' reduce: the default device)
    want_devices = [0, last] + every + [last] + every + [1]
    for step, (eager, captured) in enumerate(zip(runs[False], runs[True])):
        assert [d for d, _ in eager] == want_devices + ["host"]
        # (the first call is the eager warm-up; replays' strategy.reduce is on the first replica's GPU)
        assert [d for d, _ in captured] == want_devices + ["host" if step == 0 else 0]
        for (_, got), (_, want) in zip(captured, eager):
            np.testing.assert_array_equal(got, want)
        if step == 0:  # the weights of step 0 are the initial ones: NumPy's values of the reductions
            squares = ((_X[0] @ _W0 + _B0 - _Y[0]) ** 2).reshape(gpus, -1, 3)
            sums, maxes = squares.sum(axis=0), squares.max(axis=0)
            want = [sums, sums / gpus] + [maxes] * gpus + [sums] * (gpus + 2) + [sums]
            for (_, got), w in zip(eager, want):
                np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
def test_a_captured_reduce_across_gpus_keeps_tensorflows_dtypes(op, dtype):
    """NCCL's reduce of each dtype (the MEAN of integers: a float64 division after the sum, as TF's)."""
    runs = {}
    with gpu_env.physical_gpus(2):
        for captured in (False, True):
            strategy = gpu_env.nccl_strategy(2)

            def replica_step(x):
                return (x * 4).astype(dtype)

            def step(x):
                return strategy.reduce(op, strategy.run(replica_step, args=(x,)), axis=None)

            run = md.function(step) if captured else step
            runs[captured] = [_host(run(*gpu_env.replica_batches(strategy, s, _X))).copy() for s in range(4)]
    for s, (got, want) in enumerate(zip(runs[True], runs[False])):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        parts = (_X[s] * 4).astype(dtype).reshape(2, -1, 6)
        ref = parts.max(axis=0) if op == "MAX" else parts.sum(axis=0, dtype=dtype)
        if op == "MEAN":
            ref = ref.astype(np.float64) / 2 if np.dtype(dtype).kind == "i" else ref / dtype(2)
        assert want.dtype == ref.dtype
        np.testing.assert_allclose(want, ref, rtol=2e-3 if dtype == np.float16 else 1e-6)
