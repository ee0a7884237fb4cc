"""md.data against tf.data, a wide audit: every case of tests/data/record_tf_data_more.py gives TF 2.21's
recorded elements (values, dtypes, shapes, leaf types, tuple/dict/namedtuple structure), element_spec,
cardinality and len, or fails as TF does (re-record with:
/work/venvs/tf/bin/python tests/data/record_tf_data_more.py)."""

import collections

import numpy as np
import pytest

import data_parity
import mirrored as md

record, REFERENCE = data_parity.load_recorder("record_tf_data_more", "tf_data_reference_more.json")

# TF's errors from its C++ kernels (raised when the op runs) are ValueError in md.data, unless they wrap a Python
# TypeError (a generator's bad value); its Python-side errors keep their class.
ERROR_CLASSES = {"InvalidArgumentError": ValueError, "DataLossError": ValueError, "InternalError": ValueError}

# Kept deliberately (docs/data.md): the case and md.data's error class, with why.
DELIBERATE = {
    # TF fails while tracing (a graph op's attribute check); md.data names map_func and what to return.
    "D.range(4).map(lambda x: None)": TypeError,
    # TF's AttributeError is an internal accident ('Tensor' object has no attribute '_name'); md.data says
    # map_func must return a Dataset.
    "D.range(3).flat_map(lambda x: x)": TypeError,
    "D.range(4).interleave(lambda x: x, cycle_length=2)": TypeError,
}


# Phrases of TF's messages that md.data's say too, so a search for TF's error finds ours.
PHRASES = ["Incompatible dataset elements", "should not be empty", "Selector index out of range", "Dataset was empty",
           "more than one element", "Cannot unbatch an input with scalar components", "non-rectangular",
           "Must pass at least one dataset", "Invalid `padding_values`", "Invalid `weights`",
           "Invalid `choice_dataset`", "Invalid `datasets`", "Invalid `batch_sizes`",
           "only supports inputs with a single component", "does not support type", "can not be used together with the `output_signature`", "`generator` yielded",
           "must be greater than zero", "Index must be between", "missing 1 required positional argument",
           "must return a `tf.bool` scalar", "should return a pair", "must match the initial state"]


def expected_error_class(case, tf_class, tf_message):
    if case in DELIBERATE:
        return DELIBERATE[case]
    if tf_class in ERROR_CLASSES:
        return TypeError if "TypeError: " in tf_message else ERROR_CLASSES[tf_class]
    return {"ValueError": ValueError, "TypeError": TypeError}[tf_class]


ENV = {"D": md.data.Dataset, "np": np, "AUTOTUNE": md.data.AUTOTUNE, "TensorSpec": md.data.TensorSpec,
       "P": record.P, "collections": collections, "LEN": len, "OPTS": record.options_seen,
       "O": record.options_maker(md.data.Options, md.data.AutoShardPolicy),
       "shape_of": lambda s: s.shape.as_list() if s.shape.rank is not None else None,
       "dtype_of": lambda s: "string" if s.dtype.kind == "S" else s.dtype.name}


def test_the_reference_was_recorded_from_tf_2_21():
    data_parity.assert_reference_complete(REFERENCE, record.CASES)
    assert len(record.CASES) >= 300


@pytest.mark.parametrize("case", record.CASES)
def test_same_answer_as_tf(case):
    expected = REFERENCE[case]
    got = record.record(case, dict(ENV), md.data.Dataset)
    wanted = expected_error_class(case, *expected["error"]) if "error" in expected else None
    data_parity.assert_same_answer(got, expected, wanted, PHRASES)
