"""The ``mirrored`` logger, configured once when the package is imported.

Every module logs through ``logging.getLogger("mirrored")`` (or a child such
as ``"mirrored.store"``). ``MIRRORED_LOG_LEVEL`` (DEBUG, INFO, WARNING,
ERROR, CRITICAL or a number; default WARNING) sets its level. The handler
sits on the ``mirrored`` logger only, never on the root logger, and stays
quiet once the application configures the root logger (``logging.basicConfig``
...), whose handlers then print our records: nothing is printed twice.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("mirrored")

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (notebooks and test runners swap it) when nobody else would."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s mirrored: %(message)s", "%H:%M:%S"))

    def emit(self, record):
        if logger.propagate and logging.getLogger().handlers:
            return  # the root logger's handlers get this record through propagation
        self.stream = sys.stderr
        super().emit(record)


def multi_worker(extended) -> str:
    """Who this task is in its multi-worker job and which engines carry its collectives, in words."""
    resolver, group = extended._resolver, extended._group
    devices = list(extended.worker_devices)
    if group is None:
        return (f"one worker ({type(resolver).__name__} lists no other task), {len(devices)} replica(s) on "
                f"{devices}; reductions: native, in this process")
    gloo = group._gloo
    reason = getattr(gloo, "shared_memory_off", "")
    across = ("shared memory for all-reduce (every task on this host), Gloo over TCP for the rest"
              if not reason else f"Gloo over TCP (no shared memory: {reason})")
    return (f"task {group.tasks[group.rank]} (rank {group.rank} of {group.num_workers}, from "
            f"{type(resolver).__name__}), {group.local_replicas} local replica(s) on {devices}; "
            f"across workers: {across}")


def _level_from_env() -> tuple[int, str | None]:
    """The level ``MIRRORED_LOG_LEVEL`` names, and a complaint when it names none."""
    raw = os.environ.get("MIRRORED_LOG_LEVEL", "").strip()
    if not raw:
        return logging.WARNING, None
    if raw.upper() in _LEVELS:
        return getattr(logging, raw.upper()), None
    if raw.isdigit():
        return int(raw), None
    return logging.WARNING, (f"MIRRORED_LOG_LEVEL={raw!r} is not a log level; use one of {', '.join(_LEVELS)} "
                             "(or a number); using WARNING")


def configure() -> None:
    """Sets the level from the environment and installs the handler (once per process)."""
    if any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    level, complaint = _level_from_env()
    logger.setLevel(level)
    logger.addHandler(_StderrHandler())
    if complaint:
        logger.warning(complaint)


configure()
