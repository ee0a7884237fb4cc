"""Jobs that strangers on the machine can neither join nor disturb.

A stranger (tests/tools/stranger.py) connects to every new 127.0.0.1 listener
the moment it appears, the job's store and Gloo mesh listeners included, and
sends Gloo-like sequence numbers, garbage or nothing; as this user and as
another one. An intruder of this user opens the shared segment through
/proc/<pid>/fd during start-up and scribbles on it. Every job still finishes
with exact results.
"""

import mmap
import os
import pwd
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from multiworker_launch import cluster, launch
from multiworker_marks import MULTIWORKER

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tools"))
from stranger import Stranger  # noqa: E402

pytestmark = MULTIWORKER

STRANGER_USER = "mirrored-stranger"
SIZES = (1, 17, 5000, 700_000)  # inline in the headers, one Gloo message, a ring, several shared-memory chunks


def contribution(rank, size, dtype):
    return (np.arange(size) % 13 + 3 * rank + 1).astype(dtype)


def sums_task(pid_file=None):
    """Joins the job and all-reduces buffers of every size class; returns the sums and how they travelled."""
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    resolver = TFConfigClusterResolver()
    g = CollectiveGroup.from_cluster_resolver(resolver, 1, timeout=120.0)
    rank = g.rank
    out = {}
    for dtype in (np.float32, np.int32):
        for size in SIZES:
            out[(np.dtype(dtype).name, size)] = g.all_reduce([contribution(rank, size, dtype)], "sum")[0]
    return {"sums": out, "shm_off": g._gloo.shared_memory_off}


def check_sums(results, workers):
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-3000:])
        for (dtype, size), got in r.value["sums"].items():
            want = sum(contribution(k, size, np.dtype(dtype)) for k in range(workers))
            np.testing.assert_array_equal(got, want, err_msg=f"{r.task}: {dtype}[{size}]")


def stranger_user():
    """A second user for the stranger, created when this runs as root; None: cannot."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        return None
    try:
        pwd.getpwnam(STRANGER_USER)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               STRANGER_USER], capture_output=True)
        if made.returncode != 0:
            return None
    return STRANGER_USER


@pytest.mark.parametrize("mode", ["sequence", "garbage", "silent"])
def test_a_stranger_connecting_to_every_new_listener_changes_nothing(mode):
    spec = cluster(3)
    store_port = int(spec["worker"][0].rsplit(":", 1)[1])
    with Stranger(mode) as stranger:
        results = launch(sums_task, 3, spec=spec, timeout=180)
    check_sums(results, 3)
    assert store_port in stranger.reached(), "the stranger never reached the job: this test proves nothing"


def test_a_stranger_of_another_user_changes_nothing():
    user = stranger_user()
    if user is None:
        pytest.skip("a second user needs root (useradd)")
    spec = cluster(2)
    store_port = int(spec["worker"][0].rsplit(":", 1)[1])
    with Stranger("sequence", user=user) as stranger:
        results = launch(sums_task, 2, spec=spec, timeout=180)
    check_sums(results, 2)
    assert store_port in stranger.reached(), "the stranger never reached the job: this test proves nothing"


class Intruder(threading.Thread):
    """Watches worker 0's descriptors for the shared segment, opens it through /proc/<pid>/fd, maps it
    writable if it can, and overwrites it until stopped: the attack of a same-user process at start-up."""

    def __init__(self, pid_file):
        super().__init__(daemon=True)
        self.pid_file = pid_file
        self.stop = threading.Event()
        self.opened = self.mapped = False

    def run(self):
        fd_dir = None
        while not self.stop.is_set() and not self.opened:
            if fd_dir is None:
                try:
                    with open(self.pid_file) as f:
                        fd_dir = f"/proc/{int(f.read())}/fd"
                except (OSError, ValueError):
                    continue
            try:
                for name in os.listdir(fd_dir):
                    path = os.path.join(fd_dir, name)
                    if os.readlink(path).startswith("/memfd:mirrored-collectives"):
                        fd = os.open(path, os.O_RDWR)
                        self.opened = True
                        try:
                            self.scribble(fd)
                        finally:
                            os.close(fd)
                        break
            except OSError:
                continue

    def scribble(self, fd):
        size = 0
        while size == 0 and not self.stop.is_set():  # opened before worker 0 sized it
            size = os.fstat(fd).st_size
        if size == 0:
            return
        try:
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            return  # sealed already: no writable mapping for anyone new
        self.mapped = True
        junk = bytes([0x5a]) * size
        with m:
            while not self.stop.is_set():
                m[:] = junk


@pytest.mark.parametrize("trial", range(2))
def test_a_same_user_process_opening_the_segment_at_start_up_cannot_change_the_sums(tmp_path, trial):
    pid_file = str(tmp_path / "worker0.pid")
    intruder = Intruder(pid_file)
    intruder.start()
    try:
        results = launch(sums_task, 2, per_task_kwargs={0: {"pid_file": pid_file}}, env={"MIRRORED_SHM": "1"},
                         timeout=180)
    finally:
        intruder.stop.set()
        intruder.join()
    check_sums(results, 2)
    if intruder.mapped:  # it got in before the seal: the job went over the network instead, every task
        # agreeing: named once sealed, or (its junk over the segment as a task checks it) unverified.
        reasons = [r.value["shm_off"] for r in results]
        assert len(set(reasons)) == 1, reasons
        assert "outside the job" in reasons[0] or "could not map (or verify)" in reasons[0], reasons


def test_without_an_intruder_the_segment_is_used():
    results = launch(sums_task, 2, env={"MIRRORED_SHM": "1"}, timeout=180)
    check_sums(results, 2)
    assert [r.value["shm_off"] for r in results] == ["", ""]
