"""Scenarios of tf.distribute's semantics, written once over a small adapter ``X`` so that the same code runs
in TensorFlow (tests/data/record_tf_semantics.py records it) and in mirrored (tests/test_tf_semantics_parity.py
compares). This module imports neither TensorFlow nor mirrored.

The adapter offers: ``X.strategy(n)`` (MirroredStrategy over n CPU replicas, cached), ``X.new_strategy(n)``,
``X.dist`` (``tf.distribute`` / ``md.distribute``), ``X.const(value, dtype)``, ``X.Variable``, ``X.VS`` /
``X.VA`` (VariableSynchronization / VariableAggregation), ``X.Dataset`` (``tf.data.Dataset`` / ``md.data.Dataset``),
``X.dist_name_scope`` (``tf.name_scope`` / ``md.name_scope``), ``X.Optional`` (``tf.experimental.Optional`` /
``md.data.experimental.Optional``) and ``X.logical_cpus(count)`` (a context with that
many logical CPU devices).

Each scenario ``fn(X, n)`` returns a value; :func:`encode` turns it into plain data (types, dtypes, shapes,
values); an exception becomes ``{"raises": type name, "msg": text}``. ``words`` are the key words both
libraries' messages must contain.
"""

import collections

import numpy as np

SCENARIOS = {}  # name -> (fn, replica counts, words)
ALL = (1, 2, 4)
MULTI = (2, 4)


def scenario(ns=ALL, words=()):
    def register(fn):
        SCENARIOS[fn.__name__] = (fn, tuple(ns), tuple(words))
        return fn
    return register


Pair = collections.namedtuple("Pair", ["a", "b"])

_DISTRIBUTED = {"PerReplica", "Mirrored"}
_VARIABLES = {"MirroredVariable", "SyncOnReadVariable"}


def _dtype_name(d):
    return getattr(d, "name", None) or str(d)


def _array(x):
    a = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "v": a.tolist()}


def encode(x):
    """``x`` as plain data; TF's and mirrored's objects of the same meaning encode alike."""
    kind = type(x).__name__
    if x is None or isinstance(x, (bool, int, float, str)) and not isinstance(x, np.generic):
        return {"py": kind, "v": x}
    if kind in _DISTRIBUTED:
        return {"type": kind, "values": [encode(v) for v in x.values]}
    if kind in _VARIABLES:
        return {"type": kind, "values": [_array(v) for v in x.values]}
    if kind == "PerReplicaSpec":
        specs = x._value_specs if hasattr(x, "_value_specs") else x._specs
        return {"type": kind, "values": [encode(v) for v in specs]}
    if kind == "TensorSpec":
        return {"spec": [None if d is None else int(d) for d in x.shape], "dtype": _dtype_name(x.dtype)}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"namedtuple": kind, "v": [encode(v) for v in x]}
    if isinstance(x, (tuple, list)):
        return {kind: [encode(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[k, encode(v)] for k, v in x.items()]}
    if hasattr(x, "dtype") and (hasattr(x, "numpy") or isinstance(x, (np.ndarray, np.generic))):
        return _array(x)
    return {"other": kind}


def run_scenario(X, fn, n):
    try:
        return encode(fn(X, n))
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": str(e)}


def kind(x):
    """A value's kind: "tensor" for TF's tensors and NumPy's arrays alike, else its type's name."""
    if hasattr(x, "dtype") and hasattr(x, "shape") and type(x).__name__ not in _DISTRIBUTED | _VARIABLES:
        return "tensor"
    return type(x).__name__


def rid(X):
    return int(X.dist.get_replica_context().replica_id_in_sync_group)


def per_replica(X, s, make):
    """A PerReplica whose replica r holds ``make(r)``."""
    return s.experimental_distribute_values_from_function(lambda ctx: make(ctx.replica_id_in_sync_group))


def var_info(v):
    return {"type": type(v).__name__, "name": v.name, "dtype": _dtype_name(v.dtype), "shape": list(v.shape),
            "trainable": v.trainable, "sync": v.synchronization.name, "agg": v.aggregation.name,
            "value": v.numpy()}


# --- strategy.run return structures -------------------------------------------------------------------

@scenario()
def run_python_float(X, n):
    return X.strategy(n).run(lambda: 1.0)


@scenario()
def run_python_tuple_with_none(X, n):
    return X.strategy(n).run(lambda: (1, None, "s"))


@scenario()
def run_returns_none(X, n):
    return X.strategy(n).run(lambda: None)


@scenario()
def run_replica_id(X, n):
    return X.strategy(n).run(lambda: X.dist.get_replica_context().replica_id_in_sync_group)


@scenario()
def run_replica_num_in_sync(X, n):
    return X.strategy(n).run(lambda: X.dist.get_replica_context().num_replicas_in_sync)


@scenario()
def run_per_replica_array(X, n):
    return X.strategy(n).run(lambda: X.const([1.0, 2.0], "float32") * float(rid(X) + 1))


@scenario()
def run_identical_array(X, n):
    return X.strategy(n).run(lambda: X.const([1.0, 2.0], "float32"))


@scenario()
def run_python_int_depends_on_replica(X, n):
    return X.strategy(n).run(lambda: rid(X) * 10)


@scenario()
def run_tuple(X, n):
    return X.strategy(n).run(lambda: (X.const(rid(X), "int32"), X.const([1.5], "float64")))


@scenario()
def run_list(X, n):
    return X.strategy(n).run(lambda: [X.const(rid(X), "int64"), X.const(2, "int64")])


@scenario()
def run_dict(X, n):
    return X.strategy(n).run(lambda: {"z": X.const(rid(X), "float32"), "a": [X.const(1, "int32")]})


@scenario()
def run_namedtuple(X, n):
    return X.strategy(n).run(lambda: Pair(X.const(rid(X), "float32"), X.const(0.5, "float16")))


@scenario()
def run_nested(X, n):
    return X.strategy(n).run(lambda: {"k": (X.const([rid(X)], "int32"), {"x": Pair(X.const(1.0, "float32"),
                                                                                  None)})})


@scenario()
def run_args_per_replica(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r, r + 1], "float32"))
    return s.run(lambda a, b: a * b, args=(x,), kwargs={"b": X.const(2.0, "float32")})


@scenario()
def run_args_plain_array(X, n):
    return X.strategy(n).run(lambda a: a + 1, args=(X.const([1, 2], "int32"),))


@scenario()
def run_args_nested_per_replica(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(r, "int32"))
    return s.run(lambda d: (d["p"] + 1, d["q"]), args=({"p": x, "q": X.const(7, "int32")},))


@scenario()
def run_returns_mirrored_variable(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return type(s.run(lambda: v)).__name__


@scenario()
def run_reads_variable_value(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return s.run(lambda: v * 2.0)


@scenario()
def run_variable_created_outside_scope(X, n):
    v = X.Variable(X.const(3.0, "float32"))
    return X.strategy(n).run(lambda: v + float(rid(X)))


@scenario()
def run_exception_propagates(X, n):
    def fn():
        if rid(X) == n - 1:
            raise KeyError("boom in replica")
        return 1
    return X.strategy(n).run(fn)


# --- local results, devices, counts -------------------------------------------------------------------

@scenario()
def local_results_per_replica(X, n):
    s = X.strategy(n)
    return s.experimental_local_results(per_replica(X, s, lambda r: X.const(r, "float32")))


@scenario()
def local_results_plain_array(X, n):
    return X.strategy(n).experimental_local_results(X.const([1, 2], "int32"))


@scenario()
def local_results_python_int(X, n):
    return X.strategy(n).experimental_local_results(5)


@scenario()
def local_results_nested(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(r, "float32"))
    return s.experimental_local_results((x, {"a": x}))


@scenario()
def local_results_mirrored_variable(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0], "float32"))
    return [type(c).__name__ != "NoneType" and c.numpy().tolist() for c in s.experimental_local_results(v)]


