"""Randomised cases of the distributed values' and variables' Python surface, drawn from a seed and written once
over an adapter ``X``, so that TensorFlow (tests/data/record_tf_values_surface.py records them) and mirrored
(tests/test_values_surface.py replays them) run the same code. This module imports neither TensorFlow nor
mirrored.

A case is plain data: the strategy (``mirrored1`` .. ``mirrored3``: MirroredStrategy over the first n logical
CPUs; ``one_device``; ``central_storage`` over two; ``none``: the default strategy), the holder (a variable of a
synchronization and aggregation, a PerReplica, a Mirrored), the context (cross-replica, or inside ``run``) and one
operation of the surface: Python operators, conversions, indexing, iteration, in-place operators, hashing,
properties, read and update methods, the scatter methods, ``ref``, ``repr`` / ``str``. :func:`run_case` returns
its encoded result, or the raised exception; in replica context one result per replica.

The adapter offers what tests/tf_semantics_scenarios.py's does, and ``X.make_strategy(kind)``,
``X.IndexedSlices``.
"""

import random

import numpy as np

from tf_semantics_scenarios import encode
from tf_differential_cases import as_json

SEED = 32
STRATEGIES = ("mirrored1", "mirrored2", "mirrored3", "one_device", "central_storage", "none")
DTYPES = ("float32", "float64", "int32", "int64")
SHAPES = ((), (3,), (2, 3))
HOLDERS = ("variable", "variable", "variable", "per_replica", "mirrored")
SYNCS = ("AUTO", "ON_WRITE", "ON_READ")
AGGREGATIONS = ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA")
NAMES = ("none", "plain", "scoped", "duplicate")
CASES = 420

BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lt", "le", "gt", "ge", "eq", "ne")
UNARY = ("neg", "abs", "pos")
CONVERSIONS = ("asarray", "numpy", "float", "int", "bool", "len", "iter", "getitem_0", "getitem_slice",
               "getitem_ellipsis", "getitem_newaxis")
IDENTITY = ("hash", "eq_self", "in_list", "ref", "experimental_ref")
INPLACE = ("iadd", "isub", "imul", "itruediv")
PROPERTIES = ("name", "shape", "dtype", "trainable", "device", "synchronization", "aggregation", "values",
              "constraint", "get_shape", "initial_value", "initializer")
METHODS = ("read_value", "value", "assign", "assign_add", "assign_sub", "set_shape", "count_up_to")
SCATTERS = ("scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max",
            "scatter_update", "batch_scatter_update", "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update",
            "scatter_nd_max", "scatter_nd_min")
TEXT = ("repr", "str")
# Operations of a PerReplica / Mirrored (no updates, no variable properties).
VALUE_OPS = BINARY + UNARY + CONVERSIONS + IDENTITY + ("values", "repr", "str", "numpy", "device")


def value_of(seed, dtype, shape, replica=0):
    """Small nonzero integers (halves for floats): every operator's result is exact, no division by zero."""
    rng = np.random.RandomState((seed * 7919 + replica * 104729) % 2**32)
    ints = rng.randint(1, 5, size=shape) * rng.choice((-1, 1), size=shape)
    return (ints / 2).astype(dtype) if dtype.startswith("float") else ints.astype(dtype)


# --- drawing -----------------------------------------------------------------------------------------------

def _draw(rng):
    case = {"strategy": rng.choice(STRATEGIES), "dtype": rng.choice(DTYPES),
            "shape": list(rng.choice(SHAPES)), "seed": rng.randrange(10**6)}
    holder = rng.choice(HOLDERS)
    if holder != "variable" and not case["strategy"].startswith("mirrored"):
        holder = "variable"
    case["holder"] = holder
    if holder == "variable":
        case.update(synchronization=rng.choice(SYNCS), aggregation=rng.choice(AGGREGATIONS),
                    name=rng.choice(NAMES), trainable=rng.choice((None, True, False)))
        group = rng.choice((BINARY, UNARY, CONVERSIONS, IDENTITY, INPLACE, PROPERTIES, METHODS, METHODS, SCATTERS,
                            SCATTERS, TEXT))
        case["op"] = rng.choice(group)
        case["context"] = rng.choice(("cross_replica", "cross_replica", "replica"))
    else:
        case["op"] = rng.choice(VALUE_OPS)
        case["context"] = "cross_replica"
    if case["op"] in BINARY:
        case["other"] = rng.choice(("python", "array", "reflected"))
        if case["op"] == "matmul" and case["other"] == "python":
            case["other"] = "array"  # (a number is no matrix: an error in both)
    if case["op"] in ("assign", "assign_add", "assign_sub"):
        case["read_value"] = rng.choice((True, False))
        case["use_locking"] = rng.choice((None, True))
    return case


