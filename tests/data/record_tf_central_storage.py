"""Records TensorFlow 2.21's tf.distribute.experimental.CentralStorageStrategy for
tests/test_central_storage_strategy.py (never imported by the tests): every scenario of
tests/central_storage_scenarios.py, with 4 logical CPUs.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_central_storage.py
        (writes tests/data/tf_central_storage_reference.json)
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import central_storage_scenarios as scenarios  # noqa: E402
import record_tf_one_device  # noqa: E402  (this folder: the script's own)


class TensorFlow(record_tf_one_device.TensorFlow):
    """The scenarios' adapter over TensorFlow: one_device_scenarios' and CentralStorageStrategy."""

    @staticmethod
    def central(compute_devices=None, parameter_device=None):
        return tf.distribute.experimental.CentralStorageStrategy(compute_devices, parameter_device)


def main():
    tf.get_logger().setLevel("ERROR")
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 4)
    adapter = TensorFlow()
    out = {"tensorflow": tf.__version__,
           "scenarios": {name: scenarios.run_scenario(adapter, fn) for name, (fn, _) in scenarios.SCENARIOS.items()}}
    for name, (_, words) in scenarios.SCENARIOS.items():
        result = out["scenarios"][name]
        missing = [w for w in words if "raises" not in result or w.lower() not in result["msg"].lower()]
        if missing:
            print(f"{name}: TF's result lacks {missing}: {result}", file=sys.stderr)
    with open(os.path.join(HERE, "tf_central_storage_reference.json"), "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"{len(out['scenarios'])} scenarios", file=sys.stderr)


if __name__ == "__main__":
    main()
