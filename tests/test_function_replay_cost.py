"""What one md.function replay costs the host, whatever the GPU still has queued (gpu marker: on the simulated
GPUs without a GPU, see gpu_env.py).

A replay is a few asynchronous copies, event records and waits, and one graph launch per GPU
(docs/function.md, "What a call does"). It must neither wait for the GPU nor leave anything behind whose
release a later call pays for: a training loop runs the host ahead of the GPU, hundreds of replays deep, and
then waits (it reads a loss); the replay after that wait starts while the GPU has nothing to run, so any work
it does on account of the replays queued before (releasing their staging buffers and events, one by one) is
time the GPU idles. On an H100 that made every replay of bench/train_step.py ~0.4 ms slower than before: each
replay staged the optimizer's scalars in a pinned buffer of its own, with an event, kept in a queue that only
later uploads emptied.

The simulator holds every kernel until the host waits, so a host that queues replays without waiting is as
far ahead of the GPU as it gets; its counters give each runtime call a replay makes.
"""

import gc

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy
from mirrored.train import mixed_precision
from mirrored.train.optimizers import step_window

pytestmark = pytest.mark.gpu

_AHEAD = (40, 80)  # replays queued before the host waits (more than a loss-scaled step's readback slots)
_rng = np.random.default_rng(33)
_SIZES = [6, 5, 5, 3]  # three dense layers: six parameter tensors
_PARAMS = [a for i, o in zip(_SIZES, _SIZES[1:]) for a in (_rng.standard_normal((i, o)) / np.sqrt(i),
                                                           _rng.standard_normal(o) * 0.1)]
_X = _rng.standard_normal((12, 8, _SIZES[0]))  # (step, global batch, features)
_Y = _rng.standard_normal((12, 8, _SIZES[-1]))

_OPTIMIZERS = {
    "sgd momentum": lambda: md.optimizers.SGD(0.05, momentum=0.9),  # scalars fixed: uploaded as they are
    "adam": lambda: md.optimizers.Adam(0.01),  # scalars that follow the step
    # rows of scalars the GPU selects from (the step is known on the GPU only)
    "loss-scaled adam": lambda: mixed_precision.LossScaleOptimizer(md.optimizers.Adam(0.01), dynamic_growth_steps=3),
}