def generate(seed=SEED):
    rng = random.Random(seed)
    return {f"case-{i:03d}": _draw(rng) for i in range(CASES)}


# --- running -----------------------------------------------------------------------------------------------

def _const(X, case, replica=0, shape=None):
    shape = case["shape"] if shape is None else shape
    return X.const(value_of(case["seed"], case["dtype"], shape, replica), case["dtype"])


def _python_scalar(case):
    return 2 if case["dtype"].startswith("int") else 1.5


def _make_variable(X, s, case):
    kwargs = {"synchronization": getattr(X.VS, case["synchronization"]),
              "aggregation": getattr(X.VA, case["aggregation"])}
    if case["trainable"] is not None:
        kwargs["trainable"] = case["trainable"]
    name = {"none": None, "plain": "w", "scoped": "w", "duplicate": "w"}[case["name"]]
    with s.scope():
        if case["name"] == "scoped":
            with X.dist_name_scope("outer"):
                return X.Variable(_const(X, case), name=name, **kwargs)
        if case["name"] == "duplicate":
            X.Variable(_const(X, case), name=name, **kwargs)
        return X.Variable(_const(X, case), name=name, **kwargs)


def _make_holder(X, s, case):
    if case["holder"] == "variable":
        return _make_variable(X, s, case)
    n = s.num_replicas_in_sync
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: _const(X, case, replica=ctx.replica_id_in_sync_group))
    if case["holder"] == "per_replica":
        return per_replica
    with s.scope():
        destination = X.Variable(_const(X, case))
    return s.extended.reduce_to("SUM", per_replica, destinations=destination) if n > 1 else \
        s.extended.broadcast_to(_const(X, case), destinations=destination)


def _index(X, case):
    """Indices and updates for the scatter methods: rows 0 and the last of a rank >= 1 value."""
    shape = case["shape"]
    rows = [0, shape[0] - 1] if shape else [0]
    updates = X.const(value_of(case["seed"] + 1, case["dtype"], [len(rows)] + shape[1:]), case["dtype"])
    return rows, updates


def _scatter(X, v, case):
    op = case["op"]
    rows, updates = _index(X, case)
    if op.startswith("scatter_nd_"):
        result = getattr(v, op)(X.const([[i] for i in rows], "int32"), updates)
    else:
        result = getattr(v, op)(X.IndexedSlices(updates, X.const(rows, "int32")))
    return {"result_is_none": result is None}


def _binary(X, v, case):
    import operator
    fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
          "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "matmul": operator.matmul,
          "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
          "ne": operator.ne}[case["op"]]
    if case["other"] == "python":
        return fn(v, _python_scalar(case))
    other_shape = case["shape"][::-1] if case["op"] == "matmul" else case["shape"]
    other = X.const(value_of(case["seed"] + 2, case["dtype"], other_shape), case["dtype"])
    return fn(other, v) if case["other"] == "reflected" else fn(v, other)


def _inplace(X, v, case):
    w = v
    delta = _python_scalar(case)
    if case["op"] == "iadd":
        w += delta
    elif case["op"] == "isub":
        w -= delta
    elif case["op"] == "imul":
        w *= delta
    else:
        w /= delta
    return {"result": w if w is not v else "the variable itself"}


def _identity(X, v, case):
    op = case["op"]
    if op == "hash":
        return hash(v) == hash(v)
    if op == "eq_self":
        return v == v
    if op == "in_list":
        return v in [v]
    ref = v.ref() if op == "ref" else v.experimental_ref()
    same = v.ref() if op == "ref" else v.experimental_ref()
    return {"deref_is": ref.deref() is v, "equal": ref == same, "hash_equal": hash(ref) == hash(same),
            "dict": {ref: 1}[same]}


