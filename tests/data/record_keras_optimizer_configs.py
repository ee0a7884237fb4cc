"""Records Keras 3's optimizer configs and keras.optimizers.get's answers into keras_optimizer_configs.json.

Run with the TensorFlow venv: /work/venvs/tf/bin/python tests/data/record_keras_optimizer_configs.py
(the test suite reads the JSON and never imports TensorFlow).
"""

import json
import os

import keras

O = keras.optimizers
S = O.schedules

# (label, class name, arguments); every name given, since Keras numbers its default names per process.
CASES = [
    ("sgd default", "SGD", {}),
    ("sgd nesterov", "SGD", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True, "clipnorm": 1.0}),
    ("adam default", "Adam", {}),
    ("adam amsgrad", "Adam", {"learning_rate": 0.01, "amsgrad": True, "weight_decay": 0.01, "use_ema": True,
                              "ema_momentum": 0.9, "ema_overwrite_frequency": 3}),
    ("adamw default", "AdamW", {}),
    ("rmsprop centered", "RMSprop", {"rho": 0.8, "momentum": 0.5, "centered": True, "global_clipnorm": 2.0}),
    ("adagrad", "Adagrad", {"initial_accumulator_value": 0.2, "gradient_accumulation_steps": 4}),
    ("nadam", "Nadam", {"beta_1": 0.8, "loss_scale_factor": 128.0}),
    ("adamax", "Adamax", {"epsilon": 1e-6, "clipvalue": 0.5}),
    ("adadelta", "Adadelta", {"rho": 0.9}),
    ("lion", "Lion", {"beta_1": 0.95}),
    ("ftrl", "Ftrl", {"learning_rate_power": -0.7, "l1_regularization_strength": 0.01, "beta": 0.1}),
    ("lamb", "Lamb", {"learning_rate": 0.02, "beta_1": 0.8, "epsilon": 1e-6, "weight_decay": 0.01}),
    ("adafactor", "Adafactor", {"beta_2_decay": -0.5, "epsilon_1": 1e-20, "epsilon_2": 1e-2, "clip_threshold": 2.0,
                                "relative_step": False}),
    ("schedule free adamw", "ScheduleFreeAdamW", {"learning_rate": 0.01, "beta_1": 0.8, "epsilon": 1e-6,
                                                  "warmup_steps": 100, "weight_decay": 0.01, "clipnorm": 1.0}),
    ("muon default", "Muon", {}),
    ("muon", "Muon", {"learning_rate": 0.02, "exclude_layers": ["output", "head.*"], "exclude_embeddings": False,
                      "muon_a": 3.0, "adam_lr_ratio": 0.1, "momentum": 0.9, "ns_steps": 3, "nesterov": False,
                      "adam_weight_decay": None, "weight_decay": 0.01, "rms_rate": None, "clipnorm": 1.0,
                      "use_ema": True}),
    ("sgd schedule", "SGD", {"learning_rate": S.ExponentialDecay(0.1, 10, 0.5, staircase=True)}),
    ("adam schedule", "Adam", {"learning_rate": S.CosineDecay(0.01, 100, alpha=0.1, warmup_target=0.02,
                                                              warmup_steps=10)}),
    ("rmsprop piecewise", "RMSprop", {"learning_rate": S.PiecewiseConstantDecay([10, 20], [0.1, 0.01, 0.001])}),
]
NAMES = ["adam", "Adam", "ADAM", "sgd", "SGD", "adamw", "AdamW", "rmsprop", "RMSprop", "Adagrad", "nadam",
         "adamax", "ADADELTA", "lion", "Ftrl", "adafactor", "Adafactor", "schedulefreeadamw", "ScheduleFreeAdamW",
         "muon", "Muon"]
BAD = ["nope", "adam_w", "rms_prop", ""]


def main():
    out = {"configs": {}, "serialized": {}, "default_names": {}, "get": {}, "bad": {}}
    # First, before any other optimizer exists: Keras numbers a default name once it is taken (adam, adam_1).
    for cls in ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax", "Adadelta", "Lion", "Ftrl",
                "Lamb", "Adafactor", "Muon", "ScheduleFreeAdamW"]:
        out["default_names"][cls] = getattr(O, cls)().name
    for label, cls, kwargs in CASES:
        opt = getattr(O, cls)(name=f"opt_{label.replace(' ', '_')}", **kwargs)
        out["configs"][label] = {"class": cls, "config": opt.get_config()}
        out["serialized"][label] = O.serialize(opt)
    for name in NAMES:
        opt = O.get(name)
        config = opt.get_config()
        config.pop("name")
        out["get"][name] = {"class": type(opt).__name__, "config": config}
    for name in BAD:
        try:
            O.get(name)
        except ValueError as e:
            out["bad"][name] = str(e)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_optimizer_configs.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
