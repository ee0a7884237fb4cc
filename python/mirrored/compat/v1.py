"""``md.compat.v1``: the TF 1.x ``tf.compat.v1.distribute`` spellings of MirroredStrategy, OneDeviceStrategy and
``experimental.CentralStorageStrategy``, and ``tf.compat.v1.IndexedSlices`` with
``convert_to_tensor_or_indexed_slices``."""

from __future__ import annotations

import sys
import types

import numpy as np

from ..distribute.distribute_lib import (get_cross_replica_context, get_replica_context, get_strategy, has_strategy, in_cross_replica_context)
from ..data import NumpyDataset, make_numpy_dataset
from ..device.indexed_slices import IndexedSlices, convert_to_tensor, is_indexed_slices
from ..distribute.central_storage_strategy import CentralStorageStrategy as _CentralStorageStrategyV2
from ..distribute.input_lib import DatasetIterator
from ..distribute.mirrored_strategy import MirroredStrategy as _MirroredStrategyV2
from ..distribute.one_device_strategy import OneDeviceStrategy as _OneDeviceStrategyV2


class _StrategyV1:
    """What TF 1.x's strategies add to the v2 ones (which have the TF 1.x input and run names too, as TF's do):
    ``experimental_make_numpy_dataset(numpy_input, session)``."""

    def experimental_make_numpy_dataset(self, numpy_input, session=None) -> NumpyDataset:
        """A dataset of the rows of ``numpy_input``, copied to the host; ``session`` is ignored (eager).

        Tuples and dicts are structures of arrays; a list of arrays is stacked
        into one array, as documented for TensorFlow (``[np.ones(3), np.zeros(3)]``
        is 2 rows of shape (3,)).
        """
        return make_numpy_dataset(numpy_input)


class MirroredStrategy(_StrategyV1, _MirroredStrategyV2):
    """``tf.compat.v1.distribute.MirroredStrategy``."""


class OneDeviceStrategy(_StrategyV1, _OneDeviceStrategyV2):
    """``tf.compat.v1.distribute.OneDeviceStrategy``."""


class CentralStorageStrategy(_StrategyV1, _CentralStorageStrategyV2):
    """``tf.compat.v1.distribute.experimental.CentralStorageStrategy``."""


def convert_to_tensor_or_indexed_slices(value, dtype=None, name=None):
    """``tf.compat.v1.convert_to_tensor_or_indexed_slices``: an ``md.IndexedSlices`` as it is (of ``dtype``,
    if given), anything else through ``md.convert_to_tensor``."""
    if is_indexed_slices(value):
        if dtype is not None and np.dtype(dtype) != value.dtype:
            raise ValueError(f"dtype={np.dtype(dtype).name}: Incompatible tensor conversion requested for "
                             f"IndexedSlices of dtype {value.dtype.name}; cast its values first "
                             f"(md.IndexedSlices(values.astype(...), indices))")
        return value
    return convert_to_tensor(value, dtype)


# ``tf.compat.v1.distribute.experimental``'s strategy (its other names are multi-worker or TPU ones)
experimental = types.SimpleNamespace(CentralStorageStrategy=CentralStorageStrategy)

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "experimental", "get_strategy", "has_strategy",
           "in_cross_replica_context", "get_replica_context", "get_cross_replica_context", "NumpyDataset",
           "DatasetIterator", "IndexedSlices", "convert_to_tensor_or_indexed_slices"]

# ``tf.compat.v1.distribute.MirroredStrategy`` ported verbatim reads ``md.compat.v1.distribute.MirroredStrategy``:
# this module is that namespace too.
distribute = sys.modules[__name__]
