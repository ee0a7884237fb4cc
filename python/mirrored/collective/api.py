"""Collectives over the buffers of all local replicas, in one native call.

``buffers`` is a list with one array per replica (on host replicas NumPy
or any DLPack / ``__array_interface__`` / buffer-protocol array; CuPy or any
``__cuda_array_interface__`` array on GPU replicas, which go to the CUDA
engine). The GIL is released for the whole collective.

``out`` takes the same kinds of arrays and writes them in place (a torch
tensor, a bytearray, ...); the call returns ``out``. ``out=buffers`` works in
place without a copy. An ``out[i]`` that overlaps another replica's input,
or only part of its own, is computed aside and copied in at the end (always
right, never silently mixed); outputs that overlap each other are refused.

Arrays in non-native byte order (``'>i4'`` on x86) are read as the numbers
they hold (converted, as NumPy does); results are in native byte order, and
an ``out`` array in the other byte order receives the same values converted.

Results follow NumPy: integer sums wrap on overflow; ``mean`` of integer
buffers is NumPy's true division of the (wrapped) sum by the number of
replicas, so the result is float64 (``s.astype(np.float64) / n``), as
TensorFlow's MEAN of integer tensors is; NaN and Inf propagate as IEEE says
(``min``/``max`` return NaN when any input is NaN, like ``np.minimum``).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from .. import _core, timeline
from ..device import device_util, dlpack as _dlpack
from ..device.dtypes import OPS, dtype_code, op_code

__all__ = ["all_reduce", "broadcast", "reduce", "all_gather", "batch_all_reduce", "ALGORITHMS"]

# Algorithm names -> codes of csrc/core/communicator.h (Algorithm).
ALGORITHMS = {"auto": 0, "ring": 1, "direct": 2, "tree": 3, "hierarchical": 3}

_DTYPE_CODES: dict = {}
_MEAN = OPS["mean"]


def all_reduce(buffers, op="sum", *, out=None, algorithm="auto", chunk_bytes=0):
    """``out[i] = op(buffers[0], ..., buffers[n-1])`` for every replica ``i``.

    ``chunk_bytes``: bytes each participant handles per ring step (0: the
    engine's default); only the ring uses it.
    """
    opc = op_code(op)
    if opc == _MEAN and integer_mean(buffers, op):
        sums = all_reduce(buffers, "sum", algorithm=algorithm, chunk_bytes=chunk_bytes)
        return true_divide(sums, len(sums), out)
    if _on_gpu(buffers):
        return _cuda().all_reduce(buffers, op, out=out, algorithm=algorithm, chunk_bytes=chunk_bytes)
    chunk = _chunk_bytes(chunk_bytes)
    arrays, code = _inputs(buffers, "buffers")
    algo = _algorithm(algorithm)
    outs, finish = _outputs(out, arrays, "out")
    with timeline.span("all_reduce", arrays[0].nbytes, algorithm, len(arrays)):
        _core.all_reduce(arrays, outs, arrays[0].size, code, opc, algo, chunk)
    return finish()


def broadcast(buffers, root=0, *, out=None):
    """``out[i] = buffers[root]`` for every replica ``i``."""
    if _on_gpu(buffers):
        return _cuda().broadcast(buffers, root, out=out)
    arrays, code = _inputs(buffers, "buffers")
    root = _root(root, len(arrays))
    outs, finish = _outputs(out, arrays, "out")
    with timeline.span("broadcast", arrays[0].nbytes, "direct", len(arrays)):
        _core.broadcast(arrays, outs, arrays[0].size, code, root)
    return finish()


def reduce(buffers, op="sum", root=0, *, out=None):
    """The reduction of all replicas' buffers, written to ``out[root]`` (or a new array) and returned."""
    if integer_mean(buffers, op):
        total = reduce(buffers, "sum", root)
        return true_divide([total], len(buffers), None if out is None else [out[root]])[0]
    if _on_gpu(buffers):
        return _cuda().reduce(buffers, op, root, out=out)
    arrays, code = _inputs(buffers, "buffers")
    opc = op_code(op)
    root = _root(root, len(arrays))
    if out is None:
        target, finish = _result_like(arrays[root]), None
    else:
        outs, finish = _outputs(out, arrays, "out")
        target = outs[root]
    with timeline.span("reduce", arrays[0].nbytes, "direct", len(arrays)):
        _core.reduce(arrays, [target] * len(arrays), arrays[0].size, code, opc, root)
    return target if finish is None else finish()[root]


def all_gather(buffers, axis=0):
    """Every replica gets ``np.concatenate(buffers, axis)``; sizes may differ along ``axis`` only."""
    if _on_gpu(buffers):
        return _cuda().all_gather(buffers, axis)
    arrays, _ = _inputs(buffers, "buffers", same_shape=False)
    shape, row_bytes, outer = gather_layout(arrays, axis)
    outs = [_result(shape, arrays[0].dtype) for _ in arrays]
    with timeline.span("all_gather", arrays[0].nbytes, "direct", len(arrays)):
        _core.all_gather(arrays, outs, row_bytes, outer)
    return outs


def batch_all_reduce(per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto",
                     chunk_bytes=0):
    """All-reduce many tensors per replica at once, fused into few packs.

    ``per_replica_lists[r][t]`` is tensor ``t`` of replica ``r``; returns the
    same structure of new arrays. ``bytes_per_pack`` caps a pack's size;
    ``num_packs`` splits each dtype's tensors into that many packs; neither:
    one pack per dtype.
    """
    n = check_batch(per_replica_lists)
    if not per_replica_lists[0]:
        return [[] for _ in range(n)]
    if any_integer_mean(per_replica_lists[0], op):
        return means_of_sums(batch_all_reduce(per_replica_lists, "sum", bytes_per_pack=bytes_per_pack,
                                              num_packs=num_packs, algorithm=algorithm, chunk_bytes=chunk_bytes), n)
    if _on_gpu([per_replica_lists[0][0]]):
        return _cuda().batch_all_reduce(per_replica_lists, op, bytes_per_pack=bytes_per_pack,
                                        num_packs=num_packs, algorithm=algorithm, chunk_bytes=chunk_bytes)
    bytes_per_pack, num_packs, chunk = check_packing(bytes_per_pack, num_packs, chunk_bytes)
    opc = op_code(op)
    algo = _algorithm(algorithm)
    # Plain contiguous arrays of built-in dtypes: checked and reduced in one native call.
    nbytes = sum(np.asarray(a).nbytes for a in per_replica_lists[0]) if timeline.enabled() else 0
    with timeline.span("batch_all_reduce", nbytes, algorithm, n):
        fast = _core.batch_all_reduce_lists(per_replica_lists, opc, bytes_per_pack, num_packs, algo, chunk,
                                            _recycler.empty)
    if fast is not None:
        return fast
    # Anything else (lists, strided views, bfloat16, mismatches): convert and check tensor t across
    # replicas with messages naming it, then arrange inputs replica-major.
    columns = []
    for t in range(len(per_replica_lists[0])):
        column, code = _inputs([tensors[t] for tensors in per_replica_lists], f"per_replica_lists[*][{t}]")
        columns.append((column, code))
    inputs = [columns[t][0][r] for r in range(n) for t in range(len(columns))]
    outputs = [_result_like(a) for a in inputs]
    with timeline.span("batch_all_reduce", sum(a.nbytes for a in inputs) // n, algorithm, n):
        _core.batch_all_reduce(n, inputs, outputs, [c[0][0].size for c in columns], [c[1] for c in columns],
                               opc, bytes_per_pack, num_packs, algo, chunk)
    T = len(columns)
    return [outputs[r * T:(r + 1) * T] for r in range(n)]


# --- integer MEAN (shared with the multi-worker group) -------------------------

def integer_mean(buffers, op) -> bool:
    """Whether this is a MEAN of integer buffers (computed as a sum, then :func:`true_divide`)."""
    if op_code(op) != _MEAN:
        return False
    try:
        first = buffers[0]
    except Exception:  # not a list of buffers: the collective itself reports it
        return False
    return _is_integer(first)


def any_integer_mean(tensors, op) -> bool:
    """Whether a batch MEAN has an integer tensor among ``tensors`` (the op is checked once)."""
    return op_code(op) == _MEAN and any(_is_integer(t) for t in tensors)


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
            o = _writable_view(o, "out", i)
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


# --- validation (shared with _cuda_collectives) ------------------------------

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
    return int(bytes_per_pack), int(num_packs or 0), _chunk_bytes(chunk_bytes)


# DLPack device types of CUDA memory (kDLCUDA, kDLCUDAManaged).
_DLPACK_CUDA = (2, 13)


def _on_gpu(buffers) -> bool:
    """Whether the replicas' buffers are CUDA arrays (CuPy, __cuda_array_interface__, or CUDA DLPack)."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        return False
    first = buffers[0]
    if hasattr(first, "__cuda_array_interface__"):
        return True
    return type(first) is not np.ndarray and _cuda_dlpack(first)


def _cuda():
    try:
        from . import cuda as _cuda_collectives
    except ImportError as e:  # no CUDA extension in this build
        raise RuntimeError(
            f"GPU buffers need mirrored's CUDA extension, which is not available ({e}); "
            "reinstall mirrored on a machine with the CUDA toolkit (nvcc) and `pip install cupy-cuda13x`"
        ) from None
    return _cuda_collectives


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
    if hasattr(b, "__cuda_array_interface__") or _cuda_dlpack(b):
        raise TypeError(f"{argument}[{i}] is a GPU array but buffers[0] is a host array; every replica's "
                        "buffer and output must be on the same kind of device")


def _cuda_dlpack(x) -> bool:
    try:
        return x.__dlpack_device__()[0] in _DLPACK_CUDA
    except Exception:  # not DLPack
        return False


def _writable_view(o, argument: str, i: int) -> np.ndarray:
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


def _inputs(buffers, argument: str, same_shape: bool = True):
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
            if _native(a.dtype) != _native(dtype):
                raise TypeError(f"{argument}[{i}] has dtype {a.dtype} but {argument}[0] has {dtype}; "
                                "every replica must pass the same dtype (cast with .astype)")
            swapped = True
        if same_shape and a.shape != shape:
            raise ValueError(f"{argument}[{i}] has shape {a.shape} but {argument}[0] has {shape}; "
                             "every replica must pass the same shape")
    code = _DTYPE_CODES.get(dtype)  # holds native dtypes only
    if code is None or swapped:
        # The core reduces native numbers: convert byte-swapped arrays (a copy), as NumPy would.
        dtype = _native(dtype)
        arrays = [a if a.dtype.isnative else a.astype(dtype) for a in arrays]
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            code = _DTYPE_CODES.setdefault(dtype, dtype_code(dtype, argument))
    return arrays, code


def _native(dtype: np.dtype) -> np.dtype:
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


_recycler = _Recycler()


def _result(shape, dtype) -> np.ndarray:
    """An uninitialised array for a collective's result (large ones reuse dropped buffers)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _Recycler.MIN_BYTES:
        return np.empty(shape, dtype)
    return _recycler.empty(nbytes).view(dtype).reshape(shape)


def _result_like(a: np.ndarray) -> np.ndarray:
    return _result(a.shape, a.dtype)


def _new_outputs(arrays):
    return [_result_like(a) for a in arrays]


def _outputs(out, arrays, argument: str):
    """Native-writable outputs and a function returning what the caller sees (``out`` itself)."""
    if out is None:
        outs = _new_outputs(arrays)
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
            o = outs[i] = _writable_view(o, argument, i)
        if o.shape != arrays[i].shape or _native(o.dtype) != arrays[i].dtype:
            raise ValueError(f"{argument}[{i}] has shape {o.shape} and dtype {o.dtype}; expected "
                             f"{arrays[i].shape} and {arrays[i].dtype} like the buffers")
        if not o.flags.writeable:
            raise ValueError(f"{argument}[{i}] is read-only; pass writeable arrays (or out=None)")
        if not o.flags.c_contiguous or not o.dtype.isnative:
            # Computed into a temporary, copied back (byte-swapped where out is) by finish().
            outs[i] = _result_like(arrays[i])
            copies.append((o, outs[i]))

    def finish():
        for o, tmp in copies:
            o[...] = tmp
        return list(out)

    return outs, finish


def _algorithm(algorithm) -> int:
    code = ALGORITHMS.get(algorithm.lower() if isinstance(algorithm, str) else algorithm)
    if code is None:
        if algorithm == "nccl":
            raise ValueError("algorithm='nccl' needs GPU (CuPy) buffers; host buffers use "
                             "'auto', 'ring', 'direct' or 'tree'")
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {', '.join(repr(a) for a in ALGORITHMS)}")
    return code


def _chunk_bytes(chunk_bytes) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)) or chunk_bytes < 0:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} must be an integer >= 0 (0: the engine's default)")
    return int(chunk_bytes)


def _root(root, n: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"root={root!r} is not a replica index; use 0..{n - 1}")
    return int(root)
