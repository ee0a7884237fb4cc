"""``md.train.Checkpoint`` (alias ``md.Checkpoint``): save and restore variables and optimizer state.

    ckpt = md.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save("out/ckpt")       # out/ckpt-1, out/ckpt-2, ...; atomic; only the chief writes
    ckpt.restore(path).assert_consumed()   # any replica count; a mismatch assigns nothing
    ckpt.write("out/model.ckpt")       # exactly this file (no counter)

``md.train.CheckpointManager`` (train.py) keeps the newest few.
Python numbers cannot be tracked (a restore could not write them back): pass
``md.Variable``s. ``save`` counts in ``save_counter``, itself saved.

What is saved: every ``md.Variable`` reachable from the keyword arguments —
directly, in dicts/lists/tuples, or as public attributes of plain objects
(a model class) — under its path (``model/w1``, ``model/layers/0/b``), and for
an optimizer its state under Keras 3's names: ``_iterations``,
``_learning_rate``, and its slots numbered in Keras' build order
(``optimizer/_variables/2``). The file names each by TensorFlow's tensor name
for that path (``model/w1/.ATTRIBUTES/VARIABLE_VALUE``), as ``list_variables``
shows. A value whose variable does not exist yet at restore waits on the
``md.Module`` or ``Checkpoint`` that will hold it, an optimizer's slots on
its build (TensorFlow's and Keras' deferred restoration). Values are the
variables' cross-replica values, so a checkpoint written with 4 replicas
restores into 1 or 8.

File format (one file, little-endian)::

    8 bytes   magic  b"MDCKPT\\x00" + format version byte
    8 bytes   length of the JSON index
    ...       JSON index: {"entries": [{"key", "dtype", "shape", "offset", "nbytes"}], "data_bytes",
              "aliases" (optional: the other paths of shared objects -> their name)}
    ...       the arrays' bytes, C order, at their offsets
    32 bytes  SHA-256 of everything above

The trailing digest catches truncated and corrupted files; a save writes a
temporary file in the same directory and renames it over ``path`` only once
complete, so an interrupted save leaves the previous checkpoint intact.
A restore streams (``CheckpointReader``): header and index checked first,
the digest verified in chunks, then one variable read and assigned at a time.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import socket
import stat
import struct
import threading
import types
import uuid
import weakref

import numpy as np

from ..errors import ResourceExhaustedError, from_os_error
from .checkpoint_io import (_MAGIC, _MAX_INDEX, CheckpointError, DamagedCheckpointError, KeyNotFoundError,
                            NotFoundError, damaged, open_regular_file, read_into)

__all__ = ["Checkpoint", "CheckpointLoadStatus", "load_checkpoint", "CheckpointError", "NotFoundError"]

_ATTRIBUTES = ".ATTRIBUTES"  # key infix of a self-saving object's tensors, as in TensorFlow's checkpoints
_VERSION = 1
_DIGEST = 32
_VALUE = f"{_ATTRIBUTES}/VARIABLE_VALUE"  # a variable's tensor, under its object path


def tensor_name(path: str) -> str:
    """The name a variable at object path ``path`` is saved under, TensorFlow's:
    ``model/w/.ATTRIBUTES/VARIABLE_VALUE``."""
    return f"{path}/{_VALUE}" if path else _VALUE


def object_path(name: str) -> str:
    """The object path of a saved tensor's ``name`` (the inverse of ``tensor_name``); a name without TensorFlow's
    suffix (files mirrored wrote before it used TensorFlow's names, an iterator's state) is its own path."""
    if name == _VALUE:
        return ""
    return name[:-len(_VALUE) - 1] if name.endswith("/" + _VALUE) else name


# --- the file format ------------------------------------------------------------------------------

def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401  registers bfloat16 with NumPy

        return np.dtype(name)


_CHUNK = 4 << 20  # bytes read or hashed at a time: bounds the memory a restore needs beyond its variables

# Temporaries are named ``.{target}.tmp-{host}-{pid}-{id}``: a later save on this host can tell a dead
# writer's leftovers (a SIGKILL mid-save) from a live writer's file in progress.
_HOST = socket.gethostname().replace("-", "_") or "host"
_TMP = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _temporary_name(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)),
                        f".{os.path.basename(path)}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


_IN_FLIGHT = set()  # this process's temporaries being written (any thread)


def _writer_alive(pid: int, written_at: float) -> bool:
    """Whether process ``pid`` may still be writing a temporary last modified at ``written_at``.

    A process that started after the file was written is a later one that
    reused the PID (common after a restart in a container): not the writer.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    started = _start_time(pid)
    return started is None or started <= written_at + 1.0


def _start_time(pid: int):
    """When process ``pid`` started (seconds since the epoch), from /proc; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def sweep_stale_temporaries(directory: str, owns) -> list:
    """Delete the temporaries of saves interrupted on this host (their writer is dead); returns their paths.

    ``owns(target)`` says whether a temporary's target name (``ckpt-7``) is the
    caller's: a manager sweeps only its own prefix's leftovers.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if m is None or m["host"] != _HOST or not owns(m["target"]):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if path in _IN_FLIGHT or not stat.S_ISREG(info.st_mode) or _writer_alive(int(m["pid"]), info.st_mtime):
                continue  # a save in progress, here or in another live process
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass  # another task swept it first
    return removed


class _RemoveOnSigterm:
    """While a save is in flight in the main thread, a SIGTERM that would end the process removes its temporary.

    The launcher stops surviving tasks with SIGTERM, whose default action ends
    the process without running ``finally`` blocks. A Python handler (e.g.
    the preemption handler's) is called instead and the save goes on.
    """

    def __init__(self, tmp: str):
        self._tmp = tmp
        self._previous = None
        self._installed = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            try:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
                self._installed = True
            except ValueError:  # not the main interpreter
                pass
        return self

    def _handle(self, signum, frame):
        previous = self._previous
        if callable(previous):
            previous(signum, frame)  # its choice; an exception it raises unwinds through the save's cleanup
            return
        if previous == signal.SIG_IGN:
            return
        try:
            os.remove(self._tmp)
        except OSError:
            pass
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends as it would have

    def __exit__(self, *exc):
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        return False


