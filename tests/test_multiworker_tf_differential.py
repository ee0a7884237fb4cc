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

    def kind(self, x) -> str:
        """"tensor" (an array) or the class of a distributed value (the name users meet)."""
        return type(x).__name__ if isinstance(x, self.md.DistributedValues) else "tensor"

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


def _replica_id_as_int(result):
    """TF's replica_id_in_sync_group is an int32 tensor, ours a Python int (as under MirroredStrategy): the
    numbers are compared."""
    if isinstance(result, dict) and "id" in result:
        result = dict(result, id=[int(c["value"]) for c in result["id"]])
    return result


def differences(tf_task: dict, md_task: dict) -> list:
    """Scenario names whose results differ (both raising counts as agreeing), with both results."""
    out = []
    for name, want in tf_task.items():
        got = md_task.get(name, "<missing>")
        if name == "replica/all_reduce_and_gather":
            want, got = _replica_id_as_int(want), _replica_id_as_int(got)
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


# --- Each difference the comparison found, on its own (TF 2.21's answers, from the reference) ---

def _regression_task(directory):
    import mirrored as md

    strategy = md.MultiWorkerMirroredStrategy()
    D = md.data.Dataset

    def policy(dataset, name):
        options = md.data.Options()
        options.experimental_distribute.auto_shard_policy = md.data.AutoShardPolicy[name]
        return dataset.with_options(options)

    def steps(dist):
        return [[np.asarray(c).tolist() for c in strategy.experimental_local_results(x)] for x in dist]

    files = D.list_files(f"{directory}/*.tfrecord", shuffle=False)
    per_worker = strategy.distribute_datasets_from_function(lambda ctx: D.range(2 + 3 * ctx.input_pipeline_id)
                                                            .batch(2))
    return {
        "hint": steps(strategy.experimental_distribute_dataset(policy(D.range(8).batch(4), "HINT"))),
        "spec": repr(strategy.experimental_distribute_dataset(D.range(8).batch(4, drop_remainder=True))
                     .element_spec),
        "from_function_spec": repr(per_worker.element_spec),
        "file_uneven": [[[b.decode() for b in c] for c in s] for s in steps(strategy.experimental_distribute_dataset(
            policy(md.data.TFRecordDataset(files).batch(4), "FILE")))],
        "from_function_uneven": steps(per_worker),
        "element": type(next(iter(strategy.experimental_distribute_dataset(D.range(4).batch(2))))).__name__,
    }


def _write_records(directory, count):
    from multiworker_tf_scenarios import RECORDS_PER_FILE, record_bytes
    import mirrored as md

    for f in range(count):
        records = md.data.Dataset.from_tensor_slices(np.array([record_bytes(f, r) for r in range(RECORDS_PER_FILE)]))
        md.data.experimental.TFRecordWriter(os.path.join(directory, f"part{f}.tfrecord")).write(records)


def test_two_workers_hint_spec_and_end_of_uneven_inputs(tmp_path):
    _write_records(str(tmp_path), 3)
    results = launch(_regression_task, 2, kwargs={"directory": str(tmp_path)}, timeout=300)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-3000:])
    w0, w1 = (r.value for r in results)
    # HINT with no shard hint in the pipeline shards nothing: every worker reads every batch (was: as DATA).
    assert w0["hint"] == w1["hint"] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    # Across workers every leaf is a PerReplicaSpec, its batch dimension unknown (was: TensorSpec of 2 rows).
    for w in (w0, w1):
        assert w["spec"] == w["from_function_spec"] == \
            "PerReplicaSpec(TensorSpec(shape=(None,), dtype=int64, name=None))", w["spec"]
    # FILE over 3 files: worker 1 has one file, 3 records, and takes empty steps while worker 0 still has data
    # (was: it stopped two steps early, and any collective in those steps would wait forever).
    assert w0["file_uneven"] == [[["f0-r0", "f0-r1"]], [["f0-r2", "f2-r0"]], [["f2-r1", "f2-r2"]]]
    assert w1["file_uneven"] == [[["f1-r0", "f1-r1"]], [["f1-r2"]], [[]]]
    # A step is a PerReplica across workers, of one local replica too (was: the bare array).
    assert w0["element"] == w1["element"] == "PerReplica"
    # One pipeline per worker, of different lengths: the same agreement.
    assert w0["from_function_uneven"] == [[[0, 1]], [[]], [[]]]
    assert w1["from_function_uneven"] == [[[0, 1]], [[2, 3]], [[4]]]


def _three_worker_task(directory):
    import mirrored as md

    strategy = md.MultiWorkerMirroredStrategy()
    options = md.data.Options()
    options.experimental_distribute.auto_shard_policy = md.data.AutoShardPolicy.FILE
    files = md.data.Dataset.list_files(f"{directory}/*.tfrecord", shuffle=False)
    dist = strategy.experimental_distribute_dataset(md.data.TFRecordDataset(files).batch(4).with_options(options))
    return [[len(c) for c in strategy.experimental_local_results(x)] for x in dist]


def test_three_workers_file_sharding_takes_each_workers_own_steps(tmp_path):
    # 4 files over 3 workers: worker 0 reads 2 (batches of 4 and 2 rows), the others 1 (3 rows). A global
    # batch of 4 over 3 replicas is cut 2+1+1: worker 0 takes 3 steps of its first batch and 1 of its last
    # (was: 2, the steps the other workers' cut of 2 rows would make), the others pad to its 4.
    _write_records(str(tmp_path), 4)
    results = launch(_three_worker_task, 3, kwargs={"directory": str(tmp_path)}, timeout=300)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-3000:])
    assert [r.value for r in results] == [[[2], [1], [1], [2]], [[1], [1], [1], [0]], [[1], [2], [0], [0]]]
