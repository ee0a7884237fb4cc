"""The input rules of every collective, host and GPU alike, decided here once.

Buffers: one array per replica, the same shape (all_gather: except along the
gather axis) and dtype on every replica; host replicas take NumPy or any
DLPack / ``__array_interface__`` / buffer-protocol array, GPU replicas CuPy or
any ``__cuda_array_interface__`` / CUDA DLPack array (never a mix). Arrays in
non-native byte order are read as the numbers they hold; non-contiguous ones
are copied. Outputs: writeable arrays of the same kind, shape and dtype; one
that overlaps another replica's input, or only part of its own, is computed
aside by the engine and copied in; outputs that overlap each other are
refused. Integer MEAN is NumPy's true division of the wrapped sum (float64).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from ..device import device_util, dlpack as _dlpack, gpu as _gpu
from ..device.dtypes import OPS, dtype_code, op_code

# Algorithm names -> codes of csrc/core/communicator.h (Algorithm).
ALGORITHMS = {"auto": 0, "ring": 1, "direct": 2, "tree": 3, "hierarchical": 3}

_DTYPE_CODES: dict = {}
MEAN = OPS["mean"]


# --- integer MEAN (shared with the multi-worker group) -------------------------

def integer_mean(buffers, op) -> bool:
    """Whether this is a MEAN of integer buffers (computed as a sum, then :func:`true_divide`)."""
    if op_code(op) != MEAN:
        return False
    try:
        first = buffers[0]
    except Exception:  # not a list of buffers: the collective itself reports it
        return False
    return _is_integer(first)


def any_integer_mean(tensors, op) -> bool:
    """Whether a batch MEAN has an integer tensor among ``tensors`` (the op is checked once)."""
    return op_code(op) == MEAN and any(_is_integer(t) for t in tensors)


def _is_integer(x) -> bool:
    try:
        dtype = x.dtype if isinstance(getattr(x, "dtype", None), np.dtype) else np.asarray(x).dtype
    except Exception:  # not an array: the collective itself reports it
        return False
    return dtype.kind in "iu"


def true_divide(sums, n: int, out=None):
    """Each (wrapped) integer sum as float64 divided by ``n``, into ``out`` if given (float64 arrays)."""
    results = [_divided(s, n) for s in sums]
    if out is None:
        return results
    for i, (o, r) in enumerate(zip(out, results)):
        if not hasattr(o, "__cuda_array_interface__"):
            o = writable_view(o, "out", i)
        if getattr(o, "dtype", None) != np.float64 or getattr(o, "shape", None) != r.shape:
            raise TypeError(f"out[{i}] has dtype {getattr(o, 'dtype', type(o).__name__)}: the mean of integer "
                            "buffers is float64 (NumPy true division); pass float64 out arrays or out=None")
        o[...] = r
    return list(out)


def _divided(s, n: int):
    """s as float64 / n, on s's own GPU for CuPy arrays."""
    with device_util.array_device(s):
        return s.astype(np.float64) / n


def means_of_sums(rows, n: int):
    """A batch's MEAN from its SUM (``rows[r][t]``, fresh arrays): integers by :func:`true_divide`,
    floats divided in place (the same rounding as a native mean: sum, then one division)."""
    def mean(t):
        if t.dtype.kind in "iu":
            return true_divide([t], n)[0]
        t /= n
        return t

    return [[mean(t) for t in row] for row in rows]


# --- validation --------------------------------------------------------------

def check_batch(per_replica_lists) -> int:
    """The number of replicas of a batch: a list with one equally long list of arrays per replica."""
    if not isinstance(per_replica_lists, (list, tuple)) or not per_replica_lists:
        raise ValueError("per_replica_lists: expected a non-empty list with one list of arrays per replica")
    for r, tensors in enumerate(per_replica_lists):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"per_replica_lists[{r}] is {type(tensors).__name__}; expected a list of arrays")
        if len(tensors) != len(per_replica_lists[0]):
            raise ValueError(
                f"per_replica_lists[{r}] has {len(tensors)} tensors but per_replica_lists[0] has "
                f"{len(per_replica_lists[0])}; every replica must pass the same tensors"
            )
    return len(per_replica_lists)