@contextlib.contextmanager
def replacing(path: str):
    """Yield a temporary path beside ``path`` to write; renamed over ``path`` when the block completes.

    Whatever stops the write (an error, Ctrl-C, a SIGTERM with its default
    action) removes the temporary and leaves ``path`` as it was; a SIGKILL
    leaves it to the next save's sweep.
    """
    tmp = _temporary_name(path)
    _IN_FLIGHT.add(tmp)
    try:
        with _RemoveOnSigterm(tmp):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        _IN_FLIGHT.discard(tmp)


def _write_atomic(path: str, arrays: dict, aliases=None) -> None:
    """Write ``arrays`` (key -> host ndarray) to ``path`` via a temporary file + rename; ``aliases``: the other
    paths of shared objects (``_walk``), so a restore finds them along either path, as in TF's object graph."""
    entries, offset = [], 0
    for key, arr in arrays.items():
        entries.append({"key": key, "dtype": arr.dtype.name, "shape": list(arr.shape),
                        "offset": offset, "nbytes": arr.nbytes})
        offset += arr.nbytes
    index = json.dumps({"entries": entries, "data_bytes": offset, **({"aliases": aliases} if aliases else {})}
                       ).encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    _make_directory(directory, path)
    digest = hashlib.sha256()
    with replacing(path) as tmp:
        try:
            f = open(tmp, "wb")
        except OSError as e:
            raise from_os_error(e, f"cannot write checkpoint {path!r}: directory {directory!r} is not writable "
                                   f"({e.strerror}); pick a directory this process may write") from None
        with f:
            for chunk in (_MAGIC + bytes([_VERSION]), struct.pack("<Q", len(index)), index,
                          *(a.reshape(-1).view(np.uint8) for a in arrays.values())):  # bytes of any dtype
                digest.update(chunk)
                f.write(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
    try:  # make the rename itself durable where the platform allows
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _make_directory(directory: str, path: str) -> None:
    """Create the checkpoint's directory (and parents) if missing, naming it in any error."""
    if os.path.isdir(directory):
        return
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise from_os_error(e, f"cannot write checkpoint {path!r}: cannot create directory {directory!r} "
                               f"({e.strerror}); pick a directory this process may write") from None


def _check_memory(path: str, nbytes: int) -> None:
    """ResourceExhaustedError (a MemoryError), naming the file, for a checkpoint larger than the memory this
    machine has left.

    Linux overcommits: allocating too much succeeds and the process is then
    killed when the pages are touched, so ask first.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = dict(line.split(":", 1) for line in f)
        available = (int(info["MemAvailable"].split()[0]) + int(info["SwapFree"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return  # not Linux: the allocator will raise MemoryError itself
    if nbytes > available:
        raise ResourceExhaustedError(None, None, f"path={path!r} holds {nbytes} bytes of variables, more than the "
                                     f"{available} bytes of memory available; restore it on a machine with more "
                                     "memory")


_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "int4", "uint4")


def _entry_dtype(path: str, key: str, name) -> np.dtype:
    """The dtype of an index entry: numeric or bool only (an ``object`` dtype would unpickle, a str has no size)."""
    if not isinstance(name, str):
        raise damaged(f"path={path!r}: entry {key!r} has dtype {name!r}, not a dtype name; the file is damaged")
    if name in _ML_DTYPES:
        import ml_dtypes  # noqa: F401  registers them with NumPy

    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not (dtype.kind in "biufc" or name in _ML_DTYPES) or dtype.hasobject:
        raise CheckpointError(f"path={path!r}: entry {key!r} has dtype {name!r}, which a checkpoint cannot hold "
                              "(numeric and bool dtypes only); the file is damaged or not written by mirrored")
    return dtype


class _Entry:
    __slots__ = ("key", "dtype", "shape", "offset", "nbytes")

    def __init__(self, key, dtype, shape, offset, nbytes):
        self.key, self.dtype, self.shape, self.offset, self.nbytes = key, dtype, shape, offset, nbytes


class CheckpointReader:
    """A checkpoint file opened for streaming: header and index checked at once, data read on demand.

    ``verify()`` hashes the whole file in chunks (the SHA-256 trailer);
    ``read(key)`` reads one array. A restore verifies first, then reads and
    assigns one variable at a time, so it needs one variable of memory beyond
    the variables themselves.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self._file = open_regular_file(self.path)
        except NotFoundError:
            hint = _tensorflow_hint(self.path)
            if hint:  # a TensorFlow prefix names no file itself
                raise CheckpointError(f"path={self.path!r} is not a mirrored checkpoint{hint}") from None
            raise
        try:
            self._size = os.fstat(self._file.fileno()).st_size
            self._parse_header()
        except BaseException:
            self._file.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def keys(self) -> list:
        return list(self._entries)

    def entry(self, key: str) -> _Entry:
        return self._entries[key]

    def _damaged(self, what: str) -> DamagedCheckpointError:
        return damaged(f"path={self.path!r} is damaged: {what}; restore an earlier checkpoint")

    def _read_exact(self, offset: int, n: int) -> bytearray:
        out = bytearray(n)
        done = read_into(self._file, offset, memoryview(out))
        if done < n:
            raise self._damaged(f"it ended at byte {offset + done} while {offset + n} were expected (truncated)")
        return out

    def _parse_header(self) -> None:
        path, head = self.path, len(_MAGIC) + 1 + 8
        start = self._read_exact(0, head) if self._size >= head else b""
        if not start.startswith(_MAGIC):
            raise damaged(f"path={path!r} is not a mirrored checkpoint (no {_MAGIC!r} header); "
                                  "pass a file written by md.Checkpoint.save" + _tensorflow_hint(path))
        if start[len(_MAGIC)] != _VERSION:
            raise CheckpointError(f"path={path!r} has checkpoint format version {start[len(_MAGIC)]}, this "
                                  f"mirrored reads version {_VERSION}; upgrade mirrored to read it")
        (index_len,) = struct.unpack_from("<Q", start, len(_MAGIC) + 1)
        if head + index_len + _DIGEST > self._size:
            raise damaged(f"path={path!r} is truncated or damaged ({self._size} bytes, but its header "
                                  f"announces an index of {index_len} bytes); restore an earlier checkpoint")
        if index_len > _MAX_INDEX:
            raise self._damaged(f"its header announces an index of {index_len} bytes, more than the {_MAX_INDEX} "
                                "of any real checkpoint (about 100 bytes per variable)")
        self._index_bytes = self._read_exact(head, index_len)
        self._data_start = head + index_len
        try:
            index = json.loads(self._index_bytes.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise self._damaged(f"its index is not valid JSON ({type(e).__name__})") from None
        if not isinstance(index, dict) or not isinstance(index.get("entries"), list) \
                or not _is_count(index.get("data_bytes")):
            raise self._damaged("its index lacks 'entries' (a list) or 'data_bytes' (a count)")
        data_bytes = index["data_bytes"]
        expected = self._data_start + data_bytes + _DIGEST
        if self._size != expected:
            raise damaged(f"path={path!r} is truncated or damaged ({self._size} bytes; a complete file of "
                                  f"this header has {expected}); restore an earlier checkpoint")
        self._entries, offset = {}, 0
        for e in index["entries"]:
            entry = self._check_entry(e, offset)
            self._entries[entry.key] = entry
            offset += entry.nbytes
        if offset != data_bytes:
            raise self._damaged(f"its entries hold {offset} bytes but data_bytes says {data_bytes}")
        self.aliases = index.get("aliases", {})
        if not isinstance(self.aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in self.aliases.items()):
            raise self._damaged("its 'aliases' is not a mapping of paths to paths")

    def _check_entry(self, e, offset: int) -> _Entry:
        if not isinstance(e, dict) or not isinstance(e.get("key"), str):
            raise self._damaged(f"index entry {str(e)[:80]!r} has no 'key' string")
        key = e["key"]
        if key in self._entries:
            raise self._damaged(f"entry {key!r} appears twice")
        dtype = _entry_dtype(self.path, key, e.get("dtype"))
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._damaged(f"entry {key!r} has shape {shape!r}, not a list of non-negative ints")
        nbytes = dtype.itemsize * math.prod(shape)
        if e.get("nbytes") != nbytes or isinstance(e.get("nbytes"), bool):
            raise self._damaged(f"entry {key!r} has nbytes {e.get('nbytes')!r}, but {dtype.name}{shape} is "
                                f"{nbytes} bytes")
        if e.get("offset") != offset or isinstance(e.get("offset"), bool):
            raise self._damaged(f"entry {key!r} has offset {e.get('offset')!r}, expected {offset} (right after "
                                "the previous entry)")
        return _Entry(key, dtype, tuple(shape), offset, nbytes)

    def verify(self, keys=None) -> None:
        """Check the SHA-256 trailer, reading the file in chunks (memory: one chunk); it covers every key."""
        digest = hashlib.sha256()
        digest.update(self._read_exact(0, self._data_start))
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        end = self._size - _DIGEST
        self._file.seek(self._data_start)
        position = self._data_start
        while position < end:
            got = self._file.readinto(view[:min(_CHUNK, end - position)])
            if not got:
                raise self._damaged(f"it ended at byte {position} while {end} were expected (truncated)")
            digest.update(view[:got])
            position += got
        if digest.digest() != self._read_exact(end, _DIGEST):
            raise damaged(f"path={self.path!r} is corrupted (checksum mismatch); restore an earlier "
                                  "checkpoint")

    def read(self, key: str) -> np.ndarray:
        """One array, read straight into its own buffer (no intermediate copy)."""
        e = self._entries[key]
        _check_memory(self.path, e.nbytes)
        out = np.empty(e.shape, e.dtype)
        if read_into(self._file, self._data_start + e.offset, memoryview(out.reshape(-1).view(np.uint8))) < e.nbytes:
            raise self._damaged(f"it ended inside entry {key!r} (truncated)")
        return out

    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensorflow_hint(path: str) -> str:
    from .tensorbundle import hint

    return hint(path)


class CheckpointValues(dict):
    """What ``load_checkpoint`` returns: every saved array by its object path (``model/w``), and TensorFlow's
    ``CheckpointReader`` methods by its tensor names (``model/w/.ATTRIBUTES/VARIABLE_VALUE``), as
    ``list_variables`` shows them."""

    def __init__(self, arrays: dict):
        super().__init__({object_path(name): value for name, value in arrays.items()})
        self._by_name = arrays

    def get_variable_to_shape_map(self) -> dict:
        return {name: list(np.shape(value)) for name, value in self._by_name.items()}

    def get_variable_to_dtype_map(self) -> dict:
        """``name -> NumPy dtype`` (a string tensor's is ``object``)."""
        return {name: np.asarray(value).dtype for name, value in self._by_name.items()}

    def has_tensor(self, name: str) -> bool:
        return name in self._by_name

    def get_tensor(self, name: str):
        if name not in self._by_name:
            raise KeyNotFoundError(None, None, f"Key {name} not found in checkpoint; it holds {sorted(self._by_name)}")
        return self._by_name[name]


def read_all(reader) -> CheckpointValues:
    """Every array of an open checkpoint (mirrored's ``CheckpointReader`` or TF's ``BundleReader``), checked
    first."""
    _check_memory(reader.path, sum(reader.entry(key).nbytes for key in reader.keys))
    reader.verify(list(reader.keys))
    return CheckpointValues({key: reader.read(key) for key in sorted(reader.keys)})


def load_checkpoint(path) -> CheckpointValues:
    """Every array of mirrored's checkpoint file ``path`` (validated in full): ``model/w`` where
    ``list_variables`` says ``model/w/.ATTRIBUTES/VARIABLE_VALUE`` (``md.train.load_checkpoint`` reads
    directories and TensorFlow's files too)."""
    with CheckpointReader(path) as reader:
        return read_all(reader)


# --- which objects hold which variables -----------------------------------------------------------

def _is_variable(obj) -> bool:
    from ..distribute import values

    return isinstance(obj, values.Variable)


def _walk(roots, found: dict, optimizers: list, seen: dict, aliases: dict) -> None:
    """Collect ``path -> variable`` for every variable under ``roots`` (``(path, object)`` pairs).

    As TensorFlow names an object tracked under several paths: breadth first, children in the order they were
    attached (a module's attributes, a dict's keys as inserted), so the shortest path wins, and among paths of
    one length the first attached. ``seen``: ``id -> path`` of every object; ``aliases``: each other path to an
    object (below its parent's path) -> the path it is named by, which TF's object graph holds as a second edge.
    """
    from .optimizers.base import Optimizer

    queue = collections.deque(roots)
    while queue:
        path, obj = queue.popleft()
        if id(obj) in seen:
            if seen[id(obj)] != path:
                aliases[path] = seen[id(obj)]
            continue
        seen[id(obj)] = path
        if _is_variable(obj):
            found[path] = obj
        elif isinstance(obj, Optimizer):
            optimizers.append((path, obj))
            # Keras 3 tracks the variables it was built for: a model variable reached first there is named there.
            built = [var for var, _ in obj._slots.values()]
            if built:
                queue.append((_join(path, "_trainable_variables"), built))
        else:
            queue.extend((_join(path, key), child) for key, child in _children(obj).items())


def canonical(path: str, aliases: dict) -> str:
    """The path a file names the object at ``path`` by, following its ``aliases`` (see ``_walk``) name by name."""
    current = ""
    for name in path.split("/") if path else ():
        current = _join(current, name)
        current = aliases.get(current, current)
    return current


def _resolve_aliases(keys: dict, file_aliases: dict, variables: dict, own_aliases: dict) -> dict:
    """``keys`` (the file's ``path -> tensor name``) with the entry of each tracked variable the file names by
    another path moved to the variable's path: as TensorFlow matches objects along any edge of the object graph,
    a shared variable restores through whichever of its paths both sides have."""
    keys = dict(keys)
    other_paths = collections.defaultdict(list)
    for alias, target in own_aliases.items():
        other_paths[target].append(alias)
    for path in variables:
        if path in keys:
            continue
        for candidate in [path] + other_paths[path]:
            named = canonical(candidate, file_aliases)
            if named in keys and named not in variables:
                keys[path] = keys.pop(named)
                break
    return keys


_ITERATIONS = "_iterations"  # an optimizer's step counter, under Keras 3's attribute name


def _children(obj) -> dict:
    """``name -> child`` of a tracked container or object, in the order they were attached.

    md.Module tracks its private attributes too, as tf.Module does: it names its children itself.
    """
    if isinstance(obj, dict):
        return {str(key): value for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return {str(i): item for i, item in enumerate(obj)}
    if hasattr(obj, "_trackable_children"):
        return obj._trackable_children()
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
        return {key: value for key, value in vars(obj).items() if not key.startswith("_")}
    return {}


# --- deferred restoration: values restored before their variables exist ------------------------------------

# id(holder) -> {path below it: _Pending}; by id, as a holder may be unhashable (a class with __eq__), and
# dropped when the holder is collected.
_DEFERRED = {}


class _Pending:
    """A restored value waiting for its variable; read from the file when a holder is found for it."""

    def __init__(self, path: str, key: str, status, read):
        self.path, self.key, self.status, self._read, self._value = path, key, status, read, None

    def value(self) -> np.ndarray:
        if self._value is None:
            self._value = self._read()
            self._read = None  # the reader is closed once restore() returns
        return self._value


def _defer(obj, path: str, pending: _Pending, assign: bool = True) -> None:
    """Assign ``pending`` to the variable at ``path`` below ``obj``, or leave it with the deepest existing object
    that will be told of a new child (a class with ``_defers_restoration``: md.Module, Checkpoint); a value
    with no such holder is dropped (the status still reports it). ``assign=False``: a variable found there is
    already restored under another path (the first path names a shared variable), so it is left alone."""
    names = path.split("/") if path else []
    for i, name in enumerate(names):
        children = _children(obj)
        if name not in children:
            if getattr(type(obj), "_defers_restoration", False):
                pending.value()
                if id(obj) not in _DEFERRED:
                    _DEFERRED[id(obj)] = {}
                    weakref.finalize(obj, _DEFERRED.pop, id(obj), None)
                _DEFERRED[id(obj)]["/".join(names[i:])] = pending
            return
        obj = children[name]
    if assign and _is_variable(obj):
        _assign_pending(obj, pending)


def _assign_pending(var, pending: _Pending, what: str = "") -> None:
    """Assign a waiting value to the variable created for it, its shape and dtype checked; the status claims it."""
    value = pending.value()
    if tuple(value.shape) != tuple(var.shape) or value.dtype != np.dtype(var.dtype):
        raise CheckpointError(
            f"path={pending.path!r}: {pending.key}{what} has {value.dtype}{list(value.shape)} (a shape or dtype "
            f"mismatch), the variable created for it is {np.dtype(var.dtype)}{list(var.shape)}; create it "
            "with the shape and dtype it was saved with")
    var.assign(value)
    pending.status._claim(pending.key)


def attached(holder, name: str, value) -> None:
    """``holder.name = value`` happened: restore into ``value`` what a restore left waiting there."""
    waiting = _DEFERRED.get(id(holder))
    if not waiting:
        return
    for path in [p for p in waiting if p == name or p.startswith(name + "/")]:
        _defer(value, path[len(name) + 1:], waiting.pop(path))


def _join(path: str, name) -> str:
    """A child's object path: its name under the root object (path ``""``), else ``parent/name``."""
    return f"{path}/{name}" if path else str(name)


def _optimizer_state(path: str, optimizer) -> dict:
    """``key -> state`` of ``optimizer`` under Keras 3's names: ``_iterations``, its scalars (``_learning_rate``,
    Nadam's ``_u_product``) and its slots numbered as Keras' ``_variables`` (build order)."""
    state = {} if optimizer._iterations is None else {_join(path, _ITERATIONS): optimizer._iterations}
    for name, value in optimizer._keras_scalars().items():
        state[_join(path, name)] = _OptimizerScalar(optimizer, name, value)
    for index, (_, _, slot) in optimizer._keras_variables().items():
        state[_join(path, f"{_SLOTS}/{index}")] = slot
    return state


_SLOTS = "_variables"  # Keras 3's list of an optimizer's variables, which names its slots by position
_LEGACY_SLOTS = "slots"  # files of mirrored before Keras' names: optimizer/slots/<variable path>/<slot name>


class _OptimizerScalar:
    """A scalar Keras 3 keeps in a variable and mirrored's optimizer in a Python number (the learning rate,
    Nadam's ``u_product``): saved and restored under Keras' name, as a variable would be."""

    def __init__(self, optimizer, name: str, value):
        self._optimizer, self._name, self._value = optimizer, name, np.asarray(value)
        self.shape, self.dtype = (), self._value.dtype

    def numpy(self) -> np.ndarray:
        return self._value

    def assign(self, value) -> None:
        self._optimizer._restore_keras_scalar(self._name, np.asarray(value)[()])


def _slot_description(optimizer, index: int) -> str:
    var, slot_name, _ = optimizer._keras_variables()[index]
    return f"the {slot_name} of variable {var.name!r}"


def _layout_problem(path: str, optimizer, file_keys) -> str | None:
    """Why the file's slots (``file_keys``: its object paths) cannot be ``optimizer``'s: their ``_variables``
    numbers differ, as when another optimizer kind or configuration wrote them; else None."""
    prefix = _join(path, f"{_SLOTS}/")
    saved = sorted(int(k[len(prefix):]) for k in file_keys if k.startswith(prefix) and k[len(prefix):].isdigit())
    ours = sorted(optimizer._keras_variables())
    if not saved or saved == ours:
        return None

    def numbers(indices):
        return f"{prefix}{indices[0]}..{indices[-1]} ({len(indices)})" if indices else "none"

    slots = ", ".join(dict.fromkeys(name for _, name, _ in optimizer._keras_variables().values())) or "no slots"
    return (f"{path}: the file holds the slot variables {numbers(saved)}, {type(optimizer).__name__} "
            f"{optimizer.name!r} has {numbers(ours)} ({slots} of {len(optimizer._slots)} variables): the checkpoint "
            "was written by another optimizer kind or configuration (amsgrad, momentum, centered, use_ema, "
            "gradient_accumulation_steps and a learning-rate schedule change Keras' numbering); create the "
            "optimizer it was saved with")


class _RestoreAtBuild:
    """The optimizer's ``_restore_on_build``: assign the values a restore left ``waiting`` (``key -> _Pending``)
    to the state its build just created, as Keras' deferred restoration does. Picklable (its values read
    already): ParameterServerStrategy sends it to the ps task that builds the state."""

    def __init__(self, path: str, save_path: str, waiting: dict):
        self._path, self._save_path, self._waiting = path, save_path, waiting

    def __call__(self, optimizer) -> None:
        path, waiting = self._path, self._waiting
        problem = _layout_problem(path, optimizer, waiting)
        if problem:
            raise CheckpointError(f"path={self._save_path!r}: {problem}")
        state = _optimizer_state(path, optimizer)
        for key in [k for k in waiting if k in state]:
            _assign_pending(state[key], waiting.pop(key), _slot_of(path, optimizer, key))


def _built_state(path: str, key: str) -> bool:
    """Whether ``key`` names state the optimizer at ``path`` creates at its build: a slot, Nadam's u_product."""
    rest = key[len(path) + 1:] if path and key.startswith(path + "/") else key if not path else ""
    return rest.startswith(f"{_SLOTS}/") or rest == "_u_product"


def _slot_of(path: str, optimizer, key: str) -> str:
    """`` (the momentum of variable 'w')`` for a slot's key, else ``""``: what an error names."""
    prefix = _join(path, f"{_SLOTS}/")
    number = key[len(prefix):] if key.startswith(prefix) else ""
    if number.isdigit() and int(number) in optimizer._keras_variables():
        return f" ({_slot_description(optimizer, int(number))})"
    return ""


class CheckpointLoadStatus:
    """What ``Checkpoint.restore`` returns, as ``tf.train.Checkpoint.restore`` does.

    Two kinds of mismatch are allowed by ``restore`` (as in TensorFlow) and
    reported here: entries of the file that no tracked object claimed, and
    tracked variables the file has no value for (they keep their values).
    """

    def __init__(self, path, unused_keys, restored_keys, unmatched=()):
        self._save_path = path
        self._unused = sorted(unused_keys)
        self._restored = sorted(restored_keys)
        self._unmatched = sorted(unmatched)  # paths of tracked variables the file lacks
        self._partial_expected = False

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Raise AssertionError unless every entry of the file was restored and every variable got a value."""
        if self._unused:
            raise AssertionError(
                f"Unresolved object in checkpoint {self._save_path!r}: {', '.join(self._unused)} "
                "(not claimed by any object of this Checkpoint); pass those objects too, or call "
                "expect_partial() when a partial restore is intended")
        return self.assert_existing_objects_matched()

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Raise AssertionError if a tracked variable had no value in the file (it kept its value)."""
        if self._unmatched:
            raise AssertionError(
                f"Found {len(self._unmatched)} Python objects that were not bound to checkpointed values, "
                f"likely due to changes in the Python program: {', '.join(self._unmatched)} "
                f"(not in checkpoint {self._save_path!r})")
        return self

    def assert_nontrivial_match(self) -> "CheckpointLoadStatus":
        """Raise AssertionError if nothing at all was restored."""
        if not self._restored:
            raise AssertionError(f"nothing in checkpoint {self._save_path!r} matched an object of this "
                                 "Checkpoint; pass the objects it was saved from")
        return self

    def _claim(self, key: str) -> None:
        """``key`` was restored later, into a variable created after the restore (deferred restoration); a value
        waiting under several paths (a shared object) is claimed once."""
        if key in self._unused:
            self._unused.remove(key)
            self._restored.append(key)

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Mark entries of the file that no object claims as expected (e.g. a model-only restore)."""
        self._partial_expected = True
        return self

    def run_restore_ops(self, session=None) -> None:
        """Nothing to run: values are assigned eagerly by ``restore``."""

    def initialize_or_restore(self, session=None) -> None:
        """Nothing to run: values are assigned eagerly by ``restore``."""


class InitializationOnlyStatus(CheckpointLoadStatus):
    """What ``restore(None)`` returns: nothing was restored, variables keep their initial values."""

    def __init__(self):
        super().__init__(None, (), ())

    def assert_consumed(self):
        raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")

    def assert_existing_objects_matched(self):
        raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")

    def assert_nontrivial_match(self):
        raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")


# Values a Checkpoint cannot track: they are immutable, so a restore could never write them back.
_UNTRACKABLE = (bool, int, float, complex, str, bytes, np.generic, np.ndarray, type(None))


# --- the directory's state file (read by checkpoint_management, written here and there) ----------

STATE_FILE = "checkpoint"


def _write_state(directory: str, latest: str, paths, timestamps, last_preserved) -> None:
    """Write the directory's state file atomically (temporary file + rename)."""

    def relative(p):
        p = os.path.abspath(p)
        return os.path.relpath(p, directory) if os.path.dirname(p) == directory else p

    lines = [f"model_checkpoint_path: {json.dumps(relative(latest), ensure_ascii=False)}"]
    lines += [f"all_model_checkpoint_paths: {json.dumps(relative(p), ensure_ascii=False)}" for p in paths]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in timestamps]
    if last_preserved is not None:
        lines.append(f"last_preserved_timestamp: {float(last_preserved)!r}")
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, STATE_FILE)
    with replacing(target) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _record_latest(directory: str, path: str) -> None:
    """What ``Checkpoint.save`` records: ``path`` as the latest and only checkpoint (no times, as TF)."""
    _write_state(os.path.abspath(directory), path, [path], [], None)


class Checkpoint:
    """Groups the objects to save, as ``tf.train.Checkpoint``: ``md.train.Checkpoint(model=..., optimizer=...)``.

    ``save(prefix)`` writes ``prefix-N`` (N = ``save_counter``, which it
    increments) and records it in the directory's ``checkpoint`` state file,
    so ``md.train.latest_checkpoint(directory)`` finds it; ``write(path)``
    writes exactly ``path``. ``restore(path)`` / ``read(path)`` load a file and
    return a status with ``assert_consumed()`` and ``expect_partial()``.
    """

    _defers_restoration = True  # __setattr__ calls attached()

    def __init__(self, root=None, **objects):
        # As TensorFlow: a ``root``'s own children are saved at the top level (``w``, not ``root/w``), beside
        # the keyword arguments.
        if root is not None:
            _check_trackable("root", root)
        for name, obj in objects.items():
            _check_trackable(name, obj)
        self._root = root
        self._objects = dict(sorted(objects.items()))  # as TensorFlow: keyword arguments by name, then attributes
        self._save_counter = None
        self._aliases = {}  # the other paths of shared objects, as the last walk found them (_walk)

    def __setattr__(self, name, value):
        # As tf.train.Checkpoint: ``ckpt.model = model`` after construction tracks it too.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"Checkpoint.{name} cannot be set; pick another name for the object")
        if isinstance(value, _UNTRACKABLE):
            # As TensorFlow: a plain value set as an attribute is kept, not saved (only the constructor refuses it).
            self._objects.pop(name, None)
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)
        self._objects[name] = value
        attached(self, name, value)

    def __getattr__(self, name):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        if name == "root" and self.__dict__.get("_root") is not None:
            return self._root
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    def _trackable_children(self) -> dict:
        """What a Checkpoint saves: its root's children, its objects, and its ``save_counter`` once created."""
        children = {} if self._root is None else _children(self._root)
        children.update(self._objects)
        if self._save_counter is not None:
            children["save_counter"] = self._save_counter
        return children

    @property
    def save_counter(self):
        """The number of ``save()`` calls so far (restored with the rest): an int64 variable."""
        if self._save_counter is None:
            self._create_save_counter()
        return self._save_counter

    def _create_save_counter(self):
        from ..distribute import values
        from ..distribute.options import VariableAggregation

        found, _, _ = self._tracked()
        strategy = _strategy_of(list(found.values()))
        with strategy.scope():
            self._save_counter = values.Variable(
                np.int64(0), name="save_counter", trainable=False, dtype=np.int64,
                aggregation=VariableAggregation.ONLY_FIRST_REPLICA)

    def _tracked(self):
        found, optimizers, seen, aliases = {}, [], {}, {}
        if self._root is not None:
            seen[id(self._root)] = ""
        children = {} if self._root is None else _children(self._root)
        children.update(self._objects)
        _walk(list(children.items()), found, optimizers, seen, aliases)
        self._aliases = aliases
        for _, opt in optimizers:
            opt._refresh_state()  # (state kept on other tasks: ParameterServerStrategy's ps copies)
        return found, optimizers, seen

    def _variables(self, create_for=None, create_counter=True) -> dict:
        """``key -> variable`` of everything tracked.

        With ``create_for`` (the keys of a file being restored), optimizers first
        create the state the file holds (zero slots, step 0 — the same as
        state not created yet), so a fresh optimizer can be restored.
        """
        found, optimizers, _ = self._tracked()
        for path, opt in optimizers:
            if create_for is not None:
                # A file of mirrored before Keras' names says whose slots it holds: they are created at once.
                # Keras' numbered slots wait for the optimizer's build (_restore_from).
                prefix = _join(path, f"{_LEGACY_SLOTS}/")
                wanted = [v for p, v in found.items()
                          if any(k.startswith(f"{prefix}{p}/") for k in create_for)]
                if wanted or _join(path, _ITERATIONS) in create_for:
                    opt._create_state(opt._strategy or _strategy_of(wanted or list(found.values())), wanted)
            found.update(_optimizer_state(path, opt))
        if create_for is not None and create_counter and self._save_counter is None:
            self._create_save_counter()
        if self._save_counter is not None:
            found["save_counter"] = self._save_counter
        return found

    def save(self, file_prefix, options=None) -> str:
        """Increment ``save_counter``, write ``{file_prefix}-{save_counter}``; returns that path.

        The directory is created if missing, and its ``checkpoint`` state file
        names the new file as the latest. Every worker of a multi-worker job
        must call it (reading an ON_READ variable is a collective); a path all
        workers share is written by the chief
        (``strategy.extended.should_checkpoint``) alone, a worker's own path by
        that worker.
        """
        _require_cross_replica("save")
        file_prefix = _check_path(file_prefix, "file_prefix")
        counter = self.save_counter
        counter.assign_add(np.int64(1))
        path = f"{file_prefix}-{int(counter.numpy())}"
        if self._write(path):
            directory = os.path.dirname(os.path.abspath(path))
            _record_latest(directory, path)
            numbered = re.compile(re.escape(os.path.basename(file_prefix)) + r"-\d+")
            sweep_stale_temporaries(directory, lambda target: bool(numbered.fullmatch(target))
                                    or target == STATE_FILE)
        return path

    def write(self, file_prefix, options=None) -> str:
        """Write every tracked value to exactly ``file_prefix``, atomically; returns it.

        Unlike ``save``, no counter and no state file: the checkpoint managers'
        building block, and the call for "always this one file".
        """
        _require_cross_replica("write")
        path = _check_path(file_prefix, "file_prefix")
        if self._write(path):
            sweep_stale_temporaries(os.path.dirname(os.path.abspath(path)),
                                    lambda target: target == os.path.basename(path))
        return path

    def _write(self, path: str) -> bool:
        """Write ``path`` if this worker should; returns whether it did. Every worker must call it."""
        from ..distribute import distribute_lib

        variables = self._variables()
        arrays = {tensor_name(key): np.asarray(var.numpy(), order="C") for key, var in variables.items()}
        arrays.update(_saveable_tensors(self._objects))
        strategy = _strategy_of(list(variables.values())) if variables else distribute_lib.get_strategy()
        if _writes_here(strategy, path):
            _write_atomic(path, arrays, self._aliases)
            return True
        return False

    def restore(self, save_path, options=None) -> CheckpointLoadStatus:
        """Load ``save_path`` into the tracked objects; nothing is assigned if anything is wrong.

        The whole file is read and checked, and every entry a tracked variable
        finds must have its shape and dtype, before the first assignment.
        As in TensorFlow, entries that no tracked object claims are left alone
        (e.g. optimizer state when only the model is restored), and tracked
        variables the file lacks keep their values; ``assert_consumed()`` and
        ``assert_existing_objects_matched()`` on the returned status report them. ``save_path=None`` restores nothing
        (``CheckpointManager.latest_checkpoint`` is None before the first save).
        """
        return self._load(save_path, counter=True, what="restore")

    def _load(self, save_path, counter: bool, what: str) -> CheckpointLoadStatus:
        if save_path is None:
            return InitializationOnlyStatus()
        _require_cross_replica(what)
        path = _check_path(save_path, "save_path")
        from .tensorbundle import BundleReader, is_tensorflow_checkpoint, object_aliases, object_keys

        if is_tensorflow_checkpoint(path):
            with BundleReader(path) as bundle:
                return self._restore_from(bundle, path, object_keys(bundle), counter, object_aliases(bundle))
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"save_path={path!r} is a directory; pass a checkpoint file, e.g. "
                "md.train.latest_checkpoint(directory)")
        if not os.path.lexists(path):
            raise NotFoundError(
                None, None, f"Failed to find any matching files for save_path={path!r}; pass a path that "
                "save() or write() returned, e.g. md.train.latest_checkpoint(directory)")
        with CheckpointReader(path) as reader:
            return self._restore_from(reader, path, self._own_keys(reader.keys), counter, reader.aliases)

    def _own_keys(self, names) -> dict:
        """``object path -> tensor name`` of one of mirrored's files. Files of earlier versions named tensors by
        their object path alone, and an optimizer's counter ``iterations``: those are found too (their slots,
        ``slots/<variable path>/<slot name>``, once created: ``_legacy_slot_keys``)."""
        keys = {object_path(name): name for name in names}
        for path, _ in self._tracked()[1]:
            legacy, current = _join(path, "iterations"), _join(path, _ITERATIONS)
            if current not in keys and keys.get(legacy) == legacy:
                keys[current] = keys.pop(legacy)
        return keys

    def _legacy_slot_keys(self, keys: dict) -> dict:
        """``keys`` with the slots of an earlier mirrored file (keyed by their variable's path) renamed to Keras'
        numbers of the slots they fill."""
        found, optimizers, _ = self._tracked()
        var_paths = {id(v): p for p, v in found.items()}
        for path, opt in optimizers:
            for index, (var, slot_name, _) in opt._keras_variables().items():
                legacy = _join(path, f"{_LEGACY_SLOTS}/{var_paths.get(id(var))}/{slot_name}")
                current = _join(path, f"{_SLOTS}/{index}")
                if current not in keys and legacy in keys:
                    keys[current] = keys.pop(legacy)
        return keys

    def _restore_from(self, reader, path: str, keys: dict, counter: bool, aliases: dict) -> CheckpointLoadStatus:
        """Assign ``reader``'s arrays (``keys``: object path -> the file's tensor name) to the tracked variables.

        ``counter``: whether ``save_counter`` is created (``restore``) or left alone when not yet created
        (``read``, whose files come from ``write``), as TensorFlow's.

        Shapes and dtypes are checked, and the file's checksums verified, before
        the first assignment; then one array is read and assigned at a time, so the memory needed is
        one variable beyond the variables themselves.
        """
        # One entry at a time must fit in memory (asked before hashing a file of, say, a sparse terabyte).
        _check_memory(path, max((reader.entry(k).nbytes for k in keys.values()), default=0))
        reader.verify(list(keys.values()))  # before anything is created or assigned
        variables = self._variables(create_for=keys, create_counter=counter)
        keys = _resolve_aliases(self._legacy_slot_keys(dict(keys)), aliases, variables, self._aliases)
        optimizers = self._tracked()[1]
        problems = [problem for p, opt in optimizers if opt._slots
                    for problem in [_layout_problem(p, opt, keys)] if problem]
        unmatched = []
        for key, var in variables.items():
            if key not in keys:
                if isinstance(var, _OptimizerScalar) and isinstance(reader, CheckpointReader):
                    continue  # mirrored's files before Keras' names: the learning rate was configuration, not state
                # As TensorFlow: the variable keeps its value; the status's assertions report it (the
                # save_counter too, when restore() reads a file of write(): TF's advice is read() for those).
                unmatched.append(key)
                continue
            entry = reader.entry(keys[key])
            if tuple(entry.shape) != tuple(var.shape) or entry.dtype != np.dtype(var.dtype):
                owner = next(((p, opt) for p, opt in optimizers if _built_state(p, key)), None)
                what = _slot_of(*owner, key) if owner else ""
                problems.append(f"{key}{what}: file has {entry.dtype}{list(entry.shape)}, "
                                f"variable is {np.dtype(var.dtype)}{list(var.shape)}")
        if problems:
            raise CheckpointError(
                f"path={path!r} does not fit the objects of this Checkpoint (a shape or dtype mismatch); nothing "
                "was restored:\n  "
                + "\n  ".join(problems)
                + "\nbuild the model with the shapes it was saved with, or pass the objects it was saved from")
        restored = [key for key in variables if key in keys]
        for key in restored:
            variables[key].assign(reader.read(keys[key]))
        restored += _restore_saveables(self._objects, keys, lambda key: reader.read(keys[key]), unmatched)
        status = CheckpointLoadStatus(path, set(keys) - set(restored), restored, unmatched)
        # As Keras 3: an optimizer's state restored before its build (slots, Nadam's u_product) waits for it.
        for opt_path, opt in optimizers:
            mine = [key for key in status._unused if _built_state(opt_path, key)]
            if mine and not opt._slots:
                waiting = {key: _Pending(path, key, status, lambda name=keys[key]: reader.read(name)) for key in mine}
                for pending in waiting.values():
                    pending.value()  # read now: the reader is closed once restore() returns
                opt._defer_restore(_RestoreAtBuild(opt_path, path, waiting))
        # As TensorFlow: a value whose variable does not exist yet waits on the object that will hold it
        # (an md.Module, a Checkpoint) and is assigned when the variable is attached there.
        # The file's graph may reach it by other paths too (a shared object): it waits on each.
        for key in status._unused:
            if key != "save_counter" and f"/{_ATTRIBUTES}/" not in f"/{key}":
                pending = _Pending(path, key, status, lambda name=keys[key]: reader.read(name))
                for other in [key] + [alias + key[len(target):] for alias, target in aliases.items()
                                      if key == target or key.startswith(target + "/")]:
                    _defer(self, other, pending, assign=False)
        return status

    def read(self, save_path, options=None) -> CheckpointLoadStatus:
        """Load a file written by ``write`` (or ``save``) as ``restore`` does, except that ``save_counter`` is
        restored only if it exists already (as TensorFlow's: a file from ``save`` then leaves it unclaimed)."""
        return self._load(save_path, counter=False, what="read")


