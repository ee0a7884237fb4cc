"""Errors that users catch by name (``md.errors``: all of ``tf.errors``' classes and codes, and mirrored's own).

Each ``OpError`` subclass is also the Python error a Python caller would catch
(``NotFoundError`` a ``FileNotFoundError``, ``DataLossError`` a ``ValueError``,
``OutOfRangeError`` a ``StopIteration``...: the table in docs/tf_semantics.md),
so ``except tf.errors.NotFoundError`` ported as ``except md.errors.NotFoundError``
and a plain ``except FileNotFoundError`` both catch it.

Failures of a peer surface as Python's own classes: ``TimeoutError`` (a peer
did not arrive in time; a ``DeadlineExceededError`` too, as TensorFlow raises
for a collective's timeout), ``ConnectionError`` (a peer is gone, or the job's
collectives are broken after an earlier failure) and ``PermissionError`` (the
rendezvous store refused this task).
"""

from __future__ import annotations

import errno as _errno
import re as _re
import sys as _sys
import threading as _threading

import numpy as _np

__all__ = ["OpError", "CancelledError", "UnknownError", "InvalidArgumentError", "DeadlineExceededError",
           "NotFoundError", "AlreadyExistsError", "PermissionDeniedError", "UnauthenticatedError",
           "ResourceExhaustedError", "FailedPreconditionError", "AbortedError", "OutOfRangeError",
           "UnimplementedError", "InternalError", "UnavailableError", "DataLossError",
           "OperatorNotAllowedInGraphError", "CollectiveMismatchError", "exception_type_from_error_code",
           "error_code_from_exception_type", "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
           "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED",
           "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"]

# TF's error codes (tf.errors.*: gRPC's status codes), as a remote call reports them
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED = range(8)
RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ABORTED, OUT_OF_RANGE, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = range(8, 15)
DATA_LOSS, UNAUTHENTICATED = 15, 16


class _ErrorCode:
    """``error_code``: read-only on an error, as TF's; on a class, the code of its errors (``NotFoundError.error_code
    == NOT_FOUND``), which code written against mirrored's earlier classes reads."""

    def __get__(self, error, cls):
        return cls._class_code if error is None else error._error_code

    def __set__(self, error, value):
        raise AttributeError("error_code is read-only, as TF's; raise an error of the class of the code instead")


class OpError(Exception):
    """An error with TF's error code (``tf.errors.OpError``): ``message``, ``error_code``, ``op``, ``node_def``
    and ``experimental_payloads``.

    Built as TF builds them: ``OpError(node_def, op, message, error_code)``, a subclass
    ``NotFoundError(node_def, op, message)``; an optional next argument is the payloads dict. ``node_def`` and
    ``op`` are None here: there is no graph.
    """

    def __init__(self, node_def, op, message, error_code, *args):
        super().__init__(message)
        self._keep(node_def, op, message, error_code, args)

    def _keep(self, node_def, op, message, error_code, args):
        self._node_def, self._op, self._message, self._error_code = node_def, op, message, error_code
        self._experimental_payloads = args[0] if args else {}

    message = property(lambda self: self._message, doc="The error message, as TF's.")
    op = property(lambda self: self._op, doc="The operation that failed: None (mirrored runs no graph).")
    node_def = property(lambda self: self._node_def, doc="The failed op's NodeDef: None (no graph).")
    _class_code = UNKNOWN  # (OpError itself takes the code as an argument)
    error_code = _ErrorCode()
    experimental_payloads = property(lambda self: self._experimental_payloads,
                                     doc="Extra details as a dict of bytes (TF's status payloads); {} by default.")

    def __reduce__(self):
        payloads = (self._experimental_payloads,) if self._experimental_payloads else ()
        if type(self) is OpError:
            return OpError, (self._node_def, self._op, self._message, self._error_code, *payloads)
        return type(self), (self._node_def, self._op, self._message, *payloads)

    def __str__(self) -> str:
        return str(self._message)


def _op_error(name: str, code: int, builtin: type, doc: str) -> type:
    """The ``tf.errors`` class ``name``: an ``OpError`` of ``code`` that is also the Python ``builtin``."""

    def __init__(self, node_def, op, message, *args):
        OpError.__init__(self, node_def, op, message, code, *args)

    __init__.__qualname__ = f"{name}.__init__"
    return type(name, (OpError, builtin), {"__init__": __init__, "__doc__": doc, "__module__": __name__,
                                           "_class_code": code})


