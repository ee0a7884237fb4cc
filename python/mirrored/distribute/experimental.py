"""``md.experimental``: TensorFlow 2.0's ``tf.distribute.experimental`` spellings.

    strategy = md.experimental.MultiWorkerMirroredStrategy(
        communication=md.experimental.CollectiveCommunication.RING)
"""

from .central_storage_strategy import CentralStorageStrategy
from .input_lib import ValueContext
from .multi_worker_strategy import ExperimentalMultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from .options import CollectiveCommunication, CollectiveHints, CommunicationImplementation, CommunicationOptions
from .parameter_server import coordinator, partitioners
from .parameter_server import experimental_rpc as rpc
from .parameter_server.strategy import ParameterServerStrategy

__all__ = ["CentralStorageStrategy", "MultiWorkerMirroredStrategy", "CollectiveCommunication", "CollectiveHints",
           "CommunicationImplementation", "CommunicationOptions", "ValueContext", "ParameterServerStrategy",
           "coordinator", "partitioners", "rpc"]