@scenario()
def num_replicas_in_sync(X, n):
    return X.strategy(n).num_replicas_in_sync


@scenario()
def worker_devices(X, n):
    s = X.strategy(n)
    return {"worker": tuple(s.extended.worker_devices), "parameter": tuple(s.extended.parameter_devices)}


@scenario()
def replica_context_devices(X, n):
    return X.strategy(n).run(lambda: len(X.dist.get_replica_context().devices))


# --- strategy.reduce ------------------------------------------------------------------------------------

def _reduce(X, n, op, dtype, axis, shape=(2, 3)):
    s = X.strategy(n)
    size = int(np.prod(shape))
    x = per_replica(X, s, lambda r: X.const((np.arange(size).reshape(shape) + r * 3).astype(dtype), dtype))
    return s.reduce(op, x, axis=axis)


for _op in ("SUM", "MEAN"):
    for _dtype in ("float32", "float64", "float16", "int32", "int64"):
        for _axis in (None, 0, 1, -1):
            def _fn(X, n, op=_op, dtype=_dtype, axis=_axis):
                return _reduce(X, n, getattr(X.dist.ReduceOp, op), dtype, axis)
            _fn.__name__ = f"reduce_{_op.lower()}_{_dtype}_axis_{_axis}"
            scenario()(_fn)


@scenario()
def reduce_mean_int_rounds(X, n):
    s = X.strategy(n)
    return s.reduce("MEAN", per_replica(X, s, lambda r: X.const([r, 2 * r + 1, 7], "int32")), axis=None)


@scenario()
def reduce_mean_int_axis0_rounds(X, n):
    s = X.strategy(n)
    return s.reduce("MEAN", per_replica(X, s, lambda r: X.const([r, 2 * r + 1, 4], "int32")), axis=0)


@scenario()
def reduce_rank0_axis_none(X, n):
    s = X.strategy(n)
    return s.reduce("SUM", per_replica(X, s, lambda r: X.const(r + 0.5, "float32")), axis=None)


@scenario(words=("dimension",))
def reduce_rank0_axis0(X, n):
    s = X.strategy(n)
    return s.reduce("SUM", per_replica(X, s, lambda r: X.const(r + 0.5, "float32")), axis=0)


@scenario()
def reduce_axis_out_of_range(X, n):
    s = X.strategy(n)
    return type(run_error(lambda: s.reduce("SUM", per_replica(X, s, lambda r: X.const([1.0], "float32")),
                                           axis=2))).__name__ != "NoneType"


def run_error(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return e
    return None


@scenario()
def reduce_string_ops(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r + 1.0], "float32"))
    return [s.reduce(op, x, axis=None) for op in ("SUM", "MEAN", X.dist.ReduceOp.SUM)]


@scenario(words=("sum",))
def reduce_lowercase_string(X, n):
    s = X.strategy(n)
    return s.reduce("sum", per_replica(X, s, lambda r: X.const([r + 1.0], "float32")), axis=None)


@scenario()
def reduce_bad_string(X, n):
    s = X.strategy(n)
    return type(run_error(lambda: s.reduce("avg", per_replica(X, s, lambda r: X.const([1.0], "float32")),
                                           axis=None))).__name__


@scenario()
def reduce_plain_value_mean(X, n):
    return X.strategy(n).reduce("MEAN", X.const([1.0, 3.0], "float32"), axis=None)


@scenario()
def reduce_plain_value_mean_axis0(X, n):
    return X.strategy(n).reduce("MEAN", X.const([1.0, 3.0], "float32"), axis=0)


@scenario(words=("non-DistributedValues", "cannot be reduced"))
def reduce_plain_value_sum(X, n):
    return X.strategy(n).reduce("SUM", X.const([1.0, 3.0], "float32"), axis=None)


@scenario()
def reduce_plain_python_float_mean(X, n):
    return X.strategy(n).reduce("MEAN", 2.5, axis=None)


@scenario()
def reduce_empty_sum(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(np.zeros((0, 2), np.float32), "float32"))
    return [s.reduce("SUM", x, axis=None), s.reduce("SUM", x, axis=0)]


@scenario()
def reduce_empty_mean_axis0(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(np.zeros((0, 2), np.float32), "float32"))
    return s.reduce("MEAN", x, axis=0)


@scenario()
def reduce_uneven_mean_axis0(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(np.arange(r + 1, dtype=np.float32), "float32"))
    return s.reduce("MEAN", x, axis=0)


@scenario()
def reduce_nested(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r + 1.0], "float32"))
    return s.reduce("SUM", (x, {"a": x}), axis=None)


@scenario()
def reduce_mirrored_variable_sum(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return s.reduce("SUM", v, axis=None)


@scenario()
def reduce_mirrored_variable_mean(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return s.reduce("MEAN", v, axis=None)


@scenario()
def reduce_on_read_variable(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    return [s.reduce("SUM", v, axis=None), s.reduce("MEAN", v, axis=None)]


@scenario()
def reduce_run_result(X, n):
    s = X.strategy(n)
    out = s.run(lambda: X.const([[1.0, 2.0]], "float32") * float(rid(X) + 1))
    return [s.reduce("SUM", out, axis=0), s.reduce("MEAN", out, axis=1)]


@scenario()
def reduce_bool(X, n):
    s = X.strategy(n)
    return s.reduce("SUM", per_replica(X, s, lambda r: X.const([True], "bool")), axis=None)


# --- replica context collectives -----------------------------------------------------------------------

def _in_replicas(X, n, fn):
    return X.strategy(n).run(fn)


for _op in ("SUM", "MEAN"):
    for _dtype in ("float32", "int32", "float64"):
        def _fn(X, n, op=_op, dtype=_dtype):
            return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce(
                op, X.const([rid(X) + 1, 2 * rid(X)], dtype)))
        _fn.__name__ = f"all_reduce_{_op.lower()}_{_dtype}"
        scenario()(_fn)


@scenario()
def all_reduce_nested(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce(
        X.dist.ReduceOp.SUM, {"a": X.const(rid(X), "float32"), "b": (X.const([1.0, 2.0], "float64"),)}))


@scenario()
def all_reduce_python_float(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce("SUM", 1.5))


@scenario()
def all_reduce_bad_op(X, n):
    return _in_replicas(X, n, lambda: type(run_error(lambda: X.dist.get_replica_context().all_reduce(
        "avg", X.const(1.0, "float32")))).__name__)


@scenario()
def all_reduce_variable(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return s.run(lambda: X.dist.get_replica_context().all_reduce("SUM", v))


@scenario()
def all_gather_axis0_uneven(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_gather(
        X.const(np.full((rid(X) + 1, 2), rid(X)), "int32"), axis=0))


@scenario()
def all_gather_axis1(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_gather(
        X.const(np.full((2, 1), rid(X)), "float32"), axis=1))


@scenario()
def all_gather_nested(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_gather(
        (X.const([rid(X)], "int64"), {"a": X.const([[1.0]], "float32")}), axis=0))


@scenario(ns=MULTI)
def all_gather_rank0(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_gather(X.const(1.0, "float32"), axis=0))


@scenario()
def merge_call_sees_per_replica(X, n):
    def merge_fn(strategy, value):
        return (kind(value), strategy.experimental_local_results(value))

    return _in_replicas(X, n, lambda: X.dist.get_replica_context().merge_call(
        merge_fn, args=(X.const(rid(X), "int32"),)))


@scenario()
def merge_call_returns_per_replica(X, n):
    def merge_fn(strategy, value):
        return value

    return _in_replicas(X, n, lambda: X.dist.get_replica_context().merge_call(
        merge_fn, args=(X.const(rid(X) * 2, "int32"),)))


@scenario()
def merge_call_identical_arg_and_kwargs(X, n):
    def merge_fn(strategy, value, scale=None):
        return (kind(value), kind(scale), X.dist.in_cross_replica_context())

    return _in_replicas(X, n, lambda: X.dist.get_replica_context().merge_call(
        merge_fn, args=(3,), kwargs={"scale": X.const(rid(X), "float32")}))


@scenario()
def merge_call_reduce_to(X, n):
    def merge_fn(strategy, value):
        return strategy.extended.reduce_to("SUM", value, destinations=value)

    return _in_replicas(X, n, lambda: X.dist.get_replica_context().merge_call(
        merge_fn, args=(X.const([rid(X) + 1.0], "float32"),)))


# --- extended -------------------------------------------------------------------------------------------

@scenario()
def reduce_to_variable_destination(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([0.0, 0.0], "float32"))
    x = per_replica(X, s, lambda r: X.const([r, 1.0], "float32"))
    return [s.extended.reduce_to("SUM", x, v), s.extended.reduce_to("MEAN", x, v)]


@scenario()
def reduce_to_device_string(X, n):
    s = X.strategy(n)
    return s.extended.reduce_to("SUM", per_replica(X, s, lambda r: X.const([r, 1.0], "float32")), "/cpu:0")


@scenario()
def reduce_to_per_replica_destination(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r, 1.0], "float32"))
    return s.extended.reduce_to("MEAN", x, x)


@scenario()
def batch_reduce_to(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r, 1.0], "float32"))
    y = per_replica(X, s, lambda r: X.const(r * 2, "float64"))
    return s.extended.batch_reduce_to("SUM", [(x, x), (y, y)])


