"""An integer MEAN on one worker against a SUM on another is a mismatch, like any other op.

Integer means are computed as sums and divided in float64 afterwards, but the
workers compare the op the user asked for: every worker raises the same
CollectiveMismatchError naming both sides. Over shared memory and over Gloo TCP.
"""

import re

import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER


# --- task function (runs inside the launched processes) ---------------------------------------


def mean_against_sum(kind):
    import mirrored as md

    strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=20))
    group = strategy.extended._group
    rank = strategy.cluster_resolver.task_id
    op = "mean" if rank == 0 else "sum"
    x = np.arange(1, 4, dtype=np.int32)
    report = {}
    try:
        if kind == "all_reduce":
            group.all_reduce([x], op)
        elif kind == "reduce":
            group.reduce([x], op, 0)
        else:
            group.batch_all_reduce([[x, np.ones(2, np.float32)]], op)
        report["error"] = None
    except md.errors.CollectiveMismatchError as e:
        report["error"] = str(e)
    # Matched integer means still work, as float64.
    report["mean"] = group.all_reduce([np.array([1, 2], np.int32) * (rank + 1)], "mean")[0]
    report["reduce_mean"] = group.reduce([np.array([3, 5], np.int64) * (rank + 1)], "mean", 0)
    return report


# --- tests -----------------------------------------------------------------------------------

EXPECTED = {
    "all_reduce": r"all_reduce #\d+: worker:0 passes 3 int32 elements \(mean\), worker:1 passes 3 int32 elements "
                  r"\(sum\)",
    "reduce": r"reduce #\d+: worker:0 passes 3 int32 elements \(mean\) to replica 0, worker:1 passes 3 int32 "
              r"elements \(sum\) to replica 0",
    "batch": r"all_reduce #\d+: worker:0 passes \d+ \w+ elements \(mean\), worker:1 passes \d+ \w+ elements \(sum\)",
}


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_integer_mean_against_sum_is_a_mismatch(kind, shm):
    results = launch(mean_against_sum, 2, kwargs={"kind": kind}, env={"MIRRORED_SHM": shm}, timeout=60)
    for r in results:
        assert r.ok, (r.task, r.returncode, r.error, r.message, r.stderr[-3000:])
    messages = [r.value["error"] for r in results]
    for message in messages:
        assert message is not None and re.search(EXPECTED[kind], message), message
        assert "no data was exchanged" in message
    assert messages[0] == messages[1]
    for rank, r in enumerate(results):
        mean = r.value["mean"]
        assert mean.dtype == np.float64
        np.testing.assert_array_equal(mean, [1.5, 3.0])
        if rank == 0:
            np.testing.assert_array_equal(r.value["reduce_mean"], [4.5, 7.5])
        else:
            assert r.value["reduce_mean"] is None
