"""md.convert_to_tensor against TensorFlow 2.21's tf.convert_to_tensor (tests/data/tf_conversions_reference.json,
recorded by tests/data/record_tf_conversions.py): NumPy inputs cast to any dtype, Python values by TF's rules
(inferred dtypes, the conversions TF makes and the ones it refuses, dtype_hint), tensors keep their dtype."""

import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from recorded_results import flat_values

with open(os.path.join(os.path.dirname(__file__), "data", "tf_conversions_reference.json")) as _f:
    REFERENCE = json.load(_f)
CASES = [c for c in REFERENCE["convert_to_tensor"] if not c["value"].startswith("Variable")]
VARIABLE_CASES = [c for c in REFERENCE["convert_to_tensor"] if c["value"].startswith("Variable")]


def _dtype_name(x) -> str:
    return "string" if np.asarray(x).dtype.kind == "S" else np.asarray(x).dtype.name


def _check(got_fn, want, words=True):
    """md's result is TF's (dtype, shape, values), or its error: TF's type and (``words``) TF's first words."""
    if isinstance(want, dict):
        with pytest.raises({"TypeError": TypeError, "ValueError": ValueError}[want["raises"]]) as caught:
            got_fn()
        if words:
            assert want["msg"].split(" (")[0].split(":")[0].split("<")[0] in str(caught.value)
        return
    got = got_fn()
    assert isinstance(got, np.ndarray)
    assert {"dtype": _dtype_name(got), "shape": list(got.shape), "value": flat_values(got)} == want[0]


def _label(c):
    return f"{c['value']}-{c.get('dtype', 'hint=' + str(c.get('dtype_hint')))}"


# TF raises SystemError (its C++ conversion fails without a Python error) for a negative int or one beyond
# 64 bits into uint64; md wraps -1 as NumPy does and refuses 2**70 with the out-of-range error.
TF_INTERNAL = [c for c in CASES if isinstance(c["result"], dict) and c["result"]["raises"] == "SystemError"]


@pytest.mark.parametrize("case", [c for c in CASES if c not in TF_INTERNAL], ids=_label)
def test_matches_tensorflow(case):
    value = eval(case["value"])
    kwargs = {k: case[k] for k in ("dtype", "dtype_hint", "name") if k in case}
    _check(lambda: md.convert_to_tensor(value, **kwargs), case["result"])


@pytest.mark.parametrize("case", VARIABLE_CASES, ids=_label)
def test_a_variable_is_read_and_keeps_its_dtype(case):
    variable = md.Variable([1.0, 2.0])
    kwargs = {k: case[k] for k in ("dtype", "dtype_hint") if k in case}
    _check(lambda: md.convert_to_tensor(variable, **kwargs), case["result"], words=False)  # (md.Variable, not tf.)
    if isinstance(case["result"], dict):
        with pytest.raises(ValueError, match=r"md.Variable of type float32.*cast it with astype"):
            md.convert_to_tensor(variable, **kwargs)


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(TypeError, match=r"Cannot convert 1.5 to EagerTensor of dtype int32 \(dtype=int32: .*asarray"):
        md.convert_to_tensor(1.5, dtype="int32")
    with pytest.raises(TypeError, match=r"'foo' to a TensorFlow DType. \(dtype: pass a NumPy dtype"):
        md.convert_to_tensor(1, dtype="foo")
    with pytest.raises(TypeError, match=r"dtype_hint: pass a NumPy dtype"):
        md.convert_to_tensor(1, dtype_hint="foo")
    with pytest.raises(ValueError, match=r"non-rectangular.*same length"):
        md.convert_to_tensor([[1], [2, 3]])


def test_indexed_slices_densify_and_keep_their_dtype():
    slices = md.IndexedSlices(np.ones((2, 3), np.float32), np.array([0, 2]), (4, 3))
    np.testing.assert_array_equal(md.convert_to_tensor(slices), [[1] * 3, [0] * 3, [1] * 3, [0] * 3])
    with pytest.raises(ValueError, match="Incompatible tensor conversion requested to `dtype` float64 for "
                                         "IndexedSlices with dtype float32"):
        md.convert_to_tensor(slices, dtype=np.float64)


NUMERIC = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "bool", "complex64", "complex128"]


@settings(max_examples=60, deadline=None)
@given(source=st.sampled_from(NUMERIC), target=st.sampled_from(NUMERIC + [None]),
       shape=st.lists(st.integers(0, 3), max_size=3), as_hint=st.booleans())
def test_numpy_inputs_cast_to_any_numeric_dtype_as_numpy_does(source, target, shape, as_hint):
    array = (np.arange(int(np.prod(shape))) - 2).reshape(shape).astype(source)
    got = md.convert_to_tensor(array, **{"dtype_hint" if as_hint else "dtype": target})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (NumPy's complex-to-real and overflow warnings: the cast is the point)
        want = array if target is None else array.astype(target)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


# Python values reach arrays by the same rules everywhere: an md.Variable's initial value and a collective's input
# convert as md.convert_to_tensor does (TF's md.Variable fails on strings with an AttributeError of its own).
NUMERIC_PYTHON_CASES = [c for c in CASES if c.get("dtype", 0) is None and not c["value"].startswith(("np.", "object"))
                        and "'" not in c["value"] and c["value"] not in ("None", "[]", "[[]]")]


@pytest.mark.parametrize("case", NUMERIC_PYTHON_CASES, ids=_label)
def test_variables_and_collectives_convert_python_values_as_tensorflow(case):
    value = eval(case["value"])
    _check(lambda: np.asarray(md.Variable(value).numpy()), case["result"])
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    _check(lambda: md.device_util.to_host(value), case["result"])
    if not isinstance(case["result"], dict) and not isinstance(value, (list, tuple)) \
            and case["result"][0]["dtype"] not in ("bool", "complex128"):  # (lists are nests to a collective)
        summed = strategy.run(lambda: md.get_replica_context().all_reduce("sum", value))
        for got in strategy.experimental_local_results(summed):
            assert {"dtype": _dtype_name(got), "shape": list(np.shape(got))} == \
                {k: case["result"][0][k] for k in ("dtype", "shape")}
