"""``md.distribute.experimental.CentralStorageStrategy``: TensorFlow's one-machine strategy that keeps every
variable once, on a parameter device, and replicates the computation on the compute devices
(``tf.distribute.experimental.CentralStorageStrategy``).

The replicas are MirroredStrategy's machinery over the compute devices: the same replica context, reductions,
input pipeline, GPU streams. What differs is TF's: a variable created in its scope has one copy, on the
parameter device (an :class:`AggregatingVariable` when there are several replicas, else a plain variable); a
replica reads the current value on its own device; an update inside ``run`` goes through the variable's
aggregation (a ``merge_call``) and is applied once. Values bound for the parameter device (an optimizer's
gradients) are all-reduced over the replicas in one fused call, as MirroredStrategy's step does, and the first
replica's result is taken there, so a step gives MirroredStrategy's weights bit for bit.
"""

from __future__ import annotations

from ..device import config, device_util
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
                         "GPU(s) (md.config.list_logical_devices('GPU')); use '/cpu:0' instead")
    return device


class AggregatingVariable(AssignsThroughUpdate, DeviceVariable):
    """A variable of a CentralStorageStrategy with several replicas (TF's ``ps_values.AggregatingVariable``): one
    copy, on the parameter device.

    Inside ``run`` a replica reads the current value on its own device (a CPU replica the array itself, a GPU
    replica a copy on its GPU). ``assign`` / ``assign_add`` / ``assign_sub`` inside ``run`` combine the
    replicas' values with the variable's ``aggregation`` (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``; ``NONE``
    refuses) and update it once; in cross-replica context they update it directly.
    """

    def __init__(self, strategy, value, name, device, trainable, synchronization, aggregation):
        super().__init__(value, name, device, trainable, synchronization, aggregation)
        self._strategy = strategy
        # Per replica: the device a read is copied to, or None where the replica reads the value itself (a CPU
        # replica of a variable in host memory)
        on_host = device_util.parse(device).device_type == "CPU"
        self._copy_to = tuple(None if on_host and device_util.parse(d).device_type == "CPU" else d
                              for d in strategy.extended.worker_devices)

    def _for_replica(self, x, copy: bool):
        """``x`` (read on the parameter device) as the running replica reads it: on its own device."""
        rid = running_replica_id(self._strategy)
        device = None if rid is None else self._copy_to[rid]
        return x if device is None else device_util.place(x, device, copy=copy)

    def read_value(self):
        return self._for_replica(self._value, copy=True)

    def sparse_read(self, indices, name=None):
        return self._for_replica(super().sparse_read(indices), copy=False)

    def gather_nd(self, indices, name=None):
        return self._for_replica(super().gather_nd(indices), copy=False)

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

    # TF's: a step of distribute_datasets_from_function that some replica has no batch for ends the input
    experimental_enable_get_next_as_optional = False

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
        """Why md.function cannot capture this strategy's step as CUDA graphs (None: it can): the variables'
        update and the replicas' reads must all run on the parameter device's GPU."""
        if device_util.parse(self._parameter_device).device_type != "GPU":
            return (f"its variables live on {self._parameter_device}, not on a GPU (their update runs on the "
                    "host); pass parameter_device='/gpu:0'")
        ordinal = device_util.physical_ordinal(self._parameter_device)
        if any(device_util.physical_ordinal(d) != ordinal for d in self._local_devices):
            return (f"its replicas read the variables on {self._parameter_device} from another GPU, a copy between "
                    "GPUs that a captured step cannot order")
        return None

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
        # Values bound for the parameter device (its variables: an optimizer's gradients) are all-reduced over
        # the replicas in one fused call, the sum MirroredStrategy's step takes, and the first replica's
        # result is moved there: one collective, not one reduce per value.
        strategy, devices = self._container_strategy, self._local_devices
        if pairs and all(type(d) is AggregatingVariable and d._strategy is strategy and d is not v
                         and isinstance(v, DistributedValues) and v._devices == devices for v, d in pairs):
            reduced = super()._batch_reduce_to(op, [(v, v) for v, _ in pairs], options)
            with device_util.cross_replica_gpu_scope(self._parameter_device):
                return [device_util.place(self._local_results(r)[0], self._parameter_device) for r in reduced]
        return super()._batch_reduce_to(op, pairs, options)


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
