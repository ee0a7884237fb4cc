"""The marks of a multi-worker test module: the ``multiworker`` marker, and a skip where Gloo is not built."""

import importlib.util

import pytest

needs_gloo = pytest.mark.skipif(importlib.util.find_spec("mirrored._net") is None,
                                reason="Gloo not built (apt-get install libgloo-dev)")
MULTIWORKER = [pytest.mark.multiworker, needs_gloo]
