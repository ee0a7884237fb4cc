"""``md.distribute``: ``tf.distribute``'s names — strategies, values, input, cross-device ops.

    strategy = md.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        ...
"""

from . import cluster_resolver, experimental
from .cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce, ReductionToOneDevice,
                               RingAllReduce)
from .distribute_lib import (ReplicaContext, Strategy, StrategyExtended, experimental_set_strategy,
                             get_cross_replica_context, get_replica_context, get_strategy, has_strategy,
                             in_cross_replica_context)
from .input_lib import DistributedDataset, DistributedIterator, InputContext, ValueContext
from .mirrored_strategy import MirroredStrategy
from .one_device_strategy import OneDeviceStrategy
from .parameter_server import coordinator
from .parameter_server.server_lib import Server
from .parameter_server.strategy import ParameterServerStrategy
from .name_scope import name_scope
from .multi_worker_strategy import MultiWorkerMirroredStrategy
from .options import (CollectiveCommunication, CommunicationImplementation, CommunicationOptions, InputOptions,
                      InputReplicationMode, RunOptions, VariableAggregation, VariableSynchronization)
from .reduce_util import ReduceOp
from .values import (DistributedValues, DistributedVariable, Mirrored, MirroredVariable, PerReplica,
                     SyncOnReadVariable, Variable)

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "MultiWorkerMirroredStrategy", "Strategy", "StrategyExtended", "ReplicaContext",
           "ReduceOp", "get_replica_context", "get_cross_replica_context", "get_strategy", "has_strategy",
           "in_cross_replica_context", "experimental_set_strategy", "InputContext", "InputOptions",
           "InputReplicationMode", "RunOptions",
           "DistributedDataset", "DistributedIterator", "DistributedValues", "CrossDeviceOps", "NcclAllReduce",
           "HierarchicalCopyAllReduce", "ReductionToOneDevice", "RingAllReduce", "experimental",
           "cluster_resolver", "ParameterServerStrategy", "Server", "coordinator"]
