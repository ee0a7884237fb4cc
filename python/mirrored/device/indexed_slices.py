"""``md.IndexedSlices``: a sparse slice of a dense array (``tf.IndexedSlices``), the gradient of a gather.

``values[i]`` is the slice of the dense array at row ``indices[i]``; rows not
named are zero and a row named twice holds the sum of its slices, as
``tf.convert_to_tensor`` densifies. Values may be NumPy or CuPy arrays; the
indices and the densified array live on the values' device. docs/sparse.md.
"""

from __future__ import annotations

import warnings

import numpy as np

from .._core import scatter_add_rows as _native_scatter_add_rows
from . import device_util, gpu as _gpu, scatter_gather as _scatter_gather
from .dtypes import CODES
from .python_values import dtype_name as _name, from_python
from .tensor_shape import TensorShape

__all__ = ["IndexedSlices", "convert_to_tensor", "is_indexed_slices", "map_arrays", "map_values", "scatter_add_rows",
           "to_dense"]


def _array_module(x):
    if device_util.on_gpu(x):
        import cupy

        return cupy
    return np


def _as_array(x, like, argument: str):
    """``x`` as an array on ``like``'s device (host for host values)."""
    if device_util.on_gpu(like):
        if device_util.on_gpu(x):
            return x
        import cupy

        with device_util.array_device(like):
            return cupy.asarray(device_util.to_host(x))
    if device_util.on_gpu(x):
        raise ValueError(f"{argument}: a GPU array beside host values; put values and {argument} on one device")
    return device_util.to_host(x)


class IndexedSlices:
    """``IndexedSlices(values, indices, dense_shape=None)``: ``tf.IndexedSlices``.

    ``indices`` is a 1-D integer array with one entry per row of ``values``;
    ``dense_shape`` (optional) the shape of the dense array they slice.
    """

    __slots__ = ("_values", "_indices", "_dense_shape")

    def __init__(self, values, indices, dense_shape=None):
        values = _read_value(values)
        if not device_util.on_gpu(values):
            values = device_util.to_host(values)
        indices = _as_array(indices, values, "indices")
        if np.ndim(values) == 0:
            raise ValueError(f"values: a scalar ({values!r}); IndexedSlices take values of rank >= 1, one row "
                             "per index, e.g. values[None] for one row")
        if np.dtype(indices.dtype).kind not in "iu":
            raise TypeError(f"indices: dtype {indices.dtype} is not an integer type; pass int32 or int64 row "
                            "indices (e.g. indices.astype(np.int64))")
        if indices.ndim != 1:
            raise ValueError(f"indices: shape {tuple(indices.shape)} is not 1-D; pass one row index per row of "
                             f"values (indices.ravel() for shape {tuple(values.shape)[:1]})")
        if indices.shape[0] != values.shape[0]:
            raise ValueError(f"indices: {indices.shape[0]} indices for {values.shape[0]} rows of values (shape "
                             f"{tuple(values.shape)}); pass one index per row of values")
        if dense_shape is not None:
            dense_shape = _dense_shape(dense_shape, values)
        self._values, self._indices, self._dense_shape = values, indices, dense_shape

    @property
    def values(self):
        """The slices: ``values[i]`` is row ``indices[i]`` of the dense array."""
        return self._values

    @property
    def indices(self):
        """The 1-D integer array of row indices (repeats allowed: their slices add up)."""
        return self._indices

    @property
    def dense_shape(self):
        """The dense array's shape as a 1-D integer NumPy array, or None if not given."""
        return self._dense_shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._values.dtype)

    @property
    def shape(self) -> TensorShape:
        """The dense shape as a ``TensorShape`` (unknown rank when ``dense_shape`` is None)."""
        if self._dense_shape is None:
            return TensorShape(None)
        return TensorShape([int(d) for d in self._dense_shape])

    @property
    def device(self) -> str:
        """The values' device, canonical (``/job:localhost/replica:0/task:0/device:CPU:0``)."""
        if device_util.on_gpu(self._values):
            return device_util.canonicalize(f"/gpu:{self._values.data.device_id}")
        return device_util.canonicalize("/cpu:0")

    def __neg__(self) -> "IndexedSlices":
        return IndexedSlices(-self._values, self._indices, self._dense_shape)

    def __array__(self, dtype=None, copy=None):
        dense = device_util.to_host(to_dense(self))
        return dense if dtype is None else dense.astype(dtype, copy=False)

    def __repr__(self) -> str:
        shape = "" if self._dense_shape is None else f", dense_shape={self._dense_shape!r}"
        return f"IndexedSlices(indices={self._indices!r}, values={self._values!r}{shape})"

    def _with(self, values=None, indices=None) -> "IndexedSlices":
        """The same slices with new values (or indices) of the right form, unchecked."""
        out = object.__new__(IndexedSlices)
        out._values = self._values if values is None else values
        out._indices = self._indices if indices is None else indices
        out._dense_shape = self._dense_shape
        return out


