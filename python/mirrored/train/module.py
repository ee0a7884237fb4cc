"""``md.Module``: ``tf.Module``, a named container of variables and other modules.

    class Dense(md.Module):
        def __init__(self, fan_in, fan_out, name=None):
            super().__init__(name=name)
            with self.name_scope:                        # variables get the module's scope
                self.w = md.Variable(np.zeros((fan_in, fan_out), np.float32), name="w")
                self.b = md.Variable(np.zeros(fan_out, np.float32), name="b")

        @md.Module.with_name_scope
        def __call__(self, x):
            return x @ self.w + self.b

    model = Dense(3, 2, name="dense")   # model.w.name == "dense/w:0"
    model.trainable_variables           # (b, w): attributes in name order, then submodules
    md.train.Checkpoint(model=model)    # saves every variable the module reaches

As in TensorFlow, ``variables``, ``trainable_variables``,
``non_trainable_variables`` and ``submodules`` walk the module's attributes
(private ones too) in name order, looking into lists, tuples and dicts (by
sorted key); a module's own leaves come before those of its submodules, which
are walked in the order they were found, depth first; an object reached twice
is listed once, and a cycle of modules is not followed.
"""

from __future__ import annotations

import functools
import re
from collections import abc

from .._nest import is_nested
from ..distribute.name_scope import name_scope as _name_scope
from ..distribute.values import Variable
from .checkpoint import attached

__all__ = ["Module"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _snake_case(name: str) -> str:
    """``CamelCaseModel`` -> ``camel_case_model``, ``HTTPServer2`` -> ``http_server2`` (TensorFlow's default names)."""
    out = []
    for i, char in enumerate(name):
        previous, following = name[i - 1] if i else "", name[i + 1] if i + 1 < len(name) else ""
        # a word starts at a capital after a lower-case letter or digit, or at the last capital of an acronym
        if char.isupper() and i and (previous.islower() or previous.isdigit() or following.islower()):
            out.append("_")
        out.append(char.lower())
    return "".join(out)


class Module:
    """``tf.Module(name=None)``: ``name`` is a Python identifier; by default the class name in snake_case."""

    # Attributes the walk skips: this class's own bookkeeping (TensorFlow's hook, same name).
    _TF_MODULE_IGNORED_PROPERTIES = frozenset(("_name", "_name_scope"))

    def __init__(self, name=None):
        if name is None:
            name = _snake_case(type(self).__name__)
        elif not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
            raise ValueError(f"name={name!r} is not a valid module name. Module names must be valid Python "
                             "identifiers (e.g. a valid class name): letters, digits and underscores")
        self._name = name
        with _name_scope(name) as scope:
            self._name_scope = _name_scope(scope)  # the whole scope, so entering it later anywhere gives it again

    _defers_restoration = True  # __setattr__ calls attached()

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        # A restore may have left a value for a variable attached here only now (TF's deferred restoration).
        attached(self, name, value)

    @property
    def name(self) -> str:
        """The name given (or derived from the class); ``name_scope.name`` adds the enclosing scopes."""
        return self._name

    @property
    def name_scope(self):
        """A context manager (``md.name_scope``) in which variables are named ``'<scopes>/<name>/...'``."""
        return self._name_scope

    @property
    def variables(self) -> tuple:
        """Every variable of this module and its submodules (see the module docstring for the order)."""
        return tuple(self._flatten(predicate=_is_variable))

    @property
    def trainable_variables(self) -> tuple:
        return tuple(self._flatten(predicate=lambda x: _is_variable(x) and x.trainable))

    @property
    def non_trainable_variables(self) -> tuple:
        return tuple(self._flatten(predicate=lambda x: _is_variable(x) and not x.trainable))

    @property
    def submodules(self) -> tuple:
        """Every module reachable from this one's attributes, this one excluded."""
        return tuple(self._flatten(predicate=lambda x: isinstance(x, Module)))

    def _flatten(self, recursive=True, predicate=None, attribute_traversal_key=None, with_path=False):
        """The leaves of this module's attributes that satisfy ``predicate`` (TensorFlow's protected helper).

        ``with_path=True`` yields ``(path, leaf)`` with ``path`` a tuple of
        attribute names, indices and keys, and lists a leaf once per path.
        """
        return _walk(self, recursive, predicate or (lambda _: True), attribute_traversal_key, with_path, (),
                     {id(self)}, [])

    def _trackable_children(self) -> dict:
        """``attribute name -> value`` for ``md.train.Checkpoint``: every attribute, private ones too, as
        TensorFlow tracks them, but this class's bookkeeping."""
        return {k: v for k, v in vars(self).items() if k not in self._TF_MODULE_IGNORED_PROPERTIES}

    @classmethod
    def with_name_scope(cls, method):
        """Decorator: ``method`` runs inside ``self.name_scope`` (variables it creates get the prefix)."""
        @functools.wraps(method)
        def method_with_name_scope(self, *args, **kwargs):
            with self.name_scope:
                return method(self, *args, **kwargs)

        return method_with_name_scope

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__name__} object named {self._name!r}>"


def _is_variable(x) -> bool:
    return isinstance(x, Variable)


def _leaves_with_paths(value, path=()):
    """``(path, leaf)`` of a nested structure, in ``_nest.flatten``'s order (dicts by sorted key)."""
    if is_nested(value):
        items = sorted(value.items(), key=lambda item: item[0]) if isinstance(value, abc.Mapping) else enumerate(value)
        for key, item in items:
            yield from _leaves_with_paths(item, path + (key,))
    else:
        yield path, value


def _walk(module, recursive, predicate, traversal_key, with_path, module_path, seen, stack):
    """One module's matching leaves in attribute order, then each submodule's, depth first."""
    if id(module) in stack:
        recursive = False  # a cycle: list this module's leaves, do not walk back into its submodules
    submodules = []
    attributes = vars(module)
    for key in sorted(attributes, key=traversal_key):
        if key in module._TF_MODULE_IGNORED_PROPERTIES:
            continue
        try:
            leaves = list(_leaves_with_paths(attributes[key], (key,)))
        except TypeError as cause:  # e.g. a dict whose keys cannot be sorted
            raise ValueError(f"Error processing property {key!r} of {module!r}: {cause}") from cause
        for leaf_path, leaf in leaves:
            if not with_path:
                if id(leaf) in seen:
                    continue
                seen.add(id(leaf))
            if predicate(leaf):
                yield (module_path + leaf_path, leaf) if with_path else leaf
            if recursive and isinstance(leaf, Module):
                submodules.append((module_path + leaf_path, leaf))
    stack.append(id(module))
    for path, submodule in submodules:
        yield from _walk(submodule, recursive, predicate, traversal_key, with_path, path, seen, stack)
    stack.pop()
