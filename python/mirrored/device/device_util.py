"""Device strings in every TensorFlow spelling, and placing an array on a device.

A device is written ``/job:<job>/replica:<r>/task:<t>/device:<TYPE>:<index>``;
any part may be left out and any case is accepted (``"GPU:1"``, ``"/gpu:1"``,
``"/device:CPU:0"``). Missing parts take the local defaults (``localhost``,
replica 0, task 0, index 0).

:func:`place` is the only place where an array is put on a device: NumPy for
CPU devices, CuPy (on the device's GPU) for GPU devices.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from typing import NamedTuple

import numpy as np

from .config import physical_gpu_index as _physical_gpu_index
from .gpu import CUPY_FIX, merge_stream, step_memory
from .python_values import from_python


class DeviceSpec(NamedTuple):
    job: str
    replica: int
    task: int
    device_type: str
    device_index: int

    def to_string(self) -> str:
        return (f"/job:{self.job}/replica:{self.replica}/task:{self.task}"
                f"/device:{self.device_type}:{self.device_index}")


_PART = re.compile(r"^(?:(job):([A-Za-z0-9_\-]+)|(replica|task):(\d+)|(?:device:)?(cpu|gpu)(?::(\d+|\*)?)?)$",
                   re.IGNORECASE)


def parse(device, argument: str = "device") -> DeviceSpec:
    """The parts of a device string; raises ValueError naming ``argument`` when malformed."""
    if hasattr(device, "name") and not isinstance(device, str):  # a config.LogicalDevice
        device = device.name
    if isinstance(device, str):
        return _parse(device, argument)  # cached: hot paths place arrays on the same few devices
    return _parse.__wrapped__(device, argument)


@functools.lru_cache(maxsize=4096)
def _parse(device, argument: str) -> DeviceSpec:
    if not isinstance(device, str) or not device.strip("/"):
        raise ValueError(
            f"{argument}={device!r} is not a device string; write e.g. '/cpu:0', 'GPU:1' or "
            "'/job:localhost/replica:0/task:0/device:CPU:0'"
        )
    fields = {"job": "localhost", "replica": 0, "task": 0, "device_type": None, "device_index": 0}
    for part in device.strip("/").split("/"):
        m = _PART.match(part)
        if m is None:
            raise ValueError(
                f"{argument}={device!r}: cannot parse {part!r}; expected parts like 'job:worker', "
                "'replica:0', 'task:1', 'device:GPU:0', 'cpu:0' (any case)"
            )
        if m.group(1):
            fields["job"] = m.group(2)
        elif m.group(3):
            fields[m.group(3).lower()] = int(m.group(4))
        else:
            if fields["device_type"] is not None:
                raise ValueError(f"{argument}={device!r}: Multiple device types are not allowed; name one device, "
                                 "e.g. '/cpu:0'")
            fields["device_type"] = m.group(5).upper()
            fields["device_index"] = int(m.group(6)) if m.group(6) not in (None, "*") else 0
    if fields["device_type"] is None:
        raise ValueError(f"{argument}={device!r} names no device type; add e.g. '/device:CPU:0'")
    return DeviceSpec(**fields)


def canonicalize(device, default=None, argument: str = "device") -> str:
    """The full form ``/job:localhost/replica:0/task:0/device:CPU:0`` of ``device``.

    Parts missing from ``device`` come from ``default`` when it is given
    (TensorFlow's rule for a device inside another device's scope).
    """
    spec = parse(device, argument)
    if default is not None:
        base = parse(default, "default")
        given = str(device).lower()
        spec = spec._replace(
            job=spec.job if "job:" in given else base.job,
            replica=spec.replica if "replica:" in given else base.replica,
            task=spec.task if "task:" in given else base.task,
        )
    return spec.to_string()


resolve = canonicalize


def is_gpu(device) -> bool:
    return parse(device).device_type == "GPU"


@functools.lru_cache(maxsize=256)
@functools.lru_cache(maxsize=1024)
def all_cpu(devices: tuple) -> bool:
    """Whether every device of ``devices`` (a tuple of strings) is a CPU device."""
    return all(parse(d).device_type == "CPU" for d in devices)


# The device of the replica running on this thread (``None`` outside replicas).
_current = threading.local()


def current():
    """The canonical device of the replica running on this thread, or None."""
    return getattr(_current, "device", None)


def set_current(device) -> None:
    """Makes ``device`` (canonical, or None) this thread's current one: a replica resumed on a
    thread that ran other replicas meanwhile gets its own back."""
    _current.device = device


class device_scope:
    """Make ``device`` this thread's current device for the ``with`` block."""

    def __init__(self, device):
        self._device = device

    def __enter__(self):
        self._saved = getattr(_current, "device", None)  # (current(), inlined: entered by every replica of every step)
        _current.device = self._device

    def __exit__(self, *exc):
        _current.device = self._saved


