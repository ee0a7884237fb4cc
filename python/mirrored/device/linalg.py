"""``md.linalg.matmul`` (also ``md.matmul``): ``tf.linalg.matmul`` for NumPy and CuPy arrays.

On CuPy arrays the product runs on a cuBLAS handle of mirrored's own
(``csrc/cuda/blas.h``), which CUDA stream capture may record: CuPy refuses
every cuBLAS call (``@``, ``cupy.matmul``, ``dot``, ``tensordot``) while a
stream is capturing, so a step that ``md.function`` captures writes its
products with this function. On NumPy arrays it is ``np.matmul`` with
TensorFlow's argument rules, so the same step runs on CPU strategies.

    y = md.linalg.matmul(x, w)                       # x @ w
    dw = md.linalg.matmul(x, dy, transpose_a=True)   # x.T @ dy, without a copy of x.T
    dx = md.linalg.matmul(dy, w, transpose_b=True)   # dy @ w.T
"""

from __future__ import annotations

import math

import numpy as np

from . import gpu
from .indexed_slices import convert_to_tensor

__all__ = ["matmul"]

# What the cuBLAS engine takes (its Type codes), each computed in its own precision (halves in float32).
_GPU_TYPES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "complex64": 4, "complex128": 5}
# TensorFlow's MatMul on the host: these dtypes, both inputs alike.
_HOST_TYPES = frozenset(_GPU_TYPES) | {"int32", "int64"}
# int8/uint8 inputs (mixed, too) multiply only into output_type=int32.
_INT8_TYPES = frozenset({"int8", "uint8"})
# The host dtypes whose product np.matmul computes as TensorFlow does (no float32 accumulation to add).
_PLAIN_HOST = frozenset("fdFDil")
_OP_N, _OP_T, _OP_C = 0, 1, 2  # cublasOperation_t: as stored, transposed, conjugate-transposed


def matmul(a, b, transpose_a=False, transpose_b=False, adjoint_a=False, adjoint_b=False, a_is_sparse=False,
           b_is_sparse=False, output_type=None, grad_a=False, grad_b=False, name=None):
    """The matrix product ``op(a) @ op(b)`` of the inner-most two dimensions, TensorFlow's ``tf.linalg.matmul``.

    ``a`` and ``b``: arrays of rank >= 2 and the same dtype, both NumPy (host) or both CuPy on
    one GPU; their leading (batch) dimensions broadcast. ``transpose_*`` transposes an operand,
    ``adjoint_*`` conjugates and transposes it (at most one of the two per operand).
    ``output_type``: only ``int32`` for int8/uint8 inputs (which then may differ), or the inputs'
    own dtype. ``a_is_sparse``, ``b_is_sparse``, ``grad_a``, ``grad_b`` and ``name`` are
    TensorFlow's hints and change nothing.

    A CuPy product is queued on the current stream of the arrays' GPU and its result allocated
    from CuPy's current allocator (under ``md.function``, the captured step's own pool). float16
    and bfloat16 accumulate in float32; float32 never uses TF32, as CuPy's ``@``.
    """
    if (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == 2 == b.ndim and a.dtype == b.dtype
            and a.dtype.char in _PLAIN_HOST and output_type is None and not (adjoint_a or adjoint_b)):
        # The common host case, without the general path's checks (~15 us per call): 2-D, one dtype
        # that np.matmul computes in its own precision, transposes as views.
        x, y = a.T if transpose_a else a, b.T if transpose_b else b
        if x.shape[1] == y.shape[0]:
            return np.matmul(x, y)
    ready = _gpu_ready.get(a.__class__)
    if ready is not None and b.__class__ is a.__class__ and output_type is None and not (adjoint_a or adjoint_b):
        # The common GPU case likewise: matrices (or 3-D batches of them) of one dtype, row- or
        # column-major, on the current GPU.
        out = _gpu_fast(ready, a, b, _OP_T if transpose_a else _OP_N, _OP_T if transpose_b else _OP_N)
        if out is not None:
            return out
    for flag, t, adj in (("a", transpose_a, adjoint_a), ("b", transpose_b, adjoint_b)):
        if t and adj:
            raise ValueError(f"Only one of `transpose_{flag}` and `adjoint_{flag}` can be True. Received "
                             f"`transpose_{flag}`={t}, `adjoint_{flag}`={adj}.")
    on_gpu = _is_cupy(a), _is_cupy(b)
    if on_gpu[0] != on_gpu[1]:
        which = "a" if on_gpu[0] else "b"
        other = "b" if on_gpu[0] else "a"
        raise TypeError(f"matmul: {which} is a CuPy array and {other} is not: pass both on the same GPU "
                        f"(cupy.asarray({other})) or both on the host")
    if not on_gpu[0]:
        a = _host_operand(a)
        b = _host_operand(b, a.dtype)  # (TF converts b with a's dtype as its hint)
    _check_ranks(a, b)
    out_dtype = _result_dtype(a.dtype, b.dtype, output_type, on_gpu[0])
    conjugate = np.dtype(a.dtype).kind == "c"  # a real adjoint is a transpose (which a layout flip serves)
    ops = (_op(transpose_a, adjoint_a, conjugate), _op(transpose_b, adjoint_b, conjugate))
    m, k = _rows_cols(a.shape, ops[0])
    k_b, n = _rows_cols(b.shape, ops[1])
    if k != k_b:
        raise ValueError(f"Matrix size-incompatible: In[0]: {list(a.shape)}, In[1]: {list(b.shape)} "
                         f"(op(a) is {m} x {k}, op(b) is {k_b} x {n}: the inner dimensions must agree; check "
                         "transpose_a/transpose_b)")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"In[0] and In[1] must have compatible batch dimensions: {list(a.shape)} vs. "
                         f"{list(b.shape)} (the leading dimensions broadcast as NumPy's do)") from None
    if on_gpu[0]:
        return _gpu_matmul(a, b, ops, tuple(batch), m, n, k)
    return _host_matmul(a, b, ops, out_dtype)


