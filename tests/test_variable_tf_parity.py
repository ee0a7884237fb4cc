"""md.Variable against TensorFlow 2.21 (tests/data/tf_conversions_reference.json, recorded by
tests/data/record_tf_conversions.py): is_initialized inside and outside strategy.run, for mirrored and
sync-on-read variables at 1, 2 and 4 replicas, and tf.Variable's constructor arguments."""

import json
import os

import numpy as np
import pytest

import mirrored as md

with open(os.path.join(os.path.dirname(__file__), "data", "tf_conversions_reference.json")) as _f:
    _REFERENCE = json.load(_f)
REFERENCE = _REFERENCE["is_initialized"]
VARIABLE_ARGS = _REFERENCE["variable_args"]


def _leaf(x):
    x = np.asarray(x)
    return {"dtype": x.dtype.name, "shape": list(x.shape), "value": x.reshape(-1).astype(np.float64).tolist()}


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("kind", ["mirrored", "sync_on_read"])
def test_is_initialized_gives_one_bool_per_replica_inside_run(kind, replicas):
    want = REFERENCE[f"{kind} {replicas}"]
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        if kind == "mirrored":
            variable = md.Variable(1.0)
        else:
            variable = md.Variable(1.0, synchronization=md.VariableSynchronization.ON_READ,
                                   aggregation=md.VariableAggregation.SUM)
    inside = strategy.run(variable.is_initialized)
    assert type(inside).__name__ == ("PerReplica" if want["inside_type"] == "PerReplica" else "ndarray")
    assert [_leaf(x) for x in strategy.experimental_local_results(inside)] == want["inside"]
    assert _leaf(variable.is_initialized()) == want["outside"]


def _eval(expression):
    return eval(expression, {"np": np})


@pytest.mark.parametrize("case", VARIABLE_ARGS, ids=lambda c: f"{c['initial_value']}-{c['kwargs']}-{c.get('assign')}")
@pytest.mark.parametrize("replicas", [None, 2])
def test_constructor_arguments_as_tensorflow(case, replicas):
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)]) if replicas else md.get_strategy()
    want = case["result"]

    def make():
        with strategy.scope():
            variable = md.Variable(_eval(case["initial_value"]), **_eval(case["kwargs"]))
            if "assign" in case:
                variable.assign(_eval(case["assign"]))
        return variable

    if isinstance(want, dict):
        with pytest.raises({"TypeError": TypeError, "ValueError": ValueError}[want["raises"]]) as caught:
            make()
        words = want["msg"].split(" Got a")[0].split(",\n")[0].split(": variable_def")[0].split(". a callable")[0]
        if "assign" not in case:  # (an assign of another shape: md's own words, TF's type)
            assert words.split(" (")[0] in str(caught.value), (words, str(caught.value))
        return
    variable = make()
    got = np.asarray(variable.numpy())
    assert _leaf(got) == want[0]
