"""``md.OneDeviceStrategy``: TensorFlow's strategy for one device (``tf.distribute.OneDeviceStrategy``).

One replica, so it is MirroredStrategy's machinery with one device: the same
replica context, reductions, input pipeline, GPU streams and md.function
capture. What differs is what TF's OneDeviceStrategy differs in: variables
created in its scope are plain variables on the device (no mirroring, every
``synchronization`` / ``aggregation`` is kept as given and not checked),
``extended.update`` takes them, and values made per replica come back
as plain values.
"""

from __future__ import annotations

from .._nest import map_structure
from ..device import device_util
from .mirrored_strategy import MirroredExtended
from .distribute_lib import Strategy
from .values import DeviceVariable, select_replica

__all__ = ["OneDeviceStrategy"]


def _one_device(device):
    """``device``, checked, for MirroredStrategy's device list (which names it in its own errors as given). TF's
    spellings: ``None`` or ``''`` is the default device (the CPU), and a bare ``'gpu'``/``'cpu'`` is device 0."""
    if device is None or device == "":
        return "/cpu:0"
    if not isinstance(device, str) and not hasattr(device, "name"):
        raise ValueError(f"device={device!r}: expected one device string, e.g. '/gpu:0' or '/cpu:0' (for several "
                         "devices use md.MirroredStrategy)")
    device_util.parse(device, argument="device")
    return device


def update_on(extended, device, var, fn, args, kwargs, group):
    """``extended.update`` where variables have one copy (TF's OneDevice and CentralStorage strategies):
    ``fn(var, ...)`` once, on ``device``, with the first replica's part of distributed arguments."""
    with device_util.device_scope(device), device_util.cross_replica_gpu_scope(device):
        result = fn(var, *select_replica(0, args), **select_replica(0, kwargs))
    return result if group else map_structure(extended._local_results, result)


class OneDeviceExtended(MirroredExtended):
    """``OneDeviceStrategy.extended``: one replica on one device; variables are that device's own."""

    def __init__(self, container_strategy, device):
        super().__init__(container_strategy, [_one_device(device)])

    def _make_variable(self, value, name, trainable, synchronization, aggregation):
        variable = DeviceVariable(value, f"{name}:0", self._local_devices[0], trainable, synchronization,
                                  aggregation)
        variable._strategy = self._container_strategy
        return variable

    def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
        """``fn(*args, **kwargs)`` once, on the device, whatever ``colocate_with`` is (TF's)."""
        return super().update_non_slot(self.worker_devices, fn, args, kwargs, group)

    def _update(self, var, fn, args, kwargs, group):
        # TF's: fn(var, ...) on the device, whatever var is (no check that this strategy made it).
        return update_on(self, self._local_devices[0], var, fn, args, kwargs, group)


class OneDeviceStrategy(Strategy):
    """Runs the computation on one device (``tf.distribute.OneDeviceStrategy``).

    ``device``: a device string in any TensorFlow spelling (``'/gpu:0'``,
    ``'/cpu:0'``, ``'GPU:1'``). Code written for ``MirroredStrategy`` runs
    unchanged: ``scope``, ``run``, ``reduce``, datasets; ``run`` returns
    ``fn``'s value itself and variables are plain ``md.Variable``\\ s on the device.
    """

    def __init__(self, device):
        super().__init__(OneDeviceExtended(self, device))

    def experimental_distribute_values_from_function(self, value_fn):
        """``value_fn(ValueContext())``'s value on the device (one replica: not wrapped, as TF's)."""
        return select_replica(0, super().experimental_distribute_values_from_function(value_fn))
