"""md.function: a step captured once per input signature and replayed as CUDA graphs (gpu marker:
on the simulated GPUs without a GPU, see gpu_env.py), and its eager fallback on CPU strategies.

The captured step must give the eager step's bits; a replay must be one graph launch per GPU and
no kernel launch from Python; a new signature captures again; a step that cannot be captured
runs eagerly with one warning that names the operation that broke the capture.
"""

import contextlib

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy
from mirrored.distribute.function import EagerFallbackWarning

_rng = np.random.default_rng(7)
_W0 = _rng.standard_normal((6, 3)).astype(np.float32)
_B0 = _rng.standard_normal(3).astype(np.float32)
_X = _rng.standard_normal((10, 8, 6)).astype(np.float32)  # (step, global batch, features)
_Y = _rng.standard_normal((10, 8, 3)).astype(np.float32)


def _model(strategy, optimizer):
    with strategy.scope():
        w, b = md.Variable(_W0), md.Variable(_B0)
        opt = {"sgd": lambda: md.optimizers.SGD(0.1, momentum=0.9),
               "adam": lambda: md.optimizers.Adam(0.01)}[optimizer]()
    return w, b, opt


def _step_fn(w, b, opt):
    """A linear least-squares step: forward, hand-written gradients, apply_gradients."""
    def step(x, y):
        xp = cupy if isinstance(x, cupy.ndarray) else np
        # md.linalg.matmul: mirrored's cuBLAS, which a capture records (CuPy's `@` is refused there).
        err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
        scale = np.float32(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
        opt.apply_gradients([(md.linalg.matmul(x, err, transpose_a=True) * scale, w), (err.sum(axis=0) * scale, b)])
        return xp.sum(err * err)
    return step


def _captured_and_eager(strategy, optimizer="sgd"):
    """Two copies of the model: the captured one's (w, b), the eager one's w, and each one's step."""
    w, b, opt = _model(strategy, optimizer)
    w_eager, b_eager, opt_eager = _model(strategy, optimizer)
    return (w, b), w_eager, md.function(_step_fn(w, b, opt)), _step_fn(w_eager, b_eager, opt_eager)


def _runs_eagerly_warning(strategy, step, opt, match):
    """md.function(step) runs three batches eagerly, warning once with ``match``, and every step updates."""
    run = md.function(step)
    with pytest.warns(EagerFallbackWarning, match=match):
        for s in range(3):
            strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y))
    assert int(opt.iterations.numpy()) == 3


def _train(replicas, optimizer, captured, steps=10, one_gpu=True, assign_at=None):
    with gpu_env.mirrored_strategy(replicas, one_gpu) as strategy:
        w, b, opt = _model(strategy, optimizer)
        step = _step_fn(w, b, opt)
        run = md.function(step) if captured else step
        losses = []
        for s in range(steps):
            if assign_at is not None and s == assign_at[0]:
                opt.iterations.assign(assign_at[1])
            x, y = gpu_env.replica_batches(strategy, s, _X, _Y)
            loss = strategy.run(run, args=(x, y))
            losses.append(strategy.reduce(md.ReduceOp.SUM, loss, axis=None))
        return [c.numpy() for v in (w, b) for c in v.values], losses, opt


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_captured_step_gives_the_eager_steps_bits(replicas, optimizer):
    eager, eager_losses, _ = _train(replicas, optimizer, captured=False)
    captured, captured_losses, opt = _train(replicas, optimizer, captured=True)
    for e, c in zip(eager, captured):
        np.testing.assert_array_equal(c, e)
    np.testing.assert_array_equal(captured_losses, eager_losses)
    assert int(opt.iterations.numpy()) == 10


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_captured_float32_update_is_the_fused_kernel_reading_device_scalars(replicas, monkeypatch):
    from mirrored.train.optimizers import base

    element_wise = []
    original = base._Plan._apply_each
    monkeypatch.setattr(base._Plan, "_apply_each", lambda self, *a: (element_wise.append(a), original(self, *a))[1])
    eager, eager_losses, _ = _train(replicas, "adam", captured=False)
    captured, captured_losses, _ = _train(replicas, "adam", captured=True)
    assert element_wise == []  # eager and captured steps alike: one fused launch per GPU and dtype
    for e, c in zip(eager, captured):
        np.testing.assert_array_equal(c, e)
    np.testing.assert_array_equal(captured_losses, eager_losses)


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2])
def test_iterations_assigned_between_replays_gives_the_next_replay_that_steps_scalars(replicas):
    # Adam's bias corrections depend on the step: after `iterations` is assigned (as a checkpoint's
    # restore does), the replay hook must count from the new value, as the eager step does.
    eager, eager_losses, _ = _train(replicas, "adam", captured=False, assign_at=(5, 1000))
    captured, captured_losses, opt = _train(replicas, "adam", captured=True, assign_at=(5, 1000))
    for e, c in zip(eager, captured):
        np.testing.assert_array_equal(c, e)
    np.testing.assert_array_equal(captured_losses, eager_losses)
    assert int(opt.iterations.numpy()) == 1005


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_on_two_gpus_each_gpu_replays_its_own_graph_with_nccl_inside(optimizer):
    if gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    gpu_env.nccl_strategy(2)  # (skips without NCCL)
    eager, eager_losses, _ = _train(2, optimizer, captured=False, one_gpu=False)
    captured, captured_losses, _ = _train(2, optimizer, captured=True, one_gpu=False)
    for e, c in zip(eager, captured):
        np.testing.assert_array_equal(c, e)
    np.testing.assert_array_equal(captured_losses, eager_losses)


