"""``md.train``: checkpoints as ``tf.train`` spells them.

    ckpt = md.train.Checkpoint(model=model, optimizer=optimizer)
    manager = md.train.CheckpointManager(ckpt, "out/run", max_to_keep=3)
    manager.restore_or_initialize()          # the latest checkpoint, if any
    for epoch in ...:
        ...
        manager.save()                       # out/run/ckpt-1, ckpt-2, ...; keeps the newest 3

A directory's ``checkpoint`` file records its checkpoints, in the text form
TensorFlow uses for its ``CheckpointState``::

    model_checkpoint_path: "ckpt-3"
    all_model_checkpoint_paths: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-3"
    all_model_checkpoint_timestamps: 1764130000.5
    all_model_checkpoint_timestamps: 1764130060.2
    last_preserved_timestamp: 1764129990.1

Paths in it are relative to the directory. Each checkpoint is one file (the
format of ``md.checkpoint``), so a checkpoint "prefix" is the file's path.
In a multi-worker job every worker calls ``save`` (reading ON_READ variables is
a collective) and keeps the same list; in a directory all workers share, only
the chief writes and deletes files (a worker's own directory, TF's
``workertemp_<id>`` pattern, is written by that worker). A manager deletes
only its own ``{checkpoint_name}-N`` files, whatever the state file says, and
each save sweeps the temporaries that interrupted saves of its prefix left.
TensorFlow's checkpoint directories are read too (``tensorbundle.py``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import stat
import time
import warnings

import numpy as np

from .tensorbundle import BundleReader, is_tensorflow_checkpoint
from .checkpoint import (STATE_FILE, Checkpoint, CheckpointError, CheckpointLoadStatus, CheckpointReader,
                         CheckpointValues, NotFoundError, _check_memory, _write_state, open_regular_file, read_all,
                         sweep_stale_temporaries, tensor_name)
from .checkpoint_io import KeyNotFoundError

__all__ = ["Checkpoint", "CheckpointManager", "CheckpointState", "CheckpointLoadStatus", "CheckpointError",
           "NotFoundError", "latest_checkpoint", "get_checkpoint_state", "checkpoints_iterator", "list_variables",
           "load_variable", "load_checkpoint"]

_MAX_STATE_BYTES = 16 << 20  # about 100,000 checkpoints listed


# --- the directory's state file -------------------------------------------------------------------

class CheckpointState:
    """The contents of a directory's ``checkpoint`` file (absolute paths)."""

    def __init__(self, model_checkpoint_path, all_model_checkpoint_paths=(), all_model_checkpoint_timestamps=(),
                 last_preserved_timestamp=0.0):
        self.model_checkpoint_path = model_checkpoint_path
        self.all_model_checkpoint_paths = list(all_model_checkpoint_paths)
        self.all_model_checkpoint_timestamps = list(all_model_checkpoint_timestamps)
        self.last_preserved_timestamp = float(last_preserved_timestamp)

    def __repr__(self) -> str:
        return (f"CheckpointState(model_checkpoint_path={self.model_checkpoint_path!r}, "
                f"all_model_checkpoint_paths={self.all_model_checkpoint_paths!r})")


_LINE = re.compile(r'^\s*(\w+)\s*:\s*(.*?)\s*$')


def _fspath(path, argument: str):
    """``os.fspath(path)``, whose TypeError would not say which argument was wrong."""
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"{argument}={path!r}: expected a path (str or os.PathLike)") from None


