"""The context stack: which strategy is current on this thread, and in which replica.

Each thread has a stack of contexts ``(strategy, replica_context)``; a
``replica_context`` of ``None`` means cross-replica context. With an empty
stack the thread is in the default context: the default strategy (one
replica, no distribution) and its default replica context, which
:mod:`mirrored.distribute.distribute_lib` installs when it defines them.
Values and variables ask this module, not the strategies, which keeps them
below the strategies in the import graph.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

from .._core import replica_context_getter as _replica_context_getter


class _Context(NamedTuple):
    strategy: object  # a distribute_lib.Strategy
    replica_context: object  # a distribute_lib.ReplicaContext, or None in cross-replica context


# _Context(strategy, replica_context) built without the NamedTuple's Python-level __new__ (~0.35 us saved
# on every step's path, and per replica); an entry must not be cached where the strategy would then
# hold itself (it goes, with its replica threads, when its last reference does).
_new_tuple = tuple.__new__

_local = threading.local()
_default: _Context | None = None


def set_default_context(ctx: _Context) -> None:
    """Install the default strategy's context (distribute_lib does, once, when it is imported)."""
    global _default
    _default = ctx


def default_context() -> _Context:
    return _default


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _top() -> _Context:
    stack = getattr(_local, "stack", None)  # (not _stack(): every collective asks, a call saved)
    return stack[-1] if stack else _default


def get_strategy():
    """The current strategy: the one whose scope (or replica) this thread is in, else the default one."""
    return _top().strategy


def has_strategy() -> bool:
    """Whether a strategy other than the default one is current."""
    return _top().strategy is not _default.strategy


def in_cross_replica_context() -> bool:
    """True inside a strategy's ``scope()`` (or a ``merge_call``), False in a replica or outside any strategy."""
    return _top().replica_context is None


def _default_replica_context():
    return _default.replica_context


# get_replica_context(): the replica context of this thread; None in cross-replica context; a default one outside
# any strategy. A builtin (csrc/bindings/rendezvous_binding.cc): every replica's collective asks it first, and its
# Python frame cost about what the rest of the question did: the top entry of this thread's stack, else
# _default_replica_context().
get_replica_context = _replica_context_getter(_local, "stack", _default_replica_context)


def get_cross_replica_context():
    """The current strategy in cross-replica context, else None."""
    top = _top()
    return top.strategy if top.replica_context is None else None


@contextlib.contextmanager
def _entered(ctx: _Context):
    stack = _stack()
    stack.append(ctx)
    try:
        yield ctx.strategy
    finally:
        stack.pop()
