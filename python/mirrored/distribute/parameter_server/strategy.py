"""``md.distribute.ParameterServerStrategy``: variables on ps tasks, steps scheduled on workers by a
``ClusterCoordinator`` (``tf.distribute.experimental.ParameterServerStrategy``, TF 2's).

The program runs on the coordinator (the chief); ps and worker tasks run ``md.distribute.Server(...).join()``.
Variables created in ``scope()`` live on the ps tasks, placed round-robin in creation order, or split into a
``ShardedVariable`` by ``variable_partitioner``. A function scheduled on a worker sees this strategy with one
replica per logical GPU of the worker (TF's in-graph replication), else one CPU replica: ``strategy.run`` there
runs the replicas as MirroredStrategy does, they share one read of each variable per run, and an optimizer's
update sums their gradients on the worker (one batched all-reduce) and sends it to the ps tasks once.
docs/parameter_server.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
import weakref

from ...device import config, device_util
from ...device.tensor_shape import TensorShape
from ..cluster_resolver import ClusterResolver, SimpleClusterResolver, _validate
from ..collective_all_reduce import job_token
from ..distribute_lib import Strategy
from ..input_lib import InputContext
from ..mirrored_strategy import MirroredExtended
from ..one_device_strategy import OneDeviceExtended
from ..values import running_replica_id
from . import optimizer_state, rpc
from .values import Handle, RemoteVariable, ShardedVariable, strategy_here

__all__ = ["ParameterServerStrategy"]

_logger = logging.getLogger("mirrored")
_EXAMPLE = ("md.distribute.cluster_resolver.SimpleClusterResolver({'chief': ['host0:2222'], 'worker': "
            "['host1:2222', 'host2:2222'], 'ps': ['host3:2222']}, task_type='chief', task_id=0)")


def _cluster(cluster_resolver):
    """The resolver's cluster, checked as TF checks it for this strategy."""
    if not isinstance(cluster_resolver, ClusterResolver):
        raise ValueError(f"cluster_resolver={cluster_resolver!r}: expected a cluster resolver, e.g. "
                         f"md.distribute.cluster_resolver.TFConfigClusterResolver() or {_EXAMPLE}")
    spec = cluster_resolver.cluster_spec()
    if not spec:
        raise ValueError("Cluster spec must be non-empty in `cluster_resolver`: name the ps and worker tasks, e.g. "
                         + _EXAMPLE)
    _validate(spec, cluster_resolver.task_type, cluster_resolver.task_id, "cluster_resolver")
    if "ps" not in spec.jobs or spec.num_tasks("ps") < 1:
        raise ValueError(f"There must be at least one ps: cluster {spec.as_dict()} has no 'ps' tasks; add the "
                         "parameter server tasks that hold the variables, e.g. 'ps': ['host3:2222']")
    if "worker" not in spec.jobs or spec.num_tasks("worker") < 1:
        raise ValueError(f"There must be at least one worker: cluster {spec.as_dict()} has no 'worker' tasks; add "
                         "the tasks that run the scheduled functions, e.g. 'worker': ['host1:2222']")
    return spec


def _local_gpus() -> int:
    """The logical GPUs of this machine (``md.config``): a worker's replicas, one each (none: one CPU replica)."""
    return len(config.list_logical_devices("GPU"))


def _replica_devices(gpus: int) -> tuple:
    """TF's ``worker_devices`` of a worker with ``gpus`` GPUs."""
    return tuple(f"/device:GPU:{i}" for i in range(gpus)) or ("/device:CPU:0",)