def get_checkpoint_state(checkpoint_dir, latest_filename=None):
    """The ``CheckpointState`` recorded in ``checkpoint_dir``, or None if there is none."""
    directory = _fspath(checkpoint_dir, "checkpoint_dir")
    state_path = os.path.join(directory, latest_filename or STATE_FILE)
    try:
        with open_regular_file(state_path, "the checkpoint state file") as f:  # never a FIFO or a device
            size = os.fstat(f.fileno()).st_size
            if size > _MAX_STATE_BYTES:
                raise CheckpointError(f"{state_path}: {size} bytes, far more than a checkpoint state file holds; "
                                      "it is damaged: delete it (the checkpoint files stay usable)")
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    fields = collections.defaultdict(list)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        try:
            if m is None:
                raise ValueError(line)
            key, raw = m.groups()
            fields[key].append(json.loads(raw))
        except ValueError:
            raise CheckpointError(f"{state_path}:{number}: cannot parse {line!r}; the checkpoint state file is "
                                  "damaged: delete it (the checkpoint files stay usable)") from None
    if not fields.get("model_checkpoint_path"):
        raise CheckpointError(f"{state_path}: no model_checkpoint_path; the checkpoint state file is damaged: "
                              "delete it (the checkpoint files stay usable)")

    def absolute(p):
        return p if os.path.isabs(p) else os.path.join(directory, p)

    return CheckpointState(absolute(fields["model_checkpoint_path"][-1]),
                           [absolute(p) for p in fields["all_model_checkpoint_paths"]],
                           [float(t) for t in fields["all_model_checkpoint_timestamps"]],
                           float(fields["last_preserved_timestamp"][-1]) if fields["last_preserved_timestamp"] else 0.0)


def latest_checkpoint(checkpoint_dir, latest_filename=None):
    """The path of the newest checkpoint recorded in ``checkpoint_dir``, or None.

    For a directory of TensorFlow checkpoints, the newest one's prefix (which
    ``restore``, ``list_variables`` and ``load_variable`` read). None also
    when the recorded file no longer exists (as ``tf.train.latest_checkpoint``).
    """
    state = get_checkpoint_state(checkpoint_dir, latest_filename)
    if state is None:
        return None
    path = state.model_checkpoint_path
    if os.path.isfile(path) or is_tensorflow_checkpoint(path):
        return path
    return None


_POLL_SECONDS = 1.0  # how often checkpoints_iterator looks at the state file, as TensorFlow's


