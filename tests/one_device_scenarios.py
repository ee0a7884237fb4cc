"""Scenarios of tf.distribute.OneDeviceStrategy and tf.TensorShape, written once over a small adapter ``X`` so
that the same code runs in TensorFlow (tests/data/record_tf_one_device.py records it) and in mirrored
(tests/test_one_device_strategy.py compares). This module imports neither TensorFlow nor mirrored.

The adapter offers what tf_semantics_scenarios' does (``X.dist``, ``X.Variable``, ``X.VS``, ``X.VA``,
``X.Dataset``, ``X.const``) and: ``X.one_device(device)`` (a new OneDeviceStrategy), ``X.mirrored_one()`` (a
MirroredStrategy over '/cpu:0'), ``X.TensorShape``, ``X.optimizers`` (Keras' / md.optimizers) and
``X.checkpoint_keys(root)`` (the variables' object paths in a ``Checkpoint(**root)`` saved once).
"""

import numpy as np

from tf_semantics_scenarios import encode, kind

SCENARIOS = {}  # name -> (fn, words)


def scenario(words=(), registry=SCENARIOS):
    def register(fn):
        registry[fn.__name__] = (fn, tuple(words))
        return fn
    return register


def run_scenario(X, fn):
    try:
        return encode(fn(X))
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": str(e)}


def variable(v):
    """What users read of a variable: not its class's name (TF's ResourceVariable is md's Variable), but whether
    it is distributed, and its attributes."""
    return {"distributed": type(v).__name__ in ("MirroredVariable", "SyncOnReadVariable"),
            "has_values": hasattr(v, "values"), "name": v.name, "device": v.device,
            "dtype": getattr(v.dtype, "name", str(v.dtype)), "shape": v.shape.as_list(), "trainable": v.trainable,
            "sync": v.synchronization.name, "agg": v.aggregation.name, "value": v.numpy()}


def shape(s):
    return {"TensorShape": None if s.rank is None else s.as_list()}


# --- the strategy -----------------------------------------------------------------------------------------

@scenario()
def devices(X):
    s = X.one_device("/cpu:0")
    return [s.num_replicas_in_sync, list(s.extended.worker_devices), list(s.extended.parameter_devices),
            s.extended.should_checkpoint, s.extended.experimental_between_graph, s.cluster_resolver is None]


@scenario()
def device_spellings(X):
    given = ["/cpu:0", "cpu:0", "CPU:0", "/device:CPU:0", "cpu", "/job:localhost/replica:0/task:0/device:CPU:0",
             "/job:worker/device:CPU:0", "", None]
    return [X.one_device(d).extended.worker_devices[0] for d in given]


@scenario(words=("foo",))
def device_unknown_part(X):
    return X.one_device("/foo:0")


@scenario(words=("Multiple device types",))
def device_two_types(X):
    return X.one_device("/cpu:0/cpu:1")


