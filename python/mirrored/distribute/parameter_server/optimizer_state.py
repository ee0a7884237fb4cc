"""An optimizer's state under ParameterServerStrategy: variables on the ps tasks, which every task sees as handles.

As in TF, the optimizer's step count and slots are ps variables: each variable's slots beside it (in that ps
task's copy of the optimizer, which applies the variable's updates with them), the step count on ps task 0, the
optimizer's *home*. The first update of a variable list (from any task) asks the home task to build their state:
it records the variables' order (Keras' build order, which numbers the slots of a checkpoint), has each ps task
create its variables' slots, and assigns what a checkpoint restore left waiting for them. Each update then goes to
the home task first (which counts the step) and to the others with that step. ``optimizer.iterations``,
``variables``, ``get_slot`` and ``md.train.Checkpoint`` read and assign the ps copies through handles
(:func:`attach`). docs/parameter_server.md.
"""

from __future__ import annotations

import threading

import numpy as np

from ...device import device_util
from ...device.indexed_slices import IndexedSlices, map_arrays
from ..context import get_replica_context, get_strategy, has_strategy, in_cross_replica_context
from ..options import VariableAggregation, VariableSynchronization
from ..reduce_util import ReduceOp
from ..values import DistributedValues, PerReplica
from . import rpc
from .values import Handle, RemoteVariable, ShardedVariable, _shards, forget_reads

__all__ = ["apply_gradients", "attach", "build", "layout"]


def slot_id(key: str, var_id: str, slot: str) -> str:
    """The ps store's id of slot ``slot`` of variable ``var_id`` in optimizer ``key``'s copy."""
    return f"{key}/{var_id}/{slot}"


def iterations_id(key: str) -> str:
    return f"{key}/iterations"


def layout(variables) -> list:
    """The variables as build units, in order: a tuple of handles each (a ShardedVariable's shards)."""
    return [tuple(s._handle for s in v.variables) if isinstance(v, ShardedVariable) else (v._handle,)
            for v in variables]


def _slot(unit: tuple, key: str, slot: str, base: str, strategy):
    """The handle of slot ``slot`` of the variable ``unit`` (sharded as the variable is)."""
    def handle(h: Handle, name: str) -> Handle:
        return h._replace(var_id=slot_id(key, h.var_id, slot), name=f"{name}:0", trainable=False,
                          synchronization=VariableSynchronization.AUTO, aggregation=VariableAggregation.NONE)

    if len(unit) == 1:
        return RemoteVariable(handle(unit[0], f"{base}/{slot}"), strategy)
    return ShardedVariable([RemoteVariable(handle(h, f"{base}/{slot}/part_{i}"), strategy)
                            for i, h in enumerate(unit)])


def attach(optimizer, units: list, objects: list, home: Handle, strategy) -> None:
    """Give ``optimizer`` handles to its ps state: ``_iterations`` (``home``'s) and the slots of ``units`` (build
    order), keyed by this task's variable ``objects`` (None where it has none for a unit: a handle is made)."""
    slots = {}
    for unit, var in zip(units, objects):
        if var is None:
            var = RemoteVariable(unit[0], strategy) if len(unit) == 1 else \
                ShardedVariable([RemoteVariable(h, strategy) for h in unit])
        base = var._base_name if isinstance(var, ShardedVariable) else var.name.split(":")[0]
        slots[id(var)] = (var, {name: _slot(unit, optimizer._ps_key, name, base, strategy)
                                for name, _ in optimizer._state_specs})
    optimizer._slots = slots
    optimizer._iterations = RemoteVariable(home, strategy)
    optimizer.built = bool(slots)


def home_handle(optimizer, address: str, token: str) -> Handle:
    """The handle of the step count of ``optimizer``'s ps copies, on its home task (ps task 0)."""
    return Handle(address, token, 0, iterations_id(optimizer._ps_key), f"{optimizer.name}/iterations:0", (),
                  np.dtype(np.int64).str, False, VariableSynchronization.AUTO,
                  VariableAggregation.ONLY_FIRST_REPLICA)


