"""Records TensorFlow 2.21's results for the cases of tests/values_surface_cases.py (never imported by the tests):
the distributed values' and variables' Python surface over MirroredStrategy on 1 to 3 logical CPUs,
OneDeviceStrategy, CentralStorageStrategy and the default strategy.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_values_surface.py
        (writes tests/data/tf_values_surface_reference.json)

Each strategy kind records in processes of its own (TF keys its collectives by a group number that a strategy of
another size in the same process would reuse); a case that kills or hangs TF is recorded as {"tf_crashed": status}
and the recording goes on from the next case in a fresh process.
"""

import json
import sys

from recording import logical_cpus, record_in_children, tf, write_reference  # (this folder)
from record_tf_semantics import TensorFlow
import values_surface_cases as cases

TIMEOUT_S = 120


class Surface(TensorFlow):
    IndexedSlices = tf.IndexedSlices

    def make_strategy(self, kind):
        if kind.startswith("mirrored"):
            return self.strategy(int(kind[-1]))
        if kind == "one_device":
            return tf.distribute.OneDeviceStrategy("/cpu:0")
        if kind == "central_storage":
            return tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
        return tf.distribute.get_strategy()


def record(names):
    logical_cpus(3)
    adapter, everything = Surface(), cases.generate()
    for name in names:
        print(json.dumps([name, cases.run_case(adapter, everything[name])]), flush=True)


def record_kind(names):
    return record_in_children([sys.executable, __file__], names, TIMEOUT_S)


def main():
    everything = cases.generate()
    out = {"tensorflow": tf.__version__, "seed": cases.SEED, "drawn": everything, "cases": {}}
    for kind in cases.STRATEGIES:
        out["cases"].update(record_kind([name for name, case in everything.items() if case["strategy"] == kind]))
    out["cases"] = {name: out["cases"][name] for name in everything}
    write_reference("tf_values_surface_reference.json", out, indent=None, separators=(",", ":"))
    crashed = sum("tf_crashed" in r for r in out["cases"].values())
    print(f"{len(out['cases'])} cases, {crashed} crashed TF", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        record(sys.argv[1:])
    else:
        main()