CancelledError = _op_error("CancelledError", CANCELLED, RuntimeError, """An operation was cancelled
    (``tf.errors.CancelledError``), a ``RuntimeError``: e.g. a function scheduled with
    ``ClusterCoordinator.schedule`` that did not run because another one failed first; reschedule it.""")
UnknownError = _op_error("UnknownError", UNKNOWN, RuntimeError, """An error of no other kind
    (``tf.errors.UnknownError``), a ``RuntimeError``: e.g. a remote function raised ``KeyError``.""")
InvalidArgumentError = _op_error("InvalidArgumentError", INVALID_ARGUMENT, ValueError, """An argument was refused
    (``tf.errors.InvalidArgumentError``), a ``ValueError``: e.g. an RPC to a method that is not registered, or a
    remote function that raised ``ValueError`` or ``TypeError``.""")
DeadlineExceededError = _op_error("DeadlineExceededError", DEADLINE_EXCEEDED, TimeoutError, """A deadline passed
    before the operation completed (``tf.errors.DeadlineExceededError``), a ``TimeoutError``.""")
NotFoundError = _op_error("NotFoundError", NOT_FOUND, FileNotFoundError, """A file or an entry does not exist
    (``tf.errors.NotFoundError``), a ``FileNotFoundError``: a missing input file of a ``TFRecordDataset``, a
    ``Checkpoint.restore`` of a missing prefix, a ``Dataset.load`` of a missing directory. ``load_variable`` of a
    name the checkpoint lacks raises one that is also a ``KeyError``.""")
AlreadyExistsError = _op_error("AlreadyExistsError", ALREADY_EXISTS, FileExistsError, """What an operation would
    create already exists (``tf.errors.AlreadyExistsError``), a ``FileExistsError``.""")
PermissionDeniedError = _op_error("PermissionDeniedError", PERMISSION_DENIED, PermissionError, """The operating
    system refused the operation (``tf.errors.PermissionDeniedError``), a ``PermissionError``: e.g. a
    ``CheckpointManager`` saving into a directory this process may not write.""")
UnauthenticatedError = _op_error("UnauthenticatedError", UNAUTHENTICATED, PermissionError, """The caller has no
    valid credentials (``tf.errors.UnauthenticatedError``), a ``PermissionError``.""")
ResourceExhaustedError = _op_error("ResourceExhaustedError", RESOURCE_EXHAUSTED, MemoryError, """A resource ran
    out (``tf.errors.ResourceExhaustedError``), a ``MemoryError``: a GPU out of memory ("OOM when allocating ...",
    also CuPy's ``OutOfMemoryError`` where CuPy is imported), a checkpoint larger than the memory left.""")
FailedPreconditionError = _op_error("FailedPreconditionError", FAILED_PRECONDITION, RuntimeError, """The system
    is not in the state the operation needs (``tf.errors.FailedPreconditionError``), a ``RuntimeError``.""")
AbortedError = _op_error("AbortedError", ABORTED, RuntimeError, """The operation was aborted, typically by a
    concurrent action (``tf.errors.AbortedError``), a ``RuntimeError``: retry it.""")
OutOfRangeError = _op_error("OutOfRangeError", OUT_OF_RANGE, StopIteration, """``iterator.get_next()`` past the
    end of the data, an index past the end (``tf.errors.OutOfRangeError``). A ``StopIteration`` too, so loops
    written for Python's iterator protocol end on it as well.""")
UnimplementedError = _op_error("UnimplementedError", UNIMPLEMENTED, NotImplementedError, """The operation is not
    implemented (``tf.errors.UnimplementedError``), a ``NotImplementedError``.""")
InternalError = _op_error("InternalError", INTERNAL, RuntimeError, """An invariant of the system broke
    (``tf.errors.InternalError``), a ``RuntimeError``.""")
UnavailableError = _op_error("UnavailableError", UNAVAILABLE, ConnectionError, """The service is unavailable
    (``tf.errors.UnavailableError``), a ``ConnectionError``: e.g. an RPC server that is down.""")
