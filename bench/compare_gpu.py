"""GPU collectives against their bound and the alternatives, all measured in one run.

    python bench/compare_gpu.py --logical --replicas 2 4 8          # the issue's table, one GPU
    python bench/compare_gpu.py --replicas 2 -b 4 -e 256M -f 16      # one GPU per replica (NCCL too)

For each replica count and size, float32 sum all-reduce, in microseconds:
mirrored's ``auto`` (the one-pass kernel for replicas on one GPU), the
native ``ring`` and ``tree``, NCCL (when every replica has a GPU of its own:
NCCL refuses two ranks on one GPU), *naive* CuPy (``acc = x0 + x1 + ...``
then a copy into every output) and *bound*: the time a device-to-device
copy of n·S bytes takes, which reads n·S and writes n·S bytes as every
all-reduce of n buffers of S bytes must (``eff`` = bound / auto, 1.0 is the
memory's limit). Then a fused batch of 200 gradient-sized tensors (56 MB)
against per-tensor CuPy and its bound, and the host overhead of
``strategy.run`` (a trivial function, and one 4-byte all-reduce). ``#wrong``
counts result elements that differ from the exact sum (small-integer
inputs) over every timed candidate; the exit status is 1 when any differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import mirrored as md
from mirrored import collectives, config
from mirrored.device import gpu as _gpu
from mirrored.tools.bench import parse_size

ALGOS = ("auto", "ring", "tree")


def _sync(devices):
    cupy = _gpu.cupy_module()
    for d in set(devices):
        cupy.cuda.Device(d).synchronize()


def _timed(fn, devices, iters: int, warmup: int) -> float:
    """Seconds per call: `iters` calls queued back to back, timed to the last one's completion."""
    for _ in range(warmup):
        fn()
    _sync(devices)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(devices)
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


def _bound_us(cupy, nbytes: int, iters: int, warmup: int) -> float:
    """Microseconds of one device-to-device copy of nbytes on GPU 0 (reads and writes nbytes)."""
    with cupy.cuda.Device(0):
        src, dst = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
        t = _timed(lambda: dst.data.copy_from_device_async(src.data, nbytes), [0], iters, warmup)
    return t * 1e6


def _devices(replicas: int, logical: bool) -> list:
    ngpu = len(config.list_physical_devices("GPU"))
    return [0] * replicas if logical else [r % ngpu for r in range(replicas)]