@scenario()
def broadcast_to_variable(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([0.0, 0.0], "float32"))
    return s.extended.broadcast_to(X.const([3.0, 4.0], "float32"), v)


@scenario()
def gather_axis0_uneven(X, n):
    s = X.strategy(n)
    return s.gather(per_replica(X, s, lambda r: X.const(np.full((r + 1, 2), r), "int32")), axis=0)


@scenario()
def gather_axis1(X, n):
    s = X.strategy(n)
    return s.gather(per_replica(X, s, lambda r: X.const(np.full((2, r + 1), r), "float32")), axis=1)


@scenario()
def gather_plain_value(X, n):
    return X.strategy(n).gather(X.const([[1, 2]], "int32"), axis=0)


@scenario()
def gather_nested(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r], "int32"))
    return s.gather((x, {"a": x}), axis=0)


@scenario(ns=MULTI, words=("concatenate scalars",))
def gather_rank0(X, n):
    s = X.strategy(n)
    return s.gather(per_replica(X, s, lambda r: X.const(r, "int32")), axis=0)


# --- variables ----------------------------------------------------------------------------------------

_SYNCS = ("AUTO", "ON_WRITE", "ON_READ", "NONE")
_AGGS = ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA")

for _sync in _SYNCS:
    for _agg in _AGGS:
        def _fn(X, n, sync=_sync, agg=_agg):
            with X.strategy(n).scope():
                v = X.Variable(X.const([1.0, 2.0], "float32"), synchronization=getattr(X.VS, sync),
                               aggregation=getattr(X.VA, agg))
            info = var_info(v)
            info["type"] = info["type"] if n > 1 or info["type"] in _VARIABLES else "single"
            return info
        _fn.__name__ = f"variable_{_sync.lower()}_{_agg.lower()}"
        scenario(words={"NONE": ("synchronization mode is not supported",)}.get(
            _sync, ("Could not convert",) if (_sync, _agg) == ("ON_READ", "NONE") else ()))(_fn)


@scenario(words=("MEAN",))
def variable_int_mean(X, n):
    with X.strategy(n).scope():
        return var_info(X.Variable(X.const(1, "int32"), aggregation=X.VA.MEAN))


@scenario()
def variable_int_sum_on_read(X, n):
    with X.strategy(n).scope():
        return var_info(X.Variable(X.const(1, "int64"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM))


@scenario()
def variable_names(X, n):
    with X.strategy(n).scope():
        a = X.Variable(X.const(1.0, "float32"), name="v")
        b = X.Variable(X.const(1.0, "float32"), name="v")
        c = X.Variable(X.const(1.0, "float32"))
    return [a.name, b.name, c.name]


@scenario()
def variable_names_outside_scope(X, n):
    return [X.Variable(X.const(1.0, "float32"), name="w").name, X.Variable(X.const(1.0, "float32")).name]


def _replica_update(X, n, agg, method, sync="ON_WRITE", dtype="float32"):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([10.0, 20.0], dtype), synchronization=getattr(X.VS, sync),
                       aggregation=getattr(X.VA, agg))
    s.run(lambda: getattr(v, method)(X.const([rid(X) + 1.0, 2.0], dtype)))
    return {"read": v.read_value(), "values": [c.numpy() for c in s.experimental_local_results(v)]}


for _agg in _AGGS:
    for _method in ("assign", "assign_add", "assign_sub"):
        def _fn(X, n, agg=_agg, method=_method):
            return _replica_update(X, n, agg, method)
        _fn.__name__ = f"replica_{_method}_{_agg.lower()}"
        scenario()(_fn)
        if _agg != "NONE":
            def _fn(X, n, agg=_agg, method=_method):
                return _replica_update(X, n, agg, method, sync="ON_READ")
            _fn.__name__ = f"replica_{_method}_on_read_{_agg.lower()}"
            scenario()(_fn)


@scenario()
def cross_replica_assign_on_read(X, n):
    out = {}
    for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA"):
        with X.strategy(n).scope():
            v = X.Variable(X.const([0.0, 0.0], "float32"), synchronization=X.VS.ON_READ,
                           aggregation=getattr(X.VA, agg))
        v.assign(X.const([4.0, 8.0], "float32"))
        out[agg] = {"read": v.read_value(), "values": [c.numpy() for c in v.values]}
    return out


@scenario()
def cross_replica_assign_add_mirrored(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), aggregation=X.VA.SUM)
    v.assign_add(X.const([1.0, 1.0], "float32"))
    v.assign_sub(X.const([0.5, 0.5], "float32"))
    return [c.numpy() for c in v.values]


@scenario()
def assign_return_types(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return [type(v.assign(X.const([3.0, 4.0], "float32"))).__name__,
            type(v.assign_add(X.const([1.0, 1.0], "float32"))).__name__]


@scenario()
def assign_read_value_false(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), aggregation=X.VA.SUM)
        w = X.Variable(X.const([1.0, 2.0], "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.MEAN)
    plain = X.Variable(X.const([1.0, 2.0], "float32"))
    cross = [x.assign(X.const([5.0, 6.0], "float32"), read_value=False) is None for x in (v, w, plain)]
    cross += [x.assign_sub(X.const([1.0, 1.0], "float32"), read_value=False) is None for x in (v, w, plain)]
    replica = s.run(lambda: (v.assign_add(X.const([1.0, 1.0], "float32"), read_value=False) is None,
                             w.assign_add(X.const([1.0, 1.0], "float32"), read_value=False) is None))
    return {"cross": cross, "replica": replica, "v": v.numpy(), "w": w.numpy(), "plain": plain.numpy()}


@scenario(words=("non-DistributedValues",))
def replica_assign_add_same_object_sum(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), aggregation=X.VA.SUM)
    delta = X.const([1.0, 1.0], "float32")
    s.run(lambda: v.assign_add(delta))
    return v.numpy()


@scenario()
def replica_assign_same_object_mean(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), aggregation=X.VA.MEAN)
    value = X.const([3.0, 5.0], "float32")
    s.run(lambda: v.assign(value))
    return v.numpy()


@scenario()
def variable_operators(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([[1.0, -2.0], [3.0, 4.0]], "float32"))
    m = X.const([[1.0], [2.0]], "float32")
    return [v + 1.0, 1.0 - v, -v, v * v, v @ m, v > 0.0, v / 2.0, v ** 2, abs(v), v[0], np.asarray(v)]