def _wait_for_new_checkpoint(checkpoint_dir, last, timeout):
    """The directory's latest checkpoint once it is not ``last``; None when ``timeout`` seconds pass first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None and path != last:
            return path
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        # Sleep out a short timeout too (TF returns at once), so a timeout_fn loop never spins.
        time.sleep(_POLL_SECONDS if left is None else min(_POLL_SECONDS, left))


def checkpoints_iterator(checkpoint_dir, min_interval_secs=0, timeout=None, timeout_fn=None):
    """Yield each new latest checkpoint of ``checkpoint_dir`` as it appears, as ``tf.train.checkpoints_iterator``.

    The first is the latest at the call (if any). With ``timeout``, after that many seconds without a new one
    the iterator ends, unless ``timeout_fn`` is given and returns False (then it waits again). Consecutive
    yields are at least ``min_interval_secs`` apart.
    """
    for value, argument in ((min_interval_secs, "min_interval_secs"), (timeout, "timeout")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{argument}={value!r}: expected a non-negative number of seconds")
    last = None
    while True:
        path = _wait_for_new_checkpoint(checkpoint_dir, last, timeout)
        if path is None:
            if timeout_fn is None or timeout_fn():
                return
            continue
        started = time.monotonic()
        last = path
        yield path
        pause = started + min_interval_secs - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def _checkpoint_file(ckpt_dir_or_file) -> str:
    path = _fspath(ckpt_dir_or_file, "ckpt_dir_or_file")
    if os.path.isdir(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"ckpt_dir_or_file={path!r}: no checkpoint recorded in this directory")
        return latest
    return path


def _open(ckpt_dir_or_file):
    path = _checkpoint_file(ckpt_dir_or_file)
    if is_tensorflow_checkpoint(path):
        return BundleReader(path)
    return CheckpointReader(path)


def list_variables(ckpt_dir_or_file) -> list:
    """``[(name, shape), ...]`` of a checkpoint (or a directory's latest), sorted by name.

    Reads only the index: mirrored's own files and TensorFlow's (TensorBundle) alike.
    """
    with _open(ckpt_dir_or_file) as reader:
        return [(key, list(reader.entry(key).shape)) for key in sorted(reader.keys)]


def load_checkpoint(ckpt_dir_or_file) -> CheckpointValues:
    """Every array of a checkpoint (or a directory's latest), validated in full, as ``tf.train.load_checkpoint``:
    mirrored's own files and TensorFlow's alike (``CheckpointValues``: by object path, and TF's reader methods by
    tensor name)."""
    with _open(ckpt_dir_or_file) as reader:
        return read_all(reader)


def load_variable(ckpt_dir_or_file, name: str):
    """The saved value of ``name`` (a name of ``list_variables``; a trailing ``:0`` is ignored, as TensorFlow's)
    as a NumPy array, its checksum verified."""
    if name.endswith(":0"):
        name = name[:-2]
    with _open(ckpt_dir_or_file) as reader:
        if name not in reader.keys:
            hint = f"; did you mean {tensor_name(name)!r}?" if tensor_name(name) in reader.keys else ""
            raise KeyNotFoundError(None, None, f"Key {name} not found in checkpoint {reader.path!r}{hint} It "
                                   f"holds {sorted(reader.keys)}")
        _check_memory(reader.path, reader.entry(name).nbytes)  # before hashing a (possibly sparse) huge file
        reader.verify([name])
        return reader.read(name)


# --- the manager ----------------------------------------------------------------------------------

def _value(counter) -> int:
    """An int from a Python int or a scalar variable (``step_counter``, a global step)."""
    if isinstance(counter, (int, np.integer)) and not isinstance(counter, bool):
        return int(counter)
    if hasattr(counter, "numpy"):
        return int(np.asarray(counter.numpy()))
    raise TypeError(f"expected an int or a scalar integer variable, got {counter!r}")


class CheckpointManager:
    """Keeps the newest ``max_to_keep`` checkpoints of a ``Checkpoint`` in ``directory``.

    As ``tf.train.CheckpointManager``: ``save()`` writes
    ``{directory}/{checkpoint_name}-{N}`` (N = ``checkpoint_number``, or the
    checkpoint's incremented ``save_counter``), records it in the directory's
    ``checkpoint`` file and deletes the oldest beyond ``max_to_keep`` (None keeps
    all), except one every ``keep_checkpoint_every_n_hours``. A new manager on
    the same directory picks up the checkpoints recorded there.
    """

    def __init__(self, checkpoint, directory, max_to_keep=5, keep_checkpoint_every_n_hours=None,
                 checkpoint_name: str = "ckpt", step_counter=None, checkpoint_interval=None, init_fn=None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint={checkpoint!r}: expected an md.train.Checkpoint")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep <= 0):
            raise ValueError(f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep!r}.")
        if keep_checkpoint_every_n_hours is not None and not keep_checkpoint_every_n_hours > 0:
            raise ValueError(f"keep_checkpoint_every_n_hours={keep_checkpoint_every_n_hours!r}: expected a "
                             "positive number of hours, or None")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("`step_counter` should be passed if `checkpoint_interval` is not None.")
            if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) \
                    or checkpoint_interval < 0:  # 0, as TF: every save() at a new step
                raise ValueError(f"checkpoint_interval={checkpoint_interval!r}: expected a non-negative int of steps")
        if not checkpoint_name or os.sep in checkpoint_name:
            raise ValueError(f"checkpoint_name={checkpoint_name!r}: expected a file name without a directory")
        self._checkpoint = checkpoint
        # As given (a relative directory gives relative paths, as TensorFlow's); the files themselves are
        # written, matched and deleted below the working directory of this call, wherever the process moves.
        self._directory = os.fsdecode(_fspath(directory, "directory"))
        self._origin = os.getcwd()
        self._absolute_directory = self._absolute(self._directory)
        self._max_to_keep = max_to_keep
        self._keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self._checkpoint_name = checkpoint_name
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._numbered = re.compile(re.escape(checkpoint_name) + r"-\d+")
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step = None
        self._maybe_delete = collections.OrderedDict()  # path -> timestamp, oldest first

        state = get_checkpoint_state(self._directory)
        now = time.time()
        if state is None:
            self._latest_checkpoint = None
            # A little in the past, so a checkpoint saved right away counts as newer.
            self._last_preserved_timestamp = now - 1.0
            return
        self._latest_checkpoint = state.model_checkpoint_path
        self._last_preserved_timestamp = state.last_preserved_timestamp
        if now < self._last_preserved_timestamp:
            warnings.warn(f"the checkpoint state in {self._directory!r} was written in the future (clock moved "
                          "back?); treating its times as now", RuntimeWarning, stacklevel=2)
            self._last_preserved_timestamp = now
        timestamps = state.all_model_checkpoint_timestamps or \
            [self._last_preserved_timestamp] * len(state.all_model_checkpoint_paths)
        for path, stamp in zip(state.all_model_checkpoint_paths, timestamps):
            if not self._owns(path):
                # The state file names something this manager never writes ("../precious.txt", another
                # prefix): it is not managed, so never deleted.
                continue
            stamp = min(stamp, now)
            if stamp > self._last_preserved_timestamp:
                self._maybe_delete[path] = stamp

    # -- what TF exposes --
    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self):
        return self._checkpoint

    @property
    def checkpoint_interval(self):
        return self._checkpoint_interval

    @property
    def latest_checkpoint(self):
        """The newest checkpoint's path, or None before the first save."""
        return self._latest_checkpoint

    @property
    def checkpoints(self) -> list:
        """The managed checkpoints' paths, oldest first (those kept for good by the hours rule drop out)."""
        return list(self._maybe_delete)

    def save(self, checkpoint_number=None, check_interval: bool = True, options=None):
        """Write a new checkpoint; returns its path (None when ``checkpoint_interval`` says not yet).

        ``checkpoint_number``: an int or a scalar integer variable (a global
        step); by default the checkpoint's ``save_counter``, incremented by
        every save.
        """
        if self._checkpoint_interval is not None:
            current = _value(self._step_counter)
            if self._last_checkpoint_step is not None:
                if current == self._last_checkpoint_step:
                    return None
                if check_interval and current < self._last_checkpoint_step + self._checkpoint_interval:
                    return None
            self._last_checkpoint_step = current
        counter = self._checkpoint.save_counter
        counter.assign_add(np.int64(1))
        number = int(counter.numpy()) if checkpoint_number is None else _value(checkpoint_number)
        path = f"{self._prefix}-{number}"
        wrote = self._checkpoint._write(self._absolute(path))
        stamp = time.time()
        self._maybe_delete.pop(path, None)  # an overwritten checkpoint moves to the newest end
        self._maybe_delete[path] = stamp
        self._latest_checkpoint = path
        # State first (a job stopped while deleting still finds the new one), then again without the deleted.
        if wrote:
            self._record_state()
        self._sweep(delete_files=wrote)
        if wrote:
            self._record_state()
            sweep_stale_temporaries(self._absolute_directory, lambda target: bool(self._numbered.fullmatch(target))
                                    or target == STATE_FILE)
        return path

    def restore_or_initialize(self):
        """Restore the latest checkpoint and return its path, or call ``init_fn`` and return None."""
        if self._latest_checkpoint is not None:
            self._checkpoint.restore(self._absolute(self._latest_checkpoint))
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _value(self._step_counter)
            return self._latest_checkpoint
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Nothing to wait for: saves are synchronous."""

    # -- bookkeeping --
    def _absolute(self, path: str) -> str:
        return os.path.normpath(os.path.join(self._origin, path))

    def _owns(self, path: str) -> bool:
        """Whether ``path`` is one of this manager's checkpoints: ``{directory}/{checkpoint_name}-N``."""
        path = self._absolute(path)
        return (os.path.dirname(path) == self._absolute_directory
                and bool(self._numbered.fullmatch(os.path.basename(path))))

    def _record_state(self) -> None:
        _write_state(self._absolute_directory, self._absolute(self._latest_checkpoint),
                     [self._absolute(p) for p in self._maybe_delete],
                     list(self._maybe_delete.values()), self._last_preserved_timestamp)

    def _sweep(self, delete_files: bool) -> None:
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            path, stamp = self._maybe_delete.popitem(last=False)
            hours = self._keep_checkpoint_every_n_hours
            if hours and stamp - hours * 3600.0 >= self._last_preserved_timestamp:
                self._last_preserved_timestamp = stamp  # kept on disk for good, no longer managed
                continue
            if delete_files and self._owns(path):
                try:
                    if stat.S_ISREG(os.lstat(self._absolute(path)).st_mode):
                        os.remove(self._absolute(path))
                except FileNotFoundError:
                    pass

    def __repr__(self) -> str:
        return (f"<CheckpointManager directory={self._directory!r} max_to_keep={self._max_to_keep} "
                f"latest={self._latest_checkpoint!r}>")
