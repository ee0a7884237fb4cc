"""Records Keras 3's ScheduleFreeAdamW under tf.distribute.MirroredStrategy as test data.

    /work/venvs/tf/bin/python tests/data/record_keras_schedule_free.py

Writes keras_schedule_free.npz beside this file (read by tests/test_optimizers_schedule_free.py; the suite never
imports TensorFlow): record_keras_optimizers.py's model, gradients and replica counts (its `record`, run here on
these configurations), plus both slots after the last step, and an IndexedSlices case.
"""

import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record_keras_optimizers as base  # noqa: E402

C = "ScheduleFreeAdamW"
CONFIGS = {
    "default": (C, {}, "float32"),
    "betas epsilon": (C, {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6}, "float32"),
    "warmup": (C, {"learning_rate": 0.05, "warmup_steps": 5}, "float32"),
    "warmup float": (C, {"learning_rate": 0.05, "warmup_steps": 2.5}, "float32"),
    "beta_1 one": (C, {"learning_rate": 0.02, "beta_1": 1.0, "warmup_steps": 2}, "float32"),
    "weight_decay clipnorm warmup": (C, {"learning_rate": 0.02, "weight_decay": 0.1, "clipnorm": 1.0,
                                         "warmup_steps": 3}, "float32"),
    "global_clipnorm": (C, {"learning_rate": 0.02, "global_clipnorm": 2.0}, "float32"),
    "clipvalue weight_decay": (C, {"learning_rate": 0.01, "clipvalue": 0.5, "weight_decay": 0.05}, "float32"),
    "use_ema accumulation warmup": (C, {"learning_rate": 0.02, "use_ema": True, "ema_momentum": 0.8,
                                        "gradient_accumulation_steps": 2, "warmup_steps": 2}, "float32"),
    "use_ema overwrite loss_scale": (C, {"learning_rate": 0.01, "use_ema": True, "ema_overwrite_frequency": 3,
                                         "loss_scale_factor": 4.0}, "float32"),
    "float64 warmup weight_decay": (C, {"learning_rate": 0.01, "warmup_steps": 4, "weight_decay": 0.01},
                                    "float64"),
    "float16": (C, {"learning_rate": 0.01}, "float16"),
    "ExponentialDecay": (C, {"learning_rate": {
        "class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.05, "decay_steps": 3,
                                                     "decay_rate": 0.5}}}, "float32"),
    "CosineDecay warmup_steps": (C, {"warmup_steps": 3, "learning_rate": {
        "class_name": "CosineDecay", "config": {"initial_learning_rate": 0.0, "decay_steps": 6,
                                                "warmup_target": 0.05, "warmup_steps": 4}}}, "float32"),
}
SLOTS = ("momentum", "velocity")

_extras = base.extras


def extras(opt, w, b):
    out = _extras(opt, w, b)
    for key, var in (("w", w), ("b", b)):
        i = opt._get_variable_index(var)
        out[f"momentum_{key}"] = opt._momentums[i].numpy()
        out[f"velocity_{key}"] = opt._velocities[i].numpy()
    return out


# An IndexedSlices gradient naming row 1 twice: Keras' TF backend squares the slices one by one.
SPARSE_W0 = np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5
SPARSE_VALUES = np.array([[1., 2., 3.], [0.5, -1., 2.], [4., 0., -2.]], np.float32)
SPARSE_INDICES = np.array([1, 1, 3])


def record_sparse(data):
    import keras
    import tensorflow as tf

    w = tf.Variable(SPARSE_W0)
    opt = keras.optimizers.ScheduleFreeAdamW(0.1, warmup_steps=2)
    g = tf.IndexedSlices(tf.constant(SPARSE_VALUES), tf.constant(SPARSE_INDICES), tf.constant([4, 3]))
    for _ in range(3):
        opt.apply_gradients([(g, w)])
    data["sparse|w"] = w.numpy()
    data["sparse|momentum"] = opt._momentums[0].numpy()
    data["sparse|velocity"] = opt._velocities[0].numpy()


def record_facts(data):
    """Keras' defaults, default name and variable names (build order)."""
    import keras
    import tensorflow as tf

    opt = keras.optimizers.ScheduleFreeAdamW()
    w, b = tf.Variable(np.ones((3, 4), np.float32), name="w"), tf.Variable(np.ones(4, np.float32), name="b")
    opt.build([w, b])
    data["facts"] = np.array(json.dumps({
        "config": opt.get_config(), "variables": [[v.path, list(v.shape), v.dtype] for v in opt.variables]}))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    data = {}
    for n in base.REPLICAS:
        for dtype in sorted({dtype for _, _, dtype in CONFIGS.values()}):
            part = os.path.join(here, f".keras_schedule_free_{n}_{dtype}.npz")
            subprocess.run([sys.executable, __file__, str(n), dtype, part], check=True)
            with np.load(part) as recorded:
                data.update(recorded)
            os.remove(part)
    record_sparse(data)
    record_facts(data)
    import keras
    import tensorflow as tf

    data["configs"] = np.array(json.dumps(CONFIGS))
    data["versions"] = np.array(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    np.savez_compressed(os.path.join(here, "keras_schedule_free.npz"), **data)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        base.CONFIGS, base.extras = CONFIGS, extras
        base.record(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    else:
        main()
