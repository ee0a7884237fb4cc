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
import sys

from recording import logical_cpus, record_by_replicas, record_scenarios, tf, write_reference  # (this folder)
from scenario_adapter import ScenarioAdapter  # (the tests folder: recording puts it on the path)
import tf_semantics_scenarios as scenarios


class TensorFlow(ScenarioAdapter):
    """The scenarios' adapter over TensorFlow."""

    MirroredStrategy = tf.distribute.MirroredStrategy
    dist = tf.distribute
    Variable = tf.Variable
    VS = tf.VariableSynchronization
    VA = tf.VariableAggregation
    Dataset = tf.data.Dataset
    dist_name_scope = tf.name_scope
    Optional = tf.experimental.Optional

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
    logical_cpus(4)
    adapter = TensorFlow()
    return record_scenarios(scenarios, n, lambda fn: scenarios.run_scenario(adapter, fn, n))


def main():
    out = {"tensorflow": tf.__version__, "scenarios": record_by_replicas(__file__, scenarios.ALL)}
    write_reference("tf_semantics_reference.json", out, indent=None, separators=(",", ":"))
    print(f"{len(out['scenarios'])} scenarios, {sum(len(r) for r in out['scenarios'].values())} cases",
          file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        json.dump(record(int(sys.argv[1])), sys.stdout)
    else:
        main()
