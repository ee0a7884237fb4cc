"""``md.config.threading``: TensorFlow's thread-pool sizes, mapped onto mirrored's own threads.

Intra-op parallelism is the host engine's worker pool (the threads that split one host collective or kernel;
``MIRRORED_NUM_THREADS``): the pool starts at the process's first host collective, with the count set here before
then (0: the default, one per core up to 16). Set it first thing, as TF requires: once the pool has started, a
different count (of either kind) is TF's RuntimeError, not a setting silently ignored; the same count is a no-op.
Inter-op parallelism has no pool here (each replica runs on a thread of its own): the count is kept and reported only.
"""

import os as _os

from ..._core import host_pool_started as _pool_started

_ENV = "MIRRORED_NUM_THREADS"
_threads = {"inter": 0, "intra": 0}
_environment_default = _os.environ.get(_ENV)  # what a count of 0 restores


def _count(name: str, num_threads) -> int:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"num_threads={num_threads!r}: the {name} parallelism threads must be an integer >= 0 "
                         "(0: let mirrored choose)")
    return num_threads


def get_inter_op_parallelism_threads() -> int:
    """The inter-op thread count set (0: not set); kept for TF code, as no inter-op pool exists here."""
    return _threads["inter"]


def _check_not_started(kind: str, count: int) -> None:
    if count != _threads[kind] and _pool_started():
        raise RuntimeError(f"{kind.capitalize()} op parallelism cannot be modified after initialization: the host "
                           "pool started at this process's first host collective. Set the thread counts first thing "
                           "in the program, before any strategy runs (or set MIRRORED_NUM_THREADS in the "
                           "environment)")


def set_inter_op_parallelism_threads(num_threads) -> None:
    count = _count("inter op", num_threads)
    _check_not_started("inter", count)
    _threads["inter"] = count


def get_intra_op_parallelism_threads() -> int:
    """The host worker pool's thread count set (0: not set, the default: one per core up to 16)."""
    return _threads["intra"]


def set_intra_op_parallelism_threads(num_threads) -> None:
    """The host engine's worker threads (``MIRRORED_NUM_THREADS``), for the pool that starts at the process's first
    host collective; 0 restores the default. A different count once the pool started is TF's RuntimeError."""
    count = _count("intra op", num_threads)
    _check_not_started("intra", count)
    _threads["intra"] = count
    if num_threads:
        _os.environ[_ENV] = str(num_threads)
    elif _environment_default is None:
        _os.environ.pop(_ENV, None)
    else:
        _os.environ[_ENV] = _environment_default
