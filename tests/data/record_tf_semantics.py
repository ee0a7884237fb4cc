"""Records TensorFlow 2.21's tf.distribute semantics for tests/test_tf_semantics_parity.py (never imported by
the tests): every scenario of tests/tf_semantics_scenarios.py, run through TF's MirroredStrategy over 1, 2 and
4 logical CPU devices.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_semantics.py
        (writes tests/data/tf_semantics_reference.json)

With an argument N it prints the N-replica results only; RECORD_VERBOSE=1 names each scenario as it starts
(TF crashes the process on some inputs, e.g. collectives of empty tensors: the last name is the culprit).
"""

import contextlib
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import tf_semantics_scenarios as scenarios  # noqa: E402


class TensorFlow:
    """The scenarios' adapter over TensorFlow."""

    dist = tf.distribute
    Variable = tf.Variable
    VS = tf.VariableSynchronization
    VA = tf.VariableAggregation
    Dataset = tf.data.Dataset
    dist_name_scope = tf.name_scope
    Optional = tf.experimental.Optional

    def __init__(self):
        self._strategies = {}

    @staticmethod
    def new_strategy(n):
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])

    def strategy(self, n):
        if n not in self._strategies:
            self._strategies[n] = self.new_strategy(n)
        return self._strategies[n]

    @staticmethod
    def const(value, dtype):
        return tf.constant(value, dtype)

    @staticmethod
    def logical_cpus(count):
        """The recording runs with 4 logical CPUs from the start (TF cannot change them later)."""
        assert count == len(tf.config.list_logical_devices("CPU"))
        return contextlib.nullcontext()


def record(n):
    """Every scenario at ``n`` replicas, in a process of its own: TF keys its collectives by a group number
    that a strategy of another size in the same process would reuse."""
    tf.get_logger().setLevel("ERROR")
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 4)
    adapter = TensorFlow()
    results = {}
    for name, (fn, ns, words) in scenarios.SCENARIOS.items():
        if n not in ns:
            continue
        if os.environ.get("RECORD_VERBOSE"):
            print(name, file=sys.stderr, flush=True)
        result = scenarios.run_scenario(adapter, fn, n)
        if "raises" in result:
            missing = [w for w in words if w.lower() not in result["msg"].lower()]
            if missing:
                print(f"{name} n={n}: TF's message lacks {missing}: {result['msg']}", file=sys.stderr)
        results[name] = result
    return results


def main():
    by_n = {n: json.loads(subprocess.run([sys.executable, __file__, str(n)], check=True, stdout=subprocess.PIPE,
                                         text=True).stdout) for n in scenarios.ALL}
    out = {"tensorflow": tf.__version__, "scenarios": {
        name: {str(n): by_n[n][name] for n in ns} for name, (_, ns, _) in scenarios.SCENARIOS.items()}}
    with open(os.path.join(HERE, "tf_semantics_reference.json"), "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"{len(out['scenarios'])} scenarios, {sum(len(r) for r in out['scenarios'].values())} cases",
          file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        json.dump(record(int(sys.argv[1])), sys.stdout)
    else:
        main()
