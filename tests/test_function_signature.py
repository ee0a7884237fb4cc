"""md.function's input_signature, trace counts and attributes against TensorFlow 2.21's tf.function
(tests/data/tf_conversions_reference.json, recorded by tests/data/record_tf_conversions.py): what a signature
accepts, converts and refuses (TF's TypeError and words), how often a function traces with and without a
signature and reduce_retracing, and the same checks for each replica under strategy.run."""

import json
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from mirrored._nest import flatten
from mirrored.distribute.function import EagerFallbackWarning

with open(os.path.join(os.path.dirname(__file__), "data", "tf_conversions_reference.json")) as _f:
    REFERENCE = json.load(_f)["function_signature"]

pytestmark = pytest.mark.filterwarnings("ignore::mirrored.distribute.function.EagerFallbackWarning")


def _eval(expression):
    return eval(expression, {"np": np, "TensorSpec": md.TensorSpec})


def _identity(signature):
    return (lambda a, b: (a, b)) if signature.count("TensorSpec") == 2 and signature.startswith("[T") else (
        lambda x: x)


def _leaves(out):
    return [{"dtype": np.asarray(x).dtype.name, "shape": list(np.shape(x)),
             "value": np.asarray(x).reshape(-1).astype(np.float64).tolist()} for x in flatten(out)]


def _check(call, want):
    if isinstance(want, dict):
        with pytest.raises(TypeError) as caught:
            call()
        message = str(caught.value)
        tf_reason = want["msg"].split("`")[1].replace("dtype=tf.", "dtype=")
        assert message.startswith("Binding inputs to tf.function failed due to `")
        # TF's reason word for word, but where TF's own words are an internal slip: a list of the wrong length
        # "has no len()" (md: "Expected [...] to have length of 2").
        if "has no len()" in tf_reason:
            assert "to have length of" in message
        elif "TraceType" in tf_reason:  # (TF names its nested TraceType; md the spec)
            assert "has different keys with the TraceType" in message
        else:
            assert tf_reason.split(" (")[0] in message, (tf_reason, message)
        return
    assert _leaves(call()) == want


@pytest.mark.parametrize("case", REFERENCE["calls"], ids=lambda c: f"{c['signature']}-{c['args']}")
def test_a_signature_converts_and_refuses_as_tensorflow(case):
    fn = md.function(_identity(case["signature"]), input_signature=_eval(case["signature"]))
    _check(lambda: fn(*_eval(case["args"])), case["result"])
    assert fn.experimental_get_tracing_count() <= 1


@pytest.mark.parametrize("case", REFERENCE["keywords"], ids=lambda c: f"{c['args']}-{c['kwargs']}")
def test_keyword_arguments_bind_as_tensorflow(case):
    fn = md.function(lambda x: x, input_signature=[md.TensorSpec([None, 3], "float32")])
    _check(lambda: fn(*_eval(case["args"]), **_eval(case["kwargs"])), case["result"])


@pytest.mark.parametrize("case", REFERENCE["bad"], ids=lambda c: f"{c['fn']}-{c['signature']}")
def test_bad_signatures_raise_when_wrapped(case):
    want = case["result"]
    make = lambda: md.function(_eval(case["fn"]), input_signature=_eval(case["signature"]))  # noqa: E731
    if "raises" in want:
        with pytest.raises(TypeError) as caught:
            make()
        assert want["msg"].split(", got <class")[0].split(" with types")[0].rstrip(".") in str(caught.value)
    else:
        got = make().input_signature
        assert (None if got is None else [repr(s).replace("dtype=", "dtype=tf.") for s in flatten(
            list(got))]) == want["input_signature"]


@pytest.mark.parametrize("case", REFERENCE["tracing"], ids=lambda c: f"{c['reduce_retracing']}-{c['signature']}")
def test_tracing_counts_as_tensorflow(case):
    signature = case["signature"]
    fn = md.function((lambda *a: a) if signature is None else (lambda x: x),
                     reduce_retracing=case["reduce_retracing"],
                     input_signature=None if signature is None else _eval(signature))
    counts = []
    for call in case["calls"]:
        fn(*_eval(call))
        counts.append(fn.experimental_get_tracing_count())
    assert counts == case["counts"]


