"""The iterator users hold (``iter(dataset)``): ``next``, ``get_next``, checkpointing, clean shutdown."""

from __future__ import annotations

import numpy as np

from .._nest import map_structure
from ..errors import InvalidArgumentError, OutOfRangeError
from .structure import decode_state, encode_state, numpy_value, spec_of


class Optional:
    """A value that may be absent (``tf.experimental.Optional``): ``has_value()``, ``get_value()``,
    ``element_spec``; ``Optional.from_value(value)``, ``Optional.empty(element_spec)``."""

    def __init__(self, value, has_value: bool, element_spec=None):
        # element_spec: the spec, or a function giving it (an iterator's, asked only if someone reads it)
        self._value, self._has_value, self._element_spec = value, has_value, element_spec

    @staticmethod
    def from_value(value) -> "Optional":
        return Optional(value, True, spec_of(value))

    @staticmethod
    def empty(element_spec) -> "Optional":
        return Optional(None, False, element_spec)

    @property
    def element_spec(self):
        if callable(self._element_spec):
            self._element_spec = self._element_spec()
        return self._element_spec

    def has_value(self) -> np.bool_:
        """Whether there is a value (a NumPy bool: TF's is a bool tensor)."""
        return np.bool_(self._has_value)

    def get_value(self):
        if not self._has_value:
            # (TF's class and words; InvalidArgumentError is a ValueError)
            raise InvalidArgumentError(None, None, "The given optional does not have a value (the iterator is "
                                       "exhausted); check has_value() first")
        return self._value


class IteratorProtocol:
    """What ``iter(dataset)`` and ``iter(distributed_dataset)`` share: Python's iterator protocol and TF's
    ``get_next`` / ``get_next_as_optional`` over ``source``, the root of a tree of iterators (``next()``,
    ``close()``) over ``dataset``. Its background threads stop at the end of the data, on ``close()`` and when
    the iterator is garbage collected."""

    _source = None
    _done = False
    _closed = False

    def __init__(self, dataset, source):
        self._dataset, self._source = dataset, source

    @property
    def element_spec(self):
        return self._dataset.element_spec

    # TF 1.x's names of the element spec's parts (tf.compat.v1.data.get_output_types/shapes/classes)
    @property
    def output_types(self):
        return map_structure(lambda s: s.dtype, self.element_spec)

    @property
    def output_shapes(self):
        return map_structure(lambda s: s.shape, self.element_spec)

    @property
    def output_classes(self):
        return map_structure(lambda s: np.ndarray, self.element_spec)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._closed:  # its threads are gone: waiting on them would never end
            raise ValueError("next() on a closed iterator: close() stopped its background threads; "
                             "make a new iterator with iter(dataset)")
        try:
            return self._source.next()
        except StopIteration:
            self._done = True
            self._source.close()  # the pipeline's threads end with the data
            raise

    def get_next(self):
        """The next element; ``md.errors.OutOfRangeError`` (a ``StopIteration``) at the end, as TF's."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError(None, None, "End of sequence") from None

    next = __next__  # (TF's iterators have the Python 2 name too; it raises StopIteration, as there)

    def get_next_as_optional(self) -> Optional:
        """The next element wrapped in an :class:`Optional` that is empty at the end of the data."""
        try:
            value = next(self)
        except StopIteration:
            return Optional(None, False, lambda: self.element_spec)
        return Optional(value, True, lambda: self._spec_of(value))

    @staticmethod
    def _spec_of(element):
        """The spec of ``element`` itself (its own shapes), as TF's Optional of a value states it."""
        return spec_of(element)

    def close(self) -> None:
        """Stop this iterator's background threads now; ``next()`` then raises ``ValueError``."""
        self._closed = True
        self._source.close()

    def __del__(self):
        if self._source is not None:
            self._source.close()


class OwnedIterator(IteratorProtocol):
    """``iter(dataset)``: yields the dataset's elements; saved by ``md.train.Checkpoint(iterator=it)``.

    Background threads (``prefetch``, parallel ``map``) belong to the iterator:
    they stop when it reaches the end, and when it is garbage collected.
    ``_serialize_to_tensors()`` / ``_restore_from_tensors()`` are the
    checkpoint protocol (TensorFlow's trackables' names): the state is the
    position in every source, every buffer's elements and every random
    generator, so a restored iterator continues with the element that followed
    the save.
    """

    def __init__(self, dataset, state=None):
        super().__init__(dataset, dataset._make_iterator(state))

    def _save(self):
        return {"done": True} if self._done else {"done": False, "it": self._source.save()}

    def _restore(self, state) -> None:
        self._source.close()
        self._done = state["done"]
        self._source = self._dataset._make_iterator(None if self._done else state["it"])
        if self._done:
            self._source.close()

    def _serialize_to_tensors(self) -> dict:
        return encode_state(self._save())

    def _restore_from_tensors(self, tensors: dict) -> None:
        self._restore(decode_state(tensors))


class NumpyIterator:
    """``dataset.as_numpy_iterator()``: the elements with device arrays copied to the host and scalar strings as
    ``bytes`` (``tf.data.NumpyIterator``); checkpointable as the iterator it reads."""

    def __init__(self, dataset):
        self._iterator = iter(dataset)

    def __iter__(self):
        return self

    def __next__(self):
        return map_structure(numpy_value, next(self._iterator))

    next = __next__

    def __repr__(self) -> str:
        return f"NumpyIterator(iterator={self._iterator!r})"

    def _serialize_to_tensors(self) -> dict:
        return self._iterator._serialize_to_tensors()

    def _restore_from_tensors(self, tensors: dict) -> None:
        self._iterator._restore_from_tensors(tensors)


class IteratorSpec:
    """The spec of an iterator (``tf.data.IteratorSpec``): the ``element_spec`` of its elements."""

    def __init__(self, element_spec):
        self._element_spec = element_spec

    @staticmethod
    def from_value(value) -> "IteratorSpec":
        return IteratorSpec(value.element_spec)

    @property
    def value_type(self):
        return IteratorProtocol

    def __eq__(self, other):
        return isinstance(other, IteratorSpec) and self._element_spec == other._element_spec

    def __hash__(self):
        return hash(repr(self._element_spec))

    def is_compatible_with(self, spec_or_value) -> bool:
        other = spec_or_value if isinstance(spec_or_value, IteratorSpec) else IteratorSpec.from_value(spec_or_value)
        return self == other

    def __repr__(self) -> str:
        return f"IteratorSpec({self._element_spec!r})"
