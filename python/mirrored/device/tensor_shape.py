"""``md.TensorShape``: ``tf.TensorShape`` for the shapes TF code asks of variables and specs.

TF ports call ``v.shape.as_list()``, ``x.shape.rank``, ``shape.num_elements()``;
code written for NumPy compares shapes with tuples and unpacks them. A
``TensorShape`` here is a tuple of ints (``None`` for an unknown dimension),
so it is both: equal to, hashing like and unpacking like the tuple, with
TensorFlow's methods and answers (tests/data/tf_tensor_shape_reference.json, recorded from TF).
A shape of unknown rank (``TensorShape(None)``) is the empty tuple marked
unknown: it equals only another unknown shape, as in TF.

NumPy/CuPy arrays keep their own tuple ``.shape``; this type is for the
objects TensorFlow gives a TensorShape: variables and ``TensorSpec``.
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["TensorShape", "as_shape"]


def _dimension(d, dims):
    if d is None:
        return None
    if hasattr(d, "value") and not isinstance(d, (int, np.integer)):  # a TF Dimension-like object
        d = d.value
        if d is None:
            return None
    try:
        value = operator.index(d)
    except TypeError:
        raise TypeError(f"dims={dims!r}: dimension {d!r} is not an int or None; pass e.g. [2, None, 3]") from None
    if value < 0:
        raise ValueError(f"dims={dims!r}: dimension {value} is negative; use None for an unknown dimension")
    return value


class TensorShape(tuple):
    """``tf.TensorShape(dims)``: ``dims`` a sequence of ints and Nones (or one int), or None (unknown rank)."""

    _unknown_rank = False

    def __new__(cls, dims=()):
        if dims is None:
            shape = super().__new__(cls, ())
            shape._unknown_rank = True
            return shape
        if isinstance(dims, TensorShape):
            return dims
        if isinstance(dims, (int, np.integer)):
            dims = (dims,)
        return super().__new__(cls, (_dimension(d, dims) for d in dims))

    # TF's properties and methods

    @property
    def rank(self):
        """The number of dimensions; None for an unknown rank."""
        return None if self._unknown_rank else tuple.__len__(self)

    ndims = rank

    @property
    def dims(self):
        """The dimensions as a list of ints (None: unknown); None for an unknown rank. (TF wraps each in a
        ``Dimension``; here they are the ints ``as_list`` gives.)"""
        return None if self._unknown_rank else list(self)

    def as_list(self) -> list:
        if self._unknown_rank:
            raise ValueError("as_list() is not defined on an unknown TensorShape.")
        return list(self)

    def num_elements(self):
        """The product of the dimensions; None when any (or the rank) is unknown."""
        if not self.is_fully_defined():
            return None
        return int(np.prod(self, dtype=np.int64)) if self else 1

    def is_fully_defined(self) -> bool:
        return not self._unknown_rank and None not in self

    def is_compatible_with(self, other) -> bool:
        """Whether some fully defined shape could be both: equal ranks, and each pair of dimensions equal
        where both are known."""
        other = as_shape(other)
        if self._unknown_rank or other._unknown_rank:
            return True
        return tuple.__len__(self) == tuple.__len__(other) and all(
            a is None or b is None or a == b for a, b in zip(self, other))

    def assert_is_compatible_with(self, other) -> None:
        if not self.is_compatible_with(other):
            raise ValueError(f"Shapes {self} and {as_shape(other)} are incompatible")

    def merge_with(self, other) -> "TensorShape":
        """The shape with what both know: each dimension from whichever shape knows it."""
        other = as_shape(other)
        if not self.is_compatible_with(other):
            raise ValueError(f"Shapes {self} and {other} are not compatible")
        if self._unknown_rank:
            return other
        if other._unknown_rank:
            return self
        return TensorShape([b if a is None else a for a, b in zip(self, other)])

    def concatenate(self, other) -> "TensorShape":
        other = as_shape(other)
        if self._unknown_rank or other._unknown_rank:
            return TensorShape(None)
        return TensorShape(tuple(self) + tuple(other))

    def assert_is_fully_defined(self) -> None:
        if not self.is_fully_defined():
            raise ValueError(f"Shape {self} is not fully defined")

    def assert_has_rank(self, rank) -> None:
        """Raises unless the rank is ``rank`` (an unknown rank may be any)."""
        if self.rank not in (None, rank):
            raise ValueError(f"Shape {self} must have rank {rank}")

    def assert_same_rank(self, other) -> None:
        other = as_shape(other)
        if None not in (self.rank, other.rank) and self.rank != other.rank:
            raise ValueError(f"Shapes {self} and {other} must have the same rank")

    def with_rank(self, rank) -> "TensorShape":
        """This shape, known to have rank ``rank`` (an unknown rank becomes ``rank`` unknown dimensions)."""
        try:
            return self.merge_with(TensorShape([None] * rank))
        except ValueError:
            raise ValueError(f"Shape {self} must have rank {rank}") from None

    def with_rank_at_least(self, rank) -> "TensorShape":
        if self.rank is not None and self.rank < rank:
            raise ValueError(f"Shape {self} must have rank at least {rank}")
        return self

    def with_rank_at_most(self, rank) -> "TensorShape":
        if self.rank is not None and self.rank > rank:
            raise ValueError(f"Shape {self} must have rank at most {rank}")
        return self

    def most_specific_compatible_shape(self, other) -> "TensorShape":
        """The most specific shape both shapes are: unknown rank where the ranks differ, else each dimension
        kept where both agree on it."""
        other = as_shape(other)
        if None in (self.rank, other.rank) or self.rank != other.rank:
            return TensorShape(None)
        return TensorShape([a if a == b else None for a, b in zip(self, other)])

    def is_subtype_of(self, other) -> bool:
        """Whether every shape this one describes is one ``other`` describes (TF's trace-type order)."""
        other = as_shape(other)
        if other._unknown_rank:
            return True
        if self._unknown_rank or self.rank != other.rank:
            return False
        return all(b is None or a == b for a, b in zip(self, other))

    def most_specific_common_supertype(self, others) -> "TensorShape":
        """The most specific shape this one and each of ``others`` are subtypes of."""
        shape = self
        for other in others:
            shape = shape.most_specific_compatible_shape(other)
        return shape

    # the tuple, where TF's answer differs

    def __add__(self, other):
        return self.concatenate(other)

    def __radd__(self, other):
        return as_shape(other).concatenate(self)

    def __iter__(self):
        if self._unknown_rank:
            raise ValueError("Cannot iterate over a shape with unknown rank.")
        return tuple.__iter__(self)

    def __getitem__(self, key):
        if self._unknown_rank:
            return TensorShape(None) if isinstance(key, slice) else None
        item = tuple.__getitem__(self, key)
        return TensorShape(item) if isinstance(key, slice) else item

    def __len__(self) -> int:
        if self._unknown_rank:
            raise ValueError("Cannot take the length of shape with unknown rank.")
        return tuple.__len__(self)

    def __bool__(self) -> bool:
        return not self._unknown_rank  # TF's: every shape of known rank is true, the scalar shape () too

    def __eq__(self, other):
        if self._unknown_rank or isinstance(other, TensorShape) and other._unknown_rank:
            return isinstance(other, TensorShape) and self._unknown_rank and other._unknown_rank
        if isinstance(other, list):  # TF's: TensorShape([2, 3]) == [2, 3]
            other = tuple(other)
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__

    def __str__(self) -> str:
        return "<unknown>" if self._unknown_rank else tuple.__repr__(tuple(self))

    def __repr__(self) -> str:
        return "TensorShape(None)" if self._unknown_rank else f"TensorShape({list(self)})"

    def __reduce__(self):
        return TensorShape, (None if self._unknown_rank else tuple(self),)


def as_shape(shape) -> TensorShape:
    """``tf.TensorShape``'s conversion: a TensorShape as it is, else ``TensorShape(shape)``."""
    return shape if isinstance(shape, TensorShape) else TensorShape(shape)
