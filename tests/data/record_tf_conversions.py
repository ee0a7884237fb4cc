"""Records TensorFlow 2.21's conversions for tests/test_convert_to_tensor.py and tests/test_function_signature.py
(never imported by the tests): tf.convert_to_tensor over values x dtypes x dtype hints, tf.function with an
input_signature (what it accepts, converts and refuses, and how often it traces), Variable.is_initialized
inside strategy.run at 1, 2 and 4 replicas, and tf.Variable's constructor arguments.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_conversions.py
        (writes tests/data/tf_conversions_reference.json)

Values and signatures are Python expressions (over ``np`` and ``TensorSpec``) that the tests evaluate again.
"""

import numpy as np

from recording import logical_cpus, tf, write_reference  # (this folder)
from recorded_results import flat_values  # (the tests folder: recording puts it on the path)

CONVERT_VALUES = [
    "np.ones(2, np.float64)", "np.array([1.5, -2.5])", "np.array([1, -2], np.int64)", "np.ones(2, np.int32)",
    "np.array([True, False])", "np.array([1.5, 2.0], np.float16)", "np.array([200, 1], np.uint8)",
    "np.array([1+2j])", "np.float64(2.5)", "np.int64(-3)", "np.array(7, np.int16)",
    "1", "-1", "1.5", "True", "False", "2**40", "2**70", "1+2j", "'abc'", "b'abc'", "['a', 'b']",
    "[1, 2]", "[1.5, 2]", "[[1, 2], [3, 4]]", "(1, 2.5)", "[True, False]", "[1, True]", "[1.5, True]",
    "[1, 2j]", "[1, 'a']", "[[1], [1, 2]]", "[]", "[[]]", "None", "object()", "{'a': 1}",
    # (the first leaf's kind decides, unless the dtype takes every leaf as it is)
    "[True, 1]", "[True, 1.5]", "[True, 2j]", "[2j, 1]", "[2j, 1.5, True]", "[1, 1.5, True]", "[[1, 2], [True, 3]]",
    "[[True, 1], [2, 3]]", "[1, 2**40]", "[True, 2**40]", "[1.5, 2**70]", "[1, [2]]", "[[1], 2]", "[(1, 2), [3, 4]]",
]
DTYPES = [None, "float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool", "complex64", "complex128", "string"]
HINTS = ["float32", "int64", "bool", "complex64", "float16", "uint8"]


def result(fn):
    try:
        return leaves(fn())
    except Exception as e:  # noqa: BLE001 - TF's error is the recorded result
        return {"raises": type(e).__name__, "msg": str(e)}


def leaves(out):
    flat = tf.nest.flatten(out)
    return [{"dtype": t.dtype.name, "shape": list(t.shape), "value": flat_values(t.numpy())} for t in flat]


def convert_cases():
    out = []
    for value in CONVERT_VALUES:
        for dtype in DTYPES:
            out.append({"value": value, "dtype": dtype,
                        "result": result(lambda: tf.convert_to_tensor(_eval(value), dtype=dtype))})
        for hint in HINTS:
            out.append({"value": value, "dtype_hint": hint,
                        "result": result(lambda: tf.convert_to_tensor(_eval(value), dtype_hint=hint))})
    out.append({"value": "1", "dtype": "foo", "result": result(lambda: tf.convert_to_tensor(1, dtype="foo"))})
    out.append({"value": "1.5", "dtype": "float32", "name": "x",
                "result": result(lambda: tf.convert_to_tensor(1.5, dtype="float32", name="x"))})
    variable = tf.Variable([1.0, 2.0])
    for dtype in [None, "float32", "float64", "int32"]:
        out.append({"value": "Variable([1.0, 2.0])", "dtype": dtype,
                    "result": result(lambda: tf.convert_to_tensor(variable, dtype=dtype))})
    for hint in HINTS:
        out.append({"value": "Variable([1.0, 2.0])", "dtype_hint": hint,
                    "result": result(lambda: tf.convert_to_tensor(variable, dtype_hint=hint))})
    return out


