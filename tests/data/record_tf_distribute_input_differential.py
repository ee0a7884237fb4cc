"""Record TF 2.21's answers to the seeded distributed-input cases of tests/distribute_input_differential.py, for
tests/test_distribute_input_differential.py, which replays every case on mirrored.

    /work/venvs/tf/bin/python tests/data/record_tf_distribute_input_differential.py
    # writes tests/data/tf_distribute_input_differential.json

Each strategy kind records in a process of its own (4 logical CPUs each; TF keys its collectives by a group
number that strategies of other sizes in one process would share).
"""

import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import distribute_input_differential as gen  # noqa: E402

SEED, COUNT = 32, 400
OUTPUT = "tf_distribute_input_differential.json"


def _tensorflow():
    from recording import logical_cpus, tf  # (this folder; imports TensorFlow)

    logical_cpus(4)

    class F:
        @staticmethod
        def keep(*args):
            x = tf.nest.flatten(args)[0]
            return tf.not_equal(tf.reduce_sum(tf.cast(x, tf.int64)) % 3, 1)

        @staticmethod
        def size(element):
            return tf.size(tf.nest.flatten(element)[0])

    class TensorFlow:
        Dataset = tf.data.Dataset
        InputOptions = tf.distribute.InputOptions
        InputReplicationMode = tf.distribute.InputReplicationMode
        ReduceOp = tf.distribute.ReduceOp
        flatten = staticmethod(tf.nest.flatten)
        function = staticmethod(tf.function)

        @staticmethod
        def strategy(kind):
            cpus = [f"/cpu:{i}" for i in range(4)]
            if kind.startswith("mirrored"):
                return tf.distribute.MirroredStrategy(cpus[:int(kind[-1])])
            if kind == "one_device":
                return tf.distribute.OneDeviceStrategy("/cpu:0")
            return tf.distribute.experimental.CentralStorageStrategy(compute_devices=cpus[:int(kind[-1])],
                                                                     parameter_device="/cpu:0")

        @staticmethod
        def spec_leaf(spec):
            specs = list(spec._value_specs) if hasattr(spec, "_value_specs") else [spec]
            return [[None if s.shape.rank is None else s.shape.as_list(), s.dtype.name] for s in specs]

        @staticmethod
        def numpy(value):
            return np.asarray(value.numpy() if hasattr(value, "numpy") else value)

        @staticmethod
        def zero():
            return tf.constant(0)

    TensorFlow.F = F
    return TensorFlow


def _record(kind, path):
    lib = _tensorflow()
    with open(path, "w") as f:
        for name, case in gen.cases(SEED, COUNT).items():
            if case["strategy"] == kind:
                if os.environ.get("RECORD_VERBOSE"):
                    print(name, file=sys.stderr, flush=True)
                result = gen.run_case(lib, case)
                if gen.misspelt_option(result):
                    # TF's CentralStorageStrategy reads a misspelt option whenever options are given; mirrored
                    # takes them (docs/central_storage.md): its answer is then TF's without the options.
                    result["without_options"] = gen.run_case(lib, dict(case, options={}))
                f.write(json.dumps({"name": name, "result": result}) + "\n")
                f.flush()


def main():
    from recording import tf, write_reference

    paths = {kind: f"/tmp/record_tf_dds.{kind}.jsonl" for kind in gen.STRATEGIES}
    kinds = list(gen.STRATEGIES)
    while kinds:  # two processes at a time
        running = [subprocess.Popen([sys.executable, __file__, kind, paths[kind]]) for kind in kinds[:2]]
        kinds = kinds[2:]
        for process in running:
            if process.wait():
                raise SystemExit(f"recording failed: {process.args}")
    results = {}
    for path in paths.values():
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                results[entry["name"]] = entry["result"]
    write_reference(OUTPUT, {"_tf_version": tf.__version__, "seed": SEED, "count": COUNT, "cases": results},
                    separators=(",", ":"))
    print(f"{len(results)} cases", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _record(sys.argv[1], sys.argv[2])
    else:
        main()