def _read_value(x):
    read = getattr(x, "read_value", None)
    return read() if callable(read) and not hasattr(x, "__array_interface__") else x


def _dense_shape(dense_shape, values) -> np.ndarray:
    host = device_util.to_host(dense_shape)
    if host.ndim != 1 or np.dtype(host.dtype).kind not in "iu":
        raise ValueError(f"dense_shape={dense_shape!r}: expected a 1-D sequence of ints, e.g. (rows, "
                         f"{', '.join(str(d) for d in values.shape[1:]) or '...'})")
    if len(host) != values.ndim or any(int(a) != b for a, b in zip(host[1:], values.shape[1:])) or \
            (len(host) and host[0] < 0):
        raise ValueError(f"dense_shape={tuple(int(d) for d in host)} does not fit values of shape "
                         f"{tuple(values.shape)}: a dense shape is (rows, *values.shape[1:])")
    return host if isinstance(dense_shape, np.ndarray) else host.astype(np.int64 if host.dtype.itemsize > 4
                                                                       else np.int32)


def map_arrays(fn, slices: IndexedSlices) -> IndexedSlices:
    """The slices with ``fn`` applied to their values and to their indices (to move or copy both)."""
    return slices._with(values=fn(slices.values), indices=fn(slices.indices))


def map_values(fn, x):
    """``fn(x)`` for an array; for IndexedSlices, the slices with ``fn`` applied to their values (an
    element-wise operation that keeps zero at zero applies to a sparse array's rows alone)."""
    return x._with(values=fn(x.values)) if type(x) is IndexedSlices else fn(x)


def is_indexed_slices(x) -> bool:
    return type(x) is IndexedSlices


def to_dense(slices: IndexedSlices):
    """The dense array (on the values' device): rows not named are zero, repeated rows add up.

    As TensorFlow's CPU kernel, a negative index is dropped and one past the
    rows raises; on a GPU (no host sync) every out-of-range index is dropped,
    as TensorFlow's GPU kernel does.
    """
    if slices.dense_shape is None:
        raise ValueError(f"slices: cannot densify {slices!r} without a dense_shape; give "
                         "IndexedSlices(values, indices, dense_shape=(rows, ...))")
    return scatter_add_rows(None, slices, tuple(int(d) for d in slices.dense_shape))


def scatter_add_rows(out, slices: IndexedSlices, shape=None, squares=None, overwrite: bool = False):
    """``out[indices[i]] += values[i]`` for every i in order (repeats add up), into ``out`` or a new zero array
    of ``shape``; returns it. With ``squares`` (an array like ``out``), ``squares[indices[i]] += values[i] ** 2``
    as well: the squares a rule takes for an IndexedSlices gradient (rules.SquaredGradient). ``overwrite``:
    ``out`` and ``squares`` start from zeros (their contents ignored). A repeated row adds its slices in
    ascending order, on host and on GPU alike, so every replica gets the same bits. No sort on the host, no
    wait for a GPU. Host: a negative index is dropped, one past the rows raises (before anything is
    written); GPU: both dropped."""
    values, indices = slices.values, slices.indices
    with device_util.array_device(values):
        if device_util.on_gpu(values):
            return _gpu_scatter_add(out, squares, values, indices, shape, overwrite)
        if out is None:
            out = np.zeros(shape, values.dtype)
        elif overwrite:
            _zero(out, squares)
        _host_scatter_add(out, squares, values, indices)
    return out


