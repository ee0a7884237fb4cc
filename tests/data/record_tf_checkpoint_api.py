"""Records TensorFlow 2.21's tf.train.Checkpoint / CheckpointManager semantics for
tests/test_checkpoint_tf_parity.py (never imported by the tests): every scenario of
tests/tf_checkpoint_scenarios.py, run over TF's MirroredStrategy with 1 and 2 logical CPU devices and Keras 3's
optimizers, each in a fresh temporary directory.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_checkpoint_api.py
        (writes tests/data/tf_checkpoint_api_reference.json)

With an argument N it prints the N-replica results only.
"""

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import tf_checkpoint_scenarios as scenarios  # noqa: E402


class TensorFlow:
    """The scenarios' adapter over TensorFlow."""

    Variable = tf.Variable
    Module = tf.Module
    Checkpoint = tf.train.Checkpoint
    CheckpointManager = tf.train.CheckpointManager
    train = tf.train
    SGD = keras.optimizers.SGD
    Adam = keras.optimizers.Adam
    Dataset = tf.data.Dataset

    def __init__(self):
        self._strategies = {}

    def strategy(self, n):
        if n not in self._strategies:
            self._strategies[n] = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        return self._strategies[n]

    @staticmethod
    def const(value, dtype):
        return tf.constant(value, dtype)


def record(n):
    """Every scenario at ``n`` replicas, in a process of its own (TF keys its collectives by a group number that a
    strategy of another size in the same process would reuse)."""
    tf.get_logger().setLevel("ERROR")
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    adapter = TensorFlow()
    results = {}
    for name, (fn, ns, words) in scenarios.SCENARIOS.items():
        if n not in ns:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = scenarios.run_scenario(adapter, fn, n, tmp)
        if isinstance(result, dict) and "raises" in result:
            missing = [w for w in words if w.lower() not in result["msg"].lower()]
            if missing:
                print(f"{name} n={n}: TF's message lacks {missing}: {result['msg']}", file=sys.stderr)
        results[name] = result
    return results


def main():
    if len(sys.argv) > 1:
        json.dump(record(int(sys.argv[1])), sys.stdout)
        return
    out = {"tensorflow": tf.__version__, "keras": keras.__version__, "scenarios": {}}
    for n in (1, 2):
        text = subprocess.run([sys.executable, __file__, str(n)], check=True, capture_output=True, text=True).stdout
        for name, result in json.loads(text).items():
            out["scenarios"].setdefault(name, {})[str(n)] = result
    with open(os.path.join(HERE, "tf_checkpoint_api_reference.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
