"""Records TensorFlow 2.21 / Keras 3's handling of tf.IndexedSlices as test data.

    /work/venvs/tf/bin/python tests/data/record_tf_indexed_slices.py

Writes tf_indexed_slices_reference.json beside this file (read by tests/test_indexed_slices.py; the suite
never imports TensorFlow):
- "slices": the class's attributes, densifying (duplicate indices sum), negation, and the errors TF raises;
- "variables": tf.Variable's scatter_* methods taking an IndexedSlices;
- "reduce|n": at n = 1, 2, 4 logical CPU replicas of MirroredStrategy, strategy.reduce, extended.reduce_to
  and batch_reduce_to with each CrossDeviceOps, ReplicaContext.all_reduce over nests mixing dense and sparse
  values, and all_gather; replica r contributes r + 2 rows (duplicate indices included);
- "optimizers|n": Keras 3 optimizers fed an embedding's IndexedSlices gradient beside a dense one for STEPS
  steps, n = 0 meaning a plain loop without a strategy; rows 5 and 6 of the embedding are never touched.
"""

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
import keras

REPLICAS = (1, 2, 4)
STEPS = 4
ROWS, WIDTH = 7, 3
OPTIMIZERS = {
    "SGD": ("SGD", {"learning_rate": 0.1}),
    "SGD momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    "SGD nesterov": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    "Adam": ("Adam", {"learning_rate": 0.01}),
    "AdamW": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}),
    "RMSprop": ("RMSprop", {"learning_rate": 0.01}),
    "RMSprop centered momentum": ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
    "Adagrad": ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.5}),
    "Nadam": ("Nadam", {"learning_rate": 0.02}),
    "SGD clipnorm": ("SGD", {"learning_rate": 0.1, "clipnorm": 1.0}),
    "SGD clipvalue": ("SGD", {"learning_rate": 0.1, "clipvalue": 0.5}),
    "SGD global_clipnorm": ("SGD", {"learning_rate": 0.1, "global_clipnorm": 2.0}),
    "Adam clipnorm weight_decay": ("Adam", {"learning_rate": 0.01, "clipnorm": 1.0, "weight_decay": 0.05}),
    "SGD momentum weight_decay": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.05}),
}


def arr(x):
    x = np.asarray(x)
    return {"values": x.tolist(), "dtype": str(x.dtype), "shape": list(x.shape)}


def slices_record(s):
    """An IndexedSlices (or a Tensor) as the tests read it."""
    if isinstance(s, tf.IndexedSlices):
        return {"type": type(s).__name__, "values": arr(s.values), "indices": arr(s.indices),
                "dense_shape": None if s.dense_shape is None else arr(s.dense_shape)}
    return {"type": type(s).__name__, **arr(s)}


def distributed_record(v):
    if isinstance(v, tf.distribute.DistributedValues):
        return {"type": type(v).__name__, "components": [slices_record(c) for c in v.values]}
    return slices_record(v)


def error(fn):
    try:
        result = fn()
        if isinstance(result, (tf.IndexedSlices, tf.Tensor)):
            result = tf.convert_to_tensor(result)
        return {"raised": None, "result": str(type(result).__name__)}
    except Exception as e:  # noqa: BLE001  (what TF raises is the datum)
        return {"raised": type(e).__name__, "message": str(e)[:400]}


def attempt(fn):
    """fn's record, or what it raised (NcclAllReduce has no CPU kernel for dense tensors)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:400]}


def sparse_inputs(r, dtype="float32", index_dtype="int32"):
    """Replica r's slices: r + 2 rows, indices repeating one row."""
    k = r + 2
    values = (np.arange(k * WIDTH).reshape(k, WIDTH) + 10 * r + 1).astype(dtype) * 0.5
    indices = np.array([(3 * r + 2 * j) % 5 for j in range(k - 1)] + [(3 * r) % 5], index_dtype)
    return values, indices