def _rule(optimizer):
    """The copy a ps task applies updates with: the optimizer's arguments, its clipping done by the caller."""
    return optimizer._without_state(clipnorm=None, clipvalue=None, global_clipnorm=None, loss_scale_factor=None)


# (optimizer key, variable ids) this process had built on the home task: later updates skip the request.
_built: set = set()
_built_lock = threading.Lock()


def build(optimizer, units: list, home: str, token: str) -> None:
    """Have the home task build the state of ``units`` (idempotent); once per process and variable list."""
    marker = (optimizer._ps_key, tuple(h.var_id for unit in units for h in unit))
    with _built_lock:
        if marker in _built:
            return
    rpc.pool(home, token).call("build", optimizer._ps_key, _rule(optimizer), units, optimizer.name)
    with _built_lock:
        _built.add(marker)


def _strategy_of(variables):
    first = variables[0].variables[0] if isinstance(variables[0], ShardedVariable) else variables[0]
    return first.distribute_strategy


def _home(variables) -> tuple:
    """(address, token) of the home task of updates to ``variables``: their strategy's ps task 0."""
    first = variables[0].variables[0] if isinstance(variables[0], ShardedVariable) else variables[0]
    strategy = first.distribute_strategy
    if strategy is None:
        raise RuntimeError(f"variable {first.name!r} has no ParameterServerStrategy here: apply gradients on the "
                           "coordinator or in a scheduled function")
    return strategy.extended._ps_addresses[0], first._handle.token


def _local_replicas() -> int:
    """How many replicas the running ``strategy.run`` has on this task (1 outside one)."""
    if in_cross_replica_context() or not has_strategy():
        return 1
    return len(get_strategy().extended._local_devices)


def summed_over_replicas(strategy, grads) -> list:
    """The gradients of a worker's replicas (``PerReplica``, or one object every replica passed), summed into
    host arrays as TF sums them before the update: the dense ones by one batched all-reduce over the replicas'
    devices (the strategy's fused collective), an ``IndexedSlices``' rows by concatenation (a sum, applied)."""
    extended = strategy.extended
    devices, n = extended._local_devices, len(extended._local_devices)
    parts = [g.values if isinstance(g, DistributedValues) else (g,) * n for g in grads]
    out = [None] * len(grads)
    dense = [k for k, p in enumerate(parts) if type(p[0]) is not IndexedSlices]
    if dense:
        on_devices = [PerReplica([device_util.place(x, d) for x, d in zip(parts[k], devices)], devices)
                      for k in dense]
        for k, reduced in zip(dense, extended.batch_reduce_to(ReduceOp.SUM, [(v, v) for v in on_devices])):
            out[k] = device_util.to_host(extended._local_results(reduced)[0])
    for k, p in enumerate(parts):
        if type(p[0]) is IndexedSlices:
            rows = [map_arrays(device_util.to_host, x) for x in p]
            out[k] = IndexedSlices(np.concatenate([r.values for r in rows]), np.concatenate([r.indices for r in rows]),
                                   p[0].dense_shape)
    return out


def apply_gradients(optimizer, grads, variables) -> int:
    """``optimizer.apply_gradients`` of variables on ps tasks: clipped here (over all of them, as Keras clips),
    then one request per ps task with its variables' gradients, applied there by its copy of the optimizer (the
    slots beside the variables): the home task's first, which counts the step, then the others at that step.
    A worker with several replicas (GPUs) clips each replica's gradients, sums them (``summed_over_replicas``,
    in a ``merge_call``) and updates once. Returns the step count after the update."""
    if _local_replicas() > 1:
        grads = optimizer._clip(optimizer._unscale(list(grads)))
        return get_replica_context().merge_call(
            lambda strategy, merged: _apply_once(optimizer, summed_over_replicas(strategy, merged), variables),
            args=(grads,))
    if any(isinstance(g, DistributedValues) for g in grads):  # (the replicas' gradients, merged by the caller)
        grads = summed_over_replicas(get_strategy(), grads)
    return _apply_once(optimizer, optimizer._clip(optimizer._unscale(list(grads))), variables)


