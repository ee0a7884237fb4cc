"""Requests between the tasks of a ParameterServerStrategy job: length-prefixed frames over TCP.

A connection opens with a hello (``MDPS``, the token's length, the job token); the server compares the token
(``hmac.compare_digest``) before it reads anything else, so only the job's tasks get to send a pickle.

A frame is a header ``<4sIQ`` (``MDPS``, how many raw buffers, the pickle's length), the pickle (protocol 5),
then each raw buffer as ``<Q`` length + bytes. Arrays travel out of band (pickle's ``buffer_callback``): their
memory goes to the socket as it is, and arrives in a buffer of its own on which NumPy builds the array without
another copy. A request is ``(method, args)``; the reply ``(True, value)`` or ``(False, exception,
traceback text)``.

Functions travel by reference (module and name, pickle's rule), so every task must be able to import them: the
same program runs on every task. With ``cloudpickle`` installed (optional) functions that cannot be imported
(lambdas, closures, ``__main__``'s) travel by value instead.
"""

from __future__ import annotations

import atexit
import copyreg
import hmac
import io
import pickle
import socket
import struct
import sys
import threading
import time
import traceback

from ...errors import UnavailableError

# md.function's class, known by name: importing distribute.function here would close an import circle
# (it imports the distribute package, which exports the coordinator, which imports this module).
_STEP_FUNCTION = ("mirrored.distribute.function", "Function")

try:  # optional: functions by value (lambdas, closures); never required
    import cloudpickle
except ImportError:  # pragma: no cover - depends on the environment
    cloudpickle = None

MAGIC = b"MDPS"
_HELLO = struct.Struct("<4sI")
_HEADER = struct.Struct("<4sIQ")
_LENGTH = struct.Struct("<Q")
MAX_TOKEN_BYTES = 1024
MAX_UNADMITTED = 64  # connections that have not shown the token yet: more are closed at once (a flood)
COALESCE_BYTES = 64 << 10  # a frame up to this size is written at once (copied together); larger ones in parts
CONNECT_TIMEOUT_SECONDS = 120.0  # a task may start well after the others (a busy machine, a slow scheduler)


class TaskUnavailable(UnavailableError):
    """The task at ``address`` cannot be reached (not started yet, gone, or its connection broke): TF's
    ``UnavailableError`` (a ``ConnectionError`` too)."""

    def __init__(self, message: str, address: str):
        super().__init__(None, None, message)
        self.address = address

    def __reduce__(self):
        return TaskUnavailable, (self.args[0], self.address)


class ReplyTimeout(TimeoutError):
    """The task did not answer within the call's timeout (not a ``TimeoutError`` the remote function raised)."""


class Unpicklable(TypeError):
    """What was to be sent cannot be pickled; the message names it and the fix."""


def _unwrapped(python_function):
    """An ``md.function`` that was not reachable by name: its Python function (which a worker runs anyway)."""
    return python_function


def _reduce_step_function(step):
    module = sys.modules.get(step.__module__)
    if module is not None and getattr(module, step.__qualname__, None) is step:
        return step.__qualname__  # by reference: the module's own md.function
    return _unwrapped, (step.python_function,)


def _reduce_optimizer(optimizer):
    """An optimizer travels with its arguments, not its state: that lives on the ps tasks
    (optimizer_state.py), which every task reaches through handles, so a step's request does not grow with it.
    (Pickled as pickle pickles any object: its class, then its attributes.)"""
    fresh = optimizer._without_state(_strategy=optimizer._strategy, _exclude_ids=optimizer._exclude_ids)
    return copyreg.__newobj__, (type(optimizer),), vars(fresh)


_picklers: dict = {}


def _pickler_class():
    """pickle's Pickler (or cloudpickle's) that also sends ``md.function`` steps."""
    base = cloudpickle.Pickler if cloudpickle is not None else pickle.Pickler
    found = _picklers.get(base)
    if found is None:
        parent = getattr(base, "reducer_override", None)

        def reducer_override(self, obj):
            kind = type(obj)
            if (kind.__module__, kind.__qualname__) == _STEP_FUNCTION:
                return _reduce_step_function(obj)
            if callable(getattr(kind, "_without_state", None)):  # (an md optimizer, known by its method)
                return _reduce_optimizer(obj)
            return parent(self, obj) if parent is not None else NotImplemented

        found = _picklers[base] = type("TaskPickler", (base,), {"reducer_override": reducer_override})
    return found


