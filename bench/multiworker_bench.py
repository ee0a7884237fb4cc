"""Multi-worker all-reduce on one machine: mirrored vs torch.distributed gloo vs Open MPI, one run.

    python bench/multiworker_bench.py [--workers 2 4] [--sizes 4,1K,64K,1M,16M,64M] [--json out.json]

For each worker count, starts that many processes of a mirrored job
(TF_CONFIG on free 127.0.0.1 ports, one CPU replica each), and of each
comparison that is installed: torch.distributed's gloo backend (TCP
loopback; `pip install torch`) and MPI through mpi4py (`mpirun` with Open
MPI's shared-memory transport, vader; `apt-get install openmpi-bin
libopenmpi-dev && pip install mpi4py`). Each times an in-place float32 SUM
all-reduce of each size, the same way: the jobs alternate --repeats times; a
time is the mean per call of the slowest worker over back-to-back calls,
best of 3 rounds per job and of all jobs (other load on the machine only
adds time). busbw = algbw * 2(n-1)/n as nccl-tests reports it; "x/mirrored"
columns are the other's time / mirrored's time (> 1: mirrored is faster).
Every size's result is checked against the expected sum.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from loopback_job import run_workers

DEFAULT_SIZES = "4,64,1K,16K,64K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


ROUNDS = 3  # timed rounds per size and job; the best one counts


def iterations(nbytes: int) -> int:
    # About 20 MB moved per round, between 3 and 500 calls: every worker derives the same count.
    return max(3, min(500, 20_000_000 // max(nbytes, 4096)))


# --- worker side ------------------------------------------------------------------------------


def time_sizes(all_reduce, make, first, barrier, sizes, rank, world) -> dict:
    """Mean seconds per in-place all-reduce of each size; every size checked once after timing."""
    out = {}
    for nbytes in sizes:
        buf = make(nbytes, 0.0)  # zeros stay zeros: no overflow however often they are summed
        for _ in range(3):
            all_reduce(buf)  # warm-up: connections, allocations, page faults
        n = iterations(nbytes)
        best = float("inf")
        for _ in range(ROUNDS):
            barrier()
            start = time.perf_counter()
            for _ in range(n):
                all_reduce(buf)
            best = min(best, (time.perf_counter() - start) / n)
        out[nbytes] = best
        buf = make(nbytes, rank + 1.0)
        all_reduce(buf)
        got, want = first(buf), world * (world + 1) / 2
        if got != want:
            raise SystemExit(f"wrong all-reduce result at {nbytes} bytes: {got} (expected {want})")
    return out


def mirrored_worker(sizes, world):
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    group = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=120.0)
    tiny = [np.zeros(1, np.float32)]

    def make(nbytes, value):
        return [np.full(max(1, nbytes // 4), value, np.float32)]

    return time_sizes(lambda b: group.all_reduce(b, "sum", out=b), make, lambda b: float(b[0][0]),
                      lambda: group.all_reduce(tiny, "sum", out=tiny), sizes, group.rank, world)


def torch_worker(sizes, world, rank, port):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tiny = torch.zeros(1)

    def make(nbytes, value):
        return torch.full((max(1, nbytes // 4),), value)

    result = time_sizes(dist.all_reduce, make, lambda b: float(b[0]), lambda: dist.all_reduce(tiny), sizes, rank,
                        world)
    dist.destroy_process_group()
    return result


def mpi_worker(sizes, world):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD

    def make(nbytes, value):
        return np.full(max(1, nbytes // 4), value, np.float32)

    mine = time_sizes(lambda b: comm.Allreduce(MPI.IN_PLACE, b), make, lambda b: float(b[0]), comm.Barrier, sizes,
                      comm.Get_rank(), world)
    slowest = {size: comm.allreduce(t, op=MPI.MAX) for size, t in mine.items()}
    return slowest if comm.Get_rank() == 0 else None


# Open MPI over shared memory only (vader), as /work/shared/anchors' MPI baseline runs it.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "pml", "ob1", "--mca", "btl", "self,vader",
          "--mca", "oob_tcp_if_include", "lo"]


def mpi_missing() -> str | None:
    """Why the MPI comparison cannot run here, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed (pip install mpi4py)"
    return None


# --- launcher ---------------------------------------------------------------------------------


def run_job(kind: str, world: int, sizes: list[int]) -> dict:
    """Per size: the mean time per call of the slowest worker."""
    import mirrored

    if kind == "mpi":
        cmd = MPIRUN + ["-np", str(world), sys.executable, __file__, "--_worker", "mpi", "--_world", str(world),
                        "--sizes", ",".join(map(str, sizes))]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800,
                           env=dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none"))
        if p.returncode != 0:
            raise SystemExit(f"mpirun failed with exit code {p.returncode}")
        return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}

    root = os.path.dirname(os.path.dirname(os.path.abspath(mirrored.__file__)))  # workers import the same mirrored
    per_worker = run_workers(world, lambda rank, ports: [
        sys.executable, __file__, "--_worker", kind, "--_rank", str(rank), "--_world", str(world),
        "--_port", str(ports[0]), "--sizes", ",".join(map(str, sizes))], pythonpath=root, what=kind)
    return {size: max(w[str(size)] for w in per_worker) for size in sizes}


def human(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes, comma-separated (K/M suffixes)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--repeats", type=int, default=2, help="jobs per framework, alternating (default 2)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.distributed gloo comparison")
    ap.add_argument("--no-mpi", action="store_true", help="skip the MPI (mpi4py + Open MPI) comparison")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args._worker == "mirrored":
        print(json.dumps(mirrored_worker(sizes, args._world)))
        return 0
    if args._worker == "torch":
        print(json.dumps(torch_worker(sizes, args._world, args._rank, args._port)))
        return 0
    if args._worker == "mpi":
        slowest = mpi_worker(sizes, args._world)
        if slowest is not None:
            print(json.dumps(slowest))
        return 0

    kinds = ["mirrored"]
    if not args.no_torch:
        if importlib.util.find_spec("torch") is None:
            print("torch is not installed: no torch gloo comparison (pip install torch)")
        else:
            kinds.append("torch")
    if not args.no_mpi:
        why = mpi_missing()
        if why:
            print(f"no MPI comparison: {why}")
        else:
            kinds.append("mpi")
    report = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "results": []}
    for world in args.workers:
        best = {kind: {} for kind in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                for size, t in run_job(kind, world, sizes).items():
                    best[kind][size] = min(t, best[kind].get(size, t))
        print(f"\n{world} workers on one machine, float32 sum, in place (load average before: "
              f"{' '.join(f'{x:.1f}' for x in report['load_average'])} on {os.cpu_count()} CPUs)")
        header = f"{'size':>8}"
        for kind in kinds:
            header += f" {kind + ' us':>12} {'busbw GB/s':>10}"
        for kind in kinds[1:]:
            header += f" {kind + '/mirrored':>15}"
        print(header)
        factor = 2 * (world - 1) / world
        for size in sizes:
            row = {"workers": world, "bytes": size}
            line = f"{human(size):>8}"
            for kind in kinds:
                t = best[kind][size]
                row[f"{kind}_s"] = t
                line += f" {t * 1e6:12.1f} {size / t * factor / 1e9:10.3f}"
            for kind in kinds[1:]:
                ratio = best[kind][size] / best["mirrored"][size]
                row[f"{kind}_ratio"] = ratio
                line += f" {ratio:15.2f}"
            print(line)
            report["results"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
