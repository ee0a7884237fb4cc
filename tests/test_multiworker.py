"""Job-wide collectives across worker processes on 127.0.0.1: results, faults, admission.

Each test launches a real job (tests/multiworker_launch.py): one process per
task, TF_CONFIG on free loopback ports, Gloo over TCP between them.
"""

import importlib.util
import socket
import time

import numpy as np
import pytest

from multiworker_launch import kill_self, launch

from mirrored import collectives

_net = pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
pytestmark = pytest.mark.multiworker

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int32", "int64"] + (
    ["bfloat16"] if importlib.util.find_spec("ml_dtypes") else [])
OPS = ["sum", "prod", "min", "max", "mean"]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def replica_value(g, dtype, op, shape=(3, 5)):
    """Replica g's buffer: small integers, exact in every dtype, so any summation order gives the same bits."""
    rng = np.random.default_rng(1000 + g)
    low, high = (1, 3) if op == "prod" else (0 if dtype.startswith("u") else -6, 7)
    return rng.integers(low, high, size=shape).astype(_dtype(dtype))


def _group(local_replicas, timeout=20.0):
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    return CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), local_replicas, timeout=timeout)


# --- task functions (run inside the launched processes) ------------------------------------


def every_collective(local_replicas):
    g = _group(local_replicas)
    first = g.rank * local_replicas
    mine = range(first, first + local_replicas)
    out = {}
    for dtype in DTYPES:
        for op in OPS:
            out["all_reduce", dtype, op] = g.all_reduce([replica_value(r, dtype, op) for r in mine], op)
    for algorithm in ("direct", "ring", "tree"):
        out["all_reduce", algorithm] = g.all_reduce([replica_value(r, "float64", "sum") for r in mine], "sum",
                                                    algorithm=algorithm)
    big = [np.full(300_001, r + 1, np.float32) for r in mine]  # several Gloo segments per process
    out["all_reduce", "big"] = g.all_reduce(big, "sum", out=big)
    out["all_reduce", "empty"] = g.all_reduce([np.zeros((0, 4), np.float32) for _ in mine], "sum")
    last = g.num_replicas - 1
    out["broadcast"] = g.broadcast([replica_value(r, "int32", "sum") for r in mine], root=last)
    out["reduce"] = g.reduce([replica_value(r, "float32", "sum") for r in mine], "max", root=last)
    # Sizes differ along the gather axis only (replica r has r + 1 rows).
    out["all_gather"] = g.all_gather([np.full((2, r + 1), r, np.int64) for r in mine], axis=1)
    lists = [[replica_value(r, "float32", "sum", (7,)), replica_value(r, "int32", "sum", (2, 2)),
              replica_value(r, "float32", "sum", (4,))] for r in mine]
    out["batch"] = g.batch_all_reduce(lists, "mean", bytes_per_pack=16)
    g.close()
    return out


def train_until_a_peer_dies(victim, timeout, steps=40):
    g = _group(1, timeout=timeout)
    last_ok = time.time()
    for step in range(steps):
        if g.rank == victim and step == 5:
            kill_self()
        try:
            g.all_reduce([np.ones(1000, np.float32)], "sum")
        except ConnectionError as e:
            raise type(e)(f"{time.time() - last_ok:.2f}s {e}") from None
        last_ok = time.time()
        time.sleep(0.02)
    raise AssertionError("the job survived the death of a peer")  # pragma: no cover


def reach_the_collective_late(late, delay, timeout, where):
    # "call": joining has the default deadline (a loaded machine may start one task seconds after the other) and
    # only the late collective the short one; "group": the group's deadline, for joining and collectives alike.
    g = _group(1, timeout=timeout) if where == "group" else _group(1)
    if g.rank == late:
        time.sleep(delay)
    started = time.time()
    try:
        g.all_reduce([np.ones(4, np.float32)], "sum", timeout=timeout if where == "call" else None)
    except TimeoutError as e:
        raise type(e)(f"{time.time() - started:.2f}s {e}") from None


def join(timeout, local_replicas=1):
    _group(local_replicas, timeout=timeout)


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers, local_replicas, shm", [
    (2, 1, "1"), (2, 2, "1"), (3, 1, "1"), (3, 2, "1"), (2, 1, "0"), (3, 2, "0")])
def test_every_collective_equals_single_process(num_workers, local_replicas, shm):
    """shm "1": co-located tasks all-reduce through shared memory; "0": through Gloo only."""
    chief = num_workers == 3  # 3 tasks: chief:0, worker:0, worker:1
    results = launch(every_collective, num_workers - chief, chief=chief, kwargs={"local_replicas": local_replicas},
                     env={"MIRRORED_SHM": shm})
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
    N = num_workers * local_replicas
    everyone = range(N)
    for dtype in DTYPES:
        for op in OPS:
            # The single-process reference: all N replicas in one mirrored.collectives call.
            want = collectives.all_reduce([replica_value(r, dtype, op) for r in everyone], op)[0]
            for r in results:
                for got in r.value["all_reduce", dtype, op]:
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64),
                                                  err_msg=f"{dtype} {op} on {r.task}")
    big = sum(np.full(300_001, g + 1, np.float32) for g in everyone)
    want_gather = np.concatenate([np.full((2, g + 1), g, np.int64) for g in everyone], axis=1)
    want_batch = collectives.batch_all_reduce(
        [[replica_value(g, "float32", "sum", (7,)), replica_value(g, "int32", "sum", (2, 2)),
          replica_value(g, "float32", "sum", (4,))] for g in everyone], "mean")[0]
    want_sum = collectives.all_reduce([replica_value(g, "float64", "sum") for g in everyone], "sum")[0]
    for r in results:
        v = r.value
        for i in range(local_replicas):
            for algorithm in ("direct", "ring", "tree"):
                np.testing.assert_array_equal(v["all_reduce", algorithm][i], want_sum, err_msg=algorithm)
            np.testing.assert_array_equal(v["all_reduce", "big"][i], big)
            assert v["all_reduce", "empty"][i].shape == (0, 4)
            np.testing.assert_array_equal(v["broadcast"][i], replica_value(N - 1, "int32", "sum"))
            np.testing.assert_array_equal(v["all_gather"][i], want_gather)
            for got, want in zip(v["batch"][i], want_batch):
                np.testing.assert_array_equal(got, want)
        holds_root = r.task == results[-1].task
        if holds_root:
            want = np.max([replica_value(g, "float32", "sum") for g in everyone], axis=0)
            np.testing.assert_array_equal(v["reduce"], want)
        else:
            assert v["reduce"] is None


