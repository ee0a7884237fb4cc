"""mirrored: TensorFlow's tf.distribute programming model for NumPy/CuPy trainers.

    import mirrored as md
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = md.Variable(np.zeros(3, np.float32), aggregation=md.VariableAggregation.MEAN)
    per_replica = strategy.run(step, args=(batch,))
    total = strategy.reduce(md.ReduceOp.SUM, per_replica, axis=None)

The package is laid out by layer (docs/architecture.md): ``device`` (names,
config, GPU access) under ``collective`` (the one collective face and its
engines) under ``distribute`` (strategies, values, input, cross-device ops)
under ``train`` (optimizers, checkpoints, nn) and ``tools`` (launcher, bench,
info); ``data`` is the input pipeline.
"""

import sys as _sys
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError, version as _version

try:
    __version__ = _version("mirrored")
except _PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

from . import _logging  # noqa: F401  (before the rest: configures the "mirrored" logger from MIRRORED_LOG_LEVEL)
from . import errors, timeline
from .distribute import launcher_lifeline as _launcher_lifeline

_launcher_lifeline.watch_launcher()  # a task of mirrored-run ends with its launcher
from .device import config, device_util, linalg
from .device.linalg import matmul
from .device.tensor_shape import TensorShape
from .device.indexed_slices import IndexedSlices, convert_to_tensor
from .collective import api as collectives
from . import distribute
from .distribute import cluster_resolver, cross_device_ops, experimental
from .distribute.distribute_lib import (ReplicaContext, Strategy, StrategyExtended, get_cross_replica_context,
                                        get_replica_context, get_strategy, has_strategy, in_cross_replica_context)
from .distribute.input_lib import DistributedDataset, DistributedIterator, InputContext, ValueContext
from .distribute.mirrored_strategy import MirroredStrategy
from .distribute.one_device_strategy import OneDeviceStrategy
from .distribute.function import Function, function
from .distribute.name_scope import name_scope
from .distribute.multi_worker_strategy import MultiWorkerMirroredStrategy
from .distribute.options import (CollectiveCommunication, CommunicationImplementation, CommunicationOptions,
                                 InputOptions, InputReplicationMode, RunOptions, VariableAggregation,
                                 VariableSynchronization)
from .distribute.reduce_util import ReduceOp
from .distribute.values import (DistributedValues, DistributedVariable, Mirrored, MirroredVariable, PerReplica,
                                SyncOnReadVariable, Variable)
from .distribute.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce,
                                          ReductionToOneDevice, RingAllReduce)
from . import data, train
from .data.structure import TensorSpec
from .train import checkpoint, mixed_precision, nn, optimizers
from .train.checkpoint_management import Checkpoint
from .train.module import Module
from . import compat
from .train import preemption as _preemption

# TF names them tf.distribute.experimental.*; they drive checkpoint managers, so they live in the training
# layer, which the distribute layer may not import.
experimental.PreemptionCheckpointHandler = _preemption.PreemptionCheckpointHandler
experimental.TerminationConfig = _preemption.TerminationConfig

# The module paths of the flat layout (``import mirrored.collectives``,
# ``from mirrored.cross_device_ops import ...``) keep working.
for _name, _module in {"collectives": collectives, "config": config, "device_util": device_util,
                       "cross_device_ops": cross_device_ops, "cluster_resolver": cluster_resolver,
                       "experimental": experimental, "checkpoint": checkpoint, "nn": nn,
                       "optimizers": optimizers, "linalg": linalg}.items():
    _sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module
