"""GPU all-reduce against its bounds and alternatives, all measured in one run.

    python bench/compare_gpu.py -b 1M -e 256M -f 4 --replicas 2 --logical

For each size: the native ring (mirrored), NCCL (when every replica has a
GPU of its own; NCCL refuses two ranks on one GPU), a naive CuPy
sum-and-copy, and the device-to-device copy bandwidth of the same buffer
(cudaMemcpy on GPU 0), the bound. Bandwidths follow nccl-tests: algbw =
size / time, busbw = algbw * 2(n-1)/n (GB = 1e9 bytes). ``mem_eff`` is the
ring's memory traffic per second over the copy's: with every replica on one
GPU the ring reads and writes 5(n-1) * size bytes in all (3 per element
reduced, 2 per element copied) where a copy moves 2 * size, so with n = 2
busbw / copy is at most 0.4 there, and mem_eff is the measure of how close
the ring's kernels and copies run to the memory. #wrong counts elements
that differ from the exact expected sum (the inputs are small integers).

``run(...)`` returns the rows for ``bench/compare.py --device gpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from mirrored import _gpu, collectives, config  # noqa: E402
from mirrored.bench import parse_size  # noqa: E402


def _timed(fn, devices, iters: int, warmup: int) -> float:
    """Seconds per call: `iters` calls queued back to back, timed to the last one's completion."""
    cupy = _gpu.cupy_module()
    for _ in range(warmup):
        fn()
    for d in set(devices):
        cupy.cuda.Device(d).synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    for d in set(devices):
        cupy.cuda.Device(d).synchronize()
    return (time.perf_counter() - t0) / iters


def _naive(cupy, inputs, outputs, devices):
    """What one writes without a collective library: sum on replica 0's GPU, copy the result everywhere."""
    with cupy.cuda.Device(devices[0]):
        acc = inputs[0].copy()
        for x in inputs[1:]:
            acc += x if x.device.id == devices[0] else cupy.asarray(x)
    for o, d in zip(outputs, devices):
        with cupy.cuda.Device(d):
            o[...] = acc if d == devices[0] else cupy.asarray(acc)


def run(sizes, replicas: int = 2, logical: bool = True, dtype: str = "float32", iters: int = 20,
        warmup: int = 5) -> list[dict]:
    cupy = _gpu.cupy_module()
    ngpu = len(config.list_physical_devices("GPU"))
    if ngpu == 0:
        raise SystemExit("compare_gpu: no GPU visible")
    devices = [0] * replicas if logical else [r % ngpu for r in range(replicas)]
    nccl_ok = len(set(devices)) == len(devices) and _gpu.nccl_available()
    dt = np.dtype(dtype)
    factor = 2 * (replicas - 1) / replicas
    rows = []
    for size in sizes:
        count = max(1, size // dt.itemsize)
        nbytes = count * dt.itemsize
        i = np.arange(count, dtype=np.int64)
        inputs, outputs = [], []
        for r, d in enumerate(devices):
            with cupy.cuda.Device(d):
                inputs.append(cupy.asarray(((i * 7 + r * 3) % 11 - 5).astype(dt)))
                outputs.append(cupy.empty(count, dt))
        with cupy.cuda.Device(devices[0]):
            expect = sum(cupy.asarray(x) for x in inputs).astype(dt)
            src, dst = cupy.empty(count, dt), cupy.empty(count, dt)

        def wrong():
            n = 0
            for o in outputs:
                with o.device:
                    n += int(cupy.count_nonzero(o != cupy.asarray(expect)))
                    o.fill(0)
            return n

        row = {"size": nbytes, "count": count, "type": dtype, "replicas": replicas,
               "devices": devices}
        t = _timed(lambda: dst.data.copy_from_device_async(src.data, nbytes), devices[:1], iters, warmup)
        row["copy_us"], row["copy_gbs"] = t * 1e6, nbytes / t / 1e9
        cands = {"ring": lambda: collectives.all_reduce(inputs, "sum", out=outputs, algorithm="ring"),
                 "naive": lambda: _naive(cupy, inputs, outputs, devices)}
        if nccl_ok:
            cands["nccl"] = lambda: collectives.all_reduce(inputs, "sum", out=outputs, algorithm="nccl")
        for name, fn in cands.items():
            t = _timed(fn, devices, iters, warmup)
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_busbw"] = nbytes / t / 1e9 * factor
            row[f"{name}_wrong"] = wrong()
        if logical:
            traffic = 5 * (replicas - 1) * nbytes  # bytes the ring reads and writes on the one GPU
            row["mem_eff"] = (traffic / (row["ring_us"] * 1e-6)) / (2 * nbytes / (row["copy_us"] * 1e-6))
        row["ring_vs_copy"] = row["ring_busbw"] / row["copy_gbs"]
        row["ring_vs_naive"] = row["naive_us"] / row["ring_us"]
        if nccl_ok:
            row["ring_vs_nccl"] = row["nccl_us"] / row["ring_us"]
        rows.append(row)
    return rows


def print_table(rows, file=sys.stdout):
    nccl = any("nccl_us" in r for r in rows)
    head = ["size", "count", "copy GB/s", "ring us", "ring busbw", "naive us", "naive busbw"]
    head += ["nccl us", "nccl busbw"] if nccl else []
    head += ["ring/copy", "mem_eff", "x naive"] + (["x nccl"] if nccl else []) + ["#wrong"]
    print("".join(f"{h:>13}" for h in head), file=file)
    for r in rows:
        cells = [r["size"], r["count"], f"{r['copy_gbs']:.1f}", f"{r['ring_us']:.1f}", f"{r['ring_busbw']:.1f}",
                 f"{r['naive_us']:.1f}", f"{r['naive_busbw']:.1f}"]
        if nccl:
            cells += [f"{r['nccl_us']:.1f}", f"{r['nccl_busbw']:.1f}"] if "nccl_us" in r else ["n/a", "n/a"]
        cells += [f"{r['ring_vs_copy']:.2f}", f"{r['mem_eff']:.2f}" if "mem_eff" in r else "n/a",
                  f"{r['ring_vs_naive']:.2f}"]
        cells += [f"{r['ring_vs_nccl']:.2f}" if "ring_vs_nccl" in r else "n/a"] if nccl else []
        cells.append(r["ring_wrong"] + r["naive_wrong"] + r.get("nccl_wrong", 0))
        print("".join(f"{c:>13}" for c in cells), file=file)
    if not nccl:
        print("# NCCL: n/a (replicas share a GPU, which NCCL refuses, or NCCL is not installed: "
              f"{_gpu.NCCL_FIX})", file=file)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--logical", action="store_true", help="every replica on GPU 0 (default: one GPU each, round-robin)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    sizes, s = [], a.minbytes
    while s <= a.maxbytes:
        sizes.append(s)
        s *= max(2, a.stepfactor)
    rows = run(sizes, a.replicas, a.logical, a.dtype, a.iters, a.warmup)
    cupy = _gpu.cupy_module()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}  replicas={a.replicas} "
          f"devices={rows[0]['devices'] if rows else []}  dtype={a.dtype}")
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ring_wrong"] + r["naive_wrong"] + r.get("nccl_wrong", 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
