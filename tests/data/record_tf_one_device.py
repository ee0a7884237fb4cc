"""Records TensorFlow 2.21's tf.distribute.OneDeviceStrategy and tf.TensorShape for
tests/test_one_device_strategy.py (never imported by the tests): every scenario of
tests/one_device_scenarios.py, and its TensorShape cases.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_one_device.py
        (writes tests/data/tf_one_device_reference.json)
"""

import os
import sys
import tempfile

from recording import record_each, tf, write_reference  # (this folder: the script's own)
import one_device_scenarios as scenarios  # (the tests folder: recording puts it on the path)
import record_tf_semantics


class TensorFlow(record_tf_semantics.TensorFlow):
    """The scenarios' adapter over TensorFlow: tf_semantics' and what one_device_scenarios adds."""

    TensorShape = tf.TensorShape
    optimizers = tf.keras.optimizers

    @staticmethod
    def one_device(device):
        return tf.distribute.OneDeviceStrategy(device)

    @staticmethod
    def mirrored_one():
        return tf.distribute.MirroredStrategy(["/cpu:0"])

    @staticmethod
    def checkpoint_keys(root):
        path = tf.train.Checkpoint(**root).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
        # The variables' object paths (mirrored's own checkpoint format keys them so; TF's TensorBundle adds
        # "/.ATTRIBUTES/VARIABLE_VALUE" and the object graph's entry)
        suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
        return sorted(name[:-len(suffix)] for name, _ in tf.train.list_variables(path) if name.endswith(suffix))


def main():
    tf.get_logger().setLevel("ERROR")
    adapter = TensorFlow()
    out = {"tensorflow": tf.__version__, "scenarios": record_each(scenarios, adapter),
           "tensor_shape": scenarios.tensor_shape_cases(adapter)}
    write_reference("tf_one_device_reference.json", out, indent=None, separators=(",", ":"))
    print(f"{len(out['scenarios'])} scenarios, {len(out['tensor_shape'])} TensorShape cases", file=sys.stderr)


if __name__ == "__main__":
    main()
