"""Physical, visible and logical devices, named and answered as TensorFlow's ``tf.config`` names them.

GPUs are what the CUDA extension's runtime sees (0 without the extension, a driver or a GPU: this module never
fails to import). :func:`set_visible_devices` hides physical devices: a hidden GPU has no logical device, so
strategies neither pick it by default nor accept it by name. A visible physical device may be split into several
*logical* devices, TensorFlow's way of running several replicas on one GPU (or CPU). Logical devices are numbered
across the visible physical devices in order; :func:`physical_gpu_index` maps a logical GPU index to its CUDA ordinal.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import extension, name as engine_name

DEVICE_TYPES = ("CPU", "GPU")


@dataclass(frozen=True)
class PhysicalDevice:
    name: str
    device_type: str


@dataclass(frozen=True)
class LogicalDevice:
    name: str
    device_type: str


@dataclass(frozen=True)
class LogicalDeviceConfiguration:
    memory_limit: int | None = None
    experimental_priority: int | None = None
    experimental_device_ordinal: int | None = None


# (device type, physical index) -> its logical devices; absent: one.
_logical: dict[tuple[str, int], list[LogicalDeviceConfiguration]] = {}
# The physical devices hidden by set_visible_devices, as (device type, index); absent: visible.
_hidden: set[tuple[str, int]] = set()
# (device type, CUDA engine) -> its logical-to-physical table: placing a value on a GPU resolves its ordinal per
# replica and call. The GPUs a process sees do not change (CUDA reads CUDA_VISIBLE_DEVICES once), so a table changes
# only with the configuration or the visible devices (both clear it), or the engine (the tests').
_tables: dict = {}


def num_gpus() -> int:
    """Physical GPUs the CUDA extension can see; 0 without the extension, a driver or a GPU."""
    try:
        return int(extension().device_count())
    except Exception:  # no extension (ImportError), or a bad $MIRRORED_CUDA_ENGINE
        return 0


def _num_physical(kind: str) -> int:
    return 1 if kind == "CPU" else num_gpus()


def _kinds(device_type) -> tuple[str, ...]:
    """The device types ``device_type`` selects. As TF's: None is every type, and a type this package has no device
    of ('TPU', or a lower-case 'gpu') selects none."""
    if device_type is None:
        return DEVICE_TYPES
    if not isinstance(device_type, str):
        raise TypeError(f"device_type={device_type!r}: expected a device type string such as 'GPU' or 'CPU', or None")
    return (device_type,) if device_type in DEVICE_TYPES else ()


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The machine's physical devices of ``device_type`` (None: all), hidden ones included."""
    return [PhysicalDevice(f"/physical_device:{kind}:{i}", kind)
            for kind in _kinds(device_type) for i in range(_num_physical(kind))]


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """The logical devices of ``device_type`` (None: all): each visible physical device's, in order."""
    return [LogicalDevice(f"/device:{kind}:{i}", kind)
            for kind in _kinds(device_type) for i in range(len(_logical_to_physical(kind)))]


