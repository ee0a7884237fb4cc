"""The rendezvous store and the start-up of a job on 127.0.0.1, against hostile and faulty peers.

A local process flooding the chief's store, a frozen (SIGSTOPped) chief, a
task started twice, a restarted task that reaches the old chief, unrepresentable
timeouts, and the progress a waiting task logs. Jobs are launched with
tests/multiworker_launch.py; the hostile process is the test itself.
"""

import logging
import math
import os
import re
import resource
import signal
import socket
import struct
import tempfile
import threading
import time

import numpy as np
import pytest

from multiworker_launch import cluster, launch

import mirrored as md

_net = pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
pytestmark = pytest.mark.multiworker


def _group(timeout, local_replicas=1):
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    return CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), local_replicas, timeout=timeout)


def _flag(flag_dir, name):
    with open(os.path.join(flag_dir, name), "w") as f:
        f.write(str(os.getpid()))


def _wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def _port(address):
    return int(address.rsplit(":", 1)[1])


def _in_background(fn, *args, **kwargs):
    """Runs fn in a thread; the returned callable joins it and returns fn's result."""
    box = {}

    def body():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised by join()
            box["error"] = e

    thread = threading.Thread(target=body, daemon=True)
    thread.start()

    def join():
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    join.thread = thread
    return join


# --- task functions (run inside the launched processes) ------------------------------------


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb():
    # VmHWM, not ru_maxrss: getrusage keeps the launcher's peak across fork and exec.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def work_through_a_flood(seconds, late_rank, fd_limit=None):
    """All-reduces for `seconds` while the test floods worker:0's store; worker:0 reports what it cost."""
    import json

    if fd_limit:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, hard))
    rss_before = _rss_mb()
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == late_rank:
        time.sleep(2.0)  # joins while the flood is on
    g = _group(30.0)
    dummies = []
    if fd_limit and g.rank == 0:
        # Leave the store not a single free descriptor: every accept() fails with EMFILE.
        try:
            while True:
                dummies.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
    cpu, started = _cpu_seconds(), time.monotonic()
    right = done = 0
    while True:
        # Both stop at the same call: the clocks differ, and a lone extra all-reduce is a mismatch.
        going = np.array([time.monotonic() - started < seconds], np.float32)
        if g.all_reduce([going], "min")[0][0] == 0:
            break
        out = g.all_reduce([np.full(1000, g.rank + 1.0, np.float32)], "sum")[0]
        right += bool((out == 3.0).all())
        done += 1
        time.sleep(0.05)
    report = {"right": right, "done": done, "wall": time.monotonic() - started, "cpu": _cpu_seconds() - cpu,
              "fds_filled": len(dummies)}
    for fd in dummies:
        os.close(fd)
    report["rss_growth_mb"] = _peak_rss_mb() - rss_before
    if g.rank == 0:
        from mirrored.distribute.collective_all_reduce import _stores

        report["store"] = next(server.stats() for server, _ in _stores.values() if server is not None)
    g.all_reduce([np.ones(1, np.float32)], "sum")  # neither leaves while the other still works
    return report


def all_reduce_until_a_failure(seconds, timeout, flag_dir):
    g = _group(timeout)
    _flag(flag_dir, f"pid-{g.rank}")
    started = last = time.time()
    while time.time() - started < seconds:
        try:
            g.all_reduce([np.ones(8, np.float32)], "sum")
        except Exception as e:
            _flag(flag_dir, f"failed-{g.rank}")
            raise type(e)(f"{time.time() - last:.2f}s {e}") from None
        last = time.time()
        time.sleep(0.02)
    raise AssertionError("nothing failed")  # pragma: no cover


def join_and_hold(hold, timeout, flag_dir, leave_rank=None):
    g = _group(timeout)
    _flag(flag_dir, f"joined-{g.rank}-{os.getpid()}")
    out = g.all_reduce([np.full(4, g.rank + 1.0, np.float32)], "sum")[0]
    if g.rank == leave_rank:
        _flag(flag_dir, f"left-{g.rank}")
        return out.tolist()
    time.sleep(hold)
    if leave_rank is None:
        out = g.all_reduce([np.full(4, g.rank + 1.0, np.float32)], "sum")[0]
    return out.tolist()


def join_logging_progress(timeout):
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("mirrored").setLevel(logging.INFO)
    from mirrored.distribute import collective_all_reduce

    collective_all_reduce.RENDEZVOUS_LOG_SECONDS = 1.0
    _group(timeout)


