"""Python values as TensorFlow converts them to tensors: the dtype numbers, strings and nested lists of them
infer (int32, int64 beyond it, float32, bool, complex128, bytes), the conversions to a requested dtype TF makes
and refuses, and TF's errors for mixed and ragged values. The one place every layer converts Python values
(``md.convert_to_tensor``, arrays handed to collectives and variables, matmul operands, losses)."""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import _tf_dtype_name


def dtype_name(dtype) -> str:
    """TF's name of a NumPy dtype (bytes are TF's string)."""
    dtype = np.dtype(dtype)
    return "string" if dtype.kind == "S" else dtype.name


_name = dtype_name

# The dtypes TF converts a Python value of each kind to (bool, int, float, complex, bytes).
_NUMBERS = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
            "uint64", "complex64", "complex128")
_PYTHON_TARGETS = {
    "b": {"bool", "float16", "float32", "float64", "int32", "int64", "uint64", "complex128"},
    "i": set(_NUMBERS), "f": {"float16", "float32", "float64", "complex64", "complex128"},
    "c": {"complex64", "complex128"}, "S": {"string"}}


def from_python(value, dtype=None, hint=None):
    """Python values (numbers, strings, nested lists and tuples of them) as ``tf.convert_to_tensor`` converts
    them, to ``dtype`` (a NumPy dtype) if given. A ``hint`` is tried as the dtype, and dropped where that fails
    (TF's ``preferred_dtype``)."""
    leaves = []
    _python_leaves(value, value, leaves)
    if not leaves:  # an empty list: float32 unless told
        return np.array(value).astype(dtype or hint or np.float32)
    if dtype is None and hint is not None:
        try:
            return _convert_python(value, leaves, hint)
        except (TypeError, ValueError):
            pass
    return _convert_python(value, leaves, dtype)


def _convert_python(value, leaves, dtype):
    """TF's two ways: straight to ``dtype`` when every leaf converts to it on its own (ints in its range),
    else to the dtype the leaves infer (the first leaf's kind, widened by later ones), then cast to
    ``dtype`` where TF casts that kind."""
    kinds = {_kind(x) for x in leaves}
    if dtype is not None and _converts_straight(leaves, kinds, dtype):
        top = next(kind for kind in "Scfib" if kind in kinds)
        return _cast(_python_array(value, top), dtype)
    kind = _inferred_kind(value, leaves)
    array = _python_array(value, kind)
    if kind == "i" and array.dtype == object:
        fix = f"dtype={_name(dtype)}: the value does not fit in 64 bits; pass a float dtype" if dtype is not None \
            else f"{value!r:.80} does not fit in 64 bits; pass dtype=float64"
        raise ValueError(f"Can't convert Python sequence with out-of-range integer to Tensor. ({fix})")
    if dtype is None:
        return _default(array, kind)
    if _name(dtype) not in _PYTHON_TARGETS[kind]:
        tf_name = _tf_dtype_name(_name(dtype))
        raise TypeError(f"Cannot convert {value!r:.80} to EagerTensor of dtype {tf_name} (dtype={_name(dtype)}: "
                        f"convert it to a NumPy array of its own dtype first, e.g. np.asarray(value), to cast it)")
    return _cast(array, dtype)


def _kind(leaf) -> str:
    return "b" if isinstance(leaf, bool) else "i" if isinstance(leaf, int) else "f" if isinstance(leaf, float) \
        else "c" if isinstance(leaf, complex) else "S"


def _converts_straight(leaves, kinds, dtype) -> bool:
    """Whether each leaf converts to ``dtype`` by itself: its kind does, and an int fits an integer dtype.
    TF has no such way to complex64: values reach it only by the cast of what they infer."""
    name = _name(dtype)
    if name == "complex64" or any(name not in _PYTHON_TARGETS[kind] for kind in kinds):
        return False
    if "i" not in kinds or dtype.kind not in "iu":
        return True
    info = np.iinfo(dtype)
    return all(info.min <= x <= info.max for x in leaves if type(x) is int)


def _inferred_kind(value, leaves) -> str:
    """The first leaf's kind, widened as TF widens it: ints by floats, and complex numbers take any number;
    a bool first takes only bools, and strings only strings (else TF's mixed-types error)."""
    kind = _kind(leaves[0])
    for leaf in leaves[1:]:
        other = _kind(leaf)
        if other == kind or kind == "c" and other != "S" or kind == "f" and other in "bi" or kind == "i" and other == "b":
            continue
        if kind == "i" and other == "f":
            kind = "f"
            continue
        raise ValueError(f"Can't convert Python sequence with mixed types to Tensor. ({value!r:.80}: give "
                         "every element one type, e.g. all numbers)")
    return kind


def _python_array(value, kind):
    try:
        return np.array(_utf8(value) if kind == "S" else value, dtype=np.complex128 if kind == "c" else None)
    except ValueError as e:
        if "inhomogeneous" not in str(e):
            raise
        raise _non_rectangular(value) from None


def _non_rectangular(value):
    return ValueError(f"Can't convert non-rectangular Python sequence to Tensor. ({value!r:.80}: give every row "
                      "the same length, or pad them)")


def _python_leaves(value, whole, out) -> None:
    """The leaves in order, with TF's errors for a ragged nesting: a number first and a list later is mixed types,
    a list first and a number later (or lists of other lengths) non-rectangular."""
    if isinstance(value, (list, tuple)):
        first = None
        for v in value:
            nested = isinstance(v, (list, tuple))
            if first is None:
                first = (nested, len(v) if nested else 0)
            elif nested != first[0]:
                if nested:
                    raise ValueError(f"Can't convert Python sequence with mixed types to Tensor. ({whole!r:.80}: "
                                     "a number and a list side by side; nest every element alike)")
                raise _non_rectangular(whole)
            elif nested and len(v) != first[1]:
                raise _non_rectangular(whole)
            _python_leaves(v, whole, out)
    elif isinstance(value, (bool, int, float, complex, str, bytes)):
        out.append(value)
    else:
        raise ValueError(f"Attempt to convert a value ({whole!r}) with an unsupported type ({type(whole)}) to a "
                         "Tensor. (pass a NumPy or CuPy array, a number, a string, or nested lists of them)")


def _cast(array, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (an int too large for float16 becomes inf, as in TF)
        return array.astype(dtype)


def _utf8(value):
    """Strings as UTF-8 bytes (tf.string holds bytes), in the value's nesting."""
    if isinstance(value, (list, tuple)):
        return [_utf8(v) for v in value]
    return value.encode("utf-8") if isinstance(value, str) else value


def _default(array, kind):
    """TF's dtype of Python values: int32 (int64 beyond it), float32, bool, complex128, bytes."""
    if kind == "f":
        return array.astype(np.float32)
    if kind == "i":
        fits = array.size == 0 or (array.min() >= np.iinfo(np.int32).min and array.max() <= np.iinfo(np.int32).max)
        return array.astype(np.int32 if fits else np.int64)
    return array
