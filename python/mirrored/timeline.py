"""A Chrome-trace timeline of every collective, as Horovod's timeline gives.

Set ``MIRRORED_TIMELINE=path.json`` before importing ``mirrored`` (or call
``mirrored.timeline.start(path)``) and open the file in chrome://tracing or
https://ui.perfetto.dev. Each local replica is one row, named
``worker:i/replica:j`` in a multi-worker job (``replica j`` alone in a
single-process run); ``pid`` is the process.

* a ``wait:<what>`` span from the moment that replica reached a rendezvous
  (``merge_call``, a replica-context ``all_reduce``) until it was released —
  the gap before the collective inside it is the time spent waiting for the
  slowest replica (Horovod's NEGOTIATE phase);
* a span per collective (``all_reduce``, ``batch_all_reduce``, ``broadcast``,
  ``all_reduce[workers]``, ...) with ``args`` = bytes per replica, algorithm,
  replicas of the job and of this worker;
* your own annotations: ``mark(name)`` (an instant) and ``with region(name):``
  (a span), on the calling replica's row inside ``strategy.run``, else on the
  worker's ``host`` row — e.g. one region per training step.

Jobs: every task may be given the same path (Horovod's habit). When
``TF_CONFIG`` names a job of several tasks, each task writes its own file,
the path with the task inserted before the extension: ``trace.json`` becomes
``trace.worker-0.json``, ``trace.worker-1.json``, ... Timestamps are
microseconds on one clock for the whole job: when the workers meet at
rendezvous each one measures its offset to task 0's clock through the
rendezvous store (the round trip with the least delay of a few; the
uncertainty, half that round trip, is recorded in the trace's ``clock_sync``
metadata), so files of one job line up;
``md.timeline.merge("job.json", glob.glob("trace.*.json"))`` joins them into
one trace.

Disabled, ``span``, ``replica_wait``, ``region`` and ``mark`` cost one global
check (``span``-likes return a shared no-op context manager).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import sys
import threading
import time

__all__ = ["start", "stop", "enabled", "path", "span", "replica_wait", "mark", "region", "sync_clock", "merge"]

HOST_ROW = -1  # tid of the row for annotations made outside replica context
CLOCK_ROUNDS = 5  # ping-pongs per worker at rendezvous; the quickest one sets the offset


class _Null:
    """The context manager handed out while the timeline is off: does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _Null()
_trace = None  # the open _Trace, or None when disabled
_guard = threading.Lock()  # serialises start/stop
# This process's clock: wall-clock microseconds at import, advanced by the
# monotonic counter (wall time can step; the counter cannot).
_WALL0_US = time.time() * 1e6
_PERF0 = time.perf_counter()
_offset_us = 0.0  # added to local time to get task 0's clock (set at rendezvous)
_task = None  # "worker:1" once known (TF_CONFIG at start, or the rendezvous)


def _local_us() -> float:
    return _WALL0_US + (time.perf_counter() - _PERF0) * 1e6


def now_us() -> float:
    """Microseconds on the job's clock (task 0's), the timeline's ``ts``."""
    return _local_us() + _offset_us


def _tf_config_task():
    """(task name, number of chief/worker tasks) from TF_CONFIG, or (None, 0)."""
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        task = config.get("task") or {}
        cluster = config.get("cluster") or {}
        count = sum(len(cluster.get(job) or ()) for job in ("chief", "worker"))
        if task.get("type") is None:
            return None, count
        return f"{task['type']}:{int(task.get('index', 0))}", count
    except (ValueError, TypeError, AttributeError):  # TF_CONFIG's own errors are reported where it is used
        return None, 0


def task_path(path: str, task: str | None) -> str:
    """``trace.json`` -> ``trace.worker-1.json`` for task ``worker:1``; unchanged without a task."""
    if not task:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{task.replace(':', '-')}{ext or '.json'}"


