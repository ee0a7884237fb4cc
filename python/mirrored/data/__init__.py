"""``md.data``: the few ``tf.data`` names distributed input needs — options and auto-sharding.

A dataset here is any iterable of batches. To set TensorFlow's sharding
options on one, wrap it: ``md.data.Dataset(iterable)`` has ``with_options``
and ``options()`` (as have the datasets ``experimental_make_numpy_dataset``
returns)::

    options = md.data.Options()
    options.experimental_distribute.auto_shard_policy = md.data.experimental.AutoShardPolicy.DATA
    dataset = md.data.Dataset(batches).with_options(options)
    dist = strategy.experimental_distribute_dataset(dataset)

How a multi-worker job (W workers, N replicas in all, L per worker) shares a
dataset of global batches, per policy:

* ``DATA``: every worker reads every batch and keeps its replicas' slices
  (the batch split over all N replicas): one step per batch; every example
  is used once per epoch.
* ``FILE``: the dataset's items play the part of TensorFlow's files: worker
  ``w`` reads items ``w, w+W, w+2W, ...`` only (a worker short of an item in
  the last round gets an empty batch), splits each into N per-replica
  batches and runs them L at a time: W steps per item read.
* ``OFF``: no sharding: every worker reads every batch, splits it into N
  per-replica batches and runs them L at a time (W steps per batch), so
  every worker sees the whole dataset.
* ``AUTO`` (the default): FILE for a dataset that names its files (an
  attribute ``files``), else DATA — with TensorFlow's warning that AUTO fell
  back to DATA.
* ``HINT`` is accepted as TensorFlow spells it and shards as DATA.

With one worker every policy gives the same split.
"""

from __future__ import annotations

import enum
import types

import numpy as np

from .. import _nest
from ..device import device_util

__all__ = ["Options", "DistributeOptions", "AutoShardPolicy", "Dataset", "NumpyDataset", "experimental"]


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shares a dataset between workers (``tf.data.experimental``)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class DistributeOptions:
    """``options.experimental_distribute``: ``auto_shard_policy`` (default AUTO) and ``num_devices``."""

    def __init__(self):
        self._auto_shard_policy = AutoShardPolicy.AUTO
        self.num_devices = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        return self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value):
        try:
            if isinstance(value, str):
                self._auto_shard_policy = AutoShardPolicy[value.upper()]
            elif isinstance(value, bool):
                raise TypeError(value)
            else:
                self._auto_shard_policy = AutoShardPolicy(value)
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"auto_shard_policy={value!r}: expected md.data.experimental.AutoShardPolicy "
                             f"({', '.join(p.name for p in AutoShardPolicy)})") from None

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self._auto_shard_policy!r})"


class Options:
    """``tf.data.Options``: here only ``experimental_distribute`` matters."""

    def __init__(self):
        self.experimental_distribute = DistributeOptions()

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self.experimental_distribute!r})"


class Dataset:
    """An iterable of batches that carries ``md.data.Options`` (``with_options`` / ``options()``)."""

    def __init__(self, iterable=None, options: Options | None = None):
        if iterable is not None:
            try:
                iter(iterable)
            except TypeError:
                raise TypeError(f"iterable={iterable!r} is not iterable; pass an iterable of batches") from None
        self._iterable = iterable
        self._options = options if options is not None else Options()

    def options(self) -> Options:
        return self._options

    def with_options(self, options: Options) -> "Dataset":
        """A copy of this dataset carrying ``options``."""
        if not isinstance(options, Options):
            raise TypeError(f"options={options!r}: expected md.data.Options()")
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._options = options
        return clone

    def __iter__(self):
        return iter(self._iterable)

    @property
    def files(self):
        """The files the items come from, when the wrapped iterable names them (for FILE sharding)."""
        return getattr(self._iterable, "files", None)


class NumpyDataset(Dataset):
    """``experimental_make_numpy_dataset``'s result: the rows of host arrays, like ``from_tensor_slices``.

    ``batch(n, drop_remainder=False)`` groups rows into batches; ``repeat``
    repeats the rows ``count`` times (forever for ``None``).
    """

    def __init__(self, arrays, batch_size=None, drop_remainder=False, repeat=1, options=None):
        super().__init__(None, options)
        self._arrays = arrays
        leaves = _nest.flatten(arrays)
        if not leaves or any(np.ndim(a) == 0 for a in leaves):
            raise ValueError("numpy_input: expected arrays with a leading dimension of rows, got "
                             f"{[np.shape(a) for a in leaves]}")
        sizes = {len(a) for a in leaves}
        if len(sizes) != 1:
            raise ValueError(f"numpy_input: all arrays need the same number of rows; got {sorted(sizes)}")
        self._rows = sizes.pop()
        self._batch_size, self._drop_remainder, self._repeat = batch_size, drop_remainder, repeat

    def batch(self, batch_size: int, drop_remainder: bool = False) -> "NumpyDataset":
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
        return NumpyDataset(self._arrays, batch_size, drop_remainder, self._repeat, self._options)

    def repeat(self, count=None) -> "NumpyDataset":
        return NumpyDataset(self._arrays, self._batch_size, self._drop_remainder, count, self._options)

    def __iter__(self):
        leaves = _nest.flatten(self._arrays)
        epoch = 0
        while self._repeat is None or self._repeat < 0 or epoch < self._repeat:
            if self._batch_size is None:
                for i in range(self._rows):
                    yield _nest.pack_sequence_as(self._arrays, [a[i] for a in leaves])
            else:
                for lo in range(0, self._rows, self._batch_size):
                    hi = min(lo + self._batch_size, self._rows)
                    if hi - lo < self._batch_size and self._drop_remainder:
                        break
                    yield _nest.pack_sequence_as(self._arrays, [a[lo:hi] for a in leaves])
            epoch += 1

    @property
    def files(self):
        return None


def _stack_lists(value):
    """Lists are tensors (stacked), tuples and dicts are structures: ``tf.data``'s rule for NumPy input."""
    if isinstance(value, list):
        try:
            return np.stack([np.asarray(device_util.to_host(v)) for v in value]) if value else np.asarray(value)
        except ValueError as e:
            raise ValueError(f"numpy_input: a list is stacked into one array (tf.data's rule), but its items "
                             f"differ in shape ({e}); pass a tuple for a structure of arrays") from None
    if isinstance(value, dict):
        return type(value)((k, _stack_lists(v)) for k, v in value.items())
    if isinstance(value, tuple):
        items = [_stack_lists(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def make_numpy_dataset(numpy_input) -> NumpyDataset:
    """The rows of ``numpy_input`` (an array, or tuples/dicts of arrays; lists are stacked), copied to the host."""
    arrays = _stack_lists(numpy_input)
    return NumpyDataset(_nest.map_structure(lambda a: np.array(device_util.to_host(a), copy=True), arrays))


def policy_of(dataset) -> AutoShardPolicy:
    """The auto-shard policy ``dataset`` carries (AUTO when it carries no options)."""
    options = getattr(dataset, "options", None)
    if callable(options):
        try:
            options = options()
        except TypeError:
            options = None
    distribute = getattr(options, "experimental_distribute", None)
    return getattr(distribute, "auto_shard_policy", AutoShardPolicy.AUTO) if distribute is not None \
        else AutoShardPolicy.AUTO


experimental = types.SimpleNamespace(AutoShardPolicy=AutoShardPolicy, DistributeOptions=DistributeOptions)
