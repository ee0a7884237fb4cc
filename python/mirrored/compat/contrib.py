"""``md.compat.contrib``: the TF 1.11 ``tf.contrib.distribute`` names (towers, ``unwrap``, ...)."""

from __future__ import annotations

from .._nest import map_structure
from ..device import device_util
from ..distribute.cross_device_ops import (CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce, ReductionToOneDevice)
from ..distribute.distribute_lib import get_cross_replica_context, get_replica_context, get_strategy, has_strategy
from ..distribute.input_lib import DistributedDatasetsFromFunction
from ..distribute.options import VariableAggregation
from ..distribute.reduce_util import ReduceOp, as_reduce_op
from ..distribute.values import DistributedValues, DistributedVariable, PerReplica
from .v1 import DatasetIterator, MirroredStrategy as _MirroredStrategyV1

# TF 1.11's names of the cross-device ops ("towers" were later called replicas).
CrossTowerOps = CrossDeviceOps
ReductionToOneDeviceCrossTowerOps = ReductionToOneDevice


def AllReduceCrossTowerOps(all_reduce_alg: str = "nccl", num_packs: int = 1, agg_small_grads_max_bytes: int = 0,
                           agg_small_grads_max_group: int = 10):
    """TF 1.11's all-reduce ops: ``"nccl"`` -> ``NcclAllReduce``, ``"hierarchical_copy"`` ->
    ``HierarchicalCopyAllReduce`` (both with ``num_packs``; the small-gradient aggregation knobs
    are accepted and not used: gradients are packed by size instead)."""
    if all_reduce_alg == "nccl":
        return NcclAllReduce(num_packs=num_packs)
    if all_reduce_alg == "hierarchical_copy":
        return HierarchicalCopyAllReduce(num_packs=num_packs)
    raise ValueError(f"all_reduce_alg={all_reduce_alg!r}: expected 'nccl' or 'hierarchical_copy'")


