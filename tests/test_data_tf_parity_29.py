"""md.data against tf.data for the rest of tf.data's public surface (tests/data/record_tf_data_29.py): TensorSpec
shapes as TensorShape, cardinality's type, parallel interleave, options, tf.data.experimental's functions,
save/load/snapshot, the TFRecord / fixed-length / text readers (files written by TensorFlow) and the TFRecord
writer (byte for byte), each case's elements, element_spec, cardinality and len, or its error class and words.
Re-record with: /work/venvs/tf/bin/python tests/data/record_tf_data_29.py"""

import numpy as np
import pytest

import data_parity
import mirrored as md

record, REFERENCE = data_parity.load_recorder("record_tf_data_29", "tf_data_reference_29.json")

# TF's runtime errors and what md.data raises for them (docs/data.md).
ERROR_CLASSES = {"InvalidArgumentError": ValueError, "DataLossError": md.errors.DataLossError, "FailedPreconditionError": ValueError,
                 "NotFoundError": md.errors.NotFoundError, "OutOfRangeError": md.errors.OutOfRangeError}

# Where md.data answers differently on purpose (docs/data.md): what md.data gives instead ("value" or an error
# class), with why.
DELIBERATE = {
    # An md.data element is a NumPy array: TF wants a tf.Tensor here and refuses arrays.
    "TensorSpec([2, 3]).is_compatible_with(np.zeros((2, 3), np.float32))": "value",
    "SHAPE(TensorSpec.from_tensor(np.zeros((2, 3), np.int32)))": "value",
    "TensorSpec.from_tensor(np.zeros(2)).dtype.name": "value",
    # TF reads a file that is not gzip-compressed as if compression_type were None; md.data says it is not GZIP
    # (md.errors.DataLossError, a ValueError, as for any file it cannot decompress).
    "DATA.FixedLengthRecordDataset(F('a.bin'), 4, compression_type='GZIP')": "DataLossError",
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
    data_parity.assert_reference_complete(REFERENCE, record.CASES)


@pytest.mark.parametrize("case", record.CASES)
def test_same_answer_as_tf(case):
    expected = REFERENCE[case]
    got = record.more.record(case, dict(ENV), md.data.Dataset)
    if case in DELIBERATE:
        assert (got["error"][0] if "error" in got else "value") == DELIBERATE[case], got
        return
    wanted = expected_error_class(*expected["error"]) if "error" in expected else None
    data_parity.assert_same_answer(got, expected, wanted, PHRASES)