class _Trace:
    """An open trace file; events are appended as they finish."""

    def __init__(self, path: str):
        self.path = path
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.rows = set()  # rows already named
        self.file = open(path, "w", encoding="utf-8")
        # A JSON array; chrome://tracing also reads it when the closing bracket is
        # missing, so a crashed run still leaves a usable trace.
        self.file.write("[\n")
        self.name_process()

    def name_process(self) -> None:
        label = f"mirrored {_task} (pid {self.pid})" if _task else f"mirrored (pid {self.pid})"
        self._write({"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": label}})

    def _write(self, event: dict) -> None:
        self.file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _name_row(self, row: int) -> None:
        if row in self.rows:
            return
        self.rows.add(row)
        what = "host" if row == HOST_ROW else f"replica:{row}" if _task else f"replica {row}"
        self._write({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": row,
                     "args": {"name": f"{_task}/{what}" if _task else what}})
        self._write({"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": row,
                     "args": {"sort_index": row}})

    def emit(self, name: str, rows, ts: float, end: float, args: dict, cat: str) -> None:
        with self.lock:
            for row in rows:
                self._name_row(row)
                self._write({"name": name, "cat": cat, "ph": "X", "pid": self.pid,
                             "tid": row, "ts": round(ts, 3), "dur": round(end - ts, 3),
                             "args": args})

    def instant(self, name: str, row: int, args: dict) -> None:
        with self.lock:
            self._name_row(row)
            self._write({"name": name, "cat": "user", "ph": "i", "s": "t", "pid": self.pid, "tid": row,
                         "ts": round(now_us(), 3), "args": args})

    def metadata(self, name: str, args: dict) -> None:
        with self.lock:
            self._write({"name": name, "ph": "M", "pid": self.pid, "args": args})

    def renamed(self) -> None:
        """The task became known: name the process and every row again (the last name wins in viewers)."""
        with self.lock:
            self.name_process()
            rows, self.rows = self.rows, set()
            for row in sorted(rows):
                self._name_row(row)

    def close(self) -> None:
        with self.lock:
            # Trailing metadata event so the array ends without a dangling comma.
            self.file.write(json.dumps({"name": "trace_end", "ph": "M", "pid": self.pid,
                                        "args": {"name": "end"}}) + "\n]\n")
            self.file.close()


class _Span:
    __slots__ = ("trace", "name", "rows", "args", "cat", "ts")

    def __init__(self, trace: _Trace, name: str, rows, args: dict, cat: str):
        self.trace, self.name, self.rows, self.args, self.cat = trace, name, rows, args, cat

    def __enter__(self):
        self.ts = now_us()
        return self

    def __exit__(self, exc_type, exc, tb):
        args = self.args if exc_type is None else {**self.args, "error": exc_type.__name__}
        self.trace.emit(self.name, self.rows, self.ts, now_us(), args, self.cat)
        return False


def start(path) -> None:
    """Start writing the timeline to ``path`` (replacing a timeline already open).

    In a job of several tasks (``TF_CONFIG``), the task goes into the file
    name (see the module doc); :func:`path` says where the events go.
    """
    global _trace, _task
    with _guard:
        if _trace is not None:
            _trace.close()
        task, count = _tf_config_task()
        if task is not None and count > 1:
            _task = task
        _trace = _Trace(task_path(os.fspath(path), _task))


def stop() -> None:
    """Finish and close the timeline file; later collectives are not recorded."""
    global _trace
    with _guard:
        if _trace is not None:
            trace, _trace = _trace, None
            trace.close()


def enabled() -> bool:
    return _trace is not None


# enabled()'s answer for native callers, with no Python frame: the open trace (true) or None. The
# replica rendezvous asks it at every replica's every collective.
enabled_native = functools.partial(getattr, sys.modules[__name__], "_trace")
# The same as (module, name), for a native caller that reads the global from the module's dict itself (the
# replica rendezvous, at every replica's every collective: no call at all).
enabled_flag = (sys.modules[__name__], "_trace")


def path() -> str | None:
    """The file this process's timeline goes to (None when disabled)."""
    trace = _trace
    return None if trace is None else trace.path


def span(name: str, nbytes: int, algorithm: str, nreplicas: int, job_replicas: int | None = None):
    """Context manager around one collective over this process's ``nreplicas`` buffers (one row each).

    ``nbytes`` is the size of one replica's buffer (the nccl-tests "size");
    ``job_replicas`` the replicas of the whole job when it spans workers.
    """
    trace = _trace
    if trace is None:
        return _NULL
    args = {"bytes": int(nbytes), "algorithm": str(algorithm),
            "replicas": int(job_replicas if job_replicas is not None else nreplicas),
            "local_replicas": int(nreplicas)}
    return _Span(trace, name, range(int(nreplicas)), args, "collective")