@scenario()
def variable_dtype_cast(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([1, 2], "int64"))
        w = X.Variable([1.0, 2.0])
        z = X.Variable(3)
    return [v.numpy(), w.numpy(), z.numpy()]


@scenario()
def variable_in_replica_reads_own_copy(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const(1.0, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    s.run(lambda: v.assign_add(X.const(float(rid(X)), "float32")))
    return s.run(lambda: v.read_value())


@scenario(ns=MULTI)
def replica_assign_none_aggregation_int(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([0, 0], "int32"))
    s.run(lambda: v.assign(X.const([rid(X), 1], "int32")))
    return [c.numpy() for c in v.values]


@scenario()
def create_variable_inside_run(X, n):
    s = X.strategy(n)

    def fn():
        return type(X.Variable(X.const(1.0, "float32"))).__name__
    return s.run(fn)


# --- datasets -----------------------------------------------------------------------------------------

def _steps(s, dist):
    return [s.experimental_local_results(batch) for batch in dist]


@scenario()
def dataset_batches(X, n):
    s = X.strategy(n)
    return _steps(s, s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(10)).batch(4)))


@scenario()
def dataset_drop_remainder(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(10, dtype=np.float32)).batch(4, drop_remainder=True)
    return _steps(s, s.experimental_distribute_dataset(ds))


@scenario()
def dataset_batch_smaller_than_replicas(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(6, dtype=np.float32).reshape(3, 2)).batch(3)
    return _steps(s, s.experimental_distribute_dataset(ds))


@scenario()
def dataset_tuple_elements(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices((np.arange(6, dtype=np.int32), np.arange(6, dtype=np.float64) / 2)).batch(6)
    return _steps(s, s.experimental_distribute_dataset(ds))


@scenario()
def dataset_dict_elements(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices({"x": np.arange(5, dtype=np.int64), "y": np.ones((5, 2), np.float32)}).batch(5)
    return _steps(s, s.experimental_distribute_dataset(ds))


@scenario()
def dataset_element_types(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(8, dtype=np.float32)).batch(4)
    return [kind(b) for b in s.experimental_distribute_dataset(ds)]


@scenario()
def dataset_element_spec(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices((np.arange(8, dtype=np.float32), np.arange(8))).batch(4)
    return s.experimental_distribute_dataset(ds).element_spec


@scenario()
def dataset_element_spec_drop_remainder(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.zeros((8, 3), np.float32)).batch(4, drop_remainder=True)
    return s.experimental_distribute_dataset(ds).element_spec


@scenario()
def dataset_element_spec_uneven_drop_remainder(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.zeros((12, 2), np.int32)).batch(6, drop_remainder=True)
    return s.experimental_distribute_dataset(ds).element_spec


@scenario()
def dataset_element_spec_dict(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices({"x": np.zeros((8, 2), np.float64), "y": np.arange(8)}).batch(8)
    return s.experimental_distribute_dataset(ds).element_spec


@scenario()
def dataset_iterator_next_and_stop(X, n):
    s = X.strategy(n)
    it = iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(4)).batch(2)))
    first, second = next(it), next(it)
    end = run_error(lambda: next(it))
    return [s.experimental_local_results(first), s.experimental_local_results(second), type(end).__name__]


@scenario()
def dataset_iterate_twice(X, n):
    s = X.strategy(n)
    dist = s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(6)).batch(3))
    return [_steps(s, dist), _steps(s, dist)]


@scenario()
def dataset_get_next_as_optional(X, n):
    s = X.strategy(n)
    it = iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(4)).batch(4)))
    first = it.get_next_as_optional()
    second = it.get_next_as_optional()
    return [bool(first.has_value()), s.experimental_local_results(first.get_value()), bool(second.has_value())]


@scenario()
def dataset_run_on_batches(X, n):
    s = X.strategy(n)
    dist = s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(10, dtype=np.float32)).batch(6))
    return [s.reduce("SUM", s.run(lambda x: x * 2.0, args=(b,)), axis=0) for b in dist]


@scenario()
def datasets_from_function_contexts(X, n):
    s = X.strategy(n)
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync,
                     ctx.get_per_replica_batch_size(8)))
        return X.Dataset.from_tensor_slices(np.arange(8)).batch(ctx.get_per_replica_batch_size(8))

    steps = _steps(s, s.distribute_datasets_from_function(dataset_fn))
    return {"contexts": seen, "steps": steps}


@scenario()
def datasets_from_function_element_spec(X, n):
    s = X.strategy(n)
    return s.distribute_datasets_from_function(
        lambda ctx: X.Dataset.from_tensor_slices(np.zeros((8, 2), np.float32)).batch(2, drop_remainder=True)
    ).element_spec


@scenario()
def datasets_from_function_element_spec_partial(X, n):
    s = X.strategy(n)
    return s.distribute_datasets_from_function(
        lambda ctx: X.Dataset.from_tensor_slices(np.zeros((8, 2), np.float32)).batch(3)).element_spec


@scenario(ns=(4,), words=("10", "4"))
def input_context_batch_not_divisible(X, n):
    return X.dist.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                               num_replicas_in_sync=n).get_per_replica_batch_size(10)


@scenario()
def input_context_defaults(X, n):
    ctx = X.dist.InputContext()
    return [ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync]


@scenario()
def values_from_function_contexts(X, n):
    s = X.strategy(n)
    return s.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))


@scenario()
def values_from_function_arrays(X, n):
    s = X.strategy(n)
    return s.experimental_distribute_values_from_function(
        lambda ctx: X.const([ctx.replica_id_in_sync_group], "float32"))


# --- contexts and errors --------------------------------------------------------------------------------

def _context_state(X):
    ctx = X.dist.get_replica_context()
    return {"strategy": type(X.dist.get_strategy()).__name__, "has": X.dist.has_strategy(),
            "cross": X.dist.in_cross_replica_context(), "replica_ctx": ctx is not None,
            "replica_id": None if ctx is None else int(ctx.replica_id_in_sync_group)}


@scenario(ns=(1,))
def context_outside_any_scope(X, n):
    return _context_state(X)


@scenario()
def context_in_scope(X, n):
    with X.strategy(n).scope():
        return _context_state(X)


@scenario()
def context_in_run(X, n):
    return X.strategy(n).run(lambda: _context_state(X))


@scenario()
def context_in_merge_call(X, n):
    return X.strategy(n).run(lambda: X.dist.get_replica_context().merge_call(lambda s: _context_state(X)))


@scenario()
def get_strategy_is_strategy(X, n):
    s = X.strategy(n)
    with s.scope():
        in_scope = X.dist.get_strategy() is s
    return [in_scope, all(s.experimental_local_results(s.run(lambda: X.dist.get_strategy() is s)))]


@scenario(ns=MULTI)
def all_reduce_in_cross_replica_context(X, n):
    with X.strategy(n).scope():
        return X.dist.get_replica_context() is None


@scenario(ns=(1,))
def default_replica_context_all_reduce(X, n):
    return X.dist.get_replica_context().all_reduce("SUM", X.const([1.0, 2.0], "float32"))


@scenario(ns=(1,))
def default_replica_context_merge_call(X, n):
    return X.dist.get_replica_context().merge_call(lambda s, x: (type(s).__name__, x), args=(X.const(2, "int32"),))


@scenario(ns=MULTI, words=("Mixing different",))
def nested_scopes_of_two_strategies(X, n):
    with X.strategy(n).scope():
        with X.new_strategy(n).scope():
            return "entered"


@scenario(ns=MULTI)
def same_scope_twice(X, n):
    s = X.strategy(n)
    with s.scope():
        with s.scope():
            return X.dist.get_strategy() is s


