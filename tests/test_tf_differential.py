"""Randomised differential test of the strategy's collective semantics against TensorFlow 2.21: the cases that
tests/tf_differential_cases.py draws from its seed (reduce, all_reduce, all_gather, gather, reduce_to,
batch_reduce_to, experimental_local_results, variable updates and reads at 1 to 4 replicas), recorded from TF by
tests/data/record_tf_differential.py, replayed on mirrored's MirroredStrategy over logical CPUs. Each result must
be TF's (type, structure, dtype, shape, values, or the exception class and its key words) or one of the documented
deliberate differences below (docs/tf_semantics.md). The suite never imports TensorFlow."""

import json
import os

import numpy as np
import pytest

import tf_differential_cases as cases
from test_tf_semantics_parity import Mirrored, assert_same

with open(os.path.join(os.path.dirname(__file__), "data", "tf_differential_reference.json")) as _f:
    _RECORD = json.load(_f)
REFERENCE = _RECORD["cases"]
CASES = cases.generate()
_ADAPTER = Mirrored()

# Words of TF's message -> the words mirrored's message must hold for the same error.
_ERROR_WORDS = {"cannot be reduced": ("non-DistributedValues", "cannot be reduced"),
                "Invalid reduction dimension": ("axis",), "Requires start <= limit": ("axis",),
                "ConcatOp": ("axis",), "not in the list of allowed values": ("dtype",),
                "not in list of allowed values": ("dtype",), "Could not convert": ("Could not convert",),
                "aggregation=MEAN and a non-floating dtype": ("MEAN", "int"),
                "in cross-replica context when aggregation": ("does not support", "cross-replica", "SUM")}


# --- the leaves of a case and their NumPy results ------------------------------------------------------------

def _leaves(case):
    if "pairs" in case:
        return case["pairs"]
    if "structure" in case and isinstance(case["structure"], dict):
        def walk(node):
            (form, body), = node.items()
            if form == "single":
                return [body]
            return [leaf for item in body for leaf in walk(item[1] if form == "dict" else item)]
        return walk(case["structure"])
    return [case]


def _encoded(a):
    return cases.as_json({"dtype": a.dtype.name, "shape": list(a.shape), "v": a.tolist()})


def _replicas(leaf, n):
    return [cases.replica_value(leaf["seed"], r, leaf["dtype"], cases.shape_at(leaf, r)) for r in range(n)]


def _reduced(leaf, n, op):
    """NumPy's reduction of the leaf's replica values: MEAN of integers is float64, as in TF's all_reduce (one
    replica: the value as it is)."""
    if n == 1:
        return _encoded(_replicas(leaf, 1)[0])
    total = np.sum(_replicas(leaf, n), axis=0, dtype=leaf["dtype"])
    if op == "SUM":
        return _encoded(np.asarray(total))
    return _encoded(np.asarray(total / n if leaf["dtype"].startswith("int") else total / np.asarray(n, total.dtype)))


def _on_every_replica(encoded, n, kind):
    return encoded if n == 1 else {"type": kind, "values": [encoded] * n}


def _numpy_result(case):
    """What mirrored must return for cases TF gives no usable answer to: NumPy's result, in TF's types."""
    n, kind = case["n"], case["kind"]
    if kind == "all_reduce":
        def build(node):
            (form, body), = node.items()
            if form == "single":
                return _on_every_replica(_reduced(body, n, case["op"]), n, "PerReplica")
            if form == "dict":
                return {"dict": [[key, build(value)] for key, value in body]}
            return {form: [build(value) for value in body]}
        return build(case["structure"])
    if kind in ("gather", "all_gather"):
        gathered = _encoded(np.concatenate(_replicas(case, n), axis=case["axis"]))
        if kind == "gather":
            return gathered
        single = _on_every_replica(gathered, n, "PerReplica")
        return single if case["structure"] == "single" else {"tuple": [single, single]}
    if kind == "batch_reduce_to":
        # The reduced value on the destinations (one device: the value; every replica's: a copy on each), as
        # reduce_to places it; from merge_call, what it returns to each replica.
        kinds = {"cross_replica": "Mirrored", "merge_call": "PerReplica"}
        return {"list": [_reduced(p, n, case["op"]) if p["destinations"] == "device" else
                         _on_every_replica(_reduced(p, n, case["op"]), n, kinds[case["context"]])
                         for p in case["pairs"]]}
    raise AssertionError(f"no NumPy result for a {kind} case")


# --- the deliberate differences -----------------------------------------------------------------------------

def _unsupported_dtype(case, got, want):
    """SPEC §3's dtypes are NCCL's: bool and complex are refused (TypeError naming the dtype) where TF reduces
    complex numbers (AddN) or refuses either with InvalidArgumentError / TypeError from its kernels."""
    if not any(leaf["dtype"] in cases.RARE for leaf in _leaves(case)) or case["kind"] == "local_results" \
            or case["n"] == 1:
        return False
    assert got.get("raises") == "TypeError" and "is not supported" in got["msg"], got
    return True


