"""A dynamic LossScaleOptimizer on GPU replicas whose scalars follow the step waits for nothing (gpu marker: on
the simulated GPUs without a GPU, see gpu_env.py).

Only the GPU knows whether a loss-scaled step was skipped (it leaves ``iterations`` where it was), so the host
sends the scalars of every step the device may be at and the device picks the row of its own count
(python/mirrored/train/optimizers/step_window.py). Checked here: no host wait per step, eagerly and replayed;
the bits of the host-decided step (which knows each step exactly) over skips, growth, optimizers, dtypes and
replica counts; the host running far ahead (the simulator runs nothing until the host waits: the cap);
``iterations`` assigned or restored between steps; and the device's check of a row outside the window.
"""

import gc

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy
from mirrored.device.dtypes import dtype_code
from mirrored.train import mixed_precision
from mirrored.train.optimizers import base, step_window

pytestmark = pytest.mark.gpu

_STEPS = 12
_rng = np.random.default_rng(28)
_W0 = _rng.standard_normal((6, 3))
_B0 = _rng.standard_normal(3)
_X = _rng.standard_normal((60, 8, 6))  # (step, global batch, features)
_Y = _rng.standard_normal((60, 8, 3))
for _s in (2, 6, 7, 20, 41):
    _X[_s, 1, 2] = np.inf  # skipped steps (two in a row at 6 and 7), the scale halved
_X[9, 7, 0] = np.nan  # a nan on the last replica's part

_OPTIMIZERS = {
    "sgd": lambda: md.optimizers.SGD(0.1),
    "sgd schedule": lambda: md.optimizers.SGD(lambda step: 0.1 / (1.0 + step), momentum=0.5),
    "adam": lambda: md.optimizers.Adam(0.01),
    "nadam": lambda: md.optimizers.Nadam(0.01),
    "adamw": lambda: md.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop schedule": lambda: md.optimizers.RMSprop(lambda step: 0.01 * 0.9 ** step, momentum=0.5, centered=True),
}


def _model(strategy, optimizer, dtype):
    with strategy.scope():
        w, b = md.Variable(_W0.astype(dtype)), md.Variable(_B0.astype(dtype))
        opt = mixed_precision.LossScaleOptimizer(_OPTIMIZERS[optimizer](), initial_scale=2.0 ** 10,
                                                 dynamic_growth_steps=2)
    return w, b, opt


def _step_fn(w, b, opt, applies=1):
    """Least squares with hand-written gradients of the scaled loss; ``applies`` > 1 applies the optimizer
    that many times in the step (each from the weights the one before left)."""
    def step(x, y):
        xp = cupy if isinstance(x, cupy.ndarray) else np
        x, y = x.astype(w.dtype, copy=False), y.astype(w.dtype, copy=False)
        for _ in range(applies):
            err = md.linalg.matmul(x, w.read_value()) + b.read_value() - y
            c = w.dtype.type(2.0 / (err.shape[0] * md.get_replica_context().num_replicas_in_sync))
            scaled = opt.scale_loss(err * c).astype(w.dtype, copy=False)
            opt.apply_gradients([(md.linalg.matmul(x, scaled, transpose_a=True), w), (scaled.sum(axis=0), b)])
        return xp.sum(err * err)
    return step


def _state(w, b, opt):
    """Every copy of the weights and of the optimizers' variables (counter, scale, iterations, slots)."""
    return [c.numpy() for v in (w, b, *opt.variables) for c in v.values]


def _host_decided(monkeypatch):
    """The host-decided loss-scaled step (it knows every step exactly): the reference."""
    monkeypatch.setattr(mixed_precision.LossScaleOptimizer, "_device_plan", lambda *a: None)
    monkeypatch.setattr(mixed_precision.LossScaleOptimizer, "_device_scale", lambda *a: None)


