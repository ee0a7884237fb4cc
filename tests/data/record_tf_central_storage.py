"""Records TensorFlow 2.21's tf.distribute.experimental.CentralStorageStrategy for
tests/test_central_storage_strategy.py (never imported by the tests): every scenario of
tests/central_storage_scenarios.py, with 4 logical CPUs.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_central_storage.py
        (writes tests/data/tf_central_storage_reference.json)
"""

import sys

from recording import logical_cpus, record_each, tf, write_reference  # (this folder: the script's own)
import central_storage_scenarios as scenarios  # (the tests folder: recording puts it on the path)
import record_tf_one_device


class TensorFlow(record_tf_one_device.TensorFlow):
    """The scenarios' adapter over TensorFlow: one_device_scenarios' and CentralStorageStrategy."""

    @staticmethod
    def central(compute_devices=None, parameter_device=None):
        return tf.distribute.experimental.CentralStorageStrategy(compute_devices, parameter_device)


def main():
    logical_cpus(4)
    out = {"tensorflow": tf.__version__, "scenarios": record_each(scenarios, TensorFlow())}
    write_reference("tf_central_storage_reference.json", out, indent=None, separators=(",", ":"))
    print(f"{len(out['scenarios'])} scenarios", file=sys.stderr)


if __name__ == "__main__":
    main()
