"""Records TensorFlow 2.21's tf.config answers for tests/test_config.py (never imported by the tests): for each
scenario of tests/config_cases.py, in a process of its own (TF fixes its devices at their first use), the repr of
each expression's result, or the error it raises.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_config.py
        (writes tests/data/tf_config_reference.json)
"""

import json
import subprocess
import sys

from recording import tf, write_reference  # (this folder)
from config_cases import SCENARIOS  # (the tests folder: recording puts it on the path)


def run_scenario(name):
    scope = {"config": tf.config, "cpu": lambda: tf.config.list_physical_devices("CPU")[0],
             "phantom_gpu": tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")}
    answers = []
    for expression in SCENARIOS[name]:
        try:
            answers.append({"repr": repr(eval(expression, scope))})
        except Exception as e:  # noqa: BLE001 - TF's error is the recorded answer
            answers.append({"raises": type(e).__name__, "msg": str(e)})
    return answers


if __name__ == "__main__":
    if len(sys.argv) > 1:
        tf.get_logger().setLevel("ERROR")
        print(json.dumps(run_scenario(sys.argv[1])))
    else:
        write_reference("tf_config_reference.json", {
            name: json.loads(subprocess.run([sys.executable, __file__, name], check=True, stdout=subprocess.PIPE,
                                            text=True).stdout) for name in SCENARIOS}, indent=1)
