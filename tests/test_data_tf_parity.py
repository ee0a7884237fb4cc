"""md.data against tf.data: every pipeline of tests/data/record_tf_data.py gives TF 2.21's recorded elements,
element_spec and cardinality (re-record with: /work/venvs/tf/bin/python tests/data/record_tf_data.py)."""

import numpy as np
import pytest

import data_parity
import mirrored as md

record, REFERENCE = data_parity.load_recorder("record_tf_data", "tf_data_reference.json")


def _dtype_name(spec):
    return "string" if spec.dtype.kind == "S" else spec.dtype.name


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {"D": md.data.Dataset, "np": np, "AUTOTUNE": md.data.AUTOTUNE, "TensorSpec": md.data.TensorSpec,
            "TextLineDataset": md.data.TextLineDataset,
            "FILES": record.write_files(str(tmp_path_factory.mktemp("lines"))),
            "shape_of": lambda s: list(s.shape), "dtype_of": _dtype_name}


def test_the_reference_was_recorded_from_tf_2_21():
    data_parity.assert_reference_complete(REFERENCE, record.CASES)


@pytest.mark.parametrize("case", record.CASES)
def test_same_elements_spec_and_cardinality_as_tf(case, env):
    ds = eval(case, dict(env))
    expected = REFERENCE[case]
    assert [record.canonical(e) for e in ds.as_numpy_iterator()] == expected["elements"]
    assert record.canonical_spec(ds.element_spec, env["shape_of"], env["dtype_of"]) == expected["spec"]
    assert ds.cardinality() == expected["cardinality"]
