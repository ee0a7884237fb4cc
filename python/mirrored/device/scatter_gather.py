"""Indexed reads and in-place indexed updates of one array (NumPy or CuPy), as tf.Variable's ``sparse_read``,
``gather_nd``, ``scatter_*`` and ``scatter_nd_*`` do them, with TensorFlow's rules:

- indices are int32 or int64 (TF's index types); every index is checked against the shape on every device
  before anything is written (TF's CPU kernels raise; on a GPU that costs one wait for the check's result);
- ``scatter_nd_*`` indices have shape ``[..., K]`` (rank >= 2) and address the first ``K`` dimensions;
  updates have shape ``indices.shape[:-1] + shape[K:]`` exactly (no broadcasting). Rank-1 indices are refused:
  TF 2.21's variable kernels take ``[i0, i1, ...]`` with one update per entry and then apply the first only;
  its docs read them as one index of depth ``K`` (and ``tf.tensor_scatter_nd_*`` so);
- repeated indices apply in turn: additions add up, an update keeps the last value (TF's CPU order);
- max and min keep a NaN already held and ignore a NaN update (TF's ``a < b ? b : a``);
- bool arrays add by OR and subtract by XOR (C++'s ``bool`` arithmetic, which TF's kernels use), and have no
  max or min, nor do complex ones.

Updates are cast to the array's dtype as TF casts NumPy arrays (wrapping, truncating); Python numbers and
lists convert as ``tf.convert_to_tensor(x, dtype)`` does, which refuses floats for an integer dtype.
"""

from __future__ import annotations

import numpy as np

from . import device_util
from .dtypes import CODES

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
# An update's ufunc (on the host applied with ``ufunc.at``, which takes repeated indices in turn); None: assignment.
_UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "max": "maximum",
           "min": "minimum", "update": None}
_BOOL_UFUNCS = {"add": "bitwise_or", "sub": "bitwise_xor"}
_KIND_ORDER = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _module(x):
    if device_util.on_gpu(x):
        import cupy

        return cupy
    return np


def index_array(indices, like, argument: str = "indices"):
    """``indices`` as an int32/int64 array on ``like``'s device; TypeError for any other dtype."""
    if not device_util.on_gpu(like):
        indices = device_util.to_host(indices)
    elif not device_util.on_gpu(indices):
        with device_util.array_device(like):
            indices = _module(like).asarray(device_util.to_host(indices))
    if np.dtype(indices.dtype) not in INDEX_DTYPES:
        raise TypeError(f"{argument}: dtype {np.dtype(indices.dtype)} is not an index type; TensorFlow takes int32 "
                        f"or int64 indices (convert them, e.g. np.asarray({argument}, np.int64))")
    return indices


def _out_of_range(columns, bounds, last: bool = False):
    """The position (a tuple) of an index whose entry k is outside ``[0, bounds[k])``, else None: the first
    one, or the ``last`` (TF's gathers stop at the first; its scatter kernels run on and name the last)."""
    with device_util.array_device(columns):
        bad = _module(columns).zeros(columns.shape[:-1], bool)
        for k, bound in enumerate(bounds):
            bad |= (columns[..., k] < 0) | (columns[..., k] >= bound)
        if not bool(bad.any()):  # (on a GPU: the one wait for the check)
            return None
    return tuple(int(i) for i in np.argwhere(device_util.to_host(bad))[-1 if last else 0])


def _entry(pos) -> str:
    """``indices[i,j]`` as TF names an entry (``indices`` for a scalar)."""
    return f"indices[{','.join(map(str, pos))}]" if pos else "indices"


def _check_rows(indices, rows: int, argument: str, name: str) -> None:
    """Every entry of ``indices`` in ``[0, rows)`` (TF's words on failure)."""
    pos = _out_of_range(indices[..., None], (rows,))
    if pos is not None:
        raise IndexError(f"{argument}: {_entry(pos)} = {int(device_util.to_host(indices[pos]))} is not in "
                         f"[0, {rows}), the rows of variable '{name}'")


def gather(value, indices, name: str):
    """``tf.gather(value, indices)`` (``Variable.sparse_read``): the rows of ``value`` at ``indices``, a copy."""
    indices = index_array(indices, value)
    if value.ndim == 0:
        raise ValueError(f"sparse_read: variable '{name}' is a scalar; it has no rows to read (read_value())")
    _check_rows(indices, value.shape[0], "indices", name)
    return value[indices]