def _grads(weights, x, y, opt):
    """A tanh network of bench/train_step.py's kind: hand-written gradients of the squared error."""
    acts = [x]
    for k in range(0, len(weights), 2):
        h = md.linalg.matmul(acts[-1], weights[k]) + weights[k + 1]
        acts.append(cupy.tanh(h) if k + 2 < len(weights) else h)
    scale = 2.0 / (x.shape[0] * md.get_replica_context().num_replicas_in_sync)
    delta = (acts[-1] - y) * np.float32(scale)
    if isinstance(opt, mixed_precision.LossScaleOptimizer):
        delta = opt.scale_loss(delta)
    grads = [None] * len(weights)
    for k in range(len(weights) - 2, -1, -2):
        grads[k] = md.linalg.matmul(acts[k // 2], delta, transpose_a=True)
        grads[k + 1] = delta.sum(axis=0)
        if k:
            delta = md.linalg.matmul(delta, weights[k], transpose_b=True) * (1 - acts[k // 2] ** 2)
    return grads


def _step_fn(variables, opt):
    def step(x, y):  # (the weights read are dropped before the update, which writes them in place)
        opt.apply_gradients(zip(_grads([v.read_value() for v in variables], x, y, opt), variables))
    return step


def _counted(fn):
    """The simulator's counters of ``fn()``'s runtime calls (no garbage collection inside: a free waits)."""
    gc.collect()
    gc.disable()
    try:
        cupy.sim.reset_counters()
        fn()
        return cupy.sim.counters()
    finally:
        gc.enable()


@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
@pytest.mark.parametrize("layout", ["logical-1", "logical-2", "physical-2"])
def test_a_replay_after_the_host_ran_far_ahead_costs_what_any_replay_costs(layout, optimizer):
    if not gpu_env.SIMULATED:
        pytest.skip("the runtime calls are counted by the simulated CUDA runtime")
    if layout == "physical-2":
        gpu_env.nccl_strategy(2)  # (skips without NCCL)
    with gpu_env.layout_strategy(layout) as strategy:
        with strategy.scope():
            variables = [md.Variable(p.astype(np.float32)) for p in _PARAMS]
            opt = _OPTIMIZERS[optimizer]()
        run = md.function(_step_fn(variables, opt))
        batches = [gpu_env.replica_batches(strategy, s, _X.astype(np.float32), _Y.astype(np.float32))
                   for s in range(len(_X))]
        for s in range(4):  # warm-up, capture, replays
            strategy.run(run, args=batches[s])
        cupy.sim.drain()
        quiet = _counted(lambda: strategy.run(run, args=batches[4]))
        after, s = {}, 5
        for ahead in _AHEAD:
            for _ in range(ahead):  # the host ahead of the GPU by this many replays ...
                strategy.run(run, args=batches[s % len(batches)])
                s += 1
            cupy.sim.drain()  # ... then it waits (a loss read, a checkpoint)
            after[ahead] = _counted(lambda: strategy.run(run, args=batches[s % len(batches)]))
        assert run._captures == 1

        # One graph launch per GPU, no kernel from Python, no host wait, no event made or destroyed (each replay
        # re-records the capture's events) ...
        ordinals = {md.device_util.physical_ordinal(d) for d in strategy.extended.worker_devices}
        for counted in (quiet, *after.values()):
            assert counted["graph_launches"] == {o: 1 for o in ordinals}, counted
            assert not counted["launches"] and not counted["kernels"], counted
            assert counted["host_waits"] == 0, counted
            for call in ("cudaEventCreate", "cudaEventCreateWithFlags", "cudaEventDestroy"):
                assert call not in counted["calls"], (call, counted["calls"])
        # ... and the same calls however far ahead the host was: nothing released on behalf of earlier replays.
        # (But for a loss-scaled step's replay, which also takes the GPU's counts of steps that arrived meanwhile
        # from its readback: an event query each, its slots at most.)
        def calls(counted):
            if optimizer == "loss-scaled adam":
                assert counted["calls"]["cudaEventQuery"] <= quiet["calls"]["cudaEventQuery"] + step_window.MAX_ROWS
                return {k: v for k, v in counted["calls"].items() if k != "cudaEventQuery"}
            return counted["calls"]

        for counted in after.values():
            assert calls(counted) == calls(quiet) and counted["stream_ops"] == quiet["stream_ops"]


@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_a_replay_stages_no_pinned_memory_of_its_own_and_steps_as_the_eager_step(monkeypatch, optimizer):
    """The scalars go straight from pageable memory (CUDA stages a copy that small itself), and the replays
    still take each step's scalars: the weights are the eager step's bits after every call."""
    with gpu_env.layout_strategy("logical-2") as strategy:
        models = []
        for _ in range(2):
            with strategy.scope():
                variables = [md.Variable(p.astype(np.float32)) for p in _PARAMS]
                models.append((variables, _OPTIMIZERS[optimizer]()))
        run = md.function(_step_fn(*models[0]))
        step = _step_fn(*models[1])
        batches = [gpu_env.replica_batches(strategy, s, _X.astype(np.float32), _Y.astype(np.float32))
                   for s in range(8)]
        for s in range(3):  # warm-up, capture, a replay
            strategy.run(run, args=batches[s])
            strategy.run(step, args=batches[s])
        staged = []
        allocate = cupy.cuda.alloc_pinned_memory
        monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", lambda n: staged.append(n) or allocate(n))
        for s in range(3, 8):
            strategy.run(run, args=batches[s])
            assert not staged
            monkeypatch.undo()  # (the eager step may stage what it likes)
            strategy.run(step, args=batches[s])
            monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", lambda n: staged.append(n) or allocate(n))
            for captured, eager in zip(*(variables for variables, _ in models)):
                np.testing.assert_array_equal(captured.numpy(), eager.numpy())
        assert run._captures == 1
        assert int(models[0][1].iterations.numpy()) == int(models[1][1].iterations.numpy()) == 8
