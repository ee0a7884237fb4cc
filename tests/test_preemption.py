"""md.distribute.experimental.PreemptionCheckpointHandler: save at an agreed step on SIGTERM, exit, resume exactly."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import mirrored as md
from mirrored.distribute.preemption import RESTART_EXIT_CODE

STEPS = 8
Handler = md.distribute.experimental.PreemptionCheckpointHandler


@pytest.fixture(autouse=True)
def _keep_sigterm():
    """The handler installs a SIGTERM handler in this process: put the previous one back after each test."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 4, 3)).astype(np.float32)
    return x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32)


def _job(directory, replicas=2, config=None, manager=False, **tracked):
    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        w = md.Variable(np.zeros((3, 1), np.float32), name="w")
        opt = md.optimizers.Adam(0.05)
        tracked = {name: md.Variable(value, trainable=False) for name, value in tracked.items()}
    ckpt = md.train.Checkpoint(w=w, optimizer=opt, **tracked)
    if manager:
        handler = Handler(None, md.train.CheckpointManager(ckpt, directory, max_to_keep=2), termination_config=config)
    else:
        handler = Handler(None, ckpt, checkpoint_dir=directory, termination_config=config)
    if tracked:
        return handler, _step_fn(strategy, w, opt, replicas), w, tracked
    return handler, _step_fn(strategy, w, opt, replicas), w, opt


