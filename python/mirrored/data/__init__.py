"""``md.data``: tf.data's input pipeline for NumPy/CuPy (docs/data.md).

    ds = (md.data.Dataset.from_tensor_slices((x, y))
          .shuffle(1024, seed=1).batch(64).map(augment, num_parallel_calls=md.data.AUTOTUNE)
          .prefetch(md.data.AUTOTUNE))
    for step, (xb, yb) in enumerate(strategy.experimental_distribute_dataset(ds)): ...

Distributed input also takes any iterable of batches; wrap one as
``md.data.Dataset(iterable)`` to give it ``with_options``::

    options = md.data.Options()
    options.experimental_distribute.auto_shard_policy = md.data.experimental.AutoShardPolicy.DATA
    dataset = md.data.Dataset(batches).with_options(options)
    dist = strategy.experimental_distribute_dataset(dataset)

How a multi-worker job (W workers, N replicas in all, L per worker) shares a
dataset of global batches, per policy:

* ``DATA``: every worker reads every batch and keeps its replicas' slices
  (the batch split over all N replicas): one step per batch; every example
  is used once per epoch.
* ``FILE``: each worker reads its share of the files: for an md.data
  pipeline, the files of its ``list_files`` / ``TextLineDataset`` sources
  (worker ``w`` takes files ``w, w+W, ...``); for a plain iterable with a
  ``files`` attribute, its items (a worker short of an item in the last
  round gets an empty batch). Each batch read is split into N per-replica
  batches, run L at a time: W steps per batch read.
* ``OFF``: no sharding: every worker reads every batch, splits it into N
  per-replica batches and runs them L at a time (W steps per batch), so
  every worker sees the whole dataset.
* ``AUTO`` (the default): FILE for a pipeline that reads at least W files
  (or an iterable with a ``files`` attribute), else DATA — with TensorFlow's
  warning that AUTO fell back to DATA.
* ``HINT`` is accepted as TensorFlow spells it; md.data pipelines place no
  shard hints, so, as tf.data's without any, it shards nothing (as OFF).

With one worker every policy gives the same split.
"""

from __future__ import annotations

from . import experimental
from .dataset_ops import (AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset, NumpyDataset,
                          make_numpy_dataset)
from .iterator_ops import IteratorSpec, NumpyIterator, Optional, OwnedIterator as Iterator
from .options import AutoShardPolicy, DistributeOptions, Options, ThreadingOptions
from .readers import FixedLengthRecordDataset, TextLineDataset, TFRecordDataset
from .structure import DatasetSpec, TensorSpec

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset", "Iterator", "IteratorSpec",
           "NumpyIterator", "Options", "ThreadingOptions", "DistributeOptions", "AutoShardPolicy", "TensorSpec",
           "DatasetSpec", "TextLineDataset", "FixedLengthRecordDataset", "TFRecordDataset", "NumpyDataset",
           "experimental"]
