"""ParameterServerStrategy, md.distribute.Server and the ClusterCoordinator (TF 2.21's semantics).

Most tests run an in-process cluster (the ps and worker servers in threads of this process, talking over
loopback TCP, as TF's ``create_in_process_cluster``); the ``multiworker`` ones start the ps and workers as
processes. The scheduled functions live in tests/ps_model.py (functions travel by reference).
"""

import contextlib
import gc
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import mirrored as md
from mirrored.distribute.collective_all_reduce import job_token
from mirrored.distribute.parameter_server import rpc
from mirrored.distribute.parameter_server.values import ShardedVariable
from mirrored.errors import CancelledError, OutOfRangeError
from mirrored.tools.run import free_ports

import ps_model

Coordinator = md.distribute.coordinator.ClusterCoordinator
Resolver = md.distribute.cluster_resolver.SimpleClusterResolver
partitioners = md.distribute.experimental.partitioners


def spec_of(num_workers: int, num_ps: int) -> dict:
    ports = free_ports(1 + num_workers + num_ps)
    return {"chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{p}" for p in ports[1:1 + num_workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[1 + num_workers:]]}


@contextlib.contextmanager
def in_process_cluster(num_workers: int = 2, num_ps: int = 1, variable_partitioner=None):
    """A strategy over ps and worker servers in this process; stopped (coordinator and servers) on exit."""
    spec = spec_of(num_workers, num_ps)
    servers = {(job, i): md.distribute.Server(spec, job, i) for job in ("worker", "ps") for i in range(len(spec[job]))}
    strategy = md.distribute.ParameterServerStrategy(Resolver(spec, task_type="chief", task_id=0),
                                                     variable_partitioner=variable_partitioner)
    strategy.test_servers = servers
    try:
        yield strategy
    finally:
        if strategy._cluster_coordinator is not None:
            strategy._cluster_coordinator._cluster.stop()
        for server in servers.values():
            server._stop()


# --- names ---------------------------------------------------------------------------------------------------

def test_tf_names():
    assert md.distribute.experimental.ParameterServerStrategy is md.distribute.ParameterServerStrategy
    assert md.distribute.coordinator.PerWorkerValue is md.distribute.experimental.coordinator.PerWorkerValues
    for name in ("ClusterCoordinator", "RemoteValue", "experimental_get_current_worker_index"):
        assert hasattr(md.distribute.coordinator, name)
    for name in ("Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"):
        assert issubclass(getattr(partitioners, name), partitioners.Partitioner)


# --- Server --------------------------------------------------------------------------------------------------

def test_server_resolves_job_and_task_as_tf():
    port = free_ports(1)[0]
    server = md.distribute.Server({"ps": [f"127.0.0.1:{port}"]})  # one job, one task: both implied
    try:
        assert (server.job_name, server.task_index) == ("ps", 0)
        assert server.target == f"grpc://localhost:{port}"
        assert server.server_def["cluster"] == {"ps": [f"127.0.0.1:{port}"]}
        server.start()  # (again: nothing)
    finally:
        server._stop()
    spec = spec_of(2, 1)
    with pytest.raises(ValueError, match="job_name"):
        md.distribute.Server(spec)
    with pytest.raises(ValueError, match="task_index"):
        md.distribute.Server(spec, job_name="worker")
    with pytest.raises(ValueError, match="task_index=5"):
        md.distribute.Server(spec, job_name="worker", task_index=5)
    with pytest.raises(ValueError, match="'evaluator' is not in the cluster"):
        md.distribute.Server(spec, job_name="evaluator", task_index=0)
    with pytest.raises(ValueError, match="protocol"):
        md.distribute.Server(spec, "ps", 0, protocol="grpc+verbs")
    with pytest.raises(TypeError, match="server_or_cluster_def"):
        md.distribute.Server("127.0.0.1:2222")


def test_server_start_false_then_start_and_a_busy_port():
    server = md.distribute.Server.create_local_server(start=False)
    assert server.job_name == "localhost"
    server.start()
    try:
        address = server.server_def["cluster"]["localhost"][0]
        with pytest.raises(OSError, match="cannot listen"):
            md.distribute.Server({"localhost": [address]})
    finally:
        server._stop()


def test_a_flood_of_silent_connections_does_not_keep_out_the_job():
    spec = spec_of(1, 1)
    server = md.distribute.Server(spec, "ps", 0)
    host, _, port = spec["ps"][0].rpartition(":")
    flood = [socket.create_connection((host, int(port))) for _ in range(rpc.MAX_UNADMITTED + 20)]
    try:
        member = rpc.Connection(spec["ps"][0], job_token(spec), timeout=300)
        for _ in range(300):  # (refused while the flood holds every slot: retried as a reconnect is)
            try:
                assert member.call("ping") == "/job:ps/replica:0/task:0"
                break
            except ConnectionError:
                member = rpc.Connection(spec["ps"][0], job_token(spec), timeout=300)
                flood.pop().close()
        member.close()
    finally:
        for s in flood:
            s.close()
        server._stop()


