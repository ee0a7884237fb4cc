"""The distributed values' and variables' Python surface against TensorFlow 2.21: the cases that
tests/values_surface_cases.py draws from its seed (operators, conversions, indexing, iteration, in-place operators,
hashing and ``ref``, properties, read / update / scatter methods, ``repr`` / ``str`` of MirroredVariable,
SyncOnReadVariable, plain and CentralStorage variables, PerReplica and Mirrored, in cross-replica and replica
context), recorded from TF by tests/data/record_tf_values_surface.py, replayed here over mirrored. Each result must
be TF's (type, dtype, shape, values, text, or the exception class) or one of the documented deliberate
differences (docs/tf_semantics.md, "The values' Python surface"). The suite never imports TensorFlow."""

import ast
import json
import os
import re

import numpy as np
import pytest

import mirrored as md
import values_surface_cases as cases
from test_tf_semantics_parity import Mirrored, assert_same

with open(os.path.join(os.path.dirname(__file__), "data", "tf_values_surface_reference.json")) as _f:
    _RECORD = json.load(_f)
REFERENCE = _RECORD["cases"]
CASES = cases.generate()

# TF's class names -> mirrored's for the same thing.
_TYPES = {"ResourceVariable": "DeviceVariable", "EagerTensor": "ndarray"}
# TF's exception classes -> the class mirrored raises for the same refusal.
_ERRORS = {"InvalidArgumentError": "ValueError", "OutOfRangeError": "OutOfRangeError"}


class Surface(Mirrored):
    IndexedSlices = md.IndexedSlices

    def make_strategy(self, kind):
        if kind.startswith("mirrored"):
            return self.strategy(int(kind[-1]))
        if kind == "one_device":
            return md.distribute.OneDeviceStrategy("/cpu:0")
        if kind == "central_storage":
            return md.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
        return md.distribute.get_strategy()


_ADAPTER = Surface()


# --- TF's text as mirrored writes it: the same structure, NumPy's arrays for TF's tensors -------------------

def _tensor_repr(match):
    dtype, text = match.group(2), match.group(3)
    if match.group(1) == "":  # a scalar: TF shows the number, NumPy's repr a 0-d array
        return repr(np.array(ast.literal_eval(text.replace("nan", "None")), dtype))
    return text


def as_mirrored_text(text: str) -> str:
    text = re.sub(r"<tf\.Tensor: shape=\(([^)]*)\), dtype=(\w+), numpy=\n?(.*?)>", _tensor_repr, text, flags=re.S)
    text = re.sub(r"tf\.Tensor\(\n?(.*?), shape=\([^)]*\), dtype=\w+\)", r"\1", text, flags=re.S)
    return text.replace("<tf.Variable ", "<mirrored.Variable ")


# --- deliberate differences: (rule, TF's result as recorded, mirrored's) -------------------------------------

def _raised(result, *names):
    """Whether ``result`` is an exception (of one of ``names``, when given)."""
    return isinstance(result, dict) and "raises" in result and (not names or result["raises"] in names)


def _each(result):
    """The per-replica results of a case in replica context, else the one."""
    return result if isinstance(result, list) else [result]


