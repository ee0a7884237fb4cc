"""md.distribute.experimental.CentralStorageStrategy against TensorFlow 2.21's answers
(tests/central_storage_scenarios.py, recorded by tests/data/record_tf_central_storage.py), training like
MirroredStrategy over the same replicas and like the plain loop, on the CPU and on (simulated) GPUs."""

import json
import os

import numpy as np
import pytest

import mirrored as md
import central_storage_scenarios as scenarios
import test_one_device_strategy as one_device
import test_tf_semantics_parity as semantics_parity
from gpu_env import SKIP_REASON, cupy

with open(os.path.join(os.path.dirname(__file__), "data", "tf_central_storage_reference.json")) as _f:
    REFERENCE = json.load(_f)

CentralStorageStrategy = md.distribute.experimental.CentralStorageStrategy


class Mirrored(one_device.Mirrored):
    """The scenarios' adapter over mirrored: one_device_scenarios' and CentralStorageStrategy."""

    @staticmethod
    def central(compute_devices=None, parameter_device=None):
        return CentralStorageStrategy(compute_devices, parameter_device)


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE["scenarios"]) == sorted(scenarios.SCENARIOS)


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_strategy_matches_tensorflow(name):
    fn, words = scenarios.SCENARIOS[name]
    want = REFERENCE["scenarios"][name]
    got = scenarios.run_scenario(Mirrored(), fn)
    semantics_parity.assert_same(got, want)
    if "raises" in want:
        for word in words:
            assert word.lower() in got["msg"].lower(), (word, got["msg"])
