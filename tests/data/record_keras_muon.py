"""Records Keras 3's Muon under tf.distribute.MirroredStrategy as test data.

    /work/venvs/tf/bin/python tests/data/record_keras_muon.py

Writes keras_muon.npz beside this file (read by tests/test_optimizers_muon.py; the suite never imports
TensorFlow). A model of VARIABLES (each routed to Muon's own step or to its AdamW step by Keras' rules: the
2-D ones to Muon unless excluded by name or an embedding) trains STEPS steps at 1, 2 and 4 replicas (logical
CPU devices); replica r of step s passes gradient grads[s, r]. Recorded after the last step: every variable,
every slot (momentum for all, velocity for the AdamW-routed ones), the moving averages and `iterations`.
"""

import json
import os
import subprocess
import sys

import numpy as np

STEPS = 6
REPLICAS = (1, 2, 4)
# (path, shape): Keras' variable.path, which md's variable name (without ":0") stands for.
VARIABLES = (
    ("dense/kernel", (6, 6)),             # square: Muon
    ("dense/bias", (6,)),                 # 1-D: AdamW
    ("tall/kernel", (8, 3)),              # tall: Muon, transposed for Newton-Schulz
    ("wide/kernel", (3, 7)),              # wide: Muon
    ("dense_1/kernel", (6, 6)),           # the square's shape again: one batched iteration for both
    ("conv/kernel", (3, 3, 2, 4)),        # 4-D: AdamW
    ("conv1d/kernel", (3, 2, 4)),         # 3-D: AdamW
    ("output_dense/kernel", (6, 2)),      # 2-D, excluded by name (exclude_layers): AdamW
    ("token_embedding/embeddings", (10, 4)),  # 2-D embedding (exclude_embeddings): AdamW
)
EXCLUDE = {"exclude_layers": ["output_dense"]}
CONFIGS = {
    "Muon default": ("Muon", {}, "float32"),
    "Muon excluded": ("Muon", {"learning_rate": 0.02, **EXCLUDE}, "float32"),
    "Muon no nesterov": ("Muon", {"learning_rate": 0.05, "momentum": 0.8, "nesterov": False, **EXCLUDE}, "float32"),
    "Muon no decay": ("Muon", {"learning_rate": 0.05, "weight_decay": None, "adam_weight_decay": None}, "float32"),
    "Muon decay": ("Muon", {"learning_rate": 0.05, "weight_decay": 0.1, "adam_weight_decay": 0.3,
                            "exclude_embeddings": False, **EXCLUDE}, "float32"),
    "Muon coefficients": ("Muon", {"learning_rate": 0.03, "ns_steps": 3, "muon_a": 3.0, "muon_b": -3.2,
                                   "muon_c": 1.2, "rms_rate": None, "adam_lr_ratio": 0.1, "adam_beta_1": 0.8,
                                   "adam_beta_2": 0.99, "epsilon": 1e-5, **EXCLUDE}, "float32"),
    "Muon clipnorm": ("Muon", {"learning_rate": 0.05, "clipnorm": 1.0, **EXCLUDE}, "float32"),
    "Muon global_clipnorm": ("Muon", {"learning_rate": 0.05, "global_clipnorm": 2.0}, "float32"),
    "Muon clipvalue": ("Muon", {"learning_rate": 0.05, "clipvalue": 0.5}, "float32"),
    "Muon use_ema accumulation": ("Muon", {"learning_rate": 0.05, "use_ema": True, "ema_momentum": 0.8,
                                           "gradient_accumulation_steps": 2, **EXCLUDE}, "float32"),
    "Muon loss_scale_factor": ("Muon", {"learning_rate": 0.05, "loss_scale_factor": 4.0}, "float32"),
    "Muon schedule": ("Muon", {"learning_rate": {
        "class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.1, "decay_steps": 2,
                                                     "decay_rate": 0.5}}, **EXCLUDE}, "float32"),
    # Keras multiplies a float64 Muon step by a float32 sqrt (and fails) unless rms_rate is None.
    "Muon float64": ("Muon", {"learning_rate": 0.05, "rms_rate": None, **EXCLUDE}, "float64"),
}
# The configurations recorded at 2 and 4 replicas too (every one at 1): those where the replicas' gradients
# meet something besides their sum (clipping per replica, accumulation per replica) and the main ones.
SEVERAL_REPLICAS = ("Muon default", "Muon excluded", "Muon decay", "Muon clipnorm", "Muon global_clipnorm",
                    "Muon use_ema accumulation")