def gather_nd(value, indices, name: str):
    """``tf.gather_nd(value, indices)``: entry ``indices[i]`` (``K`` numbers) addresses the first ``K``
    dimensions; the result has shape ``indices.shape[:-1] + value.shape[K:]``, a copy."""
    indices = index_array(indices, value)
    if indices.ndim == 0:
        raise ValueError(f"indices: a scalar ({int(device_util.to_host(indices))}); gather_nd takes indices of "
                         "rank >= 1 (TF: indices must be at least a vector), e.g. [i] for row i")
    depth, shape = indices.shape[-1], tuple(value.shape)
    if depth > len(shape):
        raise ValueError(f"indices: the last dimension of indices (shape {tuple(indices.shape)}) is {depth}, more "
                         f"than the rank {len(shape)} of variable '{name}' of shape {shape}; an index addresses at "
                         "most every dimension")
    pos = _out_of_range(indices, shape[:depth])
    if pos is not None:
        raise IndexError(f"indices: {_entry(pos)} = {device_util.to_host(indices[pos]).tolist()} does "
                         f"not index into shape {list(shape)} (variable '{name}')")
    if depth == 0:  # every index addresses the whole value
        return _module(value).broadcast_to(value, indices.shape[:-1] + shape).copy()
    return value[tuple(indices[..., k] for k in range(depth))]


def _operand(updates, like, argument: str):
    """``updates`` on ``like``'s device, cast to its dtype (see the module's doc)."""
    dtype = np.dtype(like.dtype)
    python = isinstance(updates, (list, tuple, int, float, complex))
    if hasattr(updates, "read_value"):  # a variable: its value
        updates = updates.read_value()
    if device_util.on_gpu(like):
        with device_util.array_device(like):
            array = _module(like).asarray(updates if device_util.on_gpu(updates) else device_util.to_host(updates))
    else:
        array = device_util.to_host(updates)
    if python and _KIND_ORDER.get(array.dtype.kind, 9) > _KIND_ORDER.get(dtype.kind, 9):
        raise TypeError(f"{argument}: cannot convert {updates!r} to {dtype} (TensorFlow refuses Python "
                        f"{ {'b': 'bool', 'c': 'complex'}.get(array.dtype.kind, 'float')} values for a variable of "
                        f"dtype {dtype}); pass values of the variable's kind, or an array (arrays are cast as TF "
                        "casts NumPy arrays)")
    with np.errstate(all="ignore"):  # (NumPy's cast of an overflowing value warns; TF's does not)
        return array.astype(dtype, copy=False)


def _check_kernel(method: str, op: str, dtype) -> None:
    """TypeError for an update TF has no kernel for: max and min of bool or complex values."""
    dtype = np.dtype(dtype)
    if op in ("max", "min") and dtype.kind in "bc":
        raise TypeError(f"{method}: a variable of dtype {dtype} has no {method} (TensorFlow has no such kernel); "
                        f"{'cast it to a number type' if dtype.kind == 'b' else 'compare real parts'} first")


