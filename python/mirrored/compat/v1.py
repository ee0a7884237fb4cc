"""``md.compat.v1``: the TF 1.x ``tf.compat.v1.distribute`` spellings of MirroredStrategy."""

from __future__ import annotations

import copy
import sys

from ..distribute.distribute_lib import (get_cross_replica_context, get_replica_context, get_strategy, has_strategy, in_cross_replica_context)
from ..data import NumpyDataset, make_numpy_dataset
from ..distribute.input_lib import DistributedDataset, DistributedDatasetsFromFunction
from ..distribute.mirrored_strategy import MirroredStrategy as _MirroredStrategyV2
from ..distribute.options import InputReplicationMode


class DatasetIterator:
    """TF 1.x input iterator: ``initialize()`` then ``get_next()`` once per step."""

    def __init__(self, distributed):
        self._distributed = distributed
        self._iterator = None

    def initialize(self) -> list:
        """(Re)start from the first batch; returns the (empty, eager) list of initializer ops."""
        self._iterator = iter(self._distributed)
        return []

    def get_next(self):
        if self._iterator is None:
            self.initialize()
        return next(self._iterator)

    @property
    def element_spec(self):
        return self._distributed.element_spec


class MirroredStrategy(_MirroredStrategyV2):
    """``tf.compat.v1.distribute.MirroredStrategy``: the v2 strategy plus the TF 1.x input and run names."""

    def experimental_run(self, fn, input_iterator=None):
        """Run ``fn`` on every replica, with the next element of ``input_iterator`` as its argument if given."""
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(input_iterator.get_next(),))

    def make_dataset_iterator(self, dataset) -> DatasetIterator:
        """An iterator whose elements are the batches of ``dataset`` split over the replicas."""
        return DatasetIterator(DistributedDataset(dataset, self.extended))

    def make_input_fn_iterator(self, input_fn, replication_mode=InputReplicationMode.PER_WORKER) -> DatasetIterator:
        """An iterator over ``input_fn(InputContext)``'s per-replica batches (one per replica per step)."""
        if replication_mode != InputReplicationMode.PER_WORKER:
            raise ValueError(f"replication_mode={replication_mode!r}: only InputReplicationMode.PER_WORKER is "
                             "supported here (use distribute_datasets_from_function for PER_REPLICA)")
        return DatasetIterator(DistributedDatasetsFromFunction(input_fn, self.extended))

    def experimental_make_numpy_dataset(self, numpy_input, session=None) -> NumpyDataset:
        """A dataset of the rows of ``numpy_input``, copied to the host; ``session`` is ignored (eager).

        Tuples and dicts are structures of arrays; a list of arrays is stacked
        into one array, as documented for TensorFlow (``[np.ones(3), np.zeros(3)]``
        is 2 rows of shape (3,)).
        """
        return make_numpy_dataset(numpy_input)

    def update_config_proto(self, config_proto):
        """A copy of ``config_proto`` (MirroredStrategy needs no session settings)."""
        return copy.deepcopy(config_proto)

    def unwrap(self, value) -> tuple:
        """Deprecated TF 1.x name of ``experimental_local_results``."""
        return self.experimental_local_results(value)

    def group(self, value, name=None):
        """``tf.group`` of the local results: eagerly they are already computed, so None (as an eager tf.group)."""
        self.experimental_local_results(value)
        return None

    def colocate_vars_with(self, colocate_with_variable):
        return self.extended.colocate_vars_with(colocate_with_variable)

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None):
        """Keep ``session_config``; a cluster needs MultiWorkerMirroredStrategy instead."""
        if cluster_spec:
            raise ValueError("cluster_spec: MirroredStrategy runs on one machine; use "
                             "md.MultiWorkerMirroredStrategy with TF_CONFIG for a cluster")
        self._session_config = session_config


__all__ = ["MirroredStrategy", "get_strategy", "has_strategy", "in_cross_replica_context", "get_replica_context",
           "get_cross_replica_context", "NumpyDataset", "DatasetIterator"]

# ``tf.compat.v1.distribute.MirroredStrategy`` ported verbatim reads ``md.compat.v1.distribute.MirroredStrategy``:
# this module is that namespace too.
distribute = sys.modules[__name__]
