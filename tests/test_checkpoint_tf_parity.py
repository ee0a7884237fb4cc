"""tf.train.Checkpoint / CheckpointManager semantics as real TensorFlow 2.21 shows them
(tests/data/tf_checkpoint_api_reference.json, recorded by tests/data/record_tf_checkpoint_api.py from the
scenarios of tests/tf_checkpoint_scenarios.py over MirroredStrategy with 1 and 2 CPU replicas and Keras 3's
optimizers), asserted against mirrored: the same scenario code, run over mirrored's names in a fresh temporary
directory, must give the same returned paths (relative to that directory), files, state-file lines, tracked names,
values, dtypes, status outcomes and exception classes (with the scenario's key words). The suite never imports
TensorFlow; where mirrored differs on purpose (docs/tf_semantics.md) the table ``DELIBERATE`` holds its result."""

import json
import os

import numpy as np
import pytest

import mirrored as md
import tf_checkpoint_scenarios as scenarios

with open(os.path.join(os.path.dirname(__file__), "data", "tf_checkpoint_api_reference.json")) as _f:
    REFERENCE = json.load(_f)["scenarios"]

# TensorFlow's own exception classes and the built-in ones mirrored raises in their place.
_TF_ERRORS = {"InvalidArgumentError": "ValueError"}


class Mirrored:
    """The scenarios' adapter over mirrored."""

    Variable = md.Variable
    Module = md.Module
    Checkpoint = md.train.Checkpoint
    CheckpointManager = md.train.CheckpointManager
    train = md.train
    SGD = md.optimizers.SGD
    Adam = md.optimizers.Adam
    Dataset = md.data.Dataset

    def __init__(self):
        self._strategies = {}

    def strategy(self, n):
        if n not in self._strategies:
            self._strategies[n] = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        return self._strategies[n]

    @staticmethod
    def const(value, dtype):
        return np.asarray(value, dtype)


_ADAPTER = Mirrored()

_TRACKABLE = {"raises": ["ValueError"], "words": ("trackable",)}
# Scenario -> mirrored's result where it differs from TensorFlow's on purpose (docs/tf_semantics.md says why).
DELIBERATE = {
    # TF accepts anything and fails at the first save(); mirrored refuses at once, naming the argument.
    "mgr_needs_checkpoint": {"raises": ["TypeError"], "words": ("checkpoint=", "md.train.Checkpoint")},
    # Keras 3 numbers an optimizer's slots by build order (_variables/N) and saves its learning rate; mirrored
    # keys slots by their variable's path, and its learning rate is configuration, not state.
    "ck_optimizer_names": [["model/w/.ATTRIBUTES/VARIABLE_VALUE", [2]],
                           ["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE", []],
                           ["optimizer/slots/model/w/momentum/.ATTRIBUTES/VARIABLE_VALUE", [2]]],
}


def assert_same(got, want, path="result"):
    """Equal as plain data; floats to the rounding of their dtype; exceptions by class (TF's or its stand-in)."""
    if isinstance(want, dict) and "raises" in want:
        assert isinstance(got, dict) and "raises" in got, f"{path}: TF raised {want['raises'][0]}: {want['msg']}; " \
                                                          f"mirrored gave {got}"
        expected = want["raises"][0]
        assert expected in got["raises"] or _TF_ERRORS.get(expected) in got["raises"], \
            f"{path}: TF raised {expected}, mirrored {got['raises'][0]}: {got['msg']}"
        return
    if isinstance(want, dict) and "dtype" in want and "v" in want:
        assert isinstance(got, dict) and got.get("dtype") == want["dtype"] and got.get("shape") == want["shape"], \
            f"{path}: mirrored gave {got}, TF {want}"
        tol = {"float16": 1e-3, "float32": 1e-6}.get(want["dtype"], 1e-12)
        np.testing.assert_allclose(np.asarray(got["v"], np.float64), np.asarray(want["v"], np.float64),
                                   rtol=tol, atol=tol, err_msg=path)
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{path}: mirrored gave {got}, TF {want}"
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
        return
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: mirrored gave {got}, TF {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
        return
    assert got == want, f"{path}: mirrored gave {got!r}, TF {want!r}"


def assert_words(got, words):
    for word in words:
        assert word.lower() in got["msg"].lower(), (word, got["msg"])


CASES = [(name, int(n)) for name, by_n in REFERENCE.items() for n in by_n]


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE) == sorted(scenarios.SCENARIOS)
    assert len(CASES) >= 70


@pytest.mark.parametrize("name, n", CASES, ids=[f"{name}-{n}" for name, n in CASES])
def test_matches_tensorflow(name, n, tmp_path):
    fn, _, words = scenarios.SCENARIOS[name]
    want = REFERENCE[name][str(n)]
    got = scenarios.run_scenario(_ADAPTER, fn, n, str(tmp_path))
    if name in DELIBERATE:
        ours = DELIBERATE[name]
        assert want != got, f"{name}: mirrored now agrees with TF; drop it from DELIBERATE and the docs"
        if isinstance(ours, dict) and "raises" in ours:
            assert isinstance(got, dict) and ours["raises"][0] in got.get("raises", ()), got
            assert_words(got, ours["words"])
        else:
            assert got == ours
        return
    assert_same(got, want)
    if isinstance(want, dict) and "raises" in want:
        assert_words(got, words)