def record_slices():
    out = {}
    values = tf.constant([[1., 2.], [3., 4.], [5., 6.]])
    s = tf.IndexedSlices(values, tf.constant([0, 2, 0]), tf.constant([4, 2]))
    out["basic"] = {"slices": slices_record(s), "dense": arr(tf.convert_to_tensor(s)),
                    "dtype": s.dtype.name, "shape": s.shape.as_list(), "device_endswith": s.device[-5:],
                    "neg": slices_record(-s), "str": str(s), "repr_is_default": repr(s).startswith("<")}
    no_shape = tf.IndexedSlices(values, tf.constant([0, 2, 0]))
    out["no_dense_shape"] = {"shape_rank": no_shape.shape.rank, "dense_shape": no_shape.dense_shape is None,
                             "densify": error(lambda: tf.convert_to_tensor(no_shape))}
    i64 = tf.IndexedSlices(tf.constant([[1, 2]], tf.int64), tf.constant([3], tf.int64), tf.constant([5, 2], tf.int64))
    out["int64"] = {"slices": slices_record(i64), "dense": arr(tf.convert_to_tensor(i64)), "dtype": i64.dtype.name}
    out["errors"] = {
        "index_out_of_range": error(lambda: tf.IndexedSlices(values, tf.constant([0, 5, 0]), tf.constant([4, 2]))),
        "negative_index": error(lambda: tf.IndexedSlices(values, tf.constant([0, -1, 0]), tf.constant([4, 2]))),
        "float_indices": error(lambda: tf.IndexedSlices(values, tf.constant([0., 1., 2.]), tf.constant([4, 2]))),
        "indices_2d": error(lambda: tf.IndexedSlices(values, tf.constant([[0], [1], [2]]), tf.constant([4, 2]))),
        "scalar_values": error(lambda: tf.IndexedSlices(tf.constant(1.), tf.constant([0]), tf.constant([4]))),
        "leading_dims": error(lambda: tf.IndexedSlices(values, tf.constant([0, 1]), tf.constant([4, 2]))),
        "dense_shape_mismatch": error(lambda: tf.IndexedSlices(values, tf.constant([0, 1, 2]),
                                                                 tf.constant([4, 3]))),
    }
    return out


def record_variables():
    out = {}
    base = np.arange(12, dtype=np.float32).reshape(4, 3) + 1
    delta = tf.IndexedSlices(tf.constant([[1., 2., 3.], [4., 5., 6.], [0.5, 0.5, 0.5]]), tf.constant([2, 0, 2]))
    unique = tf.IndexedSlices(tf.constant([[1., 2., 3.], [4., 5., 6.]]), tf.constant([2, 0]))
    for method, d in (("scatter_add", delta), ("scatter_sub", delta), ("scatter_mul", unique),
                      ("scatter_div", unique), ("scatter_max", delta), ("scatter_min", delta),
                      ("scatter_update", unique)):
        v = tf.Variable(base)
        returned = getattr(v, method)(d)
        out[method] = {"delta": slices_record(d), "result": arr(v.numpy()), "returned": type(returned).__name__}
    v = tf.Variable(base)
    out["not_slices"] = error(lambda: v.scatter_add(tf.constant([[1., 2., 3.]])))
    out["out_of_range"] = error(lambda: v.scatter_add(tf.IndexedSlices(tf.constant([[1., 2., 3.]]),
                                                                         tf.constant([9]))))
    out["bad_shape"] = error(lambda: v.scatter_add(tf.IndexedSlices(tf.constant([[1., 2.]]), tf.constant([1]))))
    out["base"] = arr(base)
    return out


CROSS_DEVICE_OPS = ("default", "ReductionToOneDevice", "NcclAllReduce", "HierarchicalCopyAllReduce")