def _replica_update_without_aggregation(case, got, want):
    """TF >= 2.4 updates each copy of an aggregation-NONE MirroredVariable in replica context on its own (the
    copies drift apart); mirrored refuses it (SPEC §3), as TF <= 2.3 did, and the copies keep their value."""
    if case["kind"] != "variable" or case["aggregation"] != "NONE" or case["synchronization"] == "ON_READ" \
            or case["context"] == "cross_replica":
        return False
    want, got = dict(want["dict"]), dict(got["dict"])
    assert "raises" not in want["update"], want
    assert got["update"].get("raises") == "ValueError" and "aggregation" in got["update"]["msg"], got
    initial = _encoded(cases.replica_value(case["seed"], 99, case["dtype"], case["shape"]))
    assert_same(got["read"], initial)
    assert_same(got["local"], {"list": [initial] * case["n"]})
    return True


def _int32_in_a_batch(case, got, want):
    """TF keeps int32 tensors in host memory and reduces them with a cross-device op of their own, a new one for
    each value: its batch_reduce_to (and all_reduce of a structure) of two or more values, one of them int32,
    finds two ops and refuses ("all on the host or all on the compute devices"); mirrored reduces every leaf."""
    leaves = _leaves(case)
    dtypes = {leaf["dtype"] for leaf in leaves}
    if case["kind"] not in ("all_reduce", "batch_reduce_to") or "int32" not in dtypes or len(leaves) < 2:
        return False
    if dtypes & set(cases.RARE) and case["n"] > 1:  # (refused: _unsupported_dtype)
        return False
    assert want.get("raises") == "ValueError" and "all on the host" in want["msg"], want
    assert_same(got, _numpy_result(case))
    return True


def _sum_of_plain_zeros(case, got, want):
    """TF's reduce of a value that is not distributed returns 0 for a NumPy array (or number) of zeros whatever
    the op, and refuses a tf.Tensor with SUM over several replicas: mirrored's arrays are NumPy's, so take the
    first rule (docs/function.md)."""
    if case["kind"] != "reduce" or case["source"] != "plain" or case["axis"] is not None or case["op"] != "SUM" \
            or case["n"] == 1 or np.any(_replicas(case, 1)[0]):
        return False
    assert want.get("raises") == "ValueError" and "cannot be reduced" in want["msg"], want
    assert_same(got, _encoded(_replicas(case, 1)[0]))
    return True


def _negative_gather_axis(case, got, want):
    """TF's gather / all_gather along a negative axis fail in its graph code ("Requires start <= limit") for
    every dtype but int32, whose path gathers along it (tests/tf_semantics_scenarios.py all_gather_negative_axis):
    mirrored gathers along it for every dtype."""
    if case["kind"] not in ("gather", "all_gather") or case["axis"] >= 0 or case["dtype"] == "int32" \
            or not case["shape"]:
        return False
    assert want.get("raises") == "ValueError" and "Requires start <= limit" in want["msg"], want
    assert_same(got, _numpy_result(case))
    return True


DELIBERATE = (_unsupported_dtype, _replica_update_without_aggregation, _int32_in_a_batch,
              _sum_of_plain_zeros, _negative_gather_axis)


# --- the tests -----------------------------------------------------------------------------------------------

RECORDED = [name for name in CASES if "tf_crashed" not in REFERENCE[name]]
TF_CRASHED = [name for name in CASES if "tf_crashed" in REFERENCE[name]]


def test_reference_holds_this_seeds_cases():
    assert _RECORD["tensorflow"].startswith("2.21") and _RECORD["seed"] == cases.SEED
    assert _RECORD["drawn"] == CASES  # (the same draw: the same cases, values and all)
    assert list(REFERENCE) == list(CASES)
    assert len(RECORDED) >= 400
    assert {case["n"] for case in CASES.values()} == set(cases.NS)


@pytest.mark.parametrize("name", RECORDED)
def test_matches_tensorflow(name):
    case, want = CASES[name], REFERENCE[name]
    got = cases.run_case(_ADAPTER, case)
    try:
        assert_same(got, want)
    except AssertionError:
        if not any(rule(case, got, want) for rule in DELIBERATE):
            raise
        return
    for got_error, want_error in _errors(got, want):
        words = [w for key, ws in _ERROR_WORDS.items() if key in want_error["msg"] for w in ws]
        assert words or want_error["msg"] == got_error["msg"], f"no key words known for {want_error['msg']!r}"
        for word in words:
            assert word.lower() in got_error["msg"].lower(), (word, got_error["msg"])


def _errors(got, want):
    """The (mirrored's, TF's) pairs of raised exceptions in two results of the same structure (a variable case
    holds one per step)."""
    if isinstance(want, dict) and "raises" in want:
        return [(got, want)]
    if isinstance(want, dict):
        return [pair for key in want for pair in _errors(got[key], want[key])]
    if isinstance(want, list):
        return [pair for g, w in zip(got, want) for pair in _errors(g, w)]
    return []


@pytest.mark.parametrize("name", TF_CRASHED)
def test_where_tensorflow_crashed(name):
    """TF's process dies on collectives of empty tensors (a segmentation fault): mirrored gives NumPy's result."""
    case = CASES[name]
    assert any(0 in leaf["shape"] for leaf in _leaves(case)), case
    assert_same(cases.run_case(_ADAPTER, case), _numpy_result(case))
