"""What a ParameterServerStrategy's programs hold: variables that live on ps tasks, and sharded ones.

A :class:`RemoteVariable` is a handle (the ps task's address, the variable's id, name, shape, dtype): reading it
asks its ps task for the value, ``assign*`` sends the value there, and ``optimizer.apply_gradients`` sends each ps
task one request with its variables' gradients, which it applies with the optimizer's fused update
(``optimizer_state.apply_gradients``). A handle pickles as itself, so a scheduled function's arguments carry
variables to the workers, where they read and update the same ps tasks.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np

from ...device import device_util
from ...device.indexed_slices import IndexedSlices, map_arrays
from ...device.tensor_shape import TensorShape
from ..options import VariableAggregation, VariableSynchronization
from ..context import get_replica_context
from ..values import (_ND_SCATTERS, _SCATTERS, DistributedValues, Variable, _scatter_method, _scatter_nd_method,
                      _updated, aggregation_in_replicas, running_replica_id)
from . import rpc

__all__ = ["RemoteVariable", "ShardedVariable"]


class Handle(NamedTuple):
    """Where a variable lives and what it is; all a task needs to reach it."""

    address: str        # the ps task's host:port
    token: str          # the job's token (the ps admits only the job's tasks)
    task: int           # the ps task's index
    var_id: str
    name: str           # with ":0", as TF names it
    shape: tuple
    dtype: str
    trainable: bool
    synchronization: VariableSynchronization
    aggregation: VariableAggregation


# On the threads that serve a task's requests: .server, the md.distribute.Server (server_lib sets it), and
# .dispatching, True while a scheduled function (or a per-worker resource's function) runs.
serving = threading.local()


def _server(what: str):
    server = getattr(serving, "server", None)
    if server is None:
        raise RuntimeError(f"{what} was unpickled outside the tasks of its cluster; it travels only inside "
                           "functions scheduled with ClusterCoordinator.schedule")
    return server


def strategy_here():
    """The ParameterServerStrategy of the worker task this thread serves (what a pickled strategy becomes)."""
    return _server("a ParameterServerStrategy")._worker_strategy()


def resource_here(resource_id: str):
    """This worker's object made by ``create_per_worker_dataset`` (what a per-worker value becomes there)."""
    return _server("a per-worker value")._resource(resource_id)


def per_worker_here(resource_ids: tuple):
    """This worker's own of a ``PerWorkerValues`` (the ids of every worker's object, by worker index)."""
    server = _server("a PerWorkerValues")
    return server._resource(resource_ids[server.task_index])


def variable_here(handle: Handle) -> "RemoteVariable":
    """The variable of ``handle`` as this task sees it (a worker's: in its strategy)."""
    server = getattr(serving, "server", None)
    worker = server is not None and server.job_name == "worker"
    return RemoteVariable(handle, server._worker_strategy() if worker else None)


def _on_replica_device(strategy, value):
    """``value`` on the device of the replica running now (of ``strategy``, a worker's), else as it is."""
    place = getattr(getattr(strategy, "extended", None), "_on_replica_device", None)
    return value if place is None else place(value)


def _replicas_running(strategy) -> int:
    """How many replicas a ``strategy.run`` of ``strategy`` (a worker's) runs now on this thread; 0 outside."""
    if strategy is None or running_replica_id(strategy) is None:
        return 0
    return len(strategy.extended._local_devices)


def _combined_in_replicas(variable, value, send) -> None:
    """An update of ``variable`` inside a run of several replicas: their values combined on the host by its
    aggregation (SUM, MEAN, ONLY_FIRST_REPLICA; NONE refuses) in a ``merge_call``, and ``send(combined)`` once."""
    aggregation = aggregation_in_replicas(variable)

    def merge_fn(strategy, merged):
        n = len(strategy.extended._local_devices)
        values = [device_util.to_host(x) for x in (merged.values if isinstance(merged, DistributedValues)
                                                   else (merged,) * n)]
        if aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            combined = values[0]
        else:
            combined = functools.reduce(np.add, values)
            if aggregation == VariableAggregation.MEAN:
                combined = combined / n
        send(np.asarray(combined).astype(variable.dtype, copy=False))

    get_replica_context().merge_call(merge_fn, args=(value,))


def forget_reads(strategy) -> None:
    """A variable is updated: the reads the replicas of a worker's run share are stale."""
    if strategy is not None:
        forget = getattr(strategy.extended, "_forget_reads", None)
        if forget is not None:
            forget()