def _step_fn(strategy, w, opt, replicas):
    x, y = _data()

    def step(i):
        def replica_step():
            r = md.get_replica_context().replica_id_in_sync_group
            rows = slice(r * 4 // replicas, (r + 1) * 4 // replicas)
            grad = 2.0 * x[i][rows].T @ (x[i][rows] @ w.read_value() - y[i][rows]) / 4
            opt.apply_gradients([(grad, w)])
        strategy.run(replica_step)
    return step


def test_a_notice_before_the_last_run_lets_the_job_finish(tmp_path):
    handler, step, _, _ = _job(tmp_path / "run")
    _train(handler, step, preempt_at=STEPS - 1)  # the agreed run, STEPS, never starts: no save, no exit
    assert handler.total_run_calls == STEPS and md.train.latest_checkpoint(tmp_path / "run") is None


def _train(handler, step, preempt_at=None):
    while handler.total_run_calls < STEPS:
        if handler.total_run_calls == preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the notice arrives before this run
        handler.run(step, handler.total_run_calls)


def _uninterrupted(tmp_path, **kwargs):
    handler, step, w, opt = _job(tmp_path / "clean", **kwargs)
    _train(handler, step)
    return w.numpy(), int(opt.iterations.numpy())


@pytest.mark.parametrize("preempt_at", [0, 3, STEPS - 2])
@pytest.mark.parametrize("manager", [False, True])
def test_sigterm_saves_exits_with_restart_code_and_the_next_job_resumes_bit_identical(tmp_path, preempt_at, manager):
    expected_w, expected_iterations = _uninterrupted(tmp_path, manager=manager)

    handler, step, _, _ = _job(tmp_path / "run", manager=manager)
    with pytest.raises(SystemExit) as exited:
        _train(handler, step, preempt_at=preempt_at)
    assert exited.value.code == RESTART_EXIT_CODE == 42
    assert md.train.latest_checkpoint(tmp_path / "run")

    handler, step, w, opt = _job(tmp_path / "run", manager=manager)  # the restarted job: fresh objects
    assert handler.total_run_calls == preempt_at + 1  # as TF: the run after the notice, so all workers know
    _train(handler, step)
    np.testing.assert_array_equal(w.numpy(), expected_w)
    assert int(opt.iterations.numpy()) == expected_iterations == STEPS


def test_watch_preemption_scope_and_save_checkpoint_if_preempted(tmp_path):
    # TF's pattern for this API: the loop counts its steps in a checkpointed variable.
    expected_w, _ = _uninterrupted(tmp_path)

    def job():
        handler, step, w, tracked = _job(tmp_path / "run", trained_step=np.int64(0))
        return handler, step, w, tracked["trained_step"]

    handler, step, _, trained_step = job()
    with pytest.raises(SystemExit):
        with handler.watch_preemption_scope():
            while int(trained_step.numpy()) < STEPS:
                step(int(trained_step.numpy()))
                trained_step.assign_add(np.int64(1))
                if int(trained_step.numpy()) == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
                handler.save_checkpoint_if_preempted()
    handler, step, w, trained_step = job()
    # The notice came after step 5; all save at the next call: after step 6. As TF counts, the save comes
    # before that call is counted.
    assert int(trained_step.numpy()) == 6
    assert handler.total_run_calls == 5
    with handler.watch_preemption_scope():
        while int(trained_step.numpy()) < STEPS:
            step(int(trained_step.numpy()))
            trained_step.assign_add(np.int64(1))
            handler.save_checkpoint_if_preempted()
    np.testing.assert_array_equal(w.numpy(), expected_w)


def test_a_termination_watcher_and_custom_exit(tmp_path):
    notice = threading.Event()
    exits = []

    class Exit(Exception):
        pass

    def exit_fn():
        exits.append(True)
        raise Exit

    config = md.distribute.experimental.TerminationConfig(termination_watcher_fn=notice.is_set, exit_fn=exit_fn)
    handler, step, _, _ = _job(tmp_path / "run", config=config)
    handler.run(step, 0)
    notice.set()
    with pytest.raises(Exit):
        while True:  # the watcher polls about once a second: the save comes within a few runs
            handler.run(step, min(handler.total_run_calls, STEPS - 1))
    assert exits == [True]
    saved = md.train.load_variable(tmp_path / "run", "checkpointed_runs/.ATTRIBUTES/VARIABLE_VALUE")
    assert int(saved) == handler.total_run_calls >= 1


def test_a_grace_period_saves_at_once_and_trains_on(tmp_path):
    config = md.distribute.experimental.TerminationConfig(grace_period=3600)
    handler, step, _, _ = _job(tmp_path / "run", config=config)
    handler.run(step, 0)
    os.kill(os.getpid(), signal.SIGTERM)
    for i in range(1, 4):
        handler.run(step, i)  # no exit: the grace period is an hour
    runs = md.train.load_variable(tmp_path / "run", "checkpointed_runs/.ATTRIBUTES/VARIABLE_VALUE")
    assert int(runs) == 2  # the run after the notice
    assert handler.total_run_calls == 4


def test_bad_arguments_are_named(tmp_path):
    strategy = md.MirroredStrategy(devices=["/cpu:0"])
    with strategy.scope():
        w = md.Variable(np.zeros(2))
    with pytest.raises(ValueError, match="checkpoint_dir"):
        Handler(None, md.train.Checkpoint(w=w))
    with pytest.raises(TypeError, match="checkpoint_or_checkpoint_manager"):
        Handler(None, {"w": w}, checkpoint_dir=str(tmp_path))
    with pytest.raises(TypeError, match="termination_config"):
        Handler(None, md.train.Checkpoint(w=w), checkpoint_dir=str(tmp_path), termination_config={"grace_period": 1})
    with pytest.raises(ValueError, match="grace_period=-1"):
        md.distribute.experimental.TerminationConfig(grace_period=-1)
    with pytest.raises(TypeError, match="exit_fn"):
        md.distribute.experimental.TerminationConfig(exit_fn=42)


# --- two workers on loopback ---------------------------------------------------------------------------

def _worker(directory, steps, preempt_rank, preempt_after, marker):
    """One task: train ``steps`` runs under the handler; the task ``preempt_rank`` gets a SIGTERM from a thread."""
    strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=60), devices=["/cpu:0"])
    me = strategy.cluster_resolver.task_id
    with strategy.scope():
        w = md.Variable(np.zeros((3, 1), np.float32), name="w")
        opt = md.optimizers.SGD(0.05, momentum=0.9)
    ckpt = md.train.Checkpoint(w=w, optimizer=opt)
    handler = Handler(strategy.cluster_resolver, ckpt, checkpoint_dir=directory)
    start = handler.total_run_calls
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, 8, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    progressed = threading.Event()
    if me == preempt_rank and marker and not os.path.exists(marker):
        open(marker, "w").close()

        def preempt():  # asynchronous, as a real notice: wherever the main thread is (a step, a collective)
            progressed.wait()
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=preempt, daemon=True).start()

    def train_step(i):
        rows = slice(me * 4, me * 4 + 4)  # this worker's half of a global batch of 8
        strategy.run(lambda: opt.apply_gradients([(2.0 * x[i][rows].T @ (x[i][rows] @ w.read_value() - y[i][rows])
                                                   / 8, w)]))

    while handler.total_run_calls < steps:
        if handler.total_run_calls >= start + preempt_after:
            progressed.set()
        handler.run(train_step, handler.total_run_calls)
    return w.numpy().tolist(), int(opt.iterations.numpy()), start


