"""Every public class and function shows its real parameters to help() and IDEs (inspect.signature)."""

import inspect
import pydoc
import types

import pytest

import mirrored as md


def _public_callables():
    """(dotted name, object) of every public callable defined in mirrored, reached from ``md``."""
    found, seen, queue = {}, {"mirrored"}, [("md", md)]
    while queue:  # breadth first, so each object is named by its shortest path
        prefix, module = queue.pop(0)
        for name in dir(module):
            if name.startswith("_"):
                continue
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__.startswith("mirrored") and obj.__name__ not in seen:
                    seen.add(obj.__name__)
                    queue.append((f"{prefix}.{name}", obj))
            elif callable(obj) and getattr(obj, "__module__", "").startswith("mirrored"):
                found.setdefault(id(obj), (f"{prefix}.{name}", obj))
    return sorted(found.values())


PUBLIC = _public_callables()


def test_the_walk_finds_the_api():
    # (by object: md.collectives.all_reduce is also md.collective.all_reduce, whichever the walk meets first)
    found = {id(obj) for _, obj in PUBLIC}
    for obj in (md.Variable, md.MirroredStrategy, md.collectives.all_reduce, md.MirroredVariable):
        assert id(obj) in found, obj
    assert len(PUBLIC) > 60


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_signature_shows_the_parameters(name, obj):
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return  # exceptions take a message, as Python's own do
    signature = inspect.signature(obj)
    kinds = {p.kind for p in signature.parameters.values()}
    hidden = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    if isinstance(obj, type) and kinds >= hidden:
        pytest.fail(f"{name}{signature}: a class whose signature hides its parameters")


def test_variable_signature_is_the_one_it_takes():
    signature = inspect.signature(md.Variable)
    # tf.Variable's parameters in its order (TensorFlow 2.21)
    assert list(signature.parameters) == ["initial_value", "trainable", "validate_shape", "caching_device", "name",
                                          "variable_def", "dtype", "import_scope", "constraint", "synchronization",
                                          "aggregation", "shape", "experimental_enable_variable_lifting"]
    assert signature.parameters["synchronization"].default is md.VariableSynchronization.AUTO
    assert "Variable(initial_value=None, trainable=None" in pydoc.render_doc(md.Variable, renderer=pydoc.plaintext)
    # and md.Variable still takes exactly those arguments, positionally
    v = md.Variable(1.0, False, True, None, "w", None, "float64", None, None, md.VariableSynchronization.AUTO,
                    md.VariableAggregation.MEAN, ())
    assert v.name == "w:0" and v.dtype == "float64" and v.aggregation == md.VariableAggregation.MEAN
    assert not v.trainable


@pytest.mark.parametrize("cls", [md.MirroredVariable, md.SyncOnReadVariable, md.DistributedVariable])
def test_distributed_variable_classes_show_their_own_init(cls):
    assert list(inspect.signature(cls).parameters) == ["strategy", "components", "aggregation"]
