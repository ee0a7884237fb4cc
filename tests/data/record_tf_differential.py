"""Records TensorFlow 2.21's results for the randomised differential cases of tests/tf_differential_cases.py
(never imported by the tests), over TF's MirroredStrategy on 4 logical CPU devices (a case of n replicas uses the
first n).

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_differential.py
        (writes tests/data/tf_differential_reference.json)

Each replica count records in processes of its own (TF keys its collectives by a group number that a strategy of
another size in the same process would reuse). TF kills its process on some inputs (collectives of empty tensors)
and may hang on others: such a case is recorded as {"tf_crashed": exit status} and the recording goes on from the
next case in a fresh process.
"""

import json
import sys

from recording import logical_cpus, record_in_children, tf, write_reference  # (this folder)
from record_tf_semantics import TensorFlow
import tf_differential_cases as cases

TIMEOUT_S = 120


def record(n, names):
    """Prints each named case's result as a JSON line as soon as it is known (the parent sees how far we got)."""
    logical_cpus(4)
    adapter, everything = TensorFlow(), cases.generate()
    for name in names:
        print(json.dumps([name, cases.run_case(adapter, everything[name])]), flush=True)


def record_replicas(n, names):
    """{name: result} of the n-replica cases ``names``, restarting past a case that killed or hung TF."""
    return record_in_children([sys.executable, __file__, str(n)], names, TIMEOUT_S)


def main():
    everything = cases.generate()
    out = {"tensorflow": tf.__version__, "seed": cases.SEED, "drawn": everything, "cases": {}}
    for n in cases.NS:
        out["cases"].update(record_replicas(n, [name for name, case in everything.items() if case["n"] == n]))
    out["cases"] = {name: out["cases"][name] for name in everything}
    write_reference("tf_differential_reference.json", out, indent=None, separators=(",", ":"))
    crashed = sum("tf_crashed" in r for r in out["cases"].values())
    print(f"{len(out['cases'])} cases, {crashed} crashed TF", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        record(int(sys.argv[1]), sys.argv[2:])
    else:
        main()