def dumps(obj, what: str) -> tuple:
    """``obj`` as ``(pickle bytes, [raw buffers])``; ``what`` names it in the error when it cannot be pickled."""
    buffers = []
    stream = io.BytesIO()
    pickler = _pickler_class()(stream, protocol=5, buffer_callback=buffers.append)
    try:
        pickler.dump(obj)
    except Exception as e:  # pickle raises PicklingError, TypeError or AttributeError, as the object decides
        if cloudpickle is None:
            fix = ("define it at module level of a module every task imports (the same program runs on every "
                   "task), and pass what it uses as arguments (or install cloudpickle, which sends lambdas and "
                   "closures by value)")
        else:
            fix = ("pass only picklable objects (arrays, numbers, md variables, iterators of "
                   "create_per_worker_dataset), and keep locks, sockets and open files out of what it refers to")
        raise Unpicklable(f"{what} cannot be sent to another task: {type(e).__name__}: {e}; {fix}") from e
    return stream.getbuffer(), [b.raw() for b in buffers]


def _loads(data, *buffers):
    return pickle.loads(data, buffers=buffers)


class Pickled:
    """An object pickled once and sent as it is, to any number of tasks (a scheduled closure): its arrays stay
    out of band. It arrives unpickled, on the receiving task's request thread."""

    def __init__(self, obj, what: str):
        self._data, self._buffers = dumps(obj, what)

    def __reduce__(self):
        return _loads, (bytes(self._data), *map(pickle.PickleBuffer, self._buffers))


def send(sock: socket.socket, obj, what: str = "the request") -> int:
    """Write ``obj`` as one frame; returns the bytes written."""
    data, buffers = dumps(obj, what)
    header = _HEADER.pack(MAGIC, len(buffers), len(data))
    size = _HEADER.size + len(data) + sum(_LENGTH.size + b.nbytes for b in buffers)
    if size <= COALESCE_BYTES:  # one write: one packet, and one wake-up of the reader (not one per buffer)
        sock.sendall(b"".join([header, data, *(part for b in buffers for part in (_LENGTH.pack(b.nbytes), b))]))
        return size
    sock.sendall(header + bytes(data))
    sent = _HEADER.size + len(data)
    for buffer in buffers:
        sock.sendall(_LENGTH.pack(buffer.nbytes))
        sock.sendall(buffer)
        sent += _LENGTH.size + buffer.nbytes
    return sent


