"""Errors that users catch by name (``md.errors``, ``tf.errors``' names where TF has one).

Failures of a peer surface as Python's own classes: ``TimeoutError`` (a peer
did not arrive in time), ``ConnectionError`` (a peer is gone, or the job's
collectives are broken after an earlier failure) and ``PermissionError`` (the
rendezvous store refused this task).
"""

from __future__ import annotations

__all__ = ["CancelledError", "CollectiveMismatchError", "OutOfRangeError"]


class OutOfRangeError(StopIteration):
    """``iterator.get_next()`` past the end of the data (``tf.errors.OutOfRangeError``).

    A ``StopIteration`` too, so loops written for Python's iterator protocol end on it as well.
    """


class CancelledError(RuntimeError):
    """An operation was cancelled (``tf.errors.CancelledError``): e.g. a function scheduled with
    ``ClusterCoordinator.schedule`` that did not run because another one failed first; reschedule it."""


class CollectiveMismatchError(ValueError):
    """The workers of a job called one collective differently.

    Raised on every worker alike, before any data moved, e.g. ``all_reduce #12:
    worker:0 passes 10 float32 elements (sum), worker:1 passes 20 float32
    elements (sum)``: the kind of collective, the element count, the dtype, the
    reduction op, the root or a gather's shapes differ. The job's collectives
    keep working afterwards: the next collective is matched afresh.
    """
