"""Scenarios of tf.distribute.experimental.CentralStorageStrategy, written once over a small adapter ``X`` so that
the same code runs in TensorFlow (tests/data/record_tf_central_storage.py records it) and in mirrored
(tests/test_central_storage_strategy.py compares). This module imports neither TensorFlow nor mirrored.

The adapter offers what one_device_scenarios' does (``X.dist``, ``X.Variable``, ``X.VS``, ``X.VA``, ``X.Dataset``,
``X.const``, ``X.optimizers``, ``X.checkpoint_keys(root)``, ``X.mirrored_one()``) and ``X.central(compute_devices,
parameter_device)`` (a new CentralStorageStrategy; the recording runs with 4 logical CPUs).
"""

import one_device_scenarios
from one_device_scenarios import run_scenario  # noqa: F401  (the recorder's and the tests')
from tf_semantics_scenarios import kind

SCENARIOS = {}  # name -> (fn, words)


def scenario(words=()):
    return one_device_scenarios.scenario(words, SCENARIOS)


TWO = ["/cpu:0", "/cpu:1"]


def rid(X):
    return int(X.dist.get_replica_context().replica_id_in_sync_group)


def variable(v):
    """What users read of a variable: whether TF's wrapper holds it (an AggregatingVariable, not a plain
    ResourceVariable / md.Variable), and its attributes."""
    return {"aggregating": type(v).__name__ == "AggregatingVariable", "has_values": hasattr(v, "values"),
            "name": v.name, "device": v.device, "dtype": getattr(v.dtype, "name", str(v.dtype)),
            "shape": v.shape.as_list(), "trainable": v.trainable, "sync": v.synchronization.name,
            "agg": v.aggregation.name, "value": v.numpy()}


# --- devices ----------------------------------------------------------------------------------------------

@scenario()
def devices(X):
    out = []
    for compute, parameter in ((None, None), (["/cpu:0"], None), (["cpu:1"], None), (TWO, None),
                               (["/cpu:1", "CPU:2", "/device:CPU:3"], None), (TWO, "/cpu:3"),
                               (["cpu:0", "CPU:1"], "CPU:2")):
        s = X.central(compute, parameter)
        ext = s.extended
        out.append([s.num_replicas_in_sync, list(ext.worker_devices), list(ext.parameter_devices),
                    [list(d) for d in ext.worker_devices_by_replica]])
    ext = X.central(TWO).extended
    out.append([ext.should_checkpoint, ext.experimental_between_graph, ext.experimental_should_init,
                ext.should_save_summary, X.central(TWO).cluster_resolver is None])
    return out


@scenario()
def compute_devices_as_one_string(X):
    return X.central("/cpu:0")


@scenario()
def compute_devices_as_a_number(X):
    return X.central(3)


@scenario(words=("foo",))
def compute_device_unknown_part(X):
    return X.central(["/foo:0"])


@scenario()
def variables_are_placed_on_the_parameter_device(X):
    out = []
    for compute, parameter in ((TWO, None), (TWO, "/cpu:3"), (["cpu:1", "cpu:2"], "CPU:0"), (["/cpu:2"], None)):
        with X.central(compute, parameter).scope():
            out.append(variable(X.Variable(X.const([1.0], "float32"), name="p")))
    return out


# --- variables ---------------------------------------------------------------------------------------------

@scenario()
def variables_are_wrapped(X):
    s = X.central(TWO)
    with s.scope():
        made = [X.Variable(X.const([1.0, 2.0], "float32"), name="w"),
                X.Variable(X.const([1.0, 2.0], "float32"), aggregation=X.VA.MEAN, name="m"),
                X.Variable(X.const(3, "int32"), aggregation=X.VA.MEAN, name="i"),
                X.Variable(X.const(1.5, "float64"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM, name="r"),
                X.Variable(X.const(0.5, "float32"), synchronization=X.VS.NONE, name="n"),
                X.Variable(X.const([[1, 2]], "int64"), synchronization=X.VS.ON_WRITE,
                           aggregation=X.VA.ONLY_FIRST_REPLICA, name="f")]
    outside = X.Variable(X.const(1.0, "float32"))
    return [variable(v) for v in made] + [
        [s.extended.variable_created_in_scope(v) for v in made], s.extended.variable_created_in_scope(outside),
        [len(s.experimental_local_results(v)) for v in made], s.experimental_local_results(made[0])[0] is made[0],
        [s.extended.value_container(v) is v for v in made]]


@scenario()
def one_compute_device_keeps_plain_variables(X):
    s = X.central(["/cpu:0"])
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), name="w")
        i = X.Variable(X.const(3, "int32"), aggregation=X.VA.MEAN, name="i")
    return [variable(v), variable(i), s.experimental_local_results(v)[0] is v]