DataLossError = _op_error("DataLossError", DATA_LOSS, ValueError, """Data is corrupt or lost
    (``tf.errors.DataLossError``), a ``ValueError``: a TFRecord whose CRC does not match or whose last record is
    cut short, a damaged checkpoint file.""")


class PeerDeadlineExceededError(DeadlineExceededError):
    """The base of ``mirrored._net.PeerTimeoutError``: a peer of a multi-worker job did not arrive within the
    timeout (of a collective, as TensorFlow's ``DeadlineExceededError``, or of the start-up). Built from its
    message alone, as the native engine raises it."""

    def __init__(self, message="", *args):
        super().__init__(None, None, message)

    def __reduce__(self):
        return type(self), (self.message,)


class OperatorNotAllowedInGraphError(TypeError):
    """An operation a ``tf.function`` graph cannot run (``tf.errors.OperatorNotAllowedInGraphError``: a
    ``TypeError``, not an ``OpError``, as TF's). mirrored traces no graphs; the name is here for ported
    ``except`` clauses."""


class CollectiveMismatchError(ValueError):
    """The workers of a job called one collective differently.

    Raised on every worker alike, before any data moved, e.g. ``all_reduce #12:
    worker:0 passes 10 float32 elements (sum), worker:1 passes 20 float32
    elements (sum)``: the kind of collective, the element count, the dtype, the
    reduction op, the root or a gather's shapes differ. The job's collectives
    keep working afterwards: the next collective is matched afresh.
    """


_CLASS_OF_CODE = {cls.error_code: cls for cls in (
    CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError, NotFoundError, AlreadyExistsError,
    PermissionDeniedError, UnauthenticatedError, ResourceExhaustedError, FailedPreconditionError, AbortedError,
    OutOfRangeError, UnimplementedError, InternalError, UnavailableError, DataLossError)}
_CODE_OF_CLASS = {cls: code for code, cls in _CLASS_OF_CODE.items()}


def exception_type_from_error_code(error_code: int) -> type:
    """The ``OpError`` subclass of TF's ``error_code`` (``tf.compat.v1.errors.exception_type_from_error_code``);
    ``KeyError`` for a code that has none (``OK``, an unknown number), as TF's."""
    return _CLASS_OF_CODE[error_code]


def error_code_from_exception_type(cls: type) -> int:
    """TF's error code of an ``OpError`` subclass (``tf.compat.v1.errors.error_code_from_exception_type``);
    ``KeyError`` for any other class."""
    return _CODE_OF_CLASS[cls]


# errno values the operating system reports -> the TF class of the same meaning (TF's file system's mapping),
# each a subclass of the OSError the errno gives in Python, so a caller's ``except OSError`` keeps catching it.
_ERRNO_CLASSES = {_errno.ENOENT: NotFoundError, _errno.EEXIST: AlreadyExistsError, _errno.EACCES:
                  PermissionDeniedError, _errno.EPERM: PermissionDeniedError, _errno.EROFS: PermissionDeniedError}


def from_os_error(error: OSError, message: str | None = None) -> OSError:
    """``error`` as TF reports it (``NotFoundError`` for ENOENT, ``AlreadyExistsError`` for EEXIST,
    ``PermissionDeniedError`` for EACCES / EPERM / EROFS), saying ``message`` or TF's ``"<path>; <reason>"``;
    an OSError of another errno keeps its class (with ``message`` where given). Raise the result."""
    cls = type(error) if isinstance(error, OpError) else _ERRNO_CLASSES.get(error.errno)
    if cls is None:
        return error if message is None else type(error)(error.errno, message)
    if message is None:
        message = f"{error.filename}; {error.strerror}" if error.filename is not None else str(error)
    converted = cls(None, None, message)
    converted.errno, converted.strerror, converted.filename = error.errno, error.strerror, error.filename
    return converted


# --- a GPU out of memory ------------------------------------------------------------------------------------------

_OOM_FIX = ("the GPU has no room for it: use a smaller batch, fewer replicas per GPU (fewer logical GPUs in "
            "md.config.set_logical_device_configuration), or free CuPy's cached blocks "
            "(cupy.get_default_memory_pool().free_all_blocks()); md.config.experimental.set_memory_growth does not "
            "help here, as mirrored's GPU memory always grows on demand")