def _train(monkeypatch, optimizer, dtype=np.float32, replicas=2, one_gpu=True, mode="device", steps=_STEPS,
           applies=1, between=None, history=True):
    """The state after ``steps`` steps and (scale, counter, iterations) after each (``history``). ``mode``:
    "device", "captured" (md.function) or "host" (the reference). ``between(s, w, b, opt)`` runs after step s."""
    if mode == "host":
        _host_decided(monkeypatch)
    try:
        with gpu_env.mirrored_strategy(replicas, one_gpu) as strategy:
            w, b, opt = _model(strategy, optimizer, dtype)
            step = _step_fn(w, b, opt, applies)
            run = md.function(step) if mode == "captured" else step
            counts = []
            for s in range(steps):
                strategy.run(run, args=gpu_env.replica_batches(strategy, s, _X, _Y))
                if between is not None:
                    between(s, w, b, opt)
                if history:
                    counts.append((float(opt.loss_scale), opt.dynamic_counter, int(opt.iterations.numpy())))
            if mode == "captured":
                assert run.experimental_get_tracing_count() == 1
            return _state(w, b, opt), counts
    finally:
        monkeypatch.undo()


def _assert_same(got, want):
    (state, counts), (want_state, want_counts) = got, want
    assert counts == want_counts
    assert len(state) == len(want_state)
    for g, e in zip(state, want_state):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("mode", ["device", "captured"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["adam", "nadam", "adamw", "sgd schedule"])
def test_the_device_selected_scalars_give_the_host_decided_steps_bits(optimizer, replicas, mode, monkeypatch):
    host = _train(monkeypatch, optimizer, replicas=replicas, mode="host")
    _assert_same(_train(monkeypatch, optimizer, replicas=replicas, mode=mode), host)
    # Skips at 2, 6, 7 and 9 (nothing counted, the scale halved), growth after 2 good steps.
    scales, iterations = [h[0] for h in host[1]], [h[2] for h in host[1]]
    assert iterations == [1, 2, 2, 3, 4, 5, 5, 5, 6, 6, 7, 8]
    assert scales[:3] == [1024.0, 2048.0, 1024.0] and scales[4] == 2048.0


@pytest.mark.parametrize("mode", ["device", "captured"])
@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_float64_variables_and_every_rule_give_the_host_decided_steps_bits(optimizer, mode, monkeypatch):
    host = _train(monkeypatch, optimizer, np.float64, mode="host")
    _assert_same(_train(monkeypatch, optimizer, np.float64, mode=mode), host)


@pytest.mark.parametrize("optimizer", ["adam", "sgd schedule"])
def test_two_gpus_select_by_their_own_counts(optimizer, monkeypatch):
    if gpu_env.NGPU < 2:
        pytest.skip("needs two GPUs")
    gpu_env.nccl_strategy(2)  # (skips without NCCL)
    host = _train(monkeypatch, optimizer, mode="host", one_gpu=False)
    _assert_same(_train(monkeypatch, optimizer, one_gpu=False), host)
    _assert_same(_train(monkeypatch, optimizer, mode="captured", one_gpu=False), host)


@pytest.mark.parametrize("optimizer", ["adam", "nadam"])
def test_an_optimizer_applied_twice_in_a_captured_step_follows_the_first_applys_skip(optimizer, monkeypatch):
    # The second apply's step is the first's + 1, or the first's when the GPU skipped the first: its GPU picks
    # the row of what the first apply left in `iterations`, replayed as eagerly.
    host = _train(monkeypatch, optimizer, mode="host", applies=2)
    eager = _train(monkeypatch, optimizer, applies=2)
    _assert_same(eager, host)
    _assert_same(_train(monkeypatch, optimizer, mode="captured", applies=2), host)


def _waits_per_step(strategy, run, args, steps=3):
    """Host waits of ``steps`` more steps (the simulator's count; nothing drained in between)."""
    for s in range(3):  # planned, tables and packs made, captured
        strategy.run(run, args=args(s))
    batches = [args(s) for s in range(3, 3 + steps)]  # (placed before counting: an upload is not the step's)
    cupy.sim.drain()
    gc.collect()  # earlier arrays freed now, not inside the counted steps (a free waits)
    gc.disable()
    try:
        cupy.sim.reset_counters()
        for batch in batches:
            strategy.run(run, args=batch)
        counted = cupy.sim.counters()
    finally:
        gc.enable()
    cupy.sim.drain()
    return counted["host_waits"] / steps


@pytest.mark.parametrize("mode", ["eager", "captured"])
@pytest.mark.parametrize("layout", ["logical-1", "logical-2", "logical-4", "physical-2"])
def test_a_repeated_adam_step_under_a_dynamic_scale_makes_no_host_wait(layout, mode):
    if not gpu_env.SIMULATED:
        pytest.skip("host waits are counted by the simulated CUDA runtime")
    if layout == "physical-2":
        gpu_env.nccl_strategy(2)  # (skips without NCCL)
    with gpu_env.layout_strategy(layout) as strategy:
        w, b, opt = _model(strategy, "adam", np.float32)
        step = _step_fn(w, b, opt)
        run = md.function(step) if mode == "captured" else step
        assert _waits_per_step(strategy, run, lambda s: gpu_env.replica_batches(strategy, s, _X, _Y)) == 0
        assert int(opt.iterations.numpy()) == 5  # step 2 was skipped


def _run_far_ahead(monkeypatch, mode, steps, skipped):
    """``steps`` eager steps of a loss-scaled Adam on one GPU replica whose gradients keep their buffers (their
    values rewritten in place, inf at ``skipped``), so that nothing else makes the host wait: the simulator
    then runs no kernel until the host waits. Returns the state and the steps at which the host waited."""
    if mode == "host":
        _host_decided(monkeypatch)
    try:
        with gpu_env.mirrored_strategy(1) as strategy:
            device = strategy.extended.worker_devices[0]
            with strategy.scope():
                w, b = md.Variable(_W0.astype(np.float32)), md.Variable(_B0.astype(np.float32))
                opt = mixed_precision.LossScaleOptimizer(md.optimizers.Adam(0.01), dynamic_growth_steps=3)
            finite = [md.device_util.place((v * 2.0).astype(np.float32), device) for v in (_W0, _B0)]
            grads = [g.copy() for g in finite]

            def step(gw, gb):
                opt.apply_gradients([(gw, w), (gb, b)])

            cupy.sim.drain()
            gc.collect()
            gc.disable()
            waited, before = [], 0
            try:
                cupy.sim.reset_counters()
                for s in range(steps):
                    for g, f in zip(grads, finite):  # (kernels on the legacy stream, ordered with the steps)
                        g[...] = np.float32(np.inf) if s in skipped else f
                    strategy.run(step, args=tuple(grads))
                    waits = cupy.sim.counters()["host_waits"]
                    if waits != before:
                        waited.append(s)
                    before = waits
            finally:
                gc.enable()
            return (_state(w, b, opt), []), waited
    finally:
        monkeypatch.undo()


def test_a_host_far_ahead_of_the_gpu_waits_only_past_the_window(monkeypatch):
    if not gpu_env.SIMULATED:
        pytest.skip("the simulator holds every kernel until the host waits: the host runs ahead as far as it can")
    steps, skipped = 80, (3, 4, 20, 41, 42, 43)
    host, _ = _run_far_ahead(monkeypatch, "host", steps, skipped)
    device, waited = _run_far_ahead(monkeypatch, "device", steps, skipped)
    _assert_same(device, host)
    # The first step reads the count (nothing is known yet) and makes the device's buffers. Then the host runs
    # MAX_ROWS applies ahead of the last count that arrived (none arrives: nothing runs), waits once until it
    # is half that far ahead, and so on: one wait per MAX_ROWS // 2 steps, whatever was skipped.
    rows = step_window.MAX_ROWS
    assert waited[0] == 0 and waited[1] == rows, waited
    assert all(later - earlier >= rows // 2 - 1 for earlier, later in zip(waited[1:], waited[2:])), waited
    assert len(waited) <= 2 + (steps - rows) // (rows // 2 - 1), waited


def _assign(s, w, b, opt):
    if s == 4:
        opt.iterations.assign(np.int64(40))


def test_iterations_assigned_between_steps_is_the_next_steps_count(monkeypatch):
    host = _train(monkeypatch, "adam", mode="host", between=_assign)
    _assert_same(_train(monkeypatch, "adam", between=_assign), host)
    assert [h[2] for h in host[1]][4:8] == [40, 41, 41, 41]  # steps 6 and 7 are skipped


def test_a_checkpoint_restored_between_steps_gives_the_steps_after_it_their_counts(monkeypatch, tmp_path):
    def restorer(run):
        def restore(s, w, b, opt):
            checkpoint = md.train.Checkpoint(optimizer=opt, w=w, b=b)
            if s == 3:
                checkpoint.save(str(tmp_path / run / "ckpt"))
            if s == 7:
                checkpoint.restore(md.train.latest_checkpoint(str(tmp_path / run)))
        return restore

    host = _train(monkeypatch, "nadam", mode="host", between=restorer("host"))
    _assert_same(_train(monkeypatch, "nadam", between=restorer("device")), host)
    assert [h[2] for h in host[1]][7:9] == [3, 4]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_select_kernel_picks_its_counts_row_and_flags_a_count_outside_the_rows(dtype):
    kernel = base._gpu_kernel()
    code = dtype_code(np.dtype(dtype))
    width = 3
    values = [float(dtype(r * 10 + j + 0.1)) for r in range(4) for j in range(width)]  # steps 7, 8, 9, 10
    with gpu_env.mirrored_strategy(1):
        status = cupy.zeros(2, np.int64)
        for step, row in ((7, 0), (9, 2), (10, 3)):
            iterations, out = cupy.asarray(np.int64(step)), cupy.zeros(width, dtype)
            kernel.select_step_row(0, code, iterations.data.ptr, 7, width, values, out.data.ptr, status.data.ptr,
                                   cupy.cuda.get_current_stream().ptr)
            np.testing.assert_array_equal(cupy.asnumpy(out), np.array(values[row * width:(row + 1) * width], dtype))
            assert cupy.asnumpy(status).tolist() == [step, 0]
        # Outside the rows: no row is applied quietly. The scalars become NaN, the status says so, and the
        # host raises when the copy of the status arrives.
        window = step_window.StepWindow()
        window.known_exactly(7)
        for step in (6, 11):
            iterations, out = cupy.asarray(np.int64(step)), cupy.zeros(width, dtype)
            kernel.select_step_row(0, code, iterations.data.ptr, 7, width, values, out.data.ptr,
                                   window.status(0).data.ptr, cupy.cuda.get_current_stream().ptr)
            assert np.isnan(cupy.asnumpy(out)).all()
            assert cupy.asnumpy(window.status(0)).tolist() == [step, 1]
        window.counted()  # (the select above was an apply's)
        window.record(0, cupy.cuda.get_current_stream().ptr)
        cupy.cuda.get_current_stream().synchronize()
        with pytest.raises(RuntimeError, match="outside the rows of scalars"):
            window.bounds(10)


def test_the_select_kernels_rows_are_checked():
    kernel = base._gpu_kernel()
    code = dtype_code(np.dtype(np.float32))
    with pytest.raises(ValueError, match="width=0"):
        kernel.step_rows(code, 0, 0, [])
    with pytest.raises(ValueError, match="rows of width=2"):
        kernel.step_rows(code, 0, 2, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=f"1 to {step_window.MAX_ROWS} rows"):
        kernel.step_rows(code, 0, 1, [1.0] * (step_window.MAX_ROWS + 1))
    assert kernel.MAX_STEP_ROWS == step_window.MAX_ROWS
