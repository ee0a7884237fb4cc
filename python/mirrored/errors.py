"""Errors that users catch by name (``md.errors``, ``tf.errors``' names where TF has one).

Failures of a peer surface as Python's own classes: ``TimeoutError`` (a peer
did not arrive in time; a ``DeadlineExceededError`` too, as TensorFlow raises
for a collective's timeout), ``ConnectionError`` (a peer is gone, or the job's
collectives are broken after an earlier failure) and ``PermissionError`` (the
rendezvous store refused this task).
"""

from __future__ import annotations

__all__ = ["CancelledError", "CollectiveMismatchError", "OutOfRangeError", "OpError", "UnknownError",
           "InvalidArgumentError", "DeadlineExceededError", "UnimplementedError", "UnavailableError", "OK",
           "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "OUT_OF_RANGE", "UNIMPLEMENTED", "UNAVAILABLE"]

# TF's error codes (tf.errors.*: gRPC's status codes), as a remote call reports them
OK, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, OUT_OF_RANGE, UNIMPLEMENTED, UNAVAILABLE = 0, 2, 3, 4, 11, 12, 14


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


class OpError(Exception):
    """An error with TF's error code (``tf.errors.OpError``): ``message`` and ``error_code``.

    Built as TF builds them, ``InvalidArgumentError(node_def, op, message)`` (``node_def`` and ``op`` are None
    here: there is no graph). Each subclass is also the Python error a Python caller would catch.
    """

    error_code = UNKNOWN

    def __init__(self, node_def, op, message, *args):
        super().__init__(message)
        self.node_def, self.op, self.message = node_def, op, message

    def __reduce__(self):
        return type(self), (self.node_def, self.op, self.message)

    def __str__(self) -> str:
        return str(self.message)


class UnknownError(OpError, RuntimeError):
    """An error of no other kind (``tf.errors.UnknownError``): e.g. a remote function raised ``KeyError``."""

    error_code = UNKNOWN


class InvalidArgumentError(OpError, ValueError):
    """An argument was refused (``tf.errors.InvalidArgumentError``): e.g. an RPC to a method that is not
    registered, or a remote function that raised ``ValueError`` or ``TypeError``."""

    error_code = INVALID_ARGUMENT


class DeadlineExceededError(OpError, TimeoutError):
    """A deadline passed before the operation completed (``tf.errors.DeadlineExceededError``)."""

    error_code = DEADLINE_EXCEEDED


class PeerDeadlineExceededError(DeadlineExceededError):
    """The base of ``mirrored._net.PeerTimeoutError``: a peer of a multi-worker job did not arrive within the
    timeout (of a collective, as TensorFlow's ``DeadlineExceededError``, or of the start-up). Built from its
    message alone, as the native engine raises it."""

    def __init__(self, message="", *args):
        super().__init__(None, None, message)

    def __reduce__(self):
        return type(self), (self.message,)


class UnimplementedError(OpError, NotImplementedError):
    """The operation is not implemented (``tf.errors.UnimplementedError``)."""

    error_code = UNIMPLEMENTED


class UnavailableError(OpError, ConnectionError):
    """The service is unavailable (``tf.errors.UnavailableError``): e.g. an RPC server that is down."""

    error_code = UNAVAILABLE
