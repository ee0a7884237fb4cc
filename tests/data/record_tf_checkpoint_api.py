"""Records TensorFlow 2.21's tf.train.Checkpoint / CheckpointManager semantics for
tests/test_checkpoint_tf_parity.py (never imported by the tests): every scenario of
tests/tf_checkpoint_scenarios.py, run over TF's MirroredStrategy with 1 and 2 logical CPU devices and Keras 3's
optimizers, each in a fresh temporary directory.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_checkpoint_api.py
        (writes tests/data/tf_checkpoint_api_reference.json)

With an argument N it prints the N-replica results only.
"""

import json
import sys
import tempfile

from recording import logical_cpus, record_by_replicas, record_scenarios, tf, write_reference  # (this folder)
import keras
from scenario_adapter import ScenarioAdapter  # (the tests folder: recording puts it on the path)
import tf_checkpoint_scenarios as scenarios


class TensorFlow(ScenarioAdapter):
    """The scenarios' adapter over TensorFlow."""

    MirroredStrategy = tf.distribute.MirroredStrategy
    Variable = tf.Variable
    Module = tf.Module
    Checkpoint = tf.train.Checkpoint
    CheckpointManager = tf.train.CheckpointManager
    train = tf.train
    SGD = keras.optimizers.SGD
    Adam = keras.optimizers.Adam
    Dataset = tf.data.Dataset

    @staticmethod
    def const(value, dtype):
        return tf.constant(value, dtype)


def record(n):
    """Every scenario at ``n`` replicas, each in a fresh temporary directory."""
    logical_cpus(2)
    adapter = TensorFlow()

    def run(fn):
        with tempfile.TemporaryDirectory() as tmp:
            return scenarios.run_scenario(adapter, fn, n, tmp)

    return record_scenarios(scenarios, n, run)


def main():
    if len(sys.argv) > 1:
        json.dump(record(int(sys.argv[1])), sys.stdout)
        return
    out = {"tensorflow": tf.__version__, "keras": keras.__version__, "scenarios": record_by_replicas(__file__, (1, 2))}
    write_reference("tf_checkpoint_api_reference.json", out, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