@pytest.mark.gpu
@pytest.mark.parametrize("one_gpu", [True, False], ids=["logical GPUs", "two GPUs"])
def test_a_replay_is_one_graph_launch_per_gpu_and_no_kernel_launch(one_gpu):
    if not gpu_env.SIMULATED:
        pytest.skip("launches are counted by the simulated CUDA runtime (run under nsys on a GPU)")
    with gpu_env.mirrored_strategy(2, one_gpu) as strategy:
        w, b, opt = _model(strategy, "adam")
        run = md.function(_step_fn(w, b, opt))
        for s in range(2):  # warm-up and capture, then the first replay
            strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y))
        x, y = gpu_env.replica_batches(strategy, 2, _X, _Y)
        cupy.sim.drain()
        cupy.sim.reset_counters()
        strategy.run(run, args=(x, y))
        counted = cupy.sim.counters()
        assert counted["graph_launches"] == ({0: 1} if one_gpu else {0: 1, 1: 1})
        # Replicas sharing GPU 0 are a branch each beside the step stream's; a GPU's only replica is on it.
        assert counted["graph_branches"] == ({0: 3} if one_gpu else {0: 1, 1: 1})
        assert sum(counted["launches"].values()) == 0 and sum(counted["kernels"].values()) == 0
        assert sum(counted["blas"].values()) == 0  # the step's cuBLAS products are inside the graphs
        assert run.experimental_get_tracing_count() == 1


def _replica_batches_of(strategy, s):
    """Step ``s``'s batch split over the strategy's replicas (the global batch of 8 rows)."""
    return gpu_env.replica_batches(strategy, s % len(_X), _X, _Y)


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_replicas_sharing_a_gpu_are_parallel_branches_of_its_graph_and_give_the_eager_bits(replicas, optimizer):
    """Two strategy.run per step (an evaluation with an all-reduce, then a training step), each forking
    the replicas off GPU 0's step stream and joining them at every collective and at the end, with a
    reduce after each on the step stream: the replay is one graph whose branches are the step stream's
    and one per replica, and 10 steps give the eager steps' bits."""
    results = {}
    for captured in (False, True):
        with gpu_env.mirrored_strategy(replicas) as strategy:
            w, b, opt = _model(strategy, optimizer)
            step = _step_fn(w, b, opt)

            def evaluate(x, y):
                err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
                return md.get_replica_context().all_reduce(md.ReduceOp.SUM, (err * err).sum())

            def two_steps(first, second):
                loss = strategy.reduce(md.ReduceOp.SUM, strategy.run(evaluate, args=first), axis=None)
                return loss + strategy.reduce(md.ReduceOp.SUM, strategy.run(step, args=second), axis=None)

            run = md.function(two_steps) if captured else two_steps
            losses = []
            for s in range(10):
                if captured and gpu_env.SIMULATED and s == 2:  # the first replay (after warm-up and capture)
                    cupy.sim.drain()
                    cupy.sim.reset_counters()
                first, second = _replica_batches_of(strategy, 2 * s), _replica_batches_of(strategy, 2 * s + 1)
                losses.append(float(run(first, second)))
                if captured and gpu_env.SIMULATED and s == 2:
                    counted = cupy.sim.counters()
                    assert counted["graph_launches"] == {0: 1}
                    assert counted["graph_branches"] == {0: 1 + replicas}
            results[captured] = losses, [c.numpy() for v in (w, b) for c in v.values]
            if captured:
                assert run.experimental_get_tracing_count() == 1
    assert results[True][0] == results[False][0]
    for got, want in zip(results[True][1], results[False][1]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [2, 4])