def test_server_refuses_a_connection_without_the_job_token():
    spec = spec_of(1, 1)
    server = md.distribute.Server(spec, "ps", 0)
    try:
        stranger = rpc.Connection(spec["ps"][0], "not the token")
        with pytest.raises(ConnectionError, match="unavailable"):
            stranger.call("ping")  # (closed by the server, unread)
        member = rpc.Connection(spec["ps"][0], job_token(spec))
        assert member.call("ping") == "/job:ps/replica:0/task:0"
        member.close()
    finally:
        server._stop()


# --- the strategy --------------------------------------------------------------------------------------------

def test_bad_cluster_resolvers():
    with pytest.raises(ValueError, match="at least one ps"):
        md.distribute.ParameterServerStrategy(Resolver({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}))
    with pytest.raises(ValueError, match="at least one worker"):
        md.distribute.ParameterServerStrategy(Resolver({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}))
    with pytest.raises(ValueError, match="non-empty"):
        md.distribute.ParameterServerStrategy(Resolver({}))
    with pytest.raises(ValueError, match="cluster_resolver="):
        md.distribute.ParameterServerStrategy({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    spec = spec_of(1, 1)
    with pytest.raises(ValueError, match=r"Server\(.*\).join\(\)"):
        md.distribute.ParameterServerStrategy(Resolver(spec, task_type="worker", task_id=0))
    with pytest.raises(ValueError, match="variable_partitioner"):
        md.distribute.ParameterServerStrategy(Resolver(spec), variable_partitioner=3)


def test_variables_live_on_the_ps_tasks_round_robin():
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        assert strategy.num_replicas_in_sync == 1
        assert strategy.extended.worker_devices == ("/device:CPU:0",)
        assert strategy.extended.parameter_devices == ("/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0")
        with strategy.scope():
            a = md.Variable(np.arange(4, dtype=np.float32), name="a")
            b = md.Variable(np.int64(7), name="b")
            c = md.Variable(lambda: np.ones((2, 2)), name="c")
        assert [v.device for v in (a, b, c)] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1, 0)]
        assert (a.name, a.shape, a.dtype, b.shape, c.dtype) == ("a:0", (4,), np.float32, (), np.float64)
        assert a.distribute_strategy is strategy
        np.testing.assert_array_equal(a.numpy(), [0, 1, 2, 3])
        assert b.numpy() == 7 and isinstance(b.numpy(), np.int64)
        a.assign([4, 3, 2, 1])
        a.assign_add(np.ones(4, np.float32))
        assert a.assign_sub(np.full(4, 0.5, np.float32)) is a
        np.testing.assert_array_equal(a.numpy(), [4.5, 3.5, 2.5, 1.5])
        np.testing.assert_array_equal(a + 1, [5.5, 4.5, 3.5, 2.5])
        np.testing.assert_array_equal(np.asarray(c) * 2, np.full((2, 2), 2.0))
        assert a.assign([0, 0, 0, 0], read_value=False) is None
        # the ps task checks an update as a variable does: shape, and values the dtype cannot hold
        with pytest.raises(ValueError, match="shape"):
            a.assign(np.zeros(3, np.float32))
        with pytest.raises(TypeError, match="convert it"):
            b.assign(np.float64(0.5))
        np.testing.assert_array_equal(a.numpy(), [0, 0, 0, 0])