@scenario()
def variable_made_in_run(X):
    s = X.central(TWO)
    with s.scope():
        v = s.run(lambda: X.Variable(X.const(3.0, "float32"), name="inrun"))
    return variable(v)


@scenario()
def replicas_read_the_current_value(X):
    s = X.central(TWO)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
    first = s.run(lambda: v.read_value() * 1.0)
    v.assign(X.const([3.0, 4.0], "float32"))
    second = s.run(lambda: (v.read_value() + 0.0, v * 2.0))
    return [first, second, kind(s.experimental_local_results(first)[0]), v.numpy()]


def _assign_in_run(X, aggregation, method="assign_add", dtype="float32"):
    s = X.central(TWO)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], dtype), aggregation=aggregation, name="v")

    def step():
        delta = X.const([1.0, 1.0], "float32") * float(rid(X) + 1)
        return getattr(v, method)(X.const(delta.numpy() if hasattr(delta, "numpy") else delta, dtype))

    s.run(step)
    return v.numpy()


@scenario(words=("aggregation",))
def assign_in_run_without_aggregation(X):
    return _assign_in_run(X, X.VA.NONE)


@scenario()
def assign_in_run_with_aggregation(X):
    return [_assign_in_run(X, X.VA.MEAN), _assign_in_run(X, X.VA.SUM), _assign_in_run(X, X.VA.ONLY_FIRST_REPLICA),
            _assign_in_run(X, X.VA.MEAN, "assign"), _assign_in_run(X, X.VA.SUM, "assign_sub"),
            _assign_in_run(X, X.VA.SUM, "assign_add", "float64")]