def _gpu_scatter_add(out, squares, values, indices, shape, overwrite: bool):
    """scatter_add_rows on a GPU: our kernel (csrc/cuda/scatter_rows.h), each row's slices added in ascending
    order (the host's bits), six launches, no wait, capturable. The dtypes the kernel lacks (and builds
    without the CUDA extension) take the variables' GPU scatter-add (scatter_gather.gpu_apply)."""
    import cupy

    overwrite = overwrite or (out is None and squares is None)  # (a new out alone: written whole, not zeroed)
    if out is None:
        out = (cupy.empty if overwrite else cupy.zeros)(shape, values.dtype)
    code = CODES.get(np.dtype(out.dtype).name)
    kernel = _scatter_kernel()
    if kernel is None or code is None:
        if overwrite:
            _zero(out, squares)
        keep = (indices >= 0) & (indices < out.shape[0])  # (no host sync: out-of-range rows add zeros to row 0)
        rows = cupy.where(keep, indices, 0)
        kept = cupy.where(keep.reshape((-1,) + (1,) * (values.ndim - 1)), values, cupy.zeros((), values.dtype))
        kept = kept.astype(out.dtype, copy=False)
        # The variables' GPU scatter-add: exact for every dtype, where CuPy's add.at refuses the 8/16-bit
        # integers, bool and complex.
        _scatter_gather.gpu_apply(out, "add", rows, kept)
        if squares is not None:
            _scatter_gather.gpu_apply(squares, "add", rows, kept * kept)
        return out
    for name, target in (("out", out), ("squares", squares)):
        if target is not None and not (target.flags.c_contiguous and target.dtype == out.dtype
                                       and target.shape == out.shape):
            raise ValueError(f"{name}: a {target.dtype} array of shape {tuple(target.shape)}; the GPU densify "
                             f"writes C-contiguous arrays of the dense shape {tuple(out.shape)} and dtype "
                             f"{out.dtype}")
    values = cupy.ascontiguousarray(values.astype(out.dtype, copy=False))
    wide = indices.dtype != np.int32
    if wide and indices.dtype != np.int64:
        indices = indices.astype(np.int64)
    indices = cupy.ascontiguousarray(indices)
    slices, rows = len(indices), out.shape[0]
    workspace = cupy.empty(kernel.scatter_rows_workspace_bytes(slices, rows), np.uint8)
    kernel.scatter_add_rows(out.data.device_id, code, values.data.ptr, indices.data.ptr, wide, slices,
                            out.size // rows if rows else 0, rows, out.data.ptr,
                            0 if squares is None else squares.data.ptr, not overwrite, workspace.data.ptr,
                            cupy.cuda.get_current_stream().ptr)
    return out


def _zero(*arrays) -> None:
    for a in arrays:
        if a is not None:
            a.fill(0)


def _scatter_kernel():
    """The CUDA engine's extension when it has the ordered densify, else None."""
    return _gpu.cuda_module_having("scatter_add_rows")


