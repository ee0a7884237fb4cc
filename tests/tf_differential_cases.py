"""Randomised differential cases of the strategy's collective semantics: drawn from a seed, written once over the
scenario adapter ``X`` of tests/tf_semantics_scenarios.py, so that TensorFlow (tests/data/record_tf_differential.py
records them) and mirrored (tests/test_tf_differential.py replays them) run the same code. This module imports
neither TensorFlow nor mirrored.

A case is plain data (a dict: its ``kind``, replica count ``n``, reduce op, axis, dtypes, shapes, ...) and a
``seed`` from which :func:`replica_value` draws every replica's values, so the JSON reference names each case
completely. :func:`run_case` runs one and returns the encoded result (or the raised exception).

Values are small integers (halves for floats): sums and means are exact in every dtype, so a difference is a
difference of semantics, not of summation order.
"""

import random

import numpy as np

from tf_semantics_scenarios import encode, per_replica, rid

SEED = 31
NS = (1, 2, 3, 4)
OPS = ("SUM", "MEAN")
NUMERIC = ("float16", "float32", "float64", "int32", "int64")
# Dtypes TF refuses or mirrored's collectives refuse (SPEC §3), drawn now and then to compare the two refusals.
RARE = ("bool", "complex64")
SYNCS = ("ON_WRITE", "ON_READ", "AUTO")
AGGREGATIONS = ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA")
UPDATES = ("assign", "assign_add", "assign_sub")
# How many cases of each kind a seed draws.
COUNTS = {"reduce": 110, "all_reduce": 70, "all_gather": 45, "gather": 45, "reduce_to": 45, "batch_reduce_to": 25,
          "local_results": 20, "variable": 110}


def replica_value(seed, replica, dtype, shape):
    """Replica ``replica``'s value of a case leaf: small integers (halves for floats, imaginary parts for complex)."""
    rng = np.random.RandomState((seed * 7919 + replica * 104729) % 2**32)
    ints = rng.randint(-4, 6, size=shape)
    if dtype == "bool":
        return ints > 0
    if dtype.startswith("float"):
        return (ints / 2).astype(dtype)
    if dtype.startswith("complex"):
        return (ints + 1j * rng.randint(-3, 4, size=shape)).astype(dtype)
    return ints.astype(dtype)


# --- drawing -----------------------------------------------------------------------------------------------

def _dtype(rng, rare=0.08):
    return rng.choice(RARE) if rng.random() < rare else rng.choice(NUMERIC)


def _shape(rng, min_rank=0, zero=0.1):
    rank = rng.randint(min_rank, 3)
    shape = [rng.randint(1, 3) for _ in range(rank)]
    if rank and rng.random() < zero:
        shape[rng.randrange(rank)] = 0
    return shape


def _axis(rng, rank, allow_none=True):
    """None (when allowed), a dimension, now and then a negative one or one past the rank (an error in both)."""
    roll = rng.random()
    if allow_none and (rank == 0 or roll < 0.3):
        return None
    if roll > 0.93:
        return rank  # out of range
    if rank and roll > 0.82:
        return -1
    return rng.randrange(rank) if rank else 0


def _leaf(rng, min_rank=0, zero=0.1):
    return {"dtype": _dtype(rng), "shape": _shape(rng, min_rank, zero), "seed": rng.randrange(10**6)}


def _structure(rng):
    """A nested structure of leaves: single, tuple, list, dict, or a dict holding a tuple and a list."""
    form = rng.choice(("single", "tuple", "list", "dict", "nested"))
    if form == "single":
        return {"single": _leaf(rng)}
    if form == "nested":
        return {"dict": [["b", {"tuple": [{"single": _leaf(rng)}, {"single": _leaf(rng)}]}],
                         ["a", {"list": [{"single": _leaf(rng)}]}]]}
    leaves = [_leaf(rng) for _ in range(rng.randint(1, 3))]
    if form == "dict":
        return {"dict": [[f"k{i}", {"single": leaf}] for i, leaf in enumerate(leaves)]}
    return {form: [{"single": leaf} for leaf in leaves]}


def _ragged(rng, case):
    """Now and then, replicas of different sizes along the case's axis (a partial last batch): ``sizes``."""
    rank, axis = len(case["shape"]), case["axis"]
    if axis is not None and -rank <= axis < rank and rng.random() < 0.35:
        case["sizes"] = [rng.randint(1, 3) for _ in range(case["n"])]


