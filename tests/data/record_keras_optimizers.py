"""Records Keras 3 optimizers' results under tf.distribute.MirroredStrategy as test data.

    /work/venvs/tf/bin/python tests/data/record_keras_optimizers.py

Writes keras_optimizers.npz beside this file (read by tests/test_optimizer_keras_parity.py; the suite
never imports TensorFlow). Every configuration trains two float32 variables (and, for the float64 rows,
float64 ones) for STEPS steps at 1, 2 and 4 replicas (logical CPU devices); replica r of step s passes
gradient grads[s, r], so clipping (per replica, before the all-reduce, as Keras does) and the summing
across replicas are both exercised.
"""

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
import keras

STEPS = 12
REPLICAS = (1, 2, 4)
CONFIGS = {
    "SGD": ("SGD", {"learning_rate": 0.1}, "float32"),
    "SGD momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, "float32"),
    "SGD nesterov": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}, "float32"),
    "SGD default": ("SGD", {}, "float32"),
    "Adam": ("Adam", {"learning_rate": 0.01}, "float32"),
    "Adam betas": ("Adam", {"learning_rate": 0.02, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-5}, "float32"),
    "AdamW default": ("AdamW", {}, "float32"),
    "AdamW": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}, "float32"),
    "RMSprop default": ("RMSprop", {}, "float32"),
    "RMSprop momentum": ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.9}, "float32"),
    "RMSprop centered": ("RMSprop", {"learning_rate": 0.01, "centered": True}, "float32"),
    "RMSprop centered momentum": ("RMSprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True},
                                  "float32"),
    "Adagrad default": ("Adagrad", {}, "float32"),
    "Adagrad": ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.5, "epsilon": 1e-5},
                "float32"),
    "Nadam default": ("Nadam", {}, "float32"),
    "Nadam": ("Nadam", {"learning_rate": 0.02, "beta_1": 0.8, "beta_2": 0.99}, "float32"),
    "SGD clipnorm": ("SGD", {"learning_rate": 0.1, "clipnorm": 1.0}, "float32"),
    "SGD clipvalue": ("SGD", {"learning_rate": 0.1, "clipvalue": 0.5}, "float32"),
    "SGD global_clipnorm": ("SGD", {"learning_rate": 0.1, "global_clipnorm": 2.0}, "float32"),
    "Adam clipnorm": ("Adam", {"learning_rate": 0.01, "clipnorm": 1.0}, "float32"),
    "SGD momentum weight_decay": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.05},
                                  "float32"),
    "Adam weight_decay global_clipnorm": ("Adam", {"learning_rate": 0.01, "weight_decay": 0.1,
                                                   "global_clipnorm": 1.5}, "float32"),
    "RMSprop clipvalue weight_decay": ("RMSprop", {"learning_rate": 0.01, "clipvalue": 0.5,
                                                   "weight_decay": 0.2}, "float32"),
    "SGD momentum float64": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, "float64"),
    "Adam float64": ("Adam", {"learning_rate": 0.01}, "float64"),
    "Nadam float64": ("Nadam", {"learning_rate": 0.01}, "float64"),
    # Keras 3's amsgrad, moving average (EMA), loss scale factor and gradient accumulation.
    "Adam amsgrad": ("Adam", {"learning_rate": 0.01, "amsgrad": True}, "float32"),
    "Adam amsgrad betas clipnorm": ("Adam", {"learning_rate": 0.02, "beta_1": 0.8, "beta_2": 0.5, "amsgrad": True,
                                             "clipnorm": 1.0}, "float32"),
    "AdamW amsgrad": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1, "amsgrad": True}, "float32"),
    "Adam amsgrad float64": ("Adam", {"learning_rate": 0.01, "beta_2": 0.5, "amsgrad": True}, "float64"),
    "Adam use_ema": ("Adam", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}, "float32"),
    "SGD momentum use_ema overwrite": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "use_ema": True,
                                              "ema_momentum": 0.8, "ema_overwrite_frequency": 5}, "float32"),
    "RMSprop use_ema default momentum": ("RMSprop", {"learning_rate": 0.01, "use_ema": True}, "float32"),
    "Adam use_ema overwrite float64": ("Adam", {"learning_rate": 0.01, "use_ema": True,
                                                "ema_overwrite_frequency": 4}, "float64"),
    "SGD loss_scale_factor": ("SGD", {"learning_rate": 0.1, "loss_scale_factor": 8.0}, "float32"),
    "Adam loss_scale_factor clipnorm": ("Adam", {"learning_rate": 0.01, "loss_scale_factor": 0.3, "clipnorm": 1.0},
                                        "float32"),
    "Adam gradient_accumulation_steps": ("Adam", {"learning_rate": 0.01, "gradient_accumulation_steps": 3},
                                         "float32"),
    "SGD momentum accumulation clipnorm weight_decay": ("SGD", {"learning_rate": 0.1, "momentum": 0.9,
                                                               "gradient_accumulation_steps": 4, "clipnorm": 1.0,
                                                               "weight_decay": 0.05}, "float32"),
    "Nadam gradient_accumulation_steps": ("Nadam", {"learning_rate": 0.02, "gradient_accumulation_steps": 2},
                                          "float32"),
    "Adam accumulation float64": ("Adam", {"learning_rate": 0.01, "gradient_accumulation_steps": 5}, "float64"),
    "AdamW amsgrad use_ema accumulation loss_scale": ("AdamW", {
        "learning_rate": 0.01, "amsgrad": True, "use_ema": True, "ema_momentum": 0.7, "ema_overwrite_frequency": 2,
        "gradient_accumulation_steps": 2, "loss_scale_factor": 4.0}, "float32"),
    # Adamax, Adadelta, Lion and Ftrl.
    "Adamax default": ("Adamax", {}, "float32"),
    "Adamax": ("Adamax", {"learning_rate": 0.02, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-5}, "float32"),
    "Adamax weight_decay clipnorm": ("Adamax", {"learning_rate": 0.01, "weight_decay": 0.1, "clipnorm": 1.0},
                                     "float32"),
    "Adamax float64": ("Adamax", {"learning_rate": 0.01}, "float64"),
    "Adadelta default": ("Adadelta", {}, "float32"),
    "Adadelta": ("Adadelta", {"learning_rate": 1.0, "rho": 0.9, "epsilon": 1e-6}, "float32"),
    "Adadelta clipvalue weight_decay": ("Adadelta", {"learning_rate": 0.5, "clipvalue": 0.5, "weight_decay": 0.05},
                                        "float32"),
    "Adadelta float64": ("Adadelta", {"learning_rate": 1.0}, "float64"),
    "Lion default": ("Lion", {}, "float32"),
    "Lion": ("Lion", {"learning_rate": 0.01, "beta_1": 0.5, "beta_2": 0.9}, "float32"),
    "Lion weight_decay global_clipnorm": ("Lion", {"learning_rate": 0.01, "weight_decay": 0.1,
                                                   "global_clipnorm": 1.5}, "float32"),
    "Lion float64": ("Lion", {"learning_rate": 0.01, "beta_1": 1.0}, "float64"),
    "Ftrl default": ("Ftrl", {}, "float32"),
    "Ftrl regularized": ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01,
                                  "l2_regularization_strength": 0.02, "l2_shrinkage_regularization_strength": 0.03,
                                  "beta": 0.5}, "float32"),
    "Ftrl power": ("Ftrl", {"learning_rate": 0.05, "learning_rate_power": -0.3, "initial_accumulator_value": 0.5,
                            "l1_regularization_strength": 0.5, "clipnorm": 1.0}, "float32"),
    "Ftrl power zero": ("Ftrl", {"learning_rate": 0.05, "learning_rate_power": 0.0}, "float32"),
    "Ftrl float64": ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "beta": 0.1}, "float64"),
    "Adamax use_ema accumulation": ("Adamax", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.8,
                                               "gradient_accumulation_steps": 3}, "float32"),
    "Lion use_ema overwrite loss_scale": ("Lion", {"learning_rate": 0.01, "use_ema": True,
                                                   "ema_overwrite_frequency": 3, "loss_scale_factor": 2.0}, "float32"),
    "Adadelta accumulation": ("Adadelta", {"learning_rate": 1.0, "gradient_accumulation_steps": 2}, "float32"),
    "Ftrl use_ema accumulation": ("Ftrl", {"learning_rate": 0.1, "use_ema": True,
                                           "gradient_accumulation_steps": 4}, "float32"),
    "Adamax float16": ("Adamax", {"learning_rate": 0.01}, "float16"),
    "Adadelta float16": ("Adadelta", {"learning_rate": 1.0}, "float16"),
    "Lion float16": ("Lion", {"learning_rate": 0.01}, "float16"),
    "Ftrl float16": ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01}, "float16"),
    # Learning-rate schedules (keras.optimizers.schedules, serialized) as `learning_rate`.
    "SGD momentum ExponentialDecay": ("SGD", {"momentum": 0.9, "learning_rate": {
        "class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.1, "decay_steps": 3,
                                                     "decay_rate": 0.5, "staircase": True}}}, "float32"),
    "Adam CosineDecay warmup": ("Adam", {"learning_rate": {
        "class_name": "CosineDecay", "config": {"initial_learning_rate": 0.0, "decay_steps": 6,
                                                "warmup_target": 0.05, "warmup_steps": 4}}}, "float32"),
    "Adamax CosineDecayRestarts float64": ("Adamax", {"learning_rate": {
        "class_name": "CosineDecayRestarts", "config": {"initial_learning_rate": 0.05, "first_decay_steps": 3,
                                                        "t_mul": 1.5, "m_mul": 0.7, "alpha": 0.1}}}, "float64"),
    "Lion PiecewiseConstantDecay accumulation": ("Lion", {"gradient_accumulation_steps": 2, "learning_rate": {
        "class_name": "PiecewiseConstantDecay", "config": {"boundaries": [3, 7], "values": [0.03, 0.01, 0.003]}}},
        "float32"),
    "Ftrl PolynomialDecay cycle": ("Ftrl", {"learning_rate": {
        "class_name": "PolynomialDecay", "config": {"initial_learning_rate": 0.2, "decay_steps": 5, "power": 2.0,
                                                    "cycle": True}}}, "float32"),
    "Adadelta InverseTimeDecay weight_decay": ("Adadelta", {"weight_decay": 0.1, "learning_rate": {
        "class_name": "InverseTimeDecay", "config": {"initial_learning_rate": 1.0, "decay_steps": 2,
                                                     "decay_rate": 0.5}}}, "float32"),
}


