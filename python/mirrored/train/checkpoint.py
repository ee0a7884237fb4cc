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
an optimizer its ``iterations`` and its slot variables, keyed by the path of
the variable they belong to (``optimizer/slots/model/w1/m``). Values are the
variables' cross-replica values, so a checkpoint written with 4 replicas
restores into 1 or 8.

File format (one file, little-endian)::

    8 bytes   magic  b"MDCKPT\\x00" + format version byte
    8 bytes   length of the JSON index
    ...       JSON index: {"entries": [{"key", "dtype", "shape", "offset", "nbytes"}], "data_bytes"}
    ...       the arrays' bytes, C order, at their offsets
    32 bytes  SHA-256 of everything above

The trailing digest catches truncated and corrupted files; a save writes a
temporary file in the same directory and renames it over ``path`` only once
complete, so an interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import types
import uuid

import numpy as np

__all__ = ["Checkpoint", "CheckpointLoadStatus", "load_checkpoint", "CheckpointError", "NotFoundError"]

_MAGIC = b"MDCKPT\x00"
_VERSION = 1
_DIGEST = 32


class CheckpointError(ValueError):
    """The file is not a complete ``mirrored`` checkpoint, or does not fit the objects."""


class NotFoundError(FileNotFoundError):
    """No checkpoint at the path given to ``restore`` / ``read`` (TensorFlow raises ``NotFoundError`` too)."""


# --- the file format ------------------------------------------------------------------------------

def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: F401  registers bfloat16 with NumPy

        return np.dtype(name)