@scenario()
def variables_are_plain(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        made = [X.Variable(X.const([1.0, 2.0], "float32"), name="w"),
                X.Variable(X.const(3, "int32"), aggregation=X.VA.MEAN, name="i"),
                X.Variable(X.const(1.5, "float64"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM, name="r"),
                X.Variable(X.const(0.5, "float32"), synchronization=X.VS.NONE, name="n"),
                X.Variable(X.const([[1, 2]], "int64"), synchronization=X.VS.ON_WRITE,
                           aggregation=X.VA.ONLY_FIRST_REPLICA, name="f")]
        in_scope = X.dist.get_strategy() is s
    outside = X.Variable(X.const(1.0, "float32"))
    return [variable(v) for v in made] + [
        in_scope, [s.extended.variable_created_in_scope(v) for v in made],
        s.extended.variable_created_in_scope(outside), len(s.experimental_local_results(made[0])),
        s.experimental_local_results(made[0])[0] is made[0], s.extended.value_container(made[0]) is made[0]]


@scenario()
def variable_made_in_run(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        v = s.run(lambda: X.Variable(X.const(3.0, "float32"), name="inrun"))
    return variable(v)


@scenario()
def run_in_replica_context(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))

    def step(x):
        ctx = X.dist.get_replica_context()
        v.assign_add(x)
        merged = ctx.merge_call(lambda strategy, y: strategy.reduce("SUM", y, axis=None), args=(x,))
        return (int(ctx.replica_id_in_sync_group), ctx.num_replicas_in_sync, ctx.all_reduce("SUM", x * 2),
                ctx.all_reduce("MEAN", x), merged, v.read_value(), kind(ctx.all_gather(x, 0)),
                X.dist.in_cross_replica_context())

    return s.run(step, args=(X.const([0.5, 1.0], "float32"),))


@scenario()
def run_returns_values_unwrapped(X):
    s = X.one_device("/cpu:0")
    out = s.run(lambda x, k: {"a": (x, x * 2), "k": k}, args=(X.const([1, 2], "int32"),),
                kwargs={"k": X.const(3.0, "float32")})
    return [out, kind(out["a"][0]), s.experimental_local_results(out)]


@scenario()
def reduce_rules(X):
    s = X.one_device("/cpu:0")
    per = s.run(lambda: X.const([[1, 2, 4], [3, 5, 7]], "int32"))
    return [s.reduce("SUM", per, axis=None), s.reduce("MEAN", per, axis=None), s.reduce("MEAN", per, axis=0),
            s.reduce("MEAN", per, axis=1), s.reduce("SUM", per, axis=-1), s.reduce("MEAN", X.const([1, 2, 4], "int8"), axis=0),
            s.reduce("MEAN", X.const([1, 2, 4], "int64"), axis=0),
            s.reduce("MEAN", X.const([[1.0, 2.0], [3.0, 4.0]], "float32"), axis=1),
            s.reduce(X.dist.ReduceOp.SUM, X.const(2.5, "float64"), axis=None)]


@scenario(words=("Invalid reduction dimension",))
def reduce_bad_axis(X):
    s = X.one_device("/cpu:0")
    return s.reduce("SUM", X.const([1.0, 2.0], "float32"), axis=1)


@scenario()
def gather_and_local_results(X):
    s = X.one_device("/cpu:0")
    x = s.run(lambda: X.const([[1, 2], [3, 4]], "int32"))
    return [s.gather(x, 0), s.gather(x, 1), s.experimental_local_results(x), s.experimental_local_results(5)]


@scenario()
def distribute_dataset_keeps_batches_whole(X):
    s = X.one_device("/cpu:0")
    batches = list(s.experimental_distribute_dataset(X.Dataset.range(10).batch(4)))
    return [batches, [kind(b) for b in batches]]


@scenario()
def datasets_from_function(X):
    s = X.one_device("/cpu:0")
    seen = []

    def dataset_fn(ctx):
        seen.append([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync,
                     ctx.get_per_replica_batch_size(8)])
        return X.Dataset.range(5).batch(2)

    batches = list(s.distribute_datasets_from_function(dataset_fn))
    return [seen, batches]


@scenario()
def values_from_function(X):
    s = X.one_device("/cpu:0")
    value = s.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, X.const([7, 8], "int32")))
    return [value, kind(value[2])]