# --- objects that save themselves (md.data iterators) -----------------------------------------------
# TensorFlow's trackable protocol: ``_serialize_to_tensors() -> {name: array}`` and
# ``_restore_from_tensors({name: array})``; the arrays are stored under ``<object>/.ATTRIBUTES/<name>``.

def _saveable_tensors(objects: dict) -> dict:
    return {f"{name}/{_ATTRIBUTES}/{key}": np.asarray(value, order="C")
            for name, obj in objects.items() if hasattr(obj, "_serialize_to_tensors")
            for key, value in obj._serialize_to_tensors().items()}


def _restore_saveables(objects: dict, keys, read, unmatched: list) -> list:
    """Restore every self-saving object from the file's ``keys`` (``read(key)``: the array); returns the keys
    used. An object the file has nothing for is reported in ``unmatched``."""
    restored = []
    for name, obj in objects.items():
        if not hasattr(obj, "_restore_from_tensors"):
            continue
        prefix = f"{name}/{_ATTRIBUTES}/"
        mine = [key for key in keys if key.startswith(prefix)]
        if not mine:
            unmatched.append(name)
            continue
        obj._restore_from_tensors({key[len(prefix):]: read(key) for key in mine})
        restored += mine
    return restored


def _check_trackable(name: str, obj) -> None:
    if name == "save_counter":
        raise ValueError("Checkpoint(save_counter=...): the name save_counter is reserved for the "
                         "number of save() calls; pick another name")
    if isinstance(obj, _UNTRACKABLE):
        raise ValueError(
            f"Checkpoint({name}={obj!r}): `Checkpoint` was expecting {name} to be a trackable object; a "
            f"{type(obj).__name__} cannot be tracked (it could not be restored in place); wrap it in a "
            f"variable, e.g. {name}=md.Variable({obj!r}, trainable=False) created in strategy.scope()")


