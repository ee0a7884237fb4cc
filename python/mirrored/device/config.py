"""Physical and logical devices, named as TensorFlow's ``tf.config`` names them.

GPUs are what the CUDA extension's runtime sees (0 without the extension, a
driver or a GPU: this module never fails to import). A physical device may be
split into several *logical* devices, TensorFlow's way of running several
replicas on one GPU (or CPU)::

    gpu, = md.config.list_physical_devices("GPU")
    md.config.set_logical_device_configuration(
        gpu, [md.config.LogicalDeviceConfiguration()] * 2)
    # shorthand: md.config.set_logical_device_configuration("GPU", 0, count=2)
    md.config.list_logical_devices("GPU")   # GPU:0 and GPU:1, both on physical GPU 0

Logical devices are numbered across physical devices in order;
:func:`physical_gpu_index` maps a logical GPU index to its CUDA ordinal.
Unlike TensorFlow, a configuration may be changed at any time; it applies to
strategies created afterwards. ``memory_limit`` is recorded, not enforced
(cap CuPy with ``cupy.get_default_memory_pool().set_limit``).
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass

from .engine import extension, name as engine_name


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


VirtualDeviceConfiguration = LogicalDeviceConfiguration  # TF 1.x / 2.0 name

# (device type, physical index) -> its logical devices; absent: one.
_logical: dict[tuple[str, int], list[LogicalDeviceConfiguration]] = {}
# (device type, CUDA engine, configuration) -> its logical-to-physical table: placing a value on a GPU
# resolves its ordinal per replica and call. The GPUs a process sees do not change (CUDA reads
# CUDA_VISIBLE_DEVICES once), so a table changes only with the configuration, or the engine (the tests').
_tables: dict = {}


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _num_gpus() -> int:
    """GPUs the CUDA extension can see; 0 without the extension, a driver or a GPU."""
    try:
        return int(extension().device_count())
    except Exception:  # no extension (ImportError), or a bad $MIRRORED_CUDA_ENGINE
        return 0


def _num_physical(kind: str) -> int:
    return 1 if kind == "CPU" else _num_gpus()


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    return [PhysicalDevice(f"/physical_device:{kind}:{i}", kind)
            for kind in _kinds(device_type) for i in range(_num_physical(kind))]


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    return [LogicalDevice(f"/job:localhost/replica:0/task:0/device:{kind}:{i}", kind)
            for kind in _kinds(device_type) for i in range(len(_logical_to_physical(kind)))]


def set_logical_device_configuration(device, logical_devices=None, *, count: int | None = None) -> None:
    """Split physical ``device`` into logical devices (one per configuration).

    ``device`` is a :class:`PhysicalDevice` (from :func:`list_physical_devices`)
    or a string: ``"GPU:0"``, ``"/physical_device:GPU:0"``, or ``"GPU"`` with
    the index as the second argument. ``count=n`` stands for ``n`` default
    configurations. ``None`` (or ``[]``) restores a single logical device.
    """
    kind, index = _physical(device, logical_devices if isinstance(logical_devices, int) else None)
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
    configs = _logical.get(_physical(device))
    return list(configs) if configs else None


def physical_gpu_index(logical_index: int) -> int:
    """CUDA ordinal of logical GPU ``logical_index``."""
    table = _logical_to_physical("GPU")
    if isinstance(logical_index, bool) or not isinstance(logical_index, int) or not 0 <= logical_index < len(table):
        raise ValueError(
            f"GPU:{logical_index} is not a logical GPU of this machine ({len(table)} visible: "
            f"{_num_gpus()} physical, split by set_logical_device_configuration); "
            "check the device string, CUDA_VISIBLE_DEVICES and the GPU driver"
        )
    return table[logical_index]


def _logical_to_physical(kind: str) -> tuple[int, ...]:
    key = (kind, engine_name() if kind == "GPU" else None)
    table = _tables.get(key)
    if table is None:
        table = []
        for i in range(_num_physical(kind)):
            table += [i] * len(_logical.get((kind, i)) or [None])
        _tables[key] = table = tuple(table)
    return table


def _physical(device, index: int | None = None) -> tuple[str, int]:
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
    if kind not in ("CPU", "GPU") or len(parts) != 2 or not parts[1].isdigit():
        raise ValueError(f"device={device!r}: expected a physical device such as 'GPU:0', ('GPU', 0) "
                         "or list_physical_devices('GPU')[0]")
    i = int(parts[1])
    n = _num_physical(kind)
    if not 0 <= i < n:
        raise ValueError(f"device={device!r}: physical {kind}:{i} does not exist ({n} visible"
                         + ("; no GPU driver, GPU or CUDA extension found" if kind == "GPU" and n == 0 else "") + ")")
    return kind, i


def _kinds(device_type: str | None) -> tuple[str, ...]:
    if device_type is None:
        return ("CPU", "GPU")
    kind = str(device_type).upper()
    if kind not in ("CPU", "GPU"):
        raise ValueError(f"device_type={device_type!r}: expected 'CPU', 'GPU' or None")
    return (kind,)


# --- what this installation can do ---------------------------------------------

GLOO_NOT_BUILT = (
    "multi-worker collectives need mirrored's _net extension, which this build of mirrored lacks: it was built "
    "without Gloo. Install the wheel that `make wheel` builds (it bundles Gloo), or install Gloo "
    "(`apt-get install libgloo-dev` on Debian/Ubuntu) and rebuild mirrored from source (`pip install .`)"
)


def net_module():
    """The ``mirrored._net`` extension (Gloo over TCP), or a RuntimeError saying what is missing.

    Two different failures: the extension was never built (no Gloo at build
    time), or it was built but a shared library it needs cannot be loaded now;
    the second names that library.
    """
    try:
        # By its full name, as engine.extension() loads the CUDA one: an extension runs no Python of ours,
        # and ``from .. import _net`` would go through mirrored's __init__, which imports this module.
        _net = importlib.import_module("mirrored._net")
    except ModuleNotFoundError as e:
        if e.name != "mirrored._net":
            raise
        raise RuntimeError(GLOO_NOT_BUILT) from e
    except ImportError as e:
        raise RuntimeError(net_load_error(str(e))) from e
    return _net


def net_load_error(message: str) -> str:
    """The error for an ``_net`` extension that exists but does not load (``message``: the ImportError's)."""
    match = re.match(r"^(\S+): cannot open shared object file", message)
    if match:
        lib = match.group(1)
        hint = " (Debian/Ubuntu: `apt-get install libgloo0`)" if lib.startswith("libgloo") else ""
        return (f"mirrored's multi-worker extension _net needs the shared library {lib}, which the dynamic loader "
                f"cannot find (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r}): install it{hint} or add "
                f"its directory to LD_LIBRARY_PATH; the wheel that `make wheel` builds carries its own copy")
    return f"mirrored's multi-worker extension _net failed to load: {message}"


def is_gloo_available() -> bool:
    """True when multi-worker collectives over TCP (Gloo) work in this installation."""
    try:
        net_module()
    except RuntimeError:
        return False
    return True


def is_nccl_available() -> bool:
    """True when the CUDA extension is built and libnccl loads (nvidia-nccl-cu13 or the system's)."""
    from .gpu import nccl_available

    return nccl_available()


def is_cuda_available() -> bool:
    """True when the CUDA extension is built and sees at least one GPU (driver and device present)."""
    return _num_gpus() > 0
