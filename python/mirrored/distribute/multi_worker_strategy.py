"""``md.MultiWorkerMirroredStrategy``: synchronous data parallelism over the devices of several machines.

Every task of ``TF_CONFIG``'s cluster that is a chief or worker runs the same
program with its own ``task``. Each builds this strategy at the same point;
the constructor joins the job (the chief, or worker 0, serves the rendezvous
store at its address) and from then on every reduction spans all replicas of
all workers: ``num_replicas_in_sync`` = workers x local replicas. Datasets are
sharded by worker, variables start from the chief's initial values.
Without ``TF_CONFIG`` the strategy is a one-worker job on local devices.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import numpy as np

from .._logging import multi_worker
from ..device import config, device_util
from .cluster_resolver import collective_tasks, default_cluster_resolver
from .collective_all_reduce import CollectiveAllReduce, CollectiveGroup
from .mirrored_strategy import MirroredExtended, MirroredStrategy
from .options import CommunicationImplementation, CommunicationOptions
from .values import DistributedValues, PerReplica, Variable

__all__ = ["MultiWorkerMirroredStrategy", "ExperimentalMultiWorkerMirroredStrategy"]

# Strategies are built in the same order on every task: the n-th one of each
# task joins the n-th group of the job.
_instances = itertools.count()


class MultiWorkerExtended(MirroredExtended):
    """``MultiWorkerMirroredStrategy.extended``: local replicas, reductions across the job."""

    def __init__(self, container_strategy, options: CommunicationOptions, resolver, devices=None):
        if devices is None or isinstance(devices, (list, tuple)) and not devices:
            # TF's: every GPU of the worker, else one CPU (however many logical CPUs there are)
            devices = [d.name for d in config.list_logical_devices("GPU")] or ["/cpu:0"]
        super().__init__(container_strategy, devices)
        if resolver.task_type is not None:
            # As TensorFlow names a worker's devices: '/job:worker/replica:0/task:1/device:CPU:0'.
            self._local_devices = tuple(
                device_util.parse(d)._replace(job=resolver.task_type, task=int(resolver.task_id)).to_string()
                for d in self._local_devices)
        self._options = options
        self._resolver = resolver
        if options.implementation is CommunicationImplementation.NCCL:
            cpus = [d for d in self._local_devices if "GPU" not in d.upper()]
            if cpus:
                raise ValueError(f"communication_options: implementation NCCL needs GPU replicas but this worker "
                                 f"has {cpus}; use CommunicationImplementation.AUTO or RING for CPU replicas")
        tasks = collective_tasks(resolver.cluster_spec())
        me = (resolver.task_type, resolver.task_id)
        self._group = None
        # A one-task cluster (or none) needs no network; a task outside the
        # collective ones (ps, evaluator) is refused by from_cluster_resolver.
        if len(tasks) > 1 or (me[0] is not None and me not in tasks):
            self._group = CollectiveGroup.from_cluster_resolver(
                resolver, len(self._local_devices), timeout=options.timeout_seconds or None,  # 0: none
                scope=f"strategy-{next(_instances)}", devices=self._local_devices,
                implementation=options.implementation)
            self._num_workers = self._group.num_workers
            self._worker_index = self._group.rank
            weakref.finalize(container_strategy, self._group.close)
        self._cross_device_ops = CollectiveAllReduce(self._group, bytes_per_pack=options.bytes_per_pack)
        logging.getLogger("mirrored").info("MultiWorkerMirroredStrategy: %s", multi_worker(self))

    @property
    def _is_chief(self) -> bool:
        # The chief, or worker 0 in a cluster without one, or the only worker.
        return self._worker_index == 0

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def should_checkpoint(self) -> bool:
        return self._is_chief

    @property
    def should_save_summary(self) -> bool:
        return self._is_chief

    def _as_local(self, value):
        """With one local replica ``run`` returns plain values; across workers each is still one replica's part."""
        if self._group is not None and len(self._local_devices) == 1 and not isinstance(
                value, (DistributedValues, Variable)):
            return PerReplica([value], self._local_devices)
        return value

    def _reduce_to(self, op, value, destinations, options):
        return super()._reduce_to(op, self._as_local(value), destinations, options)

    def _batch_reduce_to(self, op, pairs, options):
        return super()._batch_reduce_to(op, [(self._as_local(v), d) for v, d in pairs], options)

    def _gather_to_host(self, value, axis):
        return super()._gather_to_host(self._as_local(value), axis)

    def _make_initial_values_identical(self, value):
        """Every worker takes the chief's initial value (random initialisers differ per process)."""
        if self._group is None:
            return value
        value = np.asarray(value, order="C")  # not ascontiguousarray: it makes a 0-d value 1-d
        if value.dtype.hasobject:
            raise TypeError(f"initial_value of dtype {value.dtype} cannot be sent between workers; use a numeric "
                            "NumPy dtype")
        raw = value.reshape(-1).view(np.uint8)
        chiefs = self._group.broadcast([raw] * len(self._local_devices), root=0)[0]
        return chiefs.view(value.dtype).reshape(value.shape)


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous training on the devices of several workers (``tf.distribute.MultiWorkerMirroredStrategy``).

    ``cluster_resolver``: who is in the job (default: ``TF_CONFIG``, else the
    ``SLURM_*`` variables of an ``srun`` step, else this process alone).
    ``communication_options``: a ``CommunicationOptions`` (``timeout_seconds``
    bounds every collective and the start-up wait; ``None`` or ``inf``: no
    timeout, and the start-up wait is 300 s; ``bytes_per_pack`` fuses
    gradients; ``implementation`` AUTO / RING (Gloo) / NCCL).
    TensorFlow 2.0's ``communication=CollectiveCommunication.X`` is accepted
    too. ``devices`` (a mirrored extension) lists this worker's replica
    devices, e.g. ``["/cpu:0", "/cpu:1"]``; default: every GPU, else one CPU.

    The positional order is TensorFlow's, ``(cluster_resolver,
    communication_options)``. A communication argument given first, as
    TensorFlow 2.0 (``communication``) and mirrored's first releases
    (``communication_options``) ordered them, is recognised by its type.
    """

    def __init__(self, cluster_resolver=None, communication_options=None, *, communication=None, devices=None):
        if isinstance(cluster_resolver, (CommunicationOptions, CommunicationImplementation, str)) and (
                communication_options is None or _is_resolver(communication_options)):
            cluster_resolver, communication_options = communication_options, cluster_resolver
        if isinstance(communication_options, (CommunicationImplementation, str)):
            communication, communication_options = communication_options, None  # TF 2.0 positional form
        if communication is not None:
            if communication_options is not None:
                raise ValueError("pass either communication_options or communication (the TF 2.0 form), not both")
            communication_options = CommunicationOptions(implementation=communication)
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise ValueError(f"communication_options={communication_options!r}: expected md.CommunicationOptions"
                             "(bytes_per_pack=..., timeout_seconds=..., implementation=...)")
        if cluster_resolver is not None and not _is_resolver(cluster_resolver):
            raise TypeError(f"cluster_resolver={cluster_resolver!r}: expected a cluster resolver, e.g. "
                            "md.cluster_resolver.TFConfigClusterResolver() or SimpleClusterResolver(cluster_spec, "
                            "task_type=..., task_id=...), or None to read TF_CONFIG")
        resolver = cluster_resolver if cluster_resolver is not None else default_cluster_resolver()
        # Skip MirroredStrategy.__init__: the extended object is ours.
        super(MirroredStrategy, self).__init__(
            MultiWorkerExtended(self, communication_options, resolver, devices))

    @property
    def cluster_resolver(self):
        return self._extended._resolver


class ExperimentalMultiWorkerMirroredStrategy(MultiWorkerMirroredStrategy):
    """``tf.distribute.experimental.MultiWorkerMirroredStrategy``: TensorFlow 2.0's ``(communication,
    cluster_resolver)``, ``communication`` a ``CommunicationImplementation`` (``CollectiveCommunication``)."""

    def __init__(self, communication=CommunicationImplementation.AUTO, cluster_resolver=None, *, devices=None):
        super().__init__(cluster_resolver, communication=communication, devices=devices)


def _is_resolver(value) -> bool:
    """A cluster resolver: any object with ``cluster_spec()``, ``task_type`` and ``task_id`` (TF's interface)."""
    return callable(getattr(value, "cluster_spec", None)) and hasattr(value, "task_type") and hasattr(value, "task_id")
