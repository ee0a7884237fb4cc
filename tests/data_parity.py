"""What the md.data parity suites (test_data_tf_parity*.py) share: a recorder of tests/data loaded as a module
(never run: it imports TensorFlow only when it records), its reference, the check of one recorded case, and
mirrored's CPU made into logical CPUs for a strategy of several CPU replicas."""

import contextlib
import importlib.util
import json
import os

import mirrored as md

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@contextlib.contextmanager
def logical_cpus(count):
    """mirrored's CPU as ``count`` logical CPUs while the block runs (a strategy over /cpu:0 ... /cpu:count-1)."""
    cpu = md.config.list_physical_devices("CPU")[0]
    md.config.set_logical_device_configuration(cpu, [md.config.LogicalDeviceConfiguration()] * count)
    try:
        yield
    finally:
        md.config.set_logical_device_configuration(cpu, None)


def load_recorder(recorder: str, reference: str):
    """(tests/data/``recorder``.py as a module, tests/data/``reference`` as loaded JSON)."""
    spec = importlib.util.spec_from_file_location(recorder, os.path.join(DATA, recorder + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(os.path.join(DATA, reference)) as f:
        return module, json.load(f)


def assert_reference_complete(reference, cases):
    assert reference["_tf_version"].startswith("2.21")
    assert set(reference) - {"_tf_version"} == set(cases)


def assert_same_answer(got, expected, wanted_error, phrases):
    """md.data's ``got`` is TF's ``expected``: the same value, or an error of class ``wanted_error`` whose message
    has every phrase of ``phrases`` that TF's has."""
    if "error" in expected:
        assert "error" in got, f"TF raised {expected['error']}, md.data gave {got}"
        assert got["error"][0] == wanted_error.__name__, (expected["error"], got["error"])
        for phrase in phrases:
            if phrase in expected["error"][1]:
                assert phrase in got["error"][1], (phrase, got["error"][1])
        return
    assert "error" not in got, got["error"]
    assert got == expected
