"""``md.distribute.experimental.rpc``: TF 2.21's RPC server and client (``tf.distribute.experimental.rpc``).

    server = md.distribute.experimental.rpc.Server.create("grpc", "localhost:2345")
    server.register("addition", add)          # a Python callable (or md.function) of NumPy arrays
    server.start()
    client = md.distribute.experimental.rpc.Client.create("grpc", "localhost:2345")
    result = client.addition(np.int32(2), np.int32(3))      # returns at once: a StatusOrResult
    if result.is_ok():
        result.get_value()                                   # 5

The transport is ParameterServerStrategy's (``parameter_server/rpc.py``: length-prefixed frames over TCP,
arrays out of band, the job token checked before anything is unpickled); ``"grpc"``, TF's only rpc_layer, is
the name it answers to. Failures carry TF's error codes and types (``md.errors``); docs/rpc.md.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
import time
import weakref

import numpy as np

from ...errors import (INVALID_ARGUMENT, OK, OUT_OF_RANGE, UNIMPLEMENTED, UNKNOWN, DeadlineExceededError,
                        InvalidArgumentError, UnavailableError, UnknownError, exception_type_from_error_code)
from ..._nest import flatten, is_nested, pack_sequence_as
from ...data.structure import TensorSpec, to_leaf
from ...device import device_util
from . import rpc

__all__ = ["Server", "Client", "GrpcServer", "GrpcClient", "StatusOrResult"]

RPC_LAYER = "grpc"
MAX_CONCURRENT_CALLS = 64  # a client's calls in flight at once (each on a connection of its own); more queue
_AS_RETURNED = object()  # the output_specs of a client's per-method attributes: the value as the method returned it

# TF's codes for the exceptions a Python function raises (tf.numpy_function's rule); others are UNKNOWN
_PYTHON_CODES = (((ValueError, TypeError), INVALID_ARGUMENT), (StopIteration, OUT_OF_RANGE),
                 (NotImplementedError, UNIMPLEMENTED))


def _token() -> str:
    """What a client shows before the server unpickles anything: ``MIRRORED_JOB_TOKEN`` where set (the same on
    server and clients), else a constant of this API (which keeps out other services' connections only)."""
    return os.environ.get("MIRRORED_JOB_TOKEN") or hashlib.sha256(b"md.distribute.experimental.rpc").hexdigest()


def _check_rpc_layer(rpc_layer) -> None:
    if rpc_layer != RPC_LAYER:
        raise ValueError(f"rpc_layer={rpc_layer!r}: Only GRPC backend is supported at the moment. Pass "
                         f"rpc_layer={RPC_LAYER!r} (TF's name; mirrored serves it over its own TCP transport)")


def _check_address(address) -> tuple:
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address={address!r}: expected 'host:port', e.g. 'localhost:2345'")
    return host, int(port)


def _check_timeout(timeout_in_ms, argument: str) -> int:
    if isinstance(timeout_in_ms, bool) or not isinstance(timeout_in_ms, (int, np.integer)) or timeout_in_ms < 0:
        raise ValueError(f"{argument}={timeout_in_ms!r}: a whole number of milliseconds >= 0 (0: no timeout)")
    return int(timeout_in_ms)


def _check_method_name(method_name) -> str:
    if not isinstance(method_name, str) or not method_name:
        raise TypeError(f"method_name={method_name!r}: the name the method is registered under, a non-empty str")
    return method_name


def _host_leaf(value, argument: str):
    """One tensor as it travels: a host array (a device array copied; Python numbers as TF converts them)."""
    return device_util.to_host(to_leaf(value, argument))


def _describe(leaf_or_spec) -> str:
    """``float32[2, 3]``: a tensor's (or TensorSpec's) dtype and shape, as errors show them."""
    shape = leaf_or_spec.shape
    dims = "[?]" if getattr(shape, "rank", 0) is None else str([d for d in shape])
    return f"{np.dtype(leaf_or_spec.dtype).name}{dims}"


class _Method:
    """A registered function and the input signature its arguments are checked against (None: any)."""

    def __init__(self, name: str, func, input_signature):
        # An md.function runs its Python function: the arguments are host arrays, which it would not capture
        self.name, self._func = name, getattr(func, "python_function", func)
        self.input_signature = input_signature

    def __call__(self, flat_args):
        if self.input_signature is None:
            result = self._func(*flat_args)
        else:
            specs = flatten(self.input_signature)
            if len(flat_args) != len(specs):
                raise InvalidArgumentError(
                    None, None, f"{self.name} takes {len(specs)} tensor(s) (its input_signature "
                    f"{self.input_signature}), {len(flat_args)} given")
            for i, (spec, arg) in enumerate(zip(specs, flat_args)):
                if not spec.is_compatible_with(arg):
                    raise InvalidArgumentError(
                        None, None, f"{self.name}: Expects arg[{i}] to be {_describe(spec)} but {_describe(arg)} is "
                        "provided")
            result = self._func(*pack_sequence_as(list(self.input_signature), flat_args))
        return None if result is None else pack_sequence_as(
            result, [_host_leaf(x, f"the result of {self.name}") for x in flatten(result)])


def _is_spec(spec) -> bool:
    """A TensorSpec (md.data.TensorSpec, or any spec with its dtype, shape and is_compatible_with)."""
    return isinstance(spec, TensorSpec) or all(hasattr(spec, a) for a in ("dtype", "shape", "is_compatible_with"))


def _input_signature(func):
    """``func.input_signature`` (an md.function's or any callable's), checked: a list or tuple of TensorSpecs."""
    signature = getattr(func, "input_signature", None)
    if signature is None:
        return None
    if not isinstance(signature, (list, tuple)) or not all(_is_spec(s) for s in flatten(signature)):
        raise TypeError(f"func.input_signature={signature!r}: a list of md.data.TensorSpec (nested in tuples, lists or "
                        "dicts), one per argument")
    return list(signature)


class Server:
    """A server of registered functions, which clients call by name (``tf.distribute.experimental.rpc.Server``)."""

    @staticmethod
    def create(rpc_layer, address) -> "GrpcServer":
        """A server for ``address`` (``'host:port'``); ``rpc_layer`` must be ``'grpc'``. Register methods, then
        ``start()``."""
        _check_rpc_layer(rpc_layer)
        return GrpcServer(address)

    def register(self, method_name: str, func):
        raise NotImplementedError("Please use create_server method to create a concrete subclass of Server.")

    def start(self):
        raise NotImplementedError("Please use create_server method to create a concrete subclass of Server.")


class _Methods:
    """A server's registered methods, and the requests it answers (the listener holds this, not the server,
    so that the server's deletion stops it)."""

    def __init__(self):
        self.address = ""
        self._methods: dict = {}
        self._lock = threading.Lock()

    def add(self, method: _Method) -> None:
        with self._lock:
            self._methods[method.name] = method

    def __call__(self, request: str, args):
        if request == "call":
            method_name, flat_args = args
            with self._lock:
                method = self._methods.get(method_name)
                registered = sorted(self._methods)
            if method is None:
                raise InvalidArgumentError(
                    None, None, f"{method_name} is not registered. The server at {self.address} has "
                    f"{registered}; register it with server.register({method_name!r}, func)")
            return method(flat_args)
        if request == "list":
            with self._lock:
                return [(name, method.input_signature) for name, method in self._methods.items()]
        raise InvalidArgumentError(None, None, f"the RPC server has no request {request!r}")


class GrpcServer(Server):
    """The server ``Server.create('grpc', address)`` makes: it serves until ``stop()``, or until it is garbage
    collected (TF's server is a resource, deleted with its object)."""

    def __init__(self, address: str):
        self._host, self._port = _check_address(address)
        self._methods = _Methods()
        self._methods.address = address
        self._listener = None
        self._finalizer = None

    def register(self, method_name: str, func) -> None:
        """Serve ``func`` as ``method_name``: a Python callable or ``md.function`` taking and returning NumPy
        arrays (nested in tuples, lists, dicts). With an ``input_signature`` (``md.function(fn,
        input_signature=[md.data.TensorSpec(...), ...])``) each call's arguments are checked against it."""
        method_name = _check_method_name(method_name)
        if not callable(func):
            raise ValueError(f"func={func!r}: Only functions are supported with Register method: pass a Python "
                             "callable or an md.function taking and returning NumPy arrays")
        self._methods.add(_Method(method_name, func, _input_signature(func)))

    def start(self) -> None:
        """Listen on the address; calls are served from then on (a second ``start`` does nothing)."""
        if self._listener is not None:
            return
        try:
            self._listener = rpc.Listener(self._host, self._port, _token(), self._methods, "rpc-server")
        except OSError as e:
            raise OSError(e.errno, f"the RPC server cannot listen on {self._methods.address}: {e.strerror}; "
                                   "another process may hold the port (pick a free one)") from e
        self._methods.address = f"{self._host}:{self._listener.port}"
        self._finalizer = weakref.finalize(self, self._listener.close)

    @property
    def port(self) -> int | None:
        """The port it listens on once started (mirrored's; useful with port 0, any free port)."""
        return None if self._listener is None else self._listener.port

    def stop(self) -> None:
        """Stop listening and drop the clients' connections (mirrored's; TF's server stops when deleted)."""
        if self._finalizer is not None:
            self._finalizer()


def _status(error: BaseException) -> tuple:
    """``(TF error code, message)`` of the exception a call ended with."""
    code = getattr(error, "error_code", None)
    if code is not None:
        message = str(error)
    else:
        code = next((c for kinds, c in _PYTHON_CODES if isinstance(error, kinds)), UNKNOWN)
        message = f"{type(error).__name__}: {error}"
    return code, "\n".join([message, *getattr(error, "__notes__", ())])


def _raise(code: int, message: str, cause: BaseException):
    try:
        kind = exception_type_from_error_code(code)
    except KeyError:  # a code this version does not know (a newer peer's): TF's UnknownError
        kind = UnknownError
    raise kind(None, None, message) from cause


def _structured(value, output_specs, method_name: str):
    """The method's result as ``output_specs`` describe it (TF's ``get_value``): each tensor checked."""
    if output_specs is _AS_RETURNED:
        return value
    flat = [] if value is None else flatten(value)
    if output_specs is None:
        if flat:
            raise InvalidArgumentError(
                None, None, f"{method_name} returned {len(flat)} tensor(s) and output_specs=None expects none: "
                "pass output_specs (e.g. md.data.TensorSpec([], np.int32)) to call(), or call "
                f"client.{method_name}(...), which returns the result as the method does")
        return None
    specs = flatten(output_specs)
    if len(specs) != len(flat) or not all(spec.is_compatible_with(x) for spec, x in zip(specs, flat)):
        raise InvalidArgumentError(
            None, None, f"{method_name} returned {[_describe(x) for x in flat]}, which output_specs={output_specs} "
            "do not describe: pass the specs of what the method returns")
    return pack_sequence_as(output_specs, flat)


class StatusOrResult:
    """One call's outcome (``tf.distribute.experimental.rpc.StatusOrResult``): each method waits for it."""

    def __init__(self, future: concurrent.futures.Future, output_specs, method_name: str):
        self._future, self._output_specs, self._method_name = future, output_specs, method_name
        self._code = None

    def _wait(self) -> None:
        if self._code is None:
            try:
                self._value, self._error = self._future.result(), None
                self._code, self._message = OK, ""
            except Exception as e:  # the call's failure, reported by code as TF's
                self._value, self._error = None, e
                self._code, self._message = _status(e)

    def is_ok(self) -> np.ndarray:
        """Whether the call succeeded (a bool scalar, as TF's tensor); waits for it."""
        self._wait()
        return np.asarray(self._code == OK)

    def get_error(self) -> tuple:
        """``(error code, message)``: an int64 scalar (``md.OK``, 0, on success) and bytes; waits."""
        self._wait()
        return np.asarray(self._code, np.int64), np.asarray(self._message.encode())

    def get_value(self):
        """The method's result (in ``output_specs``' structure when the call gave them); waits. A failed call
        raises its error as TF's type (``md.InvalidArgumentError``, ``DeadlineExceededError``, ...)."""
        self._wait()
        if self._code != OK:
            _raise(self._code, self._message, self._error)
        return _structured(self._value, self._output_specs, self._method_name)


class Client:
    """A client of one RPC server (``tf.distribute.experimental.rpc.Client``)."""

    @staticmethod
    def create(rpc_layer, address, name="", timeout_in_ms=0) -> "GrpcClient":
        """A client of the server at ``address``; ``rpc_layer`` must be ``'grpc'``. ``timeout_in_ms``: the
        default of its calls (0: none). It asks the server for its registered methods (a server that does not
        answer within the timeout raises ``DeadlineExceededError``) and gets an attribute for each: ``client.m(
        *args)`` (a StatusOrResult) and ``client.m_blocking(*args)`` (the value)."""
        _check_rpc_layer(rpc_layer)
        return GrpcClient(address, name=name, list_registered_methods=True, timeout_in_ms=timeout_in_ms)

    def call(self, method_name: str, args=None, output_specs=None, timeout_in_ms=0):
        raise NotImplementedError("Must be implemented in inherited classes.")


def _close_client(executor, pool) -> None:
    executor.shutdown(wait=False)  # (no join: the collector may run this on one of its threads)
    pool.close()


class GrpcClient(Client):
    """The client ``Client.create('grpc', ...)`` makes. Calls run concurrently, each on a connection of its
    own; ``close()`` (or the collector) ends its threads and connections."""

    def __init__(self, address: str, name: str = "", list_registered_methods=False, timeout_in_ms=0):
        _check_address(address)
        self._address, self._name = address, name
        self._timeout_in_ms = _check_timeout(timeout_in_ms, "timeout_in_ms")
        self._pool = rpc.Pool(address, _token())
        self._executor = concurrent.futures.ThreadPoolExecutor(MAX_CONCURRENT_CALLS, "mirrored-rpc-client")
        self._finalizer = weakref.finalize(self, _close_client, self._executor, self._pool)
        if list_registered_methods:
            listing = self._submit("list", (), _AS_RETURNED, "list", 0, wait=True)
            for method_name, input_signature in listing.get_value():
                self._add_method(method_name, input_signature)

    def _add_method(self, method_name: str, input_signature) -> None:
        # (weakly: the attributes would otherwise keep the client, its threads and connections alive)
        client = weakref.ref(self)
        signature = None if input_signature is None else tuple(input_signature)
        doc = f"RPC Call for {method_name} method to server {self._address}"

        def issue(args, timeout_in_ms, wait):
            if signature is not None:
                _check_structure(args, signature, method_name)
            return client()._call(method_name, args, _AS_RETURNED, timeout_in_ms, wait)

        def call(*args, timeout_in_ms=0):
            return issue(args, timeout_in_ms, wait=False)

        def call_blocking(*args, timeout_in_ms=0):
            return issue(args, timeout_in_ms, wait=True).get_value()

        call.__doc__ = call_blocking.__doc__ = doc
        setattr(self, method_name, call)
        setattr(self, method_name + "_blocking", call_blocking)

    def call(self, method_name: str, args=None, output_specs=None, timeout_in_ms=0) -> StatusOrResult:
        """Call ``method_name`` on the server with ``args`` (a list of arrays, flattened as TF does); returns a
        StatusOrResult at once. ``output_specs``: the structure and specs of the result (None: the method
        returns nothing). ``timeout_in_ms``: 0 uses the client's."""
        return self._call(_check_method_name(method_name), args, output_specs, timeout_in_ms)

    def _call(self, method_name, args, output_specs, timeout_in_ms, wait=False) -> StatusOrResult:
        flat = [_host_leaf(x, f"args[{i}] of {method_name}") for i, x in enumerate(flatten(args or []))]
        return self._submit("call", (method_name, flat), output_specs, method_name, timeout_in_ms, wait)

    def _submit(self, request, args, output_specs, method_name, timeout_in_ms, wait=False) -> StatusOrResult:
        """The request on the client's threads; with ``wait`` on this one (a blocking call: no hand-over)."""
        timeout_in_ms = _check_timeout(timeout_in_ms, "timeout_in_ms") or self._timeout_in_ms
        deadline = time.monotonic() + timeout_in_ms / 1000 if timeout_in_ms else None
        if self._finalizer.alive and not wait:
            future = self._executor.submit(_request, self._pool, request, args, deadline, timeout_in_ms)
        else:
            future = concurrent.futures.Future()
            try:
                if not self._finalizer.alive:
                    raise UnavailableError(None, None, f"the client of {self._address} is closed; create "
                                                  "another with Client.create")
                future.set_result(_request(self._pool, request, args, deadline, timeout_in_ms))
            except Exception as e:  # the call's failure: reported by the StatusOrResult, as from a thread
                future.set_exception(e)
        return StatusOrResult(future, output_specs, method_name)

    def close(self) -> None:
        """End the client's threads and connections (mirrored's; TF's client ends when deleted)."""
        self._finalizer()


def _check_structure(args, signature, method_name: str) -> None:
    """The client-side check of TF's per-method attributes: the arguments nest as the input signature."""
    def shape(x):
        return [shape(v) for v in (x.values() if isinstance(x, dict) else x)] if is_nested(x) else None

    if shape(args) != shape(signature):
        raise ValueError(f"The two structures don't have the same nested structure: {method_name} takes "
                         f"{signature}, the arguments are {args!r:.200}; pass one array per TensorSpec")


def _late(address: str, timeout_in_ms: int) -> DeadlineExceededError:
    return DeadlineExceededError(None, None, f"Deadline Exceeded: the RPC server at {address} did not "
                                        f"answer within {timeout_in_ms} ms; raise timeout_in_ms")


def _request(pool: rpc.Pool, request: str, args, deadline, timeout_in_ms: int):
    """One request: TF's error codes for a deadline and for a server that is down."""
    timeout = None if deadline is None else deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        raise _late(pool.address, timeout_in_ms)  # (it waited in the client's queue past its deadline)
    try:
        return pool.call(request, *args, timeout=timeout)
    except rpc.ReplyTimeout as e:
        raise _late(pool.address, timeout_in_ms) from e
    except rpc.TaskUnavailable as e:
        if deadline is not None and not pool.reached:
            # (TF's client waits for a server that has not started until the deadline)
            raise _late(pool.address, timeout_in_ms) from e
        raise UnavailableError(None, None, f"the RPC server at {pool.address} is unavailable "
                                      f"({e.__cause__ or e}); start it (server.start()) or check the address") from e
