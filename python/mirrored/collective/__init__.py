"""The collective layer: the one face every collective of the package goes through.

``mirrored.collectives`` (``api``) validates a call and hands it to an engine:
the host ring (``mirrored._core``), the CUDA kernels (``cuda``, ``mirrored._cuda``)
or NCCL. Above it sit the strategies (``mirrored.distribute``); below it, the
device layer (``mirrored.device``).
"""

from .api import all_gather, all_reduce, batch_all_reduce, broadcast, reduce

__all__ = ["all_reduce", "broadcast", "reduce", "all_gather", "batch_all_reduce"]
