"""``python -m mirrored.info``: what this installation of mirrored can do, as ``horovodrun --check-build`` tells.

    $ python -m mirrored.info
    mirrored 0.1.0 (/.../site-packages/mirrored)
    Python 3.11.7, NumPy 2.1.3
    Host kernels: avx2, 16 threads (MIRRORED_NUM_THREADS to change)
    ...

``--json`` prints the same facts as one JSON object. Nothing here fails:
whatever is missing is reported with the reason and the fix.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import sys

import numpy as np

from .. import __version__
from ..device import config

SHM_DIR = "/dev/shm"  # where shm_open(3) puts the same-host all-reduce's segment on Linux


def _loaded_library(pattern: str) -> str | None:
    """Path of the first shared library mapped into this process whose file name matches ``pattern``."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith("/") and re.search(pattern, os.path.basename(path)):
                    return path
    except OSError:  # not Linux
        pass
    return None


def _cuda() -> dict:
    try:
        from .._cuda import device_properties  # type: ignore[import-not-found]
    except ImportError as e:
        return {"built": False, "devices": 0, "reason": f"CUDA extension not built ({e}); rebuild with nvcc on PATH"}
    count = config.num_gpus()
    out = {"built": True, "devices": count, "available": config.is_cuda_available()}
    if count:
        props = [device_properties(i) for i in range(count)]
        out["names"] = [f"{d['name']} (sm_{d['compute_capability'][0]}{d['compute_capability'][1]}, "
                        f"{d['total_memory'] / 2**30:.0f} GiB)" for d in props]
    else:
        out["reason"] = "no GPU visible (no driver, no device, or CUDA_VISIBLE_DEVICES is empty)"
    return out


def _nccl() -> dict:
    from ..device import gpu as _gpu

    try:
        path, code = _gpu.load_nccl()
    except RuntimeError as e:
        return {"available": False, "reason": str(e)}
    code = int(code)
    # NCCL's version code: major*10000 + minor*100 + patch (2.9+), major*1000 + minor*100 + patch before.
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return {"available": True, "version": f"{major}.{rest // 100}.{rest % 100}", "path": str(path)}


def _cublas() -> dict:
    """The cuBLAS md.linalg.matmul uses on CuPy arrays (mirrored's own handle: capturable)."""
    from ..device import gpu as _gpu

    try:
        return {"available": True, "path": _gpu.load_cublas()}
    except RuntimeError as e:
        return {"available": False, "reason": str(e)}


def _cupy() -> dict:
    if importlib.util.find_spec("cupy") is None:
        return {"installed": False, "reason": "pip install cupy-cuda13x (GPU replicas hold CuPy arrays)"}
    try:
        import cupy
    except Exception as e:  # installed but broken (e.g. no CUDA runtime): report, never fail
        return {"installed": True, "version": None, "reason": f"import failed: {e}"}
    return {"installed": True, "version": cupy.__version__}


def _gloo() -> dict:
    try:
        config.net_module()
    except RuntimeError as e:
        return {"available": False, "reason": str(e)}
    return {"available": True, "library": _loaded_library(r"^libgloo[-.]")}


def _shm() -> dict:
    setting = os.environ.get("MIRRORED_SHM", "")
    enabled = setting != "0"
    out = {"path": SHM_DIR, "enabled": enabled, "usable": False}
    if not enabled:
        out["reason"] = "MIRRORED_SHM=0: same-host workers all-reduce over TCP"
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        out["reason"] = f"{SHM_DIR} is not available ({e.strerror}): same-host workers all-reduce over TCP"
        return out
    out["free_bytes"] = st.f_bavail * st.f_frsize
    out["usable"] = enabled and os.access(SHM_DIR, os.W_OK)
    return out


def collect() -> dict:
    """Every fact ``python -m mirrored.info`` prints, as a dict (the ``--json`` form)."""
    from .._core import isa, num_threads

    return {
        "version": __version__,
        "location": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the package, not tools/
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "isa": isa(),
        "threads": int(num_threads()),
        "cuda": _cuda(),
        "nccl": _nccl(),
        "cublas": _cublas(),
        "cupy": _cupy(),
        "gloo": _gloo(),
        "shared_memory": _shm(),
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def report(info: dict) -> str:
    cuda, nccl, cupy, gloo, shm = info["cuda"], info["nccl"], info["cupy"], info["gloo"], info["shared_memory"]
    cublas = info["cublas"]
    lines = [
        f"mirrored {info['version']} ({info['location']})",
        f"Python {info['python']}, NumPy {info['numpy']}, {info['platform']}",
        f"Host kernels:  {info['isa']}, {info['threads']} threads (MIRRORED_NUM_THREADS sets the count)",
        f"CUDA:          extension {'built' if cuda['built'] else 'NOT built'}, {cuda['devices']} GPU(s)"
        + (f": {', '.join(cuda['names'])}" if cuda.get("names") else f" - {cuda['reason']}"),
        f"NCCL:          {_yes(nccl['available'])}"
        + (f", {nccl['version']} from {nccl['path']}" if nccl["available"] else f" - {nccl['reason']}"),
        f"cuBLAS:        {_yes(cublas['available'])}"
        + (f", {cublas['path']} (md.linalg.matmul on GPUs)" if cublas["available"] else f" - {cublas['reason']}"),
        f"CuPy:          {cupy['version'] if cupy.get('version') else _yes(False)}"
        + (f" - {cupy['reason']}" if cupy.get("reason") else ""),
        f"Gloo:          {_yes(gloo['available'])}"
        + (f", {gloo['library'] or 'linked in'} (multi-worker collectives over TCP)" if gloo["available"]
           else f" - {gloo['reason']}"),
        f"Shared memory: {shm['path']}, same-host all-reduce {'on' if shm['usable'] else 'off'}"
        + (f", {shm['free_bytes'] / 2**30:.1f} GiB free" if "free_bytes" in shm else "")
        + (f" - {shm['reason']}" if shm.get("reason") else ""),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mirrored.info", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    args = p.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