def _apply_once(optimizer, grads, variables) -> int:
    if getattr(optimizer, "_exclude_ids", None):
        raise ValueError(f"{type(optimizer).__name__}.exclude_from_weight_decay(var_list=...) names variables by "
                         "identity, which does not reach the ps tasks; use exclude_from_weight_decay(var_names=[...])")
    for v in variables:
        if not isinstance(v, (RemoteVariable, ShardedVariable)):
            raise TypeError(f"variable {v.name!r} is not on a ps task, while others of this apply_gradients are; "
                            "create every variable inside ParameterServerStrategy.scope()")
    home, token = _home(variables)
    build(optimizer, layout(variables), home, token)
    forget_reads(_strategy_of(variables))
    grads = [device_util.to_host(g) if type(g) is not IndexedSlices else map_arrays(device_util.to_host, g)
             for g in grads]
    grads, variables = _shards(grads, variables)
    by_task: dict = {home: (rpc.pool(home, token), [], [])}  # (the home task first: it counts the step)
    for g, v in zip(grads, variables):
        _, ids, task_grads = by_task.setdefault(v._handle.address, (v._pool, [], []))
        ids.append(v._handle.var_id)
        task_grads.append(g)
    (home_pool, ids, task_grads), *others = by_task.values()
    step = home_pool.call("apply", optimizer._ps_key, None, ids, task_grads)
    for pool, ids, task_grads in others:
        pool.call("apply", optimizer._ps_key, step - 1, ids, task_grads)
    return step


def _finite(grad) -> bool:
    return bool(np.isfinite(np.asarray(getattr(grad, "values", grad))).all())  # (an IndexedSlices': its rows)


def loss_scale_step(optimizer, pairs) -> int:
    """A ``LossScaleOptimizer``'s step on ps variables: its scale and good-step counter (ps variables on one
    task) read and updated there by one request (the scale doubles after ``dynamic_growth_steps`` finite steps
    and halves on a step whose gradients are not all finite, which is skipped), then the gradients unscaled by
    the scale they were scaled with and applied by the wrapped optimizer. Returns its step count after it."""
    counter, scale = optimizer.step_counter, optimizer.dynamic_scale
    if not (isinstance(counter, RemoteVariable) and isinstance(scale, RemoteVariable)
            and counter._handle.address == scale._handle.address):
        raise ValueError(f"optimizer: LossScaleOptimizer {optimizer.name!r} was not created inside "
                         "ParameterServerStrategy.scope() (its scale's state must live on a ps task); create it "
                         "there, with the model")
    if any(isinstance(g, DistributedValues) for g, _ in pairs):  # (a worker's replicas': summed, as TF updates)
        pairs = list(zip(summed_over_replicas(get_strategy(), [g for g, _ in pairs]), [v for _, v in pairs]))
    finite = not optimizer.dynamic or all(_finite(g) for g, _ in pairs)
    used = counter._pool.call("loss_scale", counter._handle.var_id, scale._handle.var_id, finite,
                              optimizer.dynamic_growth_steps if optimizer.dynamic else None)
    if not finite:
        return int(optimizer.iterations.numpy())
    grads = [g if optimizer._caller_unscales else optimizer._unscaled(g, used) for g, _ in pairs]
    return optimizer.inner_optimizer.apply_gradients(list(zip(grads, [v for _, v in pairs])))


# optimizer.apply_gradients hands variables of these kinds to this function (train/optimizers/base.py)
RemoteVariable._apply_gradients = ShardedVariable._apply_gradients = staticmethod(apply_gradients)
