"""md.TensorShape and md.TensorSpec answer as TF 2.21's do (tests/data/tf_tensor_shape_reference.json, recorded by
tests/data/record_tf_tensor_shape.py): the same repr for every result, the same error type, and TF's words unless
ours name the argument and the fix."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

import mirrored as md
from tensor_shape_cases import EXPRESSIONS, OWN_WORDS

with open(os.path.join(os.path.dirname(__file__), "data", "tf_tensor_shape_reference.json")) as _f:
    REFERENCE = json.load(_f)


def test_every_expression_is_recorded():
    assert sorted(REFERENCE) == sorted(EXPRESSIONS)


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_matches_tensorflow(expression):
    want = REFERENCE[expression]
    scope = {"TS": md.TensorShape, "Spec": md.TensorSpec}
    if "raises" in want:
        with pytest.raises({"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError}[
                want["raises"]]) as caught:
            eval(expression, scope)
        if expression not in OWN_WORDS:
            assert want["msg"] in str(caught.value)
        return
    assert repr(eval(expression, scope)) == want["repr"]


dims = st.lists(st.one_of(st.none(), st.integers(0, 4)), max_size=3)
shapes = st.one_of(st.none(), dims).map(md.TensorShape)


@given(shapes, shapes)
def test_the_common_supertype_is_a_supertype_of_both_and_compatible_shapes_merge(a, b):
    common = a.most_specific_common_supertype([b])
    assert a.is_subtype_of(common) and b.is_subtype_of(common)
    assert common == b.most_specific_compatible_shape(a)
    if a.is_compatible_with(b):
        merged = a.merge_with(b)
        assert merged.is_subtype_of(a) and merged.is_subtype_of(b)
    else:
        with pytest.raises(ValueError):
            a.merge_with(b)


@given(shapes, shapes)
def test_concatenation_is_the_tuples_or_unknown(a, b):
    joined = a + b
    if a.rank is None or b.rank is None:
        assert joined.rank is None
    else:
        assert tuple(joined) == tuple(a) + tuple(b) and joined.rank == a.rank + b.rank
        assert joined.num_elements() == (None if None in joined else int(np.prod(tuple(joined), dtype=np.int64)))