def _is_cupy(x) -> bool:
    return type(x).__module__.partition(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__")


def _host_operand(x, hint=None):
    """``x`` as a NumPy array. Python values (numbers, or lists and tuples of them) convert as
    ``tf.convert_to_tensor(x, dtype_hint=hint)`` converts them, except that ints that do not fit an
    integer hint keep their own dtype: TF would wrap them, a silently wrong product."""
    if not _python_values(x):
        return np.asarray(x)
    converted = convert_to_tensor(x, dtype_hint=hint)
    if hint is not None and hint.kind in "iu" and converted.dtype == hint \
            and not np.array_equal(converted, np.asarray(x)):
        return convert_to_tensor(x)
    return converted


def _python_values(x) -> bool:
    """Whether x is a Python number or a (nested) list or tuple of them only; NumPy scalars and
    arrays keep their dtype, as in TF."""
    if type(x) in (list, tuple):
        return all(map(_python_values, x))
    return type(x) in (int, float, complex, bool)


def _check_ranks(a, b):
    for which, x in (("a", a), ("b", b)):
        if x.ndim < 2:
            raise ValueError(f"matmul: {which} has shape {list(x.shape)}: In[{'ab'.index(which)}] ndims must be "
                             ">= 2 (a matrix, or a batch of them); make a vector v a matrix with v[None, :] or "
                             "v[:, None]")


def _dtype_name(dtype) -> str:
    if dtype is None:
        return ""
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"matmul: output_type={dtype!r} is not a dtype (pass e.g. numpy.int32 or 'int32')") from None


def _result_dtype(a_dtype, b_dtype, output_type, on_gpu: bool):
    """The product's dtype under TensorFlow's rules, or the TypeError that names the argument and the fix."""
    a_name, b_name, out = np.dtype(a_dtype).name, np.dtype(b_dtype).name, _dtype_name(output_type)
    if out and not (a_name == b_name == out):
        if out == "int32" and a_name in _INT8_TYPES and b_name in _INT8_TYPES:
            if on_gpu:
                raise TypeError("matmul: int8/uint8 products on GPU arrays are not supported; multiply them on the "
                                "host, or cast both to float32")
            return np.dtype(np.int32)
        raise TypeError(f"matmul: output_type={out} for {a_name} x {b_name}: TensorFlow's matmul takes an "
                        "output_type other than the inputs' dtype only for int8/uint8 inputs, with output_type="
                        "int32; drop output_type and cast the result")
    if a_name != b_name:
        hint = ("; pass output_type=int32 to multiply int8/uint8 inputs" if {a_name, b_name} <= _INT8_TYPES
                else f" (cast one: b.astype({a_name}))")
        raise TypeError(f"matmul: a is {a_name} and b is {b_name}: both must have the same dtype{hint}")
    allowed = _GPU_TYPES if on_gpu else _HOST_TYPES
    if a_name not in allowed:
        hint = "; pass output_type=int32" if a_name in _INT8_TYPES and not on_gpu else ""
        where = "GPU" if on_gpu else "host"
        raise TypeError(f"matmul: dtype {a_name} is not supported for {where} arrays (use one of "
                        f"{', '.join(sorted(allowed))}){hint}")
    return np.dtype(a_dtype)