def record_reduce(n, name):
    out = {}
    ops = None if name == "default" else getattr(tf.distribute, name)()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=ops)
    for dtype, index_dtype in (("float32", "int32"), ("float64", "int64")):
        def make(dtype=dtype, index_dtype=index_dtype):
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            pieces = [sparse_inputs(i, dtype, index_dtype) for i in range(n)]
            values = tf.switch_case(r, [lambda p=p: tf.constant(p[0]) for p in pieces])
            indices = tf.switch_case(r, [lambda p=p: tf.constant(p[1]) for p in pieces])
            return tf.IndexedSlices(values, indices, tf.constant([ROWS, WIDTH], index_dtype))
        per_replica = strategy.run(make)
        dense = strategy.run(lambda: tf.ones([2]) * tf.cast(
            tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))
        key = f"{name}|{dtype}"
        for op in ("SUM", "MEAN"):
            reduce_op = getattr(tf.distribute.ReduceOp, op)
            out[f"{key}|reduce|{op}"] = attempt(lambda: distributed_record(
                strategy.reduce(reduce_op, per_replica, axis=None)))
            out[f"{key}|reduce_to|{op}"] = attempt(lambda: distributed_record(
                strategy.extended.reduce_to(reduce_op, per_replica, destinations=per_replica)))
            out[f"{key}|reduce_to_cpu0|{op}"] = attempt(lambda: distributed_record(
                strategy.extended.reduce_to(reduce_op, per_replica, destinations="/cpu:0")))
            out[f"{key}|batch_reduce_to|{op}"] = attempt(lambda: [distributed_record(b) for b in (
                strategy.extended.batch_reduce_to(reduce_op, [(per_replica, per_replica), (dense, dense)]))])
            out[f"{key}|batch_reduce_to_sparse|{op}"] = attempt(lambda: [distributed_record(b) for b in (
                strategy.extended.batch_reduce_to(reduce_op, [(per_replica, per_replica)] * 2))])

            def in_replica(op=op, make=make, mixed=True):
                ctx = tf.distribute.get_replica_context()
                s = make()
                d = tf.ones([2]) * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
                single = ctx.all_reduce(op.lower(), s)
                nest = ctx.all_reduce(op.lower(), {"dense": d, "sparse": [s, s]} if mixed else {"sparse": [s, s]})
                return single, nest

            def all_reduce(mixed):
                single, nest = strategy.run(in_replica, kwargs={"mixed": mixed})
                return {"single": distributed_record(single),
                        "nest_dense": distributed_record(nest["dense"]) if mixed else None,
                        "nest_sparse": [distributed_record(x) for x in nest["sparse"]]}
            out[f"{key}|all_reduce|{op}"] = attempt(lambda: all_reduce(True))
            out[f"{key}|all_reduce_sparse|{op}"] = attempt(lambda: all_reduce(False))
        if name == "default" and dtype == "float32":
            out["all_gather"] = error(lambda: strategy.run(
                lambda: tf.distribute.get_replica_context().all_gather(make(), axis=0)))
            out["gather"] = error(lambda: strategy.gather(per_replica, axis=0))
            out["default_cross_device_ops"] = type(strategy.extended._cross_device_ops
                                                   or strategy.extended._inferred_cross_device_ops).__name__
    return out


def optimizer_inputs():
    rng = np.random.RandomState(29)
    grads = {}
    for s in range(STEPS):
        for r in range(max(REPLICAS)):
            k = 2 + (s + r) % 3
            indices = rng.randint(0, 5, size=k).astype(np.int32)
            indices[-1] = indices[0]  # a duplicate on every step
            grads[f"{s}|{r}"] = {"values": (rng.randn(k, WIDTH) * 1.5).tolist(), "indices": indices.tolist()}
    return {"embedding0": rng.randn(ROWS, WIDTH).tolist(), "w0": rng.randn(WIDTH, 2).tolist(),
            "grads_w": (rng.randn(STEPS, max(REPLICAS), WIDTH, 2) * 1.5).tolist(), "sparse": grads}


def slot_values(opt):
    """Every optimizer variable (iterations and learning rate aside) by path, as Keras names them."""
    return {v.path: np.asarray(v.numpy()).tolist() for v in opt.variables
            if "iteration" not in v.path and "learning_rate" not in v.path}