def _check_path(path, argument: str) -> str:
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"{argument}={path!r}: expected a path (str or os.PathLike)") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError(f"{argument}='': expected a file path, e.g. 'out/ckpt'")
    return path


def _writes_here(strategy, path: str) -> bool:
    """Whether this worker writes ``path``: the chief always; another worker when the chief writes elsewhere.

    TensorFlow's multi-worker pattern gives every worker but the chief a
    temporary directory of its own (``write_filepath``), so each path ``save``
    returns exists. When all workers share one path, only the chief writes it.
    Every worker takes part in the broadcast of the chief's path, a collective.
    """
    fingerprint = np.frombuffer(hashlib.sha256(os.path.abspath(path).encode()).digest()[:8], np.uint8).copy()
    chiefs = strategy.extended._make_initial_values_identical(fingerprint)
    return bool(strategy.extended.should_checkpoint) or not np.array_equal(chiefs, fingerprint)


def _require_cross_replica(what: str) -> None:
    from ..distribute import distribute_lib

    if not distribute_lib.in_cross_replica_context() and distribute_lib.has_strategy():
        raise RuntimeError(f"Checkpoint.{what}() was called inside strategy.run; "
                           f"call it outside run (in cross-replica context)")


def _strategy_of(variables: list):
    from ..distribute import distribute_lib

    for var in variables:
        strategy = getattr(var, "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return distribute_lib.get_strategy()