def replica_wait(replica_id: int, what: str):
    """Context manager around one replica's stay in a rendezvous (``what``: e.g. "merge_call")."""
    trace = _trace
    if trace is None:
        return _NULL
    return _Span(trace, f"wait:{what}", (int(replica_id),), {"replica": int(replica_id)}, "wait")


def _host_row() -> int:
    return HOST_ROW


# The row of the calling thread: the local replica it runs, else HOST_ROW. The
# distribute layer, which knows replicas, installs its lookup (set_row_source):
# this module sits below it and imports nothing from it.
_caller_row = _host_row


def set_row_source(row_of_caller) -> None:
    """Install ``row_of_caller() -> int``, the local replica the calling thread runs (HOST_ROW: none)."""
    global _caller_row
    _caller_row = row_of_caller


def _check_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name={name!r}: a timeline annotation needs a non-empty string name")
    return name


def mark(name: str, **args) -> None:
    """Record an instant event ``name`` now (``args``: JSON-serialisable details shown with it)."""
    _check_name(name)
    trace = _trace
    if trace is not None:
        trace.instant(name, _caller_row(), args)


def region(name: str, **args):
    """``with md.timeline.region("step"): ...`` records the block as a span named ``name``."""
    _check_name(name)
    trace = _trace
    if trace is None:
        return _NULL
    return _Span(trace, name, (_caller_row(),), args, "user")


# --- one clock for a job ----------------------------------------------------------------------


def sync_clock(store, rank: int, tasks, timeout: float, scope: str = "") -> None:
    """Called by every task when it joins a job's rendezvous store: align this process's clock to task 0's.

    Task 0 answers each other task's pings in turn with its own time; a task
    takes ``offset = t0 - (sent + received) / 2`` from the ping-pong with the
    shortest round trip. Every task must call it, at the same point, with
    the same ``scope`` (the group's, so that each group's keys are its own).
    """
    global _offset_us, _task
    name = str(tasks[rank])
    if rank == 0:
        for peer in range(1, len(tasks)):
            for k in range(CLOCK_ROUNDS):
                ping = f"{scope}/clock/{peer}/{k}/ping"
                if store.wait([ping], timeout):
                    raise TimeoutError(f"task {tasks[peer]} did not arrive for the clock sync within {timeout} s")
                store.set(f"{scope}/clock/{peer}/{k}/pong", repr(_local_us()).encode())
        offset, error = 0.0, 0.0
    else:
        best = None
        for k in range(CLOCK_ROUNDS):
            pong = f"{scope}/clock/{rank}/{k}/pong"
            sent = _local_us()
            store.set(f"{scope}/clock/{rank}/{k}/ping", b"1")
            if store.wait([pong], timeout):
                raise TimeoutError(f"task {tasks[0]} did not answer the clock sync within {timeout} s")
            theirs = float(store.get(pong))
            received = _local_us()
            if best is None or received - sent < best[0]:
                best = (received - sent, theirs - (sent + received) / 2)
        offset, error = best[1], best[0] / 2
    renamed = _task != name
    _offset_us, _task = offset, name
    trace = _trace
    if trace is not None:
        if renamed:
            trace.renamed()
        trace.metadata("clock_sync", {"task": name, "offset_us": round(offset, 3),
                                      "uncertainty_us": round(error, 3)})


def merge(out: str, paths) -> int:
    """Join the timelines of a job's tasks into one trace at ``out``; returns the number of events written."""
    events = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            events += json.load(f)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(events, f, separators=(",", ":"))
    return len(events)


def _start_from_environment() -> None:
    """MIRRORED_TIMELINE at import: a path that cannot be written costs the timeline, never the import."""
    where = os.environ.get("MIRRORED_TIMELINE")
    if not where:
        return
    try:
        start(where)
    except OSError as e:
        logging.getLogger("mirrored").warning(
            "MIRRORED_TIMELINE=%s: cannot write the timeline there (%s); running without one. Point it at a "
            "writable file, or unset it", where, e.strerror or e)


atexit.register(stop)
_start_from_environment()
