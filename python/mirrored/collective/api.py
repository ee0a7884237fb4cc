"""Collectives over the buffers of all local replicas, in one native call.

``buffers`` is a list with one array per replica (on host replicas NumPy
or any DLPack / ``__array_interface__`` / buffer-protocol array; CuPy or any
``__cuda_array_interface__`` array on GPU replicas, which go to the CUDA
engine). The GIL is released for the whole collective.

``out`` takes the same kinds of arrays and writes them in place (a torch
tensor, a bytearray, ...); the call returns ``out``. ``out=buffers`` works in
place without a copy. An ``out[i]`` that overlaps another replica's input,
or only part of its own, is computed aside and copied in at the end (always
right, never silently mixed); outputs that overlap each other are refused.

Arrays in non-native byte order (``'>i4'`` on x86) are read as the numbers
they hold (converted, as NumPy does); results are in native byte order, and
an ``out`` array in the other byte order receives the same values converted.

Results follow NumPy: integer sums wrap on overflow; ``mean`` of integer
buffers is NumPy's true division of the (wrapped) sum by the number of
replicas, so the result is float64 (``s.astype(np.float64) / n``), as
TensorFlow's MEAN of integer tensors is; NaN and Inf propagate as IEEE says
(``min``/``max`` return NaN when any input is NaN, like ``np.minimum``).
"""

from __future__ import annotations

from ..device.gpu import raise_if_out_of_memory
from ..timeline import enabled_native as tracing
from .plan import (all_gather as plan_all_gather, all_reduce as plan_all_reduce,
                   batch_all_reduce as plan_batch_all_reduce, broadcast as plan_broadcast, lookup, lookup_batch,
                   reduce as plan_reduce)
from .rules import ALGORITHMS

__all__ = ["all_reduce", "broadcast", "reduce", "all_gather", "batch_all_reduce", "ALGORITHMS"]


def all_reduce(buffers, op="sum", *, out=None, algorithm="auto", chunk_bytes=0):
    """``out[i] = op(buffers[0], ..., buffers[n-1])`` for every replica ``i``.

    ``chunk_bytes``: bytes each participant handles per ring step (0: the
    engine's default); only the ring uses it.
    """
    try:
        plan = lookup("all_reduce", (op, algorithm, chunk_bytes), buffers)  # (all_reduce_plan(), inlined)
        if plan is not None and not tracing():
            done = plan.run(buffers, out)
            if done is not None:
                return done
        return plan_all_reduce(buffers, op, out, algorithm, chunk_bytes)
    except MemoryError as error:  # CuPy's OutOfMemoryError: TF's ResourceExhaustedError
        raise_if_out_of_memory(error)
        raise


def broadcast(buffers, root=0, *, out=None, algorithm="auto"):
    """``out[i] = buffers[root]`` for every replica ``i``.

    ``algorithm``: ``"nccl"`` broadcasts GPU buffers with NCCL (one GPU per replica), which each GPU's CUDA graph
    can hold (md.function); any other name of ``ALGORITHMS``: the engine's direct copy.
    """
    plan = lookup("broadcast", (root, algorithm), buffers)
    if plan is not None and not tracing():
        done = plan.run(buffers, out)
        if done is not None:
            return done
    return plan_broadcast(buffers, root, out, algorithm)


def reduce(buffers, op="sum", root=0, *, out=None, algorithm="auto"):
    """The reduction of all replicas' buffers, written to ``out[root]`` (or a new array) and returned.

    ``algorithm``: ``"nccl"`` reduces GPU buffers with NCCL (one GPU per
    replica); any other name of ``ALGORITHMS`` takes the engine's direct reduce.
    """
    return plan_reduce(buffers, op, root, out, algorithm)


def all_gather(buffers, axis=0):
    """Every replica gets ``np.concatenate(buffers, axis)``; sizes may differ along ``axis`` only."""
    return plan_all_gather(buffers, axis)


def batch_all_reduce(per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto",
                     chunk_bytes=0):
    """All-reduce many tensors per replica at once, fused into few packs.

    ``per_replica_lists[r][t]`` is tensor ``t`` of replica ``r``; returns the
    same structure of new arrays. ``bytes_per_pack`` caps a pack's size;
    ``num_packs`` splits each dtype's tensors into that many packs; neither:
    one pack per dtype.
    """
    try:
        plan = lookup_batch((op, bytes_per_pack, num_packs, algorithm, chunk_bytes), per_replica_lists)
        if plan is not None and not tracing():
            done = plan.run(per_replica_lists)
            if done is not None:
                return done
        return plan_batch_all_reduce(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, chunk_bytes)
    except MemoryError as error:
        raise_if_out_of_memory(error)
        raise
