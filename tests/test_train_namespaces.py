"""md.optimizers, md.mixed_precision and md.train hold Keras'/TF's names and our documented extras only (no
module internals such as np, annotations, base, rules' helpers), and the modules behind them stay importable."""

import importlib

import mirrored as md

KERAS_OPTIMIZERS = {"schedules", "Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax",
                    "Adadelta", "Lion", "Ftrl", "Lamb", "Adafactor", "ScheduleFreeAdamW", "Muon", "LossScaleOptimizer",
                    "get", "serialize", "deserialize", "MultiOptimizer", "OptimizerMap"}
OUR_OPTIMIZERS = {"rules", "sgd_update", "adam_update"}  # docs/training.md
KERAS_MIXED_PRECISION = {"LossScaleOptimizer", "Policy", "DTypePolicy", "global_policy", "set_global_policy"}
TF_TRAIN = {"Checkpoint", "CheckpointManager", "CheckpointState", "CheckpointLoadStatus", "CheckpointError",
            "NotFoundError", "latest_checkpoint", "get_checkpoint_state", "checkpoints_iterator", "list_variables",
            "load_variable", "load_checkpoint", "ClusterSpec"}
OUR_TRAIN = {"optimizers", "mixed_precision", "nn", "checkpoint", "preemption"}
KERAS_SCHEDULES = {"LearningRateSchedule", "ExponentialDecay", "PiecewiseConstantDecay", "PolynomialDecay",
                   "InverseTimeDecay", "CosineDecay", "CosineDecayRestarts", "serialize", "deserialize"}


def _public(namespace) -> set:
    return {n for n in vars(namespace) if not n.startswith("_")}


def test_the_namespaces_are_keras_and_tf_names_and_our_documented_extras():
    assert _public(md.optimizers) == set(md.optimizers.__all__) == KERAS_OPTIMIZERS | OUR_OPTIMIZERS
    assert _public(md.mixed_precision) == set(md.mixed_precision.__all__) == KERAS_MIXED_PRECISION
    assert _public(md.train) == set(md.train.__all__) == TF_TRAIN | OUR_TRAIN
    assert _public(md.optimizers.schedules) == set(md.optimizers.schedules.__all__) == KERAS_SCHEDULES
    assert md.optimizers.LossScaleOptimizer is md.mixed_precision.LossScaleOptimizer


def test_the_modules_behind_the_names_stay_importable():
    for name in ("mirrored.train.tensorbundle", "mirrored.train.checkpoint_io", "mirrored.train.module",
                 "mirrored.train.checkpoint_management", "mirrored.train.optimizers.base",
                 "mirrored.train.optimizers.keras", "mirrored.train.optimizers.step_window"):
        assert importlib.import_module(name).__name__ == name
    from mirrored.train import tensorbundle  # noqa: F401
    from mirrored.train.optimizers import base
    assert base.Optimizer is md.optimizers.Optimizer