def gather_layout(arrays, axis) -> tuple:
    """(result shape, bytes each replica adds to a row, number of rows) of gathering ``arrays`` along ``axis``."""
    first = arrays[0]
    if first.ndim == 0:
        raise ValueError("all_gather: buffers are 0-d scalars; gather needs at least one dimension (use x[None])")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -first.ndim <= axis < first.ndim:
        raise ValueError(f"axis={axis!r} is out of range for {first.ndim}-d buffers; use 0..{first.ndim - 1}")
    axis = int(axis) % first.ndim
    for i, a in enumerate(arrays):
        if a.ndim != first.ndim or a.shape[:axis] != first.shape[:axis] or a.shape[axis + 1:] != first.shape[axis + 1:]:
            raise ValueError(
                f"buffers[{i}] has shape {a.shape} but buffers[0] has {first.shape}: all_gather needs the "
                f"same shape on every replica except along axis {axis}"
            )
    outer = int(np.prod(first.shape[:axis], dtype=np.int64))
    inner = int(np.prod(first.shape[axis + 1:], dtype=np.int64)) * first.itemsize
    shape = first.shape[:axis] + (sum(a.shape[axis] for a in arrays),) + first.shape[axis + 1:]
    return shape, [a.shape[axis] * inner for a in arrays], outer


def check_packing(bytes_per_pack, num_packs, chunk_bytes=0) -> tuple:
    """(bytes_per_pack, num_packs, chunk_bytes) as the native call takes them (num_packs None -> 0)."""
    if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, (int, np.integer)) or bytes_per_pack < 0:
        raise ValueError(f"bytes_per_pack={bytes_per_pack!r} must be an integer >= 0 (0: no size limit)")
    if num_packs is not None and (isinstance(num_packs, bool) or not isinstance(num_packs, (int, np.integer))
                                  or num_packs < 1):
        raise ValueError(f"num_packs={num_packs!r} must be a positive integer or None")
    # The engine holds these in size_t / int: a larger request means "no limit" / "one pack per tensor"
    # anyway, so it is clamped rather than passed on to overflow the binding.
    return (min(int(bytes_per_pack), _MAX_BYTES), min(int(num_packs or 0), _MAX_PACKS),
            check_chunk_bytes(chunk_bytes))


_MAX_BYTES = 2**63 - 1
_MAX_PACKS = 2**31 - 1


# DLPack device types of CUDA memory (kDLCUDA, kDLCUDAManaged).
_DLPACK_CUDA = (2, 13)