def test_experimental_relax_shapes_is_reduce_retracing_and_the_decorator_keeps_every_argument():
    @md.function(experimental_relax_shapes=True, jit_compile=False)
    def relaxed(x):
        return x

    @md.function(input_signature=[md.TensorSpec([None], "int64")], autograph=False)
    def signed(x):
        return x

    for n in (2, 3, 4, 5):
        relaxed(np.ones(n))
    assert relaxed.experimental_get_tracing_count() == 2
    assert signed([1, 2]).dtype == np.int64 and signed.input_signature == (md.TensorSpec([None], "int64"),)
    assert signed.__wrapped__ is signed.python_function and signed.name == "signed"


@pytest.mark.parametrize("case", REFERENCE["concrete"], ids=lambda c: c["signature"])
def test_get_concrete_function_of_a_signature_needs_no_arguments(case):
    fn = md.function(_identity(case["signature"]), input_signature=_eval(case["signature"]))
    concrete = fn.get_concrete_function()
    args, kwargs = concrete.structured_input_signature
    assert [repr(s).replace("dtype=", "dtype=tf.").replace("shape=TensorShape(None)", "shape=<unknown>")
            for s in flatten(args)] == case["inputs"] and kwargs == {}
    assert fn.experimental_get_tracing_count() == 1


def test_get_concrete_function_without_a_signature_takes_example_arguments():
    fn = md.function(lambda x, y: x * y)
    concrete = fn.get_concrete_function(md.TensorSpec([None], "float32"), np.float32(2))
    np.testing.assert_array_equal(concrete(np.ones(3), 2.0), [2, 2, 2])
    with pytest.raises(TypeError, match="Can not cast"):
        concrete(np.ones((2, 2)), 2.0)
    with pytest.raises(TypeError, match="pass example arguments"):
        fn.get_concrete_function()


def test_a_method_binds_its_signature_after_self():
    class Model:
        scale = np.float32(3)

        @md.function(input_signature=[md.TensorSpec([2], "float32")])
        def call(self, x):
            return x * self.scale

    model = Model()
    np.testing.assert_array_equal(model.call([1, 2]), [3, 6])
    with pytest.raises(TypeError, match=r"Can not cast TensorSpec\(shape=\(3,\)"):
        model.call([1, 2, 3])


@pytest.mark.parametrize("replicas", [1, 2])
def test_strategy_run_binds_each_replicas_arguments(replicas):
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    step = md.function(lambda x: x * 2, input_signature=[md.TensorSpec([None], "float32")])
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(ctx.replica_id_in_sync_group + 1, dtype=np.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        out = strategy.run(step, args=(per_replica,))
    results = strategy.experimental_local_results(out)
    for i, r in enumerate(results):
        assert r.dtype == np.float32
        np.testing.assert_array_equal(r, np.arange(i + 1) * 2)
    bad = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 2), np.float32))
    with pytest.raises(TypeError, match=r"Can not cast TensorSpec\(shape=\(2, 2\), dtype=float32"):
        strategy.run(step, args=(bad,))
    assert step.experimental_get_tracing_count() == 1


DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool", "complex64"]


@settings(max_examples=60, deadline=None)
@given(spec_shape=st.lists(st.one_of(st.none(), st.integers(0, 3)), max_size=3),
       dims=st.lists(st.integers(0, 3), max_size=3), source=st.sampled_from(DTYPES),
       target=st.sampled_from(DTYPES))
def test_numpy_arguments_of_fitting_shape_are_cast_others_refused(spec_shape, dims, source, target):
    fn = md.function(lambda x: x, input_signature=[md.TensorSpec(spec_shape, target)])
    array = np.ones(dims, source)
    fits = len(dims) == len(spec_shape) and all(s is None or s == d for s, d in zip(spec_shape, dims))
    if not fits:
        with pytest.raises(TypeError, match="Binding inputs to tf.function failed due to `Can not cast"):
            fn(array)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = array.astype(target)
    got = fn(array)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert fn.experimental_get_tracing_count() == 1
