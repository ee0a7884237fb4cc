"""Records Keras 3's MultiOptimizer and OptimizerMap (TF 2.21, Keras 3.15) as test data.

    /work/venvs/tf/bin/python tests/data/record_keras_multi_optimizer.py

Writes keras_multi_optimizer.npz beside this file (read by tests/test_optimizers_multi.py; the suite never
imports TensorFlow):

- training: a model of four variables whose paths route them by exact key (``encoder/dense/kernel``: Adam), by
  regular expression (``encoder/.*``, ``decoder/.*``: SGD with momentum) and by default (RMSprop), STEPS steps
  under tf.distribute.MirroredStrategy at 1, 2 and 4 replicas (logical CPUs), replica r of step s passing
  gradient grads[s, r]: the weights, every sub-optimizer's slots and every ``iterations`` after the last step;
- ``rules``: what OptimizerMap returns for a set of paths, the errors (type and message) of its and
  MultiOptimizer's bad inputs, the sub-optimizers' order, loss_scale_factor's propagation, get_config, and the
  names a tf.train.Checkpoint of a built MultiOptimizer holds (that file: keras_multi_optimizer_checkpoint/, a
  model of ones after one step of gradients of ones).

The LossScaleOptimizer configuration is recorded at one replica only (see ``record``).
"""

import json
import os
import shutil
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

STEPS = 6
REPLICAS = (1, 2, 4)
# path -> shape; routed: kernel by its exact key, bias and decoder by a pattern, head by the default.
MODEL = {"encoder/dense/kernel": (3, 4), "encoder/dense/bias": (4,), "decoder/kernel": (4, 2), "head/w": (2,)}
# name -> (the map: key -> (class, kwargs); the default (class, kwargs); MultiOptimizer's loss_scale_factor;
#          a LossScaleOptimizer around it: its initial_scale or None)
CONFIGS = {
    "exact regex default": ({"encoder/dense/kernel": ("Adam", {"learning_rate": 0.05}),
                             "encoder/.*": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
                             "decoder/.*": ("SGD", {"learning_rate": 0.1, "momentum": 0.9})},
                            ("RMSprop", {"learning_rate": 0.01}), None, None),
    "clipnorm weight_decay loss_scale_factor": (
        {"encoder/dense/kernel": ("Adam", {"learning_rate": 0.05, "clipnorm": 1.0}),
         "(encoder|decoder)/.*": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.05})},
        ("RMSprop", {"learning_rate": 0.01, "global_clipnorm": 1.5}), 4.0, None),
    "loss scale optimizer": ({"encoder/.*": ("Adam", {"learning_rate": 0.05})},
                             ("SGD", {"learning_rate": 0.1, "momentum": 0.9}), None, 8.0),
}
# Keras' attribute of each slot: class -> {slot: attribute}
SLOTS = {"Adam": {"momentum": "_momentums", "velocity": "_velocities"}, "SGD": {"momentum": "momentums"},
         "RMSprop": {"velocity": "_velocities"}}


def inputs():
    rng = np.random.RandomState(23)
    data = {f"init|{path}": rng.randn(*shape).astype(np.float32) for path, shape in MODEL.items()}
    for path, shape in MODEL.items():
        data[f"grads|{path}"] = (rng.randn(STEPS, max(REPLICAS), *shape) * 1.5).astype(np.float32)
    return data


def keras_variable(keras, path, value):
    """A Keras variable whose ``path`` is ``path`` (one name scope per level)."""
    import contextlib

    *scopes, leaf = path.split("/")
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(keras.name_scope(scope))
        return keras.Variable(value, name=leaf)


def make(keras, name):
    """The config's MultiOptimizer (and its LossScaleOptimizer), the map's optimizers shared by equal entries."""
    mapped, default, factor, scale = CONFIGS[name]
    made = {}

    def one(cls, kwargs):
        key = json.dumps([cls, kwargs], sort_keys=True)
        if key not in made:
            made[key] = getattr(keras.optimizers, cls)(**kwargs)
        return made[key]

    omap = keras.optimizers.OptimizerMap(one(*default))
    for key, (cls, kwargs) in mapped.items():
        omap[key] = one(cls, kwargs)
    multi = keras.optimizers.MultiOptimizer(omap, loss_scale_factor=factor)
    outer = multi if scale is None else keras.optimizers.LossScaleOptimizer(multi, initial_scale=scale)
    return multi, outer


