"""Records TensorFlow 2.21's tf.function results for the randomised cases of tests/function_differential_cases.py
(never imported by the tests).

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_function.py
        (writes tests/data/tf_function_reference.json)

The strategy cases of each replica count run in a process of their own, over TF's MirroredStrategy on that many
logical CPU devices (TF keys its collectives by a group number that a strategy of another size would reuse).
"""

import json
import subprocess
import sys

import numpy as np

from recording import logical_cpus, tf, write_reference  # (this folder)
import function_differential_cases as cases


class TensorFlow:
    function = staticmethod(tf.function)
    TensorSpec = tf.TensorSpec
    Variable = tf.Variable

    @staticmethod
    def to_numpy(x):
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x)

    @staticmethod
    def rank(spec):
        return spec.shape.rank

    @staticmethod
    def dtype_name(dtype):
        return tf.as_dtype(dtype).name


def record_strategy(n):
    """Prints {name: result} of the n-replica strategy cases."""
    logical_cpus(max(cases.NS))
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    results = {name: cases.run_case(TensorFlow, case, strategy) for name, case in cases.generate().items()
               if case["kind"] == "strategy" and case["n"] == n}
    print(json.dumps(results))


def main():
    tf.get_logger().setLevel("ERROR")
    everything = cases.generate()
    results = {name: cases.run_case(TensorFlow, case) for name, case in everything.items()
               if case["kind"] != "strategy"}
    for n in cases.NS:
        text = subprocess.run([sys.executable, __file__, str(n)], check=True, stdout=subprocess.PIPE,
                              text=True).stdout
        results.update(json.loads(text))
    out = {"tensorflow": tf.__version__, "seed": cases.SEED, "drawn": everything,
           "cases": {name: results[name] for name in everything}}
    write_reference("tf_function_reference.json", out, indent=None, separators=(",", ":"))
    print(f"{len(out['cases'])} cases", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        record_strategy(int(sys.argv[1]))
    else:
        main()