def _property(X, v, case):
    op = case["op"]
    if op == "shape":
        return [None if d is None else int(d) for d in v.shape]
    if op == "get_shape":
        return [None if d is None else int(d) for d in v.get_shape()]
    if op == "dtype":
        return v.dtype.name
    if op in ("synchronization", "aggregation"):
        return getattr(v, op).name
    if op == "values":
        return [("variable" if "Variable" in type(x).__name__ else "tensor") for x in v.values]
    if op == "initial_value":
        return v.initial_value
    if op == "initializer":
        return type(v.initializer).__name__
    return getattr(v, op)


def _after(X, s, v):
    """A variable's copies after an update, each as a NumPy array (a plain variable: the one)."""
    return {"copies": [np.asarray(c.numpy()) for c in s.experimental_local_results(v)]}


def _method(X, s, v, case):
    op = case["op"]
    if op in ("read_value", "value"):
        return getattr(v, op)()
    if op == "set_shape":
        v.set_shape(case["shape"])
        return _after(X, s, v)
    if op == "count_up_to":
        return v.count_up_to(10)
    kwargs = {"read_value": case["read_value"]}
    if case["use_locking"] is not None:
        kwargs["use_locking"] = case["use_locking"]
    result = getattr(v, op)(_const(X, case, shape=case["shape"]), **kwargs)
    return {"result_is_none": result is None}


def _text(X, v, case):
    return repr(v) if case["op"] == "repr" else str(v)


def _conversion(X, v, case):
    op = case["op"]
    if op == "asarray":
        return np.asarray(v)
    if op == "numpy":
        return v.numpy()
    if op in ("float", "int", "bool", "len"):
        return {"float": float, "int": int, "bool": bool, "len": len}[op](v)
    if op == "iter":
        return list(v)
    index = {"getitem_0": 0, "getitem_slice": slice(None, 1), "getitem_ellipsis": Ellipsis,
             "getitem_newaxis": None}[op]
    return v[index]


def apply(X, s, v, case):
    """The case's operation on ``v`` (the holder, or inside ``run`` what a replica sees of it)."""
    op = case["op"]
    if op in BINARY:
        return _binary(X, v, case)
    if op in UNARY:
        return {"neg": lambda: -v, "abs": lambda: abs(v), "pos": lambda: +v}[op]()
    if op in CONVERSIONS:
        return _conversion(X, v, case)
    if op in IDENTITY:
        return _identity(X, v, case)
    if op in INPLACE:
        return _inplace(X, v, case)
    if op in PROPERTIES or op == "values":
        return _property(X, v, case)
    if op in TEXT:
        return _text(X, v, case)
    if op in SCATTERS:
        return _scatter(X, v, case)
    return _method(X, s, v, case)


def _attempt(fn):
    try:
        return as_json(encode_result(fn()))
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": str(e)}


def encode_result(x):
    """``encode``, with a variable given back by a method shown by its kind (TF gives the variable or a stand-in
    for it: the value is compared by the read that follows)."""
    if isinstance(x, dict) and "result" in x and not isinstance(x["result"], str):
        return {"result": encode(x["result"])}
    if isinstance(x, np.ndarray) and x.dtype == object:  # NumPy wrapped an object it could not convert
        return {"object_array": [type(a).__name__ for a in x.reshape(-1)]}
    if isinstance(x, dict) and "copies" in x:
        return {"copies": [encode(a) for a in x["copies"]]}
    return encode(x)


def run_case(X, case):
    """``{"made": holder's type name, "result": the operation's encoded result (in replica context: a list, one per
    replica), "after": the copies' values after it}``, or ``{"made": {"raises": ...}}``."""
    s = X.make_strategy(case["strategy"])
    made = []

    def make():
        made.append(_make_holder(X, s, case))
        return type(made[0]).__name__

    created = _attempt(make)
    if not made:
        return {"made": created}
    v = made[0]
    if case["context"] == "replica":
        results = {}

        def fn():
            ctx = X.dist.get_replica_context()
            results[int(ctx.replica_id_in_sync_group)] = _attempt(lambda: apply(X, s, v, case))
        ran = _attempt(lambda: s.run(fn))
        result = [results[r] for r in sorted(results)] if results else ran
    else:
        result = _attempt(lambda: apply(X, s, v, case))
    out = {"made": created, "result": result}
    if case["holder"] == "variable":
        out["after"] = _attempt(lambda: _after(X, s, v))
    return out
