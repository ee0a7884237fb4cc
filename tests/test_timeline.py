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
    meta = {e["args"]["name"] for e in _events(trace) if e["name"] == "thread_name"}
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



def _chrome_trace(path):
    """The file as chrome://tracing reads it: a JSON array of well-formed events."""
    events = _events(path)
    assert isinstance(events, list) and events
    for e in events:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M", "i") and isinstance(e["pid"], int)
        if e["ph"] in ("X", "i"):
            assert isinstance(e["tid"], int) and isinstance(e["ts"], (int, float))
        if e["ph"] == "X":
            assert e["dur"] >= 0
    return events


def _row_names(events):
    return {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}


def test_marks_and_regions_land_on_the_callers_row(trace):
    strategy = md.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with timeline.region("step", step=7):
        def body():
            with timeline.region("forward"):
                timeline.mark("inside", replica=md.get_replica_context().replica_id_in_sync_group)
        strategy.run(body)
    timeline.mark("epoch_end", epoch=1)
    timeline.stop()

    events = _chrome_trace(trace)
    user = [e for e in events if e.get("cat") == "user"]
    step = next(e for e in user if e["name"] == "step")
    assert step["ph"] == "X" and step["tid"] == timeline.HOST_ROW and step["args"] == {"step": 7}
    assert sorted(e["tid"] for e in user if e["name"] == "forward") == [0, 1]
    inside = sorted((e["tid"], e["args"]["replica"]) for e in user if e["name"] == "inside")
    assert inside == [(0, 0), (1, 1)] and all(e["ph"] == "i" for e in user if e["name"] == "inside")
    end = next(e for e in user if e["name"] == "epoch_end")
    assert end["ph"] == "i" and end["tid"] == timeline.HOST_ROW and end["ts"] >= step["ts"] + step["dur"]
    for e in user:  # the replicas' regions sit inside the step
        if e["name"] == "forward":
            assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1
    assert _row_names(events)[timeline.HOST_ROW] == "host"


def test_annotations_need_a_name():
    with pytest.raises(TypeError, match="non-empty string"):
        timeline.mark("")
    with pytest.raises(TypeError, match="non-empty string"):
        timeline.region(None)


def test_task_path():
    assert timeline.task_path("/t/trace.json", "worker:1") == "/t/trace.worker-1.json"
    assert timeline.task_path("/t/trace", "chief:0") == "/t/trace.chief-0.json"
    assert timeline.task_path("/t/trace.json", None) == "/t/trace.json"


SKEW_US = 5_000e6  # worker 1's clock runs 5000 s ahead of worker 0's


def job_with_a_timeline(skew_us):
    """A task of the job: 2 local replicas, three all-reduces inside a step region; returns its trace path."""
    import json as json_
    import os as os_

    import numpy as np_

    import mirrored as md_
    from mirrored import timeline as timeline_

    if json_.loads(os_.environ["TF_CONFIG"])["task"]["index"] == 1:
        timeline_._WALL0_US += skew_us
    strategy = md_.MultiWorkerMirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    with timeline_.region("step"):
        for _ in range(3):
            total = strategy.reduce("sum", strategy.run(lambda: np_.ones(1000, np_.float32)), axis=None)
    assert float(total[0]) == 4.0
    path = timeline_.path()
    timeline_.stop()
    return path


@pytest.mark.multiworker
def test_a_job_writes_one_file_per_task_on_one_clock(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    shared = tmp_path / "trace.json"  # the same path for every task, as Horovod users set it
    results = launch(job_with_a_timeline, 2, kwargs={"skew_us": SKEW_US}, env={"MIRRORED_TIMELINE": str(shared)},
                     timeout=90)
    assert all(r.ok for r in results), [(r.error, r.message, r.stderr[-2000:]) for r in results]
    paths = [r.value for r in results]
    assert paths == [str(tmp_path / "trace.worker-0.json"), str(tmp_path / "trace.worker-1.json")]
    assert not shared.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.worker-0.json", "trace.worker-1.json"]

    traces = [_chrome_trace(p) for p in paths]
    spans = []
    for w, events in enumerate(traces):
        # Rows: this worker's two replicas (plus its host row), named after the task.
        names = _row_names(events)
        assert names == {-1: f"worker:{w}/host", 0: f"worker:{w}/replica:0", 1: f"worker:{w}/replica:1"}
        assert all(e["tid"] in names for e in events if e["ph"] in ("X", "i"))
        coll = [e for e in events if e["ph"] == "X" and e["name"] == "all_reduce[workers]"]
        assert {e["tid"] for e in coll} == {0, 1}
        assert all(e["args"]["replicas"] == 4 and e["args"]["local_replicas"] == 2 for e in coll)
        spans.append(sorted((e for e in coll if e["tid"] == 0), key=lambda e: e["ts"]))
        sync = next(e for e in events if e["name"] == "clock_sync")["args"]
        assert sync["task"] == f"worker:{w}"
        if w == 1:  # the measured offset undoes the skew
            assert sync["offset_us"] == pytest.approx(-SKEW_US, abs=50e3)
            assert 0 <= sync["uncertainty_us"] < 50e3
    # On the shared clock each all-reduce overlaps its partner on the other worker: neither
    # can finish before the other has started.
    assert len(spans[0]) == len(spans[1]) >= 3
    slack = 50e3
    for a, b in zip(*spans):
        assert a["ts"] < b["ts"] + b["dur"] + slack and b["ts"] < a["ts"] + a["dur"] + slack, (a, b)

    merged = tmp_path / "job.json"
    assert timeline.merge(str(merged), paths) == sum(len(t) for t in traces)
    assert {e["pid"] for e in _chrome_trace(merged)} == {e["pid"] for t in traces for e in t}


@pytest.mark.parametrize("where", ["missing-dir/trace.json", "."])
def test_an_unwritable_timeline_path_is_named_and_the_import_still_works(tmp_path, where):
    code = "import mirrored as md; print(md.timeline.enabled())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, MIRRORED_TIMELINE=str(tmp_path / where)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert f"MIRRORED_TIMELINE={tmp_path / where}" in done.stderr and "running without one" in done.stderr