class ParameterServerExtended(OneDeviceExtended):
    """``ParameterServerStrategy.extended``: on a worker, one replica per local logical GPU (else one CPU
    replica), run as MirroredStrategy runs them; variables on the ps tasks. On the coordinator a ``run`` (not
    scheduled) runs one CPU replica there."""

    def __init__(self, container_strategy, spec, variable_partitioner, on_worker: bool):
        # (OneDeviceExtended's behaviour, update once on the first replica's device, over the replica devices)
        MirroredExtended.__init__(self, container_strategy,
                                  list(_replica_devices(_local_gpus())) if on_worker else ["/cpu:0"])
        self._run_reads = None  # during a run on a worker: var_id -> the value its replicas share (one read)
        self._reads_lock = threading.Lock()
        self._gpus_per_worker = None  # on the coordinator: the workers' GPUs, asked once
        self._spec = spec
        self._token = job_token(spec.as_dict())
        self._ps_addresses = [spec.task_address("ps", i) for i in spec.task_indices("ps")]
        self._variable_partitioner = variable_partitioner
        self._variable_count = 0  # placed round-robin so far
        self._variable_ids = 0
        self._variable_prefix = uuid.uuid4().hex  # ids unique across strategies and workers that make variables
        self._on_worker = on_worker
        self._warned_unscheduled = False
        self._colocate_task = None  # inside colocate_vars_with: the ps task new variables go to
        self._unnamed = False  # while md.Variable(name=None) is made: its shards are named as it is (TF's)
        # This task's variables by id (a ShardedVariable by ("sharded", its first shard's id)): what an
        # optimizer's slots are keyed by when they come into view (optimizer_state.attach)
        self._created = weakref.WeakValueDictionary()

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """New variables go to ``colocate_with_variable``'s ps task, unpartitioned (TF's)."""
        super().colocate_vars_with(colocate_with_variable)  # (checks it is this strategy's)
        target = colocate_with_variable
        if isinstance(target, ShardedVariable):
            target = target.variables[0]
        previous, self._colocate_task = self._colocate_task, target._handle.task
        try:
            yield
        finally:
            self._colocate_task = previous

    @property
    def worker_devices(self) -> tuple:
        """TF's: ``/device:GPU:i`` for each GPU of a worker, else ``/device:CPU:0`` (on the coordinator too)."""
        if self._on_worker:
            return _replica_devices(self._gpus)
        return _replica_devices(self._workers_gpus())

    @property
    def _gpus(self) -> int:
        """This task's GPU replicas."""
        return sum(o is not None for o in self._ordinals)

    def _workers_gpus(self) -> int:
        """How many GPUs each worker has (asked once; TF's error when they differ)."""
        if self._gpus_per_worker is None:
            counts = {address: rpc.pool(address, self._token).call("num_gpus")
                      for address in (self._spec.task_address("worker", i) for i in self._spec.task_indices("worker"))}
            if len(set(counts.values())) > 1:
                raise ValueError(f"Mismatched number of GPUs per worker: {counts}; give every worker the same number "
                                 "of GPUs (CUDA_VISIBLE_DEVICES of its process, md.config.set_logical_device_configuration "
                                 "in the program it runs before its md.distribute.Server)")
            self._gpus_per_worker = next(iter(counts.values()))
        return self._gpus_per_worker

    parameter_devices = property(lambda self: tuple(f"/job:ps/task:{i}/device:CPU:0"
                                                    for i in range(len(self._ps_addresses))))

    def _call_for_each_replica(self, fn, args, kwargs):
        if not self._on_worker and not self._warned_unscheduled:
            self._warned_unscheduled = True
            _logger.warning("A ParameterServerStrategy method is invoked without ClusterCoordinator.schedule: it "
                            "runs on the coordinator; schedule the function to run it on a worker")
        outer, self._run_reads = self._run_reads, {}  # (the replicas of this run share a read of each variable)
        try:
            return super()._call_for_each_replica(fn, args, kwargs)
        finally:
            self._run_reads = outer

    def _shared_read(self, variable):
        """``variable``'s host value inside a replica of a run on this worker (its ps task asked once per run
        and variable, until this worker updates a variable: the replicas share it); None outside one."""
        reads = self._run_reads
        if reads is None or running_replica_id(self._container_strategy) is None:
            return None
        key = variable._handle.var_id
        with self._reads_lock:  # (replicas may run on threads of their own: the first reads, the others wait)
            value = reads.get(key)
            if value is None:
                value = reads[key] = variable._read_host()
        return value

    def _on_replica_device(self, value):
        """``value`` on the running replica's device (a GPU replica's: a copy there); as is outside a replica."""
        rid = running_replica_id(self._container_strategy)
        if rid is None or self._ordinals[rid] is None:
            return value
        return device_util.place(value, self._local_devices[rid])

    def _forget_reads(self) -> None:
        """This worker updated a variable: the replicas read again."""
        if self._run_reads:
            self._run_reads.clear()

    def _create_variable(self, *args, **kwargs):
        # TF names the shards of a variable made without a name as the variable ("Variable:0" each), and those
        # of a named one "name/part_i:0": remember which, for _make_variable (which gets the scoped name).
        named = kwargs.get("name", args[4] if len(args) > 4 else None) is not None
        previous, self._unnamed = self._unnamed, not named
        try:
            return super()._create_variable(*args, **kwargs)
        finally:
            self._unnamed = previous

    def _make_variable(self, value, name, trainable, synchronization, aggregation):
        if self._colocate_task is not None:
            return self._on_ps(self._colocate_task, value, name, trainable, synchronization, aggregation)
        partitions = None
        if self._variable_partitioner is not None and value.ndim > 0:
            partitions = self._variable_partitioner(shape=TensorShape(value.shape), dtype=value.dtype)
            if not partitions or partitions[0] == 0 or any(p != 1 for p in partitions[1:]):
                raise ValueError("variable_partitioner must return a list/tuple whose elements are 1 besides the "
                                 f"first element (non-zero), got: {partitions!r} for variable {name!r} of shape "
                                 f"{tuple(value.shape)}")
        shards = 1 if partitions is None else min(int(partitions[0]), value.shape[0])
        if shards == 1:  # (one row: whole, as TF keeps it)
            return self._on_next_ps(value, name, trainable, synchronization, aggregation)
        # TF's "div" partitioning: consecutive rows, the first (rows % shards) shards one row longer
        base, extra = divmod(value.shape[0], shards)
        offsets = [0]
        for i in range(shards):
            offsets.append(offsets[-1] + base + (i < extra))
        sharded = ShardedVariable([self._on_next_ps(value[offsets[i]:offsets[i + 1]],
                                                    name if self._unnamed else f"{name}/part_{i}", trainable,
                                                    synchronization, aggregation) for i in range(shards)])
        self._created[("sharded", sharded.variables[0]._handle.var_id)] = sharded
        return sharded

    def _on_next_ps(self, value, name, trainable, synchronization, aggregation) -> RemoteVariable:
        """A variable on the next ps task, round-robin in creation order (TF's placement)."""
        task = self._variable_count % len(self._ps_addresses)
        self._variable_count += 1
        return self._on_ps(task, value, name, trainable, synchronization, aggregation)

    def _on_ps(self, task: int, value, name, trainable, synchronization, aggregation) -> RemoteVariable:
        self._variable_ids += 1
        dtype = value.dtype.name if value.dtype.kind == "V" else value.dtype.str  # (bfloat16: by name)
        handle = Handle(self._ps_addresses[task], self._token, task, f"{self._variable_prefix}/{self._variable_ids}",
                        f"{name}:0", tuple(value.shape), dtype, trainable, synchronization, aggregation)
        variable = RemoteVariable(handle, self._container_strategy)
        variable._pool.call("create", handle.var_id, value, handle.name, trainable, synchronization, aggregation)
        self._created[handle.var_id] = variable
        return variable

    # -- an optimizer's state lives on the ps tasks (optimizer_state.py); train/optimizers/base.py asks here --
    def _home(self) -> str:
        return self._ps_addresses[0]

    def _create_optimizer_state(self, optimizer, var_list) -> None:
        """``optimizer.build(var_list)``: the state built on the ps tasks, then seen here."""
        optimizer_state.build(optimizer, optimizer_state.layout(var_list), self._home(), self._token)
        self._refresh_optimizer_state(optimizer)

    def _refresh_optimizer_state(self, optimizer) -> None:
        """Handles to ``optimizer``'s state as the ps tasks hold it now (steps elsewhere build it)."""
        units = rpc.pool(self._home(), self._token).call("layout", optimizer._ps_key)
        if units is None:
            return
        objects = [self._created.get(unit[0].var_id if len(unit) == 1 else ("sharded", unit[0].var_id))
                   for unit in units]
        optimizer_state.attach(optimizer, units, objects,
                               optimizer_state.home_handle(optimizer, self._home(), self._token),
                               self._container_strategy)

    def _loss_scale_step(self, optimizer, pairs) -> int:
        """A LossScaleOptimizer's step: its scale's state updated on its ps task in one request."""
        return optimizer_state.loss_scale_step(optimizer, pairs)

    def _stash_optimizer_restore(self, optimizer, restore) -> None:
        """A checkpoint's values of ``optimizer``'s state not built yet: the home task assigns them at build."""
        rpc.pool(self._home(), self._token).call("stash", optimizer._ps_key, restore)


