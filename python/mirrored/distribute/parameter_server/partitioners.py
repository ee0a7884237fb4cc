"""``md.distribute.experimental.partitioners``: how ParameterServerStrategy splits a variable into shards.

A partitioner is called as ``partitioner(shape, dtype, axis=0)`` and returns the number of shards along each
axis (1 everywhere but ``axis``), with TensorFlow's arithmetic (``tf.distribute.experimental.partitioners``);
tests/data/partitioners_tf.json holds TF's answers for many shapes and dtypes.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]


def _dims(shape, axis: int) -> tuple:
    dims = tuple(int(d) for d in shape)
    if not -len(dims) <= axis < len(dims):
        raise ValueError(f"Cannot partition variable along axis {axis} when shape is only {list(dims)}")
    return dims


def _element_bytes(dtype, bytes_per_string) -> int:
    """Bytes per element (TF's ``dtype.size``; strings count ``bytes_per_string``)."""
    if dtype in (str, bytes, "string"):
        return bytes_per_string
    if dtype == "bfloat16":  # (a NumPy dtype only with ml_dtypes imported)
        return 2
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}: expected a dtype (np.float32, 'float32', 'string', ...)") from None
    return bytes_per_string if dtype.kind in "SUO" else dtype.itemsize


def _positive(value, argument: str):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 1:
        raise ValueError(f"Argument `{argument}` must be positive. Received: {value!r}")
    return value


class Partitioner:
    """The base class: a partitioner implements ``__call__(shape, dtype, axis=0)`` and returns a list with the
    number of partitions along each axis (``tf.distribute.experimental.partitioners.Partitioner``)."""

    def __call__(self, shape, dtype, axis=0):
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer when the axis is shorter): ``FixedShardsPartitioner(2)([10, 3], float32)``
    is ``[2, 1]``."""

    def __init__(self, num_shards):
        self._num_shards = num_shards  # (unchecked, as TF: ParameterServerStrategy refuses 0 shards)

    def __call__(self, shape, dtype, axis=0):
        dims = _dims(shape, axis)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``."""

    def __init__(self, min_shard_bytes=256 << 10, max_shards=1, bytes_per_string=16):
        self._min_shard_bytes = _positive(min_shard_bytes, "min_shard_bytes")
        self._max_shards = _positive(max_shards, "max_shards")
        self._bytes_per_string = _positive(bytes_per_string, "bytes_per_string")

    def __call__(self, shape, dtype, axis=0):
        dims = _dims(shape, axis)
        total = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, int(math.ceil(total / self._min_shard_bytes))))
        return result


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (whole slices along the axis; at least one slice
    per shard), at most ``max_shards`` when given."""

    def __init__(self, max_shard_bytes, max_shards=None, bytes_per_string=16):
        self._max_shard_bytes = _positive(max_shard_bytes, "max_shard_bytes")
        self._max_shards = _positive(max_shards, "max_shards") if max_shards else None  # (TF: 0 is None)
        self._bytes_per_string = _positive(bytes_per_string, "bytes_per_string")

    def __call__(self, shape, dtype, axis=0):
        dims = _dims(shape, axis)
        if 0 in dims:  # (TF divides by zero)
            raise ValueError(f"shape={list(dims)}: a variable with no elements has nothing to partition")
        slice_bytes = math.prod(dims) / dims[axis] * _element_bytes(dtype, self._bytes_per_string)
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / slice_bytes))
        shards = int(math.ceil(dims[axis] / slices_per_shard))
        if self._max_shards:
            shards = min(self._max_shards, shards)
        result = [1] * len(dims)
        result[axis] = shards
        return result