def wait_for_peers_that_never_come(flag_dir):
    _flag(flag_dir, "pid")
    _group(60.0)


def all_reduce_without_timeout(timeout, late_rank):
    g = _group(timeout)
    if g.rank == late_rank:
        time.sleep(1.0)
    return g.all_reduce([np.full(4, g.rank + 1.0, np.float32)], "sum")[0].tolist()


# --- a hostile local process ---------------------------------------------------------------


class Flood:
    """Holds `n` connections to a port, idle, garbage or announcing huge sizes; reopens those the server drops."""

    KINDS = [
        b"",                                                   # idle
        os.urandom(64),                                        # garbage
        b"MRV2" + struct.pack("<I", 0x7FFFFFFF),               # a 2 GiB job token announced
        b"MRV2" + struct.pack("<I", 1000) + b"x" * 10,         # a token that never finishes arriving
        b"MRV2" + struct.pack("<I", 0) + struct.pack("<q", 1) + struct.pack("<I", 0xFFFFFFF0),  # wrong token, huge id
    ]

    def __init__(self, port, n=300):
        self.port, self.n = port, n
        self.socks = [None] * n
        self.opened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self, i):
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        except OSError:
            return None  # not listening yet, or its backlog is full
        try:
            payload = self.KINDS[i % len(self.KINDS)]
            if payload:
                s.sendall(payload)
            s.setblocking(False)
            self.opened += 1
            return s
        except OSError:
            s.close()
            return None

    def _alive(self, s):
        try:
            return s.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _run(self):
        while not self.stop.is_set():
            for i, s in enumerate(self.socks):
                if s is None or not self._alive(s):
                    if s is not None:
                        s.close()
                    self.socks[i] = self._open(i)
            self.stop.wait(0.5)  # at most n reconnections per half second

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            if s is not None:
                s.close()


# --- the store under a flood ---------------------------------------------------------------


@pytest.mark.parametrize("fd_limit", [None, 128], ids=["flood", "flood-out-of-descriptors"])
def test_a_job_keeps_working_while_a_local_process_floods_its_store(fd_limit):
    spec = cluster(2)
    flood = Flood(_port(spec["worker"][0]))
    try:
        job = _in_background(launch, work_through_a_flood, 2, spec=spec, timeout=120,
                             kwargs={"seconds": 6.0, "late_rank": 1, "fd_limit": fd_limit})
        results = job()
    finally:
        flood.close()
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
        assert r.value["right"] == r.value["done"] >= 20, r.value
    chief = results[0].value
    # The flood reached the store and was turned away...
    assert flood.opened >= 300 and chief["store"]["dropped"] >= 300, (flood.opened, chief)
    if fd_limit:
        assert chief["fds_filled"] > 0
    # ...at a bounded cost: no memory for announced sizes, no spinning accept loop.
    assert chief["rss_growth_mb"] < 150, chief
    assert chief["cpu"] < 0.5 * chief["wall"], chief
    assert chief["store"]["buffered_bytes"] < 1 << 20, chief


def _stats_once(server, reached, within=120.0):
    """The server's counts once ``reached(counts)`` holds, or as they are after ``within`` seconds."""
    deadline = time.monotonic() + within
    stats = server.stats()
    while not reached(stats) and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = server.stats()
    return stats