# (signature, calls): each call's arguments as an expression of a tuple; the function returns its arguments.
SIGNATURES = [
    ("[TensorSpec([None, 3], 'float32')]",
     ["(np.ones((2, 3), np.float32),)", "(np.ones((5, 3), np.float32),)", "(np.ones((0, 3), np.float32),)",
      "(np.ones((2, 3), np.float64),)", "(np.arange(6).reshape(2, 3),)", "([[1, 2, 3]],)", "([[1.5, 2, 3]],)",
      "(np.ones(3, np.float32),)", "(np.ones((2, 4), np.float32),)", "(np.ones((1, 2, 3), np.float32),)",
      "(1.0,)", "(None,)", "('abc',)", "()", "(np.ones((2, 3)), 1)", "([[1, 2], [3]],)"]),
    ("[TensorSpec([], 'int32'), TensorSpec([2], 'float64')]",
     ["(3, [1, 2])", "(3.5, [1, 2])", "(np.float64(3.0), [1, 2])", "(np.int64(3), [1.5, 2])", "(True, [1, 2])",
      "(np.array(3, np.int64), np.ones(2, np.float32))", "(3, [1, 2, 3])", "(3, 4.0)", "(np.ones(1, np.int32), [1, 2])",
      "([3], [1, 2])"]),
    ("[TensorSpec(None, 'float32')]",
     ["(np.ones((2, 2, 2)),)", "(1,)", "([[1.0]],)", "(np.ones(0, np.float32),)"]),
    ("[TensorSpec([None], 'bool')]", ["([True, False],)", "(np.array([1, 0]),)", "([1, 0],)", "([1.5],)"]),
    ("[(TensorSpec([], 'int32'), {'a': TensorSpec([None], 'float32')})]",
     ["((1, {'a': [1.0, 2.0]}),)", "((1, {'b': [1.0, 2.0]}),)", "([1, {'a': [1.0, 2.0]}],)", "(1,)",
      "((1, {'a': [1.0], 'b': [2.0]}),)", "((1, {'a': [1.0]}, 2),)", "((1,),)"]),
    ("[[TensorSpec([2], 'float32'), TensorSpec([], 'int64')]]",
     ["([[1, 2], 3],)", "(([1, 2], 3),)", "([[1, 2]],)", "([np.ones(2), 3],)"]),
]
# Keyword calls of the first signature: (args, kwargs) expressions.
KEYWORD_CALLS = [("()", "{'x': np.ones((2, 3), np.float32)}"), ("()", "{'y': np.ones((2, 3), np.float32)}"),
                 ("(np.ones((2, 3), np.float32),)", "{'x': np.ones((2, 3), np.float32)}")]
# Python functions of the signature checks made when md.function wraps them: (source, signature).
BAD_SIGNATURES = [
    ("lambda x: x", "[1]"), ("lambda x: x", "TensorSpec([], 'float32')"),
    ("lambda x: x", "[TensorSpec([]), TensorSpec([])]"), ("lambda x, y: x", "[TensorSpec([])]"),
    ("lambda x, y=2: x", "[TensorSpec([])]"), ("lambda *x: x", "[TensorSpec([])]"),
    ("lambda x, **k: x", "[TensorSpec([])]"), ("lambda x: x", "[]"), ("lambda x: x", "([TensorSpec([])], 1)"),
    ("lambda x: x", "[np.float32]"), ("lambda: 1", "[]"), ("lambda x, *, y: x", "[TensorSpec([])]"),
    ("lambda x: x", "None"), ("lambda x: x", "[(TensorSpec([]), None)]"),
]
# Tracing counts after each call: (reduce_retracing, signature or None, calls).
TRACING = [
    (False, None, ["(np.ones(2, np.float32),)", "(np.ones(3, np.float32),)", "(np.ones(3, np.float32),)",
                   "(np.ones(4, np.float32),)", "(np.ones((2, 2), np.float32),)", "(np.ones(2, np.float64),)",
                   "(np.ones(2, np.float32),)", "(1,)", "(2,)", "(1,)"]),
    (True, None, ["(np.ones(2, np.float32),)", "(np.ones(3, np.float32),)", "(np.ones(3, np.float32),)",
                  "(np.ones(4, np.float32),)", "(np.ones((2, 2), np.float32),)", "(np.ones((5, 5), np.float32),)",
                  "(np.ones(7, np.float32),)", "(np.ones(2, np.float64),)", "(np.ones(2, np.float32),)",
                  "(1,)", "(2,)", "(1,)"]),
    (True, None, ["(np.ones((2, 3), np.float32), 1)", "(np.ones((4, 3), np.float32), 1)",
                  "(np.ones((5, 3), np.float32), 1)", "(np.ones((5, 3), np.float32), 2)"]),
    (False, "[TensorSpec([None], 'float32')]", ["(np.ones(2, np.float32),)", "(np.ones(9, np.float32),)",
                                                 "([1, 2],)", "(np.ones(2, np.float64),)"]),
    (True, "[TensorSpec([None], 'float32')]", ["(np.ones(2, np.float32),)", "(np.ones(9, np.float32),)"]),
]


def _eval(expression):
    return eval(expression, {"np": np, "TensorSpec": tf.TensorSpec})