def on_gpu(buffers) -> bool:
    """Whether the replicas' buffers are CUDA arrays (CuPy, __cuda_array_interface__, or CUDA DLPack)."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        return False
    first = buffers[0]
    if hasattr(first, "__cuda_array_interface__"):
        return True
    return type(first) is not np.ndarray and cuda_dlpack(first)


def _as_array(b, argument: str, i: int) -> np.ndarray:
    """buffers[i] as a C-contiguous NumPy array (copied only when it is not one)."""
    if isinstance(b, np.ndarray):
        return np.asarray(b, order="C")
    _check_host(b, argument, i)
    if not hasattr(b, "__array_interface__") and hasattr(b, "__dlpack__"):
        return np.asarray(_dlpack.host_view(b, f"{argument}[{i}]"), order="C")
    try:
        return np.asarray(b, order="C")
    except Exception as e:
        raise TypeError(f"{argument}[{i}]: expected an array, got {type(b).__name__} ({e})") from None


def _check_host(b, argument: str, i: int) -> None:
    """Refuses a GPU array among host buffers."""
    if hasattr(b, "__cuda_array_interface__") or cuda_dlpack(b):
        raise TypeError(f"{argument}[{i}] is a GPU array but buffers[0] is a host array; every replica's "
                        "buffer and output must be on the same kind of device")


def cuda_dlpack(x) -> bool:
    try:
        return x.__dlpack_device__()[0] in _DLPACK_CUDA
    except Exception:  # not DLPack
        return False


def writable_view(o, argument: str, i: int) -> np.ndarray:
    """out[i] as a NumPy array sharing its memory, so the collective writes it in place: NumPy arrays,
    DLPack tensors (torch, JAX on CPU, ...), ``__array_interface__`` and buffer-protocol objects
    (memoryview, bytearray, array.array)."""
    if isinstance(o, np.ndarray):
        return o
    _check_host(o, argument, i)
    if not hasattr(o, "__array_interface__") and hasattr(o, "__dlpack__"):
        return _dlpack.host_view(o, f"{argument}[{i}]")
    try:
        return np.asarray(o if hasattr(o, "__array_interface__") else memoryview(o))
    except Exception:  # e.g. a list: writing a converted copy would leave the caller's object unchanged
        raise TypeError(f"{argument}[{i}] is {type(o).__name__}; out must hold arrays the collective can write "
                        "in place: NumPy arrays, DLPack tensors, or buffer-protocol objects "
                        "(memoryview, bytearray, array.array)") from None


def inputs(buffers, argument: str, same_shape: bool = True):
    # The hot path of every collective: keep it to attribute reads and
    # identity checks (error messages are only formatted on failure).
    if type(buffers) not in (list, tuple) or not buffers:
        raise ValueError(f"{argument}: expected a non-empty list with one array per replica, got {buffers!r:.80}")
    arrays = []
    for i, a in enumerate(buffers):
        if type(a) is not np.ndarray or not a.flags.c_contiguous:
            a = _as_array(a, argument, i)
        arrays.append(a)
    first = arrays[0]
    shape, dtype = first.shape, first.dtype
    swapped = False  # some array is in non-native byte order
    for i, a in enumerate(arrays):
        if a.dtype is not dtype and a.dtype != dtype:
            if native(a.dtype) != native(dtype):
                raise TypeError(f"{argument}[{i}] has dtype {a.dtype} but {argument}[0] has {dtype}; "
                                "every replica must pass the same dtype (cast with .astype)")
            swapped = True
        if same_shape and a.shape != shape:
            raise ValueError(f"{argument}[{i}] has shape {a.shape} but {argument}[0] has {shape}; "
                             "every replica must pass the same shape")
    code = _DTYPE_CODES.get(dtype)  # holds native dtypes only
    if code is None or swapped:
        # The core reduces native numbers: convert byte-swapped arrays (a copy), as NumPy would.
        dtype = native(dtype)
        arrays = [a if a.dtype.isnative else a.astype(dtype) for a in arrays]
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            code = _DTYPE_CODES.setdefault(dtype, dtype_code(dtype, argument))
    return arrays, code


def native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


class _Recycler:
    """Result buffers of large collectives, handed out again once nothing refers to them.

    A fresh multi-MiB array costs a page fault per 4 KiB page when it is first
    written (the allocator gives large blocks back to the OS when they are
    freed): most of the time of an out-of-place 64 MiB all-reduce. Training
    steps reduce the same sizes every step, so a buffer is reused as soon as
    every result viewing it has been dropped, which CPython's reference count
    tells exactly.
    """

    MIN_BYTES = 1 << 20  # smaller blocks come from the allocator's free lists anyway
    MAX_FREE = 16  # free buffers kept for reuse, oldest dropped first ...
    MAX_FREE_BYTES = 1 << 30  # ... and at most this much memory held by them

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: list = []

    def empty(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` that no live array uses."""
        if nbytes < self.MIN_BYTES:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            # Free: referenced only by this list (getrefcount adds one for its own argument).
            free = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) == 2]
            for i in free:
                if self._buffers[i].nbytes == nbytes:
                    return self._buffers[i]
            # Keep at most MAX_FREE free buffers and MAX_FREE_BYTES of them, dropping the oldest.
            free_bytes = sum(self._buffers[i].nbytes for i in free)
            drop = []
            for i in free:
                if len(free) - len(drop) < self.MAX_FREE and free_bytes <= self.MAX_FREE_BYTES:
                    break
                drop.append(i)
                free_bytes -= self._buffers[i].nbytes
            for i in reversed(drop):
                del self._buffers[i]
            buf = np.empty(nbytes, np.uint8)
            self._buffers.append(buf)
            return buf


recycler = _Recycler()