def test_an_array_one_replica_hands_to_all_is_read_before_its_memory_is_reused(replicas):
    """A merge_fn returning replica 0's array gives it to every replica: the others read it on their own
    branches, two collectives later, after replica 0 dropped it; its block (filed under replica 0's
    stream in the step's pool) must not go to replica 0's later array before those reads (StepScope)."""
    rng = np.random.default_rng(11)
    with gpu_env.mirrored_strategy(replicas) as strategy:
        devices = strategy.extended.worker_devices

        run = md.function(gpu_env.hand_off_step)
        for s in range(6):
            host = [rng.standard_normal(64).astype(np.float32) for _ in devices]
            x = md.PerReplica([md.device_util.place(h, d) for h, d in zip(host, devices)], devices)
            # (s == 0: the eager warm-up, checked too)
            gpu_env.check_hand_off(strategy, host, strategy.run(run, args=(x,)))
        assert run.experimental_get_tracing_count() == 1


@pytest.mark.gpu
def test_logical_gpus_on_two_gpus_are_captured_with_nccl_and_give_the_eager_bits():
    """2 GPUs x 2 logical replicas: with NCCL the hierarchical engine (docs/hierarchical.md: no event
    between GPUs) lets the step be captured. Without it the native engine orders the GPUs with events,
    which per-GPU graphs cannot hold: the capture fails (its forked streams joined, so the next steps run
    on clean streams) and the step runs eagerly with one warning. Either way it gives the eager bits."""
    if gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    from mirrored.device import config

    results = []
    try:
        for gpu in (0, 1):
            config.set_logical_device_configuration("GPU", gpu, count=2)
        for captured in (False, True):
            strategy = md.MirroredStrategy([f"/gpu:{i}" for i in range(4)])
            assert sorted(md.device_util.physical_ordinal(d) for d in strategy.extended.worker_devices) == [0, 0, 1, 1]
            w, b, opt = _model(strategy, "adam")
            step = _step_fn(w, b, opt)
            run = md.function(step) if captured else step
            eager = captured and not isinstance(strategy.extended._cross_device_ops, md.NcclAllReduce)
            with pytest.warns(EagerFallbackWarning, match="recorded outside the capture") if eager else \
                    contextlib.nullcontext():
                losses = [strategy.reduce(md.ReduceOp.SUM, strategy.run(run, args=_replica_batches_of(strategy, s)),
                                          axis=None) for s in range(4)]
            results.append((losses, [c.numpy() for v in (w, b) for c in v.values]))
    finally:
        for gpu in (0, 1):
            config.set_logical_device_configuration(f"GPU:{gpu}", None)
    (eager_losses, eager), (captured_losses, captured) = results
    np.testing.assert_array_equal(captured_losses, eager_losses)
    for e, c in zip(eager, captured):
        np.testing.assert_array_equal(c, e)


@pytest.mark.gpu
def test_a_new_batch_shape_captures_again_and_each_signature_replays_its_own_graph():
    with gpu_env.mirrored_strategy(1) as strategy:
        (w, b), w_eager, run, step = _captured_and_eager(strategy)
        for rows in (8, 8, 5, 5, 8, 5):
            x, y = (md.device_util.place(a[0, :rows], "/gpu:0") for a in (_X, _Y))
            got = float(strategy.run(run, args=(x, y)))
            want = float(strategy.run(step, args=(x, y)))
            assert got == want
        assert run.experimental_get_tracing_count() == 2 and run._captures == 2
        np.testing.assert_array_equal(w.numpy(), w_eager.numpy())


