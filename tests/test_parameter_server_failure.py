"""A ps task that fails, as TF 2.21's ClusterCoordinator handles it: the job fails for good with TF's
``UnavailableError`` (``PSUnavailableError``), raised by ``schedule``, ``join``, ``done`` and the values of the
functions in flight, naming the ps task and the fix (restart the tasks, restore the last checkpoint) — at once when
the task is gone, by the heartbeat when it hangs; then a new cluster restored from a checkpoint continues the run
bit for bit. In-process clusters and (``multiworker``) processes killed with SIGKILL, on 127.0.0.1."""

import signal
import threading
import time

import numpy as np
import pytest

import mirrored as md
from mirrored.distribute.parameter_server import coordinator as coordinator_lib
from mirrored.distribute.parameter_server import rpc
from mirrored.errors import CancelledError, UnavailableError

import ps_model
from test_parameter_server_state import assert_same_state, plain_model, train_ps
from test_parameter_server_strategy import Coordinator, in_process_cluster, process_cluster

PSUnavailableError = md.distribute.coordinator.PSUnavailableError


def assert_names_the_ps_task_and_the_fix(error, task: int, address: str) -> None:
    assert isinstance(error, UnavailableError) and isinstance(error, ConnectionError)
    message = str(error)
    assert f"/job:ps/replica:0/task:{task}" in message and address in message
    assert "restart" in message and "checkpoint" in message


def test_a_ps_task_that_goes_away_fails_the_job_naming_it_and_the_fix():
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            v0 = md.Variable(np.zeros(2, np.float32), name="v0")
            v1 = md.Variable(np.zeros(2, np.float32), name="v1")  # (on ps task 1)
        assert coordinator.schedule(ps_model.read_and_add, args=(v1, np.ones(2, np.float32))).fetch().tolist() == [1, 1]
        strategy.test_servers[("ps", 1)]._stop()
        failed = coordinator.schedule(ps_model.read_and_add, args=(v1, np.ones(2, np.float32)))
        with pytest.raises(PSUnavailableError) as raised:
            coordinator.join()
        address = strategy.extended._ps_addresses[1]
        assert_names_the_ps_task_and_the_fix(raised.value, 1, address)
        with pytest.raises(PSUnavailableError):
            failed.fetch()
        # for good: the job cannot go on (the variables of that task are gone)
        with pytest.raises(PSUnavailableError, match="task:1"):
            coordinator.schedule(ps_model.identity, args=(0,))
        with pytest.raises(PSUnavailableError):
            coordinator.done()
        with pytest.raises(PSUnavailableError):
            coordinator.join()
        rpc.pool(address, strategy.extended._token).close()  # (no idle connection: the next read connects)
        with pytest.raises(UnavailableError, match=f"cannot reach the task at {address}"):  # at once
            v1.read_value()
        assert v0.numpy().tolist() == [0, 0]  # (the other task still answers)


def test_a_hung_ps_task_misses_its_heartbeat_and_fails_the_job(monkeypatch):
    monkeypatch.setattr(coordinator_lib, "HEARTBEAT_SECONDS", 1.0)
    release = threading.Event()
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            v = md.Variable(np.zeros(2, np.float32), name="v")
        listener = strategy.test_servers[("ps", 0)]._listener
        answer = listener._handle

        def hung(method, args):  # (alive, its connections open, answering nothing)
            release.wait()
            return answer(method, args)

        listener._handle = hung
        try:
            held = coordinator.schedule(ps_model.read_and_add, args=(v, np.ones(2, np.float32)))
            queued = [coordinator.schedule(ps_model.read_and_add, args=(v, np.ones(2, np.float32)))
                      for _ in range(3)]
            start = time.monotonic()
            with pytest.raises(PSUnavailableError, match="did not answer a heartbeat within 1 s") as raised:
                coordinator.join()  # (the in-flight functions hang on the ps: not waited for)
            assert time.monotonic() - start < 60
            assert_names_the_ps_task_and_the_fix(raised.value, 0, strategy.extended._ps_addresses[0])
            with pytest.raises(PSUnavailableError):
                held.fetch()
            for value in queued:  # in flight on the other worker (hung too) or cancelled
                with pytest.raises((PSUnavailableError, CancelledError)):
                    value.fetch()
        finally:
            release.set()


def test_workers_without_a_heartbeat_still_fail_at_once_on_a_dead_ps(monkeypatch):
    monkeypatch.setenv("MIRRORED_PS_HEARTBEAT_SECONDS", "0")
    with in_process_cluster(num_workers=1) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            v = md.Variable(np.zeros(2, np.float32), name="v")
        coordinator.schedule(ps_model.read_and_add, args=(v, np.ones(2, np.float32))).fetch()
        strategy.test_servers[("ps", 0)]._stop()
        coordinator.schedule(ps_model.read_and_add, args=(v, np.ones(2, np.float32)))
        with pytest.raises(PSUnavailableError, match="task:0"):
            coordinator.join()


def test_the_error_travels_and_keeps_its_fields():
    import pickle

    error = coordinator_lib._ps_unavailable(3, "127.0.0.1:1", "gone")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is PSUnavailableError and str(again) == str(error) and again.address == "127.0.0.1:1"
    assert again.error_code == md.errors.UnavailableError.error_code


@pytest.mark.multiworker
def test_processes_a_killed_ps_fails_the_job_at_once_then_a_restored_cluster_continues(tmp_path):
    batches = ps_model.data(6)
    with process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        train_ps(strategy, model, batches[:3])
        path = md.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
        victim = strategy.test_processes[1]  # (ps task 1: it holds b)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        coordinator = Coordinator(strategy)
        start = time.monotonic()
        value = coordinator.schedule(model.train_step, args=batches[3])
        with pytest.raises(PSUnavailableError) as raised:
            coordinator.join()
        # at once: neither the heartbeat's 120 s nor the connection timeout's (the refusal is the answer)
        assert time.monotonic() - start < 30
        assert_names_the_ps_task_and_the_fix(raised.value, 1, strategy.extended._ps_addresses[1])
        with pytest.raises(PSUnavailableError):
            value.fetch()
        with pytest.raises(PSUnavailableError):
            coordinator.schedule(model.train_step, args=batches[3])
    # TF's recovery: a new cluster, the checkpoint restored, the steps after it scheduled again
    with process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.Model("adam")
        md.train.Checkpoint(model=model).restore(path)
        train_ps(strategy, model, batches[3:])
        assert_same_state(model, plain_model("adam", batches), "adam")
