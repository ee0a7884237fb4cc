"""Elements of a dataset: nested tuples/dicts of arrays, their specs, and how they are stored in a checkpoint.

tf.data's structure rules: tuples, namedtuples and dicts are structures;
a list is one tensor (stacked) where it is an input, and a tuple where a
``map`` function returns it. Python numbers convert as ``tf.constant`` does
(int32, int64 when they do not fit, float32), strings to bytes.
"""

from __future__ import annotations

import json
import sys
from collections import abc

import numpy as np

from .._nest import flatten, map_structure
from ..device import device_util
from ..device.tensor_shape import TensorShape


class TensorSpec:
    """Shape and dtype of one element leaf (``tf.TensorSpec``). ``shape`` is an ``md.TensorShape`` (``None`` for
    a dimension that varies; ``TensorShape(None)``, unknown rank, when even the rank varies)."""

    def __init__(self, shape, dtype=np.float32, name=None):
        self.shape = TensorShape(shape)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind in "SUO":
            self.dtype = np.dtype("S")  # a string tensor: bytes of any length (tf.string; see string_array)
        self.name = name

    @classmethod
    def from_tensor(cls, tensor, name=None) -> "TensorSpec":
        """The spec of an array (or number, string) as tf.data would hold it."""
        leaf = to_leaf(tensor, "tensor")
        return cls(tuple(leaf.shape), leaf.dtype, name)

    @classmethod
    def from_spec(cls, spec, name=None) -> "TensorSpec":
        return cls(spec.shape, spec.dtype, spec.name if name is None else name)

    def __eq__(self, other):
        return isinstance(other, TensorSpec) and (self.shape, self.dtype) == (other.shape, other.dtype)

    def __hash__(self):
        return hash((self.shape, self.dtype))

    def is_compatible_with(self, other) -> bool:
        """Same dtype, and shapes that could agree (``None`` matches anything; an unknown rank, any shape)."""
        if isinstance(other, TensorSpec):
            other_shape, other_dtype = other.shape, other.dtype
        else:
            leaf = to_leaf(other, "spec_or_value")
            other_shape, other_dtype = tuple(np.shape(leaf)), TensorSpec((), leaf.dtype).dtype
        return self.dtype == other_dtype and self.shape.is_compatible_with(other_shape)

    def is_subtype_of(self, other) -> bool:
        """Whether every value of this spec fits ``other`` (same dtype; ``other`` as general or more)."""
        if not isinstance(other, TensorSpec) or self.dtype != other.dtype:
            return False
        if other.shape.rank is None:
            return True
        return self.shape.rank == other.shape.rank and all(b is None or a == b
                                                           for a, b in zip(self.shape, other.shape))

    def most_specific_common_supertype(self, others):
        """The most specific spec every one of ``[self] + others`` fits; None when the dtypes differ."""
        spec = self
        for other in others:
            if not isinstance(other, TensorSpec) or other.dtype != self.dtype:
                return None
            spec = spec.most_specific_compatible(other)
        return spec

    def most_specific_compatible(self, other: "TensorSpec") -> "TensorSpec":
        """The spec both fit: dimensions that differ become ``None``, and the shape when the ranks differ
        (the dtypes must agree)."""
        if self.shape.rank is None or other.shape.rank is None or self.shape.rank != other.shape.rank:
            return TensorSpec(None, self.dtype)
        return TensorSpec([a if a == b else None for a, b in zip(self.shape, other.shape)], self.dtype)

    def most_specific_compatible_type(self, other: "TensorSpec") -> "TensorSpec":
        """TF's (deprecated) name of :meth:`most_specific_compatible`; ``ValueError`` for another dtype."""
        if not isinstance(other, TensorSpec) or other.dtype != self.dtype:
            raise ValueError(f"No TypeSpec is compatible with both {self} and {other}")
        return self.most_specific_compatible(other)

    def __repr__(self) -> str:
        dtype = "string" if self.dtype.kind == "S" else self.dtype.name
        return f"TensorSpec(shape={self.shape}, dtype={dtype}, name={self.name!r})"


