"""MIRRORED_TIMELINE: a Chrome trace of every collective, one row per replica."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mirrored as md
from mirrored import timeline


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.json"
    timeline.start(path)
    yield path
    timeline.stop()


def _events(path):
    with open(path) as f:
        return json.load(f)


def test_disabled_costs_a_shared_no_op(monkeypatch):
    monkeypatch.setattr(timeline, "_trace", None)  # off even when the suite runs under MIRRORED_TIMELINE
    assert not timeline.enabled()
    a = timeline.span("all_reduce", 8, "ring", 2)
    assert a is timeline.span("broadcast", 16, "direct", 4) is timeline.replica_wait(0, "merge_call")
    with a:
        pass


def test_every_collective_is_recorded_per_replica(trace):
    n = 3
    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])

    def step():
        ctx = md.get_replica_context()
        return ctx.all_reduce("sum", np.ones(1000, np.float32) * ctx.replica_id_in_sync_group)

    result = strategy.run(step)
    np.testing.assert_allclose(strategy.experimental_local_results(result)[0], np.full(1000, 3.0))
    md.collectives.broadcast([np.arange(4.0)] * n, root=1)
    timeline.stop()

    events = [e for e in _events(trace) if e["ph"] == "X"]
    collectives = [e for e in events if e["cat"] == "collective"]
    names = {e["name"] for e in collectives}
    assert names & {"all_reduce", "batch_all_reduce"} and "broadcast" in names
    for name in names:
        rows = sorted(e["tid"] for e in collectives if e["name"] == name)
        assert rows[:n] == list(range(n))  # one span per replica row
    bcast = [e for e in collectives if e["name"] == "broadcast"]
    assert {e["args"]["bytes"] for e in bcast} == {32}
    assert all(e["args"]["replicas"] == n and e["args"]["algorithm"] for e in collectives)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    # Each replica's wait at the rendezvous encloses the all-reduce it waited for.
    waits = [e for e in events if e["cat"] == "wait"]
    assert sorted({e["tid"] for e in waits}) == list(range(n))
    reduce_span = next(e for e in collectives if e["name"] in ("all_reduce", "batch_all_reduce"))
    for w in (e for e in waits if e["tid"] == 0):
        if w["ts"] <= reduce_span["ts"] and reduce_span["ts"] + reduce_span["dur"] <= w["ts"] + w["dur"] + 1:
            break
    else:
        pytest.fail("no wait span of replica 0 encloses the all-reduce")
    meta = {e["args"]["name"] for e in _events(trace) if e["ph"] == "M"}
    assert {f"replica {i}" for i in range(n)} <= meta


def test_environment_variable_enables_it_for_a_whole_run(tmp_path):
    path = tmp_path / "env_trace.json"
    code = ("import numpy as np, mirrored as md\n"
            "md.collectives.all_reduce([np.ones(256, np.float64)] * 2, 'sum')\n")
    env = {**os.environ, "MIRRORED_TIMELINE": str(path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    spans = [e for e in _events(path) if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["args"]["bytes"]) for e in spans] == [
        ("all_reduce", 0, 2048), ("all_reduce", 1, 2048)]

