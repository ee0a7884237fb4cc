"""Record what Keras 3 (TF 2.21, Keras 3.15) writes for an optimizer in a tf.train.Checkpoint, and how a fresh
optimizer continues from it: tests/data/keras_optimizer_checkpoints.json and the checkpoints themselves
(tests/data/keras_optimizer_checkpoints/<case>_<replicas>/ckpt.*), read by tests/test_checkpoint_keras_optimizer.py.

Run with the TensorFlow side venv (never imported by the package or its tests):
    /work/venvs/tf/bin/python tests/data/record_keras_optimizer_checkpoints.py [case ...]

Per case (an optimizer configuration) and replica count (1: no strategy, 2: MirroredStrategy over two logical
CPUs): a model {w: (3, 2), b: (2,)} takes STEPS steps of the recorded gradients (every replica the same), the
checkpoint is written, and the same model and optimizer take STEPS more steps ("continued"). A fresh model and
optimizer then read the file (Checkpoint.read: no save_counter to report; the status before their first step
shows the slots waiting for the build), and take the same STEPS steps ("resumed"). Names, shapes and dtypes are
those of tf.train.list_variables / load_checkpoint.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "keras_optimizer_checkpoints")
STEPS = 3


class Halving(keras.optimizers.schedules.LearningRateSchedule):
    """0.1 for steps 0 and 1, 0.05 after (mirrored: ``lambda step: 0.1 if step < 2 else 0.05``)."""

    def __call__(self, step):
        return tf.where(step < 2, tf.constant(0.1, tf.float32), tf.constant(0.05, tf.float32))

    def get_config(self):
        return {}


O = keras.optimizers
# case -> (constructor, the same constructor's description for mirrored: class name, keyword arguments)
CASES = {
    "sgd": (lambda: O.SGD(0.1), ("SGD", {"learning_rate": 0.1})),
    "sgd_momentum": (lambda: O.SGD(0.1, momentum=0.9), ("SGD", {"learning_rate": 0.1, "momentum": 0.9})),
    "sgd_nesterov": (lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
                     ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True})),
    "adam": (lambda: O.Adam(0.1), ("Adam", {"learning_rate": 0.1})),
    "adam_amsgrad": (lambda: O.Adam(0.1, amsgrad=True), ("Adam", {"learning_rate": 0.1, "amsgrad": True})),
    "adamw": (lambda: O.AdamW(0.1, weight_decay=0.01), ("AdamW", {"learning_rate": 0.1, "weight_decay": 0.01})),
    "rmsprop": (lambda: O.RMSprop(0.1), ("RMSprop", {"learning_rate": 0.1})),
    "rmsprop_centered_momentum": (lambda: O.RMSprop(0.1, momentum=0.5, centered=True),
                                  ("RMSprop", {"learning_rate": 0.1, "momentum": 0.5, "centered": True})),
    "adagrad": (lambda: O.Adagrad(0.1), ("Adagrad", {"learning_rate": 0.1})),
    "nadam": (lambda: O.Nadam(0.1), ("Nadam", {"learning_rate": 0.1})),
    "adamax": (lambda: O.Adamax(0.1), ("Adamax", {"learning_rate": 0.1})),
    "adadelta": (lambda: O.Adadelta(1.0), ("Adadelta", {"learning_rate": 1.0})),
    "lion": (lambda: O.Lion(0.1), ("Lion", {"learning_rate": 0.1})),
    "ftrl": (lambda: O.Ftrl(0.1, l1_regularization_strength=0.01, beta=0.1),
             ("Ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "beta": 0.1})),
    "adam_ema": (lambda: O.Adam(0.1, use_ema=True, ema_momentum=0.5),
                 ("Adam", {"learning_rate": 0.1, "use_ema": True, "ema_momentum": 0.5})),
    "sgd_momentum_accumulation": (lambda: O.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
                                  ("SGD", {"learning_rate": 0.1, "momentum": 0.9,
                                           "gradient_accumulation_steps": 2})),
    "adam_all": (lambda: O.Adam(0.1, amsgrad=True, use_ema=True, ema_momentum=0.5, gradient_accumulation_steps=2),
                 ("Adam", {"learning_rate": 0.1, "amsgrad": True, "use_ema": True, "ema_momentum": 0.5,
                           "gradient_accumulation_steps": 2})),
    "adam_schedule": (lambda: O.Adam(Halving()), ("Adam", {"learning_rate": "halving"})),
    "loss_scale_sgd_momentum": (lambda: O.LossScaleOptimizer(O.SGD(0.1, momentum=0.9), initial_scale=4.0),
                                ("LossScaleOptimizer", {"inner": ["SGD", {"learning_rate": 0.1, "momentum": 0.9}],
                                                        "initial_scale": 4.0})),
    "loss_scale_adam": (lambda: O.LossScaleOptimizer(O.Adam(0.1), initial_scale=4.0),
                        ("LossScaleOptimizer", {"inner": ["Adam", {"learning_rate": 0.1}], "initial_scale": 4.0})),
    "lamb": (lambda: O.Lamb(0.1, weight_decay=0.01), ("Lamb", {"learning_rate": 0.1, "weight_decay": 0.01})),
    # (Adafactor's r and c of the 1-D b are int32 scalars in Keras' checkpoints.)
    "adafactor": (lambda: O.Adafactor(0.5), ("Adafactor", {"learning_rate": 0.5})),
    "schedule_free_adamw": (lambda: O.ScheduleFreeAdamW(0.1, warmup_steps=2, weight_decay=0.01),
                            ("ScheduleFreeAdamW", {"learning_rate": 0.1, "warmup_steps": 2, "weight_decay": 0.01})),
}

W0 = np.arange(6, dtype=np.float32).reshape(3, 2) / 4 - 0.5
B0 = np.array([0.25, -0.75], np.float32)


def grads(step):
    """Step ``step``'s gradients (float32, exact in binary)."""
    gw = (np.arange(6, dtype=np.float32).reshape(3, 2) - 2.5) / 8 * (1 + (step % 3))
    gb = np.array([0.5, -0.25], np.float32) * (step - 2)
    return gw, gb


