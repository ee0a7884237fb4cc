"""Records Keras 3's Lamb and Adafactor under tf.distribute.MirroredStrategy as test data.

    /work/venvs/tf/bin/python tests/data/record_keras_lamb_adafactor.py

Writes keras_lamb_adafactor.npz beside this file (read by tests/test_optimizers_lamb_adafactor.py; the suite
never imports TensorFlow): record_keras_optimizers.py's model, gradients and replica counts (its `record`,
run here on these configurations), plus every slot after the last step.
"""

import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record_keras_optimizers as base  # noqa: E402

CONFIGS = {
    "Lamb default": ("Lamb", {}, "float32"),
    "Lamb": ("Lamb", {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5}, "float32"),
    "Lamb weight_decay clipnorm": ("Lamb", {"learning_rate": 0.02, "weight_decay": 0.1, "clipnorm": 1.0},
                                   "float32"),
    "Lamb use_ema accumulation": ("Lamb", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.8,
                                           "gradient_accumulation_steps": 2}, "float32"),
    "Lamb float64": ("Lamb", {"learning_rate": 0.01}, "float64"),
    "Lamb schedule": ("Lamb", {"learning_rate": {
        "class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.05, "decay_steps": 3,
                                                     "decay_rate": 0.5}}}, "float32"),
    "Adafactor default": ("Adafactor", {}, "float32"),
    "Adafactor": ("Adafactor", {"learning_rate": 0.05, "beta_2_decay": -0.5, "epsilon_2": 1e-2,
                                "clip_threshold": 0.5}, "float32"),
    "Adafactor large lr": ("Adafactor", {"learning_rate": 1.0, "epsilon_1": 1e-3}, "float32"),
    "Adafactor weight_decay global_clipnorm": ("Adafactor", {"learning_rate": 0.1, "weight_decay": 0.05,
                                                             "global_clipnorm": 2.0}, "float32"),
    "Adafactor relative_step off clipvalue": ("Adafactor", {"learning_rate": 0.3, "relative_step": False,
                                                            "clipvalue": 0.5}, "float32"),
    "Adafactor use_ema accumulation": ("Adafactor", {"learning_rate": 0.1, "use_ema": True,
                                                     "gradient_accumulation_steps": 3}, "float32"),
    "Adafactor float64": ("Adafactor", {"learning_rate": 0.2}, "float64"),
    "Adafactor schedule": ("Adafactor", {"learning_rate": {
        "class_name": "PiecewiseConstantDecay", "config": {"boundaries": [3, 7], "values": [0.5, 0.1, 0.02]}}},
        "float32"),
}
SLOTS = {"Lamb": ("_momentums", "_velocities"), "Adafactor": ("_r", "_c", "_v")}
NAMES = {"_momentums": "momentum", "_velocities": "velocity", "_r": "r", "_c": "c", "_v": "velocity"}

_extras = base.extras


def extras(opt, w, b):
    out = _extras(opt, w, b)
    for key, var in (("w", w), ("b", b)):
        i = opt._get_variable_index(var)
        for attribute in SLOTS[type(opt).__name__]:
            out[f"{NAMES[attribute]}_{key}"] = getattr(opt, attribute)[i].numpy()
    return out


# An IndexedSlices gradient naming row 1 twice: Keras' TF backend squares the slices one by one.
SPARSE_W0 = np.arange(12, dtype=np.float32).reshape(4, 3) / 7 - 0.5
SPARSE_VALUES = np.array([[1., 2., 3.], [0.5, -1., 2.], [4., 0., -2.]], np.float32)
SPARSE_INDICES = np.array([1, 1, 3])


def record_sparse(data):
    import keras
    import tensorflow as tf

    for cls in ("Lamb", "Adafactor"):
        w = tf.Variable(SPARSE_W0)
        opt = getattr(keras.optimizers, cls)(0.1)
        g = tf.IndexedSlices(tf.constant(SPARSE_VALUES), tf.constant(SPARSE_INDICES), tf.constant([4, 3]))
        for _ in range(3):
            opt.apply_gradients([(g, w)])
        data[f"sparse|{cls}"] = w.numpy()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    data = {}
    for n in base.REPLICAS:
        for dtype in sorted({dtype for _, _, dtype in CONFIGS.values()}):
            part = os.path.join(here, f".keras_lamb_adafactor_{n}_{dtype}.npz")
            subprocess.run([sys.executable, __file__, str(n), dtype, part], check=True)
            with np.load(part) as recorded:
                data.update(recorded)
            os.remove(part)
    record_sparse(data)
    import keras
    import tensorflow as tf

    data["configs"] = np.array(json.dumps(CONFIGS))
    data["versions"] = np.array(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    np.savez_compressed(os.path.join(here, "keras_lamb_adafactor.npz"), **data)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        base.CONFIGS, base.extras = CONFIGS, extras
        base.record(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    else:
        main()