@pytest.mark.gpu
def test_a_step_that_waits_for_the_gpu_runs_eagerly_and_the_warning_names_the_operation():
    with gpu_env.mirrored_strategy(1) as strategy:
        w, b, opt = _model(strategy, "sgd")
        inner = _step_fn(w, b, opt)

        def step(x, y):
            loss = inner(x, y)
            return float(loss)  # a host wait: not capturable

        run = md.function(step)
        with pytest.warns(EagerFallbackWarning,
                          match=r"(cudaStreamSynchronize|D2H transfers are disallowed).*float\(loss\)"):
            first = [strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y)) for s in range(2)]
        losses = first + [strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y)) for s in range(2, 4)]
        assert all(isinstance(v, float) for v in losses)
        assert int(opt.iterations.numpy()) == 4  # the failed capture took no step of its own


def test_on_a_cpu_strategy_it_runs_eagerly_and_warns_once(two):
    calls = []

    @md.function
    def step(x):
        calls.append(md.get_replica_context().replica_id_in_sync_group)
        return x * 2

    with pytest.warns(EagerFallbackWarning, match="not on GPUs only") as caught:
        results = [two.run(step, args=(np.float32(i),)) for i in range(4)]
    assert len(caught) == 1
    assert [float(r.values[0]) for r in results] == [0.0, 2.0, 4.0, 6.0]
    assert sorted(calls) == [0] * 4 + [1] * 4  # every call ran the Python step on every replica
    with pytest.warns(EagerFallbackWarning, match="not on GPUs only") as caught:
        two.run(md.function(lambda: 1))
    assert len(caught) == 1


def test_function_is_tfs_decorator_with_and_without_arguments():
    @md.function(reduce_retracing=True)
    def f(x):
        return x + 1

    g = md.function(lambda x: x * 3)
    with pytest.warns(EagerFallbackWarning, match="no strategy.run"):
        assert f(1) == 2 and g(2) == 6
    assert f.python_function(1) == 2
    with pytest.raises(TypeError, match="md.function wraps a callable"):
        md.function(3)


