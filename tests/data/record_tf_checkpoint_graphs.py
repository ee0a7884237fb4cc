"""Records TensorFlow 2.21 + Keras 3.15 on the random object graphs of tests/tf_checkpoint_graphs.py for
tests/test_checkpoint_tf_graphs.py (never imported by the tests): each case is built over TF's MirroredStrategy
(1 to 3 logical CPUs), its ON_READ variables given other values on every replica, its optimizer trained, and
saved with tf.train.Checkpoint.save to tests/data/tf_checkpoint_graphs/gNNN-1 (TensorBundle). Recorded: what
tf.train.list_variables / load_variable read from the file, and what TF's own restore of it gives in fresh
objects: the statuses, every replica's values, with the graph whole, one top-level object left out, one variable
more, and the variables created after the restore (deferred restoration). Also the random CheckpointManager
sequences (``manager_cases``): after each operation, what the manager and tf.train's functions show.

    /work/venvs/tf/bin/python tests/data/record_tf_checkpoint_graphs.py
        (writes tests/data/tf_checkpoint_graphs/ and tests/data/tf_checkpoint_graphs.json)

With an argument N it prints the N-replica cases' results only (each replica count runs in a process of its own).
"""

import json
import os
import shutil
import sys
import tempfile

from recording import HERE, logical_cpus, record_by_replicas, tf, write_reference  # (this folder)
import keras
from scenario_adapter import ScenarioAdapter  # (the tests folder: recording puts it on the path)
import tf_checkpoint_graphs as graphs

OUT = os.path.join(HERE, "tf_checkpoint_graphs")


class TensorFlow(ScenarioAdapter):
    MirroredStrategy = tf.distribute.MirroredStrategy
    Variable = tf.Variable
    Module = tf.Module
    Checkpoint = tf.train.Checkpoint
    CheckpointManager = tf.train.CheckpointManager
    train = tf.train
    VariableSynchronization = tf.VariableSynchronization
    VariableAggregation = tf.VariableAggregation
    strings = True

    @staticmethod
    def optimizer(kind, **config):
        return getattr(keras.optimizers, kind)(**config)

    @staticmethod
    def const(value, dtype):
        return tf.constant(value, tf.string if dtype == "string" else dtype)


def restored(X, case, path, **how):
    ckpt, made, optimizer, attach = graphs.build(X, case, zero=True, **how)
    status = ckpt.restore(path)
    out = {"before": graphs.statuses(status)}
    if how.get("deferred"):
        attach()
    var_list = [made[i] for i in case["optimizer"]["vars"] if i in made] if optimizer is not None else []
    if var_list:
        with X.strategy(case["replicas"]).scope():
            optimizer.build(var_list)
    out["after"] = graphs.statuses(status)
    out["vars"] = {str(i): graphs.replicas(v) for i, v in made.items()}
    if not how:  # what TF saves again from the restored objects
        with tempfile.TemporaryDirectory() as tmp:
            again = ckpt.write(os.path.join(tmp, "again"))
            out["resaved"] = {k: graphs.arr(tf.train.load_variable(again, k)) for k, _ in tf.train.list_variables(again)
                              if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}
    return out


def record_case(X, case):
    ckpt, made, optimizer, _ = graphs.build(X, case)
    graphs.set_on_read_copies(X, case, made)
    graphs.train(X, case, made, optimizer)
    path = ckpt.save(os.path.join(OUT, case["name"]))
    names = [[k, list(s)] for k, s in tf.train.list_variables(path)]
    out = {"path": os.path.basename(path), "names": names,
           "values": {k: graphs.arr(tf.train.load_variable(path, k)) for k, _ in names
                      if k != "_CHECKPOINTABLE_OBJECT_GRAPH"},
           "saved": {str(i): graphs.replicas(v) for i, v in made.items()}}
    out["full"] = restored(X, case, path)
    out["partial"] = restored(X, case, path, drop=case["drop"])
    out["extra"] = restored(X, case, path, extra=True)
    out["deferred"] = restored(X, case, path, deferred=True)
    return out


def record(n):
    logical_cpus(3)
    X = TensorFlow()
    results = {}
    for case in graphs.cases():
        if case["replicas"] != n:
            continue
        if os.environ.get("RECORD_VERBOSE"):
            print(case["name"], file=sys.stderr, flush=True)
        try:
            results[case["name"]] = record_case(X, case)
        except Exception as e:  # noqa: BLE001  (recorded: the test expects mirrored to raise likewise)
            results[case["name"]] = {"raises": type(e).__name__, "msg": str(e)}
    if n == 1:
        import tf_checkpoint_scenarios as scenarios

        for case in graphs.manager_cases():
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    results[case["name"]] = graphs.run_manager_case(X, case, tmp, scenarios.files,
                                                                    scenarios.state_lines, scenarios.rel)
                except Exception as e:  # noqa: BLE001
                    results[case["name"]] = {"raises": type(e).__name__, "msg": str(e)}
    return results


def main():
    if len(sys.argv) > 1:
        json.dump(record(int(sys.argv[1])), sys.stdout)
        return
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    by_case = {name: result for name, by_n in record_by_replicas(__file__, (1, 2, 3)).items()
               for result in by_n.values()}
    managers = {name: by_case.pop(name) for name in [c["name"] for c in graphs.manager_cases()]}
    out = {"tensorflow": tf.__version__, "keras": keras.__version__, "seed": graphs.SEED, "cases": by_case,
           "managers": managers}
    os.remove(os.path.join(OUT, "checkpoint"))
    write_reference("tf_checkpoint_graphs.json", out, indent=None, sort_keys=True)


if __name__ == "__main__":
    main()
