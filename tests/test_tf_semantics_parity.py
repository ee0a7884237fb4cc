"""tf.distribute's semantics as real TensorFlow 2.21 shows them (tests/data/tf_semantics_reference.json,
recorded by tests/data/record_tf_semantics.py from the scenarios of tests/tf_semantics_scenarios.py over
MirroredStrategy with 1, 2 and 4 logical CPU devices), asserted against mirrored: the same scenario code,
run over mirrored's names, must give the same types, structures, dtypes, shapes, values and exception
types (with the scenario's key words). The suite never imports TensorFlow."""

import json
import math
import os

import numpy as np
import pytest

import mirrored as md
import tf_semantics_scenarios as scenarios

with open(os.path.join(os.path.dirname(__file__), "data", "tf_semantics_reference.json")) as _f:
    REFERENCE = json.load(_f)["scenarios"]

# TensorFlow's own exception classes and the built-in ones mirrored raises for them (as md.errors maps them).
_TF_ERRORS = {"InvalidArgumentError": "ValueError", "NotFoundError": "FileNotFoundError"}


class Mirrored:
    """The scenarios' adapter over mirrored."""

    dist = md.distribute
    Variable = md.Variable
    VS = md.VariableSynchronization
    VA = md.VariableAggregation
    Dataset = md.data.Dataset

    def __init__(self):
        self._strategies = {}

    @staticmethod
    def new_strategy(n):
        return md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])

    def strategy(self, n):
        if n not in self._strategies:
            self._strategies[n] = self.new_strategy(n)
        return self._strategies[n]

    @staticmethod
    def const(value, dtype):
        return np.asarray(value, dtype)


_ADAPTER = Mirrored()


def assert_same(got, want, path="result"):
    """Equal as encoded; floats to the rounding of their dtype (replicas may sum in another order)."""
    if isinstance(want, dict) and "raises" in want:
        assert isinstance(got, dict) and "raises" in got, f"{path}: TF raised {want['raises']}: {want['msg']}; " \
                                                          f"mirrored gave {got}"
        assert got["raises"] in (want["raises"], _TF_ERRORS.get(want["raises"])), (path, got, want)
        return
    if isinstance(want, dict) and "dtype" in want and "v" in want:
        assert isinstance(got, dict) and got.get("dtype") == want["dtype"] and got.get("shape") == want["shape"], \
            f"{path}: mirrored gave {got}, TF {want}"
        tol = {"float16": 1e-3, "float32": 1e-6}.get(want["dtype"], 1e-12)
        np.testing.assert_allclose(np.asarray(got["v"], np.float64), np.asarray(want["v"], np.float64),
                                   rtol=tol, atol=tol, err_msg=path)
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{path}: mirrored gave {got}, TF {want}"
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
        return
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: mirrored gave {got}, TF {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
        return
    if isinstance(want, float) and isinstance(got, float) and math.isnan(want):
        assert math.isnan(got), path
        return
    assert got == want and type(got) is type(want), f"{path}: mirrored gave {got!r}, TF {want!r}"


CASES = [(name, int(n)) for name, by_n in REFERENCE.items() for n in by_n]


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE) == sorted(scenarios.SCENARIOS)
    assert len(CASES) >= 150


@pytest.mark.parametrize("name, n", CASES, ids=[f"{name}-{n}" for name, n in CASES])
def test_matches_tensorflow(name, n):
    fn, _, words = scenarios.SCENARIOS[name]
    want = REFERENCE[name][str(n)]
    got = scenarios.run_scenario(_ADAPTER, fn, n)
    assert_same(got, want)
    if "raises" in want:
        for word in words:
            assert word.lower() in got["msg"].lower(), (word, got["msg"])
