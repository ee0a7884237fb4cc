"""Nested structures (tuples, namedtuples, lists, dicts) of leaves, as tf.nest sees them."""

from __future__ import annotations

from collections import abc


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def is_nested(x) -> bool:
    return isinstance(x, (list, tuple, abc.Mapping))


def flatten(structure) -> list:
    """Leaves in a fixed order: sequences in order, mappings by sorted key (as tf.nest)."""
    if isinstance(structure, abc.Mapping):
        return [leaf for k in sorted(structure) for leaf in flatten(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [structure]


def pack_sequence_as(structure, leaves):
    """``structure`` with its leaves replaced, in :func:`flatten` order, by ``leaves``."""
    it = iter(leaves)
    out = _pack(structure, it)
    return out


def _pack(structure, it):
    if isinstance(structure, abc.Mapping):
        packed = {k: _pack(structure[k], it) for k in sorted(structure)}
        return type(structure)((k, packed[k]) for k in structure)
    if _is_namedtuple(structure):
        return type(structure)(*(_pack(s, it) for s in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(_pack(s, it) for s in structure)
    return next(it)


def map_structure(fn, structure):
    return pack_sequence_as(structure, [fn(leaf) for leaf in flatten(structure)])