def read_exactly(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buffer


def receive(sock: socket.socket) -> tuple:
    """One frame's object (its arrays built on the received buffers), and the frame's size in bytes."""
    magic, count, length = _HEADER.unpack(read_exactly(sock, _HEADER.size))
    if magic != MAGIC:
        raise ConnectionError(f"the peer sent {bytes(magic)!r} where a frame starts; it is not a task of this job")
    data = read_exactly(sock, length)
    buffers = [read_exactly(sock, _LENGTH.unpack(read_exactly(sock, _LENGTH.size))[0]) for _ in range(count)]
    size = _HEADER.size + length + sum(_LENGTH.size + len(b) for b in buffers)
    return pickle.loads(data, buffers=buffers), size


class Connection:
    """A client connection to one task; ``call`` is one request and its reply (one caller at a time)."""

    def __init__(self, address: str, token: str, timeout: float | None = CONNECT_TIMEOUT_SECONDS,
                 cancel: threading.Event | None = None):
        host, _, port = address.rpartition(":")
        self.address = address
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:  # the task may not listen yet: retry until the deadline (TF's workers wait for the ps too)
            try:
                self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10.0)
                break
            except OSError as e:
                if (deadline is not None and time.monotonic() + delay > deadline) or (
                        cancel is not None and cancel.is_set()):
                    raise TaskUnavailable(f"cannot reach the task at {address} within {timeout:g} s: {e}; start "
                                          "its md.distribute.Server (server.join()) or check the cluster spec's "
                                          "address", address) from e
                if cancel is not None:
                    cancel.wait(delay)  # back-off between connection attempts (cut short by cancel)
                else:
                    time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        secret = token.encode()
        self._sock.sendall(_HELLO.pack(MAGIC, len(secret)) + secret)
        self._lock = threading.Lock()
        self.bytes_sent = 0

    def call(self, method: str, *args, timeout: float | None = None):
        """``method(*args)`` on the task; its exception is raised here, with the remote traceback as a note.
        ``timeout`` (seconds) bounds the reply: past it the connection closes (a late reply would be read as
        the next call's) and ``ReplyTimeout`` is raised."""
        with self._lock:
            try:
                self._sock.settimeout(timeout)
                self.bytes_sent += send(self._sock, (method, args), f"the arguments of {method}")
                reply, _ = receive(self._sock)
            except Unpicklable:
                raise
            except TimeoutError as e:  # (socket.timeout: before OSError, of which it is one)
                self.close()
                raise ReplyTimeout(f"the task at {self.address} did not answer {method} within {timeout:g} s") \
                    from e
            except (OSError, EOFError, pickle.UnpicklingError, struct.error) as e:
                self.close()
                raise TaskUnavailable(f"the task at {self.address} is unavailable ({method}): {e}",
                                      self.address) from e
        if reply[0]:
            return reply[1]
        error, remote_traceback = reply[1], reply[2]
        error.add_note(f"Traceback on the task at {self.address}:\n{remote_traceback}")
        raise error

    def close(self) -> None:
        """Close the connection; a call blocked on it in another thread fails at once (the heartbeat's way to
        let go of a hung worker: a plain close would leave that thread waiting)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # (not connected any more)
        try:
            self._sock.close()
        except OSError:
            pass


class Pool:
    """Idle connections to one task, so concurrent callers each get one (a worker's closure threads, reads)."""

    def __init__(self, address: str, token: str):
        self.address, self._token = address, token
        self._reached = False
        self._closed = False
        self._idle: list = []
        self._lock = threading.Lock()

    @property
    def reached(self) -> bool:
        """Whether a connection to the task ever opened (it has started, at least)."""
        return self._reached

    def call(self, method: str, *args, timeout: float | None = None):
        """``method(*args)`` on an idle connection; ``timeout`` (seconds) bounds connecting and the reply."""
        with self._lock:
            connection = self._idle.pop() if self._idle else None
        if connection is None:
            # Waits for a task that has not started yet; one that answered before and is gone fails at once.
            wait = 0 if self._reached else CONNECT_TIMEOUT_SECONDS
            start = time.monotonic()
            connection = Connection(self.address, self._token, timeout=wait if timeout is None else min(wait, timeout))
            self._reached = True
            if timeout is not None:
                timeout = max(timeout - (time.monotonic() - start), 1e-3)
        try:
            result = connection.call(method, *args, timeout=timeout)
        except (TaskUnavailable, ReplyTimeout):
            raise  # (the connection closed itself)
        except BaseException:
            self._release(connection)
            raise
        self._release(connection)
        return result

    def _release(self, connection: Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(connection)
                return
        connection.close()  # (a call that was in flight when the pool closed)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


_pools: dict = {}
_pools_lock = threading.Lock()


@atexit.register
def _close_pools() -> None:
    """Close this process's idle connections before it ends (not left to the collector's warnings)."""
    with _pools_lock:
        pools = list(_pools.values())
    for found in pools:
        found.close()


def pool(address: str, token: str) -> Pool:
    """This process's connections to the task at ``address`` (one pool per address and token)."""
    key = (address, token)
    with _pools_lock:
        found = _pools.get(key)
        if found is None:
            found = _pools[key] = Pool(address, token)
        return found


class Listener:
    """Serves requests on ``host:port``: one thread per connection, ``handle(method, args)`` per request."""

    def __init__(self, host: str, port: int, token: str, handle, name: str, on_thread=None):
        self._sock = socket.create_server((host.strip("[]"), port), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._token, self._handle, self._name, self._on_thread = token.encode(), handle, name, on_thread
        self._clients: set = set()
        self._lock = threading.Lock()
        self._closed = False
        self._unadmitted = 0
        self.requests = self.bytes_received = self.bytes_sent = 0  # (served so far: the benchmark reads them)
        self._thread = threading.Thread(target=self._accept, name=f"mirrored-{name}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    client.close()
                    return
                if self._unadmitted >= MAX_UNADMITTED:
                    client.close()
                    continue
                self._unadmitted += 1
                self._clients.add(client)
            threading.Thread(target=self._serve, args=(client,), name=f"mirrored-{self._name}-conn",
                             daemon=True).start()

    def _admitted(self, client: socket.socket) -> bool:
        client.settimeout(30.0)  # a hello is a few bytes: a peer that sends none is not a task of the job
        magic, length = _HELLO.unpack(read_exactly(client, _HELLO.size))
        if magic != MAGIC or length > MAX_TOKEN_BYTES:
            return False
        admitted = hmac.compare_digest(bytes(read_exactly(client, length)), self._token)
        client.settimeout(None)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return admitted

    def _serve(self, client: socket.socket) -> None:
        try:
            try:
                admitted = self._admitted(client)
            finally:
                with self._lock:
                    self._unadmitted -= 1
            if not admitted:
                return
            if self._on_thread is not None:
                self._on_thread()
            while True:
                (method, args), received = receive(client)
                try:
                    reply = (True, self._handle(method, args))
                except BaseException as e:  # the caller's error: sent back, the server goes on
                    reply = (False, e, traceback.format_exc())
                try:
                    sent = send(client, reply, f"the result of {method}")
                except Unpicklable as e:  # (an exception that cannot be pickled arrives as a RuntimeError)
                    error = e if reply[0] else RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")
                    sent = send(client, (False, error, traceback.format_exc() if reply[0] else reply[2]))
                with self._lock:
                    self.requests += 1
                    self.bytes_received += received
                    self.bytes_sent += sent
        except (OSError, EOFError, ConnectionError, pickle.UnpicklingError, struct.error):
            pass  # the peer went away (or was not one of ours): its connection ends, the server goes on
        finally:
            with self._lock:
                self._clients.discard(client)
            client.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients), set()
        for s in [self._sock] + clients:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked in accept / recv
            except OSError:
                pass
            s.close()
        self._thread.join()
