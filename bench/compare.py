"""Side-by-side comparison, measured in one run on this machine.

    python bench/compare.py --replicas 2 4 [--sizes 4,64K,1M,4M,16M,64M] [--json out.json]
    python bench/compare.py --device gpu           # delegates to bench/compare_gpu.py

For each replica count and size (float32 sum, in place), times:
  bound   the memory-bandwidth bound: one copy of N*S bytes (np.copyto), i.e.
          the N*S read + N*S written that any all-reduce of N buffers must do,
          by one thread or split over as many threads as our pool has (the faster)
  naive   NumPy: t = a0 + a1 (+ a2 ...), then copy t into every replica
  ours    mirrored.collectives.all_reduce, per algorithm
  gloo    torch.distributed gloo with N processes on 127.0.0.1 (when torch is installed)
and prints a Markdown table with ratios, plus the small-message latency, the
fusion check and the Strategy step overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from mirrored import _core, collectives
from mirrored.tools.bench import parse_size

ALGOS = ("auto", "ring", "direct", "tree")


def measure(fn, budget=0.25, min_sample=2e-3, samples=7):
    """Median seconds per call: samples of k back-to-back calls, k chosen so a sample lasts min_sample."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    k = max(1, int(min_sample / one))
    samples = max(3, min(samples, int(budget / (one * k)) or 3))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times)


_copiers = None


def split_copy(dst, src):
    """np.copyto split over the pool's thread count (NumPy releases the GIL while copying)."""
    global _copiers
    threads = _core.num_threads()
    if _copiers is None:
        from concurrent.futures import ThreadPoolExecutor

        _copiers = ThreadPoolExecutor(threads)
    parts = np.array_split(np.arange(len(src)), threads)
    list(_copiers.map(lambda p: np.copyto(dst[p[0]:p[-1] + 1], src[p[0]:p[-1] + 1]) if len(p) else None, parts))


def naive(bufs, tmp):
    np.add(bufs[0], bufs[1], out=tmp)
    for b in bufs[2:]:
        np.add(tmp, b, out=tmp)
    for b in bufs:
        np.copyto(b, tmp)


# --- torch.distributed gloo, N processes --------------------------------------

