"""Records Keras 3's learning-rate schedules as test data.

    /work/venvs/tf/bin/python tests/data/record_keras_schedules.py

Writes keras_schedules.json beside this file (read by tests/test_schedules.py; the suite never imports
TensorFlow): for every case, the schedule's value at each step of STEPS (float32, as Keras computes it from
an int64 step), its get_config() and keras.optimizers.schedules.serialize().
"""

import json
import os

import numpy as np
import tensorflow as tf
import keras

S = keras.optimizers.schedules
STEPS = list(range(0, 41)) + [57, 100, 255, 1000, 12345]
CASES = {
    "ExponentialDecay": ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5}),
    "ExponentialDecay staircase": ("ExponentialDecay", {"initial_learning_rate": 0.01, "decay_steps": 7,
                                                        "decay_rate": 0.96, "staircase": True}),
    "PiecewiseConstantDecay": ("PiecewiseConstantDecay", {"boundaries": [5, 12], "values": [1.0, 0.5, 0.1]}),
    "PiecewiseConstantDecay one boundary": ("PiecewiseConstantDecay", {"boundaries": [20], "values": [0.3, 0.03]}),
    "PiecewiseConstantDecay many": ("PiecewiseConstantDecay", {"boundaries": [1, 2, 10, 30],
                                                               "values": [0.9, 0.7, 0.5, 0.25, 0.125]}),
    "PolynomialDecay": ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 20}),
    "PolynomialDecay power": ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 15,
                                                  "end_learning_rate": 0.01, "power": 0.5}),
    "PolynomialDecay cycle": ("PolynomialDecay", {"initial_learning_rate": 0.2, "decay_steps": 8,
                                                  "end_learning_rate": 0.02, "power": 2.0, "cycle": True}),
    "InverseTimeDecay": ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 5, "decay_rate": 0.5}),
    "InverseTimeDecay staircase": ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 6,
                                                        "decay_rate": 2.0, "staircase": True}),
    "CosineDecay": ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 30}),
    "CosineDecay alpha": ("CosineDecay", {"initial_learning_rate": 0.05, "decay_steps": 25, "alpha": 0.1}),
    "CosineDecay warmup": ("CosineDecay", {"initial_learning_rate": 0.0, "decay_steps": 20, "warmup_target": 0.1,
                                           "warmup_steps": 10}),
    "CosineDecay warmup alpha": ("CosineDecay", {"initial_learning_rate": 0.01, "decay_steps": 16, "alpha": 0.2,
                                                 "warmup_target": 0.2, "warmup_steps": 7}),
    "CosineDecayRestarts": ("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 5}),
    "CosineDecayRestarts t_mul m_mul alpha": ("CosineDecayRestarts", {
        "initial_learning_rate": 0.1, "first_decay_steps": 4, "t_mul": 1.5, "m_mul": 0.8, "alpha": 0.05}),
    "CosineDecayRestarts t_mul 1": ("CosineDecayRestarts", {"initial_learning_rate": 0.2, "first_decay_steps": 6,
                                                            "t_mul": 1.0, "m_mul": 0.5}),
}


def main():
    out = {"steps": STEPS, "cases": {}, "versions": f"tensorflow {tf.__version__}, keras {keras.__version__}"}
    for name, (cls, kwargs) in CASES.items():
        schedule = getattr(S, cls)(**kwargs)
        step = tf.Variable(0, dtype=tf.int64)  # an optimizer passes its int64 `iterations`
        values = []
        for s in STEPS:
            step.assign(s)
            value = schedule(step)
            values.append(float(np.float32(value.numpy())))
        out["cases"][name] = {"class": cls, "kwargs": kwargs, "values": values, "dtype": str(value.dtype.name),
                              "config": schedule.get_config(), "serialized": S.serialize(schedule)}
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "keras_schedules.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
