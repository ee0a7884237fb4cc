"""``md.distribute.experimental.CentralStorageStrategy``: TensorFlow's one-machine strategy that keeps every
variable once, on a parameter device, and replicates the computation on the compute devices
(``tf.distribute.experimental.CentralStorageStrategy``).

The replicas are MirroredStrategy's machinery over the compute devices: the same replica context, reductions,
input pipeline, GPU streams. What differs is TF's: a variable created in its scope has one copy, on the
parameter device (an :class:`AggregatingVariable` when there are several replicas, else a plain variable); a
replica reads the current value on its own device; an update inside ``run`` goes through the variable's
aggregation (a ``merge_call``) and is applied once. Values bound for the parameter device (an optimizer's
gradients, packed one buffer per dtype) are all-reduced over the replicas in one fused call, as
MirroredStrategy's step does, and one replica's result is taken there, so a step gives MirroredStrategy's weights
bit for bit; after the update the replicas on other GPUs get the new values in one transfer per GPU and dtype
(docs/central_storage.md).
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from ..collective import api as collectives
from ..device import config, device_util, gpu as _gpu
from .distribute_lib import Strategy
from .mirrored_strategy import MirroredExtended
from .one_device_strategy import update_on
from .values import (AssignsThroughUpdate, DeviceVariable, DistributedValues, Variable, running_replica_id,
                     update_in_replica)

__all__ = ["CentralStorageStrategy", "AggregatingVariable"]

# TF's default parameter device when there are several compute devices (kept as spelled: parameter_devices)
_LOCAL_CPU = "/device:CPU:0"


def _compute_devices(compute_devices) -> list:
    """TF's default (every GPU, else the CPU), or ``compute_devices`` as a list of device strings."""
    if compute_devices is None:
        return [d.name for d in config.list_logical_devices("GPU")] or ["/cpu:0"]
    if isinstance(compute_devices, str) or not hasattr(compute_devices, "__iter__"):
        error = ValueError if isinstance(compute_devices, str) else TypeError
        raise error(f"compute_devices={compute_devices!r}: expected a list of device strings, e.g. ['/gpu:0', "
                    "'/gpu:1'] (or None for every GPU, else the CPU)")
    devices = list(compute_devices)
    if not devices:
        raise ValueError("compute_devices=[]: no compute device given; pass a list such as ['/cpu:0', '/cpu:1'], "
                         "or None for every GPU (else the CPU)")
    return [device_util.canonicalize(d, argument="compute_devices") for d in devices]


def _parameter_device(parameter_device) -> str:
    """``parameter_device`` in full, checked: a device this machine has."""
    if not isinstance(parameter_device, str):
        raise ValueError(f"parameter_device={parameter_device!r}: expected one device string, e.g. '/cpu:0' or "
                         "'/gpu:0' (or None: the CPU, or the one compute device)")
    device = device_util.canonicalize(parameter_device, argument="parameter_device")
    spec = device_util.parse(device)
    num_gpus = len(config.list_logical_devices("GPU"))
    if spec.device_type == "GPU" and spec.device_index >= num_gpus:
        raise ValueError(f"parameter_device={parameter_device!r} is not available; this machine has {num_gpus} "
                         f"GPU(s) (md.config.list_logical_devices('GPU'){config.hidden_note('GPU')}); use '/cpu:0' "
                         "instead")
    return device


@contextlib.contextmanager
def _ordered_with_replicas(devices):
    """The one context for writing what replicas read on GPUs ``devices`` (the last one current): each GPU's
    merge stream (device_util.cross_replica_gpu_scope) current on it. Several replicas, each on its own
    stream, read one copy per GPU; the merge stream's work follows every replica stream's queued work (their
    reads of the old values) and precedes their later work (reads of the new ones), and a block allocated
    there is handed out again only to later merge-stream work. On the stream of whichever replica happened to
    read first, the others would read unordered with the copy (before it ran: garbage), and that replica's
    next allocations would take the block back under their reads."""
    with contextlib.ExitStack() as scopes:
        for device in devices:
            scopes.enter_context(device_util.cross_replica_gpu_scope(device))
        yield