def _deliberate(case, want):
    """What mirrored gives instead of TF's ``want`` where it differs on purpose (docs/tf_semantics.md), as a
    predicate of mirrored's result; None where mirrored must give TF's result."""
    op, result = case["op"], want.get("result")
    if case["holder"] == "per_replica" and op in cases.BINARY and _raised(result, "AttributeError"):
        # TF converts the other operand first and fails on a missing `dtype`; the operator is refused either way
        return lambda got: _raised(got["result"], "TypeError")
    if case["holder"] == "mirrored" and op == "asarray" and _raised(result, "ValueError"):
        # TF's __array__ of a Mirrored fails; here NumPy's array of the component, which the operators see too
        return lambda got: got["result"].get("dtype") == case["dtype"] and got["result"]["shape"] == case["shape"]
    distributed = want.get("made", {}).get("v") in ("MirroredVariable", "SyncOnReadVariable", "Mirrored")
    if distributed and op in ("float", "int") and _raised(result, "TypeError") and not case["shape"]:
        # TF's distributed classes lack __float__ / __int__; here a scalar converts, as a tf.Variable does
        return lambda got: all(isinstance(g, dict) and (g.get("py") in ("float", "int") or _raised(
            g, "ValueError")) for g in _each(got["result"]))
    if op == "matmul" and len(case["shape"]) == 1 and all(_raised(w, "InvalidArgumentError") for w in _each(result)):
        # TF's matmul takes matrices only; the variable reads as a NumPy array, whose @ takes vectors too
        return lambda got: all(g.get("shape") == [] for g in _each(got["result"]))
    if op == "count_up_to" and _raised(result, "InvalidArgumentError") and case["dtype"].startswith("float"):
        # a dtype refused: TypeError, as for every variable method (docs/variables.md)
        return lambda got: _raised(got["result"], "TypeError")
    if case["context"] == "replica" and case.get("aggregation") == "NONE" and case["holder"] == "variable" and \
            want.get("made", {}).get("v") == "MirroredVariable" and (op in ("assign", "assign_add", "assign_sub")
                                                                     or op.startswith("scatter_nd_m")
                                                                     or op in cases.SCATTERS[:7]) and \
            not any(_raised(w) for w in _each(result)):
        # SPEC §3, docs/variables.md: an update of an aggregation-NONE mirrored variable inside run is refused (TF
        # updates each replica's copy on its own: they may drift apart)
        return lambda got: all(_raised(g, "ValueError") and "aggregation" in g["msg"] for g in _each(got["result"]))
    if op.startswith("scatter_nd_") and want.get("made", {}).get("v") == "MirroredVariable" and \
            case["context"] == "cross_replica" and "after" in want and not _raised(result):
        # docs/variables.md: every copy updated (TF updates the first only)
        return lambda got: got["result"] == result and all(c == got["after"]["copies"][0]
                                                             for c in got["after"]["copies"])
    if case["holder"] == "mirrored" and op in ("ref", "experimental_ref") and want["made"]["v"] == "EagerTensor":
        # one replica: the value is NumPy's array, which has no ref() (TF's tensor has)
        return lambda got: _raised(got["result"], "AttributeError")
    if op.startswith("getitem") and _raised(result, "InvalidArgumentError"):
        # an index the value does not have: NumPy's IndexError
        return lambda got: _raised(got["result"], "IndexError")
    if case["holder"] == "mirrored" and op in ("ref", "experimental_ref"):
        # TF's delegates to the component's (deref gives the tensor); here the Mirrored itself
        return lambda got: got["result"] == {**want["result"], "dict": [[k, {"py": "bool", "v": True}] if k == "deref_is"
                                                                        else [k, v] for k, v in want["result"]["dict"]]}
    return None


def _normalise(got):
    """mirrored's class names as TF's where they name the same thing."""
    made = got.get("made")
    if isinstance(made, dict) and made.get("py") == "str":
        made = {"py": "str", "v": {v: k for k, v in _TYPES.items()}.get(made["v"], made["v"])}
    return {**got, "made": made}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN, as IEEE says (and TF)
@pytest.mark.parametrize("name", sorted(CASES))
def test_surface_as_tensorflow(name):
    case, want = CASES[name], REFERENCE[name]
    assert _RECORD["drawn"][name] == case, "the generator changed: record the reference again"
    got = _normalise(cases.run_case(_ADAPTER, case))
    rule = _deliberate(case, want)
    if rule is not None:
        assert rule(got), f"{name}: {case}\nTF {want}\nmirrored {got}"
        return
    if case["op"] in cases.TEXT and isinstance(want.get("result"), (dict, list)):
        want = {**want, "result": [
            {"py": "str", "v": as_mirrored_text(w["v"])} if isinstance(w, dict) and w.get("py") == "str" else w
            for w in _each(want["result"])]}
        if not isinstance(got["result"], list):
            want["result"] = want["result"][0]
    assert_same(got, want, name, errors=_ERRORS)


# --- what the cases found, each on its own ------------------------------------------------------------------

def _two_replicas():
    return md.MirroredStrategy(["/cpu:0", "/cpu:1"])


def test_in_place_operator_refused_on_a_plain_variable_and_rebinds_a_distributed_one():
    plain = md.Variable(np.array([1.0, 2.0], np.float32))
    w = plain
    with pytest.raises(RuntimeError, match="assign_add"):
        w += 1.0
    with _two_replicas().scope():
        mirrored = md.Variable(np.array([1.0, 2.0], np.float32))
    w = mirrored
    w += 1.0  # TF: w is now the array w + 1, the variable unchanged
    assert type(w) is np.ndarray and w.tolist() == [2.0, 3.0] and mirrored.numpy().tolist() == [1.0, 2.0]


def test_variable_has_no_len_unary_plus_or_scalar_iteration():
    v = md.Variable(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError):
        len(v)
    with pytest.raises(TypeError, match="unary"):
        +v
    assert [row.shape for row in v] == [(3,), (3,)]
    with pytest.raises(TypeError, match="scalar"):
        list(md.Variable(np.float32(1)))  # NumPy's fallback iteration gave [] here