def _host_scatter_add(out, squares, values, indices) -> None:
    """scatter_add_rows on host arrays: the native loop (float32/float64, C-contiguous), else ufunc.at (the
    same order of additions)."""
    if len(indices) and indices.max() >= out.shape[0]:
        bad = int(np.argmax(indices >= out.shape[0]))
        raise IndexError(f"indices[{bad}] = {int(indices[bad])} is out of range [0, {out.shape[0]}) of the "
                         f"dense shape {tuple(out.shape)}; every index must name a row")
    native = (out.dtype in _NATIVE_DTYPES and values.dtype == out.dtype and out.flags.c_contiguous
              and (squares is None or squares.dtype == out.dtype and squares.flags.c_contiguous))
    if native:
        _native_scatter_add_rows(out, squares, np.ascontiguousarray(values),
                                 np.ascontiguousarray(indices, np.int64))
        return
    keep = indices >= 0
    if not keep.all():
        values, indices = values[keep], indices[keep]
    np.add.at(out, indices, values)
    if squares is not None:
        np.add.at(squares, indices, values * values)


_NATIVE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def convert_to_tensor(value, dtype=None, dtype_hint=None, name=None):
    """``tf.convert_to_tensor`` (``name`` is accepted and unused: arrays have no names).

    Tensors here are device (CuPy) arrays, variables and ``IndexedSlices`` (densified on their device): they keep
    their dtype, and another ``dtype`` raises ``ValueError`` as in TF (``dtype_hint`` is ignored). A NumPy array
    or scalar is TF's NumPy input: cast to ``dtype`` (else ``dtype_hint``) whatever the two dtypes, as TF casts
    it. Python values (numbers, strings, nested lists and tuples of them) convert by TF's rules: the dtype they
    infer (int32, int64 beyond its range, float32, bool, complex128, bytes) unless ``dtype`` is given, when
    only the conversions TF makes are made (``TypeError`` otherwise, e.g. a float to an int dtype);
    ``dtype_hint`` is used where that conversion exists, else the inferred dtype.
    """
    dtype, hint = _as_dtype(dtype, "dtype"), _as_dtype(dtype_hint, "dtype_hint")
    if is_indexed_slices(value) or device_util.on_gpu(value) or callable(getattr(value, "read_value", None)):
        if dtype is not None and dtype != np.dtype(value.dtype):
            fix = f"(dtype={_name(dtype)}: a tensor keeps its dtype; cast it with astype({_name(dtype)}) first)"
            if callable(getattr(value, "read_value", None)):
                raise ValueError(f"Incompatible type conversion requested to type {_name(dtype)} for md.Variable "
                                 f"of type {_name(value.dtype)}. {fix}")
            if is_indexed_slices(value):
                raise ValueError(f"Incompatible tensor conversion requested to `dtype` {_name(dtype)} for "
                                 f"IndexedSlices with dtype {_name(value.dtype)} {fix}")
            raise ValueError(f"Tensor conversion requested dtype {_name(dtype)} for Tensor with dtype "
                             f"{_name(value.dtype)}: a {type(value).__name__} {fix}")
        if is_indexed_slices(value):
            return to_dense(value)
        return value if device_util.on_gpu(value) else device_util.to_host(_read_value(value))
    if isinstance(value, (np.ndarray, np.generic)):
        return _cast_numpy(np.asarray(value), dtype or hint)
    return from_python(value, dtype, hint)


def _as_dtype(dtype, argument: str):
    if dtype is None:
        return None
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType
    if isinstance(dtype, str) and dtype == "string":
        return np.dtype("S")
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(f"Cannot convert the argument `type_value`: {dtype!r} to a TensorFlow DType. ({argument}: "
                        "pass a NumPy dtype or its name, e.g. 'float32')") from None


def _cast_numpy(array, dtype):
    """TF casts a NumPy input to any numeric dtype (NumPy's casts: floats truncate, ints wrap, a complex keeps
    its real part); to strings it refuses numbers."""
    if dtype is None or dtype == array.dtype:
        return array
    if dtype.kind == "S" and array.dtype.kind not in "SU":
        kind = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}.get(array.dtype.kind, "object")
        raise ValueError(f"Failed to convert a NumPy array to a Tensor (Unsupported object type {kind}). "
                         f"(dtype=string: a numeric array does not become strings; format them first)")
    with warnings.catch_warnings():
        # TF drops the imaginary part and overflows to inf too: NumPy's warnings of both are not errors here.
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        return array.astype(dtype)