def scatter_nd_plan(value, method: str, op: str, indices, updates, name: str, arguments=("indices", "updates")):
    """``(rows, slices)`` for :func:`apply`: indices checked and made row numbers of ``value`` seen as
    ``(-1,) + shape[K:]``, updates checked and cast (``arguments``: their names in errors). Raises before
    anything is written."""
    indices_argument, updates_argument = arguments
    shape = tuple(value.shape)
    if not shape:
        raise ValueError(f"{method}: variable '{name}' is a scalar; scatter_nd_* updates entries of a variable of "
                         "rank >= 1 (TF: Output must be at least 1-D); use assign / assign_add")
    _check_kernel(method, op, value.dtype)
    indices = index_array(indices, value, indices_argument)
    if indices.ndim == 0:
        raise ValueError(f"{indices_argument}: a scalar ({int(device_util.to_host(indices))}); {method} takes "
                         "indices of shape [..., K], e.g. [[i]] for row i")
    given = tuple(indices.shape)
    if indices.ndim == 1:
        raise ValueError(f"{indices_argument}: shape {given} is rank 1, which TensorFlow 2.21's {method} reads as "
                         f"{given[0]} indices and then applies the first only; pass shape ({given[0]}, 1) for "
                         f"{given[0]} rows (np.asarray(indices)[:, None]), or [[i0, ..., iK-1]] for one index")
    depth = indices.shape[-1]
    if not 1 <= depth <= len(shape):
        raise ValueError(f"{indices_argument}: the last dimension of indices (shape {given}) is {depth}; {method} "
                         f"needs it in [1, {len(shape)}] for variable '{name}' of shape {shape} (each index "
                         "addresses its first K dimensions)")
    slices = _operand(updates, value, updates_argument)
    expected = indices.shape[:-1] + shape[depth:]
    if tuple(slices.shape) != expected:
        raise ValueError(f"{updates_argument}: shape {tuple(slices.shape)} does not fit indices of shape {given} "
                         f"into variable '{name}' of shape {shape}: expected {expected} (indices.shape[:-1] + "
                         "shape[K:], no broadcasting)")
    pos = _out_of_range(indices, shape[:depth], last=True)
    if pos is not None:
        raise IndexError(f"{indices_argument}: {_entry(pos)} = {device_util.to_host(indices[pos]).tolist()} does "
                         f"not index into shape {list(shape)} (variable '{name}')")
    rows = indices[..., 0].astype(np.int64)
    for k in range(1, depth):  # row-major: the row number of entry (i0, ..., iK-1) among shape[:K]
        rows = rows * shape[k] + indices[..., k]
    return rows.reshape(-1), slices.reshape((-1,) + shape[depth:])


def batch_plan(value, indices, slices, name: str):
    """:func:`scatter_nd_plan` for ``batch_scatter_update``: indices of shape ``[d0, ..., dn]`` update along
    dimension ``n``, so entry ``(i0, ..., in)`` addresses ``(i0, ..., in-1, indices[i0, ..., in])``."""
    indices = index_array(indices, value, "sparse_delta.indices")
    xp = _module(indices)
    with device_util.array_device(indices):
        leading = [xp.broadcast_to(xp.arange(size, dtype=indices.dtype).reshape(
            [size if j == k else 1 for j in range(indices.ndim)]), indices.shape)
            for k, size in enumerate(indices.shape[:-1])]
        positions = xp.stack(leading + [indices], axis=-1)
    return scatter_nd_plan(value, "batch_scatter_update", "update", positions, slices, name,
                           ("sparse_delta.indices", "sparse_delta.values"))


def row_plan(value, method: str, op: str, indices, slices, name: str):
    """:func:`scatter_nd_plan` for the row scatters (``scatter_add(IndexedSlices)``): 1-D indices of rows."""
    _check_kernel(method, op, value.dtype)
    indices = index_array(indices, value, "sparse_delta.indices")
    _check_rows(indices, value.shape[0], "sparse_delta", name)
    return indices, _operand(slices, value, "sparse_delta.values")


def apply(buffer, op: str, rows, slices) -> None:
    """``buffer`` (C-contiguous) seen as ``(-1,) + slices.shape[1:]`` updated in place: row ``rows[i]``
    combined with ``slices[i]`` by ``op`` (see ``_UFUNCS``), repeated rows in turn."""
    if device_util.on_gpu(buffer):
        with device_util.array_device(buffer), np.errstate(all="ignore"):
            gpu_apply(buffer, op, rows, slices)
        return
    flat = buffer.reshape((-1,) + tuple(slices.shape[1:]))
    ufunc = _BOOL_UFUNCS.get(op, _UFUNCS[op]) if buffer.dtype.kind == "b" else _UFUNCS[op]
    if op in ("max", "min") and buffer.dtype.kind == "f":
        slices = slices.copy()  # a NaN update changes nothing: the identity in its place
        slices[np.isnan(slices)] = -np.inf if op == "max" else np.inf
    with np.errstate(all="ignore"):
        if ufunc is None:
            flat[rows] = slices
        elif op == "div" and buffer.dtype.kind in "iu":
            _host_divide_in_turn(flat, np.asarray(rows, np.int64).reshape(-1), slices)
        else:
            getattr(np, ufunc).at(flat, rows, slices)


def truncating_divide(xp, a, b):
    """``a / b`` of integers as TF's integer division gives it (C's: rounded toward zero), exact at every
    magnitude (a float64 quotient is not above 2**53); a zero divisor gives 0."""
    q = xp.floor_divide(a, b)
    if np.dtype(a.dtype).kind == "u":
        return q
    inexact = (a - q * b != 0) & ((a < 0) != (b < 0)) & (b != 0)
    return q + inexact.astype(q.dtype)