@pytest.mark.gpu
def test_an_iterator_argument_gives_one_batch_per_call_into_the_captured_buffers():
    """TF's pattern: @function def train_step(iterator): strategy.run(step, args=(next(iterator),))."""
    results = {}
    for captured in (False, True):
        with gpu_env.mirrored_strategy(2) as strategy:
            w, b, opt = _model(strategy, "adam")
            step = _step_fn(w, b, opt)
            dataset = md.data.Dataset.from_tensor_slices((_X.reshape(-1, 6), _Y.reshape(-1, 3))).batch(
                8, drop_remainder=True)
            iterator = iter(strategy.experimental_distribute_dataset(dataset))

            def train_step(it):
                x, y = next(it)
                return strategy.reduce(md.ReduceOp.SUM, strategy.run(step, args=(x, y)), axis=None)

            run = md.function(train_step) if captured else train_step
            losses = [float(run(iterator)) for _ in range(6)]
            results[captured] = losses, [c.numpy() for c in w.values]
    assert results[True][0] == results[False][0]
    for got, want in zip(results[True][1], results[False][1]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_results_are_the_captured_arrays_which_the_next_replay_overwrites():
    with gpu_env.mirrored_strategy(1) as strategy:
        @md.function
        def double(x):
            return strategy.run(lambda v: v * 2, args=(x,))

        first = [double(cupy.full(3, float(i), np.float32)) for i in range(3)]
        assert first[1] is first[2]  # the replays return the captured outputs themselves
        np.testing.assert_array_equal(cupy.asnumpy(first[2]), [4.0, 4.0, 4.0])
        kept = cupy.asnumpy(first[2])  # a copy survives the next replay
        double(cupy.full(3, 5.0, np.float32))
        np.testing.assert_array_equal(cupy.asnumpy(first[2]), [10.0, 10.0, 10.0])
        np.testing.assert_array_equal(kept, [4.0, 4.0, 4.0])
        np.testing.assert_array_equal(cupy.asnumpy(first[0]), [0.0, 0.0, 0.0])  # the warm-up's own result


@pytest.mark.gpu
def test_new_signatures_are_bounded_and_frequent_retracing_is_logged(caplog):
    from mirrored.distribute import function as function_module

    with gpu_env.mirrored_strategy(1) as strategy:
        run = md.function(lambda x: strategy.run(lambda v: v + 1, args=(x,)))
        sizes = range(1, function_module.MAX_SIGNATURES + 3)
        with caplog.at_level("WARNING", logger="mirrored"):
            for n in sizes:
                out = run(cupy.zeros(n, np.float32))
                np.testing.assert_array_equal(cupy.asnumpy(out), np.ones(n))
        assert run.experimental_get_tracing_count() == len(sizes)
        assert len(run._steps) == function_module.MAX_SIGNATURES
        assert sum("triggered md.function retracing" in r.message for r in caplog.records) == 1
        out = run(cupy.full(1, 7.0, np.float32))  # the oldest signature went: captured again
        np.testing.assert_array_equal(cupy.asnumpy(out), [8.0])
        assert run._captures == len(sizes) + 1
        assert run.experimental_get_tracing_count() == len(sizes)  # TF's count: that type was traced before


@pytest.mark.gpu
def test_a_variable_moved_between_calls_by_copy_on_write_is_captured_again():
    with gpu_env.mirrored_strategy(1) as strategy:
        (w, b), w_eager, run, step = _captured_and_eager(strategy)
        held = []
        for s in range(5):
            for fn in (run, step):
                strategy.run(fn, args=gpu_env.replica_batches(strategy, s, _X, _Y))
            if s == 2:  # arrays read now keep their values: the next updates move w and b to new buffers
                held = [cupy.asnumpy(w.values[0].read_value()), w.values[0].read_value(), b.values[0].read_value()]
        np.testing.assert_array_equal(w.numpy(), w_eager.numpy())
        np.testing.assert_array_equal(cupy.asnumpy(held[1]), held[0])  # the held array never changed
        assert run._captures == 2  # captured again (one trace, as TF counts: the inputs' type is the same)
        assert run.experimental_get_tracing_count() == 1


@pytest.mark.gpu
def test_a_plain_cupy_step_without_a_strategy_is_captured_too():
    @md.function
    def affine(a, b):
        return a * 2 + b

    for i in range(4):
        a, b = cupy.full(5, float(i), np.float32), cupy.ones(5, np.float32)
        if gpu_env.SIMULATED:
            cupy.sim.drain()
            cupy.sim.reset_counters()
        out = affine(a, b)
        if i >= 1 and gpu_env.SIMULATED:
            assert cupy.sim.counters()["graph_launches"] == {0: 1} and not cupy.sim.counters()["kernels"]
        np.testing.assert_array_equal(cupy.asnumpy(out), np.full(5, 2.0 * i + 1, np.float32))
    assert affine.experimental_get_tracing_count() == 1


@pytest.mark.gpu
def test_a_step_that_holds_a_read_across_the_update_runs_eagerly_naming_the_variable():
    with gpu_env.mirrored_strategy(1) as strategy:
        with strategy.scope():
            w = md.Variable(_W0, name="kernel")
            opt = md.optimizers.SGD(0.1)

        def step(x):
            held = w.read_value()  # still referenced when apply_gradients updates w
            opt.apply_gradients([(md.matmul(x, md.matmul(x, held), transpose_a=True), w)])
            return held.sum()

        run = md.function(step)
        x = md.device_util.place(_X[0], "/gpu:0")
        with pytest.warns(EagerFallbackWarning, match="variable 'kernel:0'.*copy-on-write"):
            sums = [float(strategy.run(run, args=(x,))) for _ in range(3)]
        assert len(set(sums)) == 3  # every call stepped, eagerly


@pytest.mark.gpu
def test_a_step_that_calls_cupys_cublas_runs_eagerly_and_the_warning_names_md_linalg_matmul():
    with gpu_env.mirrored_strategy(1) as strategy:
        w, b, opt = _model(strategy, "sgd")

        def step(x, y):
            err = x @ w.read_value() + b.read_value() - y  # CuPy's cuBLAS: refused while capturing
            opt.apply_gradients([(x.T @ err, w), (err.sum(axis=0), b)])

        _runs_eagerly_warning(strategy, step, opt, r"cuBLAS.*x @ w\.read_value\(\).*md\.linalg\.matmul")


@pytest.mark.gpu
def test_the_captured_products_run_on_mirroreds_cublas_at_each_replay():
    with gpu_env.mirrored_strategy(1) as strategy:
        (w, b), w_eager, run, step = _captured_and_eager(strategy)
        for s in range(3):  # warm-up, capture, replays
            for fn in (run, step):
                strategy.run(fn, args=gpu_env.replica_batches(strategy, s, _X, _Y))
        np.testing.assert_array_equal(w.numpy(), w_eager.numpy())
        if gpu_env.SIMULATED:  # two products a step, run from the graph: none queued from Python
            cupy.sim.drain()
            cupy.sim.reset_counters()
            strategy.run(step, args=gpu_env.replica_batches(strategy, 3, _X, _Y))
            assert cupy.sim.counters()["blas"] == {0: 2}
            cupy.sim.drain()
            cupy.sim.reset_counters()
            strategy.run(run, args=gpu_env.replica_batches(strategy, 3, _X, _Y))
            assert not cupy.sim.counters()["blas"] and cupy.sim.counters()["graph_launches"] == {0: 1}


# A deep ReLU network of bench/train_step.py's kind, small: 2 * _LAYERS parameter tensors (more than the
# 8 beyond which CuPy's concatenate uploads a pointer table, refused under capture), odd widths (so that
# packed gradients lie at offsets that are not 16-byte aligned).
_LAYERS, _WIDTH = 12, 5


def _deep_variables(strategy, optimizer):
    rng = np.random.default_rng(3)
    with strategy.scope():
        params = []
        for _ in range(_LAYERS):
            params.append(md.Variable(rng.standard_normal((_WIDTH, _WIDTH)).astype(np.float32) / np.float32(2)))
            params.append(md.Variable(rng.standard_normal(_WIDTH).astype(np.float32) / np.float32(10)))
        opt = {"sgd": lambda: md.optimizers.SGD(0.01),
               "sgd momentum": lambda: md.optimizers.SGD(0.01, momentum=0.9),
               "adam": lambda: md.optimizers.Adam(0.001)}[optimizer]()
    return params, opt


def _deep_step(params, opt, global_batch):
    """Forward, backward by hand (bench/train_step.py's way), apply_gradients of every parameter."""
    def forward_backward(x, y):
        # (A function of its own: the values read go before the update, which then stays in place.)
        xp = cupy if isinstance(x, cupy.ndarray) else np
        weights = [p.read_value() for p in params]
        hs = [x]
        for j in range(0, len(weights), 2):
            z = md.linalg.matmul(hs[-1], weights[j]) + weights[j + 1]
            hs.append(xp.maximum(z, np.float32(0)) if j + 2 < len(weights) else z)
        err = hs[-1] - y
        g = err * np.float32(2.0 / global_batch)
        grads = [None] * len(weights)
        for j in range(len(weights) - 2, -1, -2):
            h = hs[j // 2]
            grads[j], grads[j + 1] = md.linalg.matmul(h, g, transpose_a=True), g.sum(axis=0)
            if j:
                g = md.linalg.matmul(g, weights[j], transpose_b=True) * (h > 0)
        return xp.sum(err * err), grads

    def step(x, y):
        loss, grads = forward_backward(x, y)
        opt.apply_gradients(zip(grads, params))
        return loss
    return step


def _train_deep(replicas, optimizer, captured, steps=4):
    with gpu_env.mirrored_strategy(replicas) as strategy:
        params, opt = _deep_variables(strategy, optimizer)
        step = _deep_step(params, opt, global_batch=8)
        run = md.function(step) if captured else step
        rng = np.random.default_rng(5)
        losses = []
        for _ in range(steps):
            x = rng.standard_normal((8, _WIDTH)).astype(np.float32)
            y = rng.standard_normal((8, _WIDTH)).astype(np.float32)
            per = 8 // replicas

            def part(data):
                return md.PerReplica([md.device_util.place(data[r * per:(r + 1) * per], d)
                                      for r, d in enumerate(strategy.extended.worker_devices)],
                                     strategy.extended.worker_devices)
            losses.append(strategy.reduce(md.ReduceOp.SUM, strategy.run(run, args=(part(x), part(y))), axis=None))
        return [c.numpy() for p in params for c in p.values], losses, run


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "sgd momentum", "adam"])
def test_a_step_over_many_parameters_is_captured_and_gives_the_eager_steps_bits(replicas, optimizer):
    """The optimizer packs the gradients with the native multi-tensor copy (no pointer-table upload
    from pageable memory, which CuPy refuses while capturing): no fallback warning (pytest turns it
    into an error), one capture, the eager step's bits."""
    eager, eager_losses, _ = _train_deep(replicas, optimizer, captured=False)
    captured, captured_losses, run = _train_deep(replicas, optimizer, captured=True)
    assert run.experimental_get_tracing_count() == 1
    for e, c in zip(eager, captured):
        np.testing.assert_array_equal(c, e)
    np.testing.assert_array_equal(captured_losses, eager_losses)


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2])
def test_compute_average_loss_in_a_captured_step_captures_and_gives_the_eager_values(replicas):
    """md.nn.compute_average_loss divides by a NumPy scalar: no host-to-device copy inside the step."""
    def train(captured):
        with gpu_env.mirrored_strategy(replicas) as strategy:
            w, b, opt = _model(strategy, "sgd")
            inner = _step_fn(w, b, opt)

            def step(x, y):
                inner(x, y)
                return md.nn.compute_average_loss(cupy.sum(x * x, axis=1), global_batch_size=8)

            run = md.function(step) if captured else step
            losses = [strategy.reduce(md.ReduceOp.SUM,
                                      strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y)), axis=None)
                      for s in range(4)]
            return [float(v) for v in losses], w.numpy(), run

    eager_losses, eager_w, _ = train(False)
    losses, w, run = train(True)
    assert run.experimental_get_tracing_count() == 1
    assert losses == eager_losses
    np.testing.assert_array_equal(w, eager_w)