def _op(transpose: bool, adjoint: bool, conjugate: bool) -> int:
    return _OP_C if adjoint and conjugate else _OP_T if transpose or adjoint else _OP_N


def _rows_cols(shape, op):
    r, c = shape[-2], shape[-1]
    return (r, c) if op == _OP_N else (c, r)


def _host_matmul(a, b, ops, out_dtype):
    x, y = (_apply_op(v, op) for v, op in zip((a, b), ops))
    if out_dtype.name in ("float16", "bfloat16"):
        # Halves accumulate in float32 (as TF's kernels and cuBLAS do), then round once.
        return np.matmul(x.astype(np.float32), y.astype(np.float32)).astype(out_dtype)
    if out_dtype != x.dtype:  # int8/uint8 into int32
        return np.matmul(x.astype(out_dtype), y.astype(out_dtype))
    return np.matmul(x, y)


def _apply_op(x, op):
    if op == _OP_N:
        return x
    x = np.swapaxes(x, -1, -2)
    return np.conj(x) if op == _OP_C else x


# --- CuPy arrays: mirrored's cuBLAS ------------------------------------------------------

# What a product's signature determines, found on its first call and reused by the fast path
# (_gpu_fast), which then reads neither the environment nor a dtype's name: CuPy's array class ->
# the calls a product makes (cupy.empty, the current device and stream, the engine's matmul with
# cuBLAS loaded; the real CuPy's arrays go to the real engine, the simulator's stand-in's to the
# simulator), and dtype -> the engine's Type code.
_gpu_ready: dict = {}
_gpu_codes: dict = {}


def _gpu_engine(cls):
    """(cupy, the CUDA extension with cuBLAS loaded) for products of CuPy arrays of class ``cls``."""
    extension = gpu.cuda_module()
    gpu.load_cublas()
    cupy = gpu.cupy_module()
    if cls is cupy.ndarray and cls not in _gpu_ready:
        _gpu_ready[cls] = cupy.empty, cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream, extension.matmul
    return cupy, extension


def _gpu_code(dtype) -> int:
    code = _gpu_codes.get(dtype)
    if code is None:
        code = _gpu_codes[dtype] = _GPU_TYPES[np.dtype(dtype).name]
    return code


def _gpu_fast(ready, a, b, op_a, op_b):
    """``op(a) @ op(b)`` of 2-D or 3-D CuPy arrays of one dtype on the current GPU whose matrices are
    row- or column-major, without the general path's checks (cuBLAS's arguments from the shapes and
    strides alone); None for anything else, which the general path takes (and raises for)."""
    dtype = a.dtype
    code = _gpu_codes.get(dtype)
    if code is None or b.dtype is not dtype:
        return None
    empty, current_device, current_stream, product = ready
    data_a, data_b = a.data, b.data
    device = data_a.device_id
    if data_b.device_id != device or current_device() != device:
        return None
    size = dtype.itemsize
    x, y = _fast_operand(a.shape, a.strides, size, op_a), _fast_operand(b.shape, b.strides, size, op_b)
    if x is None or y is None:
        return None
    m, k, flag_a, lda, items_a, stride_a = x
    k_b, n, flag_b, ldb, items_b, stride_b = y
    count = items_a if items_b == 1 else items_b
    if k != k_b or not (m and n and k and count) or items_a not in (1, count):
        return None
    out = empty((m, n) if a.ndim == 2 == b.ndim else (count, m, n), dtype)
    product(device, code, m, n, k, count, data_a.ptr, flag_a, lda, stride_a, data_b.ptr, flag_b, ldb, stride_b,
            out.data.ptr, current_stream().ptr)
    return out


