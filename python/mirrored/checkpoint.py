"""``md.Checkpoint``: save and restore variables, optimizer state and step counters.

    ckpt = md.Checkpoint(model=model, optimizer=opt)
    ckpt.save("out/model.ckpt")        # atomic; only the chief writes
    ckpt.restore("out/model.ckpt")     # any replica count; all or nothing

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

import hashlib
import json
import os
import struct
import types
import uuid

import numpy as np

__all__ = ["Checkpoint", "load_checkpoint", "CheckpointError"]

_MAGIC = b"MDCKPT\x00"
_VERSION = 1
_DIGEST = 32


class CheckpointError(ValueError):
    """The file is not a complete ``mirrored`` checkpoint, or does not fit the objects."""


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
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
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
    from . import values

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
        for key in sorted(vars(obj)):
            if not key.startswith("_"):
                _walk(vars(obj)[key], f"{path}/{key}", found, optimizers, seen)


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


class Checkpoint:
    """Groups the objects to save: ``md.Checkpoint(model=..., optimizer=..., step=...)``."""

    def __init__(self, **objects):
        if not objects:
            raise ValueError("Checkpoint() needs the objects to save as keyword arguments, "
                             "e.g. md.Checkpoint(model=model, optimizer=optimizer)")
        self._objects = objects

    def _variables(self, create_for=None) -> dict:
        """``key -> variable`` of everything tracked.

        With ``create_for`` (the keys of a file being restored), optimizers first
        create the state the file holds (zero slots, step 0 — the same as
        state not created yet), so a fresh optimizer can be restored.
        """
        found, optimizers, seen = {}, [], set()
        for name, obj in self._objects.items():
            _walk(obj, name, found, optimizers, seen)
        var_paths = {id(v): p for p, v in found.items()}
        for path, opt in optimizers:
            if create_for is not None:
                prefix = f"{path}/slots/"
                wanted = [v for p, v in found.items()
                          if any(k.startswith(f"{prefix}{p}/") for k in create_for)]
                if wanted or f"{path}/iterations" in create_for:
                    opt._create_state(_strategy_of(wanted or list(found.values())), wanted)
            found.update(_optimizer_state(path, opt, var_paths))
        return found

    def save(self, path) -> str:
        """Write every tracked value to ``path`` atomically; returns ``path``.

        Every worker of a multi-worker job must call it (reading an ON_READ
        variable is a collective); only the chief
        (``strategy.extended.should_checkpoint``) writes the file.
        """
        from . import distribute_lib

        path = os.fspath(path)
        _require_cross_replica("save")
        variables = self._variables()
        arrays = {key: np.asarray(var.numpy(), order="C") for key, var in variables.items()}
        strategy = _strategy_of(list(variables.values())) if variables else distribute_lib.get_strategy()
        if strategy.extended.should_checkpoint:
            _write_atomic(path, arrays)
        return path

    def restore(self, path) -> "Checkpoint":
        """Load ``path`` into the tracked objects: all of them, or none if anything is wrong.

        The whole file is read and checked, and every tracked variable must have
        an entry of the same shape and dtype, before the first assignment.
        Entries that no tracked object claims are ignored (e.g. optimizer state
        when only the model is restored).
        """
        _require_cross_replica("restore")
        arrays = load_checkpoint(path)
        variables = self._variables(create_for=arrays)
        problems = []
        for key, var in variables.items():
            if key not in arrays:
                problems.append(f"{key}: not in the file")
            elif tuple(arrays[key].shape) != tuple(var.shape) or arrays[key].dtype != np.dtype(var.dtype):
                problems.append(f"{key}: file has {arrays[key].dtype}{list(arrays[key].shape)}, "
                                f"variable is {np.dtype(var.dtype)}{list(var.shape)}")
        if problems:
            raise CheckpointError(
                f"path={os.fspath(path)!r} does not fit the objects of this Checkpoint; nothing was restored:\n  "
                + "\n  ".join(problems)
                + "\nbuild the model with the shapes it was saved with, or pass the objects it was saved from")
        for key, var in variables.items():
            var.assign(arrays[key])
        return self


def _require_cross_replica(what: str) -> None:
    from . import distribute_lib

    if not distribute_lib.in_cross_replica_context() and distribute_lib.has_strategy():
        raise RuntimeError(f"Checkpoint.{what}() was called inside strategy.run; "
                           f"call it outside run (in cross-replica context)")


def _strategy_of(variables: list):
    from . import distribute_lib

    for var in variables:
        strategy = getattr(var, "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return distribute_lib.get_strategy()
