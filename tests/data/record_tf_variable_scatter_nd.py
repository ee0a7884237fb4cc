"""Records TensorFlow 2.21's variable scatter/gather surface and a few small public names as test data.

    /work/venvs/tf/bin/python tests/data/record_tf_variable_scatter_nd.py

Writes tf_variable_scatter_nd_reference.json beside this file (read by tests/test_variable_scatter_nd.py; the
suite never imports TensorFlow). Sections, each keyed by replica count ("0": a plain variable, no strategy):
- "scatter_nd": tf.Variable.scatter_nd_add/sub/update/max/min over many variable shapes, dtypes, index depths
  K, index batch shapes, index dtypes and duplicate patterns (inputs drawn from a seeded RandomState and
  stored beside the results);
- "batch_scatter_update", "readers" (sparse_read, gather_nd, read_value_no_copy, is_initialized, create) and
  "errors": what TF returns or raises, with its message; "row_scatters": scatter_max/min meeting NaN;
- "distributed": every one of those methods (and the row scatters) on MirroredVariable and
  SyncOnReadVariable, in cross-replica and in replica context: what it raises, or what it returns and what
  each copy holds after;
- "datasets": DistributedDataset / DistributedDatasetsFromFunction build() and auto_shard(), over batches
  and over text files by each AutoShardPolicy;
- "names": CollectiveHints, tf.compat.v1's IndexedSlices and convert_to_tensor_or_indexed_slices.
"""

import json
import os
import sys
import tempfile

import numpy as np

from recording import record_by_replicas, tf, write_reference  # (this folder)
import variable_scatter_cases  # (tests/)

