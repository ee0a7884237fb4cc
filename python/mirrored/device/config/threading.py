"""``md.config.threading``: TensorFlow's thread-pool sizes, mapped onto mirrored's own threads.

Intra-op parallelism is the host engine's worker pool (the threads that split one host collective or kernel;
``MIRRORED_NUM_THREADS``): the pool starts at the process's first host collective, with the count set here before
then (0: the default, one per core up to 16). Set it first thing, as TF requires; a count set after the pool started
takes effect in processes started afterwards (a launched worker inherits it through the environment). Inter-op
parallelism has no pool here (each replica runs on a thread of its own): the count is kept and reported only.
"""

import os as _os

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


def set_inter_op_parallelism_threads(num_threads) -> None:
    _threads["inter"] = _count("inter op", num_threads)


def get_intra_op_parallelism_threads() -> int:
    """The host worker pool's thread count set (0: not set, the default: one per core up to 16)."""
    return _threads["intra"]


def set_intra_op_parallelism_threads(num_threads) -> None:
    """The host engine's worker threads (``MIRRORED_NUM_THREADS``), for the pool that starts at the process's first
    host collective; 0 restores the default."""
    _threads["intra"] = _count("intra op", num_threads)
    if num_threads:
        _os.environ[_ENV] = str(num_threads)
    elif _environment_default is None:
        _os.environ.pop(_ENV, None)
    else:
        _os.environ[_ENV] = _environment_default
