"""Records TensorFlow 2.21 / Keras 3 behaviour that tests/test_tfport.py asserts (never imported by the tests).

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tfport_reference.py > tests/data/tfport_reference.json

Recorded: LossScaleOptimizer's scale / counter / iterations / weights over gradient sequences with inf and
nan (one device, and MirroredStrategy with a non-finite gradient on one replica only); tf.Module's
traversal order, de-duplication and name scopes; tf.Variable's argument rules; tf.train.ClusterSpec's
methods; a variable constraint applied by a Keras optimizer. Writes tf_module_checkpoint/ck (the recorded
module less its `shared` alias, each variable its index in `variables` + 10).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

INF, NAN = float("inf"), float("nan")


def encode(x):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    if isinstance(x, list):
        return [encode(v) for v in x]
    return x


def lso_trajectory(grads, initial_scale, growth, lr, strategy=None, replica_grads=None, clipnorm=None):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        w = tf.Variable([1.0, 2.0], dtype=tf.float32)
        opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(lr, clipnorm=clipnorm),
                                                       initial_scale=initial_scale, dynamic_growth_steps=growth)
    rows = []
    for step, g in enumerate(grads):
        if replica_grads is None:
            opt.apply_gradients([(tf.constant(g, tf.float32), w)])
        else:
            def fn(ctx_grads=replica_grads[step]):
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                g = tf.constant(ctx_grads, tf.float32)[rid]
                opt.apply_gradients([(g, w)])
            strategy.run(fn)
        rows.append({"scale": float(opt.dynamic_scale.numpy()), "counter": int(opt.step_counter.numpy()),
                     "iterations": int(opt.iterations.numpy()), "w": [float(v) for v in w.numpy()]})
    return rows


def record_lso(strategy):
    out = {}
    seq = [[1.0, 1.0], [2.0, -1.0], [INF, 0.0], [1.0, 1.0], [0.5, 0.5], [NAN, 1.0], [1.0, 2.0], [1.0, 1.0],
           [1.0, 1.0], [1.0, 1.0], [-INF, 1.0], [NAN, NAN], [4.0, 4.0]]
    out["single"] = {"initial_scale": 16.0, "growth": 3, "lr": 0.5, "grads": encode(seq),
                     "steps": lso_trajectory(seq, 16.0, 3, 0.5)}
    opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    out["defaults"] = {"initial_scale": opt.initial_scale, "dynamic_growth_steps": opt.dynamic_growth_steps,
                       "scale_loss_unbuilt": float(opt.scale_loss(tf.constant(3.0)).numpy())}
    per_replica = [[[1.0, 1.0], [1.0, 3.0]], [[INF, 1.0], [1.0, 1.0]], [[1.0, 1.0], [NAN, 1.0]],
                   [[2.0, 0.0], [0.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]],
                   [[0.5, 0.5], [0.5, 0.5]]]
    out["mirrored2"] = {"initial_scale": 4.0, "growth": 2, "lr": 0.25, "replica_grads": encode(per_replica),
                        "steps": lso_trajectory([None] * len(per_replica), 4.0, 2, 0.25, strategy, per_replica)}
    # clipnorm on the wrapped optimizer: Keras clips each replica's unscaled gradient, then sums
    clipped = [[[12.0, 16.0], [0.0, 8.0]], [[INF, 0.0], [1.0, 1.0]], [[2.0, 2.0], [-8.0, 0.0]],
               [[0.5, 0.0], [0.0, 0.5]]]
    out["mirrored2_clipnorm"] = {"initial_scale": 4.0, "growth": 2, "lr": 0.5, "clipnorm": 1.0,
                                 "replica_grads": encode(clipped),
                                 "steps": lso_trajectory([None] * len(clipped), 4.0, 2, 0.5, strategy, clipped,
                                                         clipnorm=1.0)}
    return out


class Leaf(tf.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        with self.name_scope:
            self.w = tf.Variable(1.0, name="w")
            self.b = tf.Variable(0.0, name="b", trainable=False)


class Tree(tf.Module):
    def __init__(self):
        super().__init__(name="tree")
        with self.name_scope:
            self.z_leaf = Leaf("zed")
            self.a_list = [Leaf("first"), {"y": Leaf("dict_y"), "x": Leaf("dict_x")}]
            self.shared = self.z_leaf  # the same module twice: listed once
            self._private = Leaf("private")
            self.v = tf.Variable(2.0, name="v")
            self.vs = (tf.Variable(3.0, name="t0"), self.v)  # the same variable twice
            self.counter = tf.Variable(0, name="count", trainable=False)

    @tf.Module.with_name_scope
    def make(self):
        return tf.Variable(5.0, name="made")


def record_module():
    tree = Tree()
    # A TensorFlow checkpoint of the module (a TensorBundle), for md.train.Checkpoint to restore: without the
    # second name of z_leaf, as TF keys an object reached twice by its first path in assignment order.
    saved = Tree()
    del saved.shared
    for i, v in enumerate(saved.variables):
        v.assign(tf.cast(i + 10, v.dtype))
    tf.train.Checkpoint(model=saved).write(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                        "tf_module_checkpoint", "ck"))
    names = lambda vs: [v.name for v in vs]  # noqa: E731
    outer = tf.Module(name="outer")
    with outer.name_scope:
        inner = tf.Module(name="inner")
        with inner.name_scope:
            nested = tf.Variable(1.0, name="x")
    out = {
        "submodules": [m.name for m in tree.submodules],
        "variables": names(tree.variables),
        "trainable_variables": names(tree.trainable_variables),
        "non_trainable_variables": names(tree.non_trainable_variables),
        "made": tree.make().name,
        "default_name": Leaf().name,
        "outer_scope": outer.name_scope.name, "inner_scope": inner.name_scope.name, "nested": nested.name,
        "inner_name": inner.name,
        "leaf_variables_after_make": names(tree.z_leaf.variables),
    }

    class CamelCaseModel(tf.Module):
        pass
    out["camel_default_name"] = CamelCaseModel().name
    out["http_default_name"] = type("HTTPServer2", (tf.Module,), {})().name
    try:
        tf.Module(name="not valid")
    except ValueError as e:
        out["bad_name_error"] = str(e)
    return out


def record_variable(strategy):
    out = {}
    out["positional_trainable_false"] = tf.Variable(1.0, False).trainable
    out["on_read_default_trainable"] = tf.Variable(
        1.0, synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM).trainable
    try:
        tf.Variable(1.0, constraint=3)
    except ValueError as e:
        out["constraint_not_callable"] = str(e)
    v = tf.Variable([1.0, -2.0, 3.0], constraint=lambda x: tf.clip_by_value(x, -1.0, 1.0))
    v.assign([5.0, 5.0, 5.0])
    out["assign_ignores_constraint"] = v.numpy().tolist()
    w = tf.Variable([1.0, -2.0, 3.0], constraint=lambda x: tf.clip_by_value(x, -1.0, 1.0))
    keras.optimizers.SGD(0.5).apply_gradients([(tf.constant([1.0, 1.0, -10.0]), w)])
    out["keras_sgd_applies_constraint"] = w.numpy().tolist()
    with strategy.scope():
        m = tf.Variable([1.0, -2.0, 3.0], constraint=lambda x: tf.clip_by_value(x, -1.0, 1.0))
        opt = keras.optimizers.SGD(0.5)
    strategy.run(lambda: opt.apply_gradients([(tf.constant([1.0, 1.0, -10.0]), m)]))
    out["mirrored_keras_sgd_applies_constraint"] = m.numpy().tolist()
    return out


def record_cluster_spec():
    spec = tf.train.ClusterSpec({"worker": ["w0:2222", "w1:2222"], "chief": ["c:2222"],
                                 "ps": {3: "p3:2222", 1: "p1:2222"}})
    return {
        "as_dict": spec.as_dict(), "jobs": spec.jobs, "num_tasks_ps": spec.num_tasks("ps"),
        "task_indices_ps": spec.task_indices("ps"), "task_address_ps3": spec.task_address("ps", 3),
        "job_tasks_ps": spec.job_tasks("ps"), "job_tasks_worker": spec.job_tasks("worker"),
        "bool_empty": bool(tf.train.ClusterSpec({})), "bool_full": bool(spec),
        "eq_dict_copy": spec == tf.train.ClusterSpec(spec.as_dict()),
    }


if __name__ == "__main__":
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    # One strategy for every recording: a second one would reuse the first's collective instance keys.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    json.dump({"tensorflow": tf.__version__, "keras": keras.__version__, "loss_scale": record_lso(strategy),
               "module": record_module(), "variable": record_variable(strategy), "cluster_spec": record_cluster_spec()},
              sys.stdout, indent=1, sort_keys=True)
    print()
