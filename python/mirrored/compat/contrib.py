"""``md.compat.contrib``: the TF 1.11 ``tf.contrib.distribute`` names (towers, ``unwrap``, ...)."""

from __future__ import annotations

from .. import device_util
from ..distribute_lib import get_cross_replica_context, get_replica_context, get_strategy, has_strategy
from ..input_lib import DistributedDatasetsFromFunction
from ..options import VariableAggregation
from ..reduce_util import ReduceOp, as_reduce_op
from ..values import DistributedValues, DistributedVariable, PerReplica
from .v1 import DatasetIterator, MirroredStrategy as _MirroredStrategyV1


def _as_op(aggregation) -> ReduceOp:
    """TF 1.11 reduced with a VariableAggregation (SUM, MEAN); a ReduceOp or its name works too."""
    if isinstance(aggregation, VariableAggregation):
        return ReduceOp.from_variable_aggregation(aggregation)
    return as_reduce_op(aggregation, "aggregation")


class TowerContext:
    """TF 1.11's name for a replica context: ``tower_id``, ``merge_call(fn, *args, **kwargs)``."""

    def __init__(self, replica_context):
        self._ctx = replica_context

    tower_id = property(lambda self: self._ctx.replica_id_in_sync_group)
    num_towers = property(lambda self: self._ctx.num_replicas_in_sync)
    distribution_strategy = property(lambda self: self._ctx.strategy)
    device = property(lambda self: self._ctx.strategy.extended.worker_devices[self._ctx._local_replica_id])

    def merge_call(self, merge_fn, *args, **kwargs):
        return self._ctx.merge_call(merge_fn, args, kwargs)


def get_tower_context():
    """The tower (replica) context of this thread, None in cross-tower context."""
    ctx = get_replica_context()
    return None if ctx is None else TowerContext(ctx)


get_cross_tower_context = get_cross_replica_context
get_distribution_strategy = get_strategy
has_distribution_strategy = has_strategy


class MultiStepContext:
    """State of ``run_steps_on_dataset``: ``fn(ctx, inputs)`` records outputs with ``set_last_step_output``."""

    def __init__(self, strategy):
        self._strategy = strategy
        self.last_step_outputs = {}

    def set_last_step_output(self, name, output, aggregation=None):
        """Record ``output`` under ``name``: per tower (PerReplica), or reduced with ``aggregation``."""
        def store(strategy, value):
            self.last_step_outputs[name] = (value if aggregation is None
                                            else strategy.extended._reduce(_as_op(aggregation), value))

        ctx = get_replica_context()
        if ctx is None:
            store(self._strategy, output)
        else:
            ctx.merge_call(store, args=(output,))

    def __repr__(self) -> str:
        return f"MultiStepContext(last_step_outputs={self.last_step_outputs!r})"


