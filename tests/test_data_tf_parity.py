"""md.data against tf.data: every pipeline of tests/data/record_tf_data.py gives TF 2.21's recorded elements,
element_spec and cardinality (re-record with: /work/venvs/tf/bin/python tests/data/record_tf_data.py)."""

import importlib.util
import json
import os

import numpy as np
import pytest

import mirrored as md

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_spec = importlib.util.spec_from_file_location("record_tf_data", os.path.join(HERE, "record_tf_data.py"))
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)

with open(os.path.join(HERE, "tf_data_reference.json")) as f:
    REFERENCE = json.load(f)


def _dtype_name(spec):
    return "string" if spec.dtype.kind == "S" else spec.dtype.name


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {"D": md.data.Dataset, "np": np, "AUTOTUNE": md.data.AUTOTUNE, "TensorSpec": md.data.TensorSpec,
            "TextLineDataset": md.data.TextLineDataset,
            "FILES": record.write_files(str(tmp_path_factory.mktemp("lines"))),
            "shape_of": lambda s: list(s.shape), "dtype_of": _dtype_name}


def test_the_reference_was_recorded_from_tf_2_21():
    assert REFERENCE["_tf_version"].startswith("2.21")
    assert set(REFERENCE) - {"_tf_version"} == set(record.CASES)


@pytest.mark.parametrize("case", record.CASES)
def test_same_elements_spec_and_cardinality_as_tf(case, env):
    ds = eval(case, dict(env))
    expected = REFERENCE[case]
    assert [record.canonical(e) for e in ds.as_numpy_iterator()] == expected["elements"]
    assert record.canonical_spec(ds.element_spec, env["shape_of"], env["dtype_of"]) == expected["spec"]
    assert ds.cardinality() == expected["cardinality"]