REPLICAS = (1, 2, 4)
METHODS = ("scatter_nd_add", "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
# (variable shape, K, index batch shape); K None: rank-1 indices, which TF reads as one-element indices
LAYOUTS = (((5,), 1, (3,)), ((4, 3), 1, (0,)), ((5,), None, (4,)), ((4, 3), 1, (2,)), ((4, 3), None, (3,)),
           ((4, 3), 2, (5,)), ((4, 3), 2, (2, 2)), ((3, 4, 2), 1, (2,)), ((3, 4, 2), 2, (3,)),
           ((3, 4, 2), 3, (4,)), ((2, 3, 2, 2), 2, (2, 3)), ((6,), 1, (8,)))


def arr(x):
    x = np.asarray(x)
    return {"dtype": x.dtype.name, "shape": list(x.shape), "v": x.tolist()}


def unarr(encoded):
    """An encoded array back (its shape too: an empty one's list does not tell it)."""
    return np.array(encoded["v"], tf_dtype(encoded["dtype"])).reshape(encoded["shape"])


def numpy_of(x):
    return np.asarray(tf.convert_to_tensor(x).numpy())


def attempt(fn):
    """fn's result (already encoded by fn), or what it raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (what TF raises is the datum)
        return {"raised": type(e).__name__, "message": str(e)[:400]}


def tf_dtype(name):
    return tf.bfloat16.as_numpy_dtype if name == "bfloat16" else np.dtype(name)


def scatter_nd_cases():
    rng = np.random.RandomState(30)
    cases = []
    for method in METHODS:
        for dtype in DTYPES:
            for shape, k, batch in LAYOUTS:
                depth = 1 if k is None else k
                # a small index range, so that duplicates are common
                indices = np.stack([rng.randint(0, min(d, 3), size=batch) for d in shape[:depth]], axis=-1)
                if k is None:
                    indices = indices[..., 0]
                index_dtype = ("int32", "int64")[len(cases) % 2]
                low = 0 if dtype.startswith("u") else -6
                updates = rng.randint(low, 7, size=batch + shape[depth:])
                initial = rng.randint(low, 7, size=shape)
                cases.append({"method": method, "var": arr(initial.astype(tf_dtype(dtype))),
                              "indices": arr(indices.astype(index_dtype)),
                              "updates": arr(updates.astype(tf_dtype(dtype)))})
    # NaN: TF keeps a NaN already held and ignores a NaN update (max and min alike)
    for method in ("scatter_nd_max", "scatter_nd_min"):
        cases.append({"method": method, "var": arr(np.array([1.0, np.nan, 2.0, 3.0], np.float32)),
                      "indices": arr(np.array([[0], [1], [2], [3], [3]], np.int32)),
                      "updates": arr(np.array([np.nan, 5.0, np.nan, 7.0, np.nan], np.float32))})
    # bool: add is OR, sub is XOR, update assigns (TF has no bool max/min kernel)
    for method in ("scatter_nd_add", "scatter_nd_sub", "scatter_nd_update"):
        cases.append({"method": method, "var": arr(np.array([True, True, False, False])),
                      "indices": arr(np.array([[0], [1], [2], [3], [2]], np.int32)),
                      "updates": arr(np.array([True, False, True, False, True]))})
    for case in cases:
        v, indices, updates = tf.Variable(unarr(case["var"])), unarr(case["indices"]), unarr(case["updates"])

        def run(v=v, case=case, indices=indices, updates=updates):
            returned = getattr(v, case["method"])(indices, updates)
            return {"returned": type(returned).__name__, "result": arr(v.numpy())}
        case.update(attempt(run))
    return cases


def slices(values, indices, dtype="float32"):
    return tf.IndexedSlices(np.asarray(values, dtype), np.asarray(indices))


def batch_scatter_update_cases():
    base2 = np.arange(12, dtype=np.float32).reshape(4, 3)
    base3 = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    cases = {
        "1d_indices_rank1_var": (np.array([1., 2., 3.], np.float32), [9., 8.], [2, 0]),
        "1d_indices_rank2_var": (base2, -np.ones((2, 3)), [2, 0]),
        "1d_indices_duplicates": (base2, [[1, 1, 1], [2, 2, 2]], [0, 0]),
        "2d_indices_rank2_var": (base2, -np.ones((4, 2)), [[2, 0], [1, 1], [0, 0], [2, 2]]),
        "2d_indices_short_prefix": (base2, -np.ones((2, 2)), [[2, 0], [1, 1]]),
        "2d_indices_rank3_var": (base3, -np.ones((2, 2, 4)), [[2, 0], [1, 1]]),
        "3d_indices_rank3_var": (base3, -np.ones((2, 3, 1)), [[[0], [1], [2]], [[3], [3], [3]]]),
        "out_of_range": (base3, -np.ones((2, 2, 4)), [[2, 0], [1, 3]]),
        "negative": (base2, np.ones((1, 3)), [-1]),
        "long_prefix": (base2, -np.ones((5, 2)), [[2, 0], [1, 1], [0, 0], [2, 2], [0, 0]]),
        "bad_updates_shape": (base3, -np.ones((2, 2, 3)), [[2, 0], [1, 1]]),
        "float64_values": (base2, np.ones((1, 3), np.float64), [1]),
        "float_values_int_var": (base2.astype(np.int32), [[1.5, 2, 3]], [1]),
    }
    out = {}
    for name, (base, values, indices) in cases.items():
        values = np.asarray(values, np.float64 if name.startswith("float") else np.asarray(base).dtype)

        def run(base=base, values=values, indices=indices):
            v = tf.Variable(base)
            returned = v.batch_scatter_update(tf.IndexedSlices(values, np.asarray(indices)), use_locking=True,
                                              name="bsu")
            return {"returned": type(returned).__name__, "result": arr(v.numpy())}
        out[name] = {"var": arr(base), "values": arr(values), "indices": arr(np.asarray(indices)), **attempt(run)}
    out["dense_delta"] = attempt(lambda: tf.Variable(base2).batch_scatter_update(np.ones(3)))
    return out


def reader_cases():
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    calls = {
        "sparse_read_1d": ("sparse_read", [2, 0, 2]), "sparse_read_2d": ("sparse_read", [[0, 1], [3, 3]]),
        "sparse_read_scalar": ("sparse_read", 1), "sparse_read_empty": ("sparse_read", np.zeros(0, np.int32)),
        "sparse_read_int64": ("sparse_read", np.array([3], np.int64)),
        "sparse_read_negative": ("sparse_read", [-1]), "sparse_read_out_of_range": ("sparse_read", [4]),
        "sparse_read_float": ("sparse_read", [0.0]), "sparse_read_int16": ("sparse_read", np.array([1], np.int16)),
        "gather_nd_elements": ("gather_nd", [[1, 1], [0, 2]]), "gather_nd_rows": ("gather_nd", [[2], [0]]),
        "gather_nd_rank1_element": ("gather_nd", [1, 1]), "gather_nd_rank1_row": ("gather_nd", [1]),
        "gather_nd_3d": ("gather_nd", [[[1, 1], [0, 2]]]), "gather_nd_empty": ("gather_nd", np.zeros((0, 2), np.int32)),
        "gather_nd_depth0": ("gather_nd", np.zeros((2, 0), np.int32)), "gather_nd_scalar": ("gather_nd", 1),
        "gather_nd_negative": ("gather_nd", [[-1, 0]]), "gather_nd_out_of_range": ("gather_nd", [[0, 3]]),
        "gather_nd_too_deep": ("gather_nd", [[0, 0, 0]]), "gather_nd_float": ("gather_nd", [[0.0, 0.0]]),
    }
    out = {}
    for name, (method, indices) in calls.items():
        out[name] = {"method": method, "indices": indices if not isinstance(indices, np.ndarray) else arr(indices),
                     **attempt(lambda method=method, indices=indices: {
                         "result": arr(getattr(tf.Variable(base), method)(indices, name="read").numpy())})}
    out["base"] = arr(base)
    out["read_value_no_copy"] = attempt(lambda: {"result": arr(tf.Variable(base).read_value_no_copy().numpy())})
    out["is_initialized"] = attempt(lambda: {"result": arr(tf.Variable(base).is_initialized(name="init").numpy())})
    out["create"] = attempt(lambda: {"result": str(tf.Variable(base).create)})
    return out


def error_cases():
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    one_row = np.ones((1, 3), np.float32)
    calls = {
        "out_of_range": ("scatter_nd_add", [[1, 0], [4, 0]], np.array([1, 2], np.float32), base),
        "negative": ("scatter_nd_update", [[-1, 0]], np.array([1], np.float32), base),
        "too_deep": ("scatter_nd_add", [[1, 0, 0]], np.array([1], np.float32), base),
        "depth0": ("scatter_nd_add", np.zeros((2, 0), np.int32), np.ones((2, 4, 3), np.float32), base),
        "updates_row_shape": ("scatter_nd_add", [[1]], np.ones((1, 2), np.float32), base),
        "updates_batch_shape": ("scatter_nd_sub", [[1]], np.ones((3,), np.float32), base),
        "updates_not_broadcast": ("scatter_nd_add", [[1], [2]], one_row, base),
        "scalar_indices": ("scatter_nd_add", np.int32(1), np.ones(3, np.float32), base),
        "rank1_indices_scalar_updates": ("scatter_nd_add", [1, 2], np.float32(5), base),
        "float_indices": ("scatter_nd_add", [[1.0]], one_row, base),
        "int16_indices": ("scatter_nd_add", np.array([[1]], np.int16), one_row, base),
        "uint8_indices": ("scatter_nd_max", np.array([[1]], np.uint8), one_row, base),
        "scalar_variable": ("scatter_nd_update", [[0]], np.array([1.0], np.float32), np.float32(3)),
        "empty_variable": ("scatter_nd_add", [[0]], np.zeros((1, 3), np.float32), np.zeros((0, 3), np.float32)),
        "bool_max": ("scatter_nd_max", [[0]], np.array([True]), np.array([False, True])),
        "bool_min": ("scatter_nd_min", [[0]], np.array([True]), np.array([False, True])),
        "complex_max": ("scatter_nd_max", [[0]], np.array([1j], np.complex64), np.zeros(2, np.complex64)),
        "float_list_into_int": ("scatter_nd_add", [[1]], [[1.5, 2, 3]], base.astype(np.int32)),
        "int_list_into_float": ("scatter_nd_add", [[1]], [[1, 2, 3]], base),
        "float64_array_into_float32": ("scatter_nd_add", [[1]], np.array([[0.5, 2, 3]]), base),
        "float64_array_into_int32": ("scatter_nd_add", [[1]], np.array([[1.5, 2, 3]]), base.astype(np.int32)),
        "int_wraps_into_int8": ("scatter_nd_add", [[1]], np.array([[300, 2, 3]]), base.astype(np.int8)),
        "int8_overflow_wraps": ("scatter_nd_add", [[0]], np.array([10], np.int8), np.array([120], np.int8)),
    }
    out = {}
    for name, (method, indices, updates, initial) in calls.items():
        def run(method=method, indices=indices, updates=updates, initial=initial):
            v = tf.Variable(initial)
            returned = getattr(v, method)(indices, updates, name="nd")
            return {"returned": type(returned).__name__, "result": arr(v.numpy())}
        out[name] = attempt(run)
    out["use_locking_keyword"] = attempt(
        lambda: tf.Variable(base).scatter_nd_add([[1]], one_row, use_locking=True) and {"result": None})
    return out


def row_scatter_cases():
    """The row scatters' NaN rule (TF's max and min keep a NaN held and ignore a NaN given)."""
    out = {}
    for method in ("scatter_max", "scatter_min"):
        v = tf.Variable(np.array([[1.0, np.nan], [2.0, 3.0]], np.float32))
        getattr(v, method)(slices([[np.nan, 5.0], [np.nan, np.nan], [-7.0, 9.0]], [0, 1, 1]))
        out[method] = {"result": arr(v.numpy())}
    return out


def record_plain():
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()])
    return {"scatter_nd": scatter_nd_cases(), "batch_scatter_update": batch_scatter_update_cases(),
            "readers": reader_cases(), "errors": error_cases(), "row_scatters": row_scatter_cases(),
            "names": names()}


# --- distributed variables ------------------------------------------------------------------------------

DISTRIBUTED_CALLS = variable_scatter_cases.distributed_calls(slices)
KINDS = variable_scatter_cases.kinds(tf)


def encode_result(strategy, result):
    if isinstance(result, bool):
        return {"py": result}
    if isinstance(result, tf.distribute.DistributedValues) and not isinstance(result, tf.Variable):
        return {"per_replica": [arr(numpy_of(c)) for c in strategy.experimental_local_results(result)]}
    return arr(numpy_of(result))


def record_distributed(strategy):
    out = {}
    base = np.arange(12, dtype=np.float32).reshape(4, 3) + 1
    for kind, (synchronization, aggregation) in KINDS.items():
        for method, call in DISTRIBUTED_CALLS.items():
            for where in ("cross_replica", "replica"):
                with strategy.scope():
                    v = tf.Variable(base, synchronization=synchronization, aggregation=aggregation)

                def run(v=v, call=call, where=where):
                    result = call(v) if where == "cross_replica" else strategy.run(lambda: call(v))
                    return {"type": type(v).__name__, "returned": type(result).__name__,
                            "value": encode_result(strategy, result),
                            "copies": [arr(c.numpy()) for c in v.values]}
                out[f"{kind}|{method}|{where}"] = attempt(run)
    return out


FILES = 4  # text files of 3 lines each, "f<file>-<line>", for the FILE policy


def write_text_files(folder):
    """FILES text files in ``folder`` (the test writes the same); their glob pattern."""
    for i in range(FILES):
        with open(os.path.join(folder, f"f{i}.txt"), "w") as f:
            f.write("".join(f"f{i}-{j}\n" for j in range(3)))
    return os.path.join(folder, "f*.txt")


def record_datasets(strategy):
    def elements(dataset):
        return [[np.asarray(c).tolist() for c in strategy.experimental_local_results(e)] for e in dataset]

    batches = tf.data.Dataset.range(24).batch(6)
    out = {}
    dist = strategy.experimental_distribute_dataset(batches)
    out["dataset|build"] = attempt(lambda: dist.build() and {})
    out["dataset|build_replace"] = attempt(lambda: dist.build(dataset_to_replace=batches) and {})
    for shards, index in ((1, 0), (2, 0), (2, 1), (3, 0), (3, 2)):
        out[f"dataset|auto_shard|{shards}|{index}"] = attempt(lambda shards=shards, index=index: {
            "type": type(dist.auto_shard(shards, index)).__name__,
            "elements": elements(dist.auto_shard(shards, index)),
            "cardinality": int(dist.auto_shard(shards, index).cardinality)})
    out["dataset|auto_shard_twice"] = attempt(lambda: {"elements": elements(dist.auto_shard(2, 1).auto_shard(2, 0))})
    out["dataset|auto_shard_uneven"] = attempt(lambda: {"elements": elements(
        strategy.experimental_distribute_dataset(tf.data.Dataset.range(14).batch(7)).auto_shard(2, 1))})
    for policy in ("OFF", "DATA"):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, policy)
        out[f"dataset|auto_shard_policy_{policy}"] = attempt(lambda options=options: {"elements": elements(
            strategy.experimental_distribute_dataset(batches.with_options(options)).auto_shard(2, 1))})
    for shards, index in ((2, 2), (2, -1), (0, 0)):
        out[f"dataset|auto_shard_bad|{shards}|{index}"] = attempt(
            lambda shards=shards, index=index: {"elements": elements(dist.auto_shard(shards, index))})
    with tempfile.TemporaryDirectory() as folder:
        pattern = write_text_files(folder)
        for policy in ("FILE", "AUTO", "OFF"):
            def lines(policy=policy):
                options = tf.data.Options()
                options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy,
                                                                            policy)
                files = tf.data.Dataset.list_files(pattern, shuffle=False)
                return tf.data.TextLineDataset(files).batch(2).with_options(options)

            def decoded(dataset):
                return [[[line.decode() for line in c] for c in e] for e in elements(dataset)]
            for shards, index in ((2, 0), (2, 1), (3, 2)):
                out[f"files|{policy}|dataset|{shards}|{index}"] = attempt(lambda shards=shards, index=index: {
                    "elements": decoded(strategy.experimental_distribute_dataset(lines()).auto_shard(shards, index))})
                out[f"files|{policy}|from_function|{shards}|{index}"] = attempt(
                    lambda shards=shards, index=index: {"elements": decoded(
                        strategy.distribute_datasets_from_function(lambda ctx: lines()).auto_shard(shards, index))})
    from_fn = strategy.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(12).batch(2))
    out["from_function|build"] = attempt(lambda: from_fn.build() and {})
    for shards, index in ((2, 0), (2, 1), (3, 2)):
        out[f"from_function|auto_shard|{shards}|{index}"] = attempt(lambda shards=shards, index=index: {
            "type": type(from_fn.auto_shard(shards, index)).__name__,
            "elements": elements(from_fn.auto_shard(shards, index)),
            "cardinality": int(from_fn.auto_shard(shards, index).cardinality)})
    return out


def names():
    hints = tf.distribute.experimental.CollectiveHints

    def fields(options):
        return {"type": type(options).__name__, "bytes_per_pack": options.bytes_per_pack,
                "timeout_seconds": options.timeout_seconds, "implementation": options.implementation.name}
    options_type = type(tf.distribute.experimental.CommunicationOptions())
    convert = tf.compat.v1.convert_to_tensor_or_indexed_slices
    indexed = slices([[1.0, 2.0]], [3])
    return {
        "hints_default": fields(hints()),
        "hints_keywords": fields(hints(bytes_per_pack=1024, timeout_seconds=5.0)),
        "hints_positional": fields(hints(8, 2)),
        "hints_same_type_as_options": type(hints()) is options_type,
        "hints_isinstance": isinstance(hints(), hints),
        "hints_negative": attempt(lambda: hints(bytes_per_pack=-1)),
        "hints_implementation": attempt(lambda: hints(implementation="RING")),
        "options_merge_hints": fields(tf.distribute.experimental.CommunicationOptions(bytes_per_pack=5).merge(
            hints(bytes_per_pack=1024, timeout_seconds=5.0))),
        "compat_v1_indexed_slices": tf.compat.v1.IndexedSlices is tf.IndexedSlices,
        "or_slices_returns_slices": convert(indexed, None) is indexed,
        "or_slices_same_dtype": convert(indexed, tf.float32) is indexed,
        "or_slices_other_dtype": attempt(lambda: convert(indexed, tf.float64)),
        "or_slices_list": arr(convert([1.0, 2.0], None)),
        "or_slices_list_dtype": arr(convert([1, 2], tf.int64)),
        "compat_v1_indexed_names": sorted(x for x in dir(tf.compat.v1) if "ndexed" in x),
    }


def record_replicas(n):
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * n)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    hints = tf.distribute.experimental.CollectiveHints(bytes_per_pack=1024, timeout_seconds=30.0)
    per_replica = strategy.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1,
                                               tf.float32))
    options = {
        "all_reduce": [arr(x) for x in strategy.experimental_local_results(strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant([2.0]), options=hints)))],
        "all_gather": [arr(x) for x in strategy.experimental_local_results(strategy.run(
            lambda: tf.distribute.get_replica_context().all_gather(tf.constant([2.0]), 0, options=hints)))],
        "reduce_to": arr(strategy.extended.reduce_to("SUM", per_replica, "/cpu:0", options=hints)),
        "batch_reduce_to": [arr(x) for x in strategy.extended.batch_reduce_to(
            "MEAN", [(per_replica, "/cpu:0"), (per_replica, "/cpu:0")], options=hints)],
    }
    return {"distributed": record_distributed(strategy), "datasets": record_datasets(strategy),
            "hints_accepted": options}


def main():
    out = {"tensorflow": tf.__version__, **record_by_replicas(__file__, (0,) + REPLICAS)}
    write_reference("tf_variable_scatter_nd_reference.json", out, separators=(",", ":"))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        n = int(sys.argv[1])
        json.dump(record_plain() if n == 0 else record_replicas(n), sys.stdout)
    else:
        main()