def _draw(kind, rng):
    case = {"kind": kind, "n": rng.choice(NS)}
    if kind == "reduce":
        case.update(_leaf(rng), op=rng.choice(OPS), source=rng.choice(("values_from_function", "run", "plain")))
        case["axis"] = _axis(rng, len(case["shape"]))
        if case["source"] != "plain":
            _ragged(rng, case)
    elif kind == "all_reduce":
        case.update(op=rng.choice(OPS), structure=_structure(rng))
    elif kind == "all_gather":
        case.update(_leaf(rng, min_rank=rng.choice((0, 1, 1, 1))), structure=rng.choice(("single", "tuple")))
        case["axis"] = _axis(rng, len(case["shape"]), allow_none=False)
        _ragged(rng, case)
    elif kind == "gather":
        case.update(_leaf(rng, min_rank=rng.choice((0, 1, 1, 1))), source=rng.choice(("values_from_function", "run")))
        case["axis"] = _axis(rng, len(case["shape"]), allow_none=False)
        _ragged(rng, case)
    elif kind == "reduce_to":
        case.update(_leaf(rng), op=rng.choice(OPS), context=rng.choice(("cross_replica", "merge_call")),
                    destinations=rng.choice(("value", "device", "variable")))
    elif kind == "batch_reduce_to":
        case.update(op=rng.choice(OPS), context=rng.choice(("cross_replica", "merge_call")),
                    pairs=[dict(_leaf(rng), destinations=rng.choice(("value", "device", "variable")))
                           for _ in range(rng.randint(1, 3))])
    elif kind == "local_results":
        case.update(structure=_structure(rng), source=rng.choice(("values_from_function", "run", "plain")))
    elif kind == "variable":
        dtype = rng.choice(NUMERIC)
        case.update(dtype=dtype, shape=_shape(rng, zero=0.05), seed=rng.randrange(10**6),
                    synchronization=rng.choice(SYNCS), aggregation=rng.choice(AGGREGATIONS),
                    update=rng.choice(UPDATES), context=rng.choice(("replica", "replica_same", "cross_replica")))
    return case


def generate(seed=SEED):
    """The cases of ``seed``: COUNTS of each kind, each named ``kind-index``."""
    rng = random.Random(seed)
    cases = {}
    for kind, count in COUNTS.items():
        for i in range(count):
            cases[f"{kind}-{i:03d}"] = _draw(kind, rng)
    return cases


# --- running -----------------------------------------------------------------------------------------------

def shape_at(leaf, replica):
    """The leaf's shape at ``replica``: its ``sizes[replica]`` along its axis where the replicas' sizes differ."""
    shape = list(leaf["shape"])
    if "sizes" in leaf:
        shape[leaf["axis"]] = leaf["sizes"][replica]
    return shape


def _const(X, leaf, replica):
    return X.const(replica_value(leaf["seed"], replica, leaf["dtype"], shape_at(leaf, replica)), leaf["dtype"])


def _build(X, structure, replica):
    """The nested structure's values at ``replica``."""
    (form, body), = structure.items()
    if form == "single":
        return _const(X, body, replica)
    if form == "dict":
        return {key: _build(X, value, replica) for key, value in body}
    items = [_build(X, value, replica) for value in body]
    return tuple(items) if form == "tuple" else items


def _distributed(X, s, source, make):
    """A value of replica r holding ``make(r)``: from experimental_distribute_values_from_function, returned by
    ``run``, or (``plain``) replica 0's value, not distributed."""
    if source == "values_from_function":
        return per_replica(X, s, make)
    if source == "run":
        return s.run(lambda: make(rid(X)))
    return make(0)


def _destination(X, s, kind, value, dtype, shape):
    if kind == "value":
        return value
    if kind == "device":  # the last replica's (TF leaves values_from_function's components on /cpu:0, so there a
        return f"/cpu:{len(s.extended.worker_devices) - 1}"  # batch_reduce_to would all-reduce them in place)
    with s.scope():
        return X.Variable(X.const(np.zeros(shape), dtype))


def _reduce(X, s, case):
    value = _distributed(X, s, case["source"], lambda r: _const(X, case, r))
    return s.reduce(case["op"], value, axis=case["axis"])


def _all_reduce(X, s, case):
    return s.run(lambda: X.dist.get_replica_context().all_reduce(case["op"], _build(X, case["structure"], rid(X))))


