"""``md.name_scope``: TensorFlow 2's ``tf.name_scope`` as eager execution has it, for variable names.

    with md.name_scope("dense"):
        w = md.Variable(np.zeros(3), name="w")     # w.name == "dense/w:0"

Scopes nest (``"outer/inner/"``); a name ending in ``/`` is taken as the
whole scope and an empty name leaves every scope; names are never made
unique (eager TensorFlow does not either). The scope belongs to the thread
that entered it: a replica function of ``strategy.run`` enters its own.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["name_scope", "current_scope", "scoped_name"]

_state = threading.local()


def current_scope() -> str:
    """The scope names get now: ``""`` or ``"a/b/"``."""
    return getattr(_state, "scope", "")


def swap_scope(scope: str) -> str:
    """Make ``scope`` (a whole scope name) current on this thread; returns the one it replaces."""
    previous = getattr(_state, "scope", "")
    _state.scope = scope
    return previous


@contextlib.contextmanager
def entered(scope: str):
    """A context in which ``current_scope()`` is ``scope``, a whole scope name (``""`` or ending in ``/``)."""
    previous = current_scope()
    _state.scope = scope
    try:
        yield scope
    finally:
        _state.scope = previous


class name_scope:  # noqa: N801  (TensorFlow's spelling)
    """``with md.name_scope("block") as scope:``: names made inside start with ``scope`` (``"block/"``)."""

    def __init__(self, name):
        if not isinstance(name, str):
            raise ValueError(f"name={name!r}: the name of a name_scope must be a string, e.g. md.name_scope('dense')")
        self._name = name
        self._contexts = []

    @property
    def name(self) -> str:
        return self._name

    def __enter__(self) -> str:
        name, previous = self._name, current_scope()
        scope = "" if not name else name if name.endswith("/") else f"{previous}{name}/"
        context = entered(scope)
        self._contexts.append(context)  # a stack: the same object may be entered again inside itself
        return context.__enter__()

    def __exit__(self, *exc_info):
        return self._contexts.pop().__exit__(*exc_info)


def scoped_name(name: str) -> str:
    """``name`` inside the current scope, as a variable created here is named."""
    return current_scope() + name
