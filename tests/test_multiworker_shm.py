"""The shared-memory segment of co-located workers leaves nothing behind, whenever a worker dies."""

import os
import threading

import numpy as np
import pytest

from multiworker_launch import kill_self, launch
from multiworker_marks import MULTIWORKER

pytestmark = [*MULTIWORKER, pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")]


def _group(timeout):
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    return CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=timeout)


def die_while_setting_up(pid_file, delay):
    """Worker 0 (which creates the segment) is SIGKILLed `delay` s into joining, or after its first all-reduce."""
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    rank = int(os.environ["TF_CONFIG"].split('"index": ')[1][0])
    if rank == 0 and delay is not None:
        threading.Timer(delay, kill_self).start()
    # A survivor of a worker 0 killed while joining waits out its timeout (worker 0 serves the store): a short
    # one then, as nothing is asserted about it; the full job gets a generous one.
    g = _group(20.0 if delay is None else 5.0)
    g.all_reduce([np.ones(4, np.float32)], "sum")
    with open("/proc/self/maps") as f:
        mapped = sum("memfd:mirrored-collectives" in line for line in f)
    named = [name for name in os.listdir("/dev/shm") if str(os.getpid()) in name]
    if rank == 0 and delay is None:
        kill_self()
    try:
        g.all_reduce([np.ones(4, np.float32)], "sum")  # fails once worker 0 is gone
    except ConnectionError:
        pass
    return {"mapped": mapped, "named": named}


@pytest.mark.parametrize("delay", [None, 0.05, 0.3, 0.6])
def test_a_killed_worker_leaves_nothing_in_dev_shm(tmp_path, delay):
    pid_files = {r: str(tmp_path / f"{r}.pid") for r in range(2)}
    results = launch(die_while_setting_up, 2, per_task_kwargs={r: {"pid_file": p, "delay": delay}
                                                               for r, p in pid_files.items()},
                     env={"MIRRORED_SHM": "1"}, timeout=60)
    assert results[0].returncode == -9, (results[0].message, results[0].stderr[-2000:])
    pids = [(tmp_path / f"{r}.pid").read_text() for r in pid_files]
    leftovers = [name for name in os.listdir("/dev/shm") if any(pid in name for pid in pids)]
    assert leftovers == [], leftovers
    survivor = results[1]
    if delay is None:  # both joined: the segment was in use, as an anonymous memfd
        assert survivor.ok, (survivor.message, survivor.stderr[-2000:])
        assert survivor.value["mapped"] >= 1 and survivor.value["named"] == []
