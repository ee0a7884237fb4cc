"""Workers that disagree on a collective: the same clear error on every worker, no data moved, the job goes on.

Each variant runs over shared memory (MIRRORED_SHM=1, the default on one
machine) and over Gloo TCP (MIRRORED_SHM=0), through the public API.
"""

import re

import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

import mirrored as md

pytestmark = MULTIWORKER


# --- task function (runs inside the launched processes) ---------------------------------------


def disagree(variant):
    """Worker 0 and worker 1 call one collective differently; then both run a matched all-reduce."""
    import mirrored as md

    strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=20))
    rank = strategy.cluster_resolver.task_id
    ctx = lambda: md.get_replica_context()  # noqa: E731
    calls = {
        "size": lambda: ctx().all_reduce("sum", np.ones(10 if rank == 0 else 20, np.float32)),
        "dtype": lambda: ctx().all_reduce("sum", np.ones(3, np.float32 if rank == 0 else np.float64)),
        "op": lambda: ctx().all_reduce("sum" if rank == 0 else "max", np.ones(3, np.float32)),
        "kind": lambda: (ctx().all_reduce("sum", np.ones(3, np.float32)) if rank == 0
                         else ctx().all_gather(np.ones(3, np.float32), axis=0)),
        "gather_shape": lambda: ctx().all_gather(np.ones((2, 3 if rank == 0 else 4), np.float32), axis=0),
    }
    report = {}
    try:
        if variant == "root":
            # Roots are not part of strategy.run's API: the job's collective group takes them.
            strategy.extended._group.broadcast([np.arange(100, dtype=np.int64)], root=rank)
        else:
            strategy.run(calls[variant])
        report["error"] = None
    except md.errors.CollectiveMismatchError as e:
        report["error"] = str(e)
        report["is_value_error"] = isinstance(e, ValueError)
    # The job's collectives still work, with nothing left over from the failed call.
    x = np.full(4, 1.0, np.float32)
    report["after"] = strategy.run(lambda: ctx().all_reduce("sum", x))
    report["gather_after"] = strategy.run(lambda: ctx().all_gather(np.full((1, 2), rank, np.int64), axis=0))
    return report


# --- tests -----------------------------------------------------------------------------------

EXPECTED = {
    "size": r"all_reduce #\d+: worker:0 passes 10 float32 elements \(sum\), worker:1 passes 20 float32 elements",
    "dtype": r"all_reduce #\d+: worker:0 passes 3 float32 elements \(sum\), worker:1 passes 3 float64 elements",
    "op": r"all_reduce #\d+: worker:0 passes 3 float32 elements \(sum\), worker:1 passes 3 float32 elements \(max\)",
    "kind": r"collective #\d+: worker:0 calls all_reduce \(3 float32 elements \(sum\)\), worker:1 calls all_gather",
    "root": r"broadcast #\d+: worker:0 passes 100 int64 elements from replica 0, worker:1 passes 100 int64 "
            r"elements from replica 1",
    "gather_shape": r"all_gather #\d+: worker:0 passes float32 buffers of shape \(2, 3\) gathered along axis 0, "
                    r"worker:1 passes float32 buffers of shape \(2, 4\)",
}


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
@pytest.mark.parametrize("variant", list(EXPECTED))
def test_a_mismatch_raises_the_same_error_on_every_worker(variant, shm):
    results = launch(disagree, 2, kwargs={"variant": variant}, env={"MIRRORED_SHM": shm}, timeout=60)
    for r in results:
        assert r.ok, (r.task, r.returncode, r.error, r.message, r.stderr[-3000:])
    messages = [r.value["error"] for r in results]
    for r, message in zip(results, messages):
        assert message is not None, f"{r.task} saw no error for a {variant} mismatch"
        assert re.search(EXPECTED[variant], message), message
        assert "every worker must" in message and "no data was exchanged" in message, message
        assert r.value["is_value_error"]
    assert messages[0] == messages[1]  # the same words on every worker
    for r in results:
        np.testing.assert_array_equal(r.value["after"], np.full(4, 2.0, np.float32))
        np.testing.assert_array_equal(r.value["gather_after"], np.array([[0, 0], [1, 1]], np.int64))


def test_the_error_class_is_exported():
    assert issubclass(md.errors.CollectiveMismatchError, ValueError)
