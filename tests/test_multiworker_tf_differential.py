"""MultiWorkerMirroredStrategy against TensorFlow's: jobs of separate processes on 127.0.0.1 run
tests/multiworker_tf_scenarios.py, and every task's results must equal what TensorFlow 2.21's tasks gave in the
same job shape (tests/data/tf_multiworker_reference.json, recorded by tests/data/record_tf_multiworker.py):
datasets under every AutoShardPolicy, input contexts, cross-worker reductions and gathers, variables and the
cluster's properties. Where TensorFlow raised, ours must raise too (its error classes are TensorFlow's own).
"""

import json
import os

import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = {"workers2": (2, False), "chief_worker": (1, True), "workers3": (3, False)}


def reference():
    with open(os.path.join(HERE, "data", "tf_multiworker_reference.json")) as f:
        return json.load(f)


class MdLib:
    def __init__(self):
        import mirrored as md
        from mirrored._nest import map_structure

        self.md = md
        self.data = md.data
        self.ReduceOp = md.ReduceOp
        self.get_replica_context = md.get_replica_context
        self.map_structure = map_structure
        self.Variable = md.Variable
        self.VariableAggregation = md.VariableAggregation
        self.VariableSynchronization = md.VariableSynchronization

    def strategy(self):
        return self.md.MultiWorkerMirroredStrategy()

    @staticmethod
    def constant(x):
        return np.asarray(x)

    @staticmethod
    def to_numpy(x):
        return np.asarray(x)


def write_files(directory):
    """The scenarios' TFRecord files, as the recorder wrote them with TensorFlow."""
    import mirrored as md
    from multiworker_tf_scenarios import RECORDS_PER_FILE, record_bytes

    for sub, count in (("four", 4), ("three", 3)):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
        for f in range(count):
            records = md.data.Dataset.from_tensor_slices(np.array([record_bytes(f, r) for r in
                                                                   range(RECORDS_PER_FILE)]))
            md.data.experimental.TFRecordWriter(os.path.join(directory, sub, f"part{f}.tfrecord")).write(records)


def _task(directory):
    from multiworker_tf_scenarios import run_task

    config = json.loads(os.environ["TF_CONFIG"])
    rank = config["task"]["index"] + (config["task"]["type"] == "worker" and "chief" in config["cluster"])
    return json.loads(json.dumps(run_task(MdLib(), directory, rank)))


def differences(tf_task: dict, md_task: dict) -> list:
    """Scenario names whose results differ (both raising counts as agreeing), with both results."""
    out = []
    for name, want in tf_task.items():
        got = md_task.get(name, "<missing>")
        if isinstance(want, dict) and "raises" in want:
            if not (isinstance(got, dict) and "raises" in got):
                out.append((name, want, got))
        elif got != want:
            out.append((name, want, got))
    return out


@pytest.mark.parametrize("job", list(JOBS))
def test_tasks_see_what_tensorflow_tasks_see(job, tmp_path):
    workers, chief = JOBS[job]
    write_files(str(tmp_path))
    results = launch(_task, workers, chief=chief, kwargs={"directory": str(tmp_path)}, timeout=900)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-3000:])
    wanted = reference()[job]
    assert len(wanted) == len(results)
    report = []
    for rank, (want, r) in enumerate(zip(wanted, results)):
        for name, tf_result, md_result in differences(want, r.value):
            report.append(f"task {rank} {name}:\n  tf: {tf_result}\n  md: {md_result}")
    assert not report, f"{len(report)} differences:\n" + "\n".join(report[:40])