def build(optimizers, cls, kwargs):
    """``optimizers.<cls>(**kwargs)``, a serialized schedule as learning_rate made by ``optimizers.schedules``."""
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("learning_rate"), dict):
        kwargs["learning_rate"] = optimizers.schedules.deserialize(kwargs["learning_rate"])
    return getattr(optimizers, cls)(**kwargs)


def extras(opt, w, b):
    """What Keras keeps beside the slots each test compares: velocity_hat, the moving averages, each
    replica's gradient accumulators, and `iterations` (floor-divided under gradient accumulation)."""
    out = {"iterations": np.array(int(opt.iterations.numpy()))}
    for key, var in (("w", w), ("b", b)):
        i = opt._get_variable_index(var)
        if getattr(opt, "amsgrad", False):
            out[f"velocity_hat_{key}"] = opt._velocity_hats[i].numpy()
        if opt.use_ema:
            out[f"average_{key}"] = opt._model_variables_moving_average[i].numpy()
        if opt.gradient_accumulation_steps:
            out[f"accumulator_{key}"] = np.stack([v.numpy() for v in opt._accumulated_gradients[i].value.values])
    return out


def inputs():
    rng = np.random.RandomState(17)
    return {
        "w0": rng.randn(3, 4), "b0": rng.randn(4),
        # Large enough that every clipping argument above is active on most steps.
        "grads_w": rng.randn(STEPS, max(REPLICAS), 3, 4) * 1.5,
        "grads_b": rng.randn(STEPS, max(REPLICAS), 4),
    }


