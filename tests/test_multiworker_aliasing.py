"""Multi-worker collectives whose outputs alias inputs: the same answers as separate outputs.

An output may be its own replica's input (in place, zero-copy); one that is
another local replica's input, or overlaps its own only in part, must still
get the job's result; outputs that overlap each other are refused. 2 workers
x 2 local replicas (and x 3, where a rotation makes a partial sum overwrite
an input not yet read), over shared memory and over Gloo TCP.
"""


import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER

COUNTS = [5, 300_000]  # in the headers; and through the segment's chunks / a Gloo data stage


def value(replica, count):
    return (np.arange(count) % 97 + 10 * replica + 1).astype(np.float32)


# --- task function (runs inside the launched processes) ---------------------------------------


def aliased(local):
    import mirrored as md

    strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=60),
                                              devices=[f"/cpu:{i}" for i in range(local)])
    group = strategy.extended._group
    rank = strategy.cluster_resolver.task_id
    got = {}
    for count in COUNTS:
        fresh = lambda: [value(rank * local + j, count) for j in range(local)]  # noqa: E731
        rotated = lambda a: [a[(j + 1) % local] for j in range(local)]  # noqa: E731
        for algorithm in ("auto", "ring"):
            a = fresh()
            group.all_reduce(a, "sum", out=rotated(a), algorithm=algorithm)  # every output another's input
            got[("all_reduce swapped", count, algorithm)] = [x.copy() for x in a]
            a = fresh()
            spares = [np.empty_like(x) for x in a[1:]]
            group.all_reduce(a, "sum", out=[a[1]] + spares, algorithm=algorithm)  # another replica's input
            got[("all_reduce other", count, algorithm)] = [a[1].copy()] + spares
            base = np.concatenate([value(rank * local, count), [0]]).astype(np.float32)
            a = [base[:count]] + [value(rank * local + j, count) for j in range(1, local)]
            group.all_reduce(a, "sum", out=[base[1:]] + [np.empty(count, np.float32) for _ in a[1:]],
                             algorithm=algorithm)
            got[("all_reduce shifted", count, algorithm)] = base[1:].copy()
            a = fresh()
            group.all_reduce(a, "mean", out=a, algorithm=algorithm)  # exactly in place
            got[("all_reduce in place", count, algorithm)] = [x.copy() for x in a]
        a = fresh()
        group.broadcast(a, local + 1, out=rotated(a))  # worker 1's local replica 1
        got[("broadcast swapped", count)] = [x.copy() for x in a]
        a = fresh()
        group.reduce(a, "sum", local, out=rotated(a))  # the root: worker 1's local replica 0
        got[("reduce swapped", count)] = [x.copy() for x in a]
        a = fresh()
        shared = np.empty(count + 1, np.float32)
        try:
            group.all_reduce(a, "sum", out=[shared[:count], shared[1:]] + [np.empty(count, np.float32)
                                                                            for _ in a[2:]])
            got[("overlap", count)] = None
        except ValueError as e:
            got[("overlap", count)] = str(e)
    # The job goes on after the refused call.
    got["after"] = group.all_reduce([np.ones(3, np.float32) for _ in range(local)], "sum")[0]
    return got


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("local", [2, 3])
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_outputs_aliasing_inputs_get_the_job_result(shm, local):
    results = launch(aliased, 2, kwargs={"local": local}, env={"MIRRORED_SHM": shm}, timeout=180)
    for r in results:
        assert r.ok, (r.task, r.returncode, r.error, r.message, r.stderr[-3000:])
    for rank, r in enumerate(results):
        got = r.value
        for count in COUNTS:
            every = [value(g, count) for g in range(2 * local)]
            total = np.sum(every, axis=0, dtype=np.float32)
            for algorithm in ("auto", "ring"):
                for x in got[("all_reduce swapped", count, algorithm)]:
                    np.testing.assert_array_equal(x, total, err_msg=f"{r.task} swapped {count} {algorithm}")
                for x in got[("all_reduce other", count, algorithm)]:
                    np.testing.assert_array_equal(x, total, err_msg=f"{r.task} other {count} {algorithm}")
                np.testing.assert_array_equal(got[("all_reduce shifted", count, algorithm)], total)
                for x in got[("all_reduce in place", count, algorithm)]:
                    np.testing.assert_allclose(x, total / (2 * local), rtol=1e-6)
            for x in got[("broadcast swapped", count)]:
                np.testing.assert_array_equal(x, every[local + 1], err_msg=f"{r.task} broadcast {count}")
            reduced = got[("reduce swapped", count)]
            for j in range(local):
                if rank == 1 and j == 1:  # the root's output, out[0], is a[1]
                    np.testing.assert_array_equal(reduced[j], total, err_msg=f"reduce {count}")
                else:  # no other output is written: the inputs are as they were
                    np.testing.assert_array_equal(reduced[j], every[rank * local + j])
            message = got[("overlap", count)]
            assert message is not None and "out[0] and out[1] share memory" in message, message
        np.testing.assert_array_equal(got["after"], np.full(3, 2.0 * local, np.float32))
