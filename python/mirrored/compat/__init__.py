"""Older TensorFlow spellings: ``compat.v1`` (TF 1.x ``tf.compat.v1.distribute``) and ``compat.contrib`` (TF 1.11)."""

from . import contrib, v1