def inputs():
    rng = np.random.RandomState(36)
    data = {}
    for i, (path, shape) in enumerate(VARIABLES):
        data[f"w0_{i}"] = rng.randn(*shape)
        data[f"grads_{i}"] = rng.randn(STEPS, max(REPLICAS), *shape) * 1.5
    return data


def _build(keras, cls, kwargs):
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("learning_rate"), dict):
        kwargs["learning_rate"] = keras.optimizers.schedules.deserialize(kwargs["learning_rate"])
    return getattr(keras.optimizers, cls)(**kwargs)


def _variable(keras, path, value):
    scope, name = path.split("/")
    with keras.name_scope(scope):
        return keras.Variable(value, name=name)


def record(n, dtype_wanted, out_path):
    """One replica count and dtype per process: TF's collective keys clash across strategies of other sizes."""
    import keras
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    data, out = inputs(), {}
    for name, (cls, kwargs, dtype) in CONFIGS.items():
        if dtype != dtype_wanted or (n > 1 and name not in SEVERAL_REPLICAS):
            continue
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            variables = [_variable(keras, path, data[f"w0_{i}"].astype(dtype)) for i, (path, _) in enumerate(VARIABLES)]
            opt = _build(keras, cls, kwargs)
        for s in range(STEPS):
            def step(s=s):
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                grads = [tf.gather(tf.constant(data[f"grads_{i}"][s].astype(dtype)), r) for i in range(len(VARIABLES))]
                opt.apply_gradients(zip(grads, variables))
            strategy.run(step)
        out[f"{name}|{n}|iterations"] = np.array(int(opt.iterations.numpy()))
        for i, var in enumerate(variables):
            out[f"{name}|{n}|w_{i}"] = var.numpy()
            k = opt._get_variable_index(var)
            out[f"{name}|{n}|momentum_{i}"] = opt.momentums[k].numpy()
            if opt.adam_velocities[k] is not None:
                out[f"{name}|{n}|velocity_{i}"] = opt.adam_velocities[k].numpy()
            if opt.use_ema:
                out[f"{name}|{n}|average_{i}"] = opt._model_variables_moving_average[k].numpy()
        out[f"{name}|{n}|slot_paths"] = np.array(json.dumps([v.path for v in opt.variables]))
    np.savez(out_path, **out)


# An IndexedSlices gradient of the embedding (AdamW-routed: Keras squares the slices one by one) beside a
# dense one of a Muon-routed kernel, on one device.
SPARSE_W0 = np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5
SPARSE_VALUES = np.array([[1., 2., 3.], [0.5, -1., 2.], [4., 0., -2.]], np.float32)
SPARSE_INDICES = np.array([1, 1, 3])
SPARSE_KERNEL_GRAD = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)


def record_sparse(data):
    import keras
    import tensorflow as tf

    emb = _variable(keras, "embedding/embeddings", SPARSE_W0)
    kernel = _variable(keras, "dense/kernel", np.ones((5, 3), np.float32))
    opt = keras.optimizers.Muon(0.1)
    g = tf.IndexedSlices(tf.constant(SPARSE_VALUES), tf.constant(SPARSE_INDICES), tf.constant([4, 3]))
    for _ in range(3):
        opt.apply_gradients([(g, emb), (tf.constant(SPARSE_KERNEL_GRAD), kernel)])
    data["sparse|embeddings"] = emb.numpy()
    data["sparse|kernel"] = kernel.numpy()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    data = inputs()
    parts = {(n, dtype): os.path.join(here, f".keras_muon_{n}_{dtype}.npz") for n in REPLICAS
             for dtype in sorted({dtype for name, (_, _, dtype) in CONFIGS.items()
                                  if n == 1 or name in SEVERAL_REPLICAS})}
    running = [subprocess.Popen([sys.executable, __file__, str(n), dtype, part]) for (n, dtype), part in parts.items()]
    if any(p.wait() != 0 for p in running):
        raise RuntimeError("a recording process failed")
    for part in parts.values():
        with np.load(part) as recorded:
            data.update(recorded)
        os.remove(part)
    record_sparse(data)
    import keras
    import tensorflow as tf

    data["configs"] = np.array(json.dumps(CONFIGS))
    data["variables"] = np.array(json.dumps(VARIABLES))
    data["versions"] = np.array(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    np.savez_compressed(os.path.join(here, "keras_muon.npz"), **data)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        record(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    else:
        main()