def _write_atomic(path: str, arrays: dict) -> None:
    """Write ``arrays`` (key -> host ndarray) to ``path`` via a temporary file + rename."""
    entries, offset = [], 0
    for key, arr in arrays.items():
        entries.append({"key": key, "dtype": arr.dtype.name, "shape": list(arr.shape),
                        "offset": offset, "nbytes": arr.nbytes})
        offset += arr.nbytes
    index = json.dumps({"entries": entries, "data_bytes": offset}).encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    _make_directory(directory, path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    try:
        try:
            f = open(tmp, "wb")
        except OSError as e:
            raise type(e)(e.errno, f"cannot write checkpoint {path!r}: directory {directory!r} is not "
                                   f"writable ({e.strerror}); pick a directory this process may write") from None
        with f:
            for chunk in (_MAGIC + bytes([_VERSION]), struct.pack("<Q", len(index)), index,
                          *(a.reshape(-1).view(np.uint8) for a in arrays.values())):  # bytes of any dtype
                digest.update(chunk)
                f.write(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Whatever stopped the save (an error, Ctrl-C), the old checkpoint stays as it was.
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
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
        raise type(e)(e.errno, f"cannot write checkpoint {path!r}: cannot create directory {directory!r} "
                               f"({e.strerror}); pick a directory this process may write") from None


def load_checkpoint(path) -> dict:
    """Every array of the checkpoint at ``path``, as ``{key: ndarray}`` (validated in full)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        blob = f.read()
    head = len(_MAGIC) + 1 + 8
    if len(blob) < head or not blob.startswith(_MAGIC):
        raise CheckpointError(f"path={path!r} is not a mirrored checkpoint (no {_MAGIC!r} header); "
                              "pass a file written by md.Checkpoint.save")
    if blob[len(_MAGIC)] != _VERSION:
        raise CheckpointError(f"path={path!r} has checkpoint format version {blob[len(_MAGIC)]}, this "
                              f"mirrored reads version {_VERSION}; upgrade mirrored to read it")
    (index_len,) = struct.unpack_from("<Q", blob, len(_MAGIC) + 1)
    try:
        index = json.loads(blob[head:head + index_len].decode("utf-8"))
        data_bytes = int(index["data_bytes"])
        entries = index["entries"]
    except (ValueError, KeyError, TypeError):
        index = None
    expected = head + index_len + (data_bytes if index is not None else 0) + _DIGEST
    if index is None or len(blob) != expected:
        raise CheckpointError(
            f"path={path!r} is truncated or damaged ({len(blob)} bytes; a complete file of this "
            f"header has {expected if index is not None else 'more'}); restore an earlier checkpoint")
    if hashlib.sha256(blob[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise CheckpointError(f"path={path!r} is corrupted (checksum mismatch); restore an earlier checkpoint")
    data = memoryview(blob)[head + index_len:head + index_len + data_bytes]
    arrays = {}
    for e in entries:
        dtype = _dtype(e["dtype"])
        arr = np.frombuffer(data[e["offset"]:e["offset"] + e["nbytes"]], dtype=dtype)
        arrays[e["key"]] = arr.reshape(e["shape"]).copy()
    return arrays


# --- which objects hold which variables -----------------------------------------------------------

def _is_variable(obj) -> bool:
    from ..distribute import values

    return isinstance(obj, values.Variable)


def _walk(obj, path: str, found: dict, optimizers: list, seen: set) -> None:
    """Collect ``path -> variable`` for every variable under ``obj`` (first path wins)."""
    from .optimizers import Optimizer

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if _is_variable(obj):
        found[path] = obj
    elif isinstance(obj, Optimizer):
        optimizers.append((path, obj))
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _walk(obj[key], f"{path}/{key}", found, optimizers, seen)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _walk(item, f"{path}/{i}", found, optimizers, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
        # md.Module tracks its private attributes too, as tf.Module does: it names its children itself.
        children = obj._trackable_children() if hasattr(obj, "_trackable_children") else {
            key: value for key, value in vars(obj).items() if not key.startswith("_")}
        for key in sorted(children):
            _walk(children[key], f"{path}/{key}", found, optimizers, seen)


def _optimizer_state(path: str, optimizer, var_paths: dict) -> dict:
    """``key -> state variable`` of ``optimizer``; slots keyed by their variable's path."""
    state = {} if optimizer._iterations is None else {f"{path}/iterations": optimizer._iterations}
    for var, slots in optimizer._slots.values():
        var_path = var_paths.get(id(var))
        if var_path is None:
            raise CheckpointError(
                f"{path}: the optimizer has slots for variable {var.name!r}, which is not part of this "
                "Checkpoint; pass the model too, e.g. md.Checkpoint(model=model, optimizer=optimizer)")
        for slot_name, slot in slots.items():
            state[f"{path}/slots/{var_path}/{slot_name}"] = slot
    return state


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


class Checkpoint:
    """Groups the objects to save, as ``tf.train.Checkpoint``: ``md.train.Checkpoint(model=..., optimizer=...)``.

    ``save(prefix)`` writes ``prefix-N`` (N = ``save_counter``, which it
    increments) and records it in the directory's ``checkpoint`` state file,
    so ``md.train.latest_checkpoint(directory)`` finds it; ``write(path)``
    writes exactly ``path``. ``restore(path)`` / ``read(path)`` load a file and
    return a status with ``assert_consumed()`` and ``expect_partial()``.
    """

    def __init__(self, root=None, **objects):
        if root is not None:
            objects = {"root": root, **objects}
        for name, obj in objects.items():
            _check_trackable(name, obj)
        self._objects = objects
        self._save_counter = None

    def __setattr__(self, name, value):
        # As tf.train.Checkpoint: ``ckpt.model = model`` after construction tracks it too.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"Checkpoint.{name} cannot be set; pick another name for the object")
        _check_trackable(name, value)
        self._objects[name] = value

    def __getattr__(self, name):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

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
        found, optimizers, seen = {}, [], set()
        for name, obj in self._objects.items():
            _walk(obj, name, found, optimizers, seen)
        return found, optimizers, seen

    def _variables(self, create_for=None) -> dict:
        """``key -> variable`` of everything tracked.

        With ``create_for`` (the keys of a file being restored), optimizers first
        create the state the file holds (zero slots, step 0 — the same as
        state not created yet), so a fresh optimizer can be restored.
        """
        found, optimizers, _ = self._tracked()
        var_paths = {id(v): p for p, v in found.items()}
        for path, opt in optimizers:
            if create_for is not None:
                prefix = f"{path}/slots/"
                wanted = [v for p, v in found.items()
                          if any(k.startswith(f"{prefix}{p}/") for k in create_for)]
                if wanted or f"{path}/iterations" in create_for:
                    opt._create_state(_strategy_of(wanted or list(found.values())), wanted)
            found.update(_optimizer_state(path, opt, var_paths))
        if create_for is not None and "save_counter" in create_for and self._save_counter is None:
            self._create_save_counter()
        if self._save_counter is not None:
            found["save_counter"] = self._save_counter
        return found

    def save(self, file_prefix, options=None) -> str:
        """Increment ``save_counter``, write ``{file_prefix}-{save_counter}``; returns that path.

        The directory is created if missing, and its ``checkpoint`` state file
        names the new file as the latest. Every worker of a multi-worker job
        must call it (reading an ON_READ variable is a collective); only the
        chief (``strategy.extended.should_checkpoint``) writes files.
        """
        _require_cross_replica("save")
        file_prefix = _check_path(file_prefix, "file_prefix")
        counter = self.save_counter
        counter.assign_add(np.int64(1))
        path = f"{file_prefix}-{int(counter.numpy())}"
        self.write(path, options=options)
        if self._is_chief():
            from . import checkpoint_management as train

            train._record_latest(os.path.dirname(os.path.abspath(path)), path)
        return path

    def write(self, file_prefix, options=None) -> str:
        """Write every tracked value to exactly ``file_prefix``, atomically; returns it.

        Unlike ``save``, no counter and no state file: the checkpoint managers'
        building block, and the call for "always this one file".
        """
        _require_cross_replica("write")
        path = _check_path(file_prefix, "file_prefix")
        variables = self._variables()
        arrays = {key: np.asarray(var.numpy(), order="C") for key, var in variables.items()}
        if self._is_chief(variables):
            _write_atomic(path, arrays)
        return path

    def _is_chief(self, variables=None) -> bool:
        from ..distribute import distribute_lib

        if variables is None:
            variables = self._variables()
        strategy = _strategy_of(list(variables.values())) if variables else distribute_lib.get_strategy()
        return bool(strategy.extended.should_checkpoint)

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
        if save_path is None:
            return InitializationOnlyStatus()
        _require_cross_replica("restore")
        path = _check_path(save_path, "save_path")
        if os.path.isdir(path):
            raise IsADirectoryError(
                f"save_path={path!r} is a directory; pass a checkpoint file, e.g. "
                "md.train.latest_checkpoint(directory)")
        if not os.path.exists(path):
            raise NotFoundError(
                errno.ENOENT, f"Failed to find any matching files for save_path={path!r}; pass a path that "
                "save() or write() returned, e.g. md.train.latest_checkpoint(directory)", path)
        arrays = load_checkpoint(path)
        variables = self._variables(create_for=arrays)
        problems, unmatched = [], []
        for key, var in variables.items():
            if key not in arrays:
                # As TensorFlow: the variable keeps its value; the status's assertions report it.
                # Files written by write() have no save_counter: the counter stays, unreported.
                if key != "save_counter":
                    unmatched.append(key)
            elif tuple(arrays[key].shape) != tuple(var.shape) or arrays[key].dtype != np.dtype(var.dtype):
                problems.append(f"{key}: file has {arrays[key].dtype}{list(arrays[key].shape)}, "
                                f"variable is {np.dtype(var.dtype)}{list(var.shape)}")
        if problems:
            raise CheckpointError(
                f"path={path!r} does not fit the objects of this Checkpoint; nothing was restored:\n  "
                + "\n  ".join(problems)
                + "\nbuild the model with the shapes it was saved with, or pass the objects it was saved from")
        restored = [key for key in variables if key in arrays]
        for key in restored:
            variables[key].assign(arrays[key])
        return CheckpointLoadStatus(path, set(arrays) - set(restored), restored, unmatched)

    def read(self, save_path, options=None) -> CheckpointLoadStatus:
        """Load a file written by ``write`` (or ``save``): the same as ``restore``."""
        return self.restore(save_path, options=options)


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