class RemoteVariable(Variable):
    """A variable on a ps task (``/job:ps/replica:0/task:i/device:CPU:0``); reads and updates go there."""

    def __init__(self, handle: Handle, strategy=None):
        self._handle = handle
        self._shape = TensorShape(handle.shape)
        self._dtype = np.dtype(handle.dtype)
        self._strategy = strategy
        self._pool = rpc.pool(handle.address, handle.token)

    def __reduce__(self):
        return variable_here, (self._handle,)

    name = property(lambda self: self._handle.name)
    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._dtype)
    trainable = property(lambda self: self._handle.trainable)
    synchronization = property(lambda self: self._handle.synchronization)
    aggregation = property(lambda self: self._handle.aggregation)
    distribute_strategy = property(lambda self: self._strategy)

    @property
    def device(self) -> str:
        return f"/job:ps/replica:0/task:{self._handle.task}/device:CPU:0"

    def read_value(self):
        """The value from the ps task; inside a worker's ``strategy.run``, on the replica's device (a GPU array
        on a GPU replica), its replicas sharing one read per run until this worker updates a variable."""
        return _on_replica_device(self._strategy, self._host_value())

    def _host_value(self):
        """The host value: the one a worker's replicas share in a run, else read now."""
        shared = getattr(getattr(self._strategy, "extended", None), "_shared_read", None)
        value = shared(self) if shared is not None else None
        return self._read_host() if value is None else value

    def _read_host(self):
        return self._pool.call("read", [self._handle.var_id])[0]

    # Updates run on the ps task, by the variable there (which checks them as any md.Variable does).
    def _update(self, method: str, *args) -> None:
        forget_reads(self._strategy)
        self._pool.call("update", self._handle.var_id, method, args)

    def _send(self, method: str, value, read_value: bool):
        if isinstance(value, Variable):
            value = value.read_value()
        if _replicas_running(self._strategy) > 1:  # (TF's AggregatingVariable: combined, then sent once)
            _combined_in_replicas(self, value, lambda combined: self._update(method, combined))
        else:
            self._update(method, device_util.to_host(value))
        return _updated(self, read_value)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._send("assign", value, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._send("assign_add", delta, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._send("assign_sub", delta, read_value)

    def _scatter(self, method: str, sparse_delta):
        if type(sparse_delta) is IndexedSlices:  # (a GPU replica's rows travel from the host)
            sparse_delta = map_arrays(device_util.to_host, sparse_delta)
        self._update(method, sparse_delta)
        return self

    def _scatter_nd(self, method: str, indices, updates):
        self._update(method, device_util.to_host(indices), device_util.to_host(updates))
        return self

    def batch_scatter_update(self, sparse_delta, use_locking=False, name=None):
        """``tf.Variable.batch_scatter_update``, on the ps task; returns the variable."""
        return self._scatter("batch_scatter_update", sparse_delta)

    scatter_add, scatter_sub, scatter_mul, scatter_div, scatter_max, scatter_min, scatter_update = map(
        _scatter_method, _SCATTERS)
    scatter_nd_add, scatter_nd_sub, scatter_nd_update, scatter_nd_max, scatter_nd_min = map(
        _scatter_nd_method, _ND_SCATTERS)

    def sparse_read(self, indices, name=None):
        """The rows at ``indices`` (``tf.gather`` along axis 0), gathered on the ps task."""
        return _on_replica_device(self._strategy, self._pool.call("gather", self._handle.var_id, "sparse_read",
                                                                  device_util.to_host(indices)))

    def gather_nd(self, indices, name=None):
        """``tf.gather_nd`` of the value, on the ps task."""
        return _on_replica_device(self._strategy, self._pool.call("gather", self._handle.var_id, "gather_nd",
                                                                  device_util.to_host(indices)))

    def is_initialized(self) -> np.bool_:
        return np.bool_(True)



class ShardedVariable(Variable):
    """A variable split along its first axis into shards on the ps tasks (``tf.distribute.ShardedVariable``'s
    semantics): ``variables`` are the shards in order; reads concatenate them, ``assign*`` splits the value.
    ``name`` is the container's, ``'ShardedVariable'`` unless given (TF's); the shards carry the variable's name
    (``'table/part_0:0'``, ...)."""

    def __init__(self, variables, name="ShardedVariable"):
        variables = list(variables)
        if not variables:
            raise ValueError("variables=[]: a ShardedVariable needs at least one shard")
        first = variables[0]
        for v in variables[1:]:
            if v.dtype != first.dtype or tuple(v.shape)[1:] != tuple(first.shape)[1:]:
                raise ValueError(f"variables: shard {v.name!r} of shape {tuple(v.shape)} and dtype {v.dtype} does "
                                 f"not match {first.name!r} ({tuple(first.shape)}, {first.dtype}); shards differ in "
                                 "their first dimension only")
        self._variables = variables
        rows = [v.shape[0] for v in variables]
        self._offsets = np.cumsum([0] + rows)
        self._shape = TensorShape((int(self._offsets[-1]),) + tuple(first.shape)[1:])
        self._name = name

    variables = property(lambda self: list(self._variables))
    name = property(lambda self: self._name)
    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._variables[0].dtype)
    trainable = property(lambda self: self._variables[0].trainable)
    synchronization = property(lambda self: self._variables[0].synchronization)
    aggregation = property(lambda self: self._variables[0].aggregation)
    distribute_strategy = property(lambda self: self._variables[0].distribute_strategy)

    def read_value(self):
        """The shards' values, concatenated; on the replica's device inside a worker's ``strategy.run``."""
        return _on_replica_device(self.distribute_strategy,
                                  np.concatenate([v._host_value() for v in self._variables], axis=0))

    def _split(self, value, argument: str) -> list:
        if isinstance(value, Variable):
            value = value.read_value()
        value = device_util.to_host(value)
        if tuple(value.shape) != tuple(self._shape):
            raise ValueError(f"{argument}: cannot assign a value of shape {tuple(value.shape)} to sharded variable "
                             f"{self._what()} of shape {tuple(self._shape)}; the shapes must be equal")
        return np.split(value, self._offsets[1:-1], axis=0)

    def _each(self, method: str, value, argument: str, read_value: bool):
        for v, part in zip(self._variables, self._split(value, argument)):
            getattr(v, method)(part, read_value=False)
        return _updated(self, read_value)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return self._each("assign", value, "value", read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return self._each("assign_add", delta, "delta", read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return self._each("assign_sub", delta, "delta", read_value)

    def _scatter(self, method: str, sparse_delta):
        """A row scatter split over the shards: each gets the rows it holds (renumbered from its first)."""
        if type(sparse_delta) is not IndexedSlices:
            raise TypeError(f"sparse_delta: {method} takes an md.IndexedSlices (values, indices), not a "
                            f"{type(sparse_delta).__name__}")
        indices = device_util.to_host(sparse_delta.indices).astype(np.int64, copy=False)
        values = device_util.to_host(sparse_delta.values)
        self._check_rows(indices, "sparse_delta.indices")
        shard = np.searchsorted(self._offsets, indices, side="right") - 1
        for s in np.unique(shard):
            where = shard == s
            self._variables[s]._scatter(method, IndexedSlices(values[where], indices[where] - self._offsets[s]))
        return self

    scatter_add, scatter_sub, scatter_mul, scatter_div, scatter_max, scatter_min, scatter_update = map(
        _scatter_method, _SCATTERS)

    def _check_rows(self, flat, argument: str) -> None:
        rows = self._shape[0]
        if flat.size and (flat.min() < 0 or flat.max() >= rows):
            bad = int(flat[(flat < 0) | (flat >= rows)][0])
            raise IndexError(f"{argument}: {bad} is not in [0, {rows}), the rows of {self._what()}")

    def sparse_read(self, indices, name=None):
        """The rows at ``indices``, from the shards that hold them (``embedding_lookup``)."""
        return self.embedding_lookup(indices)

    def embedding_lookup(self, ids):
        """The rows ``ids`` (``tf.nn.embedding_lookup`` of the sharded table, TF's "div" partitioning)."""
        ids = device_util.to_host(ids)
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        self._check_rows(flat, "ids")
        shard = np.searchsorted(self._offsets, flat, side="right") - 1
        rows = np.empty((flat.size,) + tuple(self._shape)[1:], self.dtype)
        for s in np.unique(shard):
            where = shard == s
            rows[where] = self._variables[s]._host_value()[flat[where] - self._offsets[s]]
        return _on_replica_device(self.distribute_strategy, rows.reshape(ids.shape + tuple(self._shape)[1:]))

    @property
    def _base_name(self) -> str:
        """The variable's own name, its shards' without ``/part_i:0`` (the container's is 'ShardedVariable')."""
        return self._variables[0].name.rsplit("/part_", 1)[0].removesuffix(":0")

    def _what(self) -> str:
        return f"'{self._base_name}'"

    def __repr__(self) -> str:
        return f"<mirrored.ShardedVariable {self._what()} shape={self._shape} dtype={self.dtype.name}, " \
               f"{len(self._variables)} shards>"


def _shards(grads, variables) -> tuple:
    """Gradients and variables with each ShardedVariable replaced by its shards (its gradient split to fit)."""
    out_grads, out_vars = [], []
    for g, v in zip(grads, variables):
        if isinstance(v, ShardedVariable) and type(g) is IndexedSlices:  # each shard its rows, renumbered
            indices = np.asarray(g.indices).astype(np.int64, copy=False)
            shard = np.searchsorted(v._offsets, indices, side="right") - 1
            for s, part in enumerate(v.variables):
                where = shard == s
                out_grads.append(IndexedSlices(np.asarray(g.values)[where], indices[where] - v._offsets[s]))
                out_vars.append(part)
        elif isinstance(v, ShardedVariable):
            out_grads += np.split(np.asarray(g), v._offsets[1:-1], axis=0)
            out_vars += v.variables
        else:
            out_grads.append(g)
            out_vars.append(v)
    return out_grads, out_vars