def strategy(n):
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)]) if n > 1 else tf.distribute.get_strategy()


def replicas(v, s):
    return [np.asarray(x).tolist() for x in s.experimental_local_results(v)]


def train(s, model, opt, first, count):
    for k in range(first, first + count):
        gw, gb = grads(k)

        def step():
            opt.apply_gradients([(tf.constant(gw), model["w"]), (tf.constant(gb), model["b"])])

        s.run(step)


def status_of(status):
    try:
        status.assert_consumed()
        return "consumed"
    except AssertionError as e:
        return "unresolved: " + str(e).split("checkpoint_key: ")[1].split("\n")[0] if "checkpoint_key" in str(e) \
            else "unresolved"


def record(case, make, n):
    s = strategy(n)
    with s.scope():
        model = {"w": tf.Variable(W0), "b": tf.Variable(B0)}
        opt = make()
    train(s, model, opt, 0, STEPS)
    directory = os.path.join(OUT, f"{case}_{n}")
    shutil.rmtree(directory, ignore_errors=True)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(os.path.join(directory, "ckpt"))
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    names = [[name, shape, dtypes[name].name] for name, shape in tf.train.list_variables(path)
             if name != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    values = {name: np.asarray(reader.get_tensor(name)).tolist() for name, _, _ in names}
    train(s, model, opt, STEPS, STEPS)
    continued = {k: replicas(v, s) for k, v in model.items()}
    with s.scope():
        model2 = {"w": tf.Variable(np.zeros_like(W0)), "b": tf.Variable(np.zeros_like(B0))}
        opt2 = make()
    status = tf.train.Checkpoint(model=model2, optimizer=opt2).read(path)
    before = status_of(status)
    train(s, model2, opt2, STEPS, STEPS)
    return {"names": names, "values": values, "continued": continued,
            "resumed": {k: replicas(v, s) for k, v in model2.items()},
            "status_before_build": before, "status_after_build": status_of(status),
            "iterations": int(opt2.iterations.numpy())}


def main(only):
    """Records every case, or (``only``: case names) those cases into the existing JSON."""
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)
    out = {"tensorflow": tf.__version__, "keras": keras.__version__, "steps": STEPS,
           "w0": W0.tolist(), "b0": B0.tolist(),
           "grads": [[g.tolist() for g in grads(k)] for k in range(2 * STEPS)], "cases": {}}
    if only:
        with open(os.path.join(HERE, "keras_optimizer_checkpoints.json")) as f:
            out["cases"] = json.load(f)["cases"]
    for case, (make, mirrored) in CASES.items():
        if only and case not in only:
            continue
        out["cases"][case] = {"mirrored": mirrored, "runs": {str(n): record(case, make, n) for n in (1, 2)}}
        print(case, [name for name, _, _ in out["cases"][case]["runs"]["1"]["names"]])
    with open(os.path.join(HERE, "keras_optimizer_checkpoints.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