def test_colocated_variables_share_a_ps_task_and_are_not_partitioned():
    with in_process_cluster(num_workers=1, num_ps=3,
                            variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            a = md.Variable(np.float32(1), name="a")  # task 0
            b = md.Variable(np.float32(2), name="b")  # task 1
            with strategy.extended.colocate_vars_with(b):
                slot = md.Variable(np.ones((4, 2), np.float32), name="slot")
            c = md.Variable(np.float32(3), name="c")  # task 2: colocated ones do not take a turn
        assert not isinstance(slot, ShardedVariable)
        assert [v.device[-14:-13] for v in (a, b, slot, c)] == ["0", "1", "1", "2"]
        with pytest.raises(ValueError, match="colocate_vars_with"), strategy.extended.colocate_vars_with(np.zeros(1)):
            pass


def test_scatters_and_gathers_run_on_the_ps_task_as_on_a_plain_variable():
    value = np.arange(20, dtype=np.float32).reshape(5, 4)
    rows = md.IndexedSlices(np.full((3, 4), 2, np.float32), np.array([4, 0, 4]))
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        coordinator = Coordinator(strategy)
        plain = md.Variable(value, name="plain")
        with strategy.scope():
            remote = md.Variable(value, name="remote")
        for method, args in [("scatter_add", (rows,)), ("scatter_mul", (rows,)), ("scatter_update", (rows,)),
                             ("scatter_max", (md.IndexedSlices(np.full((1, 4), 50, np.float32), [2]),)),
                             ("scatter_nd_add", (np.array([[1, 2], [3, 3]]), np.array([5, 6], np.float32))),
                             ("scatter_nd_update", (np.array([[0]]), np.ones((1, 4), np.float32))),
                             ("batch_scatter_update", (md.IndexedSlices(np.zeros((2, 4), np.float32), [1, 3]),))]:
            assert getattr(remote, method)(*args) is remote
            getattr(plain, method)(*args)
            np.testing.assert_array_equal(remote.numpy(), plain.numpy(), err_msg=method)
        np.testing.assert_array_equal(remote.sparse_read([3, 1, 3]), plain.sparse_read([3, 1, 3]))
        np.testing.assert_array_equal(remote.gather_nd([[1, 2], [4, 0]]), plain.gather_nd([[1, 2], [4, 0]]))
        with pytest.raises(IndexError):  # (the ps task's variable checks the rows, as a plain one)
            remote.scatter_add(md.IndexedSlices(np.ones((1, 4), np.float32), [5]))
        # from a worker too
        coordinator.schedule(ps_model.scatter, args=(remote, rows)).fetch()
        plain.scatter_sub(rows)
        np.testing.assert_array_equal(remote.numpy(), plain.numpy())


def test_sharded_row_scatters_go_to_the_shards_that_hold_the_rows():
    value = np.arange(26, dtype=np.float64).reshape(13, 2)
    with in_process_cluster(num_workers=1, num_ps=2,
                            variable_partitioner=partitioners.FixedShardsPartitioner(5)) as strategy:
        with strategy.scope():
            table = md.Variable(value, name="table")
        plain = md.Variable(value, name="plain")
        rows = md.IndexedSlices(np.full((4, 2), 3.0), np.array([12, 0, 5, 12]))
        for method in ("scatter_add", "scatter_max", "scatter_update", "scatter_div"):
            assert getattr(table, method)(rows) is table
            getattr(plain, method)(rows)
            np.testing.assert_array_equal(table.numpy(), plain.numpy(), err_msg=method)
        np.testing.assert_array_equal(table.sparse_read([[12, 3]]), plain.sparse_read([[12, 3]]))
        with pytest.raises(IndexError, match="sparse_delta.indices: 13"):
            table.scatter_add(md.IndexedSlices(np.ones((1, 2)), [13]))
        with pytest.raises(TypeError, match="IndexedSlices"):
            table.scatter_add(np.ones((13, 2)))


def test_datasets_are_built_per_worker_as_tf():
    with in_process_cluster(num_workers=1) as strategy:
        distributed = strategy.experimental_distribute_dataset(ps_model.range_dataset())
        with pytest.raises(ValueError, match="create_per_worker_dataset"):
            iter(distributed)
        from_function = strategy.distribute_datasets_from_function(ps_model.context_dataset)
        with pytest.raises(ValueError, match="create_per_worker_dataset"):
            iter(from_function)
        coordinator = Coordinator(strategy)
        for source, want in ((distributed, [0, 1]), (from_function, [1, 0, 1])):
            iterator = iter(coordinator.create_per_worker_dataset(source))
            _, batch = coordinator.schedule(ps_model.next_batch, args=(iterator,)).fetch()
            np.testing.assert_array_equal(batch, want)  # (an InputContext of one pipeline, one replica)


# --- the coordinator -----------------------------------------------------------------------------------------

def test_coordinator_is_one_per_strategy_and_needs_this_strategy():
    with in_process_cluster(num_workers=1) as strategy:
        assert Coordinator(strategy) is Coordinator(strategy)
        assert Coordinator(strategy).strategy is strategy
    with pytest.raises(ValueError, match="Only `md.distribute.experimental.ParameterServerStrategy`"):
        Coordinator(md.MirroredStrategy(["/cpu:0"]))


def test_a_scheduled_function_sees_one_replica_of_this_strategy():
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        values = [coordinator.schedule(ps_model.where_am_i) for _ in range(4)]
        coordinator.join()
        assert coordinator.done()
        for name, cross_replica, replicas, inside, worker in coordinator.fetch(values):
            assert (name, cross_replica, replicas, inside) == ("ParameterServerStrategy", True, 1, (0, 1))
            assert worker in (0, 1)
    with pytest.raises(RuntimeError, match="Cannot retrieve the worker index"):
        md.distribute.coordinator.experimental_get_current_worker_index()


_release = threading.Event()


def block_until_released():
    """Holds its worker until the test releases it (in-process cluster: the same module object)."""
    assert _release.wait(timeout=300)
    return md.distribute.coordinator.experimental_get_current_worker_index()


def test_a_function_goes_to_the_worker_that_is_free():
    _release.clear()
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        blocked = coordinator.schedule(block_until_released)
        others = [coordinator.schedule(md.distribute.coordinator.experimental_get_current_worker_index)
                  for _ in range(3)]
        free = {v.fetch() for v in others}  # while the first worker is held
        assert not coordinator.done()
        _release.set()
        assert free == {1 - blocked.fetch()}
        coordinator.join()


def test_fetch_over_nests_and_values_passed_through():
    with in_process_cluster(num_workers=1) as strategy:
        coordinator = Coordinator(strategy)
        value = {"a": np.arange(6).reshape(2, 3), "b": [1.5, "text"]}
        remote = coordinator.schedule(ps_model.identity, args=(value,))
        got = coordinator.fetch({"x": remote, "y": (remote, 3)})
        np.testing.assert_array_equal(got["x"]["a"], value["a"])
        assert got["y"][0]["b"] == [1.5, "text"] and got["y"][1] == 3
        assert remote.get()["b"] == remote.fetch()["b"]
        assert coordinator.schedule(ps_model.identity, kwargs={"x": np.float32(2)}).fetch() == 2
        # md.function steps: by reference, or (not reachable by name) their Python function; run eagerly there
        assert coordinator.schedule(ps_model.step_function, args=(np.float32(3),)).fetch() == 6
        assert coordinator.schedule(md.function(ps_model.identity), args=(4,)).fetch() == 4


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("num_ps", [1, 2])
def test_one_worker_trains_to_the_plain_loops_weights(optimizer, num_ps):
    batches = ps_model.data(6)
    with in_process_cluster(num_workers=1, num_ps=num_ps) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            model = ps_model.Model(optimizer)
        steps = [coordinator.schedule(model.train_step, args=batch) for batch in batches]
        coordinator.join()
        assert [s.fetch() for s in steps] == list(range(1, len(batches) + 1))  # (the ps copy's iterations)
        assert model.b.device.endswith(f"task:{1 if num_ps == 2 else 0}/device:CPU:0")
        w, b = ps_model.plain_loop(optimizer, batches)
        np.testing.assert_array_equal(model.w.numpy(), w)
        np.testing.assert_array_equal(model.b.numpy(), b)


def test_an_update_is_one_request_per_ps_task():
    with in_process_cluster(num_workers=1, num_ps=1) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            model = ps_model.Model("adam")
        # per step: w and b read (one request each), one update of both; (+1: the first stats request)
        assert ps_model.requests_of_later_steps(strategy, coordinator, model, ps_model.data(4)) == 3 * 3 + 1


def test_updates_of_several_workers_all_land():
    with in_process_cluster(num_workers=3, num_ps=2) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            w = md.Variable(np.full(5, 100.0, np.float32), name="w")
            optimizer = md.optimizers.SGD(0.5)
        c = np.ones(5, np.float32)
        workers = [coordinator.schedule(ps_model.constant_step, args=(w, optimizer, c)) for _ in range(40)]
        coordinator.join()
        assert set(coordinator.fetch(workers)) <= {0, 1, 2}
        # each step subtracts 0.5: the sum is exact whatever order the asynchronous steps took
        np.testing.assert_array_equal(w.numpy(), np.full(5, 80.0, np.float32))


def test_per_worker_iterators_run_out_as_tf():
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        per_worker = coordinator.create_per_worker_dataset(ps_model.small_dataset)
        iterator = iter(per_worker)
        with pytest.raises(NotImplementedError, match="scheduled function"):
            next(iterator)
        values = [coordinator.schedule(ps_model.next_batch, args=(iterator,)) for _ in range(12)]
        with pytest.raises(OutOfRangeError, match="End of sequence"):
            coordinator.join()
        seen = {0: [], 1: []}
        for value in values:
            try:
                worker, batch = value.fetch()
            except (OutOfRangeError, CancelledError):
                continue
            seen[worker].append(batch.tolist())
        batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        for got in seen.values():  # each worker iterates its own copy of the dataset, in order
            assert got == batches[:len(got)]
        assert len(seen[0]) == 5 or len(seen[1]) == 5  # (one ran out: five batches, then OutOfRangeError)


def test_iterators_of_past_epochs_are_let_go_on_the_workers():
    with in_process_cluster(num_workers=1) as strategy:
        coordinator = Coordinator(strategy)
        per_worker = coordinator.create_per_worker_dataset(ps_model.small_dataset)
        held = strategy.test_servers[("worker", 0)]._resources
        for epoch in range(3):
            iterator = iter(per_worker)
            batches = [coordinator.schedule(ps_model.next_batch, args=(iterator,)) for _ in range(5)]
            coordinator.join()
            assert [b.fetch()[1].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
            del iterator, batches
            gc.collect()
            assert len(held) == 1  # this epoch's (let go of when the next function runs): the earlier ones are gone


def test_a_dataset_fn_shards_by_worker_index():
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(ps_model.sharded_by_worker))
        _release.clear()
        first = coordinator.schedule(block_until_released)  # holds one worker: the next runs on the other
        other = coordinator.schedule(ps_model.next_batch, args=(iterator,)).fetch()
        _release.set()
        first.fetch()
        worker, batch = other
        np.testing.assert_array_equal(batch, [worker, worker + 2])  # Dataset.range(8).shard(2, worker)


def test_an_error_is_raised_by_join_and_cancels_what_is_queued():
    with in_process_cluster(num_workers=1) as strategy:
        coordinator = Coordinator(strategy)
        _release.clear()
        held = coordinator.schedule(block_until_released)
        failed = coordinator.schedule(ps_model.fail, args=("boom",))
        queued = coordinator.schedule(ps_model.identity, args=(1,))
        _release.set()
        with pytest.raises(ValueError, match=r"boom \(in the function scheduled on /job:worker/replica:0/task:0\)"):
            coordinator.join()
        assert held.fetch() == 0
        with pytest.raises(ValueError, match="boom"):
            failed.fetch()
        with pytest.raises(CancelledError, match="reschedule"):
            queued.fetch()
        # the coordinator goes on after the error was raised
        assert coordinator.schedule(ps_model.identity, args=(2,)).fetch() == 2
        coordinator.schedule(ps_model.fail, args=("again",))
        with pytest.raises(ValueError, match="again"):
            while True:  # TF's: the next schedule (or join, or done) raises it
                coordinator.schedule(ps_model.identity, args=(3,))
        assert coordinator.done()


def test_bad_schedules():
    with in_process_cluster(num_workers=1) as strategy:
        coordinator = Coordinator(strategy)
        with pytest.raises(TypeError, match="only accepts a callable"):
            coordinator.schedule(3)
        remote = coordinator.schedule(ps_model.identity, args=(1,))
        with pytest.raises(ValueError, match="RemoteValue.*input"):
            coordinator.schedule(ps_model.identity, args=(remote,))
        lock = threading.Lock()

        def uses_a_lock():
            with lock:
                return 1

        with pytest.raises(TypeError, match=r"fn=.*uses_a_lock cannot be sent.*lock"):
            coordinator.schedule(uses_a_lock)
        with pytest.raises(TypeError, match="arguments of identity cannot be sent"):
            coordinator.schedule(ps_model.identity, args=(lock,))
        with pytest.raises(ValueError, match="dataset_fn="):
            coordinator.create_per_worker_dataset(3)
        coordinator._cluster.stop()
        with pytest.raises(RuntimeError, match="stopped"):
            coordinator.schedule(ps_model.identity, args=(1,))


def test_without_cloudpickle_functions_travel_by_reference(monkeypatch):
    monkeypatch.setattr(rpc, "cloudpickle", None)
    with in_process_cluster(num_workers=1) as strategy:
        coordinator = Coordinator(strategy)
        assert coordinator.schedule(ps_model.identity, args=(5,)).fetch() == 5
        with pytest.raises(TypeError, match="module level of a module every task imports.*cloudpickle"):
            coordinator.schedule(lambda: 1)
        assert coordinator.schedule(ps_model.step_function, args=(1,)).fetch() == 2


# --- sharded variables ---------------------------------------------------------------------------------------

def test_a_partitioner_shards_variables_as_tf():
    with in_process_cluster(num_workers=1, num_ps=2,
                            variable_partitioner=partitioners.FixedShardsPartitioner(5)) as strategy:
        value = np.arange(13 * 2, dtype=np.float32).reshape(13, 2)
        with strategy.scope():
            table = md.Variable(value, name="table")
            scalar = md.Variable(np.float32(1), name="scalar")  # rank 0: never partitioned
            two_rows = md.Variable(np.ones((2, 3), np.float32), name="two")  # 5 shards asked: 2 rows, 2 shards
        assert isinstance(table, ShardedVariable) and not isinstance(scalar, ShardedVariable)
        assert [v.shape[0] for v in table.variables] == [3, 3, 3, 2, 2]  # TF's "div" split of 13 rows over 5
        assert [v.name for v in table.variables] == [f"table/part_{i}:0" for i in range(5)]
        assert [v.device[-14:-13] for v in table.variables] == ["0", "1", "0", "1", "0"]
        assert (table.name, table.shape, table.dtype) == ("ShardedVariable", (13, 2), np.float32)  # (TF's)
        assert [v.shape for v in two_rows.variables] == [(1, 3), (1, 3)]
        np.testing.assert_array_equal(table.numpy(), value)
        table.assign_add(np.ones((13, 2), np.float32))
        np.testing.assert_array_equal(table.read_value(), value + 1)
        np.testing.assert_array_equal(table.embedding_lookup([[12, 0], [5, 5]]), (value + 1)[[[12, 0], [5, 5]]])
        with pytest.raises(IndexError, match="13"):
            table.embedding_lookup([13])
        with pytest.raises(ValueError, match="shape"):
            table.assign(np.zeros((12, 2), np.float32))


def test_sharded_variables_and_their_shards_are_named_as_tf():
    reference = json.loads((pathlib.Path(__file__).parent / "data" / "tf_sharded_names_reference.json").read_text())
    assert reference["tf_version"].startswith("2.21")
    with in_process_cluster(num_workers=1, num_ps=2,
                            variable_partitioner=partitioners.FixedShardsPartitioner(3)) as strategy:
        with strategy.scope():  # (the recorder's variables, in its order)
            made = {"named": md.Variable(np.zeros((7, 2), np.float32), name="emb"),
                    "unnamed": md.Variable(np.zeros(5, np.float32)),
                    "nested_name": md.Variable(np.zeros((2, 2), np.float32), name="outer/inner"),
                    "scalar": md.Variable(np.float32(1), name="scalar"),
                    "one_row": md.Variable(np.zeros((1, 3), np.float32), name="row")}
            with md.name_scope("scope"):
                made["in_name_scope"] = md.Variable(np.zeros(4, np.float32), name="table")
                made["unnamed_in_name_scope"] = md.Variable(np.zeros(4, np.float32))
        assert sorted(made) == sorted(reference["cases"])
        for case, v in made.items():
            tf = reference["cases"][case]
            shards = v.variables if isinstance(v, ShardedVariable) else None
            assert (case, isinstance(v, ShardedVariable), v.name) == (case, tf["sharded"], tf["name"])
            if shards is not None:
                assert [s.name for s in shards] == tf["shards"], case
                assert [list(s.shape) for s in shards] == tf["shapes"], case
        assert "'emb'" in repr(made["named"])  # (ours names the variable; TF's repr is the object's address)
        with pytest.raises(ValueError, match="'emb'"):
            made["named"].assign(np.zeros((6, 2), np.float32))


def test_sharded_variables_train_as_the_plain_loop():
    batches = ps_model.data(4)
    with in_process_cluster(num_workers=1, num_ps=2,
                            variable_partitioner=partitioners.MaxSizePartitioner(max_shard_bytes=24)) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            model = ps_model.Model("adam")
        assert isinstance(model.w, ShardedVariable) and len(model.w.variables) == 3  # 6 rows of 12 bytes
        for batch in batches:
            coordinator.schedule(model.train_step, args=batch)
        coordinator.join()
        w, b = ps_model.plain_loop("adam", batches)
        np.testing.assert_array_equal(model.w.numpy(), w)
        np.testing.assert_array_equal(model.b.numpy(), b)


def test_checkpoints_save_and_restore_ps_variables_sharded_ones_whole(tmp_path):
    with in_process_cluster(num_workers=1, num_ps=2,
                            variable_partitioner=partitioners.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            w = md.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="w")
            b = md.Variable(np.float32(3), name="b")
        checkpoint = md.train.Checkpoint(w=w, b=b)
        path = checkpoint.save(str(tmp_path / "ckpt"))
        w.assign(np.zeros((3, 2), np.float32))
        b.assign(0)
        checkpoint.restore(path).assert_consumed()
        np.testing.assert_array_equal(w.numpy(), np.arange(6, dtype=np.float32).reshape(3, 2))
        assert b.numpy() == 3
        # a sharded variable is saved as one variable, as TF saves it
        assert ("w/.ATTRIBUTES/VARIABLE_VALUE", [3, 2]) in md.train.list_variables(str(tmp_path))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_gradients_of_a_sharded_table_train_as_the_plain_loop(optimizer):
    value = np.random.default_rng(5).standard_normal((11, 3)).astype(np.float32)
    steps = [md.IndexedSlices(np.full((3, 3), 0.5 * k, np.float32), np.array([10, k, 10])) for k in range(4)]
    plain = md.Variable(value, name="table")
    reference = ps_model.make_optimizer(optimizer)
    for g in steps:
        reference.apply_gradients([(g, plain)])
    with in_process_cluster(num_workers=1, num_ps=2,
                            variable_partitioner=partitioners.FixedShardsPartitioner(3)) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            table = md.Variable(value, name="table")
            trained = ps_model.make_optimizer(optimizer)
        for g in steps:
            coordinator.schedule(ps_model.apply_one, args=(trained, g, table))
        coordinator.join()
        np.testing.assert_array_equal(table.numpy(), plain.numpy())


def test_a_partitioner_that_returns_nonsense():
    with in_process_cluster(num_workers=1, variable_partitioner=lambda shape, dtype: [2, 2]) as strategy:
        with pytest.raises(ValueError, match="elements are 1 besides the first"), strategy.scope():
            md.Variable(np.ones((4, 4)), name="v")


# --- worker failure ------------------------------------------------------------------------------------------

def test_a_function_of_a_worker_that_goes_away_runs_on_another():
    with in_process_cluster(num_workers=2) as strategy:
        coordinator = Coordinator(strategy)
        assert coordinator.schedule(ps_model.identity, args=(0,)).fetch() == 0
        strategy.test_servers[("worker", 1)]._stop()
        values = [coordinator.schedule(md.distribute.coordinator.experimental_get_current_worker_index)
                  for _ in range(8)]
        coordinator.join()
        assert coordinator.fetch(values) == [0] * 8


def test_run_and_reduce_on_the_coordinator_itself():
    with in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            v = md.Variable(np.float32(3), name="v")
        out = strategy.run(lambda x: x * np.asarray(v), args=(np.float32(2),))  # (TF's: runs here, warns)
        assert out == 6
        assert strategy.reduce("SUM", out, axis=None) == 6
        assert strategy.experimental_local_results(out) == (6,)


def test_workers_that_start_after_the_coordinator():
    spec = spec_of(2, 1)
    servers = [md.distribute.Server(spec, "ps", 0)] + [md.distribute.Server(spec, "worker", i, start=False)
                                                       for i in range(2)]
    strategy = md.distribute.ParameterServerStrategy(Resolver(spec, task_type="chief", task_id=0))
    coordinator = Coordinator(strategy)
    try:
        iterator = iter(coordinator.create_per_worker_dataset(ps_model.small_dataset))
        values = [coordinator.schedule(ps_model.next_batch, args=(iterator,)) for _ in range(4)]
        for server in servers[1:]:  # (the closures went back to the queue meanwhile, the resources wait)
            server.start()
        coordinator.join()
        for worker, batch in coordinator.fetch(values):
            assert batch.tolist() in ([0, 1], [2, 3], [4, 5], [6, 7])
    finally:
        coordinator._cluster.stop()
        for server in servers:
            server._stop()


# --- processes -----------------------------------------------------------------------------------------------

def _start_tasks(spec: dict, jobs) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(md.__file__)),
                                                       os.path.dirname(__file__)]))
    code = ("import sys, json, mirrored as md; "
            "md.distribute.Server(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])).join()")
    import json
    return [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), job, str(i)], env=env)
            for job, i in jobs]