def result(shape, dtype) -> np.ndarray:
    """An uninitialised array for a collective's result (large ones reuse dropped buffers)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _Recycler.MIN_BYTES:
        return np.empty(shape, dtype)
    return recycler.empty(nbytes).view(dtype).reshape(shape)


def result_like(a: np.ndarray) -> np.ndarray:
    return result(a.shape, a.dtype)


def new_outputs(arrays):
    return [result_like(a) for a in arrays]


def outputs(out, arrays, argument: str, written=None):
    """Native-writable outputs and a function returning what the caller sees (``out`` itself).
    ``written``: the one output the collective writes (reduce's root), else every one."""
    if out is None:
        outs = new_outputs(arrays)
        return outs, outs.copy
    if type(out) not in (list, tuple) or len(out) != len(arrays):
        raise ValueError(f"{argument}: expected a list of {len(arrays)} arrays (one per replica), got {out!r:.80}")
    outs = list(out)
    copies = []  # (the caller's view, the temporary the core writes instead)
    for i, o in enumerate(out):
        if o is arrays[i]:  # in place on a contiguous input: already validated
            if not o.flags.writeable:
                raise ValueError(f"{argument}[{i}] is read-only; pass writeable arrays (or out=None)")
            continue
        if type(o) is not np.ndarray:
            o = outs[i] = writable_view(o, argument, i)
        if o.shape != arrays[i].shape or native(o.dtype) != arrays[i].dtype:
            raise ValueError(f"{argument}[{i}] has shape {o.shape} and dtype {o.dtype}; expected "
                             f"{arrays[i].shape} and {arrays[i].dtype} like the buffers")
        if not o.flags.writeable:
            raise ValueError(f"{argument}[{i}] is read-only; pass writeable arrays (or out=None)")
        if written is not None and i != written:
            continue
        if not o.flags.c_contiguous or not o.dtype.isnative:
            # Computed into a temporary, copied back (byte-swapped where out is) by finish().
            outs[i] = result_like(arrays[i])
            copies.append((o, outs[i]))

    def finish():
        for o, tmp in copies:
            o[...] = tmp
        return list(out)

    return outs, finish


def algorithm_code(algorithm) -> int:
    code = ALGORITHMS.get(algorithm.lower() if isinstance(algorithm, str) else algorithm)
    if code is None:
        if algorithm == "nccl":
            raise ValueError("algorithm='nccl' needs GPU (CuPy) buffers; host buffers use "
                             "'auto', 'ring', 'direct' or 'tree'")
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {', '.join(repr(a) for a in ALGORITHMS)}")
    return code


def check_chunk_bytes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"chunk_bytes={value!r} must be an integer >= 0 (0: the engine's default)")
    return min(int(value), _MAX_BYTES)  # (a chunk larger than any buffer is the whole buffer)


def root_index(root, n: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"root={root!r} is not a replica index; use 0..{n - 1}")
    return int(root)


# --- GPU buffers ---------------------------------------------------------------

def _as_gpu_array(b, argument: str, i: int):
    """buffers[i] as a C-contiguous CuPy array on its own GPU (copied only when not contiguous)."""
    cupy = _gpu.cupy_module()
    if isinstance(b, cupy.ndarray):
        a = b
    elif hasattr(b, "__cuda_array_interface__"):
        a = cupy.asarray(b)  # zero-copy view
    elif isinstance(b, np.ndarray) or hasattr(b, "__array_interface__") or isinstance(b, (bytes, bytearray, memoryview)):
        raise TypeError(f"{argument}[{i}] is a host array but {argument}[0] is on a GPU; every replica's buffer "
                        "must be on that replica's GPU (move it with cupy.asarray under cupy.cuda.Device(ordinal))")
    elif hasattr(b, "__dlpack__"):
        try:
            a = cupy.from_dlpack(b)
        except Exception as e:
            raise TypeError(f"{argument}[{i}]: this DLPack tensor is not on a CUDA GPU ({e}); every replica's "
                            "buffer must be on that replica's GPU") from None
    else:
        raise TypeError(f"{argument}[{i}] is {type(b).__name__}; expected a CuPy array or an object with "
                        "__cuda_array_interface__ or __dlpack__")
    data = a.data
    if data is None or not isinstance(getattr(data, "ptr", None), int) or (data.ptr == 0 and a.size):
        raise ValueError(f"{argument}[{i}] has no device memory (its data is {data!r:.60}); pass a live CuPy array")
    if not a.flags.c_contiguous:
        with a.device:
            a = cupy.ascontiguousarray(a)
    return a


