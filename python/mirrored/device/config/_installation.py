"""What this installation can do: the CUDA, NCCL and Gloo (multi-worker) parts, each optional."""

from __future__ import annotations

import importlib
import os
import re

from ._devices import num_gpus

GLOO_NOT_BUILT = (
    "multi-worker collectives need mirrored's _net extension, which this build of mirrored lacks: it was built "
    "without Gloo. Install the wheel that `make wheel` builds (it bundles Gloo), or install Gloo "
    "(`apt-get install libgloo-dev` on Debian/Ubuntu) and rebuild mirrored from source (`pip install .`)"
)


def net_module():
    """The ``mirrored._net`` extension (Gloo over TCP), or a RuntimeError saying what is missing.

    Two different failures: the extension was never built (no Gloo at build
    time), or it was built but a shared library it needs cannot be loaded now;
    the second names that library.
    """
    try:
        # By its full name, as engine.extension() loads the CUDA one: an extension runs no Python of ours,
        # and ``from ... import _net`` would go through mirrored's __init__, which imports this module.
        _net = importlib.import_module("mirrored._net")
    except ModuleNotFoundError as e:
        if e.name != "mirrored._net":
            raise
        raise RuntimeError(GLOO_NOT_BUILT) from e
    except ImportError as e:
        raise RuntimeError(net_load_error(str(e))) from e
    return _net


def net_load_error(message: str) -> str:
    """The error for an ``_net`` extension that exists but does not load (``message``: the ImportError's)."""
    match = re.match(r"^(\S+): cannot open shared object file", message)
    if match:
        lib = match.group(1)
        hint = " (Debian/Ubuntu: `apt-get install libgloo0`)" if lib.startswith("libgloo") else ""
        return (f"mirrored's multi-worker extension _net needs the shared library {lib}, which the dynamic loader "
                f"cannot find (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r}): install it{hint} or add "
                f"its directory to LD_LIBRARY_PATH; the wheel that `make wheel` builds carries its own copy")
    return f"mirrored's multi-worker extension _net failed to load: {message}"


def is_gloo_available() -> bool:
    """True when multi-worker collectives over TCP (Gloo) work in this installation."""
    try:
        net_module()
    except RuntimeError:
        return False
    return True


def is_nccl_available() -> bool:
    """True when the CUDA extension is built and libnccl loads (nvidia-nccl-cu13 or the system's)."""
    from ..gpu import nccl_available

    return nccl_available()


def is_cuda_available() -> bool:
    """True when the CUDA extension is built and sees at least one GPU (driver and device present)."""
    return num_gpus() > 0