@pytest.mark.gpu
def test_a_step_that_uploads_host_data_runs_eagerly_and_the_warning_says_to_pass_it_in():
    with gpu_env.mirrored_strategy(1) as strategy:
        w, b, opt = _model(strategy, "sgd")
        inner = _step_fn(w, b, opt)
        offset = np.ones(3, np.float32)

        def step(x, y):
            return inner(x, y + cupy.asarray(offset))  # a host-to-device copy: refused while capturing

        _runs_eagerly_warning(strategy, step, opt, r"H2D transfers are disallowed.*cupy\.asarray\(offset\).*"
                              r"make such arrays before the step and pass them in")


@pytest.mark.gpu
def test_a_keras2_loss_scaled_step_runs_eagerly_and_the_warning_names_the_loss_scale_optimizer():
    # Keras 2's get_unscaled_gradients divides by the scale on the host (a loss-scaled step that calls
    # apply_gradients with the scaled gradients captures: tests/test_mixed_precision_device.py).
    with gpu_env.mirrored_strategy(1) as strategy:
        with strategy.scope():
            w, b = md.Variable(_W0), md.Variable(_B0)
            opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.SGD(0.1))

        def step(x, y):
            err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
            grads = opt.get_unscaled_gradients([md.linalg.matmul(x, err, transpose_a=True), err.sum(axis=0)])
            opt.apply_gradients(zip(grads, (w, b)))

        _runs_eagerly_warning(strategy, step, opt,
                              r"get_unscaled_gradients\(.*LossScaleOptimizer read its loss scale on the host")


