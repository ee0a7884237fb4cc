"""md.data against tf.data on generated pipelines: tests/data_differential.py draws 400 pipelines from a seed
(sources, then chains of 1-5 transformations), tests/data/record_tf_data_differential.py recorded TF 2.21's
element_spec, cardinality and elements (values, dtypes, shapes, leaf types, structure) or its error, and each
must come out the same from md.data (re-record with
/work/venvs/tf/bin/python tests/data/record_tf_data_differential.py). The mismatches it found are fixed, each with
a focused test in tests/test_data_differential_regressions.py."""

import numpy as np
import pytest

import data_differential
import data_parity
import mirrored as md

record, REFERENCE = data_parity.load_recorder("record_tf_data_differential", "tf_data_differential.json")
CASES = record.cases()

# TF's kernel errors (raised when the op runs) are ValueError in md.data; its Python-side errors keep their class.
ERROR_CLASSES = {"InvalidArgumentError": ValueError, "FailedPreconditionError": ValueError, "InternalError": ValueError,
                 "ValueError": ValueError, "TypeError": TypeError}
PHRASES = ["Cannot batch tensors with different shapes", "must be either `tf.data.AUTOTUNE` or a value less than",
           "Invalid `input_dataset.`", "must have the same batch size in each component",
           "matching leading dimension"]

# md.data learns a function's spec by running it, not by tracing (docs/data.md): the length of a data-dependent
# shape (F.iota of a scalar) is static here, unknown in TF. Everything else of these must agree, and the specs be
# compatible.
SPEC_GUESSES = {
    "D.range(7, 3, 1, output_type=np.int32).map(lambda x: F.iota(x % 4)).padded_batch(4, padding_values=np.int32(1), "
    "drop_remainder=True).window(3, shift=1, stride=1, drop_remainder=False).flat_map(lambda w: w.batch(3))"
    ".enumerate(5).filter(lambda *t: t[0] % 2 == 0)",
    "D.range(6, 0, -2).unique().interleave(lambda x: D.from_tensors(x).repeat(2), cycle_length=3, block_length=1, "
    "num_parallel_calls=3).map(lambda x: F.iota(x % 4), num_parallel_calls=2)",
}

ENV = {"D": md.data.Dataset, "np": np, "AUTOTUNE": md.data.AUTOTUNE, "TensorSpec": md.data.TensorSpec,
       "F": data_differential.numpy_functions(np),
       "shape_of": lambda s: s.shape.as_list() if s.shape.rank is not None else None,
       "dtype_of": lambda s: "string" if s.dtype.kind == "S" else s.dtype.name}


def assert_compatible(got, expected):
    """Two recorded specs of one structure and dtypes whose shapes have one rank and agree where both are known."""
    if isinstance(expected, dict):
        assert list(got) == list(expected)
        (kind, items), = expected.items()
        if kind in ("dict", "namedtuple"):
            assert [k for k, _ in got[kind]] == [k for k, _ in items]
            items, got_items = [v for _, v in items], [v for _, v in got[kind]]
        else:
            got_items = got[kind]
        assert len(got_items) == len(items)
        for g, e in zip(got_items, items):
            assert_compatible(g, e)
        return
    (got_shape, got_dtype), (shape, dtype) = got, expected
    assert got_dtype == dtype and len(got_shape) == len(shape), (got, expected)
    assert all(g is None or e is None or g == e for g, e in zip(got_shape, shape)), (got, expected)


def test_the_reference_holds_every_generated_pipeline():
    data_parity.assert_reference_complete(REFERENCE, [case["expr"] for case in CASES])
    assert len(CASES) >= 300
    assert SPEC_GUESSES <= set(REFERENCE)


@pytest.mark.parametrize("case", CASES, ids=[f"p{i}" for i in range(len(CASES))])
def test_same_answer_as_tf(case):
    expected = REFERENCE[case["expr"]]
    got = record.record(case, dict(ENV), md.data.Dataset)
    if case["expr"] in SPEC_GUESSES:
        assert got["spec"] != expected["spec"], "md.data now has TF's spec: drop the case from SPEC_GUESSES"
        assert_compatible(got.pop("spec"), expected["spec"])
        expected = {k: v for k, v in expected.items() if k != "spec"}
    wanted = ERROR_CLASSES[expected["error"][0]] if "error" in expected else None
    data_parity.assert_same_answer(got, expected, wanted, PHRASES)