class DatasetSpec:
    """The spec of a component that is itself a dataset (``window``'s elements): its ``element_spec``."""

    def __init__(self, element_spec):
        self.element_spec = element_spec

    def __eq__(self, other):
        return isinstance(other, DatasetSpec) and self.element_spec == other.element_spec

    def __hash__(self):
        return hash(repr(self.element_spec))

    def __repr__(self) -> str:
        return f"DatasetSpec({self.element_spec!r}, TensorShape([]))"


def _is_gpu_array(x) -> bool:
    return device_util.on_gpu(x)


def array_module(x):
    """NumPy for host leaves, CuPy (or the array's own module) for device leaves."""
    if _is_gpu_array(x):
        return sys.modules[type(x).__module__.split(".")[0]]
    return np


def string_array(items, shape) -> np.ndarray:
    """A string tensor of rank 1 or more: an object array of ``bytes``, as TF's ``.numpy()`` gives one. Not a
    NumPy ``S`` array: that pads with NUL bytes and so drops a string's trailing ones (``b"a\\0"`` would come
    back as ``b"a"``), which binary records (a TFRecord's serialized protos) do end with. A scalar string is a
    ``np.bytes_``, which keeps them."""
    out = np.empty(len(items), object)
    out[:] = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in items]
    return out.reshape(shape)


def is_string(x) -> bool:
    """Whether a leaf (``np.bytes_`` scalar or object array, see string_array) is a string tensor."""
    return x.dtype.kind in "SO"


def row(leaf, index):
    """``leaf[index]``, a string scalar kept a ``np.bytes_`` (an object array's item is a plain ``bytes``)."""
    item = leaf[index]
    return np.bytes_(item) if type(item) is bytes else item


