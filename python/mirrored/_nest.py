"""Nested structures (tuples, namedtuples, lists, dicts) of leaves, as tf.nest sees them."""

from __future__ import annotations

from collections import abc

# What each type is to nest, found once per type: every replica's every
# collective flattens its value, and an ABC check (abc.Mapping) on a leaf
# costs more than the rest of a small collective's Python.
_LEAF, _MAPPING, _NAMEDTUPLE, _SEQUENCE = range(4)
_kinds: dict = {}


def _kind(x) -> int:
    t = type(x)
    kind = _kinds.get(t)
    if kind is None:
        if isinstance(x, abc.Mapping):
            kind = _MAPPING
        elif isinstance(x, tuple) and hasattr(x, "_fields"):
            kind = _NAMEDTUPLE
        elif isinstance(x, (list, tuple)):
            kind = _SEQUENCE
        else:
            kind = _LEAF
        _kinds[t] = kind
    return kind


def _sorted_keys(mapping) -> list:
    """A mapping's keys in tf.nest's order; keys that do not sort (1 beside 'a') are TF's TypeError, not
    Python's "'<' not supported between instances"."""
    try:
        return sorted(mapping)
    except TypeError:
        raise TypeError(f"nest only supports dicts with sortable keys; got the keys {list(mapping)!r} (use keys of "
                        "one type, e.g. all strings)") from None


def is_nested(x) -> bool:
    return _kind(x) != _LEAF


def flatten(structure) -> list:
    """Leaves in a fixed order: sequences in order, mappings by sorted key (as tf.nest)."""
    kind = _kind(structure)
    if kind == _LEAF:
        return [structure]
    if kind == _MAPPING:
        return [leaf for k in _sorted_keys(structure) for leaf in flatten(structure[k])]
    return [leaf for item in structure for leaf in flatten(item)]


def flatten_with_structure_key(structure):
    """``(flatten(structure), key)`` in one walk, the key a hashable description of how ``structure`` nests
    (types, lengths, mapping keys), its leaves left out: two structures with equal keys flatten and pack alike.
    (Every call of an md.function describes its arguments so.)"""
    leaves = []
    return leaves, _describe(structure, leaves.append)


def _describe(structure, add):
    kind = _kind(structure)
    if kind == _LEAF:
        add(structure)
        return None
    if kind == _MAPPING:
        return type(structure), tuple((k, _describe(structure[k], add)) for k in _sorted_keys(structure))
    return type(structure), tuple(_describe(item, add) for item in structure)


def pack_sequence_as(structure, leaves):
    """``structure`` with its leaves replaced, in :func:`flatten` order, by ``leaves``."""
    if _kind(structure) == _LEAF:
        return next(iter(leaves))
    return _pack(structure, iter(leaves))


def _pack(structure, it):
    kind = _kind(structure)
    if kind == _LEAF:
        return next(it)
    if kind == _MAPPING:
        packed = {k: _pack(structure[k], it) for k in _sorted_keys(structure)}
        return type(structure)((k, packed[k]) for k in structure)
    if kind == _NAMEDTUPLE:
        return type(structure)(*(_pack(s, it) for s in structure))
    return type(structure)(_pack(s, it) for s in structure)


def map_structure(fn, structure):
    return pack_sequence_as(structure, [fn(leaf) for leaf in flatten(structure)])