@contextlib.contextmanager
def cross_replica_gpu_scope(device):
    """For cross-replica work on GPU ``device``'s data: that GPU current (CuPy computes, and
    allocates, on its current device), and its legacy default stream, which is ordered after
    every replica stream's queued work and before their later work. On a replica stream the
    next merge's reads (another replica's stream) would race with this merge's frees.
    A null context for other devices."""
    spec = parse(device)
    if spec.device_type != "GPU":
        yield
        return
    cupy = _cupy_for(spec)

    ordinal = _gpu_ordinal(spec)
    with cupy.cuda.Device(ordinal), merge_stream(ordinal), step_memory():
        yield


def _gpu_ordinal(spec: DeviceSpec) -> int:
    """CUDA ordinal of a (logical) GPU device; config maps logical GPUs onto physical ones."""
    return _physical_gpu_index(spec.device_index)


def physical_ordinal(device) -> int:
    """CUDA ordinal of a GPU device string (logical GPUs share a physical one)."""
    spec = parse(device)
    if spec.device_type != "GPU":
        raise ValueError(f"device={device!r} is not a GPU device")
    return _gpu_ordinal(spec)


def all_gpu(devices: tuple) -> bool:
    """Whether every device of ``devices`` (a tuple of strings) is a GPU device."""
    return all(parse(d).device_type == "GPU" for d in devices)


def on_gpu(x) -> bool:
    return hasattr(x, "__cuda_array_interface__")


def array_device(x):
    """A context making x's GPU current for CuPy arrays (CuPy computes, and allocates, on the
    current device, not the operands'), else a null context."""
    device = getattr(x, "device", None) if on_gpu(x) else None
    return device if hasattr(device, "__enter__") else contextlib.nullcontext()


def to_host(x):
    """A NumPy view or copy of any accepted array-like (see :func:`place`).

    Python numbers, strings and (nested) lists convert as ``tf.convert_to_tensor``
    converts them (device/python_values.py): floats to float32, ints to int32 (int64
    when they do not fit), TF's errors for mixed and ragged lists.
    """
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(x)
    if hasattr(x, "__array_interface__"):
        return np.asarray(x)
    if hasattr(x, "__dlpack__"):  # before __array__: torch's bfloat16 has no NumPy conversion, but DLPack carries it
        from .dlpack import host_view

        return host_view(x, "value")  # zero-copy for CPU DLPack producers
    if hasattr(x, "__array__"):
        return np.asarray(x)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return np.asarray(memoryview(x))
    return _python_to_array(x)


def _python_to_array(x) -> np.ndarray:
    if isinstance(x, (bool, int, float, complex, str, list, tuple)):
        return from_python(x)
    raise TypeError(f"value of type {type(x).__name__} cannot be converted to an array; pass a NumPy/CuPy "
                    "array, a Python number or anything with __array_interface__, __cuda_array_interface__, "
                    "__dlpack__ or the buffer protocol")


