"""Host NumPy views of DLPack tensors, bfloat16 included.

``np.from_dlpack`` covers NumPy's own dtypes; a bfloat16 tensor (DLPack
type code kDLBfloat) is read here from the producer's capsule and viewed as
``ml_dtypes.bfloat16``. Either way the view shares the producer's memory, so
writing it writes the tensor in place.
"""

from __future__ import annotations

import ctypes

import numpy as np

_K_DL_BFLOAT = 4
_HOST_DEVICES = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):  # the unversioned capsule, "dltensor"
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def host_view(x, argument: str) -> np.ndarray:
    """A NumPy array sharing the memory of DLPack tensor ``x`` (host memory only)."""
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        error = e
    view = _bfloat16_view(x, argument)
    if view is None:
        raise TypeError(f"{argument}: cannot read this DLPack tensor on the host ({error})") from None
    return view


def _bfloat16_view(x, argument: str):
    """``x`` viewed as ml_dtypes.bfloat16 if it is a bfloat16 tensor in host memory, else None."""
    try:
        capsule = x.__dlpack__()  # no max_version: the unversioned capsule every producer offers
    except Exception:  # the producer refuses to export (np.from_dlpack's error says why)
        return None
    t = _DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor")).dl_tensor
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (_K_DL_BFLOAT, 16, 1) or \
            t.device.device_type not in _HOST_DEVICES:
        return None
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"{argument} is a bfloat16 tensor; reading it needs the ml_dtypes package "
                        "(pip install ml_dtypes)") from None
    itemsize = 2
    shape = tuple(t.shape[k] for k in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[k] * itemsize for k in range(t.ndim))
    else:  # NULL strides: C-contiguous
        strides = tuple(int(np.prod(shape[k + 1:], dtype=np.int64)) * itemsize for k in range(t.ndim))
    if 0 in shape:
        return np.empty(shape, ml_dtypes.bfloat16)
    # The bytes the view spans, from its lowest to its highest element.
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + itemsize
    memory = (ctypes.c_char * (high - low)).from_address((t.data or 0) + t.byte_offset + low)
    memory._capsule = capsule  # the producer frees the tensor when its capsule goes, after the view
    return np.ndarray(shape, ml_dtypes.bfloat16, buffer=memory, offset=-low, strides=strides)
