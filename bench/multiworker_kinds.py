"""Every collective kind of a 2-worker job over Gloo TCP (MIRRORED_SHM=0), beside torch.distributed gloo.

    python bench/multiworker_kinds.py [--before PATH] [--no-torch]

Times all_reduce (auto, ring, direct), broadcast, reduce and all_gather of
4 KiB, 64 KiB and 1 MiB float32 buffers (one CPU replica per worker), and
torch's gloo all_reduce, broadcast, reduce and all_gather. A time is the
median call of the slowest worker, best of 3 alternating jobs (ms).
``--before PATH`` also times another build of mirrored (PATH is put first on
PYTHONPATH, e.g. a ``pip install --target PATH`` of an older commit), in the
same run, alternating with this one.
"""

import argparse
import json
import sys
import time

import numpy as np
from loopback_job import run_workers

SIZES = [4096, 65536, 1 << 20]


def timed(fn, barrier, n):
    for _ in range(3):
        fn()  # warm-up
    barrier()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def mirrored_worker():
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    g = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=60.0)
    res = {}
    for nb in SIZES:
        b = [np.ones(nb // 4, np.float32)]
        kinds = {
            "all_reduce auto": lambda: g.all_reduce(b, "sum", out=b),
            "all_reduce ring": lambda: g.all_reduce(b, "sum", algorithm="ring"),
            "all_reduce direct": lambda: g.all_reduce(b, "sum", algorithm="direct"),
            "broadcast": lambda: g.broadcast(b, 0),
            "reduce": lambda: g.reduce(b, "sum", 0),
            "all_gather": lambda: g.all_gather(b, 0),
        }
        for k, f in kinds.items():
            res[f"{k} {nb}"] = timed(f, g.barrier, 60 if nb < (1 << 20) else 30)
    return res


def torch_worker(rank, port):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for nb in SIZES:
        b = torch.ones(nb // 4)
        kinds = {"all_reduce auto": lambda: dist.all_reduce(b),
                 "broadcast": lambda: dist.broadcast(b, 0),
                 "reduce": lambda: dist.reduce(b, 0),
                 "all_gather": lambda: dist.all_gather([torch.empty_like(b) for _ in range(2)], b)}
        for k, f in kinds.items():
            res[f"{k} {nb}"] = timed(f, dist.barrier, 60 if nb < (1 << 20) else 30)
    dist.destroy_process_group()
    return res


def launch(kind, pythonpath=None):
    outs = run_workers(2, lambda rank, ports: [sys.executable, __file__, "--_worker", kind, "--_rank", str(rank),
                                           "--_port", str(ports[0])],
                   pythonpath=pythonpath, env={"MIRRORED_SHM": "0"}, timeout=600, what=kind)
    return {k: max(o[k] for o in outs) for k in outs[0]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="PYTHONPATH entry of another mirrored build to time alongside")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        res = mirrored_worker() if args._worker == "mirrored" else torch_worker(args._rank, args._port)
        print(json.dumps(res))
        return 0
    jobs = [("before", "mirrored", args.before)] if args.before else []
    jobs.append(("mirrored", "mirrored", None))
    if not args.no_torch:
        jobs.append(("torch", "torch", None))
    best = {}
    for _ in range(3):
        for name, kind, path in jobs:
            for k, v in launch(kind, path).items():
                best.setdefault(name, {})[k] = min(v, best.get(name, {}).get(k, float("inf")))
    names = [j[0] for j in jobs]
    print(f"{'collective, bytes':28s}" + "".join(f"{n:>10s}" for n in names)
          + "  (ms: median call of the slowest worker, best of 3 alternating jobs)")
    for k in best["mirrored"]:
        print(f"{k:28s}" + "".join(f"{best[n].get(k, float('nan')):10.3f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