@scenario()
def extended_methods(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    ext = s.extended
    grouped = ext.update(v, lambda var, d: var.assign_add(d), args=(X.const([1.0, 1.0], "float32"),))
    ungrouped = ext.update(v, lambda var, d: var.assign_sub(d), args=(X.const([0.5, 0.5], "float32"),),
                           group=False)
    return [grouped.numpy(), [u.numpy() for u in ungrouped], v.numpy(),
            ext.reduce_to("SUM", X.const(3.0, "float32"), v), ext.batch_reduce_to("MEAN", [(X.const(4, "int32"), v)]),
            ext.broadcast_to(X.const([1, 2], "int32"), v), ext.read_var(v),
            ext.update_non_slot(v, lambda: X.const(1.5, "float32")), list(ext.non_slot_devices([v]))]


@scenario(words=("Mixing different",))
def another_strategys_scope_inside(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        with s.scope():
            pass
        with X.mirrored_one().scope():
            return "entered"


@scenario(words=("cross-replica context",))
def scope_inside_run(X):
    s = X.one_device("/cpu:0")

    def step():
        with s.scope():
            return 1

    return s.run(step)


@scenario()
def checkpoint_keys(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        w = X.Variable(X.const([1.0, 2.0], "float32"))
        r = X.Variable(X.const(0.0, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    return X.checkpoint_keys({"w": w, "r": r})


def _train(X, s, make_optimizer, steps=3):
    """A few steps of a quadratic's descent, each gradient computed by hand in the replica (no tape)."""
    with s.scope():
        w = X.Variable(X.const([1.0, -2.0, 0.5], "float32"), name="w")
        b = X.Variable(X.const(0.25, "float32"), name="b")
        opt = make_optimizer()

    def step():
        gw = w.read_value() * X.const([2.0, 1.0, 4.0], "float32") + 0.5
        gb = b.read_value() * 3.0 - 1.0
        opt.apply_gradients([(gw, w), (gb, b)])

    for _ in range(steps):
        s.run(step)
    return [w.numpy(), b.numpy()]


@scenario()
def sgd_momentum_steps(X):
    return _train(X, X.one_device("/cpu:0"), lambda: X.optimizers.SGD(0.1, momentum=0.9))


@scenario()
def adam_steps(X):
    return _train(X, X.one_device("/cpu:0"), lambda: X.optimizers.Adam(0.05))


@scenario()
def variable_shapes(X):
    s = X.one_device("/cpu:0")
    with s.scope():
        v = X.Variable(X.const(np.zeros((2, 3)), "float32"))
    m = X.mirrored_one()
    with m.scope():
        mv = X.Variable(X.const(np.zeros(4), "float32"))
    plain = X.Variable(X.const(1.0, "float32"))
    return [[x.shape.as_list(), x.shape.rank, x.shape.ndims, x.get_shape().num_elements(),
             x.shape.is_fully_defined(), shape(x.get_shape()), str(x.shape), repr(x.shape), x.shape == tuple(x.shape)]
            for x in (v, mv, plain)]


# --- tf.TensorShape -------------------------------------------------------------------------------------------

SHAPES = [[], [3], [2, 3], [2, None], [None], [0, 4], [1, 2, 3], None]
OTHERS = [[], [3], [2, 3], [2, 4], [None, 3], [2, None], [None], None]


def _shape_case(fn):
    try:
        r = fn()
        return shape(r) if type(r).__name__ == "TensorShape" else r
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": str(e)}


def tensor_shape_cases(X):
    """Every TensorShape method on every shape of SHAPES (and every pair with OTHERS): name -> TF's answer."""
    S = X.TensorShape
    cases = {}
    for d in SHAPES:
        s = S(d)
        one = {"as_list": lambda: s.as_list(), "rank": lambda: s.rank, "ndims": lambda: s.ndims,
               "num_elements": lambda: s.num_elements(), "is_fully_defined": lambda: s.is_fully_defined(),
               "str": lambda: str(s), "repr": lambda: repr(s), "len": lambda: len(s), "bool": lambda: bool(s),
               "getitem 0": lambda: s[0], "getitem -1": lambda: s[-1], "getitem 1:": lambda: s[1:],
               "eq tuple": lambda: d is not None and s == tuple(d), "eq list": lambda: d is not None and s == list(d),
               "hash": lambda: d is not None and hash(s) == hash(tuple(d)),
               "dims": lambda: None if s.dims is None else len(s.dims)}
        for name, fn in one.items():
            cases[f"{name} {d}"] = _shape_case(fn)
        for o in OTHERS:
            t = S(o)
            two = {"is_compatible_with": lambda: s.is_compatible_with(t),
                   "is_compatible_with list": lambda: s.is_compatible_with(o),
                   "merge_with": lambda: s.merge_with(t), "concatenate": lambda: s.concatenate(t),
                   "assert_is_compatible_with": lambda: s.assert_is_compatible_with(t),
                   "eq": lambda: s == t, "ne": lambda: s != t}
            for name, fn in two.items():
                cases[f"{name} {d} {o}"] = _shape_case(fn)
    cases["concatenate a list"] = _shape_case(lambda: S([2]).concatenate([3, None]))
    cases["from an int"] = _shape_case(lambda: S(3))
    cases["index past the end"] = _shape_case(lambda: S([2])[3])
    return cases
