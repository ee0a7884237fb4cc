"""``md.train``: ``tf.train``'s checkpoints and ``ClusterSpec``; the optimizers and ``nn`` helpers live here too.

The training layer sits on top of ``mirrored.distribute``.
"""

from ..distribute.cluster_resolver import ClusterSpec
from . import checkpoint, mixed_precision, nn, optimizers, preemption
from .checkpoint_management import (Checkpoint, CheckpointError, CheckpointLoadStatus, CheckpointManager,
                                    CheckpointState, NotFoundError, checkpoints_iterator, get_checkpoint_state,
                                    latest_checkpoint, list_variables, load_checkpoint, load_variable)

# Keras 3 names it keras.optimizers.LossScaleOptimizer too (the same class as keras.mixed_precision's).
optimizers.LossScaleOptimizer = mixed_precision.LossScaleOptimizer

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointState", "CheckpointLoadStatus", "CheckpointError",
           "NotFoundError", "latest_checkpoint", "get_checkpoint_state", "checkpoints_iterator", "list_variables",
           "load_variable", "load_checkpoint", "ClusterSpec"]