def _identity(signature):
    """The function of a signature's calls: it returns its arguments (two for two specs, else one)."""
    return (lambda a, b: (a, b)) if signature.count("TensorSpec") == 2 and signature.startswith("[T") else (
        lambda x: x)


def signature_cases():
    out = {"calls": [], "keywords": [], "bad": [], "tracing": [], "concrete": []}
    for signature, calls in SIGNATURES:
        fn = tf.function(_identity(signature), input_signature=_eval(signature))
        for call in calls:
            out["calls"].append({"signature": signature, "args": call, "result": result(lambda: fn(*_eval(call)))})
        out["concrete"].append({"signature": signature, "inputs": [repr(s) for s in tf.nest.flatten(
            fn.get_concrete_function().structured_input_signature)]})
    fn = tf.function(lambda x: x, input_signature=_eval(SIGNATURES[0][0]))
    for args, kwargs in KEYWORD_CALLS:
        out["keywords"].append({"args": args, "kwargs": kwargs,
                                "result": result(lambda: fn(*_eval(args), **_eval(kwargs)))})
    for source, signature in BAD_SIGNATURES:
        try:
            made = tf.function(_eval(source), input_signature=_eval(signature)).input_signature
            r = {"input_signature": None if made is None else [repr(s) for s in tf.nest.flatten(made)]}
        except Exception as e:  # noqa: BLE001 - TF's error is the recorded result
            r = {"raises": type(e).__name__, "msg": str(e)}
        out["bad"].append({"fn": source, "signature": signature, "result": r})
    for reduce_retracing, signature, calls in TRACING:
        fn = tf.function((lambda *a: a) if signature is None else (lambda x: x), reduce_retracing=reduce_retracing,
                         input_signature=None if signature is None else _eval(signature))
        counts = []
        for call in calls:
            fn(*_eval(call))
            counts.append(fn.experimental_get_tracing_count())
        out["tracing"].append({"reduce_retracing": reduce_retracing, "signature": signature, "calls": calls,
                               "counts": counts})
    return out


def is_initialized_cases():
    out = {}
    for n in (1, 2, 4):
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            variables = {"mirrored": tf.Variable(1.0),
                         "sync_on_read": tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ,
                                                     aggregation=tf.VariableAggregation.SUM)}
        for kind, v in variables.items():
            inside = strategy.run(v.is_initialized)
            outside = v.is_initialized()
            out[f"{kind} {n}"] = {
                "inside_type": type(inside).__name__,
                "inside": [leaves(x)[0] for x in strategy.experimental_local_results(inside)],
                "outside": leaves(outside)[0]}
    return out


# md.Variable's constructor arguments: (initial value, keyword arguments), both expressions.
VARIABLE_ARGS = [
    ("[1.0, 2.0]", "{'validate_shape': False}"), ("[1.0, 2.0]", "{'shape': [2]}"), ("[1.0, 2.0]", "{'shape': [3]}"),
    ("[1.0, 2.0]", "{'shape': [2, 1]}"), ("[1.0, 2.0]", "{'shape': [3], 'validate_shape': False}"),
    ("1.0", "{'caching_device': '/cpu:0'}"), ("1.0", "{'import_scope': 's'}"),
    ("1.0", "{'experimental_enable_variable_lifting': False}"), ("1.0", "{'variable_def': 3}"),
    ("None", "{'variable_def': {'a': 1}}"), ("None", "{}"), ("lambda: [1.0, 2.0]", "{}"),
    ("lambda: [1, 2]", "{'dtype': 'float32'}"), ("1.5", "{'dtype': 'int32'}"), ("np.ones(2)", "{'dtype': 'float32'}"),
    ("np.float64(2.5)", "{'dtype': 'int32'}"), ("[1, 2]", "{}"), ("2**40", "{}"), ("True", "{}"), ("1.5", "{}"),
    ("1.0", "{'constraint': 3}"),
]


def variable_cases():
    out = []
    for initial, kwargs in VARIABLE_ARGS:
        out.append({"initial_value": initial, "kwargs": kwargs,
                    "result": result(lambda: tf.Variable(_eval(initial), **_eval(kwargs)).read_value())})
    v = tf.Variable([1.0, 2.0], validate_shape=False)
    out.append({"initial_value": "[1.0, 2.0]", "kwargs": "{'validate_shape': False}", "assign": "[1.0, 2.0, 3.0]",
                "result": result(lambda: v.assign([1.0, 2.0, 3.0]))})
    return out


def main():
    logical_cpus(4)
    write_reference("tf_conversions_reference.json", {
        "convert_to_tensor": convert_cases(), "function_signature": signature_cases(),
        "is_initialized": is_initialized_cases(), "variable_args": variable_cases()}, indent=1)


if __name__ == "__main__":
    main()