def test_repr_breaks_before_an_array_of_several_lines():
    assert repr(md.Variable(np.zeros((2, 2), np.int32), name="w")) == (
        "<mirrored.Variable 'w:0' shape=(2, 2) dtype=int32, numpy=\narray([[0, 0],\n       [0, 0]], dtype=int32)>")


def test_experimental_ref_set_shape_count_up_to_initial_value():
    v = md.Variable(np.int64(3))
    assert v.experimental_ref() == v.ref() and v.experimental_ref().deref() is v
    v.set_shape([])
    with pytest.raises(ValueError, match="not compatible"):
        v.set_shape([2])
    assert v.count_up_to(5) == 3 and v.numpy() == 4
    v.count_up_to(5)
    with pytest.raises(md.errors.OutOfRangeError):
        v.count_up_to(5)
    with pytest.raises(TypeError, match="int32 or int64"):
        md.Variable(np.float32(0)).count_up_to(5)
    with pytest.raises(RuntimeError, match="initial_value"):
        v.initial_value
    with _two_replicas().scope():
        mirrored = md.Variable(np.int64(0))
    for call in (lambda: mirrored.count_up_to(5), lambda: mirrored.set_shape([])):
        with pytest.raises(NotImplementedError):
            call()


def test_row_scatter_of_a_scalar_variable_is_a_clear_error():
    v = md.Variable(np.float32(1))
    with pytest.raises(ValueError, match="scalar"):  # was an IndexError from inside the shape check
        v.scatter_add(md.IndexedSlices(np.ones(1, np.float32), np.array([0], np.int32)))


def test_summed_mirrored_variable_refuses_scatter_max_before_checking_the_rows():
    with _two_replicas().scope():
        v = md.Variable(np.zeros(3, np.float32), aggregation=md.VariableAggregation.SUM)
    with pytest.raises(NotImplementedError, match="NONE or `ONLY_FIRST_REPLICA`"):  # (TF's order of the checks)
        v.scatter_max(md.IndexedSlices(np.ones((1, 2), np.float32), np.array([0], np.int32)))


def test_sync_on_read_none_scatter_nd_in_cross_replica_context_raises_the_read_error():
    with _two_replicas().scope():
        v = md.Variable(np.zeros(3, np.float32), synchronization=md.VariableSynchronization.ON_READ)
    with pytest.raises(ValueError, match="Could not convert"):
        v.scatter_nd_max(np.array([[0]], np.int32), np.ones(1, np.float32))


def test_mirrored_value_reads_as_its_component():
    s = _two_replicas()
    with s.scope():
        v = md.Variable(np.zeros(2, np.float32))
    m = s.extended.reduce_to("SUM", s.experimental_distribute_values_from_function(
        lambda ctx: np.array([1.0, 2.0], np.float32) * (ctx.replica_id_in_sync_group + 1)), destinations=v)
    assert type(m) is md.Mirrored
    assert (m + 1).tolist() == [4.0, 7.0] and (2 * m).tolist() == [6.0, 12.0] and (-m).tolist() == [-3.0, -6.0]
    assert (m == np.array([3.0, 0.0], np.float32)).tolist() == [True, False]
    assert m[1] == 6.0 and m.numpy().tolist() == [3.0, 6.0] and np.asarray(m).tolist() == [3.0, 6.0]
    assert m.shape == (2,) and m.dtype == np.float32 and m.device.endswith("CPU:0")
    assert s.run(lambda: m.device).values[1].endswith("CPU:1")  # (inside run: the replica's own component)
    assert s.run(lambda: m + 0).values[1] is not m.values[0]
    assert {m.ref(): 1}[m.ref()] == 1 and {m: 1}[m] == 1  # (TF 2.21: hashable, == identity but with a tensor)
    assert (m == m) is True and (m == 3.0) is False and (m != m) is False
    with pytest.raises(TypeError):
        len(m)


def test_per_replica_refuses_operators_and_comparisons_with_arrays():
    s = _two_replicas()
    p = s.experimental_distribute_values_from_function(lambda ctx: np.array([1, 2], np.int32))
    with pytest.raises(TypeError):
        np.array([1, 2], np.int32) == p  # NumPy compared each element with the PerReplica: [False, False]
    with pytest.raises(TypeError):
        p + 1
    assert p == p and p != s.experimental_distribute_values_from_function(lambda ctx: np.zeros(2))
    assert {p: 1}[p] == 1
