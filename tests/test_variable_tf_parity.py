"""md.Variable against TensorFlow 2.21 (tests/data/tf_conversions_reference.json, recorded by
tests/data/record_tf_conversions.py): is_initialized inside and outside strategy.run, for mirrored and
sync-on-read variables at 1, 2 and 4 replicas."""

import json
import os

import numpy as np
import pytest

import mirrored as md

with open(os.path.join(os.path.dirname(__file__), "data", "tf_conversions_reference.json")) as _f:
    REFERENCE = json.load(_f)["is_initialized"]


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