class MirroredStrategy(_MirroredStrategyV1):
    """``tf.contrib.distribute.MirroredStrategy`` (TF 1.11): towers, cross-tower ops and positional args."""

    def __init__(self, devices=None, num_gpus=None, num_gpus_per_worker=None, cross_tower_ops=None,
                 prefetch_on_device=None, auto_shard_dataset=False, cross_device_ops=None):
        if devices is not None and (num_gpus or num_gpus_per_worker):
            raise ValueError("devices and num_gpus were both given; pass one of them")
        gpus = num_gpus if num_gpus is not None else num_gpus_per_worker
        if devices is None and gpus is not None:
            devices = [f"/device:GPU:{i}" for i in range(gpus)] or ["/device:CPU:0"]
        if cross_tower_ops is not None and cross_device_ops is not None:
            raise ValueError("cross_tower_ops and cross_device_ops were both given; pass one of them")
        super().__init__(devices, cross_device_ops or cross_tower_ops)

    num_towers = property(lambda self: self.num_replicas_in_sync)
    worker_devices = property(lambda self: self.extended.worker_devices)
    parameter_devices = property(lambda self: self.extended.parameter_devices)

    @property
    def worker_device_index(self) -> dict:
        """Map from each worker device to its tower index."""
        return {d: i for i, d in enumerate(self.extended.worker_devices)}

    def call_for_each_tower(self, fn, *args, **kwargs):
        return self.run(fn, args=args, kwargs=kwargs)

    def reduce(self, aggregation, value, destinations=None):
        """Reduce ``value`` with ``aggregation`` to ``destinations`` (default: every device of ``value``)."""
        if destinations is None:
            destinations = value if isinstance(value, DistributedValues) else self.extended.worker_devices[0]
        return self.extended.reduce_to(_as_op(aggregation), value, destinations)

    def batch_reduce(self, aggregation, value_destination_pairs):
        return self.extended.batch_reduce_to(_as_op(aggregation), list(value_destination_pairs))

    def broadcast(self, tensor, destinations=None):
        return self.extended.broadcast_to(tensor, destinations if destinations is not None
                                          else list(self.extended.worker_devices))

    def update(self, var, fn, *args, **kwargs):
        return self.extended.update(var, fn, args, kwargs)

    def update_non_slot(self, colocate_with, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` once per device of the ``colocate_with`` variables; results grouped."""
        variables = colocate_with if isinstance(colocate_with, (list, tuple)) else [colocate_with]
        devices = variables[0]._devices if isinstance(variables[0], DistributedVariable) else \
            self.extended.worker_devices
        results = []
        for device in devices:
            with device_util.device_scope(device):
                results.append(fn(*args, **kwargs))
        return results[0] if all(r is results[0] for r in results) else PerReplica(results, devices)

    def read_var(self, var):
        """The value of ``var`` in cross-tower context (aggregated for sync-on-read variables)."""
        return var.read_value()

    def map(self, map_over, fn, *args, **kwargs):
        """``fn(item, *args, **kwargs)`` for each item of ``map_over``, items dealt round-robin to the towers."""
        devices = self.extended.worker_devices
        per_device = [[] for _ in devices]
        for i, item in enumerate(map_over):
            with device_util.device_scope(devices[i % len(devices)]):
                per_device[i % len(devices)].append(fn(item, *args, **kwargs))
        return PerReplica(per_device, devices)

    def distribute_dataset(self, dataset_fn) -> "PerDeviceDataset":
        """TF 1.11: each tower takes its own whole batch of ``dataset_fn()`` per step."""
        return PerDeviceDataset(DistributedDatasetsFromFunction(lambda _ctx: dataset_fn(), self.extended))

    def run_steps_on_dataset(self, fn, iterator, iterations: int = 1, initial_loop_values=None):
        """Run ``fn(ctx, inputs)`` on every tower for ``iterations`` steps; returns the MultiStepContext."""
        ctx = MultiStepContext(self)
        if initial_loop_values is not None:
            ctx.last_step_outputs.update(initial_loop_values)
        for _ in range(iterations):
            inputs = iterator.get_next()
            ctx.run_op = self.call_for_each_tower(fn, ctx, inputs)
        return ctx

    def initialize(self) -> list:
        """Eager: nothing to initialize; returns the empty list of init ops."""
        return []

    def finalize(self) -> list:
        """Eager: nothing to finalize; returns the empty list of ops."""
        return []


class PerDeviceDataset:
    """TF 1.11 distributed dataset: ``make_one_shot_iterator()`` / ``make_initializable_iterator()``."""

    def __init__(self, distributed):
        self._distributed = distributed

    def __iter__(self):
        return iter(self._distributed)

    def make_one_shot_iterator(self) -> DatasetIterator:
        it = DatasetIterator(self._distributed)
        it.initialize()
        return it

    def make_initializable_iterator(self) -> DatasetIterator:
        return DatasetIterator(self._distributed)


__all__ = ["MirroredStrategy", "TowerContext", "MultiStepContext", "PerDeviceDataset", "get_tower_context",
           "get_cross_tower_context", "get_distribution_strategy", "has_distribution_strategy"]