def record(n, path):
    import keras
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    data, out = inputs(), {}
    for name in CONFIGS:
        if CONFIGS[name][3] is not None and n > 1:
            # Keras 3.15's LossScaleOptimizer around a MultiOptimizer fails under MirroredStrategy with more than
            # one replica (its cross-replica apply all-reduces the sub-optimizers' gradients in mismatched
            # collectives: "Shape mismatch in the collective instance"): recorded at one replica only.
            continue
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            variables = [keras_variable(keras, p, data[f"init|{p}"]) for p in MODEL]
            assert [v.path for v in variables] == list(MODEL)
            multi, outer = make(keras, name)
        for s in range(STEPS):
            def step(s=s):
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                grads = [tf.gather(tf.constant(data[f"grads|{p}"][s]), r) for p in MODEL]
                outer.apply_gradients(zip(grads, variables))
            strategy.run(step)
        prefix = f"{name}|{n}"
        for var, var_path in zip(variables, MODEL):
            out[f"{prefix}|{var_path}"] = var.numpy()
        out[f"{prefix}|iterations"] = np.array(int(multi.iterations.numpy()))
        for k, opt in enumerate(multi.optimizers):
            out[f"{prefix}|optimizer{k}|iterations"] = np.array(int(opt.iterations.numpy()))
            for var, var_path in zip(variables, MODEL):
                try:
                    i = opt._get_variable_index(var)
                except KeyError:
                    continue
                for slot, attribute in SLOTS[type(opt).__name__].items():
                    out[f"{prefix}|{var_path}|{slot}"] = getattr(opt, attribute)[i].numpy()
    np.savez(path, **out)


def _error(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the type is what is recorded)
        return [type(error).__name__, str(error)]
    return None