class ParameterServerStrategy(Strategy):
    """Variables on parameter servers, steps on workers (``tf.distribute.experimental.ParameterServerStrategy``).

    ``cluster_resolver`` names the ``ps`` and ``worker`` tasks (and the ``chief``, this program); each ps and
    worker task runs ``md.distribute.Server(cluster_spec, job_name, task_index).join()``. Use it with
    ``md.distribute.coordinator.ClusterCoordinator(strategy)``, whose ``schedule`` runs a function on a free
    worker. ``variable_partitioner`` (``md.distribute.experimental.partitioners``) splits each variable along
    its first axis into a ``ShardedVariable`` when it asks for more than one shard.
    """

    def __init__(self, cluster_resolver, variable_partitioner=None):
        spec = _cluster(cluster_resolver)
        if cluster_resolver.task_type in ("worker", "ps"):
            raise ValueError(f"cluster_resolver.task_type={cluster_resolver.task_type!r}: ParameterServerStrategy is "
                             "created by the coordinator (the chief); a worker or ps task runs "
                             "md.distribute.Server(cluster_resolver.cluster_spec(), job_name=task_type, "
                             "task_index=task_id).join() instead")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise ValueError(f"variable_partitioner={variable_partitioner!r}: expected a partitioner, e.g. "
                             "md.distribute.experimental.partitioners.MinSizePartitioner(max_shards=num_ps), or None")
        self._cluster_resolver = cluster_resolver
        self._cluster_coordinator = None
        self._should_use_with_coordinator = True
        super().__init__(ParameterServerExtended(self, spec, variable_partitioner, on_worker=False))

    @classmethod
    def _on_worker(cls, spec, task_index: int) -> "ParameterServerStrategy":
        """The strategy as a worker task sees it, in the functions scheduled there."""
        strategy = cls.__new__(cls)
        strategy._cluster_resolver = SimpleClusterResolver(spec, task_type="worker", task_id=task_index)
        strategy._cluster_coordinator = None
        strategy._should_use_with_coordinator = True
        Strategy.__init__(strategy, ParameterServerExtended(strategy, spec, None, on_worker=True))
        return strategy

    # A scheduled function's strategy is, on the worker, the worker's own (values.strategy_here).
    def __reduce__(self):
        return strategy_here, ()

    @property
    def cluster_resolver(self):
        return self._cluster_resolver

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas of one worker (TF's): its GPUs, else 1; on the coordinator, asked of the workers."""
        extended = self.extended
        return extended._num_replicas_in_sync if extended._on_worker else max(extended._workers_gpus(), 1)

    def experimental_distribute_dataset(self, dataset, options=None):
        """A dataset for ``ClusterCoordinator.create_per_worker_dataset`` (each worker iterates its own copy)."""
        return PerWorkerInput(self, dataset=dataset)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``dataset_fn(InputContext)`` for ``ClusterCoordinator.create_per_worker_dataset`` (called on each
        worker with one input pipeline, as TF's)."""
        if not callable(dataset_fn):
            raise ValueError(f"dataset_fn={dataset_fn!r}: expected a function of an md.distribute.InputContext "
                             "that returns a dataset")
        return PerWorkerInput(self, dataset_fn=dataset_fn)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def __repr__(self) -> str:
        return f"<ParameterServerStrategy cluster={self.extended._spec.as_dict()}>"


class PerWorkerInput:
    """A dataset of ParameterServerStrategy, built on each worker by ``create_per_worker_dataset`` (TF's
    unbuilt distributed dataset: iterating it on the coordinator refuses, as TF's does)."""

    def __init__(self, strategy, dataset=None, dataset_fn=None):
        self._strategy, self._dataset, self._dataset_fn = strategy, dataset, dataset_fn

    def build(self):
        """The worker's dataset (run on the worker): with GPU replicas, distributed over them as
        MirroredStrategy distributes (each element a PerReplica of batches on the replicas' GPUs)."""
        strategy = strategy_here()
        if strategy.extended._ordinals[0] is None and strategy.num_replicas_in_sync == 1:
            return self._dataset if self._dataset_fn is None else self._dataset_fn(InputContext(1, 0, 1))
        if self._dataset_fn is None:
            return Strategy.experimental_distribute_dataset(strategy, self._dataset)
        return Strategy.distribute_datasets_from_function(strategy, self._dataset_fn)

    def __iter__(self):
        if self._dataset_fn is None:
            raise ValueError("To use this dataset, you need to pass this dataset to "
                             "ClusterCoordinator.create_per_worker_dataset.")
        raise ValueError("You need to use this dataset in ClusterCoordinator.create_per_worker_dataset.")

    def __reduce__(self):
        return PerWorkerInput, (None, self._dataset, self._dataset_fn)

