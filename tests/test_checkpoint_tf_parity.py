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

def _refused_at_construction(got, want):
    # TF accepts anything and fails at the first save(); mirrored refuses at once, naming the argument.
    assert want == {"object": "CheckpointManager"}
    assert "TypeError" in got["raises"], got
    assert_words(got, ("checkpoint=", "md.train.Checkpoint"))


def _slots_keyed_by_variable(got, want):
    # Keras 3 numbers an optimizer's slots by build order (_variables/N) and saves its learning rate; mirrored
    # keys slots by their variable's path, and its learning rate is configuration, not state.
    assert [name for name, _ in want] == ["model/w/.ATTRIBUTES/VARIABLE_VALUE",
                                          "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE",
                                          "optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE",
                                          "optimizer/_variables/2/.ATTRIBUTES/VARIABLE_VALUE"]
    assert got == [["model/w/.ATTRIBUTES/VARIABLE_VALUE", [2]], ["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE", []],
                   ["optimizer/slots/model/w/momentum/.ATTRIBUTES/VARIABLE_VALUE", [2]]]


def _every_replica_resumes(got, want):
    # TF 2.21 + Keras 3 restore an optimizer's slots, created after the restore under MirroredStrategy, into the
    # first replica only: the other replicas' next step differs from the uninterrupted run. mirrored's every
    # replica continues exactly as the uninterrupted run (TF's own first replica).
    assert want["resumed"][1] != want["continued"][1] and want["resumed"][0] == want["continued"][0]
    assert_same({**got, "resumed": None}, {**want, "resumed": None})
    assert_same(got["resumed"], want["continued"], "result.resumed")


def _directory_named(got, want):
    # TF tries to open the directory as a TensorBundle table (DataLossError); mirrored says what to pass.
    assert want["raises"][0] == "DataLossError"
    assert "IsADirectoryError" in got["raises"], got
    assert_words(got, ("is a directory", "latest_checkpoint"))


def _prefix_must_be_a_path(got, want):
    # TF converts the int 123 to the string "123" and saves "123-1" in the working directory.
    assert want == "123-1"
    assert "TypeError" in got["raises"], got
    assert_words(got, ("file_prefix=123", "path"))


# (scenario, replicas) -> a check of mirrored's result where it differs from TensorFlow's on purpose
# (docs/tf_semantics.md says why); each also asserts what TF recorded, so a change on either side is noticed.
DELIBERATE = {
    ("mgr_needs_checkpoint", 1): _refused_at_construction,
    ("ck_optimizer_names", 1): _slots_keyed_by_variable,
    ("ck_sgd_momentum_resume", 2): _every_replica_resumes,
    ("ck_adam_resume", 2): _every_replica_resumes,
    ("ck_restore_directory", 1): _directory_named,
    ("ck_save_bad_prefix_type", 1): _prefix_must_be_a_path,
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
    if (name, n) in DELIBERATE:
        DELIBERATE[name, n](got, want)
        return
    assert_same(got, want)
    if isinstance(want, dict) and "raises" in want:
        assert_words(got, words)