def gpu_inputs(buffers, argument: str, same_shape: bool = True):
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise ValueError(f"{argument}: expected a non-empty list with one array per replica, got {buffers!r:.80}")
    arrays = [_as_gpu_array(b, argument, i) for i, b in enumerate(buffers)]
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.dtype != first.dtype:
            raise TypeError(f"{argument}[{i}] has dtype {a.dtype} but {argument}[0] has {first.dtype}; "
                            "every replica must pass the same dtype (cast with .astype)")
        if same_shape and a.shape != first.shape:
            raise ValueError(f"{argument}[{i}] has shape {a.shape} but {argument}[0] has {first.shape}; "
                             "every replica must pass the same shape")
    return arrays, dtype_code(first.dtype, argument), tuple(a.data.device_id for a in arrays)


def gpu_outputs(out, arrays, devices, argument: str, written=None):
    """Device outputs the engine writes, and a function returning what the caller sees.

    As on the host (csrc/host/output_staging.h): ``out[i]`` may be its own input (in place); one that
    overlaps an input otherwise (another replica's, or part of its own) or is not contiguous is
    computed into a new array and copied in by ``finish``; outputs that overlap each other are refused.
    ``written``: the one output the collective writes (reduce's root), else every one."""
    cupy = _gpu.cupy_module()
    if out is None:
        outs = []
        for a, d in zip(arrays, devices):
            with cupy.cuda.Device(d):
                outs.append(cupy.empty_like(a))
        return outs, outs.copy
    if not isinstance(out, (list, tuple)) or len(out) != len(arrays):
        raise ValueError(f"{argument}: expected a list of {len(arrays)} arrays (one per replica), got {out!r:.80}")
    outs, copies, spans = list(out), [], {}
    inputs = [gpu_span(a) for a in arrays]
    for i, o in enumerate(out):
        if o is arrays[i]:
            spans[i] = inputs[i]
            continue
        if not isinstance(o, cupy.ndarray):
            if not hasattr(o, "__cuda_array_interface__"):
                raise TypeError(f"{argument}[{i}] is {type(o).__name__}; out must hold GPU arrays "
                                "(CuPy or __cuda_array_interface__) for GPU buffers")
            o = outs[i] = cupy.asarray(o)  # a view: written in place
        if o.shape != arrays[i].shape or o.dtype != arrays[i].dtype:
            raise ValueError(f"{argument}[{i}] has shape {o.shape} and dtype {o.dtype}; expected "
                             f"{arrays[i].shape} and {arrays[i].dtype} like the buffers")
        if o.data.device_id != devices[i]:
            raise ValueError(f"{argument}[{i}] is on GPU {o.device.id} but buffers[{i}] on GPU {devices[i]}; "
                             "each output must be on its replica's GPU")
        if written is not None and i != written:
            continue
        span = spans[i] = gpu_span(o)
        in_place = o.flags.c_contiguous and span == inputs[i]
        if not in_place and (not o.flags.c_contiguous or any(_overlap(span, x) for x in inputs)):
            with o.device:
                outs[i] = cupy.empty_like(arrays[i])  # computed here, copied back by finish()
            copies.append((o, outs[i]))
    written_spans = sorted(spans.items())
    for k, (i, a) in enumerate(written_spans):
        for j, b in written_spans[:k]:
            if _overlap(a, b):
                raise ValueError(f"{argument}[{j}] and {argument}[{i}] share memory; give every replica its own "
                                 "output array")

    def finish():
        for o, tmp in copies:
            with o.device:
                o[...] = tmp
        return list(out)

    return outs, finish


def gpu_span(a) -> tuple:
    """The device addresses [first, end) that a CuPy array's elements lie in ((p, p) when it has none)."""
    first = end = a.data.ptr
    if a.size == 0:
        return first, first
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            first += (n - 1) * stride
        else:
            end += (n - 1) * stride
    return first, end + a.itemsize


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]
