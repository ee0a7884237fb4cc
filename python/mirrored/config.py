"""Physical and logical devices, named as TensorFlow's ``tf.config`` names them."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PhysicalDevice:
    name: str
    device_type: str


@dataclass(frozen=True)
class LogicalDevice:
    name: str
    device_type: str


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _num_gpus() -> int:
    """GPUs the CUDA extension can see; 0 without the extension, a driver or a GPU."""
    try:
        from . import _cuda  # type: ignore[attr-defined]
    except ImportError:
        return 0
    try:
        return int(_cuda.device_count())
    except Exception:
        return 0


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    kinds = _kinds(device_type)
    out = []
    if "CPU" in kinds:
        out.append(PhysicalDevice("/physical_device:CPU:0", "CPU"))
    if "GPU" in kinds:
        out += [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(_num_gpus())]
    return out


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    kinds = _kinds(device_type)
    out = []
    if "CPU" in kinds:
        out.append(LogicalDevice("/job:localhost/replica:0/task:0/device:CPU:0", "CPU"))
    if "GPU" in kinds:
        out += [LogicalDevice(f"/job:localhost/replica:0/task:0/device:GPU:{i}", "GPU") for i in range(_num_gpus())]
    return out


def _kinds(device_type: str | None) -> tuple[str, ...]:
    if device_type is None:
        return ("CPU", "GPU")
    kind = str(device_type).upper()
    if kind not in ("CPU", "GPU"):
        raise ValueError(f"device_type={device_type!r}: expected 'CPU', 'GPU' or None")
    return (kind,)