@scenario(ns=MULTI)
def run_inside_other_strategy_scope(X, n):
    other = X.new_strategy(n)
    with other.scope():
        return type(run_error(lambda: X.strategy(n).run(lambda: 1))).__name__


@scenario(ns=MULTI)
def nested_run(X, n):
    s = X.strategy(n)
    return s.run(lambda: type(run_error(lambda: s.run(lambda: 1))).__name__)


@scenario(ns=MULTI, words=("requires being in cross-replica context",))
def scope_inside_run(X, n):
    s = X.strategy(n)

    def fn():
        with s.scope():
            return X.dist.in_cross_replica_context()
    return s.run(fn)


# --- more variables -------------------------------------------------------------------------------------

@scenario()
def variable_devices(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const(1.0, "float32"))
    return {"device": v.device, "values": [c.device for c in v.values]}


@scenario()
def variable_shape_and_dtype_compare(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([[1.0, 2.0]], "float32"))
    return [v.shape == (1, 2), tuple(v.shape), len(v.shape), v.dtype == np.float32, np.asarray(v).dtype.name,
            type(v.numpy()).__name__]


@scenario()
def variable_callable_initial_value_and_dtype(X, n):
    with X.strategy(n).scope():
        v = X.Variable(lambda: X.const([1.0, 2.0], "float32"))
        w = X.Variable(3, dtype="float32")
    return [v.numpy(), w.numpy()]


@scenario()
def variable_assign_wrong_shape(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return type(run_error(lambda: v.assign(X.const([1.0, 2.0, 3.0], "float32")))).__name__


@scenario()
def variable_assign_python_values(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
        i = X.Variable(X.const([1, 2], "int64"))
    v.assign([3.0, 4.0])
    i.assign_add([1, 1])
    v.assign_sub(0.5)
    return [v.numpy(), i.numpy()]


@scenario()
def on_read_cross_replica_assign_add(X, n):
    out = {}
    for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA"):
        with X.strategy(n).scope():
            v = X.Variable(X.const([4.0, 8.0], "float32"), synchronization=X.VS.ON_READ,
                           aggregation=getattr(X.VA, agg))
        error = run_error(lambda: v.assign_add(X.const([1.0, 1.0], "float32")))
        out[agg] = {"error": type(error).__name__, "read": v.read_value(), "values": [c.numpy() for c in v.values]}
    return out


@scenario()
def on_read_trainable_true(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const(1.0, "float32"), trainable=True, synchronization=X.VS.ON_READ,
                       aggregation=X.VA.SUM)
    return v.trainable


@scenario()
def on_read_only_first_replica_reads(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const(0.0, "float32"), synchronization=X.VS.ON_READ,
                       aggregation=X.VA.ONLY_FIRST_REPLICA)
    s.run(lambda: v.assign(X.const(float(rid(X) + 5), "float32")))
    return [v.read_value(), v.numpy(), [c.numpy() for c in v.values]]


@scenario()
def on_read_mean_reads(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([0.0, 0.0], "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.MEAN)
    s.run(lambda: v.assign_add(X.const([float(rid(X)), 1.0], "float32")))
    return [v.read_value(), v.numpy(), s.reduce("SUM", v, axis=None)]


@scenario()
def extended_update(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    result = s.extended.update(v, lambda var, x: var.assign_add(x), args=(X.const([1.0, 1.0], "float32"),))
    return {"type": kind(result), "value": v.numpy()}


@scenario()
def extended_value_container_and_created_in_scope(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const(1.0, "float32"))
    plain = X.Variable(X.const(1.0, "float32"))
    return [s.extended.value_container(v.values[-1]) is v, s.extended.variable_created_in_scope(v),
            s.extended.variable_created_in_scope(plain)]


@scenario()
def extended_flags(X, n):
    e = X.strategy(n).extended
    return [e.should_checkpoint, e.should_save_summary, e.experimental_should_init, e.experimental_between_graph,
            X.strategy(n).cluster_resolver is None]


# --- more run / merge_call ------------------------------------------------------------------------------

@scenario()
def run_args_list(X, n):
    return X.strategy(n).run(lambda a, b: a + b, args=[X.const(1, "int32"), X.const(2, "int32")])


@scenario()
def run_returns_argument_per_replica(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(r, "int64"))
    return s.run(lambda a: a, args=(x,))


@scenario()
def run_all_replicas_raise(X, n):
    def fn():
        raise ValueError("every replica fails")
    return X.strategy(n).run(fn)


@scenario()
def merge_call_returns_tuple_of_per_replica(X, n):
    def merge_fn(strategy, a, b):
        return a, strategy.reduce("SUM", b, axis=None)

    return _in_replicas(X, n, lambda: X.dist.get_replica_context().merge_call(
        merge_fn, args=(X.const(rid(X), "float32"), X.const([1.0, rid(X)], "float32"))))


@scenario()
def merge_call_with_variable(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const(2.0, "float32"))

    def merge_fn(strategy, var):
        return type(var).__name__

    return s.run(lambda: X.dist.get_replica_context().merge_call(merge_fn, args=(v,)))


@scenario()
def all_reduce_float16(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce(
        "SUM", (X.const([0.5, rid(X)], "float16"), X.const([1.0], "float32"))))


@scenario()
def all_reduce_mean_mixed_structure(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce(
        X.dist.ReduceOp.MEAN, [X.const(rid(X) + 1, "int64"), X.const([rid(X)], "float64")]))


@scenario()
def replica_context_attributes(X, n):
    s = X.strategy(n)
    return s.run(lambda: (X.dist.get_replica_context().strategy is s,
                          X.dist.get_replica_context().num_replicas_in_sync))


@scenario()
def reduce_op_conversions(X, n):
    R = X.dist.ReduceOp
    return [R.SUM.value, R.MEAN.value, R("SUM") is R.SUM, R.from_variable_aggregation(X.VA.MEAN) is R.MEAN,
            R.from_variable_aggregation(X.VA.SUM) is R.SUM, type(run_error(lambda: R("sum"))).__name__,
            type(run_error(lambda: R.from_variable_aggregation(X.VA.NONE))).__name__]


@scenario()
def reduce_run_dict_axis0(X, n):
    s = X.strategy(n)
    out = s.run(lambda: {"loss": X.const([1.0, float(rid(X))], "float32"), "n": X.const([1, 2, 3], "int32")})
    return [s.reduce("SUM", out, axis=0), s.reduce("MEAN", out, axis=0)]


# --- more datasets --------------------------------------------------------------------------------------

@scenario()
def dataset_batch7(X, n):
    s = X.strategy(n)
    return _steps(s, s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(7)).batch(7)))


@scenario()
def dataset_repeat_take(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(3, dtype=np.float32)).repeat(2).batch(4).take(2)
    return _steps(s, s.experimental_distribute_dataset(ds))


@scenario()
def dataset_unbatched_scalars(X, n):
    s = X.strategy(n)
    return _steps(s, s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(2)).take(1)))


@scenario()
def dataset_first_element_kind(X, n):
    s = X.strategy(n)
    b = next(iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(8)).batch(8))))
    return [kind(b), [kind(c) for c in s.experimental_local_results(b)]]


@scenario()
def dataset_iterator_element_spec(X, n):
    s = X.strategy(n)
    it = iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.ones((4, 2), np.float32)).batch(4)))
    return it.element_spec


@scenario()
def dataset_fetch_to_device_false(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(4)).batch(4)
    options = X.dist.InputOptions(experimental_fetch_to_device=False)
    return _steps(s, s.experimental_distribute_dataset(ds, options=options))


@scenario()
def datasets_from_function_uneven_pipeline(X, n):
    s = X.strategy(n)
    return _steps(s, s.distribute_datasets_from_function(
        lambda ctx: X.Dataset.from_tensor_slices(np.arange(5)).batch(2)))


@scenario()
def input_context_per_replica_batch_sizes(X, n):
    ctx = X.dist.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=n)
    return [ctx.get_per_replica_batch_size(8), ctx.get_per_replica_batch_size(0)]


