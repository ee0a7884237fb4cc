"""``md.train``: ``tf.train``'s checkpoints and ``ClusterSpec``; the optimizers and ``nn`` helpers live here too.

The training layer sits on top of ``mirrored.distribute``.
"""

from ..distribute.cluster_resolver import ClusterSpec
from . import checkpoint, mixed_precision, module, nn, optimizers, preemption
from .optimizers import serialization as optimizers_serialization
from .checkpoint_management import (Checkpoint, CheckpointError, CheckpointLoadStatus, CheckpointManager,
                                    CheckpointState, NotFoundError, checkpoints_iterator, get_checkpoint_state,
                                    latest_checkpoint, list_variables, load_checkpoint, load_variable)

# Keras 3 names it keras.optimizers.LossScaleOptimizer too (the same class as keras.mixed_precision's).
optimizers.LossScaleOptimizer = mixed_precision.LossScaleOptimizer
optimizers_serialization.register_builtin(mixed_precision.LossScaleOptimizer)  # get("LossScaleOptimizer"), ...

# The modules behind the names are no part of the namespace (`from mirrored.train import tensorbundle` and
# `from mirrored.train.module import Module` still work); the training packages above are.
del checkpoint_io, checkpoint_management, module, optimizers_serialization, tensorbundle  # noqa: F821  (bound by the imports above)

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointState", "CheckpointLoadStatus", "CheckpointError",
           "NotFoundError", "latest_checkpoint", "get_checkpoint_state", "checkpoints_iterator", "list_variables",
           "load_variable", "load_checkpoint", "ClusterSpec",
           # ours (docs/training.md): the optimizers, loss scaling, nn helpers, checkpoint internals, preemption
           "optimizers", "mixed_precision", "nn", "checkpoint", "preemption"]
