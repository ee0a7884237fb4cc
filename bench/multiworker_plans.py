"""Per-call cost of repeated multi-worker collectives: this tree against another build, same run.

    python bench/multiworker_plans.py --old /path/to/site-packages [--local 2] [--jobs 5] [--rounds 20]
                                      [--calls 200] [--shm 1|0]

Starts jobs of 2 workers on 127.0.0.1 (TF_CONFIG on free ports), each with
``--local`` host replicas, ``--jobs`` per build, the builds alternating
(``--old``: a directory holding another ``mirrored`` package, e.g. a copy of
an older install's site-packages; this tree's ``python/`` is "new";
``--shm 0``: over Gloo TCP instead of shared memory). In each job, every
worker times ``--rounds`` rounds (a barrier before each) of back-to-back calls of

* a 4-byte float32 SUM all_reduce in place (``out=buffers``), and
* a batch_all_reduce of 200 float32 tensors (16 to 4,096 elements, 1.6 MB per replica; 1/10 the calls).

A round's wall time per call is the slowest worker's; its CPU time per call
is the workers' mean process CPU time (every thread of the process, Gloo's
I/O thread included), which the machine's other load disturbs far less than
wall time. Prints the median and the minimum over every round of every job
per build, and old/new ratios (> 1: new is faster). Results are checked
against the expected sums.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from loopback_job import free_ports

WORKERS = 2
# 200 tensor sizes, deterministic: gradient-like, small to medium.
BATCH_SIZES = [16 << (i % 9) for i in range(200)]


def worker(local: int, rounds: int, calls: int, out: str) -> None:
    import time

    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    g = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), local, timeout=120.0)
    replicas = g.num_replicas
    tiny = [np.zeros(1, np.float32) for _ in range(local)]
    lists = [[np.ones(s, np.float32) for s in BATCH_SIZES] for _ in range(local)]

    def timed(fn, n):
        for _ in range(10):
            fn()  # warm-up: plans, connections, allocations
        samples = []
        for _ in range(rounds):
            g.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                fn()
            samples.append(((time.perf_counter() - wall) / n, (time.process_time() - cpu) / n))
        return samples

    result = {"all_reduce 4 B": timed(lambda: g.all_reduce(tiny, "sum", out=tiny), calls),
              "batch_all_reduce 200 tensors": timed(lambda: g.batch_all_reduce(lists, "sum"), max(2, calls // 10))}
    check = g.batch_all_reduce(lists, "sum")
    if not all(float(t[0]) == replicas and float(t[-1]) == replicas for t in check[0]):
        raise SystemExit("wrong batch_all_reduce result")
    ones = [np.ones(1, np.float32) for _ in range(local)]
    if float(g.all_reduce(ones, "sum", out=ones)[0][0]) != replicas:
        raise SystemExit("wrong all_reduce result")
    g.close()
    with open(out, "w") as f:
        json.dump(result, f)


def run_job(pythonpath: str, local: int, rounds: int, calls: int, shm: str) -> dict:
    """name -> [(wall, cpu) per call of each round]: the slowest worker's wall, the workers' mean CPU."""
    ports = free_ports(WORKERS)
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(WORKERS):
            env = dict(os.environ, PYTHONPATH=pythonpath, MIRRORED_SHM=shm,
                       TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": "worker", "index": i}}))
            out = os.path.join(tmp, f"{i}.json")
            procs.append((subprocess.Popen([sys.executable, __file__, "--worker", str(local), str(rounds), str(calls),
                                            out], env=env), out))
        for p, _ in procs:
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"a worker failed (exit {p.returncode})")
        results = []
        for _, out in procs:
            with open(out) as f:
                results.append(json.load(f))
    return {name: [(max(r[name][i][0] for r in results), statistics.mean(r[name][i][1] for r in results))
                   for i in range(rounds)] for name in results[0]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*(int(v) for v in sys.argv[2:5]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="directory holding the other build's mirrored package")
    parser.add_argument("--local", type=int, default=2, help="replicas per worker")
    parser.add_argument("--jobs", type=int, default=5, help="jobs per build (the builds alternate)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per job")
    parser.add_argument("--calls", type=int, default=200, help="4-byte all-reduces per round (batches: 1/10)")
    parser.add_argument("--shm", default="1", choices=["1", "0"], help="0: over Gloo TCP, no shared memory")
    args = parser.parse_args()
    new = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    builds = {"old": args.old, "new": new}
    samples: dict = {b: {} for b in builds}
    for _ in range(args.jobs):
        for build, path in builds.items():
            for name, rounds in run_job(path, args.local, args.rounds, args.calls, args.shm).items():
                samples[build].setdefault(name, []).extend(rounds)
    print(f"{WORKERS} workers x {args.local} replicas on 127.0.0.1 ({'shared memory' if args.shm == '1' else 'Gloo TCP'}), "
          f"{args.jobs} jobs x {args.rounds} rounds per build; us per call")
    print(f"{'collective':<30}{'':>8}{'old':>10}{'new':>10}{'old/new':>9}")
    for name in samples["new"]:
        for what, index, pick in [("wall median", 0, statistics.median), ("wall min", 0, min),
                                  ("CPU median", 1, statistics.median)]:
            old, new_ = (pick(s[index] for s in samples[b][name]) * 1e6 for b in ("old", "new"))
            print(f"{name if what == 'wall median' else '':<30}{what:>12}{old:>10.1f}{new_:>10.1f}{old / new_:>9.2f}")


if __name__ == "__main__":
    main()