@pytest.mark.gpu
@pytest.mark.parametrize("replicas", [1, 2])
def test_calls_whose_arguments_nest_differently_are_captured_apart(replicas):
    """f(a, b), f(a, y=b) and f((a, b)) flatten to the same arrays; each is its own signature (a replay of
    another's graph would return another computation's result)."""
    with gpu_env.mirrored_strategy(replicas) as strategy:
        def step(*args, **kwargs):
            if kwargs:
                return args[0] - kwargs["y"]
            if isinstance(args[0], tuple):
                return args[0][0] * args[0][1]
            return args[0] + args[1]
        run = md.function(step)
        a, b = cupy.full(4, 3.0, np.float32), cupy.full(4, 2.0, np.float32)
        want = {"positional": 5.0, "keyword": 1.0, "tuple": 6.0}
        calls = {"positional": lambda: strategy.run(run, args=(a, b)),
                 "keyword": lambda: strategy.run(run, args=(a,), kwargs={"y": b}),
                 "tuple": lambda: strategy.run(run, args=((a, b),))}
        for _ in range(3):  # warm-up, capture, replay of each
            for name, call in calls.items():
                for value in strategy.experimental_local_results(call()):
                    np.testing.assert_array_equal(cupy.asnumpy(value), want[name], err_msg=name)