@pytest.mark.parametrize("timeout, victim, shm", [(3.0, 2, "1"), (None, 2, "1"), (3.0, 0, "1"), (3.0, 2, "0"),
                                                 (None, 0, "0")])
def test_a_killed_worker_is_named_by_every_survivor(timeout, victim, shm):
    """Victim 0 also serves the rendezvous store: survivors must still name it."""
    results = launch(train_until_a_peer_dies, 3, kwargs={"victim": victim, "timeout": timeout}, timeout=40,
                     env={"MIRRORED_SHM": shm})
    assert results[victim].returncode == -9
    for r in results:
        if r is results[victim]:
            continue
        assert r.error == "PeerLostError", (r.task, r.error, r.message)
        assert f"worker:{victim}" in r.message and "gone" in r.message, r.message
        # Survivors fail promptly: a dead peer's sockets close at once, whatever the timeout.
        assert float(r.message.split("s ", 1)[0]) < (timeout or 0) + 5


def test_a_peer_that_never_joins_is_named_at_the_timeout():
    (chief,) = launch(join, 2, kwargs={"timeout": 2.0}, only=[0], timeout=60)
    assert chief.error == "PeerTimeoutError", chief.message
    assert "worker:1 did not join within 2.0 s" in chief.message
    # Raised at the timeout, not at launch()'s: timed from the call, not from the task's start-up (its
    # imports alone can take seconds on a busy machine).
    assert 2.0 <= chief.raised_at - chief.called_at < 2.0 + 8


@pytest.mark.parametrize("where, timeout", [("call", 1.5), ("group", 10.0)])
@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_peer_that_is_late_for_a_collective_is_named(shm, where, timeout):
    results = launch(reach_the_collective_late, 2, kwargs={"late": 1, "delay": timeout + 4.0, "timeout": timeout,
                                                           "where": where}, timeout=60, env={"MIRRORED_SHM": shm})
    first = results[0]
    assert first.error == "PeerTimeoutError", first.message
    assert "worker:1 did not reach this collective" in first.message
    assert float(first.message.split("s ", 1)[0]) < timeout + 5


def test_workers_with_different_replica_counts_are_refused():
    results = launch(join, 2, kwargs={"timeout": 10.0}, per_task_kwargs={1: {"local_replicas": 2}}, timeout=30)
    for r in results:
        assert r.error == "ValueError", (r.task, r.error, r.message)
        assert "task worker:1 has 2 local replicas but" in r.message or "has 1 local replicas" in r.message


# --- the store, in process -----------------------------------------------------------------


def test_store_admits_only_this_jobs_tasks():
    server = _net.StoreServer("127.0.0.1", 0, "secret", 2)
    try:
        with pytest.raises(PermissionError, match="wrong job token.*MIRRORED_JOB_TOKEN"):
            _net.StoreClient("127.0.0.1", server.port, "guess", 0, "chief:0", 5.0)
        with pytest.raises(PermissionError, match="task rank 2 is outside this job's 2 tasks"):
            _net.StoreClient("127.0.0.1", server.port, "secret", 2, "chief:0", 5.0)
        # A stranger speaking another protocol is dropped and the store keeps serving.
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            try:
                assert s.recv(100) == b""  # closed without a word
            except ConnectionResetError:
                pass  # or reset, when our request was still unread
        client = _net.StoreClient("127.0.0.1", server.port, "secret", 1, "chief:0", 5.0)
        client.set("k", b"v")
        assert client.get("k") == b"v"
    finally:
        server.close()


def test_store_wait_reports_missing_keys_and_departed_tasks():
    server = _net.StoreServer("127.0.0.1", 0, "t", 2)
    try:
        a = _net.StoreClient("127.0.0.1", server.port, "t", 0, "chief:0", 5.0)
        b = _net.StoreClient("127.0.0.1", server.port, "t", 1, "chief:0", 5.0)
        b.set("x", b"\x00\x01")
        started = time.monotonic()
        assert a.wait(["x", "y"], 0.3) == ["y"]
        assert 0.25 < time.monotonic() - started < 3
        with pytest.raises(IndexError, match="key 'y' is not set"):
            a.get("y")
        assert a.get("x") == b"\x00\x01"
        assert [s[:2] for s in a.status()] == [(True, False), (True, False)]
        del b
        deadline = time.monotonic() + 5
        while a.status()[1][:2] != (False, True) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.status()[1][:2] == (False, True)
    finally:
        server.close()


def test_a_client_gives_up_on_a_store_that_never_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"chief:0 at 127.0.0.1:{port} within 0.5 s.*start task chief:0"):
        _net.StoreClient("127.0.0.1", port, "t", 1, "chief:0", 0.5)
    assert time.monotonic() - started < 3


def test_the_store_binds_only_the_configured_address():
    with pytest.raises(ConnectionError, match="cannot listen on 192.0.2.1"):
        _net.StoreServer("192.0.2.1", 0, "t", 1)  # TEST-NET-1: not an address of this machine
