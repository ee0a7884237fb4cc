"""md.data against tf.data for the rest of tf.data's public surface (tests/data/record_tf_data_29.py): TensorSpec
shapes as TensorShape, cardinality's type, parallel interleave, options, tf.data.experimental's functions,
save/load/snapshot, the TFRecord / fixed-length / text readers (files written by TensorFlow) and the TFRecord
writer (byte for byte), each case's elements, element_spec, cardinality and len, or its error class and words.
Re-record with: /work/venvs/tf/bin/python tests/data/record_tf_data_29.py"""

import importlib.util
import json
import os

import numpy as np
import pytest

import mirrored as md

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_spec = importlib.util.spec_from_file_location("record_tf_data_29", os.path.join(HERE, "record_tf_data_29.py"))
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)

with open(os.path.join(HERE, "tf_data_reference_29.json")) as f:
    REFERENCE = json.load(f)

# TF's runtime errors and what md.data raises for them (docs/data.md).
ERROR_CLASSES = {"InvalidArgumentError": ValueError, "DataLossError": ValueError, "FailedPreconditionError": ValueError,
                 "NotFoundError": FileNotFoundError, "OutOfRangeError": md.errors.OutOfRangeError}

# Where md.data answers differently on purpose (docs/data.md): what md.data gives instead ("value" or an error
# class), with why.
DELIBERATE = {
    # An md.data element is a NumPy array: TF wants a tf.Tensor here and refuses arrays.
    "TensorSpec([2, 3]).is_compatible_with(np.zeros((2, 3), np.float32))": "value",
    "SHAPE(TensorSpec.from_tensor(np.zeros((2, 3), np.int32)))": "value",
    "TensorSpec.from_tensor(np.zeros(2)).dtype.name": "value",
    # TF reads a file that is not gzip-compressed as if compression_type were None; md.data says it is not GZIP.
    "DATA.FixedLengthRecordDataset(F('a.bin'), 4, compression_type='GZIP')": "ValueError",
}

PHRASES = ["Input dataset was expected to contain", "Index out of range", "should not be empty",
           "requires its input dataset to be a dictionary", "must have a cardinalty less than",
           "`shard_func` must return a scalar int64", "Expected binary or unicode string",
           "is not an exact multiple of the record length", "corrupted record at", "truncated record at",
           "No such file or directory", "Cannot set the property", "must be of type",
           "Mutating `tf.data.Options()` returned by", "Invalid `dataset_or_iterator`",
           "Expected `key_func` to return a scalar tf.int64", "`record_bytes` must be > 0",
           "must be greater than zero", "Expected a`dataset` that produces scalar `tf.string` elements",
           "is not supported for datasets that produce datasets"]


def expected_error_class(tf_class, tf_message):
    if tf_class in ERROR_CLASSES:
        return TypeError if "TypeError: " in tf_message else ERROR_CLASSES[tf_class]
    return {"ValueError": ValueError, "TypeError": TypeError, "AttributeError": AttributeError}[tf_class]


def md_env():
    env = record.make_env(md.data, md.data.experimental, md.data.Dataset, md.data.TensorSpec)
    env.update({"LEN": lambda x: np.int32(len(x)), "I32": np.int32,
                "shape_of": lambda s: s.shape.as_list() if s.shape.rank is not None else None,
                "dtype_of": lambda s: "string" if s.dtype.kind == "S" else s.dtype.name})
    return env


ENV = md_env()


def test_the_reference_was_recorded_from_tf_2_21():
    assert REFERENCE["_tf_version"].startswith("2.21")
    assert set(REFERENCE) - {"_tf_version"} == set(record.CASES)


@pytest.mark.parametrize("case", record.CASES)
def test_same_answer_as_tf(case):
    expected = REFERENCE[case]
    got = record.more.record(case, dict(ENV), md.data.Dataset)
    if case in DELIBERATE:
        assert (got["error"][0] if "error" in got else "value") == DELIBERATE[case], got
        return
    if "error" in expected:
        assert "error" in got, f"TF raised {expected['error']}, md.data gave {got}"
        wanted = expected_error_class(*expected["error"])
        assert got["error"][0] == wanted.__name__, (expected["error"], got["error"])
        for phrase in PHRASES:
            if phrase in expected["error"][1]:
                assert phrase in got["error"][1], (phrase, got["error"][1])
        return
    assert "error" not in got, got["error"]
    assert got == expected
