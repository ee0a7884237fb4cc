"""Record TensorFlow's MultiWorkerMirroredStrategy on tests/multiworker_tf_scenarios.py: jobs of separate
processes on 127.0.0.1 with TF_CONFIG (two workers; a chief and a worker; three workers), one CPU replica each.

    /work/venvs/tf/bin/python tests/data/record_tf_multiworker.py   # writes tests/data/tf_multiworker_reference.json

The reference holds, per job, every task's {scenario: result} in rank order (chief first).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

JOBS = {"workers2": (2, False), "chief_worker": (1, True), "workers3": (3, False)}


class TFLib:
    def __init__(self):
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        self.tf = tf
        self.data = tf.data
        self.constant = tf.constant
        self.ReduceOp = tf.distribute.ReduceOp
        self.get_replica_context = tf.distribute.get_replica_context
        self.map_structure = tf.nest.map_structure
        self.Variable = tf.Variable
        self.VariableAggregation = tf.VariableAggregation
        self.VariableSynchronization = tf.VariableSynchronization

    def strategy(self):
        return self.tf.distribute.MultiWorkerMirroredStrategy()

    def kind(self, x) -> str:
        """"tensor" or the class of a distributed value (the name users meet)."""
        return "tensor" if isinstance(x, self.tf.Tensor) else type(x).__name__

    @staticmethod
    def to_numpy(x):
        return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def write_files(directory):
    """The TFRecord files of the scenarios: four/part0..3 and three/part0..2, RECORDS_PER_FILE records each."""
    import tensorflow as tf
    from multiworker_tf_scenarios import RECORDS_PER_FILE, record_bytes

    for sub, count in (("four", 4), ("three", 3)):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
        for f in range(count):
            with tf.io.TFRecordWriter(os.path.join(directory, sub, f"part{f}.tfrecord")) as w:
                for r in range(RECORDS_PER_FILE):
                    w.write(record_bytes(f, r))


def task(directory, rank, out):
    from multiworker_tf_scenarios import run_task

    result = run_task(TFLib(), directory, rank)
    with open(out, "w") as f:
        json.dump(result, f)


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def job(num_workers, chief, directory):
    ports = free_ports(num_workers + chief)
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports[chief:]]}
    tasks = [("worker", i) for i in range(num_workers)]
    if chief:
        spec["chief"] = [f"127.0.0.1:{ports[0]}"]
        tasks.insert(0, ("chief", 0))
    procs = []
    for rank, (kind, index) in enumerate(tasks):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": kind, "index": index}}))
        out = os.path.join(directory, f"task{rank}.json")
        procs.append((subprocess.Popen([sys.executable, __file__, "task", directory, str(rank), out], env=env), out))
    results = []
    for p, out in procs:
        if p.wait() != 0:
            raise SystemExit(f"a TensorFlow task failed (exit {p.returncode})")
        with open(out) as f:
            results.append(json.load(f))
    return results


def main():
    reference = {}
    for name, (workers, chief) in JOBS.items():
        with tempfile.TemporaryDirectory() as directory:
            write_files(directory)
            reference[name] = job(workers, chief, directory)
    with open(os.path.join(HERE, "tf_multiworker_reference.json"), "w") as f:
        json.dump(reference, f, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["task"]:
        task(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