def _only_first(aggregation) -> bool:
    return aggregation is VariableAggregation.ONLY_FIRST_REPLICA or (
        isinstance(aggregation, str) and aggregation.upper() in ("ONLY_FIRST_REPLICA", "ONLY_FIRST_TOWER"))


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
    """State of ``run_steps_on_dataset``: ``fn(ctx, *inputs)`` records outputs with ``set_last_step_output``
    (tensors, reduced with ``aggregation`` or kept per tower) and ``set_non_tensor_output``."""

    def __init__(self, strategy):
        self._strategy = strategy
        self.last_step_outputs = {}
        self._last_step_outputs_aggregations = {}
        self._non_tensor_outputs = {}
        self.run_op = None

    def set_last_step_output(self, name, output, aggregation=VariableAggregation.NONE):
        """Record ``output`` under ``name``: as given (per tower) with NONE, else reduced with ``aggregation``."""
        if aggregation is None:
            aggregation = VariableAggregation.NONE

        def store(strategy, value):
            self._last_step_outputs_aggregations[name] = aggregation
            if aggregation is VariableAggregation.NONE:
                self.last_step_outputs[name] = value
            elif _only_first(aggregation):
                self.last_step_outputs[name] = value.values[0] if isinstance(value, DistributedValues) else value
            else:
                self.last_step_outputs[name] = strategy.extended._reduce(_as_op(aggregation), value)

        ctx = get_replica_context()
        if ctx is None:
            store(self._strategy, output)
        else:
            ctx.merge_call(store, args=(output,))

    @property
    def non_tensor_outputs(self) -> dict:
        """What ``set_non_tensor_output`` recorded: a value, or a list of the towers' values."""
        return self._non_tensor_outputs

    def set_non_tensor_output(self, name, output):
        """Record a non-tensor ``output``; in a tower, the list of every tower's value (no reduction)."""
        ctx = get_replica_context()
        if ctx is None:
            self._non_tensor_outputs[name] = output
        else:
            def store(strategy, value):
                self._non_tensor_outputs[name] = strategy.unwrap(value)

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
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
            argument = "num_gpus" if num_gpus is not None else "num_gpus_per_worker"
            raise ValueError(f"{argument}={gpus!r}: expected an int >= 0 (0: one CPU replica)")
        if devices is None and gpus is not None:
            devices = [f"/device:GPU:{i}" for i in range(gpus)] or ["/device:CPU:0"]
        if cross_tower_ops is not None and cross_device_ops is not None:
            raise ValueError("cross_tower_ops and cross_device_ops were both given; pass one of them")
        super().__init__(devices, cross_device_ops or cross_tower_ops)

    num_towers = property(lambda self: self.num_replicas_in_sync)
    worker_devices = property(lambda self: self.extended.worker_devices)
    parameter_devices = property(lambda self: self.extended.parameter_devices)

    @property
    def worker_device_index(self):
        """Each tower's index, as a per-tower value (the int itself with one tower): pass it to
        ``call_for_each_tower`` and every tower gets its own int."""
        devices = self.extended.worker_devices
        return 0 if len(devices) == 1 else PerReplica(list(range(len(devices))), devices)

    between_graph = property(lambda self: False)
    is_single_tower = property(lambda self: len(self.extended.worker_devices) == 1)
    should_checkpoint = property(lambda self: self.extended.should_checkpoint)
    should_init = property(lambda self: self.extended.experimental_should_init)
    should_save_summary = property(lambda self: self.extended.should_save_summary)

    def non_slot_devices(self, var_list) -> list:
        """Where variables that are not slots of ``var_list`` go: every tower's device."""
        return list(self.extended.worker_devices)

    def value_container(self, value):
        """The mirrored variable that ``value`` is a copy of, else ``value`` itself."""
        return self.extended.value_container(value)

    def call_for_each_tower(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on every tower; ``run_concurrently`` (TF 1.11) is taken, not passed to ``fn``:
        towers run in their own threads either way."""
        kwargs.pop("run_concurrently", None)
        return self.run(fn, args=args, kwargs=kwargs)

    def reduce(self, aggregation, value, destinations=None, **kwargs):
        """Reduce ``value`` with ``aggregation`` to ``destinations`` (default: every device of ``value``).

        ``aggregation`` is a VariableAggregation (SUM, MEAN, ONLY_FIRST_TOWER) or a
        ReduceOp. Called the TF 2 way (``reduce(op, value, axis=...)``), as
        sync-on-read variables do when read, it is ``Strategy.reduce``.
        """
        if "axis" in kwargs:
            axis = kwargs.pop("axis")
            if kwargs or destinations is not None:
                raise TypeError("reduce(op, value, axis=...) takes no destinations")
            return super().reduce(_as_op(aggregation), value, axis=axis)
        if kwargs:
            raise TypeError(f"reduce() got unexpected keyword arguments {sorted(kwargs)}")
        if destinations is None:
            destinations = value if isinstance(value, DistributedValues) else self.extended.worker_devices[0]
        if _only_first(aggregation):
            first = value.values[0] if isinstance(value, DistributedValues) else value
            if isinstance(first, (int, float)):
                return first
            return self.extended.broadcast_to(first, destinations)
        return self.extended.reduce_to(_as_op(aggregation), value, destinations)

    def batch_reduce(self, aggregation, value_destination_pairs):
        pairs = list(value_destination_pairs)
        if _only_first(aggregation):
            return [self.reduce(aggregation, v, d) for v, d in pairs]
        return self.extended.batch_reduce_to(_as_op(aggregation), pairs)

    def broadcast(self, tensor, destinations=None):
        return self.extended.broadcast_to(tensor, destinations if destinations is not None
                                          else list(self.extended.worker_devices))

    def update(self, var, fn, *args, **kwargs):
        """``fn(copy, *args, **kwargs)`` on every copy of ``var``; mirrored args (mirrored variables
        included) become their component on that copy's device."""
        copies = var.values if isinstance(var, DistributedVariable) else (var,)

        def on_copy(copy, *a, **k):
            i = next(j for j, c in enumerate(copies) if c is copy)
            pick = lambda x: x.values[i] if isinstance(x, DistributedVariable) else x  # noqa: E731
            return fn(copy, *map_structure(pick, list(a)), **map_structure(pick, dict(k)))

        return self.extended.update(var, on_copy, args, kwargs)

    def update_non_slot(self, colocate_with, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` once per device of the ``colocate_with`` variables; results grouped."""
        variables = colocate_with if isinstance(colocate_with, (list, tuple)) else [colocate_with]
        devices = variables[0]._devices if isinstance(variables[0], DistributedVariable) else \
            self.extended.worker_devices
        return self.extended.update_non_slot(devices, fn, args, kwargs)

    def read_var(self, var):
        """The value of ``var`` in cross-tower context (aggregated for tower-local variables)."""
        return var.read_value()

    def unwrap(self, value) -> list:
        """The per-tower components of ``value`` as a list (``[value]`` for a plain value)."""
        return list(self.experimental_local_results(value))

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
        """``iterations`` times: ``fn(ctx, *inputs)`` with the iterator's next element, once, in cross-tower
        context (a tuple element is unpacked); ``fn`` calls ``call_for_each_tower`` itself, as in TF 1.11.
        Returns the ``MultiStepContext`` (``last_step_outputs``, ``non_tensor_outputs``, ``run_op``)."""
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations={iterations!r}: expected a positive int")
        ctx = MultiStepContext(self)
        if initial_loop_values is not None:
            ctx.last_step_outputs.update(initial_loop_values)
        with self.scope():
            for _ in range(iterations):
                inputs = iterator.get_next()
                if not isinstance(inputs, tuple):
                    inputs = (inputs,)
                ctx.run_op = fn(ctx, *inputs)
        return ctx

    def initialize(self) -> None:
        """Eager: nothing to initialize (TF returns no ops eagerly)."""
        return None

    def finalize(self) -> None:
        """Eager: nothing to finalize (TF returns no ops eagerly)."""
        return None


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
           "get_cross_tower_context", "get_distribution_strategy", "has_distribution_strategy", "CrossTowerOps",
           "ReductionToOneDeviceCrossTowerOps", "AllReduceCrossTowerOps", "VariableAggregation"]