def to_leaf(value, argument: str):
    """One leaf as an array (NumPy, or a device array kept where it is), TF's conversion rules."""
    if isinstance(value, (np.str_, np.ndarray)) and np.asarray(value).dtype.kind == "U":
        return _unicode_to_bytes(value)  # tf.string holds bytes (UTF-8)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        item = value[()]  # a rank-0 tensor is a NumPy scalar in as_numpy_iterator, as a Python number is
        if value.dtype.kind == "O" and isinstance(item, (bytes, str)):
            return np.bytes_(item.encode("utf-8") if isinstance(item, str) else item)
        return item
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO":
        items = value.reshape(-1).tolist()
        if value.dtype.kind == "S" or (items and all(isinstance(v, (bytes, str)) for v in items)):
            return string_array(items, value.shape)  # (an object array of anything else stays as it is)
        return value
    if isinstance(value, (np.ndarray, np.generic)) or _is_gpu_array(value):
        return value
    if isinstance(value, str):
        return np.bytes_(value.encode("utf-8"))
    if isinstance(value, bytes):
        return np.bytes_(value)
    if isinstance(value, (list, bool, int, float, complex)) or hasattr(value, "__array_interface__") \
            or hasattr(value, "__array__") or hasattr(value, "__dlpack__"):
        if isinstance(value, list) and _all_strings(value):
            return string_array(_flat_strings(value), np.shape(value))
        if isinstance(value, list) and any(isinstance(v, (np.ndarray, np.generic)) for v in _flat_strings(value)):
            return np.asarray(value)  # a list of arrays keeps their dtype (tf.stack), Python numbers convert as TF
        if isinstance(value, list) and _ragged(value):
            raise ValueError(f"{argument}: Can't convert non-rectangular Python sequence to Tensor ({value!r:.80}); "
                             "give every row the same length, or pad them")
        try:
            leaf = device_util.to_host(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{argument}: {e}") from None
        # A Python number is a NumPy scalar (as tf.data's elements are in as_numpy_iterator), not a 0-d array.
        return leaf[()] if isinstance(leaf, np.ndarray) and leaf.ndim == 0 else leaf
    raise TypeError(f"{argument}: a value of type {type(value).__name__} ({value!r:.80}) is not a tensor; use "
                    "NumPy/CuPy arrays, Python numbers, strings or bytes, nested in tuples or dicts")


def numpy_value(x):
    """A leaf as ``as_numpy_iterator`` gives it: device arrays copied to the host, a scalar string as bytes."""
    if _is_gpu_array(x):
        return device_util.to_host(x)
    return bytes(x) if isinstance(x, np.bytes_) else x


def _unicode_to_bytes(value):
    if isinstance(value, np.generic) or value.ndim == 0:
        return np.bytes_(str(value[()] if isinstance(value, np.ndarray) else value).encode("utf-8"))
    return string_array(value.reshape(-1).tolist(), value.shape)


def _ragged(value) -> bool:
    """A nested list whose rows differ in length (or in nesting)."""
    rows = [v for v in value if isinstance(v, (list, tuple))]
    if not rows:
        return False
    if len(rows) != len(value) or len({len(r) for r in rows}) != 1:
        return True
    return any(_ragged(list(r)) for r in rows)


def _all_strings(value) -> bool:
    flat = _flat_strings(value)
    return bool(flat) and all(isinstance(v, (str, bytes)) for v in flat)


def _flat_strings(value) -> list:
    return [x for v in value for x in _flat_strings(v)] if isinstance(value, list) else [value]


def map_container(fn, container):
    """A mapping or tuple with ``fn`` applied to each item, rebuilt as its type (a namedtuple stays one)."""
    if isinstance(container, abc.Mapping):
        return type(container)((k, fn(v)) for k, v in container.items())
    items = [fn(v) for v in container]
    return type(container)(*items) if hasattr(container, "_fields") else tuple(items)


def normalize_input(value, argument: str):
    """An input structure (``from_tensor_slices``/``from_tensors``/``output_signature``): lists are tensors."""
    if isinstance(value, (abc.Mapping, tuple)):
        return map_container(lambda v: normalize_input(v, argument), value)
    return to_leaf(value, argument)


def normalize_output(value, argument: str):
    """A ``map``/generator result: lists are tuples (tf.data's rule for function results)."""
    if value is None:
        raise TypeError(f"{argument} returned None; return an array, a number, or a tuple/dict of them")
    if isinstance(value, list):  # only at the top: a list inside a tuple or dict is one tensor (stacked)
        value = tuple(value)
    if isinstance(value, (abc.Mapping, tuple)) and not flatten(value):
        raise ValueError(f"{argument} returned an empty structure ({value!r}); return at least one array or number")
    if isinstance(value, (abc.Mapping, tuple)):
        return map_container(lambda v: normalize_input(v, argument) if isinstance(v, list)
                             else normalize_output(v, argument), value)
    return to_leaf(value, argument)


def leaf_spec(x) -> TensorSpec:
    return TensorSpec(tuple(x.shape), x.dtype)


def spec_of(element):
    """The structure of ``TensorSpec``s of one element."""
    return map_structure(leaf_spec, element)


def stack(leaves: list, component: int):
    """One batched leaf from the same leaf of several elements (all of one shape)."""
    first = leaves[0]
    shape = tuple(first.shape)
    for i, leaf in enumerate(leaves):
        if tuple(leaf.shape) != shape:
            raise ValueError(f"Cannot batch tensors with different shapes in component {component}. First element "
                             f"had shape {list(shape)} and element {i} had shape {list(leaf.shape)}; give every "
                             "element the same shape (e.g. pad or crop it in map) before batch")
    if is_string(first):  # (string_array's form: object arrays of bytes)
        out = np.empty((len(leaves),) + shape, object)
        for i, leaf in enumerate(leaves):
            out[i] = bytes(leaf) if isinstance(leaf, np.bytes_) else leaf
        return out
    return array_module(first).stack(leaves)


# --- iterator state as checkpoint tensors --------------------------------------------------------------
# An iterator's state is a tree of dicts, lists, tuples, Python scalars, strings and arrays. It is stored
# as one JSON description (uint8) plus one entry per array, so a checkpoint file holds only plain arrays
# (no pickle: loading a checkpoint never runs code).

def encode_state(state) -> dict:
    arrays: list = []

    def enc(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, np.bytes_):  # (as its bytes: NumPy's S arrays would drop trailing NUL bytes)
            arrays.append(np.frombuffer(bytes(x), np.uint8).copy())
            return {"b": len(arrays) - 1, "scalar": True}
        if isinstance(x, np.ndarray) and x.dtype == object and all(type(v) is bytes for v in x.reshape(-1)):
            items = x.reshape(-1).tolist()  # a string tensor (string_array): its bytes and their lengths
            arrays.append(np.frombuffer(b"".join(items), np.uint8).copy())
            arrays.append(np.array([len(v) for v in items], np.int64))
            return {"strings": len(arrays) - 2, "shape": list(x.shape)}
        if isinstance(x, (np.ndarray, np.generic)) or _is_gpu_array(x):
            arr = np.asarray(device_util.to_host(x))
            if arr.dtype == object:
                raise ValueError("an iterator holds an element with an object array, which a checkpoint cannot "
                                 "store; keep elements numeric, bytes or strings")
            arr = np.asarray(arr, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
            if arr.dtype.kind in "SU":  # strings travel as their bytes: a checkpoint stores numeric dtypes
                arrays.append(np.frombuffer(arr.tobytes(), np.uint8).copy())
                return {"a": len(arrays) - 1, "scalar": isinstance(x, np.generic), "str": arr.dtype.str,
                        "shape": list(arr.shape)}
            arrays.append(arr)
            if _is_gpu_array(x):  # stored from the host, put back on its GPU
                return {"a": len(arrays) - 1, "scalar": False, "gpu": int(x.device.id)}
            return {"a": len(arrays) - 1, "scalar": isinstance(x, np.generic)}
        if isinstance(x, bytes):
            arrays.append(np.frombuffer(x, np.uint8).copy())
            return {"b": len(arrays) - 1}
        if isinstance(x, abc.Mapping):
            return {"d": [[enc(k), enc(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"t": [enc(v) for v in x]}
        if isinstance(x, list):
            return {"l": [enc(v) for v in x]}
        raise ValueError(f"an iterator's state holds a {type(x).__name__}, which a checkpoint cannot store")

    description = json.dumps(enc(state)).encode("utf-8")
    tensors = {"state": np.frombuffer(description, np.uint8).copy()}
    tensors.update({str(i): a for i, a in enumerate(arrays)})
    return tensors


def decode_state(tensors: dict):
    try:
        description = json.loads(np.asarray(tensors["state"], np.uint8).tobytes().decode("utf-8"))
    except (KeyError, ValueError) as e:
        raise ValueError(f"the checkpoint has no readable iterator state ({e}); restore a checkpoint that was "
                         "saved with the same iterator") from None

    def dec(x):
        if not isinstance(x, dict):
            return x
        if "a" in x:
            arr = np.asarray(tensors[str(x["a"])])
            if "str" in x:
                arr = np.frombuffer(arr.tobytes(), np.dtype(x["str"])).reshape(x["shape"])
            if "gpu" in x:
                import cupy

                with cupy.cuda.Device(x["gpu"]):
                    return cupy.asarray(arr)
            return arr[()] if x["scalar"] else arr
        if "b" in x:
            data = np.asarray(tensors[str(x["b"])], np.uint8).tobytes()
            return np.bytes_(data) if x.get("scalar") else data
        if "strings" in x:
            data = np.asarray(tensors[str(x["strings"])], np.uint8).tobytes()
            ends = np.cumsum(np.asarray(tensors[str(x["strings"] + 1)], np.int64)).tolist()
            return string_array([data[a:b] for a, b in zip([0] + ends[:-1], ends)], x["shape"])
        if "d" in x:
            return {dec(k): dec(v) for k, v in x["d"]}
        if "t" in x:
            return tuple(dec(v) for v in x["t"])
        return [dec(v) for v in x["l"]]

    return dec(description)