def written_event(cupy, x):
    """An event recorded on the current stream of GPU array ``x``'s device: a copy on another
    stream waits for it to read x only after the work queued there (which writes x) is done."""
    device = getattr(getattr(x, "data", None), "device_id", None)
    with cupy.cuda.Device(device) if device is not None else contextlib.nullcontext():
        return cupy.cuda.get_current_stream().record()


def _copy_from_other_gpu(cupy, x, ordinal: int):
    """``x`` (a CuPy array on another GPU) copied onto GPU ``ordinal``, ordered both ways with the
    current stream of x's GPU: the copy waits for the work there that writes x, and that stream
    waits for the copy, so x's memory (freed into that stream's pool once x goes) is not handed out
    again before the copy has read it. CuPy orders neither: its copy runs on the destination's stream.

    The copy is a memcpy (CUDA routes it peer to peer, or through the host where the GPUs have no
    peer access), not a kernel on the destination reading x's memory: that would need peer access,
    and CuPy warns when it switches it on. A strided x is made contiguous on its own GPU first."""
    with cupy.cuda.Device(x.data.device_id):
        source = cupy.ascontiguousarray(x)  # (x itself when contiguous)
    written = written_event(cupy, source)
    with cupy.cuda.Device(ordinal):
        stream = cupy.cuda.get_current_stream()
        stream.wait_event(written)
        y = cupy.empty(x.shape, x.dtype)
        if y.nbytes:
            y.data.copy_from_device_async(source.data, y.nbytes, stream)
        read = stream.record()
    with cupy.cuda.Device(x.data.device_id):
        cupy.cuda.get_current_stream().wait_event(read)
    return y


def empty(size: int, dtype, device):
    """An uninitialised 1-D array of ``size`` elements of ``dtype`` on ``device`` (NumPy or CuPy): on a GPU an
    allocation only, no copy. (``place(np.empty(...), gpu)`` would queue an upload of host garbage on the
    current stream, a write that work on another stream, e.g. another replica filling the buffer, is not
    ordered with: it could land over that work's result.)"""
    spec = device if isinstance(device, DeviceSpec) else parse(device)
    if spec.device_type != "GPU":
        return np.empty(size, dtype)
    cupy = _cupy_for(spec)

    with cupy.cuda.Device(_gpu_ordinal(spec)):
        return cupy.empty(size, dtype)


def _cupy_for(spec: DeviceSpec):
    """CuPy, which holds the arrays of GPU device ``spec``; without it a ValueError naming the device (not
    Python's ModuleNotFoundError from deep inside a collective)."""
    try:
        import cupy
    except ImportError:
        raise ValueError(f"device {spec.to_string()!r} is a GPU, but GPU arrays need CuPy, which is not installed "
                         f"({CUPY_FIX}); use a CPU device such as '/cpu:0'") from None
    return cupy


def place(x, device, copy: bool = False):
    """``x`` as an array on ``device``: NumPy for CPU devices, CuPy for GPU devices.

    Accepts anything with ``__array_interface__``, the buffer protocol,
    ``__cuda_array_interface__`` or ``__dlpack__``, and Python scalars/lists.
    ``copy=True`` guarantees a buffer of its own (variables' copies never alias).
    """
    spec = device if isinstance(device, DeviceSpec) else parse(device)
    if spec.device_type == "GPU":
        cupy = _cupy_for(spec)
        ordinal = _gpu_ordinal(spec)
        if type(x) is cupy.ndarray:
            if x.data.device_id != ordinal:
                return _copy_from_other_gpu(cupy, x, ordinal)
            if not copy:
                return x  # (what cupy.asarray returns, without a device switch: the hot path of collectives)
        with cupy.cuda.Device(ordinal):
            if on_gpu(x):
                same_gpu = getattr(getattr(x, "device", None), "id", None) == ordinal
                return cupy.asarray(x) if same_gpu and not copy else cupy.array(x, copy=True)
            return cupy.asarray(to_host(x))
    host = to_host(x)
    return host.copy() if copy else host
