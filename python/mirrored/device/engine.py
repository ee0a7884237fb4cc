"""Which extension runs the GPU path: ``mirrored._cuda`` over the CUDA runtime,
or ``mirrored._cuda_sim``, the same code over the simulated CUDA runtime
(``csrc/cuda/sim``) that the test suite uses on machines without a GPU.

Users get the CUDA runtime; the simulator only when asked for, by
``MIRRORED_CUDA_ENGINE=sim`` or :func:`select` (tests and host-overhead
benchmarks). Importing this module never fails.
"""

from __future__ import annotations

import importlib
import os

ENV = "MIRRORED_CUDA_ENGINE"
_MODULES = {"cuda": "mirrored._cuda", "sim": "mirrored._cuda_sim"}
_selected: str | None = None


def select(name: str | None) -> None:
    """Route the GPU path to engine ``name`` ("cuda" or "sim"); None: back to $MIRRORED_CUDA_ENGINE."""
    global _selected
    if name is not None and name not in _MODULES:
        raise ValueError(f"engine={name!r} is not a CUDA engine; use one of {', '.join(map(repr, _MODULES))}")
    _selected = name


def name() -> str:
    """The engine in use: "cuda" unless the simulator was selected."""
    chosen = _selected or os.environ.get(ENV) or "cuda"
    if chosen not in _MODULES:
        raise ValueError(f"{ENV}={chosen!r} is not a CUDA engine; use one of {', '.join(map(repr, _MODULES))}")
    return chosen


def extension():
    """The selected engine's extension module; ImportError when this build lacks it."""
    return importlib.import_module(_MODULES[name()])