def _same_memory(a: str, b: str) -> bool:
    """Whether devices ``a`` and ``b`` address the same memory: the host's, or one physical GPU's."""
    spec_a, spec_b = device_util.parse(a), device_util.parse(b)
    if spec_a.device_type != spec_b.device_type:
        return False
    return spec_a.device_type == "CPU" or device_util.physical_ordinal(a) == device_util.physical_ordinal(b)


class AggregatingVariable(AssignsThroughUpdate, DeviceVariable):
    """A variable of a CentralStorageStrategy with several replicas (TF's ``ps_values.AggregatingVariable``): one
    copy, on the parameter device.

    Inside ``run`` a replica reads the current value on its own device: a replica on the parameter device's
    own memory (a CPU replica of a variable in host memory, a replica on the variable's GPU) the array itself,
    any other a copy on its GPU, made once per value: by the optimizer's update for every variable it updates
    (:class:`_ReplicaReads`), else by the first read after a write. ``assign`` / ``assign_add`` / ``assign_sub``
    inside ``run`` combine the replicas' values with the variable's ``aggregation`` (``SUM``, ``MEAN``,
    ``ONLY_FIRST_REPLICA``; ``NONE`` refuses) and update it once; in cross-replica context they update it
    directly.
    """

    # Per replica, what its reads return while the value stays as it is (None entries: the value itself);
    # None: to be copied at the next read. Every write drops it (_writable_buffer).
    _reads = None

    def __init__(self, strategy, value, name, device, trainable, synchronization, aggregation):
        super().__init__(value, name, device, trainable, synchronization, aggregation)
        self._strategy = strategy
        # Per replica: the device a read is copied to, or None where the replica reads the value itself
        self._copy_to = tuple(None if _same_memory(d, device) else d
                              for d in strategy.extended.worker_devices)

    def read_value(self):
        rid = running_replica_id(self._strategy)
        if rid is None or self._copy_to[rid] is None:
            return self._value
        reads = self._reads
        if reads is None:
            reads = self._strategy.extended._copied_for_replicas(self)
        return reads[rid]

    def _writable_buffer(self):
        self._reads = None  # (the replicas' copies are of the value before this write)
        return super()._writable_buffer()

    def _update(self, method: str, value):
        update = getattr(DeviceVariable, method)

        def apply(x):  # TF's: through extended.update (distributed values: the first replica's)
            self._strategy.extended.update(self, update, args=(x,))

        if running_replica_id(self._strategy) is None:
            apply(value)
            return self
        return update_in_replica(self, value, apply)