@scenario()
def value_context_defaults(X, n):
    ctx = X.dist.experimental.ValueContext()
    return [ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync]


@scenario()
def values_from_function_nested(X, n):
    s = X.strategy(n)
    return s.experimental_distribute_values_from_function(
        lambda ctx: {"a": X.const(ctx.replica_id_in_sync_group, "int32"), "b": (X.const([1.0], "float32"),)})


@scenario()
def values_from_function_python_values(X, n):
    s = X.strategy(n)
    return s.experimental_distribute_values_from_function(lambda ctx: [ctx.replica_id_in_sync_group * 2.5])


@scenario(ns=(1,), words=("scope",))
def experimental_set_strategy_inside_scope(X, n):
    with X.strategy(2).scope():
        X.dist.experimental_set_strategy(X.strategy(2))


@scenario(ns=(1,))
def experimental_set_strategy_twice(X, n):
    X.dist.experimental_set_strategy(X.strategy(2))
    X.dist.experimental_set_strategy(X.strategy(4))
    try:
        return [X.dist.get_strategy() is X.strategy(4), X.dist.get_strategy().num_replicas_in_sync]
    finally:
        X.dist.experimental_set_strategy(None)


@scenario(ns=(1,))
def experimental_set_strategy(X, n):
    s = X.strategy(2)
    X.dist.experimental_set_strategy(s)
    try:
        inside = [X.dist.get_strategy() is s, X.dist.has_strategy(), X.dist.in_cross_replica_context()]
    finally:
        X.dist.experimental_set_strategy(None)
    return inside + [X.dist.has_strategy()]


# --- public names (the test asserts TF's are a subset of mirrored's) --------------------------------------

def public_names(obj):
    return sorted(name for name in dir(obj) if not name.startswith("_"))


@scenario(ns=(2,))
def api_strategy(X, n):
    return public_names(X.strategy(n))


@scenario(ns=(2,))
def api_extended(X, n):
    return public_names(X.strategy(n).extended)


@scenario(ns=(2,))
def api_per_replica(X, n):
    s = X.strategy(n)
    return public_names(per_replica(X, s, lambda r: X.const(r, "float32")))


@scenario(ns=(2,))
def api_mirrored(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const(r, "float32"))
    return public_names(s.extended.reduce_to("SUM", x, x))


@scenario(ns=(2,))
def api_mirrored_variable(X, n):
    with X.strategy(n).scope():
        return public_names(X.Variable(X.const(1.0, "float32")))


@scenario(ns=(2,))
def api_sync_on_read_variable(X, n):
    with X.strategy(n).scope():
        return public_names(X.Variable(X.const(1.0, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM))


@scenario(ns=(1,))
def api_variable(X, n):
    return public_names(X.Variable(X.const(1.0, "float32")))


@scenario(ns=(2,))
def api_replica_context(X, n):
    return X.strategy(n).run(lambda: public_names(X.dist.get_replica_context()))


@scenario(ns=(2,))
def api_distributed_dataset_and_iterator(X, n):
    s = X.strategy(n)
    dist = s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(4)).batch(4))
    it = iter(dist)
    return {"dataset": public_names(dist), "iterator": public_names(it),
            "optional": public_names(it.get_next_as_optional())}


@scenario(ns=(2,))
def api_datasets_from_function(X, n):
    s = X.strategy(n)
    return public_names(s.distribute_datasets_from_function(lambda ctx: X.Dataset.from_tensor_slices([1, 2])))


@scenario(ns=(1,))
def api_contexts(X, n):
    return {"input": public_names(X.dist.InputContext()),
            "value": public_names(X.dist.experimental.ValueContext())}


@scenario(ns=(1,))
def api_distribute_module(X, n):
    return public_names(X.dist)


@scenario(ns=(1,))
def api_distribute_experimental_module(X, n):
    return public_names(X.dist.experimental)


# --- constructing strategies, cross-device ops ----------------------------------------------------------

for _i, _devices in enumerate((["CPU:0", "CPU:1"], ["/CPU:1", "/device:CPU:0"], "/cpu:1",
                              ["/job:localhost/replica:0/task:0/device:CPU:1"])):
    def _fn(X, n, devices=_devices):
        s = X.dist.MirroredStrategy(devices)
        return [s.num_replicas_in_sync, tuple(s.extended.worker_devices)]
    _fn.__name__ = f"strategy_device_spelling_{_i}"
    scenario(ns=(1,))(_fn)


@scenario(ns=(1,))
def strategy_default_devices_without_gpu(X, n):
    with X.logical_cpus(4):
        return [[s.num_replicas_in_sync, tuple(s.extended.worker_devices)]
                for s in (X.dist.MirroredStrategy(), X.dist.MirroredStrategy([]))]


@scenario(ns=(1,))
def strategy_duplicate_devices(X, n):
    return X.dist.MirroredStrategy(["/cpu:0", "/cpu:0"]).num_replicas_in_sync


@scenario(ns=MULTI)
def run_args_not_a_sequence(X, n):
    return X.strategy(n).run(lambda *a: len(a), args=X.const([1.0, 2.0], "float32"))


@scenario()
def scope_enter_returns_strategy(X, n):
    s = X.strategy(n)
    with s.scope() as entered:
        return entered is s


def _cdo(X, name):
    return getattr(X.dist, name)()


for _name in ("ReductionToOneDevice", "HierarchicalCopyAllReduce"):
    def _fn(X, n, name=_name):
        s = X.strategy(n)
        ops = _cdo(X, name)
        x = per_replica(X, s, lambda r: X.const([r + 1.0, 2.0], "float32"))
        y = per_replica(X, s, lambda r: X.const(float(r), "float32"))
        R = X.dist.ReduceOp
        return {"reduce": ops.reduce(R.SUM, x, destinations=x),
                "batch": ops.batch_reduce(R.MEAN, [(x, x), (y, y)]),
                "broadcast": ops.broadcast(X.const([7.0], "float32"), destinations=x)}
    _fn.__name__ = f"cross_device_ops_{_name}"
    scenario()(_fn)


@scenario()
def strategy_with_reduction_to_one_device(X, n):
    s = X.dist.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=X.dist.ReductionToOneDevice())
    out = s.run(lambda: X.dist.get_replica_context().all_reduce("MEAN", X.const([rid(X) * 2.0], "float32")))
    return [out, s.reduce("SUM", out, axis=None)]


# --- names added after the public-names audit -----------------------------------------------------------

@scenario()
def variable_legacy_readers(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "float32"))
    return [tuple(v.get_shape()), v.sparse_read([2, 0]), v.gather_nd([[1, 1], [0, 0]]), bool(v.is_initialized())]


@scenario()
def on_read_variable_sparse_read(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0, 3.0], "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    return [v.sparse_read([1]), s.run(lambda: v.sparse_read([0, 2]))]


@scenario()
def distributed_dataset_cardinality(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(10))
    return [s.experimental_distribute_dataset(d.batch(4)).cardinality
            for d in (ds, ds.repeat(), ds.filter(lambda x: x > 3), ds.take(3))]


@scenario()
def distributed_iterator_next_method(X, n):
    s = X.strategy(n)
    it = iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(4)).batch(4)))
    return s.experimental_local_results(it.next())