def all_reduce_rows(sizes, replicas: int, logical: bool, iters: int, warmup: int) -> list[dict]:
    cupy = _gpu.cupy_module()
    devices = _devices(replicas, logical)
    nccl_ok = len(set(devices)) == len(devices) and _gpu.nccl_available()
    rows = []
    for size in sizes:
        count = max(1, size // 4)
        nbytes = count * 4
        i = np.arange(count, dtype=np.int64)
        inputs, outputs = [], []
        for r, d in enumerate(devices):
            with cupy.cuda.Device(d):
                inputs.append(cupy.asarray(((i * 7 + r * 3) % 11 - 5).astype(np.float32)))
                outputs.append(cupy.empty(count, np.float32))
        expect_host = sum(((i * 7 + r * 3) % 11 - 5) for r in range(replicas)).astype(np.float32)
        expect = {}
        for d in set(devices):
            with cupy.cuda.Device(d):
                expect[d] = cupy.asarray(expect_host)

        def wrong():
            n = 0
            for o, d in zip(outputs, devices):
                with cupy.cuda.Device(d):
                    n += int(cupy.count_nonzero(o != expect[d]))
                    o.fill(0)
            return n

        row = {"replicas": replicas, "devices": devices, "size": nbytes,
               "bound_us": _bound_us(cupy, replicas * nbytes, iters, warmup), "wrong": 0}
        cands = {a: (lambda a=a: collectives.all_reduce(inputs, "sum", out=outputs, algorithm=a)) for a in ALGOS}
        cands["naive"] = lambda: _naive(cupy, inputs, outputs, devices)
        if nccl_ok:
            cands["nccl"] = lambda: collectives.all_reduce(inputs, "sum", out=outputs, algorithm="nccl")
        for name, fn in cands.items():
            row[f"{name}_us"] = _timed(fn, devices, iters, warmup) * 1e6
            row["wrong"] += wrong()
        row["eff"] = row["bound_us"] / row["auto_us"]
        row["x_naive"] = row["naive_us"] / row["auto_us"]
        rows.append(row)
    return rows


def batch_row(replicas: int, logical: bool, iters: int, warmup: int, tensors: int = 200,
              total_bytes: int = 56 * 10**6) -> dict:
    """A fused batch of `tensors` float32 tensors of gradient-like sizes, `total_bytes` in all."""
    cupy = _gpu.cupy_module()
    devices = _devices(replicas, logical)
    weights = np.array([(t % 10 + 1) ** 2 for t in range(tensors)], np.float64)
    counts = np.maximum(1, (weights / weights.sum() * total_bytes / 4).astype(np.int64))
    lists = []
    for r, d in enumerate(devices):
        with cupy.cuda.Device(d):
            lists.append([cupy.full(int(c), r + t % 3, cupy.float32) for t, c in enumerate(counts)])
    nbytes = int(counts.sum()) * 4
    result = []

    def fused():
        result[:] = [collectives.batch_all_reduce(lists, "sum")]

    def per_tensor():
        outs = [[None] * tensors for _ in devices]
        for t in range(tensors):
            column = [lst[t] for lst in lists]
            with cupy.cuda.Device(devices[0]):
                acc = column[0].copy()
                for x in column[1:]:
                    acc += x if x.device.id == devices[0] else cupy.asarray(x)
            for r, d in enumerate(devices):
                with cupy.cuda.Device(d):
                    outs[r][t] = acc.copy() if d == devices[0] else cupy.asarray(acc)
        result[:] = [outs]

    row = {"replicas": replicas, "devices": devices, "tensors": tensors, "size": nbytes,
           "bound_us": _bound_us(cupy, replicas * nbytes, iters, warmup), "wrong": 0}
    for name, fn in (("fused", fused), ("per_tensor", per_tensor)):
        row[f"{name}_us"] = _timed(fn, devices, iters, warmup) * 1e6
        for r in range(replicas):
            for t, x in enumerate(result[0][r]):
                want = sum(q + t % 3 for q in range(replicas))
                row["wrong"] += int(cupy.count_nonzero(x != want))
    return row


def run_overhead_row(replicas: int, iters: int, warmup: int) -> dict:
    """Microseconds per strategy.run on `replicas` logical GPUs of GPU 0: trivial, and one 4-byte all-reduce."""
    cupy = _gpu.cupy_module()
    md.config.set_logical_device_configuration("GPU", 0, count=replicas)
    try:
        s = md.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
        x = s.experimental_distribute_values_from_function(lambda ctx: cupy.ones(1, cupy.float32))
        row = {"replicas": replicas, "wrong": 0}
        for name, fn, args in (("trivial", lambda: None, ()),
                               ("all_reduce_4B", lambda v: md.get_replica_context().all_reduce("sum", v), (x,))):
            for _ in range(warmup * 20):
                got = s.run(fn, args=args)
            _sync([0])
            t0 = time.perf_counter()
            for _ in range(iters * 20):
                got = s.run(fn, args=args)
            _sync([0])
            row[f"{name}_us"] = (time.perf_counter() - t0) / (iters * 20) * 1e6
            if args:
                row["wrong"] += sum(int(cupy.asnumpy(v)[0]) != replicas for v in s.experimental_local_results(got))
        return row
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


def _fmt(v):
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def print_tables(report, file=sys.stdout):
    rows = report["all_reduce"]
    nccl = any("nccl_us" in r for r in rows)
    head = ["n", "size", "auto us", "ring us", "tree us"] + (["nccl us"] if nccl else []) + \
           ["naive us", "bound us", "eff", "x naive", "#wrong"]
    print("".join(f"{h:>11}" for h in head), file=file)
    for r in rows:
        cells = [r["replicas"], r["size"], r["auto_us"], r["ring_us"], r["tree_us"]]
        cells += [r.get("nccl_us", "n/a")] if nccl else []
        cells += [r["naive_us"], r["bound_us"], f"{r['eff']:.2f}", f"{r['x_naive']:.2f}", r["wrong"]]
        print("".join(f"{_fmt(c):>11}" for c in cells), file=file)
    print("\n# fused batch_all_reduce", file=file)
    print("".join(f"{h:>13}" for h in ("n", "tensors", "bytes", "fused us", "per-tensor us", "bound us",
                                          "#wrong")), file=file)
    for r in report["batch"]:
        cells = [r["replicas"], r["tensors"], r["size"], r["fused_us"], r["per_tensor_us"], r["bound_us"], r["wrong"]]
        print("".join(f"{_fmt(c):>13}" for c in cells), file=file)
    print("\n# strategy.run host overhead (logical GPUs)", file=file)
    print("".join(f"{h:>20}" for h in ("n", "run(trivial) us", "run(all_reduce 4B) us", "#wrong")), file=file)
    for r in report["run"]:
        cells = [r["replicas"], r["trivial_us"], r["all_reduce_4B_us"], r["wrong"]]
        print("".join(f"{_fmt(c):>20}" for c in cells), file=file)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"))
    p.add_argument("-f", "--stepfactor", type=int, default=16)
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--logical", action="store_true", help="every replica on GPU 0 (default: one GPU each, round-robin)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-batch", action="store_true", help="skip the 200-tensor batch rows")
    p.add_argument("--no-run", action="store_true", help="skip the strategy.run overhead rows")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    if not config.list_physical_devices("GPU"):
        raise SystemExit("compare_gpu: no GPU visible")
    sizes, s = [], a.minbytes
    while s <= a.maxbytes:
        sizes.append(s)
        s *= max(2, a.stepfactor)
    if sizes and sizes[-1] != a.maxbytes:
        sizes.append(a.maxbytes)
    report = {"all_reduce": [], "batch": [], "run": []}
    for n in a.replicas:
        report["all_reduce"] += all_reduce_rows(sizes, n, a.logical, a.iters, a.warmup)
    if not a.no_batch:
        report["batch"].append(batch_row(2, a.logical, a.iters, a.warmup))
    if not a.no_run:
        report["run"] += [run_overhead_row(n, a.iters, a.warmup) for n in a.replicas]
    cupy = _gpu.cupy_module()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}  replicas={a.replicas} "
          f"{'logical (all on GPU 0)' if a.logical else 'one GPU each (round-robin)'}  float32 sum")
    print_tables(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    wrong = sum(r["wrong"] for rows in report.values() for r in rows)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