@pytest.mark.multiworker
@pytest.mark.parametrize("preempt_rank", [0, 1])
def test_two_workers_agree_on_the_step_save_exit_and_resume_bit_identical(tmp_path, preempt_rank):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import cluster, launch

    steps = 12
    clean = launch(_worker, 2, kwargs={"directory": str(tmp_path / "clean"), "steps": steps, "preempt_rank": -1,
                                       "preempt_after": 0, "marker": ""}, timeout=180)
    assert all(r.ok for r in clean), [(r.task, r.returncode, r.message, r.stderr[-1500:]) for r in clean]

    kwargs = {"directory": str(tmp_path / "run"), "steps": steps, "preempt_rank": preempt_rank, "preempt_after": 3,
              "marker": str(tmp_path / "preempted")}
    first = launch(_worker, 2, kwargs=kwargs, timeout=180, spec=cluster(2))
    assert [r.returncode for r in first] == [RESTART_EXIT_CODE] * 2, \
        [(r.task, r.returncode, r.message, r.stderr[-1500:]) for r in first]
    assert not (tmp_path / "workertemp_1").exists()  # the non-chief's temporary directory is gone
    resumed = launch(_worker, 2, kwargs=kwargs, timeout=180, spec=cluster(2))
    assert all(r.ok for r in resumed), [(r.task, r.returncode, r.message, r.stderr[-1500:]) for r in resumed]
    starts = {r.value[2] for r in resumed}
    assert len(starts) == 1 and 3 <= starts.pop() < steps  # both resumed at the one agreed step
    for r, c in zip(resumed, clean):
        assert r.value[:2] == c.value[:2]  # bit-identical weights, and all steps taken


_LAUNCHED = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import mirrored as md

    directory, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=60))
    me = strategy.cluster_resolver.task_id
    with strategy.scope():
        w = md.Variable(np.zeros((3, 1), np.float32), name="w")
        opt = md.optimizers.SGD(0.05, momentum=0.9)
    handler = md.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, md.train.Checkpoint(w=w, optimizer=opt), checkpoint_dir=directory)
    print("resumed at", handler.total_run_calls, flush=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, 8, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)

    def train_step(i):
        rows = slice(me * 4, me * 4 + 4)
        strategy.run(lambda: opt.apply_gradients([(2.0 * x[i][rows].T @ (x[i][rows] @ w.read_value() - y[i][rows])
                                                   / 8, w)]))

    while handler.total_run_calls < steps:
        handler.run(train_step, handler.total_run_calls)
        with open(f"{out}.progress.{me}", "w") as f:
            f.write(f"{os.getpid()} {handler.total_run_calls}")
    with open(f"{out}.{me}", "w") as f:
        json.dump(w.numpy().tolist(), f)
""")


@pytest.mark.multiworker
def test_mirrored_run_restarts_a_preempted_job_which_ends_like_an_uninterrupted_one(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    import time

    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED)
    steps = 400

    def job(name, preempt):
        out = tmp_path / name
        proc = subprocess.Popen([sys.executable, "-m", "mirrored.run", "-np", "2", "--max-restarts", "2",
                                 sys.executable, str(script), str(tmp_path / f"{name}.ckpt"), str(out), str(steps)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        if preempt:
            progress = tmp_path / f"{name}.progress.1"
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:  # wait for worker 1's 5th step
                text = progress.read_text() if progress.exists() else ""
                if text.count(" ") == 1 and int(text.split()[1]) >= 5:
                    os.kill(int(text.split()[0]), signal.SIGTERM)  # a preemption notice to one worker
                    break
                time.sleep(0.05)
            else:
                pytest.fail("worker 1 never reached step 5")
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()[-3000:]
        return stdout.decode(), [json.loads((tmp_path / f"{name}.{me}").read_text()) for me in range(2)]

    clean_out, expected = job("clean", preempt=False)
    preempted_out, got = job("preempted", preempt=True)
    assert clean_out.count("resumed at 0") == 2
    resumed = sorted(int(n) for n in re.findall(r"resumed at (\d+)", preempted_out))
    assert len(resumed) == 4 and resumed[:2] == [0, 0] and resumed[2] == resumed[3] >= 5, preempted_out
    assert got == expected