def record_rules():
    import keras
    import tensorflow as tf

    O = keras.optimizers
    rules = {}
    adam, sgd, rms = O.Adam(), O.SGD(), O.RMSprop()
    omap = O.OptimizerMap(default_optimizer=rms)
    omap["encoder/layer_0/dense"] = adam
    omap["encoder/.*"] = sgd
    omap["decoder"] = adam
    omap["dec.*/w|head"] = sgd
    names = {id(adam): "adam", id(sgd): "sgd", id(rms): "rms"}
    queries = ["decoder", "encoder/layer_0/dense", "encoder/layer_0/attention/query", "decoder/layer_0/dense",
               "encoder", "head", "decoder/w", "xencoder/a", "encoder/", "ENCODER/a"]
    rules["lookup"] = {q: names[id(omap[q])] for q in queries}
    rules["lookup_error"] = _error(lambda: omap["encoder/w"] if omap.__setitem__("enc.*", sgd) is None else None)
    rules["len_iter"] = [len(omap), list(omap)]
    rules["errors"] = {
        "default not an optimizer": _error(lambda: O.OptimizerMap("adam")),
        "map not a dict": _error(lambda: O.OptimizerMap(O.SGD(), [("a", O.Adam())])),
        "duplicate key": _error(lambda: omap.__setitem__("decoder", O.SGD())),
        "duplicate key, not an optimizer": _error(lambda: omap.__setitem__("decoder", 3)),
        "key not a string": _error(lambda: omap.__setitem__(3, O.SGD())),
        "value not an optimizer": _error(lambda: omap.__setitem__("x", "sgd")),
        "value a LossScaleOptimizer": _error(lambda: omap.__setitem__("x", O.LossScaleOptimizer(O.SGD()))),
        "value a MultiOptimizer": _error(lambda: omap.__setitem__("x", O.MultiOptimizer(O.OptimizerMap(O.SGD())))),
    }
    multi = O.MultiOptimizer(O.OptimizerMap(O.SGD()))
    rules["errors"]["learning_rate get"] = _error(lambda: multi.learning_rate)
    rules["errors"]["learning_rate set"] = _error(lambda: setattr(multi, "learning_rate", 0.1))
    rules["errors"]["apply without variables, not built"] = _error(lambda: multi.apply([np.ones(2, np.float32)]))
    rules["errors"]["set_weights, not built"] = _error(lambda: multi.set_weights([]))
    v = keras.Variable(np.ones(2, np.float32), name="v")
    u = keras.Variable(np.ones(3, np.float32), name="u")
    multi.build([v, u])
    rules["errors"]["apply, fewer gradients"] = _error(lambda: multi.apply([np.ones(2, np.float32)], [v]))
    for label, returned in (("a LossScaleOptimizer", lambda: O.LossScaleOptimizer(O.SGD())),
                            ("a MultiOptimizer", lambda: O.MultiOptimizer(O.OptimizerMap(O.SGD()))),
                            ("not an optimizer", lambda: "sgd")):
        selector = O.MultiOptimizer(lambda var, returned=returned: returned())
        rules["errors"][f"callable returns {label}"] = _error(lambda s=selector: s.build([v]))
    # A callable's optimizers join `optimizers` at build, in the order it returns them.
    made = {}
    selector = O.MultiOptimizer(lambda var: made.setdefault(var.path, O.Adam(name=f"adam_{var.path}")))
    selector.build([v, u])
    rules["callable optimizers"] = [opt.name for opt in selector.optimizers]
    # The map's optimizers in its order (each once), then the default; loss_scale_factor set on each (None too).
    a, s, r = O.Adam(loss_scale_factor=3.0), O.SGD(loss_scale_factor=3.0), O.RMSprop(loss_scale_factor=3.0)
    ordered = O.MultiOptimizer(O.OptimizerMap(r, {"x": s, "y": a, "z": s}))
    rules["order"] = [opt.name for opt in ordered.optimizers]
    rules["loss_scale_factor None"] = [opt.loss_scale_factor for opt in ordered.optimizers]
    ordered.loss_scale_factor = 2.0
    rules["loss_scale_factor set"] = [ordered.loss_scale_factor] + [opt.loss_scale_factor
                                                                    for opt in ordered.optimizers]
    scaled = O.MultiOptimizer(O.OptimizerMap(O.SGD(), {"x": O.Adam()}), loss_scale_factor=5.0, name="mo")
    rules["loss_scale_factor init"] = [scaled.loss_scale_factor] + [opt.loss_scale_factor
                                                                    for opt in scaled.optimizers]
    rules["names"] = [O.MultiOptimizer(O.OptimizerMap(O.SGD())).name, scaled.name]
    rules["config"] = O.serialize(O.MultiOptimizer(
        O.OptimizerMap(O.RMSprop(0.01), {"encoder/.*": O.Adam(0.05), "head": O.SGD(0.1, momentum=0.9)}),
        loss_scale_factor=2.0, name="multi"))
    rules["map config"] = O.OptimizerMap(O.SGD(0.5), {"a": O.Adam(0.25)}).get_config()
    # What a tf.train.Checkpoint of a built MultiOptimizer names (the sub-optimizers are not tracked).
    variables = [keras_variable(keras, p, np.ones(shape, np.float32)) for p, shape in MODEL.items()]
    multi, _ = make(keras, "exact regex default")
    multi.apply([np.ones(shape, np.float32) for shape in MODEL.values()], variables)
    directory = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_multi_optimizer_checkpoint")
    shutil.rmtree(directory, ignore_errors=True)
    path = tf.train.Checkpoint(optimizer=multi, model=variables).write(os.path.join(directory, "ckpt"))
    rules["checkpoint"] = [[key, shape] for key, shape in tf.train.list_variables(path)]
    rules["checkpoint iterations"] = [int(multi.iterations.numpy())] + [int(o.iterations.numpy())
                                                                        for o in multi.optimizers]
    rules["variables"] = [var.path for var in multi.variables]
    return rules


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    data = {}
    for n in REPLICAS:
        part = os.path.join(here, f".keras_multi_optimizer_{n}.npz")
        subprocess.run([sys.executable, __file__, str(n), part], check=True)
        with np.load(part) as recorded:
            data.update(recorded)
        os.remove(part)
    import keras
    import tensorflow as tf

    data.update(inputs())
    data["rules"] = np.array(json.dumps(record_rules()))
    data["configs"] = np.array(json.dumps(CONFIGS))
    data["versions"] = np.array(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    np.savez_compressed(os.path.join(here, "keras_multi_optimizer.npz"), **data)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        record(int(sys.argv[1]), sys.argv[2])
    else:
        main()