def test_the_store_drops_a_huge_announced_size_without_allocating_it():
    server = _net.StoreServer("127.0.0.1", 0, "t", 1)
    try:
        client = _net.StoreClient("127.0.0.1", server.port, "t", 0, "chief:0", 120.0, instance="tester")
        socks = []
        for _ in range(24):  # each announces a 2 GiB token, then sends a little of it
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"MRV2" + struct.pack("<I", 0x7FFFFFFF) + b"x" * 1000)
            socks.append(s)
        for s in socks:
            s.settimeout(120)
            try:
                assert s.recv(10) == b""  # dropped
            except ConnectionResetError:
                pass
            s.close()
        # The server publishes its counts once per turn of its loop, after it closed what it dropped: a client
        # may see its connection closed before the counts say so (a busy machine can stall the server there).
        stats = _stats_once(server, lambda st: st["dropped"] >= 24)
        assert stats["buffered_bytes"] < 64 << 10 and stats["dropped"] >= 24, stats
        # Tasks of the job (they know the token) announcing 4 MiB values: held only as the bytes arrive.
        def handshake(rank, instance):
            return (b"MRV2" + struct.pack("<I", 1) + b"t" + struct.pack("<q", rank) + struct.pack("<I", len(instance))
                    + instance)

        rss = _rss_mb()
        announced = []
        for _ in range(15):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(handshake(0, b"tester") + bytes([1]) + struct.pack("<I", 1) + b"k"
                      + struct.pack("<I", (4 << 20) - 1) + b"x" * 1000)
            announced.append(s)
        stats = _stats_once(server, lambda st: st["buffered_bytes"] >= 15 * 1000)
        assert 15 * 1000 <= stats["buffered_bytes"] < 15 * 2000, stats
        assert _rss_mb() - rss < 30  # 60 MiB if the announced sizes were allocated
        for s in announced:
            s.close()
        # A value above the limit is refused before it leaves the client; the connection stays usable.
        with pytest.raises(ValueError, match="exceeds the store's limits"):
            client.set("big", b"x" * (5 << 20))
        client.set("k", b"v")
        assert client.get("k") == b"v"
    finally:
        server.close()


# --- blame -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_frozen_chief_is_reported_as_unresponsive_and_blames_nobody_when_it_resumes(shm):
    timeout = 2.0
    with tempfile.TemporaryDirectory() as flags:
        job = _in_background(launch, all_reduce_until_a_failure, 2, timeout=90, env={"MIRRORED_SHM": shm},
                             kwargs={"seconds": 60.0, "timeout": timeout, "flag_dir": flags})
        _wait_for(os.path.join(flags, "pid-0"), 30)
        _wait_for(os.path.join(flags, "pid-1"), 30)
        time.sleep(0.5)
        with open(os.path.join(flags, "pid-0")) as f:
            chief_pid = int(f.read())
        os.kill(chief_pid, signal.SIGSTOP)
        stopped = time.time()
        try:
            _wait_for(os.path.join(flags, "failed-1"), 3 * timeout + 10)
            time.sleep(0.5)
        finally:
            os.kill(chief_pid, signal.SIGCONT)
        chief, worker = job()
    assert worker.error == "PeerTimeoutError", (worker.error, worker.message)
    assert "worker:0 (which serves the rendezvous store) is not responding" in worker.message, worker.message
    assert "gone" not in worker.message, worker.message
    assert worker.raised_at - stopped < 2 * timeout + 4
    # Resumed, the chief knows it was the one that stalled.
    assert chief.error == "PeerTimeoutError", (chief.error, chief.message)
    assert "this task (worker:0) was frozen for" in chief.message, chief.message
    assert "task(s) worker:1" not in chief.message, chief.message