def record(n, dtype_wanted, path):
    """One replica count and dtype per process: TF's collective keys clash across strategies of other
    sizes, and across dtypes."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    data, out = inputs(), {}
    for name, (cls, kwargs, dtype) in CONFIGS.items():
        if dtype != dtype_wanted:
            continue
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            w = tf.Variable(data["w0"].astype(dtype))
            b = tf.Variable(data["b0"].astype(dtype))
            opt = build(keras.optimizers, cls, kwargs)
        for s in range(STEPS):
            def step(s=s):
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                gw = tf.gather(tf.constant(data["grads_w"][s].astype(dtype)), r)
                gb = tf.gather(tf.constant(data["grads_b"][s].astype(dtype)), r)
                opt.apply_gradients([(gw, w), (gb, b)])
            strategy.run(step)
        out[f"{name}|{n}|w"] = w.numpy()
        out[f"{name}|{n}|b"] = b.numpy()
        for key, value in extras(opt, w, b).items():
            out[f"{name}|{n}|{key}"] = value
        if opt.use_ema:  # the end of training: every variable takes its average
            with strategy.scope():
                opt.finalize_variable_values([w, b])
            out[f"{name}|{n}|final_w"] = w.numpy()
            out[f"{name}|{n}|final_b"] = b.numpy()
    np.savez(path, **out)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    data = inputs()
    for n in REPLICAS:
        for dtype in sorted({dtype for _, _, dtype in CONFIGS.values()}):
            part = os.path.join(here, f".keras_optimizers_{n}_{dtype}.npz")
            subprocess.run([sys.executable, __file__, str(n), dtype, part], check=True)
            with np.load(part) as recorded:
                data.update(recorded)
            os.remove(part)
    data["configs"] = np.array(json.dumps(CONFIGS))
    data["versions"] = np.array(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    np.savez_compressed(os.path.join(here, "keras_optimizers.npz"), **data)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        record(int(sys.argv[1]), sys.argv[2], sys.argv[3])
    else:
        main()
