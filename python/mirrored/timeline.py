"""A Chrome-trace timeline of every collective, as Horovod's timeline gives.

Set ``MIRRORED_TIMELINE=path.json`` before importing ``mirrored`` (or call
``mirrored.timeline.start(path)``) and open the file in chrome://tracing or
https://ui.perfetto.dev. Each local replica is one row (``tid`` = replica id,
``pid`` = the process, so the workers of a multi-worker job sit side by side):

* a ``wait:<what>`` span from the moment that replica reached a rendezvous
  (``merge_call``, a replica-context ``all_reduce``) until it was released —
  the gap before the collective inside it is the time spent waiting for the
  slowest replica (Horovod's NEGOTIATE phase);
* a span per collective (``all_reduce``, ``batch_all_reduce``, ``broadcast``,
  ...) with ``args`` = bytes per replica, algorithm, replica count.

One native call reduces the buffers of all local replicas together, so a
collective has the same start and end on every replica row; what differs per
replica is its arrival, which the wait span shows.

Disabled, ``span`` and ``replica_wait`` cost one global check and return a
shared no-op context manager.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

__all__ = ["start", "stop", "enabled", "span", "replica_wait"]


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


class _Trace:
    """An open trace file; events are appended as they finish."""

    def __init__(self, path: str):
        self.path = path
        self.pid = os.getpid()
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.rows = set()  # replica rows already named
        self.file = open(path, "w", encoding="utf-8")
        # A JSON array; chrome://tracing also reads it when the closing bracket is
        # missing, so a crashed run still leaves a usable trace.
        self.file.write("[\n")
        self._write({"name": "process_name", "ph": "M", "pid": self.pid,
                     "args": {"name": f"mirrored (pid {self.pid})"}})

    def now_us(self) -> float:
        return (time.perf_counter() - self.t0) * 1e6

    def _write(self, event: dict) -> None:
        self.file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def emit(self, name: str, rows, ts: float, end: float, args: dict, cat: str) -> None:
        with self.lock:
            for row in rows:
                if row not in self.rows:
                    self.rows.add(row)
                    self._write({"name": "thread_name", "ph": "M", "pid": self.pid,
                                 "tid": row, "args": {"name": f"replica {row}"}})
                self._write({"name": name, "cat": cat, "ph": "X", "pid": self.pid,
                             "tid": row, "ts": round(ts, 3), "dur": round(end - ts, 3),
                             "args": args})

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
        self.ts = self.trace.now_us()
        return self

    def __exit__(self, exc_type, exc, tb):
        args = self.args if exc_type is None else {**self.args, "error": exc_type.__name__}
        self.trace.emit(self.name, self.rows, self.ts, self.trace.now_us(), args, self.cat)
        return False


def start(path) -> None:
    """Start writing the timeline to ``path`` (replacing a timeline already open)."""
    global _trace
    with _guard:
        if _trace is not None:
            _trace.close()
        _trace = _Trace(os.fspath(path))


def stop() -> None:
    """Finish and close the timeline file; later collectives are not recorded."""
    global _trace
    with _guard:
        if _trace is not None:
            trace, _trace = _trace, None
            trace.close()


def enabled() -> bool:
    return _trace is not None


def span(name: str, nbytes: int, algorithm: str, nreplicas: int):
    """Context manager around one collective over ``nreplicas`` local buffers.

    ``nbytes`` is the size of one replica's buffer (the nccl-tests "size").
    """
    trace = _trace
    if trace is None:
        return _NULL
    args = {"bytes": int(nbytes), "algorithm": str(algorithm), "replicas": int(nreplicas)}
    return _Span(trace, name, range(int(nreplicas)), args, "collective")


def replica_wait(replica_id: int, what: str):
    """Context manager around one replica's stay in a rendezvous (``what``: e.g. "merge_call")."""
    trace = _trace
    if trace is None:
        return _NULL
    return _Span(trace, f"wait:{what}", (int(replica_id),), {"replica": int(replica_id)}, "wait")


atexit.register(stop)
if os.environ.get("MIRRORED_TIMELINE"):
    start(os.environ["MIRRORED_TIMELINE"])