def test_a_task_started_twice_is_named_at_rendezvous():
    spec = cluster(2)
    with tempfile.TemporaryDirectory() as flags:
        job = _in_background(launch, join_and_hold, 2, spec=spec, timeout=60,
                             kwargs={"hold": 4.0, "timeout": 20.0, "flag_dir": flags})
        deadline = time.monotonic() + 30
        while len(os.listdir(flags)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.time()
        (twin,) = launch(join_and_hold, 2, spec=spec, only=[1], timeout=30,
                         kwargs={"hold": 0.0, "timeout": 20.0, "flag_dir": flags})
        results = job()
    assert twin.error == "RefusedError", (twin.error, twin.message)
    assert "worker:1 joined twice: it is already connected as process" in twin.message, twin.message
    assert twin.raised_at - started < 10  # not Gloo's connect timeout
    for r in results:  # the job itself is unharmed
        assert r.ok and r.value == [3.0] * 4, (r.task, r.error, r.message)


def test_a_restarted_task_that_reaches_the_old_chief_gets_a_clear_error():
    spec = cluster(2)
    with tempfile.TemporaryDirectory() as flags:
        job = _in_background(launch, join_and_hold, 2, spec=spec, timeout=60,
                             kwargs={"hold": 8.0, "timeout": 20.0, "flag_dir": flags, "leave_rank": 1})
        _wait_for(os.path.join(flags, "left-1"), 30)
        time.sleep(2.0)  # worker:1's process has exited
        started = time.time()
        (restarted,) = launch(join_and_hold, 2, spec=spec, only=[1], timeout=30,
                              kwargs={"hold": 0.0, "timeout": 20.0, "flag_dir": flags})
        results = job()
    assert restarted.error == "RefusedError", (restarted.error, restarted.message)
    assert "worker:1 already took part in the job that worker:0 serves" in restarted.message, restarted.message
    assert "start them all again" in restarted.message
    assert restarted.raised_at - started < 10
    assert all(r.ok for r in results), [(r.task, r.error, r.message) for r in results]


# --- progress while waiting ------------------------------------------------------------------


def test_the_chief_logs_who_it_is_waiting_for():
    spec = cluster(2)
    (chief,) = launch(join_logging_progress, 2, spec=spec, only=[0], kwargs={"timeout": 3.5}, timeout=30,
                      env={"MIRRORED_LOG_LEVEL": "INFO"})
    assert chief.error == "PeerTimeoutError" and "worker:1 did not join within 3.5 s" in chief.message
    lines = re.findall(rf"mirrored INFO waiting for worker:1 at {re.escape(spec['worker'][1])} \((\d+) s of 3.5 s\)",
                       chief.stderr)
    assert len(lines) >= 2 and [int(s) for s in lines] == sorted(int(s) for s in lines), chief.stderr


def test_a_worker_logs_that_it_is_waiting_for_the_chief():
    spec = cluster(2)
    # Long enough for two of the once-a-second progress lines on a loaded machine (3.5 s gave one).
    (worker,) = launch(join_logging_progress, 2, spec=spec, only=[1], kwargs={"timeout": 8.0}, timeout=40,
                       env={"MIRRORED_LOG_LEVEL": "INFO"})
    assert worker.error == "PeerTimeoutError", (worker.error, worker.message)
    assert "could not reach the rendezvous store of worker:0" in worker.message
    lines = re.findall(rf"mirrored INFO waiting for worker:0 at {re.escape(spec['worker'][0])} \((\d+) s of 8 s\)",
                       worker.stderr)
    assert len(lines) >= 2, worker.stderr


@pytest.mark.parametrize("rank", [0, 1], ids=["chief-waits-for-a-worker", "worker-waits-for-the-chief"])
def test_ctrl_c_lands_while_waiting_at_rendezvous(rank):
    with tempfile.TemporaryDirectory() as flags:
        job = _in_background(launch, wait_for_peers_that_never_come, 2, only=[rank], timeout=50,
                             kwargs={"flag_dir": flags})
        _wait_for(os.path.join(flags, "pid"), 30)
        time.sleep(1.5)  # inside the native wait by now
        with open(os.path.join(flags, "pid")) as f:
            os.kill(int(f.read()), signal.SIGINT)
        interrupted = time.monotonic()
        (result,) = job()
        assert time.monotonic() - interrupted < 5  # not the 60 s rendezvous timeout
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, (result.returncode, result.stderr)


# --- timeouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, math.inf, 1e9, 0.5, 30, np.float64(2.5)])
def test_representable_timeouts_are_accepted(value):
    assert md.CommunicationOptions(timeout_seconds=value).timeout_seconds == value


@pytest.mark.parametrize("value, why", [
    (1e10, "longest supported timeout"), (9.3e9, "longest supported timeout"), (10**400, "longest supported"),
    (-1.0, "must be >= 0"), (math.nan, "must be >= 0"), (-math.inf, "must be >= 0"),
    ("10", "expected a number"), (True, "expected a number"), ([1], "expected a number")])
def test_unrepresentable_timeouts_are_refused_naming_the_argument(value, why):
    with pytest.raises(ValueError, match=f"timeout_seconds=.*{why}.*(None|float)"):
        md.CommunicationOptions(timeout_seconds=value)


def test_an_infinite_timeout_means_none():
    """Used to overflow: healthy jobs failed at once with '... within -9.22337e+15 s'."""
    results = launch(all_reduce_without_timeout, 2, kwargs={"timeout": math.inf, "late_rank": 1}, timeout=60)
    for r in results:
        assert r.ok and r.value == [3.0] * 4, (r.task, r.error, r.message)


def test_the_native_side_clamps_what_python_passes():
    server = _net.StoreServer("127.0.0.1", 0, "t", 1)
    try:
        client = _net.StoreClient("127.0.0.1", server.port, "t", 0, "chief:0", 1e300)
        client.set("k", b"v")
        assert client.wait(["k"], 1e300) == []
        started = time.monotonic()
        assert client.wait(["absent"], math.nan) == ["absent"]
        assert client.wait(["absent"], -5.0) == ["absent"]
        assert time.monotonic() - started < 3
    finally:
        server.close()
