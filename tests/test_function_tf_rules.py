"""md.function's calls, traces, methods and concrete functions as TensorFlow 2.21's tf.function (the values are
TF's, as tests/data/tf_function_reference.json recorded them): one small test per rule the randomised
differential test (test_function_differential.py) found md.function breaking."""

import numpy as np
import pytest

import mirrored as md

pytestmark = pytest.mark.filterwarnings("ignore::mirrored.distribute.function.EagerFallbackWarning")


def test_positional_keyword_and_default_arguments_are_one_trace():
    f = md.function(lambda x, y=3: x * y)
    a = np.ones(2)
    for call in (lambda: f(a), lambda: f(x=a), lambda: f(a, 3), lambda: f(a, y=3)):
        np.testing.assert_array_equal(call(), [3, 3])
    assert f.experimental_get_tracing_count() == 1
    f(a, 4)
    assert f.experimental_get_tracing_count() == 2


def test_python_literals_trace_by_value_and_numpy_scalars_by_dtype():
    f = md.function(lambda x: x)
    f(1), f(1.0), f(True)  # equal values: TF's literals 1, 1.0 and True are one trace type
    assert f.experimental_get_tracing_count() == 1
    g = md.function(lambda x: x)
    g(np.float32(1)), g(np.float32(2))  # NumPy scalars are tensors to TF: a new value is no new trace
    assert g.experimental_get_tracing_count() == 1
    g(np.int64(3))
    assert g.experimental_get_tracing_count() == 2


@pytest.mark.parametrize("args, kwargs, reason", [
    ((1, 2, 3), {}, "too many positional arguments"),
    ((), {}, "missing a required argument: 'x'"),
    ((1,), {"x": 2}, "multiple values for argument 'x'"),
    ((1,), {"z": 2}, "got an unexpected keyword argument 'z'"),
])
def test_calls_without_a_signature_bind_with_tensorflows_refusals(args, kwargs, reason):
    f = md.function(lambda x, y=3: x)
    with pytest.raises(TypeError, match=f"^Binding inputs to tf.function failed due to `{reason}`"):
        f(*args, **kwargs)
    assert f.experimental_get_tracing_count() == 0


def test_a_trace_that_raises_is_not_counted():
    f = md.function(lambda x: x + "a")
    with pytest.raises(TypeError):
        f(1)
    assert f.experimental_get_tracing_count() == 0
    assert f("b") == "ba" and f.experimental_get_tracing_count() == 1


def test_a_decorated_method_is_one_function_per_instance():
    class Model:
        def __init__(self, k):
            self.k = k

        @md.function
        def scaled(self, x):
            return x * self.k

    a, b = Model(1), Model(2)
    assert a.scaled is a.scaled and a.scaled.__name__ == "scaled"
    assert a.scaled(1) == 1 and b.scaled(1) == 2 and a.scaled(2) == 2
    assert (a.scaled.experimental_get_tracing_count(), b.scaled.experimental_get_tracing_count(),
            Model.scaled.experimental_get_tracing_count()) == (2, 1, 0)


def test_a_concrete_function_takes_every_argument_it_was_traced_with():
    f = md.function(lambda x, y=3: x * y)
    concrete = f.get_concrete_function(md.TensorSpec([None], "float32"))
    args, kwargs = concrete.structured_input_signature
    assert args == (md.TensorSpec([None], "float32", "x"), 3) and kwargs == {}
    np.testing.assert_array_equal(concrete(np.ones(2, np.float32), 3), [3, 3])
    with pytest.raises(TypeError, match="failed due to `missing a required argument: 'y'`"):
        concrete(np.ones(2, np.float32))
    with pytest.raises(TypeError, match=r"failed due to `Can not cast 4 to Literal\[3\]`"):
        concrete(np.ones(2, np.float32), 4)
    f(np.ones(5, np.float32))  # the concrete function's trace covers it
    assert f.experimental_get_tracing_count() == 1


def test_a_concrete_functions_structured_signature_nests_as_tensorflows():
    f = md.function(lambda x, y: x, input_signature=[
        (md.TensorSpec([2], "float32"), md.TensorSpec([None], "int32")), {"a": md.TensorSpec([], "float64")}])
    args, kwargs = f.get_concrete_function().structured_input_signature
    assert args == ((md.TensorSpec([2], "float32", "x_0"), md.TensorSpec([None], "int32", "x_1")),
                    {"a": md.TensorSpec([], "float64", "y_a")}) and kwargs == {}
    g = md.function(lambda x: x)
    args, _ = g.get_concrete_function([0, 1]).structured_input_signature  # Python values stay values
    assert args == ([0, 1],)
    with pytest.raises(TypeError, match="Can not cast array"):
        g.get_concrete_function([0, 1])(np.array([0, 1]))


def test_a_non_callable_is_refused_in_tensorflows_words():
    with pytest.raises(TypeError, match="^3 is not a callable object"):
        md.function(3)


def test_a_copy_shares_the_traces_and_a_deep_copy_starts_afresh():
    import copy

    f = md.function(lambda x: x * 2)
    f(np.ones(2))
    shallow = copy.copy(f)
    shallow(np.ones(3))
    assert f.experimental_get_tracing_count() == shallow.experimental_get_tracing_count() == 2
    deep = copy.deepcopy(f)
    assert deep.experimental_get_tracing_count() == 0
    np.testing.assert_array_equal(deep(np.ones(2)), [2, 2])


def test_parameters_a_signature_leaves_out_keep_their_defaults():
    f = md.function(lambda x, y=3, *, k=2: x * y * k, input_signature=[md.TensorSpec([None], "float32")])
    np.testing.assert_array_equal(f(np.ones(2), 3.0, k=2), [6, 6])  # (equal values pass)
    with pytest.raises(TypeError, match=r"failed due to `Can not cast 1 to Literal\[3\]`"):
        f(np.ones(2), 1)
    with pytest.raises(TypeError, match=r"failed due to `Can not cast 5 to Literal\[2\]`"):
        f(np.ones(2), k=5)


def test_an_object_with_a_decorated_method_is_freed_when_dropped():
    """The md.function kept for each instance holds it weakly, as tf.function's: a model dropped after its
    step ran goes at once, with its arrays (the step kept a bound method, which kept the model for good)."""
    import gc
    import weakref

    class Model:
        def __init__(self):
            self.w = np.full(3, 2.0)

        @md.function
        def step(self, x):
            return x * self.w

    gc.collect()
    gc.disable()
    try:
        model = Model()
        step = model.step
        assert step is model.step and step.__name__ == "step"
        np.testing.assert_array_equal(step(np.ones(3)), [2, 2, 2])
        assert step.python_function.__self__ is model
        dropped = weakref.ref(model)
        del model
        assert dropped() is None, "the decorated method's function keeps its object alive"
        with pytest.raises(ReferenceError, match="its object was deleted"):  # (tf.function's holds it weakly too)
            step(np.ones(3))
    finally:
        gc.enable()