def _all_gather(X, s, case):
    def fn():
        value = _const(X, case, rid(X))
        if case["structure"] == "tuple":
            value = (value, value)
        return X.dist.get_replica_context().all_gather(value, case["axis"])
    return s.run(fn)


def _gather(X, s, case):
    return s.gather(_distributed(X, s, case["source"], lambda r: _const(X, case, r)), case["axis"])


def _in_context(X, s, context, value, merge_fn):
    """``merge_fn(strategy, value)`` in cross-replica context, or through merge_call from inside ``run``."""
    if context == "cross_replica":
        return merge_fn(s, value)
    return s.run(lambda v: X.dist.get_replica_context().merge_call(merge_fn, args=(v,)), args=(value,))


def _reduce_to(X, s, case):
    value = per_replica(X, s, lambda r: _const(X, case, r))
    destination = _destination(X, s, case["destinations"], value, case["dtype"], case["shape"])
    return _in_context(X, s, case["context"], value,
                       lambda strategy, v: strategy.extended.reduce_to(case["op"], v, destinations=destination))


def _batch_reduce_to(X, s, case):
    values = [per_replica(X, s, lambda r, leaf=leaf: _const(X, leaf, r)) for leaf in case["pairs"]]
    destinations = [_destination(X, s, leaf["destinations"], v, leaf["dtype"], leaf["shape"])
                    for leaf, v in zip(case["pairs"], values)]
    return _in_context(X, s, case["context"], tuple(values),
                       lambda strategy, vs: strategy.extended.batch_reduce_to(
                           case["op"], list(zip(vs, destinations))))


def _local_results(X, s, case):
    return s.experimental_local_results(
        _distributed(X, s, case["source"], lambda r: _build(X, case["structure"], r)))


def _update(X, s, case, v):
    """The case's assign / assign_add / assign_sub of ``v``: in cross-replica context, or from inside ``run``
    with each replica's value (``replica``) or replica 0's on all (``replica_same``)."""
    update = case["update"]
    if case["context"] == "cross_replica":
        getattr(v, update)(_const(X, case, 0))
    else:
        same = case["context"] == "replica_same"

        def fn():
            getattr(v, update)(_const(X, case, 0 if same else rid(X)))
        s.run(fn)


def _variable_case(X, s, case):
    """The variable made, then each step on its own (the update, then every read), so that one refused step
    leaves the others compared."""
    made = []

    def make():
        with s.scope():
            made.append(X.Variable(X.const(replica_value(case["seed"], 99, case["dtype"], case["shape"]),
                                           case["dtype"]),
                                   synchronization=getattr(X.VS, case["synchronization"]),
                                   aggregation=getattr(X.VA, case["aggregation"])))
        return type(made[0]).__name__

    created = _attempt(make)
    if not made:
        return created
    v = made[0]
    steps = [("update", lambda: _update(X, s, case, v)), ("read", v.read_value),
             ("local", lambda: [c.read_value() for c in s.experimental_local_results(v)]),
             ("replica_read", lambda: s.run(lambda: v.read_value()))]
    return {"dict": [["type", created]] + [[name, _attempt(step)] for name, step in steps]}


_RUNNERS = {"reduce": _reduce, "all_reduce": _all_reduce, "all_gather": _all_gather, "gather": _gather,
            "reduce_to": _reduce_to, "batch_reduce_to": _batch_reduce_to, "local_results": _local_results}


def as_json(encoded):
    """``encoded`` with complex numbers as [real, imaginary] (JSON has no complex numbers)."""
    if isinstance(encoded, complex):
        return [encoded.real, encoded.imag]
    if isinstance(encoded, dict):
        return {key: as_json(value) for key, value in encoded.items()}
    if isinstance(encoded, list):
        return [as_json(value) for value in encoded]
    return encoded


def _attempt(fn):
    """``fn()`` encoded, or ``{"raises": class name, "msg": text}``."""
    try:
        return as_json(encode(fn()))
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": str(e)}


def run_case(X, case):
    """The encoded result of ``case`` over the adapter ``X``: its value, or ``{"raises": class name, "msg": text}``
    (a variable case: each step's)."""
    s = X.strategy(case["n"])
    if case["kind"] == "variable":
        return _variable_case(X, s, case)
    return _attempt(lambda: _RUNNERS[case["kind"]](X, s, case))