class CentralStorageExtended(MirroredExtended):
    """``CentralStorageStrategy.extended``: replicas on the compute devices, variables on the parameter device."""

    def __init__(self, container_strategy, compute_devices=None, parameter_device=None):
        super().__init__(container_strategy, _compute_devices(compute_devices))
        if parameter_device is None:  # TF's: the one compute device, else the CPU
            parameter_device = self._local_devices[0] if len(self._local_devices) == 1 else _LOCAL_CPU
        self._parameter_device = _parameter_device(parameter_device)
        self._parameter_devices = (parameter_device,)  # as given, as TF reports it
        # One compute device that holds the variables too: TF keeps plain variables there.
        self._plain_variables = self._local_devices == (self._parameter_device,)
        # The replicas' copies of the variables an optimizer updates, per variable list (their ids), refreshed
        # by each update; and the variables whose copies a read made (dropped by the next update, which may
        # have written them: slots, accumulators).
        self._replica_reads = {}
        self._read_copies = {}  # id -> variable
        self._plan_variables = {}  # per variable list (their ids): the set of those ids
        # The replica whose all-reduced values (the same bits on every replica) go to the variables: one on the
        # parameter device's memory where there is one (no copy between GPUs), else the first.
        self._nearest_replica = next((r for r, d in enumerate(self._local_devices)
                                      if _same_memory(d, self._parameter_device)), 0)

    # TF's: a step of distribute_datasets_from_function that some replica has no batch for ends the input
    experimental_enable_get_next_as_optional = False
    _per_replica_pipelines = False

    @property
    def parameter_devices(self) -> tuple:
        return self._parameter_devices

    @property
    def experimental_between_graph(self) -> bool:
        return True  # (TF's answer for every ParameterServerStrategy, this one included)

    def non_slot_devices(self, var_list):
        """TF's: the variable of ``var_list`` whose name sorts first (a variable, not devices)."""
        return min(var_list, key=lambda v: v.name)

    def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
        """``fn(*args, **kwargs)`` once, on the parameter device."""
        return super().update_non_slot((self._parameter_device,), fn, args, kwargs, group)

    def _capture_refusal(self):
        """Why md.function cannot capture this strategy's step as CUDA graphs (None: it can). The step's graphs
        are one per replica GPU, and everything between GPUs in them goes through collectives, which order
        themselves: the gradients' all-reduce, whose sum the update takes from a replica on the parameter
        device's GPU, and the broadcast of the updated variables to the replicas on other GPUs."""
        if device_util.parse(self._parameter_device).device_type != "GPU":
            return (f"its variables live in host memory ({self._parameter_device}): their update runs on the host, "
                    "and the replicas' reads and gradients are copies between host and GPU memory, which a CUDA "
                    "graph of GPU work cannot hold; pass parameter_device='/gpu:0'")
        if not any(_same_memory(d, self._parameter_device) for d in self._local_devices):
            return (f"no replica runs on the GPU of its variables ({self._parameter_device}), so the gradients' sum "
                    "and the variables' values are copied between GPUs outside any collective, which a captured "
                    "step cannot order; make that GPU a compute device too")
        return None

    def _copied_for_replicas(self, variable) -> tuple:
        """``variable``'s reads on every replica, copied now (a read after a write, or of a variable no update
        refreshes): one copy per GPU, which its replicas share until the next write or update."""
        scope = _gpu.step_scope()
        if scope is not None and scope.capturing:
            raise RuntimeError(
                f"variable {variable.name!r} was written in this step outside the optimizer's update (or is "
                f"not one it updates), so a replica's read would copy it from {variable.device} to another GPU, "
                "which md.function cannot capture; assign it outside the step")
        copies = {}  # GPU ordinal -> the copy its replicas read
        for d in variable._copy_to:
            if d is not None and device_util.physical_ordinal(d) not in copies:
                with _ordered_with_replicas([d]):  # (read by every replica of that GPU, not only this one)
                    copies[device_util.physical_ordinal(d)] = device_util.place(variable._value, d, copy=True)
        reads = variable._reads = tuple(None if d is None else copies[device_util.physical_ordinal(d)]
                                        for d in variable._copy_to)
        self._read_copies[id(variable)] = variable
        return reads

    def _variables_updated(self, plan, updated: bool) -> None:
        """After an optimizer's update on the parameter device (``plan``: the optimizer's, see
        train/optimizers/base.py): copies that reads made are dropped (the update may have written those
        variables: slots, accumulators), and, when the variables changed (``updated``), their copies on the
        replicas' GPUs refreshed at once (:class:`_ReplicaReads`). A step that only accumulated
        (``updated`` False) wrote no variable of the plan (unless it overwrote them with their moving
        averages): their copies stay, and the next step's reads copy nothing."""
        key = tuple(map(id, plan.variables))
        if updated or plan.ema_overwrite:
            for variable in self._read_copies.values():
                variable._reads = None
            self._read_copies.clear()
        else:
            kept = self._plan_variables.get(key)
            if kept is None:
                kept = self._plan_variables[key] = frozenset(key)
            for k in [k for k in self._read_copies if k not in kept]:
                self._read_copies.pop(k)._reads = None
            return
        reads = self._replica_reads.get(key, False)
        if reads is False:  # (decided once per variable list)
            reads = self._replica_reads[key] = _ReplicaReads.for_plan(plan)
        if type(reads) is _ReplicaReads:
            reads.refresh(plan)
        elif reads:  # (copied again by each variable's next read)
            for variable in reads:
                variable._reads = None

    def _make_variable(self, value, name, trainable, synchronization, aggregation):
        # TF keeps ``synchronization`` and ``aggregation`` as given, unchecked (NONE, MEAN of integers).
        if self._plain_variables:
            variable = DeviceVariable(value, f"{name}:0", self._parameter_device, trainable, synchronization,
                                      aggregation)
            variable._strategy = self._container_strategy
            return variable
        return AggregatingVariable(self._container_strategy, value, f"{name}:0", self._parameter_device, trainable,
                                   synchronization, aggregation)

    def _update(self, var, fn, args, kwargs, group):
        if not isinstance(var, Variable):
            raise ValueError(f"You can not update `var` {var!r}. It must be a Variable (md.Variable); "
                             "strategy.extended.update takes a variable and fn(variable, ...)")
        return update_on(self, var.device, var, fn, args, kwargs, group)

    def _batch_reduce_to(self, op, pairs, options):
        # Values bound for the parameter device (its variables: an optimizer's gradients, or their fusion
        # buffers) are all-reduced over the replicas in one fused call, the sum MirroredStrategy's step takes,
        # and one replica's result is moved there (none moves from a replica on its memory): one collective,
        # not one reduce per value.
        strategy, devices = self._container_strategy, self._local_devices
        if pairs and all(type(d) is AggregatingVariable and d._strategy is strategy and d is not v
                         and isinstance(v, DistributedValues) and v._devices == devices for v, d in pairs):
            reduced = super()._batch_reduce_to(op, [(v, v) for v, _ in pairs], options)
            with device_util.cross_replica_gpu_scope(self._parameter_device):
                return [device_util.place(self._local_results(r)[self._nearest_replica], self._parameter_device)
                        for r in reduced]
        return super()._batch_reduce_to(op, pairs, options)