def get_visible_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The physical devices of ``device_type`` (None: all) that :func:`set_visible_devices` has not hidden."""
    return [d for d in list_physical_devices(device_type) if _index(d) not in _hidden]


def set_visible_devices(devices, device_type: str | None = None) -> None:
    """Make ``devices`` (PhysicalDevices from :func:`list_physical_devices`, or one) the visible devices of
    ``device_type``, hiding that type's others; ``device_type=None``: the visible devices of every type.

    ``set_visible_devices([], 'GPU')`` hides every GPU: strategies then run on the CPU. Unlike TensorFlow, the
    devices may change at any time; a change applies to the strategies created afterwards. The CPU cannot be
    hidden (TF refuses to start without it)."""
    if isinstance(devices, PhysicalDevice):
        devices = [devices]
    if not isinstance(devices, (list, tuple)):
        raise ValueError(f"Unrecognized device: {devices!r}; pass PhysicalDevices from "
                         "md.config.list_physical_devices(), e.g. set_visible_devices([], 'GPU') to hide the GPUs")
    physical = list_physical_devices()
    for d in devices:
        if d not in physical or (device_type is not None and d.device_type != device_type):
            hint = ("" if isinstance(d, PhysicalDevice) and d in physical else
                    "; pass PhysicalDevices from md.config.list_physical_devices()")
            raise ValueError(f"Unrecognized device: {d!r}" + (
                f" (not of device_type={device_type!r})" if not hint else hint))
    kinds = DEVICE_TYPES if device_type is None else _kinds(device_type)
    hidden = {key for key in _hidden if key[0] not in kinds}
    hidden |= {_index(d) for d in physical if d.device_type in kinds and d not in devices}
    if any(kind == "CPU" for kind, _ in hidden):
        raise ValueError(f"set_visible_devices({devices!r}, device_type={device_type!r}) would hide the CPU, which "
                         "mirrored (like TensorFlow) needs; keep list_physical_devices('CPU') in the visible devices")
    _hidden.clear()
    _hidden.update(hidden)
    _tables.clear()


def set_logical_device_configuration(device, logical_devices=None, *, count: int | None = None) -> None:
    """Split physical ``device`` into logical devices (one per configuration).

    ``device`` is a :class:`PhysicalDevice` (from :func:`list_physical_devices`)
    or a string: ``"GPU:0"``, ``"/physical_device:GPU:0"``, or ``"GPU"`` with
    the index as the second argument. ``count=n`` stands for ``n`` default
    configurations. ``None`` (or ``[]``) restores a single logical device.
    """
    kind, index = physical_key(device, logical_devices if isinstance(logical_devices, int) else None)
    if isinstance(logical_devices, int) and not isinstance(logical_devices, bool):
        logical_devices = None
    if count is not None:
        if logical_devices is not None:
            raise ValueError("pass either logical_devices or count, not both")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r} must be a positive integer (logical devices on {kind}:{index})")
        logical_devices = [LogicalDeviceConfiguration()] * count
    _tables.clear()
    if not logical_devices:
        _logical.pop((kind, index), None)
        return
    configs = list(logical_devices)
    for i, c in enumerate(configs):
        if not isinstance(c, LogicalDeviceConfiguration):
            raise TypeError(f"logical_devices[{i}] is {type(c).__name__}; use md.config.LogicalDeviceConfiguration()")
    _logical[(kind, index)] = configs


def get_logical_device_configuration(device) -> list[LogicalDeviceConfiguration] | None:
    """The configurations set for ``device``, or None when it is a single logical device."""
    configs = _logical.get(physical_key(device))
    return list(configs) if configs else None


def physical_gpu_index(logical_index: int) -> int:
    """CUDA ordinal of logical GPU ``logical_index``."""
    table = _logical_to_physical("GPU")
    if isinstance(logical_index, bool) or not isinstance(logical_index, int) or not 0 <= logical_index < len(table):
        raise ValueError(
            f"GPU:{logical_index} is not a logical GPU of this machine ({len(table)} visible: "
            f"{num_gpus()} physical{hidden_note('GPU')}, split by set_logical_device_configuration); "
            "check the device string, CUDA_VISIBLE_DEVICES and the GPU driver"
        )
    return table[logical_index]


def hidden_note(kind: str) -> str:
    """``'; N hidden by md.config.set_visible_devices'`` when some physical devices of ``kind`` are hidden, else ''."""
    n = sum(1 for k, _ in _hidden if k == kind)
    return f"; {n} hidden by md.config.set_visible_devices" if n else ""


def _logical_to_physical(kind: str) -> tuple[int, ...]:
    key = (kind, engine_name() if kind == "GPU" else None)
    table = _tables.get(key)
    if table is None:
        table = []
        for i in range(_num_physical(kind)):
            if (kind, i) not in _hidden:
                table += [i] * len(_logical.get((kind, i)) or [None])
        _tables[key] = table = tuple(table)
    return table


def _index(device: PhysicalDevice) -> tuple[str, int]:
    return device.device_type, int(device.name.rsplit(":", 1)[1])


def physical_key(device, index: int | None = None) -> tuple[str, int]:
    """(type, index) of a physical device given as PhysicalDevice or string."""
    if isinstance(device, PhysicalDevice):
        name = device.name
    elif isinstance(device, str):
        name = device
    else:
        raise TypeError(f"device={device!r}: expected a PhysicalDevice from list_physical_devices() or 'GPU:0'")
    parts = name.strip("/").split(":")
    if parts[0].lower() in ("physical_device", "device"):
        parts = parts[1:]
    if index is not None and len(parts) == 1:
        parts.append(str(index))
    kind = parts[0].upper()
    if kind not in DEVICE_TYPES or len(parts) != 2 or not parts[1].isdigit():
        raise ValueError(f"device={device!r}: expected a physical device such as 'GPU:0', ('GPU', 0) "
                         "or list_physical_devices('GPU')[0]")
    i = int(parts[1])
    n = _num_physical(kind)
    if not 0 <= i < n:
        raise ValueError(f"device={device!r}: physical {kind}:{i} does not exist ({n} visible"
                         + ("; no GPU driver, GPU or CUDA extension found" if kind == "GPU" and n == 0 else "") + ")")
    return kind, i
