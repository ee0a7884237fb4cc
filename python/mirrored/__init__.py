"""mirrored: TensorFlow's tf.distribute programming model for NumPy/CuPy trainers.

    import mirrored as md
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = md.Variable(np.zeros(3, np.float32), aggregation=md.VariableAggregation.MEAN)
    per_replica = strategy.run(step, args=(batch,))
    total = strategy.reduce(md.ReduceOp.SUM, per_replica, axis=None)
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("mirrored")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

from . import _logging  # noqa: F401  (before the rest: configures the "mirrored" logger from MIRRORED_LOG_LEVEL)
from . import cross_device_ops, device_util
from .distribute_lib import (ReplicaContext, Strategy, StrategyExtended, get_cross_replica_context,
                             get_replica_context, get_strategy, has_strategy, in_cross_replica_context)
from .input_lib import DistributedDataset, DistributedIterator, InputContext, ValueContext
from .mirrored_strategy import MirroredStrategy
from .options import (CollectiveCommunication, CommunicationImplementation, CommunicationOptions,
                      InputOptions, InputReplicationMode, RunOptions, VariableAggregation,
                      VariableSynchronization)
from .reduce_util import ReduceOp
from .values import (DistributedValues, DistributedVariable, Mirrored, MirroredVariable, PerReplica,
                     SyncOnReadVariable, Variable)
from .cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce, ReductionToOneDevice,
                               RingAllReduce)
from . import compat

# Other parts of the package append their exports below (multi-worker, optimizers, checkpoints).
from . import checkpoint, collectives, optimizers, timeline
from . import nn, train
from .train import Checkpoint
from . import cluster_resolver
from .multi_worker_strategy import MultiWorkerMirroredStrategy
from . import data, errors, experimental