def record_optimizers(n, names):
    data = optimizer_inputs()
    out = {}
    for name in names:
        cls, kwargs = OPTIMIZERS[name]
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)]) if n else \
            tf.distribute.get_strategy()
        with strategy.scope():
            e = tf.Variable(np.array(data["embedding0"], np.float32), name="embedding")
            w = tf.Variable(np.array(data["w0"], np.float32), name="w")
            opt = getattr(keras.optimizers, cls)(**kwargs)
            opt.build([e, w])

        def slices(s, r):
            g = data["sparse"][f"{s}|{r}"]
            return tf.IndexedSlices(tf.constant(g["values"], tf.float32), tf.constant(g["indices"], tf.int32),
                                    tf.constant([ROWS, WIDTH], tf.int32))
        for s in range(STEPS):
            if not n:
                opt.apply_gradients([(slices(s, 0), e), (tf.constant(data["grads_w"][s][0], tf.float32), w)])
                continue

            def step(s=s):
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                sparse = [slices(s, i) for i in range(n)]
                values = tf.switch_case(r, [lambda g=g: g.values for g in sparse])
                indices = tf.switch_case(r, [lambda g=g: g.indices for g in sparse])
                gw = tf.gather(tf.constant(data["grads_w"][s], tf.float32), r)
                opt.apply_gradients([(tf.IndexedSlices(values, indices, tf.constant([ROWS, WIDTH])), e), (gw, w)])
            strategy.run(step)
        out[name] = {"embedding": arr(e.numpy()), "w": arr(w.numpy()), "slots": slot_values(opt),
                     "iterations": int(opt.iterations.numpy())}
    return out


def record_loss_scale():
    """LossScaleOptimizer: a non-finite value in the sparse gradient skips the step and halves the scale."""
    data = optimizer_inputs()
    e = tf.Variable(np.array(data["embedding0"], np.float32))
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    scales = []
    for s in range(3):
        g = data["sparse"][f"{s}|0"]
        values = np.array(g["values"], np.float32) * 4.0
        if s == 1:
            values[0, 1] = np.inf
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(values), tf.constant(g["indices"]),
                                               tf.constant([ROWS, WIDTH])), e)])
        scales.append(float(opt.dynamic_scale.numpy()))
        if s == 0:
            after_first = e.numpy()
        if s == 1:
            after_skip = e.numpy()
    return {"scales": scales, "after_first": arr(after_first), "after_skip": arr(after_skip),
            "embedding": arr(e.numpy())}


def record(n, part, path):
    """One replica count and part per process: TF's collective keys clash across strategies of other sizes
    and shapes."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * max(n, 1))
    out = {}
    if part == "basics":
        out["slices"] = record_slices()
        out["variables"] = record_variables()
        out["loss_scale"] = record_loss_scale()
    elif part.startswith("optimizers"):
        names = list(OPTIMIZERS) if part == "optimizers" else [part.split(":", 1)[1]]
        out = {f"optimizers|{n}|{name}": value for name, value in record_optimizers(n, names).items()}
    else:
        out[f"reduce|{n}|{part}"] = record_reduce(n, part)
    with open(path, "w") as f:
        json.dump(out, f)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    data = {"versions": f"tensorflow {tf.__version__}, keras {keras.__version__}",
            "optimizer_configs": OPTIMIZERS, "optimizer_inputs": optimizer_inputs(), "rows": ROWS,
            "width": WIDTH, "steps": STEPS}
    # (Strategies in one process share TF's collective instance keys: one per optimizer under a strategy.)
    parts = [(0, "basics"), (0, "optimizers")] + [(n, part) for n in REPLICAS for part in (
        *CROSS_DEVICE_OPS, *(f"optimizers:{name}" for name in OPTIMIZERS))]
    for n, part in parts:
        path = os.path.join(here, f".tf_indexed_slices_{n}_{part.replace(' ', '_').replace(':', '_')}.json")
        subprocess.run([sys.executable, __file__, str(n), part, path], check=True)
        with open(path) as f:
            data.update(json.load(f))
        os.remove(path)
    with open(os.path.join(here, "tf_indexed_slices_reference.json"), "w") as f:
        json.dump(data, f, sort_keys=True)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        record(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    else:
        main()
