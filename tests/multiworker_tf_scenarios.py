"""Scenarios of a MultiWorkerMirroredStrategy job, run by every task of it, over TensorFlow (recorded by
tests/data/record_tf_multiworker.py) or mirrored (replayed by tests/test_multiworker_tf_differential.py).

``run_task(lib, directory)`` builds the task's strategy and returns {scenario: result} in plain JSON values: the
task's cluster properties, what its replicas receive from distributed datasets under every AutoShardPolicy
(global batches that do and do not divide, drop_remainder, range / from_tensor_slices / TFRecord sources),
``distribute_datasets_from_function``'s input contexts, cross-worker reductions and gathers, and variables.
``lib`` is an adapter naming the library's classes (``TFLib`` in the recorder, ``MdLib`` in the test).
"""

from __future__ import annotations

import numpy as np

POLICIES = ("AUTO", "FILE", "DATA", "OFF", "HINT")
SOURCES = ("range", "slices", "tfrecord_files", "tfrecord_list", "tfrecord_three")
BATCHES = ((4, False), (4, True), (3, False), (3, True))
RECORDS_PER_FILE = 3


def record_bytes(file: int, record: int) -> bytes:
    return b"f%d-r%d" % (file, record)


def canonical(x):
    """A value as JSON: arrays as {"dtype", "shape", "value"} (bytes decoded), structures as lists / dicts."""
    if isinstance(x, dict):
        return {str(k): canonical(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [canonical(v) for v in x]
    a = np.asarray(x)
    if a.dtype.kind in "SO":
        return {"dtype": "string", "shape": list(a.shape),
                "value": np.vectorize(lambda b: b.decode() if isinstance(b, bytes) else str(b), otypes=[object])(a)
                .tolist() if a.size else []}
    value = a.tolist()
    if a.dtype.kind == "f":  # NaN-free here; float16 and float32 rounded the same on both sides
        value = np.asarray(a, np.float64).round(5).tolist()
    return {"dtype": a.dtype.name, "shape": list(a.shape), "value": value}


def error(e: Exception) -> dict:
    return {"raises": type(e).__name__, "msg": str(e)[:300]}


def _spec(spec):
    if isinstance(spec, dict):
        return {str(k): _spec(v) for k, v in sorted(spec.items())}
    if isinstance(spec, (list, tuple)):
        return [_spec(v) for v in spec]
    if type(spec).__name__ == "PerReplicaSpec":  # one spec per local replica (TF's attribute, or ours)
        return {"PerReplicaSpec": [_spec(v) for v in getattr(spec, "_value_specs", None) or spec._specs]}
    shape = spec.shape.as_list() if hasattr(spec.shape, "as_list") else list(spec.shape)
    dtype = getattr(spec.dtype, "as_numpy_dtype", spec.dtype)  # a tf.DType, or a NumPy dtype
    dtype = "string" if getattr(spec.dtype, "name", "") == "string" or np.dtype(dtype).kind in "SO" \
        else np.dtype(dtype).name
    return {"shape": [None if d is None else int(d) for d in shape], "dtype": dtype}


def _source(lib, kind: str, directory: str):
    data = lib.data
    if kind == "range":
        return data.Dataset.range(11)
    if kind == "slices":
        return data.Dataset.from_tensor_slices({"x": np.arange(22, dtype=np.float32).reshape(11, 2),
                                                "y": np.arange(11, dtype=np.int32)})
    if kind == "tfrecord_files":
        return data.TFRecordDataset(data.Dataset.list_files(f"{directory}/four/*.tfrecord", shuffle=False))
    if kind == "tfrecord_list":
        return data.TFRecordDataset([f"{directory}/four/part{i}.tfrecord" for i in range(4)])
    return data.TFRecordDataset(data.Dataset.list_files(f"{directory}/three/*.tfrecord", shuffle=False))


def _local(strategy, value):
    return [canonical(lib_value) for lib_value in strategy.experimental_local_results(value)]


def distributed_dataset_scenarios(lib, strategy, directory) -> dict:
    out = {}
    for kind in SOURCES:
        for batch, drop in BATCHES:
            for policy in POLICIES:
                name = f"dataset/{kind}/b{batch}{'d' if drop else ''}/{policy}"
                options = lib.data.Options()
                options.experimental_distribute.auto_shard_policy = getattr(lib.data.experimental.AutoShardPolicy,
                                                                            policy)
                try:
                    ds = _source(lib, kind, directory).batch(batch, drop_remainder=drop).with_options(options)
                    dist = strategy.experimental_distribute_dataset(ds)
                    spec = _spec(dist.element_spec)
                    steps = [_local(strategy, x) for x in dist]
                    out[name] = {"spec": spec, "steps": steps}
                except Exception as e:  # the library's verdict, compared as such
                    out[name] = error(e)
    # End of data through an iterator: get_next_as_optional, then StopIteration / OutOfRange.
    it = iter(strategy.experimental_distribute_dataset(lib.data.Dataset.range(5).batch(2)))
    seen = []
    while True:
        opt = it.get_next_as_optional()
        if not bool(lib.to_numpy(opt.has_value())):
            break
        seen.append(_local(strategy, opt.get_value()))
    out["dataset/optional_end"] = seen
    return out


def from_function_scenarios(lib, strategy) -> dict:
    out = {}
    contexts = []

    def dataset_fn(ctx):
        contexts.append({"num_input_pipelines": ctx.num_input_pipelines, "input_pipeline_id": ctx.input_pipeline_id,
                         "num_replicas_in_sync": ctx.num_replicas_in_sync,
                         "per_replica_batch_12": int(ctx.get_per_replica_batch_size(12))})
        try:
            ctx.get_per_replica_batch_size(7)
            contexts.append({"per_replica_batch_7": "no error"})
        except Exception as e:
            contexts.append({"per_replica_batch_7": type(e).__name__})
        per_replica = ctx.get_per_replica_batch_size(12)
        return lib.data.Dataset.range(30).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(per_replica)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    out["from_function/steps"] = [_local(strategy, x) for x in dist]
    out["from_function/contexts"] = contexts
    out["from_function/spec"] = _spec(dist.element_spec)
    # No shard: every worker reads the whole pipeline, so each worker's replica gets the same batches.
    dist = strategy.distribute_datasets_from_function(lambda ctx: lib.data.Dataset.range(6).batch(4))
    out["from_function/unsharded"] = [_local(strategy, x) for x in dist]
    # Pipelines of different lengths: the workers agree on the end, one that ran out gets empty batches.
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: lib.data.Dataset.range(2 + 3 * ctx.input_pipeline_id).batch(2))
    out["from_function/uneven"] = [_local(strategy, x) for x in dist]
    return out


def type_scenarios(lib, strategy) -> dict:
    """The classes users meet: a distributed dataset's elements, run's results, distributed values."""
    dist = strategy.experimental_distribute_dataset(lib.data.Dataset.range(8).batch(4))
    element = next(iter(dist))
    ran = strategy.run(lambda x: x * 2, args=(element,))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: lib.constant(np.float32(1.0)))
    optional = iter(dist).get_next_as_optional().get_value()
    from_function = next(iter(strategy.distribute_datasets_from_function(lambda ctx: lib.data.Dataset.range(4)
                                                                         .batch(2))))
    return {"types": {"element": type(element).__name__, "run": lib.kind(ran),
                      "values_from_function": type(values).__name__, "optional_value": type(optional).__name__,
                      "from_function_element": type(from_function).__name__,
                      "local_results": len(strategy.experimental_local_results(element))}}


