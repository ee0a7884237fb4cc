"""Distributed inputs on one worker answer as TF 2.21's do, over 400 seeded random cases
(tests/distribute_input_differential.py, recorded by tests/data/record_tf_distribute_input_differential.py):
MirroredStrategy over 1-4 logical CPUs, OneDeviceStrategy and CentralStorageStrategy; md.data pipelines
distributed by experimental_distribute_dataset (with InputOptions), distribute_datasets_from_function and
experimental_distribute_values_from_function; consumed by for loops, next, get_next, get_next_as_optional and
md.function. Per case: the element specs, cardinality, every step's per-replica arrays, strategy.run on them,
experimental_local_results, reduce, the end of iteration and a second pass; or the same exception as TF."""

import json
import os
import warnings

import numpy as np
import pytest

import mirrored as md
from mirrored._nest import flatten
from mirrored.distribute.function import EagerFallbackWarning
from data_parity import logical_cpus
import distribute_input_differential as gen

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tf_distribute_input_differential.json")
with open(_PATH) as _f:
    REFERENCE = json.load(_f)
CASES = gen.cases(REFERENCE["seed"], REFERENCE["count"])

# TF's exception classes and the built-in ones mirrored raises in their place.
_TF_ERRORS = {"InvalidArgumentError": ("ValueError",)}
# The phrases of TF's messages that mirrored's say too, where TF's has them.
KEY_WORDS = ("End of sequence", "does not have a value", "PER_REPLICA", "distribute_datasets_from_function",
             "not divisible", "global_batch_size", "num_replicas_in_sync")


class _F:
    @staticmethod
    def keep(*args):
        return np.sum(np.asarray(flatten(args)[0]).astype(np.int64)) % 3 != 1

    @staticmethod
    def size(element):
        return np.int32(np.size(md.device_util.to_host(flatten(element)[0])))


class Mirrored:
    """The generator's adapter over mirrored."""

    Dataset = md.data.Dataset
    InputOptions = md.distribute.InputOptions
    InputReplicationMode = md.distribute.InputReplicationMode
    ReduceOp = md.distribute.ReduceOp
    F = _F
    flatten = staticmethod(flatten)
    function = staticmethod(md.function)

    @staticmethod
    def strategy(kind):
        cpus = [f"/cpu:{i}" for i in range(4)]
        if kind.startswith("mirrored"):
            return md.MirroredStrategy(cpus[:int(kind[-1])])
        if kind == "one_device":
            return md.distribute.OneDeviceStrategy("/cpu:0")
        return md.distribute.experimental.CentralStorageStrategy(compute_devices=cpus[:int(kind[-1])],
                                                                  parameter_device="/cpu:0")

    @staticmethod
    def spec_leaf(spec):
        specs = list(spec._specs) if hasattr(spec, "_specs") else [spec]
        return [[None if s.shape.rank is None else s.shape.as_list(), np.dtype(s.dtype).name] for s in specs]

    @staticmethod
    def numpy(value):
        return np.asarray(md.device_util.to_host(value))

    @staticmethod
    def zero():
        return np.int32(0)


def _same(got, want, path):
    """``got`` is ``want``, an exception matched by class (or mirrored's built-in stand-in) alone."""
    if isinstance(want, dict) and "raises" in want:
        assert isinstance(got, dict) and "raises" in got, f"{path}: TF raised {want}; mirrored gave {got}"
        assert got["raises"] in (want["raises"],) + _TF_ERRORS.get(want["raises"], ()), (path, got, want)
        for words in KEY_WORDS:
            assert words not in want["msg"] or words in got["msg"], f"{path}: mirrored's {got} lacks {words!r}"
        return
    if isinstance(want, dict) and isinstance(got, dict):
        assert set(got) == set(want), f"{path}: mirrored answered {sorted(got)}, TF {sorted(want)}"
        for key in want:
            _same(got[key], want[key], f"{path}.{key}")
        return
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}[{i}]")
        return
    assert got == want, f"{path}: mirrored gave {got}, TF {want}"


def test_every_case_is_recorded():
    assert REFERENCE["_tf_version"].startswith("2.21")
    assert set(REFERENCE["cases"]) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_tensorflow(name):
    with logical_cpus(4), warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)  # (md.function on CPU replicas runs eagerly)
        got = json.loads(json.dumps(gen.run_case(Mirrored, CASES[name])))
    want = REFERENCE["cases"][name]
    if gen.misspelt_option(want):  # (TF's CentralStorageStrategy fails on any options; see the generator)
        if CASES[name]["options"].get("experimental_replication_mode") == "PER_REPLICA":
            assert got["build"]["raises"] == "NotImplementedError", got
            assert "distribute_datasets_from_function" in got["build"]["msg"], got
            return
        want = want["without_options"]
    _same(got, want, name)
