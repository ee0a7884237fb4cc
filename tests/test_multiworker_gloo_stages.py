"""Gloo's data stages (ring/direct all-reduce, broadcast, reduce, all-gather) against NumPy.

Runs over Gloo TCP (MIRRORED_SHM=0), 3 workers x 2 local replicas, so the
ring's chunks are uneven and some are empty (fewer elements than workers),
and payloads above the 16 KiB that ride in the agreement headers.
"""

import numpy as np

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER

WORKERS, LOCAL = 3, 2
COUNTS = [1, 2, 5, 4097, 100_003]  # 4097 float32 > 16 KiB: a data stage, not the headers


def value(replica, count, dtype):
    return ((np.arange(count) * 7 + replica * 13) % 101).astype(dtype)


# --- task function (runs inside the launched processes) ---------------------------------------


def stages():
    import mirrored as md

    strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=60),
                                              devices=[f"/cpu:{i}" for i in range(LOCAL)])
    group = strategy.extended._group
    rank = strategy.cluster_resolver.task_id
    mine = [rank * LOCAL + j for j in range(LOCAL)]
    got = {}
    for count in COUNTS:
        for dtype in (np.float32, np.int64):
            bufs = lambda: [value(g, count, dtype) for g in mine]  # noqa: E731
            for algorithm in ("auto", "ring", "direct"):
                got[("all_reduce", count, dtype.__name__, algorithm)] = group.all_reduce(
                    bufs(), "sum", algorithm=algorithm)[1]
            got[("max", count, dtype.__name__)] = group.all_reduce(bufs(), "max", algorithm="ring")[0]
            for root in (0, 3, 5):
                got[("broadcast", count, dtype.__name__, root)] = group.broadcast(bufs(), root)[1]
                got[("reduce", count, dtype.__name__, root)] = group.reduce(bufs(), "sum", root)
            # Rows differ between workers: all-gather-v.
            rows = [np.full((rank + 1, count), g, dtype) for g in mine]
            got[("all_gather", count, dtype.__name__)] = group.all_gather(rows, axis=0)[0]
    return got


# --- tests -----------------------------------------------------------------------------------


def test_gloo_data_stages_match_numpy():
    results = launch(stages, WORKERS, env={"MIRRORED_SHM": "0"}, timeout=240)
    for r in results:
        assert r.ok, (r.task, r.returncode, r.error, r.message, r.stderr[-3000:])
    replicas = range(WORKERS * LOCAL)
    for rank, r in enumerate(results):
        got = r.value
        for count in COUNTS:
            for dtype in (np.float32, np.int64):
                name = dtype.__name__
                every = [value(g, count, dtype) for g in replicas]
                total = np.sum(every, axis=0, dtype=dtype)
                for algorithm in ("auto", "ring", "direct"):
                    np.testing.assert_array_equal(got[("all_reduce", count, name, algorithm)], total,
                                                  err_msg=f"{r.task} all_reduce {algorithm} {count} {name}")
                np.testing.assert_array_equal(got[("max", count, name)], np.max(every, axis=0))
                for root in (0, 3, 5):
                    np.testing.assert_array_equal(got[("broadcast", count, name, root)], every[root])
                    reduced = got[("reduce", count, name, root)]
                    if root // LOCAL == rank:
                        np.testing.assert_array_equal(reduced, total, err_msg=f"reduce to {root}, {count} {name}")
                    else:
                        assert reduced is None
                want = np.concatenate([np.full((w + 1, count), w * LOCAL + j, dtype)
                                       for w in range(WORKERS) for j in range(LOCAL)])
                np.testing.assert_array_equal(got[("all_gather", count, name)], want)
