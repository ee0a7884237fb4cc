"""Host cost of one md.linalg.matmul beside CuPy's own product of the same operands.

    python bench/linalg_overhead.py [--repeat 2000] [--dtypes float32 float16]

On a machine with a GPU and CuPy it times both on the GPU. Without one it runs
on the simulated CUDA runtime (mirrored._cuda_sim) with the tests' CuPy
stand-in (tests/fake_cupy.py), whose `@` is NumPy's: there only md's column,
and md against an earlier build of it, mean anything.

Each call is timed alone (perf_counter around it), its queued work drained
after it outside the clock, the three calls of a row in turn, and the median
over --repeat calls of each is reported:
the host's cost of a call, which is what a launch-bound training step pays.
"native" is mirrored's binding alone with the arguments precomputed (the cuBLAS
call and what mirrored's C++ does around it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import numpy as np  # noqa: E402

import gpu_env  # noqa: E402

if gpu_env.cupy is None:
    raise SystemExit(gpu_env.SKIP_REASON)
if gpu_env.SIMULATED:
    gpu_env.install(0)
cupy = gpu_env.cupy

import mirrored as md  # noqa: E402
from mirrored.device import gpu  # noqa: E402

# (name, shapes of the stored a and b, matmul's flags, CuPy's product of a and b)
CASES = [
    ("a @ b, (512,256) (256,256)", ((512, 256), (256, 256)), {}, lambda a, b: a @ b),
    ("a.T @ b, (512,256) (512,256)", ((512, 256), (512, 256)), {"transpose_a": True}, lambda a, b: a.T @ b),
    ("a @ b.T, (512,256) (256,256)", ((512, 256), (256, 256)), {"transpose_b": True}, lambda a, b: a @ b.T),
    ("batch a @ b, (8,64,64) (8,64,64)", ((8, 64, 64), (8, 64, 64)), {}, lambda a, b: a @ b),
    ("batch a @ w, (8,64,64) (64,64)", ((8, 64, 64), (64, 64)), {}, lambda a, b: a @ b),
]
SIMULATED_SHAPES = {(512, 256): (16, 8), (256, 256): (8, 8), (8, 64, 64): (8, 4, 4), (64, 64): (4, 4)}


def per_call_us(calls, repeat: int) -> list:
    """Median µs of one call of each of ``calls``, taken in turn (so that a busy or drifting host
    weighs on each alike), the queued work drained after each call, outside the clock."""
    drain = cupy.sim.drain if gpu_env.SIMULATED else cupy.cuda.get_current_stream().synchronize
    for call in calls:
        for _ in range(20):
            call()
    drain()
    times = [[] for _ in calls]
    clock = time.perf_counter
    for _ in range(repeat):
        for call, spent in zip(calls, times):
            t0 = clock()
            call()
            spent.append(clock() - t0)
            drain()
    return [statistics.median(spent) * 1e6 for spent in times]


def native_call(a, b, flags):
    """mirrored's binding alone, for the product md.linalg.matmul(a, b, **flags) of two contiguous operands."""
    ext = gpu.cuda_module()
    gpu.load_cublas()
    codes = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
    ta, tb = flags.get("transpose_a", False), flags.get("transpose_b", False)
    m, k = a.shape[-2:][::-1] if ta else a.shape[-2:]
    n = b.shape[-2] if tb else b.shape[-1]
    count = a.shape[0] if a.ndim == 3 else 1
    out = cupy.empty((count, m, n) if count > 1 else (m, n), a.dtype)
    stream = cupy.cuda.get_current_stream().ptr
    args = (0, codes[a.dtype.name], m, n, k, count, a.data.ptr, int(ta), a.shape[-1],
            a.shape[-2] * a.shape[-1] if a.ndim == 3 else 0, b.data.ptr, int(tb), b.shape[-1],
            b.shape[-2] * b.shape[-1] if b.ndim == 3 else 0, out.data.ptr, stream)
    return lambda: ext.matmul(*args) or out  # (out lives as long as the call)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    args = p.parse_args()
    where = "simulated GPUs, CuPy stand-in" if gpu_env.SIMULATED else "GPU 0: " + str(
        cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    print(f"md.linalg.matmul host cost per call ({where}; median of {args.repeat} calls, µs)\n")
    print("| dtype | product | CuPy `@` | md.linalg.matmul | md / `@` | native |")
    print("|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for name, shapes, flags, cupys in CASES:
            if gpu_env.SIMULATED:  # (the stand-in multiplies on the host: small operands keep the run short)
                shapes = [SIMULATED_SHAPES[s] for s in shapes]
            a, b = (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes)
            ours, theirs, native = per_call_us(
                [lambda: md.linalg.matmul(a, b, **flags), lambda: cupys(a, b), native_call(a, b, flags)], args.repeat)
            print(f"| {dtype} | {name} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} | {native:.1f} |")


if __name__ == "__main__":
    main()