def torch_worker(rank, n, port, sizes, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    results = {}
    for size in sizes:
        t = torch.zeros(max(1, size // 4), dtype=torch.float32)
        # Every rank must make the same number of calls: a fixed count per size.
        k = max(2, min(100, int(2e7 // max(size, 1))))
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                dist.all_reduce(t)
            times.append((time.perf_counter() - t0) / k)
        results[size] = statistics.median(times)
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def torch_gloo(n, sizes):
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/mirrored-gloo-{os.getpid()}-{n}.json"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--torch-worker", str(r), str(n), str(port),
                               ",".join(map(str, sizes)), out], env=env) for r in range(n)]
    for p in procs:
        p.wait(timeout=1800)
    if any(p.returncode for p in procs):
        return None
    with open(out) as f:
        res = {int(k): v for k, v in json.load(f).items()}
    os.unlink(out)
    return res


# --- the comparison -------------------------------------------------------------

def compare(n, sizes, with_torch):
    gloo = torch_gloo(n, sizes) if with_torch else None
    rows = []
    for size in sizes:
        count = max(1, size // 4)
        bufs = [np.zeros(count, np.float32) for _ in range(n)]
        big_src = np.zeros(n * count, np.float32)
        big_dst = np.empty_like(big_src)
        tmp = np.empty(count, np.float32)
        row = {"replicas": n, "size": count * 4}
        row["bound"] = min(measure(lambda: np.copyto(big_dst, big_src)), measure(lambda: split_copy(big_dst, big_src)))
        row["naive"] = measure(lambda: naive(bufs, tmp))
        for a in ALGOS:
            row[a] = measure(lambda: collectives.all_reduce(bufs, "sum", out=bufs, algorithm=a))
        if gloo is not None:
            row["gloo"] = gloo[size]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def fmt_time(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def fmt_size(b):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b} B"


HEADER = ("| N | size | bound | naive NumPy | ours auto | ring | direct | tree | torch gloo | "
          "auto vs bound | auto vs naive | auto vs gloo |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r):
    g = r.get("gloo")
    best = r["auto"]
    return (f"| {r['replicas']} | {fmt_size(r['size'])} | {fmt_time(r['bound'])} | {fmt_time(r['naive'])} | "
            f"{fmt_time(best)} | {fmt_time(r['ring'])} | {fmt_time(r['direct'])} | {fmt_time(r['tree'])} | "
            f"{fmt_time(g) if g else 'n/a'} | {r['bound'] / best:.2f}x | {r['naive'] / best:.2f}x | "
            f"{(g / best if g else float('nan')):.1f}x |")


def latency(n):
    bufs = [np.zeros(1, np.float32) for _ in range(n)]
    py = measure(lambda: collectives.all_reduce(bufs, "sum", out=bufs), budget=0.5, samples=15)
    native = measure(lambda: _core.all_reduce(bufs, bufs, 1, 2, 0, 0), budget=0.5, samples=15)
    return py, native


def fusion(n, tensors=256, tensor_bytes=4096):
    per = [[np.zeros(tensor_bytes // 4, np.float32) for _ in range(tensors)] for _ in range(n)]
    one = [np.zeros(tensors * tensor_bytes // 4, np.float32) for _ in range(n)]
    t_batch = measure(lambda: collectives.batch_all_reduce(per, "sum"), budget=0.5)
    t_one = measure(lambda: collectives.all_reduce(one, "sum"), budget=0.5)
    return t_batch, t_one


def strategy_overhead(n):
    try:
        import mirrored as md
    except ImportError:
        return None
    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    x = s.experimental_distribute_values_from_function(lambda ctx: np.ones(1, np.float32))
    trivial = measure(lambda: s.run(lambda: 1.0), budget=0.5)
    ar = measure(lambda: s.run(lambda v: md.get_replica_context().all_reduce("sum", v), args=(x,)), budget=0.5)
    red = measure(lambda: s.reduce("sum", x, axis=None), budget=0.5)
    return trivial, ar, red


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    known, rest = device.parse_known_args(argv)
    if known.device == "gpu":  # the GPU comparison has its own options (see compare_gpu.py --help)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import compare_gpu

        return compare_gpu.main(rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", default="4,4K,64K,1M,4M,16M,64M")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"# mirrored bench/compare.py: float32 sum, in place; host kernels {_core.isa()}, "
          f"{_core.num_threads()} pool threads, {os.cpu_count()} CPUs\n")
    print(HEADER)
    rows = []
    for n in args.replicas:
        rows += compare(n, sizes, not args.no_torch)
    extra = {}
    print("\n| N | 4 B all_reduce via mirrored.collectives | native call alone (_core) |\n|---|---|---|")
    for n in args.replicas:
        py, native = latency(n)
        extra[f"latency_{n}"] = (py, native)
        print(f"| {n} | {py * 1e6:.2f} us | {native * 1e6:.2f} us |")
    print("\n| N | batch_all_reduce 256 x 4 KiB | all_reduce of 1 MiB | ratio |\n|---|---|---|---|")
    for n in args.replicas:
        tb, to = fusion(n)
        extra[f"fusion_{n}"] = (tb, to)
        print(f"| {n} | {fmt_time(tb)} | {fmt_time(to)} | {tb / to:.2f}x |")
    print("\n| N | strategy.run(trivial) | run(all_reduce 4 B) | strategy.reduce(SUM) 4 B |\n|---|---|---|---|")
    for n in args.replicas:
        s = strategy_overhead(n)
        if s:
            extra[f"strategy_{n}"] = s
            print(f"| {n} | {fmt_time(s[0])} | {fmt_time(s[1])} | {fmt_time(s[2])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "extra": extra}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        r, n, port, sizes, out = sys.argv[2:7]
        torch_worker(int(r), int(n), int(port), [int(s) for s in sizes.split(",")], out)
    else:
        main()