def _fast_operand(shape, strides, size, op):
    """(rows, cols of op(x), op flag, ld, batch items, batch stride) for cuBLAS of a 2-D or 3-D
    operand whose matrices are C-contiguous (read as stored) or F-contiguous (read with the op flag
    flipped); None for other layouts and ranks."""
    if len(shape) == 2:
        items, stride = 1, 0
    elif len(shape) == 3:
        items, stride = shape[0], strides[0]
        if items == 1:
            stride = 0
        elif stride < 0 or stride % size:
            return None
    else:
        return None
    r, c = shape[-2], shape[-1]
    sr, sc = strides[-2], strides[-1]
    if sc == size and sr == c * size:
        flag, ld = op, c
    elif sr == size and sc == r * size:
        flag, ld = 1 - op, r  # (N <-> T)
    else:
        return None
    return (c, r, flag, ld, items, stride // size) if op else (r, c, flag, ld, items, stride // size)


def _gpu_matmul(a, b, ops, batch, m, n, k):
    cupy, extension = _gpu_engine(a.__class__)
    device = int(a.data.device_id)
    if int(b.data.device_id) != device:
        raise ValueError(f"matmul: a is on GPU {device} and b on GPU {int(b.data.device_id)}: both must be on one GPU "
                         f"(copy one: with cupy.cuda.Device({device}): b = cupy.asarray(b))")
    code = _gpu_code(a.dtype)
    with cupy.cuda.Device(device):
        out = cupy.empty(batch + (m, n), a.dtype)
        if out.size == 0:
            return out
        if k == 0:  # an empty sum
            out.fill(0)
            return out
        count = math.prod(batch)
        (a, op_a, lda, stride_a), (b, op_b, ldb, stride_b) = (
            _operand(cupy, x, op, batch, count) for x, op in ((a, ops[0]), (b, ops[1])))
        stream = cupy.cuda.get_current_stream()
        extension.matmul(device, code, m, n, k, count, a.data.ptr, op_a, lda, stride_a, b.data.ptr, op_b, ldb,
                         stride_b, out.data.ptr, stream.ptr)
    return out


def _operand(cupy, x, op, batch, count):
    """(array, op, ld, batch stride) of ``x`` as a row-major operand of cuBLAS: as it lies where its
    layout allows (a transposed matrix, F-contiguous, is read with the op flag flipped), else a
    contiguous copy (other strides, or batch dimensions that broadcast over part of the batch)."""
    items = math.prod(x.shape[:-2])
    if items not in (1, count):
        x = cupy.ascontiguousarray(cupy.broadcast_to(x, batch + x.shape[-2:]))
        items = count
    layout = _layout(x, op)
    if layout is None:
        x = cupy.ascontiguousarray(x)
        layout = _layout(x, op)
    op, ld, stride = layout
    return x, op, ld, stride if items > 1 else 0


def _layout(x, op):
    """(op, ld, batch stride) in elements when ``x``'s matrices are row-major (rows ld apart) or
    column-major (then read transposed) with one stride between batch items; None otherwise."""
    size = x.itemsize
    r, c = x.shape[-2:]
    sr, sc = x.strides[-2:]
    stride = _batch_stride(x.shape[:-2], x.strides[:-2])
    if stride is None or stride % size or any(s % size for s in (sr, sc)):
        return None
    if (c == 1 or sc == size) and (r == 1 or sr >= c * size):
        return op, (sr // size if r > 1 else c), stride // size
    flipped = {_OP_N: _OP_T, _OP_T: _OP_N}.get(op)  # (a conjugate without transpose has no flag: copied)
    if flipped is not None and (r == 1 or sr == size) and (c == 1 or sc >= r * size):
        return flipped, (sc // size if c > 1 else r), stride // size
    return None


def _batch_stride(shape, strides):
    """The one stride between consecutive batch items (C order over the batch dimensions), None if
    there is none; 0 for a single item."""
    stride, expected = 0, None
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if expected is None:
            stride = expected = s
        elif s != expected:
            return None
        expected = s * n
    return stride if stride >= 0 else None