@contextlib.contextmanager
def process_cluster(num_workers: int, num_ps: int):
    spec = spec_of(num_workers, num_ps)
    tasks = _start_tasks(spec, [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)])
    strategy = md.distribute.ParameterServerStrategy(Resolver(spec, task_type="chief", task_id=0))
    strategy.test_processes = tasks
    try:
        yield strategy
    finally:
        if strategy._cluster_coordinator is not None:
            strategy._cluster_coordinator._cluster.stop()
        for task in tasks:
            task.kill()
            task.wait()


@pytest.mark.multiworker
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_processes_one_worker_trains_to_the_plain_loops_weights(optimizer):
    batches = ps_model.data(5)
    with process_cluster(num_workers=1, num_ps=2) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            model = ps_model.Model(optimizer)
        for batch in batches:
            coordinator.schedule(model.train_step, args=batch)
        coordinator.join()
        w, b = ps_model.plain_loop(optimizer, batches)
        np.testing.assert_array_equal(model.w.numpy(), w)
        np.testing.assert_array_equal(model.b.numpy(), b)


@pytest.mark.multiworker
def test_processes_two_workers_and_one_killed():
    with process_cluster(num_workers=2, num_ps=1) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            w = md.Variable(np.zeros(3, np.float32), name="w")
            optimizer = md.optimizers.SGD(1.0)
        c = np.full(3, -0.25, np.float32)
        first = [coordinator.schedule(ps_model.constant_step, args=(w, optimizer, c)) for _ in range(8)]
        coordinator.join()
        assert set(coordinator.fetch(first)) <= {0, 1}
        np.testing.assert_array_equal(w.numpy(), np.full(3, 2.0, np.float32))
        worker_1 = strategy.test_processes[-1]
        worker_1.send_signal(signal.SIGKILL)
        worker_1.wait()
        later = [coordinator.schedule(ps_model.constant_step, args=(w, optimizer, c)) for _ in range(8)]
        coordinator.join()
        assert coordinator.fetch(later) == [0] * 8  # every function ran (on the worker that is left)
        np.testing.assert_array_equal(w.numpy(), np.full(3, 4.0, np.float32))