@scenario()
def extended_read_var(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
        w = X.Variable(X.const([3.0], "float32"))
    s.run(lambda: v.assign(X.const([1.0, 1.0], "float32")))
    return [s.extended.read_var(v), s.extended.read_var(w)]


@scenario()
def extended_worker_devices_by_replica(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const(1.0, "float32"))
    return [s.extended.worker_devices_by_replica, tuple(s.extended.non_slot_devices([v]))]


@scenario()
def datasets_from_function_cardinality(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices(np.arange(10))
    return [s.distribute_datasets_from_function(lambda ctx, d=d: d.batch(2)).cardinality
            for d in (ds, ds.repeat(), ds.filter(lambda x: x > 3))]


@scenario(ns=(1,))
def plain_variable_legacy_readers(X, n):
    v = X.Variable(X.const([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "float32"))
    return [tuple(v.get_shape()), v.sparse_read([2, 0]), v.gather_nd([[1, 1], [0, 0]]), v.gather_nd([[2]]),
            bool(v.is_initialized()), v.sparse_read(X.const(1, "int32"))]


@scenario(ns=(1,))
def multi_worker_default_devices_without_gpu(X, n):
    with X.logical_cpus(4):
        s = X.dist.MultiWorkerMirroredStrategy()
        return [s.num_replicas_in_sync, tuple(s.extended.worker_devices), s.cluster_resolver.task_type]


@scenario(ns=(1,))
def option_defaults(X, n):
    i, r = X.dist.InputOptions(), X.dist.RunOptions()
    return {"input": [i.experimental_fetch_to_device, i.experimental_replication_mode.name,
                      i.experimental_place_dataset_on_device, i.experimental_per_replica_buffer_size],
            "run": [r.experimental_enable_dynamic_batch_size, r.experimental_bucketizing_dynamic_shape,
                    r.experimental_xla_options]}


@scenario(ns=(1,))
def input_options_rules(X, n):
    M = X.dist.InputReplicationMode
    return [type(run_error(lambda: X.dist.InputOptions(experimental_place_dataset_on_device=True,
                                                       experimental_fetch_to_device=True))).__name__,
            type(run_error(lambda: X.dist.InputOptions(experimental_place_dataset_on_device=True))).__name__,
            X.dist.InputOptions(experimental_replication_mode=M.PER_REPLICA).experimental_replication_mode.name]


@scenario()
def distribute_dataset_per_replica_mode_refused(X, n):
    s = X.strategy(n)
    options = X.dist.InputOptions(experimental_replication_mode=X.dist.InputReplicationMode.PER_REPLICA)
    return s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(4)).batch(2), options)


@scenario()
def datasets_from_function_per_replica_mode(X, n):
    s = X.strategy(n)
    options = X.dist.InputOptions(experimental_replication_mode=X.dist.InputReplicationMode.PER_REPLICA,
                                  experimental_fetch_to_device=False)
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return X.Dataset.from_tensor_slices(np.arange(4) + 10 * ctx.input_pipeline_id).batch(2)
    return {"steps": _steps(s, s.distribute_datasets_from_function(dataset_fn, options)), "contexts": seen}


@scenario()
def run_with_run_options(X, n):
    s = X.strategy(n)
    return s.run(lambda: rid(X) + 1, options=X.dist.RunOptions(experimental_enable_dynamic_batch_size=False))


# --- small integer dtypes (wrap-around as TF's kernels do) ---------------------------------------------------

for _dtype in ("int8", "uint8", "int16"):
    for _op in ("SUM", "MEAN"):
        for _axis in (None, 0):
            def _fn(X, n, op=_op, dtype=_dtype, axis=_axis):
                s = X.strategy(n)
                x = per_replica(X, s, lambda r: X.const([[100, 7 + r], [120, 3]], dtype))
                return s.reduce(op, x, axis=axis)
            _fn.__name__ = f"reduce_{_op.lower()}_{_dtype}_wraps_axis_{_axis}"
            scenario()(_fn)

    def _fn(X, n, dtype=_dtype):
        return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce(
            "SUM", X.const([100, rid(X), 120], dtype)))
    _fn.__name__ = f"all_reduce_sum_{_dtype}_wraps"
    scenario()(_fn)


@scenario()
def reduce_float_specials(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([np.inf if r == 0 else 1.0, np.nan, -np.inf, 1e38], "float32"))
    return [s.reduce("SUM", x, axis=None), s.reduce("MEAN", x, axis=None)]


@scenario()
def run_returns_variable_reads(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    return [s.run(lambda: v.read_value()), s.run(lambda: v.value()), s.run(lambda x: x, args=(v,)).__class__.__name__]


@scenario()
def run_passes_mirrored_through(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r + 1.0], "float32"))
    m = s.extended.reduce_to("SUM", x, x)
    return s.run(lambda a: a * 2.0, args=(m,))


@scenario()
def merge_call_returns_mirrored(X, n):
    def merge_fn(strategy, value):
        return strategy.extended.reduce_to("MEAN", value, value)

    return _in_replicas(X, n, lambda: X.dist.get_replica_context().merge_call(
        merge_fn, args=(X.const([rid(X) * 2.0], "float32"),)) + 1.0)