@scenario(words=("non-DistributedValues",))
def assign_in_run_of_the_same_value_with_sum(X):
    s = X.central(TWO)
    with s.scope():
        r = X.Variable(X.const(1.0, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    s.run(lambda: r.assign_add(1.0))
    return r.numpy()


@scenario()
def assign_in_cross_replica_context(X):
    s = X.central(TWO)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"))
        v.assign(X.const([5.0, 6.0], "float32"))
        v.assign_add(X.const([1.0, 1.0], "float32"))
    v.assign_sub(X.const([0.5, 0.5], "float32"))
    first = v.numpy()
    with s.scope():
        v.assign(s.run(lambda: X.const([1.0, 1.0], "float32") * float(rid(X) + 1)))  # the first replica's value
    return [first, v.numpy(), s.run(lambda: v.sparse_read([1, 0]))]


# --- run, reduce, input --------------------------------------------------------------------------------------

@scenario()
def run_in_replica_context(X):
    s = X.central(TWO)

    def step(x):
        ctx = X.dist.get_replica_context()
        y = x * float(rid(X) + 1)
        merged = ctx.merge_call(lambda strategy, z: strategy.reduce("SUM", z, axis=None), args=(y,))
        return (rid(X), ctx.num_replicas_in_sync, ctx.all_reduce("SUM", y), ctx.all_reduce("MEAN", y), merged,
                kind(ctx.all_gather(y, 0)), X.dist.in_cross_replica_context())

    return s.run(step, args=(X.const([0.5, 1.0], "float32"),))


@scenario()
def reduce_gather_local_results(X):
    s = X.central(TWO)
    per = s.run(lambda: X.const([[1, 2, 4], [3, 5, 7]], "int32") * (rid(X) + 1))
    return [s.reduce("SUM", per, axis=None), s.reduce("MEAN", per, axis=None), s.reduce("MEAN", per, axis=0),
            s.reduce("SUM", per, axis=1), s.gather(per, 0), s.gather(per, 1), s.experimental_local_results(per),
            s.experimental_local_results(5), s.reduce("MEAN", X.const(2.5, "float64"), axis=None)]


@scenario()
def distribute_dataset_splits_batches(X):
    s = X.central(TWO)
    return [[s.experimental_local_results(b)
             for b in s.experimental_distribute_dataset(X.Dataset.range(size).batch(4))] for size in (10, 9, 5)]


@scenario()
def datasets_from_function(X):
    s = X.central(TWO)
    seen = []

    def dataset_fn(ctx):
        seen.append([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync,
                     ctx.get_per_replica_batch_size(8)])
        return X.Dataset.range(ctx.num_replicas_in_sync * 3 - len(seen) + 1).batch(2)  # 6, then 5 rows

    batches = [[s.experimental_local_results(b) for b in s.distribute_datasets_from_function(dataset_fn)]
               for _ in range(2)]
    return [seen, batches]


@scenario()
def values_from_function(X):
    s = X.central(TWO)
    return s.experimental_distribute_values_from_function(lambda ctx: (ctx.replica_id_in_sync_group,
                                                                        ctx.num_replicas_in_sync))


# --- extended ------------------------------------------------------------------------------------------------

@scenario()
def extended_methods(X):
    s = X.central(TWO)
    with s.scope():
        v = X.Variable(X.const([1.0, 2.0], "float32"), name="v")
        a = X.Variable(X.const(1.0, "float32"), name="a")
        r = X.Variable(X.const(1.5, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM, name="r")
    ext = s.extended
    per = s.run(lambda: X.const([1.0, 1.0], "float32") * float(rid(X) + 1))
    grouped = ext.update(v, lambda var, d: var.assign_add(d), args=(X.const([1.0, 1.0], "float32"),))
    ungrouped = ext.update(v, lambda var, d: var.assign_sub(d), args=(X.const([0.5, 0.5], "float32"),), group=False)
    with_per_replica = ext.update(v, lambda var, d: var.assign_add(d), args=(per,))
    outside = X.Variable(X.const(1.0, "float32"))
    ext.update(outside, lambda var: var.assign_add(X.const(1.0, "float32")))
    return [grouped.numpy(), [u.numpy() for u in ungrouped], with_per_replica.numpy(), v.numpy(), outside.numpy(),
            ext.reduce_to("SUM", per, v), ext.reduce_to("MEAN", X.const(3.0, "float32"), v),
            ext.batch_reduce_to("MEAN", [(per, v), (per, a)]), ext.read_var(v), ext.read_var(r),
            ext.broadcast_to(X.const([1, 2], "int32"), v), ext.update_non_slot(v, lambda: X.const(1.5, "float32")),
            ext.non_slot_devices([v, a]).name]


@scenario(words=("Variable",))
def update_of_a_non_variable(X):
    s = X.central(TWO)
    return s.extended.update(X.const(1.0, "float32"), lambda x: x)


@scenario(words=("non-DistributedValues",))
def reduce_to_sum_of_a_plain_value(X):
    s = X.central(TWO)
    with s.scope():
        v = X.Variable(X.const(1.0, "float32"))
    return s.extended.reduce_to("SUM", X.const(3.0, "float32"), v)


@scenario()
def colocate_vars_with(X):
    s = X.central(TWO)
    outside = X.Variable(X.const(1.0, "float32"))
    with s.scope():
        m = X.Variable(X.const(1.0, "float32"), name="m")
        with s.extended.colocate_vars_with(m):
            a = X.Variable(X.const(2.0, "float32"), name="a")
        with s.extended.colocate_vars_with(outside):
            b = X.Variable(X.const(3.0, "float32"), name="b")
    return [variable(a), variable(b)]


@scenario(words=("Mixing different",))
def another_strategys_scope_inside(X):
    s = X.central(TWO)
    with s.scope():
        with s.scope():
            pass
        with X.mirrored_one().scope():
            return "entered"


@scenario()
def checkpoint_keys(X):
    s = X.central(TWO)
    with s.scope():
        w = X.Variable(X.const([1.0, 2.0], "float32"))
        r = X.Variable(X.const(0.0, "float32"), synchronization=X.VS.ON_READ, aggregation=X.VA.SUM)
    return X.checkpoint_keys({"w": w, "r": r})


# --- training ------------------------------------------------------------------------------------------------

def _train(X, make_optimizer, compute=TWO, steps=3):
    """A few steps of a quadratic's descent, each replica's gradient computed by hand (no tape) and scaled by its
    replica id, so that the update shows the sum over replicas."""
    s = X.central(compute)
    with s.scope():
        w = X.Variable(X.const([1.0, -2.0, 0.5], "float32"), name="w")
        b = X.Variable(X.const(0.25, "float32"), name="b")
        opt = make_optimizer()

    def step():
        k = float(rid(X) + 1)
        gw = (w.read_value() * X.const([2.0, 1.0, 4.0], "float32") + 0.5) * k
        gb = (b.read_value() * 3.0 - 1.0) * k
        opt.apply_gradients([(gw, w), (gb, b)])

    for _ in range(steps):
        s.run(step)
    return [w.numpy(), b.numpy(), int(opt.iterations.numpy())]


@scenario()
def sgd_momentum_steps(X):
    return [_train(X, lambda: X.optimizers.SGD(0.1, momentum=0.9), compute)
            for compute in (["/cpu:0"], TWO, ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])]


@scenario()
def adam_steps(X):
    return [_train(X, lambda: X.optimizers.Adam(0.05), compute)
            for compute in (["/cpu:0"], TWO, ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])]


@scenario()
def gradient_accumulation_clips_the_accumulated_average(X):
    """Keras 3 clips ``(g + accumulator) / steps`` on the update step, after accumulating (base_optimizer.apply),
    with ``clipnorm`` and ``global_clipnorm``. One compute device: with several, TF's Keras fails (its
    accumulators are AggregatingVariables updated in replica context without an aggregation)."""
    return [_train(X, lambda: X.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2, **clip),
                   ["/cpu:0"], steps=5) for clip in ({"clipnorm": 1.0}, {"global_clipnorm": 1.0})]