def _host_divide_in_turn(flat, rows, slices) -> None:
    """Integer scatter_div: each row divided by its slices in turn (a repeated row once per round)."""
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    starts = np.searchsorted(sorted_rows, sorted_rows)  # per sorted slice: where its row's run begins
    occurrence = np.empty_like(order)
    occurrence[order] = np.arange(len(rows)) - starts  # per slice: how many earlier slices name its row
    for k in range(int(occurrence.max(initial=-1)) + 1):
        now = occurrence == k
        flat[rows[now]] = truncating_divide(np, flat[rows[now]], slices[now]).astype(flat.dtype)


# --- on a GPU --------------------------------------------------------------------------------------------------
# CuPy's ufunc.at is no base here: it refuses most dtypes (add.at: no int8/int16/uint8/uint16/bool/complex;
# subtract.at: int32/uint32 only; maximum.at/minimum.at: no 8/16-bit types; multiply.at/true_divide.at: none),
# its float max/min drop a NaN held (fmax), and a plain ``a[rows] = v`` keeps any one of a repeated row's values.
# So every op is built from what CuPy does exactly for every dtype: rows grouped by a sort, ufunc.at only on
# uint64 (order-free: modular sums, maxima of order-preserving keys, first/last positions), and every repeated
# row written the same value by all its slices (so whichever write lands, the result is the same).

_SIGN = np.uint64(1 << 63)
_ALL_ONES = np.uint64((1 << 64) - 1)


