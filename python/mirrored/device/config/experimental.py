"""``md.config.experimental``: TensorFlow's ``tf.config.experimental`` for GPUs, answered from the CUDA runtime and
CuPy's memory pool.

Memory growth: CuPy's pool always takes GPU memory as arrays need it (it never maps the whole GPU up front, as TF
does without growth), so ``set_memory_growth(gpu, True)`` is what happens anyway, and ``False`` (TF's default) does
not pre-allocate here; the flag is kept, checked as TF checks it, and reported by :func:`get_memory_growth`. Cap a
GPU's memory with ``cupy.get_default_memory_pool().set_limit``.
"""

import contextlib as _contextlib
import logging as _logging

from ._devices import (LogicalDeviceConfiguration as VirtualDeviceConfiguration, PhysicalDevice as _PhysicalDevice,
                       get_logical_device_configuration as get_virtual_device_configuration, get_visible_devices,
                       list_logical_devices, list_physical_devices, physical_gpu_index as _physical_gpu_index,
                       physical_key as _physical_key,
                       set_logical_device_configuration as set_virtual_device_configuration, set_visible_devices)

__all__ = ["VirtualDeviceConfiguration", "get_device_details", "get_memory_growth", "get_memory_info",
           "get_memory_usage", "get_virtual_device_configuration", "get_visible_devices", "list_logical_devices",
           "list_physical_devices", "reset_memory_stats", "set_memory_growth", "set_virtual_device_configuration",
           "set_visible_devices"]

# physical GPU index -> memory growth, as set; absent: TF's default, off
_memory_growth: dict[int, bool] = {}


def _recognized(device) -> tuple[str, int]:
    """(type, index) of ``device``, a PhysicalDevice of this machine; TF's ValueError for anything else."""
    if not isinstance(device, _PhysicalDevice) or device not in list_physical_devices():
        raise ValueError(f"Unrecognized device: {device!r}; pass a device from "
                         "md.config.list_physical_devices('GPU')")
    return _physical_key(device)


def set_memory_growth(device, enable) -> None:
    """Memory growth for physical GPU ``device`` (see the module's note: CuPy's pool grows on demand either way)."""
    kind, index = _recognized(device)
    if get_virtual_device_configuration(device):
        raise ValueError("Cannot set memory growth on device when virtual devices configured")
    if kind != "GPU":
        raise ValueError("Cannot set memory growth on non-GPU and non-Pluggable devices")
    _memory_growth[index] = bool(enable)


def get_memory_growth(device) -> bool:
    """Whether memory growth was set on physical GPU ``device`` (False unless set, as TF's default)."""
    kind, index = _recognized(device)
    if kind != "GPU":
        raise KeyError(f"{device!r}: memory growth is a GPU setting (list_physical_devices('GPU'))")
    return _memory_growth.get(index, False)


def get_device_details(device) -> dict:
    """TF's details of a physical device: ``{}`` for the CPU; for a GPU its ``compute_capability`` (major, minor)
    and ``device_name``, as the CUDA runtime reports them."""
    if not isinstance(device, _PhysicalDevice):
        raise ValueError(f"device must be an md.config.PhysicalDevice (from md.config.list_physical_devices()), "
                         f"but got: {device}")
    if device not in list_physical_devices():
        raise ValueError("The PhysicalDevice must be one obtained from calling `md.config.list_physical_devices`, "
                         f"but got: {device}")
    kind, index = _physical_key(device)
    if kind != "GPU":
        return {}
    from ..engine import extension

    properties = extension().device_properties(index)
    return {"compute_capability": tuple(properties["compute_capability"]), "device_name": properties["name"]}


def _gpu_of(device) -> int | None:
    """The CUDA ordinal of logical device string ``device`` ('GPU:0', '/device:GPU:0', '/gpu:0', with or without
    '/job:localhost/replica:0/task:0'); None for a CPU; TF's ValueError for a device this machine lacks."""
    if not isinstance(device, str):
        raise TypeError(f"device={device!r}: expected a device string such as 'GPU:0' or '/device:CPU:0'")
    parts = [p for p in device.split("/") if p and not p.startswith(("job:", "replica:", "task:"))]
    fields = parts[0].split(":") if len(parts) == 1 else []
    if fields[:1] == ["device"]:
        fields = fields[1:]
    kind = fields[0].upper() if len(fields) == 2 and fields[1].isdigit() else None
    if kind not in ("CPU", "GPU") or int(fields[1]) >= len(list_logical_devices(kind)):
        raise ValueError(f"No matching devices found for '{device}'")
    return _physical_gpu_index(int(fields[1])) if kind == "GPU" else None


@_contextlib.contextmanager
def _default_pool_of(ordinal: int):
    """CuPy's default memory pool, with GPU ``ordinal`` current (the pool answers for the current device)."""
    from ..gpu import cupy_module

    cupy = cupy_module()
    with cupy.cuda.Device(ordinal):
        yield cupy.get_default_memory_pool()


def get_memory_info(device: str) -> dict:
    """``{'current': bytes, 'peak': bytes}`` of logical device ``device``'s memory.

    A GPU answers from CuPy's default memory pool on its physical GPU (logical GPUs that share one share its
    answer): ``current``, the bytes of live arrays; ``peak``, the bytes the pool holds, which its cache keeps at the
    most that was in use since :func:`reset_memory_stats`. The CPU answers zeros, as TF's does (host memory is
    NumPy's, not counted)."""
    ordinal = _gpu_of(device)
    if ordinal is None:
        return {"current": 0, "peak": 0}
    with _default_pool_of(ordinal) as pool:
        current = int(pool.used_bytes())
        return {"current": current, "peak": max(current, int(pool.total_bytes()))}


def reset_memory_stats(device: str) -> None:
    """Start ``device``'s peak again from its current use: a GPU's pool gives its cached free blocks back to the
    device (the peak is the memory the pool holds)."""
    ordinal = _gpu_of(device)
    if ordinal is not None:
        with _default_pool_of(ordinal) as pool:
            pool.free_all_blocks()


def get_memory_usage(device: str) -> int:
    """Deprecated in TF: ``get_memory_info(device)['current']``, which it returns."""
    # (logged, as TF logs its deprecations: a warning would fail the TF code that runs under -W error)
    _logging.getLogger("mirrored").warning("md.config.experimental.get_memory_usage is deprecated, as in TF: use "
                                           "md.config.experimental.get_memory_info(device)['current'] instead")
    return get_memory_info(device)["current"]