class _ReplicaReads:
    """The copies that replicas on other GPUs than the parameter device's memory read of the variables one
    optimizer updates: per such GPU one buffer per dtype, holding the variables back to back (the optimizer's
    fusion layout), and a view of it per variable, which the variable's reads return.

    After each update :meth:`refresh` fills them with nothing per variable: from a GPU parameter device the
    variables packed into the optimizer's fusion buffers on it (one launch) and broadcast to the other GPUs
    (one collective per dtype, which md.function captures as the all-reduce); from the host, packed by one
    copy per dtype and copied to each GPU (one copy per GPU and dtype). A view that a reader still holds, or an
    array derived from one (a slice, a reshape), keeps its values: its GPU gets new buffers first (copy-on-write,
    as variables do).
    """

    def __init__(self, plan):
        self.variables = plan.variables
        self.groups = list(plan.groups.values())
        self.source = self.variables[0].device
        copy_to = self.variables[0]._copy_to
        # One device per GPU that reads copies (logical replicas of one GPU share them), and each replica's
        self.devices = list({device_util.physical_ordinal(d): d for d in copy_to if d is not None}.values())
        ordinals = [device_util.physical_ordinal(d) for d in self.devices]
        self.slot = tuple(None if d is None else ordinals.index(device_util.physical_ordinal(d)) for d in copy_to)
        # A view's references when no reader holds it: the views list, each replica's reads tuple, the count's
        self.unheld = [2 + self.slot.count(i) for i in range(len(self.devices))]
        # Per GPU, each buffer's references when no reader holds it (measured as allocated): an array a reader
        # derived from its read (a slice, a reshape) holds the buffer (CuPy's base, the memory's owner), not the
        # view it was derived from
        self.unheld_buffers = [None] * len(self.devices)
        values = [v._value for v in self.variables]
        self.staging = ([np.empty(sum(values[k].size for k in indices), values[indices[0]].dtype)
                         for indices in self.groups] if device_util.parse(self.source).device_type == "CPU" else None)
        # NCCL's broadcast where it loads: each GPU's CUDA graph holds it (md.function); the native one orders
        # the GPUs with events, which a capture cannot record
        self.algorithm = "nccl" if _gpu.nccl_available() else "auto"
        self.buffers, self.views = [None] * len(self.devices), [None] * len(self.devices)
        for i in range(len(self.devices)):
            self._allocate(i, plan)
        self._link()

    @staticmethod
    def for_plan(plan):
        """How the replicas' reads of ``plan``'s variables follow its updates: a ``_ReplicaReads`` where the copies
        are on GPUs and can be refreshed this way (host variables, or GPU variables the plan packs on their GPU),
        else the variables whose copies an update drops (none: every replica reads the variables' memory)."""
        variables = plan.variables
        copied = [v for v in variables if type(v) is AggregatingVariable and any(d is not None for d in v._copy_to)]
        if len(copied) < len(variables) or not all(
                device_util.parse(d).device_type == "GPU" for d in variables[0]._copy_to if d is not None):
            return copied
        if device_util.parse(variables[0].device).device_type == "CPU" or (
                plan.packs and len(plan.pack_devices) > plan.own_pack[0]):
            return _ReplicaReads(plan)
        return copied

    def _allocate(self, i: int, plan) -> None:
        """New buffers for GPU ``i``, one per dtype in ``plan``'s fusion layout, and their views per variable."""
        with _ordered_with_replicas([self.devices[i]]):
            buffers = [device_util.empty(sum(self.variables[k]._value.size for k in indices),
                                         self.variables[indices[0]]._value.dtype, self.devices[i])
                       for indices in self.groups]
        self.buffers[i], self.views[i] = buffers, plan.unpacked(buffers)
        self.unheld_buffers[i] = list(map(sys.getrefcount, buffers))

    def _link(self) -> None:
        """Each variable's reads: per replica, the view on its GPU."""
        self.reads = [tuple(None if i is None else self.views[i][k] for i in self.slot)
                      for k in range(len(self.variables))]

    def refresh(self, plan) -> None:
        for i, views in enumerate(self.views):
            if max(map(sys.getrefcount, views)) > self.unheld[i] or any(
                    n > unheld for n, unheld in zip(map(sys.getrefcount, self.buffers[i]), self.unheld_buffers[i])):
                scope = _gpu.step_scope()
                if scope is not None and scope.capturing:
                    raise RuntimeError(
                        f"an array a replica on {self.devices[i]} read of a variable is still referenced when the "
                        "optimizer updates the variables, so the replica's copies would move to new buffers, which "
                        "a captured step cannot replay; inside md.function drop such references before the update")
                self._allocate(i, plan)
                self._link()
        values = [v._value for v in self.variables]
        if self.staging is not None:  # host variables: packed on the host, one copy to each GPU per dtype
            for staging, indices in zip(self.staging, self.groups):
                np.concatenate([values[k] for k in indices], axis=None, out=staging)
            for device, buffers in zip(self.devices, self.buffers):
                with _ordered_with_replicas([device]):
                    for buffer, staging in zip(buffers, self.staging):
                        buffer.set(staging)
        else:  # on the update's stream: the variables packed, then broadcast to the other GPUs
            with _ordered_with_replicas(self.devices + [self.source]):
                packed = plan.pack(plan.own_pack[0], values)
                for j, source in enumerate(packed):
                    targets = [source] + [buffers[j] for buffers in self.buffers]
                    collectives.broadcast(targets, 0, out=targets, algorithm=self.algorithm)
        for variable, reads in zip(self.variables, self.reads):
            variable._reads = reads


class CentralStorageStrategy(Strategy):
    """Variables on one device, computation replicated on the others
    (``tf.distribute.experimental.CentralStorageStrategy``).

    ``compute_devices``: the replicas' devices (a list, any TF spelling); None: every GPU, else the CPU.
    ``parameter_device``: where every variable lives; None: the CPU, or the compute device when there is one.
    Code written for ``MirroredStrategy`` runs unchanged (``scope``, ``run``, ``reduce``, datasets, optimizers);
    variables are not mirrored: each is kept once and updated once.
    """

    def __init__(self, compute_devices=None, parameter_device=None):
        super().__init__(CentralStorageExtended(self, compute_devices, parameter_device))
