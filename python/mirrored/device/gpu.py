"""GPU helpers: which CUDA ordinal a (logical) GPU device is, the streams
replicas and collectives run on, where NCCL comes from and when to use it,
and asynchronous host-to-device copies for dataset prefetch.

Importing this module needs neither CuPy nor a driver; the functions that do
raise an error naming the fix.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import threading

import numpy as np

from . import engine

NCCL_FIX = "pip install nvidia-nccl-cu13"
CUPY_FIX = "pip install cupy-cuda13x"


def cuda_module():
    """The CUDA extension (``mirrored._cuda``, or the simulator's when :mod:`.engine` selects it),
    or a RuntimeError naming the fix."""
    try:
        return engine.extension()
    except ImportError as e:
        raise RuntimeError(
            f"GPU collectives need mirrored's CUDA extension, which this build lacks ({e}); reinstall mirrored "
            "on a machine with the CUDA toolkit (nvcc on PATH)"
        ) from None


def cupy_module():
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"GPU replicas hold CuPy arrays; install CuPy: {CUPY_FIX}") from None
    return cupy


# --- streams -----------------------------------------------------------------

_lock = threading.Lock()
_replica_streams: dict = {}
_replica_stream_ptrs: set = set()


def replica_stream(replica_id: int, ordinal: int):
    """Replica ``replica_id``'s own CuPy stream on GPU ``ordinal``, made once.

    Blocking streams (not ``non_blocking``) on purpose: the device's legacy
    default stream orders them with each other, which is what collectives
    use to meet every replica's work (see :func:`collective_stream`).
    """
    key = (int(replica_id), int(ordinal))
    with _lock:
        s = _replica_streams.get(key)
        if s is None:
            cupy = cupy_module()
            with cupy.cuda.Device(ordinal):
                s = cupy.cuda.Stream(non_blocking=False)
            _replica_streams[key] = s
            _replica_stream_ptrs.add(s.ptr)
        return s


@contextlib.contextmanager
def replica_scope(ordinal: int, replica_id: int):
    """Run a replica's code on CUDA device ``ordinal`` and its own stream (made by :func:`replica_stream`)::

        with _gpu.replica_scope(device_util.physical_ordinal("/gpu:1"), 1):
            fn()   # CuPy work lands on replica 1's stream of GPU 1's physical device
    """
    cupy = cupy_module()
    with cupy.cuda.Device(ordinal), replica_stream(replica_id, ordinal):
        yield


def collective_stream(ordinal: int) -> int:
    """Handle of the stream a collective over a buffer on GPU ``ordinal`` is ordered on.

    The calling thread's current CuPy stream, as for any CuPy operation;
    except when that is a replica stream (a merged call from inside a
    replica): then the legacy default stream, which waits for every
    replica's queued work on the device and is waited for by their next work.
    """
    s = cupy_module().cuda.get_current_stream(ordinal)
    return 0 if s.ptr in _replica_stream_ptrs else s.ptr


# --- NCCL --------------------------------------------------------------------

_nccl: dict = {}  # engine name -> (path, version) once loaded, or the error text


def nccl_library_candidates() -> list[str]:
    """Where libnccl is looked for: $MIRRORED_NCCL_LIBRARY, the nvidia-nccl-cu13 wheel, the system.

    The simulated engine is its own libnccl (a stand-in over the simulated GPUs).
    """
    if engine.name() == "sim":
        return [cuda_module().__file__]
    out = []
    if os.environ.get("MIRRORED_NCCL_LIBRARY"):
        out.append(os.environ["MIRRORED_NCCL_LIBRARY"])
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        out.append(os.path.join(root, "lib", "libnccl.so.2"))
    out.append("libnccl.so.2")
    return out


def load_nccl() -> tuple[str, int]:
    """(path, version code) of the loaded libnccl; RuntimeError naming ``pip install nvidia-nccl-cu13`` if none loads."""
    with _lock:
        key = engine.name()
        if key not in _nccl:
            try:
                _nccl[key] = tuple(cuda_module().nccl_load(nccl_library_candidates()))
            except RuntimeError as e:
                _nccl[key] = str(e)
        loaded = _nccl[key]
        if isinstance(loaded, str):
            if NCCL_FIX not in loaded:
                raise RuntimeError(f"NCCL is not available: {loaded}; {NCCL_FIX}")
            raise RuntimeError(loaded)
        return loaded


def nccl_available() -> bool:
    try:
        load_nccl()
        return True
    except RuntimeError:
        return False


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) for ``_cuda.nccl_rank`` in multi-worker jobs."""
    load_nccl()
    return cuda_module().nccl_unique_id()


_warned: set = set()


def default_gpu_algorithm(ordinals) -> str:
    """The all-reduce algorithm for GPU replicas on CUDA ``ordinals`` by default.

    ``"nccl"`` when NCCL loads and every replica has a GPU of its own; else
    ``"auto"`` (the native engine: one-pass kernels where every replica's GPU
    reads the others', else the ring or tree), with a one-line warning saying why
    (logged once per reason on the ``mirrored`` logger, as TensorFlow logs it).
    """
    ordinals = [int(o) for o in ordinals]
    if len(set(ordinals)) != len(ordinals):
        reason = "several replicas share a GPU (logical GPUs), which NCCL refuses"
    elif not nccl_available():
        reason = f"NCCL is not installed ({NCCL_FIX})"
    else:
        return "nccl"
    if reason not in _warned:
        _warned.add(reason)
        logging.getLogger("mirrored").warning("GPU all-reduce uses the native engine (one-pass kernels, "
                                              "native ring or tree): %s", reason)
    return "auto"


# --- host -> device ----------------------------------------------------------

class _Inflight:
    """Pinned staging buffers kept alive until the copies reading them finish."""

    def __init__(self):
        self._q = collections.deque()
        self._lock = threading.Lock()

    def add(self, event, pinned):
        with self._lock:
            self._q.append((event, pinned))
            while self._q and self._q[0][0].done:
                self._q.popleft()


_inflight = _Inflight()


def to_device_async(host, ordinal: int, stream=None):
    """A CuPy copy of host array ``host`` on GPU ``ordinal``, queued on ``stream``.

    The data goes through a pinned staging buffer, so the copy runs on the
    copy engine while the host (and the GPU's compute) carry on; the call
    returns at once. Work queued on ``stream`` afterwards sees the data; other
    streams must wait for it (``stream`` defaults to the current one).
    """
    cupy = cupy_module()
    host = np.ascontiguousarray(host)
    with cupy.cuda.Device(ordinal):
        stream = stream or cupy.cuda.get_current_stream()
        with stream:
            out = cupy.empty(host.shape, host.dtype)
            if host.nbytes == 0:
                return out
            pinned = cupy.cuda.alloc_pinned_memory(host.nbytes)
            staging = np.frombuffer(pinned, host.dtype, host.size).reshape(host.shape)
            staging[...] = host
            out.set(staging, stream=stream)
            event = stream.record()
    _inflight.add(event, pinned)
    return out