# TF's messages name three dtypes by their C names; the one copy, also used by device/python_values.py.
_TF_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half"}


def _tf_dtype_name(name: str) -> str:
    """A dtype's name as TF's error messages write it (``float32`` is ``float``)."""
    return _TF_DTYPE_NAMES.get(name, name)


_gpu_error_classes: dict = {}
_gpu_error_classes_lock = _threading.Lock()


def _cupy_out_of_memory_class() -> type | None:
    """``cupy.cuda.memory.OutOfMemoryError`` where CuPy is imported (it must be, to have allocated on a GPU)."""
    cupy = _sys.modules.get("cupy")
    cupy_class = getattr(getattr(getattr(cupy, "cuda", None), "memory", None), "OutOfMemoryError", None)
    return cupy_class if isinstance(cupy_class, type) and issubclass(cupy_class, MemoryError) else None


def _gpu_error_class() -> type:
    """ResourceExhaustedError, or where CuPy is imported one class that is also its ``OutOfMemoryError`` (made
    once per CuPy class), so code that caught CuPy's error still catches mirrored's."""
    cupy_class = _cupy_out_of_memory_class()
    if cupy_class is None:
        return ResourceExhaustedError
    with _gpu_error_classes_lock:
        cls = _gpu_error_classes.get(cupy_class)
        if cls is None:
            cls = type("ResourceExhaustedError", (ResourceExhaustedError, cupy_class), {
                "__init__": _init_gpu_error, "__module__": __name__,
                "__reduce__": lambda self: (_rebuild_gpu_error, (self.message,)),
                "__doc__": "ResourceExhaustedError of a GPU out of memory, also CuPy's OutOfMemoryError."})
            _gpu_error_classes[cupy_class] = cls
    return cls


def _init_gpu_error(self, node_def, op, message, *args):
    # (not through CuPy's __init__, which takes the bytes and builds its own words)
    BaseException.__init__(self, message)
    self._keep(node_def, op, message, RESOURCE_EXHAUSTED, args)


def _rebuild_gpu_error(message: str):
    return _gpu_error_class()(None, None, message)


def gpu_out_of_memory(nbytes: int, device: int, *, shape=None, dtype=None, purpose: str | None = None,
                      allocator: str = "cudaMalloc") -> ResourceExhaustedError:
    """The error of a GPU (``device``; -1: pinned host memory) that could not allocate ``nbytes``, in TF's words:
    "OOM when allocating tensor with shape[...] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by
    allocator ..." where the shape and dtype are known, else "OOM when allocating N bytes for <purpose> on ...",
    then the fix. Raise the result."""
    where = "CPU:0" if device < 0 else f"GPU:{device}"
    if shape is not None and dtype is not None:
        name = _np.dtype(dtype).name
        what = f"tensor with shape[{','.join(str(int(d)) for d in shape)}] and type {_tf_dtype_name(name)}"
    else:
        what = f"{int(nbytes)} bytes" + (f" for {purpose}" if purpose else "")
    return _gpu_error_class()(None, None, f"OOM when allocating {what} on /job:localhost/replica:0/task:0/device:"
                                          f"{where} by allocator {allocator}: {_OOM_FIX}")


def is_gpu_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is CuPy's OutOfMemoryError not yet made a ResourceExhaustedError."""
    cupy_class = _cupy_out_of_memory_class()
    return cupy_class is not None and isinstance(error, cupy_class) and not isinstance(error, ResourceExhaustedError)


def from_gpu_out_of_memory(error: MemoryError, device: int, *, shape=None, dtype=None) -> ResourceExhaustedError:
    """CuPy's OutOfMemoryError ``error`` (on GPU ``device``, allocating a tensor of ``shape`` and ``dtype`` where
    known) as ResourceExhaustedError; raise it ``from error``."""
    nbytes = getattr(error, "_size", None)
    if nbytes is None:
        found = _re.search(r"allocating ([\d,]+) bytes", str(error))
        nbytes = int(found.group(1).replace(",", "")) if found else 0
    return gpu_out_of_memory(nbytes, device, shape=shape, dtype=dtype, purpose=f"an array ({error})",
                             allocator="cupy")