@pytest.mark.multiworker
def test_processes_a_worker_killed_mid_function_hands_it_to_another(tmp_path):
    with process_cluster(num_workers=2, num_ps=1) as strategy:
        coordinator = Coordinator(strategy)
        held = coordinator.schedule(ps_model.wait_for_release, args=(str(tmp_path),))
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("started.*")):  # (the worker's process creates it)
            assert time.monotonic() < deadline, "the scheduled function never started"
            time.sleep(0.01)
        started = int(list(tmp_path.glob("started.*"))[0].suffix[1:])
        victim = strategy.test_processes[1 + started]  # (ps first, then the workers)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        (tmp_path / "release").touch()
        assert held.fetch() == 1 - started  # run again, on the other worker
        coordinator.join()


@pytest.mark.multiworker
def test_the_example_trains():
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "train_parameter_server.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(md.__file__)))
    env.pop("TF_CONFIG", None)
    done = subprocess.run([sys.executable, example, "--steps", "200"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    last = float(done.stdout.split("last 10 steps")[1].split()[0])
    assert last < 0.01, done.stdout


DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def _dtype(name):
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def test_every_dtype_and_layout_travels_exactly():
    with in_process_cluster(num_workers=1, num_ps=2) as strategy:
        coordinator = Coordinator(strategy)
        rng = np.random.default_rng(3)
        for name in DTYPES:
            dtype = _dtype(name)
            for shape in [(), (0,), (3, 0), (5,), (4, 3), (2, 3, 4)]:
                value = (rng.standard_normal(shape) * 10).astype(dtype)
                with strategy.scope():
                    v = md.Variable(value, name=f"v_{name}")
                got = v.numpy()
                assert got.dtype == dtype and got.shape == shape
                np.testing.assert_array_equal(got, value)
                # a worker reads and updates it: the same bits
                new = coordinator.schedule(ps_model.read_and_add, args=(v, np.ones(shape, dtype))).fetch()
                np.testing.assert_array_equal(new, (value.astype(np.float64) + 1).astype(dtype))
        with strategy.scope():
            v = md.Variable(np.zeros((3, 4), np.float32), name="layouts")
        fortran = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
        v.assign(fortran)
        np.testing.assert_array_equal(v.numpy(), fortran)
        strided = np.arange(24, dtype=np.float32).reshape(3, 8)[:, ::2]
        v.assign(strided)
        np.testing.assert_array_equal(v.numpy(), strided)
        assert coordinator.schedule(ps_model.identity, args=(strided,)).fetch().tolist() == strided.tolist()


@pytest.fixture(scope="module")
def two_ps_spec():
    spec = spec_of(1, 2)
    servers = [md.distribute.Server(spec, "ps", i) for i in range(2)]
    yield spec
    for server in servers:
        server._stop()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), cols=st.integers(0, 3), shards=st.integers(1, 9), data=st.data())
def test_shards_split_rows_as_tf_and_look_up_as_numpy(two_ps_spec, rows, cols, shards, data):
    strategy = md.distribute.ParameterServerStrategy(
        Resolver(two_ps_spec), variable_partitioner=partitioners.FixedShardsPartitioner(shards))
    value = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols) - 7.5
    with strategy.scope():
        v = md.Variable(value, name="table")
    pieces = np.array_split(value, min(shards, rows))  # TF's div split: the first (rows % n) one row longer
    if len(pieces) == 1:
        assert not isinstance(v, ShardedVariable)
    else:
        assert [tuple(s.shape) for s in v.variables] == [p.shape for p in pieces]
        ids = np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=12)), np.int64)
        np.testing.assert_array_equal(v.embedding_lookup(ids), value[ids])
    np.testing.assert_array_equal(v.numpy(), value)