def gpu_apply(buffer, op: str, rows, slices) -> None:
    """``buffer[rows[i]] op= slices[i]`` on a GPU for every i in turn, TF's result for every dtype (rows in
    range; ``buffer`` C-contiguous)."""
    import cupy

    n, width = len(rows), int(np.prod(slices.shape[1:], dtype=np.int64))
    if n == 0 or width == 0:
        return
    flat = buffer.reshape(buffer.size // width, width)
    slices = cupy.ascontiguousarray(slices.reshape(n, width))
    rows = cupy.ascontiguousarray(rows, dtype=np.int64)
    group = cupy.searchsorted(cupy.sort(rows), rows)  # per slice: an id in [0, n) its row's slices share
    kind = flat.dtype.kind
    if op == "update":  # the last slice naming a row
        flat[rows] = slices[_position(cupy.maximum, group, cupy.arange(n, dtype=np.uint64), 0)]
    elif op in ("max", "min"):
        _gpu_extremum(flat, op, rows, slices, group)
    elif op in ("add", "sub") and kind in "biu":
        _gpu_integer_sum(flat, op, rows, slices, group)
    elif op in ("add", "sub"):
        _gpu_float_sum(flat, op, rows, slices)
    else:  # mul, div
        if op == "div" and kind in "iu":
            combine = lambda old, value: truncating_divide(cupy, old, value).astype(flat.dtype)  # noqa: E731
        else:
            ufunc = getattr(cupy, _UFUNCS[op])
            combine = lambda old, value: ufunc(old, value).astype(flat.dtype)  # noqa: E731
        _gpu_in_turn(flat, rows, slices, group, combine)


def _position(at, group, positions, identity):
    """Per slice: ``at`` (cupy.maximum or cupy.minimum) of ``positions`` (uint64, ``identity`` where a slice
    takes no part) over its row's slices, as int64 (an ``n``-long workspace: no array of the variable's size)."""
    import cupy

    chosen = cupy.full(positions.shape, identity, np.uint64)
    at.at(chosen, group, positions)
    return chosen[group].astype(np.int64)


def _order_key(values, op: str):
    """uint64 keys ordered as ``values`` (exact for every real dtype); a float NaN gets the identity of ``op``
    (TF's max and min ignore a NaN update) and -0.0 the key of 0.0 (equal values: the first one wins)."""
    import cupy

    kind = values.dtype.kind
    if kind in "bu":
        return values.astype(np.uint64)
    if kind == "i":
        return values.astype(np.int64).view(np.uint64) ^ _SIGN
    x = values.astype(np.float64) + 0.0  # exact; -0.0 + 0.0 is 0.0
    bits = x.view(np.uint64)
    key = cupy.where(bits >= _SIGN, ~bits, bits | _SIGN)
    return cupy.where(cupy.isnan(x), np.uint64(0) if op == "max" else _ALL_ONES, key)


def _gpu_extremum(flat, op: str, rows, slices, group) -> None:
    """TF's ``old < u ? u : old`` (max) applied in turn: the result is the first update holding the row's
    maximum when that exceeds the value held, else the value held (a NaN held stays, a NaN update is ignored)."""
    import cupy

    n = len(rows)  # (no complex values: the plans refused them, _check_kernel)
    at = cupy.maximum if op == "max" else cupy.minimum
    key = _order_key(slices, op)
    best = cupy.full(key.shape, 0 if op == "max" else _ALL_ONES, np.uint64)
    at.at(best, group, key)
    positions = cupy.broadcast_to(cupy.arange(n, dtype=np.uint64)[:, None], key.shape)
    first = _position(cupy.minimum, group, cupy.where(key == best[group], positions, np.uint64(n)), n)
    winner = cupy.take_along_axis(slices, first, axis=0)
    old = flat[rows]
    flat[rows] = cupy.where(old < winner if op == "max" else old > winner, winner, old)


def _gpu_integer_sum(flat, op: str, rows, slices, group) -> None:
    """Integer and bool add/sub: each row's updates summed modulo 2**64 (exact in any order), then added to the
    value held and cast back (wrapping, as in turn); bool: OR (add) and XOR (sub), C++'s bool arithmetic."""
    import cupy

    wide = slices.astype(np.uint64)
    if op == "sub" and flat.dtype.kind != "b":
        wide = cupy.negative(wide)  # (modular: a - b == a + (2**64 - b))
    total = cupy.zeros(wide.shape, np.uint64)
    cupy.add.at(total, group, wide)
    total, old = total[group], flat[rows]
    if flat.dtype.kind != "b":
        flat[rows] = (old.astype(np.uint64) + total).astype(flat.dtype)
    elif op == "add":
        flat[rows] = old | (total != 0)
    else:
        flat[rows] = old ^ ((total & np.uint64(1)) != 0)


def _gpu_float_sum(flat, op: str, rows, slices) -> None:
    """Float and complex add/sub (a complex value as its two float parts; ``a - b`` is exactly ``a + -b``):
    mirrored's ordered scatter kernel adds each row's updates in turn, TF's CPU order (every replica the same
    bits); without the CUDA extension (or for a dtype it lacks) CuPy's add.at, whose atomics add in any order."""
    import cupy

    from .gpu import cuda_module_having

    if flat.dtype.kind == "c":
        part = np.float32 if flat.dtype == np.complex64 else np.float64
        flat, slices = flat.view(part), slices.view(part)
    values = cupy.ascontiguousarray(-slices if op == "sub" else slices)
    kernel, code = cuda_module_having("scatter_add_rows"), CODES.get(np.dtype(flat.dtype).name)
    if kernel is None or code is None:
        cupy.add.at(flat, rows, values)
        return
    n, (count, width) = len(rows), flat.shape
    workspace = cupy.empty(kernel.scatter_rows_workspace_bytes(n, count), np.uint8)
    kernel.scatter_add_rows(flat.data.device_id, code, values.data.ptr, rows.data.ptr, True, n, width, count,
                            flat.data.ptr, 0, True, workspace.data.ptr, cupy.cuda.get_current_stream().ptr)


def _gpu_in_turn(flat, rows, slices, group, combine) -> None:
    """``flat[rows[i]] = combine(flat[rows[i]], slices[i])`` for every i in turn (mul and div, whose float
    results depend on the order): one round per slice of the most repeated row, each round applying every
    row's next slice at once (one wait, for the number of rounds)."""
    import cupy

    n = len(rows)
    counts = cupy.zeros(n, np.uint64)
    cupy.add.at(counts, group, cupy.ones(n, np.uint64))
    positions = cupy.arange(n, dtype=np.uint64)
    pending = cupy.ones(n, bool)
    for _ in range(int(counts.max())):
        turn = _position(cupy.minimum, group, cupy.where(pending, positions, np.uint64(n)), n)
        now = (turn < n)[:, None]
        old = flat[rows]
        flat[rows] = cupy.where(now, combine(old, slices[cupy.minimum(turn, n - 1)]), old)
        pending &= positions != turn.astype(np.uint64)