@scenario()
def on_read_inside_run_reads_and_values(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const(0.0, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    s.run(lambda: v.assign(X.const(float(rid(X) + 1), "float32")))
    return [s.run(lambda: v.value()), v.value(), v.numpy(), s.run(lambda: v + 1.0)]


@scenario()
def values_from_function_context_state(X, n):
    s = X.strategy(n)
    return s.experimental_distribute_values_from_function(
        lambda ctx: [X.dist.in_cross_replica_context(), X.dist.has_strategy(), X.dist.get_strategy() is s])


@scenario()
def dataset_fn_context_state(X, n):
    s = X.new_strategy(n)  # (TF's cached strategy may keep an earlier PER_REPLICA scenario's input workers)
    seen = []

    def dataset_fn(ctx):
        seen.append([X.dist.in_cross_replica_context(), X.dist.has_strategy(), X.dist.get_strategy() is s])
        return X.Dataset.from_tensor_slices(np.arange(4)).batch(2)
    s.distribute_datasets_from_function(dataset_fn)
    return seen


@scenario()
def dataset_string_elements(X, n):
    s = X.strategy(n)
    ds = X.Dataset.from_tensor_slices((np.array([b"a", b"bb", b"c", b"d"]), np.arange(4))).batch(4)
    return [[[kind(leaf), np.asarray(leaf.numpy() if hasattr(leaf, "numpy") else leaf).tolist()]
             for leaf in (c[0],)] for c in _steps(s, s.experimental_distribute_dataset(ds))[0]]


# --- names ----------------------------------------------------------------------------------------------

@scenario()
def variable_component_names(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const(1.0, "float32"), name="w")
        r = X.Variable(X.const(1.0, "float32"), name="r", synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    return [[c.name for c in v.values], [c.name for c in r.values]]


@scenario()
def variable_names_in_name_scope(X, n):
    with X.strategy(n).scope():
        with X.dist_name_scope("outer"):
            with X.dist_name_scope("inner"):
                v = X.Variable(X.const(1.0, "float32"), name="w")
            u = X.Variable(X.const(1.0, "float32"))
    return [v.name, u.name, [c.name for c in v.values]]


@scenario()
def variable_names_created_in_run(X, n):
    s = X.strategy(n)
    made = []

    def fn():
        with X.dist_name_scope("step"):
            v = X.Variable(X.const(1.0, "float32"), name="k")
        made.append(v)
        return v.name
    names = s.run(fn)
    return [names, made[0] is made[-1], [c.name for c in s.experimental_local_results(made[0])]]


@scenario(ns=(1,))
def plain_variable_device_and_name(X, n):
    v = X.Variable(X.const(1.0, "float32"), name="p")
    return [v.name, v.device, v.trainable, v.synchronization.name, v.aggregation.name]


# --- calls in the wrong context -------------------------------------------------------------------------

def _error_in_replicas(X, n, call):
    return X.strategy(n).run(lambda: type(run_error(call)).__name__)


@scenario(ns=MULTI)
def reduce_inside_run(X, n):
    s = X.strategy(n)
    return _error_in_replicas(X, n, lambda: s.reduce("SUM", X.const(1.0, "float32"), axis=None))


@scenario(ns=MULTI)
def gather_inside_run(X, n):
    s = X.strategy(n)
    return _error_in_replicas(X, n, lambda: s.gather(X.const([1.0], "float32"), axis=0))


@scenario(ns=MULTI)
def reduce_to_inside_run(X, n):
    s = X.strategy(n)
    return _error_in_replicas(X, n, lambda: s.extended.reduce_to("SUM", X.const(1.0, "float32"), "/cpu:0"))


@scenario(ns=MULTI)
def distribute_dataset_inside_run(X, n):
    s = X.strategy(n)
    return _error_in_replicas(X, n, lambda: s.experimental_distribute_dataset(
        X.Dataset.from_tensor_slices(np.arange(4)).batch(2)))


@scenario(ns=MULTI)
def run_inside_merge_fn(X, n):
    s = X.strategy(n)
    return s.run(lambda: X.dist.get_replica_context().merge_call(
        lambda st: type(run_error(lambda: st.run(lambda: 1))).__name__))


@scenario(ns=MULTI)
def update_in_replica_context(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([1.0], "float32"))
    s.run(lambda: s.extended.update(v, lambda var, x: var.assign_add(x), args=(X.const([float(rid(X))], "float32"),)))
    return [c.numpy() for c in v.values]


# --- shapes and axes ------------------------------------------------------------------------------------

for _shape, _axis in (((0,), 0), ((1,), -1), ((3, 1, 2), 1), ((3, 1, 2), -2), ((2, 0, 3), 2), ((4, 5), -1),
                      ((2, 3), None), ((1, 1, 1, 2), 3)):
    def _fn(X, n, shape=_shape, axis=_axis):
        s = X.strategy(n)
        size = int(np.prod(shape))
        x = per_replica(X, s, lambda r: X.const((np.arange(size) * (r + 1) % 7).reshape(shape), "float32"))
        out = [s.reduce("SUM", x, axis=axis), s.reduce("MEAN", x, axis=axis)]
        if size:  # (TF's collective kernels crash the process on empty tensors)
            out.append(s.run(lambda v: X.dist.get_replica_context().all_reduce("MEAN", v), args=(x,)))
        return out
    _fn.__name__ = "reduce_shape_" + "x".join(map(str, _shape)) + f"_axis_{_axis}".replace("-", "m")
    scenario()(_fn)


for _shape in ((1, 2), (3,), (2, 3, 1)):  # (TF crashes the process gathering empty tensors)
    def _fn(X, n, shape=_shape):
        s = X.strategy(n)
        x = per_replica(X, s, lambda r: X.const(np.full(shape, r), "int64"))
        out = [s.gather(x, axis=0)]
        if np.prod(shape):  # (as above)
            out.append(s.run(lambda v: X.dist.get_replica_context().all_gather(v, axis=len(shape) - 1), args=(x,)))
        return out
    _fn.__name__ = "gather_shape_" + "x".join(map(str, _shape))
    scenario()(_fn)


@scenario(ns=MULTI)
def all_gather_negative_axis(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_gather(
        X.const([[rid(X), 1]], "int32"), axis=-1))


@scenario()
def run_returns_the_same_object_everywhere(X, n):
    s = X.strategy(n)
    t = X.const([1.0, 2.0], "float32")
    out = s.run(lambda: (t, X.const(rid(X), "int32")))
    return [kind(out[0]), out[0] is t, out]


@scenario()
def reduce_variable_along_axis(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([[1.0, 2.0], [3.0, 4.0]], "float32"))
    return [s.reduce("MEAN", v, axis=0), s.reduce("SUM", v, axis=1)]


@scenario()
def collectives_with_options(X, n):
    options = X.dist.experimental.CommunicationOptions(bytes_per_pack=8)
    return _in_replicas(X, n, lambda: (
        X.dist.get_replica_context().all_reduce("SUM", [X.const([rid(X), 1.0], "float32")] * 3, options=options),
        X.dist.get_replica_context().all_gather(X.const([rid(X)], "int32"), axis=0, options=options)))


@scenario()
def reduce_per_replica_python_numbers(X, n):
    s = X.strategy(n)
    ints = s.run(lambda: rid(X) * 10 + 1)
    floats = s.run(lambda: rid(X) * 0.5)
    return [s.reduce("SUM", ints, axis=None), s.reduce("MEAN", ints, axis=None), s.reduce("SUM", floats, axis=None),
            s.reduce("MEAN", floats, axis=None)]


@scenario()
def all_reduce_python_int_per_replica(X, n):
    return _in_replicas(X, n, lambda: X.dist.get_replica_context().all_reduce("SUM", X.const(rid(X) + 1, "int64")))


@scenario()
def on_read_only_first_cross_replica_assign(X, n):
    with X.strategy(n).scope():
        v = X.Variable(X.const([0, 0], "int32"), synchronization=X.VS.ON_READ, aggregation=X.VA.ONLY_FIRST_REPLICA)
    v.assign(X.const([3, 4], "int32"))
    v.assign_add(X.const([1, 1], "int32"))
    return [v.read_value(), [c.numpy() for c in v.values]]


@scenario()
def mirrored_only_first_replica_int(X, n):
    s = X.strategy(n)
    with s.scope():
        v = X.Variable(X.const([0, 0], "int64"), aggregation=X.VA.ONLY_FIRST_REPLICA)
    s.run(lambda: v.assign_add(X.const([rid(X) + 1, 5], "int64")))
    return [c.numpy() for c in v.values]


@scenario()
def iterator_get_next_at_end(X, n):
    s = X.strategy(n)
    it = iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.arange(2)).batch(2)))
    it.get_next()
    error = run_error(it.get_next)
    return [type(error).__name__, isinstance(error, Exception), type(run_error(lambda: next(it))).__name__,
            type(run_error(it.next)).__name__]


@scenario()
def per_replica_repr_shape(X, n):
    s = X.strategy(n)
    text = repr(per_replica(X, s, lambda r: X.const(r, "int32")))
    return [line.split(":")[0] for line in text.splitlines()]


@scenario()
def optional_element_spec(X, n):
    s = X.strategy(n)
    it = iter(s.experimental_distribute_dataset(X.Dataset.from_tensor_slices(np.ones((4, 2), np.float32)).batch(4)))
    first, end = it.get_next_as_optional(), it.get_next_as_optional()
    return [first.element_spec, end.element_spec, bool(end.has_value())]


@scenario(ns=(1,))
def optional_from_value_and_empty(X, n):
    full = X.Optional.from_value((X.const([1, 2], "int32"), {"a": X.const(1.5, "float64")}))
    empty = X.Optional.empty(full.element_spec)
    return [full.element_spec, bool(full.has_value()), full.get_value(), empty.element_spec, bool(empty.has_value())]


@scenario()
def tf1_names_on_a_tf2_strategy(X, n):
    s = X.strategy(n)
    x = per_replica(X, s, lambda r: X.const([r], "int64"))
    it = s.make_dataset_iterator(X.Dataset.from_tensor_slices(np.arange(2 * n)).batch(n))
    return [s.unwrap(x), s.group(x), s.configure(), s.experimental_run(lambda b: b * 10, it),
            s.experimental_local_results(s.experimental_run(lambda: X.const(1, "int32")))]


@scenario()
def extended_update_non_slot_and_numpy_dataset(X, n):
    s = X.strategy(n)
    e = s.extended
    with s.scope():
        v = X.Variable(X.const(1.0, "float32"))
    devices = e.non_slot_devices([v])
    return [e.experimental_enable_get_next_as_optional,
            e.update_non_slot(devices, lambda x: x * 2.0, args=(X.const(3.0, "float32"),)),
            e.update_non_slot(devices, lambda x: x * 2.0, args=(X.const(3.0, "float32"),), group=False),
            e.update_non_slot(devices, lambda: X.const(5, "int32")),
            list(e.experimental_make_numpy_dataset(np.arange(3)))]