def _per_replica(lib, strategy, make):
    """A PerReplica value whose replica r (global id) holds ``make(r)``."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: lib.constant(make(ctx.replica_id_in_sync_group)))


def collective_scenarios(lib, strategy) -> dict:
    out = {}
    ReduceOp = lib.ReduceOp
    values = {
        "f32": lambda r: np.array([[1.5, -2.0, 3.0], [0.25, 8.0, -1.0]], np.float32) * (r + 1) + r,
        "f64": lambda r: np.array([1e-3, 2.5, -7.0], np.float64) * (3 * r - 1),
        "i32": lambda r: np.array([7, -3, 10, 1], np.int32) * (r + 1) + 2 * r,
        "i64": lambda r: np.array([[5, -9]], np.int64) - 4 * r,
        "f16": lambda r: np.array([0.5, 1.25], np.float16) * (r + 2),
    }
    for dname, make in values.items():
        for op in ("SUM", "MEAN"):  # TensorFlow's ReduceOp has no others
            name = f"reduce/{dname}/{op}"
            try:
                out[name] = canonical(lib.to_numpy(strategy.reduce(getattr(ReduceOp, op),
                                                                   _per_replica(lib, strategy, make), axis=None)))
            except Exception as e:
                out[name] = error(e)
    # axis: replica r holds r + 2 rows, so MEAN divides by the rows of every replica of every worker.
    rows = lambda r: np.arange((r + 2) * 3, dtype=np.float32).reshape(r + 2, 3) * (r + 1)
    rows_i = lambda r: np.arange((r + 2) * 3, dtype=np.int32).reshape(r + 2, 3) * (r + 1) + 1
    for op in ("SUM", "MEAN"):
        for label, make in (("f32", rows), ("i32", rows_i)):
            name = f"reduce_axis0/{label}/{op}"
            try:
                out[name] = canonical(lib.to_numpy(strategy.reduce(getattr(ReduceOp, op),
                                                                   _per_replica(lib, strategy, make), axis=0)))
            except Exception as e:
                out[name] = error(e)
    same_rows = lambda r: np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1)
    for op in ("SUM", "MEAN"):
        out[f"reduce_axis1/{op}"] = canonical(lib.to_numpy(strategy.reduce(
            getattr(ReduceOp, op), _per_replica(lib, strategy, same_rows), axis=1)))
    out["reduce/plain_mean"] = canonical(lib.to_numpy(strategy.reduce(ReduceOp.MEAN, lib.constant(
        np.array([1.0, 2.0], np.float32)), axis=None)))
    out["reduce/string_op"] = canonical(lib.to_numpy(strategy.reduce("sum", _per_replica(lib, strategy, values["i32"]),
                                                                     axis=None)))
    # gather along the axis where rows differ, and along another.
    out["gather/axis0"] = canonical(lib.to_numpy(strategy.gather(_per_replica(lib, strategy, rows), axis=0)))
    out["gather/axis1"] = canonical(lib.to_numpy(strategy.gather(_per_replica(lib, strategy, same_rows), axis=1)))
    out["gather/i32"] = canonical(lib.to_numpy(strategy.gather(_per_replica(lib, strategy, rows_i), axis=0)))

    def replica_fn(x, y):
        ctx = lib.get_replica_context()
        nested = {"a": x, "b": (y, x * 2)}
        return {
            "sum": ctx.all_reduce(ReduceOp.SUM, nested),
            "mean": ctx.all_reduce(ReduceOp.MEAN, nested),
            "mean_string": ctx.all_reduce("mean", y),
            "gather0": ctx.all_gather(nested, axis=0),
            "gather1": ctx.all_gather(x, axis=1),
            "id": ctx.replica_id_in_sync_group,
            "n": ctx.num_replicas_in_sync,
        }

    x = _per_replica(lib, strategy, same_rows)
    y = _per_replica(lib, strategy, values["i32"])
    result = strategy.run(replica_fn, args=(x, y))
    out["replica/all_reduce_and_gather"] = lib.map_structure(
        lambda v: [canonical(lib.to_numpy(c)) for c in strategy.experimental_local_results(v)], result)
    # batch_reduce_to and reduce_to across workers, destinations the values themselves.
    a = _per_replica(lib, strategy, same_rows)
    b = _per_replica(lib, strategy, values["i32"])
    for op in ("SUM", "MEAN"):
        reduced = strategy.extended.batch_reduce_to(getattr(ReduceOp, op), [(a, a), (b, b)])
        out[f"batch_reduce_to/{op}"] = [[canonical(lib.to_numpy(c)) for c in strategy.experimental_local_results(r)]
                                        for r in reduced]
        reduced = strategy.extended.reduce_to(getattr(ReduceOp, op), a, a)
        out[f"reduce_to/{op}"] = [canonical(lib.to_numpy(c)) for c in strategy.experimental_local_results(reduced)]
    return out


def variable_scenarios(lib, strategy, task_rank: int) -> dict:
    out = {}
    Agg, Sync = lib.VariableAggregation, lib.VariableSynchronization
    rng = np.random.RandomState(100 + task_rank)  # each task its own initial value: the chief's must win
    with strategy.scope():
        initial = rng.normal(size=3).astype(np.float32)
        v = lib.Variable(initial)
        v_callable = lib.Variable(lambda: rng.normal(size=(2,)).astype(np.float32) + task_rank)
        v_int = lib.Variable(np.arange(3, dtype=np.int32) * (task_rank + 1))
        mirrored = {agg: lib.Variable(np.zeros(2, np.float32), aggregation=getattr(Agg, agg))
                    for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA")}
        on_read = {agg: lib.Variable(np.zeros(2, np.float32), synchronization=Sync.ON_READ,
                                     aggregation=getattr(Agg, agg))
                   for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA", "NONE")}
        on_read_int = lib.Variable(np.zeros(2, np.int32), synchronization=Sync.ON_READ, aggregation=Agg.SUM)
    out["variable/broadcast_initial"] = canonical(lib.to_numpy(v.read_value()))
    out["variable/broadcast_callable"] = canonical(lib.to_numpy(v_callable.read_value()))
    out["variable/broadcast_int"] = canonical(lib.to_numpy(v_int.read_value()))
    out["variable/local_copies_equal"] = [canonical(lib.to_numpy(c)) for c in
                                          strategy.experimental_local_results(v)]

    def step(delta, delta_i):
        for var in mirrored.values():
            var.assign_add(delta)
        for var in on_read.values():
            var.assign_add(delta)
        on_read_int.assign_add(delta_i)

    delta = _per_replica(lib, strategy, lambda r: np.array([1.0, -0.5], np.float32) * (r + 1) + r)
    delta_i = _per_replica(lib, strategy, lambda r: np.array([3, -1], np.int32) * (r + 2))
    strategy.run(step, args=(delta, delta_i))
    strategy.run(step, args=(delta, delta_i))
    for agg, var in mirrored.items():
        out[f"variable/mirrored/{agg}"] = canonical(lib.to_numpy(var.read_value()))
    for agg, var in on_read.items():
        try:
            out[f"variable/on_read/{agg}"] = canonical(lib.to_numpy(var.read_value()))
        except Exception as e:
            out[f"variable/on_read/{agg}"] = error(e)
    out["variable/on_read_int/SUM"] = canonical(lib.to_numpy(on_read_int.read_value()))
    # Cross-replica assigns: to an ON_READ SUM variable each copy holds x / replicas, the read is x.
    on_read["SUM"].assign(np.array([6.0, -2.0], np.float32))
    out["variable/on_read/SUM_after_assign"] = canonical(lib.to_numpy(on_read["SUM"].read_value()))
    on_read["MEAN"].assign(np.array([6.0, -2.0], np.float32))
    out["variable/on_read/MEAN_after_assign"] = canonical(lib.to_numpy(on_read["MEAN"].read_value()))
    mirrored["MEAN"].assign(np.array([4.0, 5.0], np.float32) * (task_rank + 1))
    out["variable/mirrored/cross_replica_assign_own_value"] = canonical(lib.to_numpy(mirrored["MEAN"].read_value()))
    return out


def cluster_scenarios(lib, strategy) -> dict:
    resolver = strategy.cluster_resolver
    extended = strategy.extended
    spec = resolver.cluster_spec()
    return {"cluster": {
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "task_type": resolver.task_type,
        "task_id": resolver.task_id,
        "rpc_layer": resolver.rpc_layer,
        "cluster_spec_jobs": sorted(spec.jobs),
        "num_workers_in_spec": spec.num_tasks("worker"),
        "should_checkpoint": extended.should_checkpoint,
        "should_save_summary": extended.should_save_summary,
        "experimental_should_init": extended.experimental_should_init,
        "experimental_between_graph": extended.experimental_between_graph,
        "worker_devices": list(extended.worker_devices),
        "parameter_devices": list(extended.parameter_devices),
    }}


def run_task(lib, directory: str, task_rank: int) -> dict:
    strategy = lib.strategy()
    out = cluster_scenarios(lib, strategy)
    out.update(collective_scenarios(lib, strategy))
    out.update(variable_scenarios(lib, strategy, task_rank))
    out.update(from_function_scenarios(lib, strategy))
    out.update(type_scenarios(lib, strategy))
    out.update(distributed_dataset_scenarios(lib, strategy, directory))
    return out
