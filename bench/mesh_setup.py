"""Start-up cost of a multi-worker job's collectives: the time from the
first task entering ``CollectiveGroup`` (store, Gloo mesh with its token
handshakes, shared segment with its seal and /proc check, clock sync) until
the last task leaves it, for jobs of N workers on 127.0.0.1.

``--compare PATH`` also times the package under PATH (another build's
``mirrored``, e.g. a checkout of main with its extensions) in the same run,
alternating job by job, and prints the ratio of the medians.

    python bench/mesh_setup.py --workers 2 4 --jobs 9
    python bench/mesh_setup.py --workers 2 4 --jobs 9 --compare /tmp/base/python
"""

import argparse
import os
import statistics
import sys

from loopback_job import run_workers

TASK = r"""
import json, sys, time
from mirrored.cluster_resolver import TFConfigClusterResolver
from mirrored.distribute.collective_all_reduce import CollectiveGroup
start = time.time()
g = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=120.0)
print(json.dumps([start, time.time()]))
"""


def job_seconds(package, workers):
    """One job: seconds from the first task's entry to the last task's exit."""
    spans = run_workers(workers, lambda rank, ports: [sys.executable, "-c", TASK], pythonpath=package, timeout=300,
                    what=package)
    return max(end for _, end in spans) - min(start for start, _ in spans)


def main():
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--jobs", type=int, default=9, help="jobs per package and size (median reported)")
    parser.add_argument("--compare", metavar="PATH", help="another package root to time alternately")
    args = parser.parse_args()
    packages = {"this": here} | ({"compare": args.compare} if args.compare else {})
    print(f"| workers | {' | '.join(f'{name} (ms, median of {args.jobs})' for name in packages)}"
          + (" | this / compare |" if args.compare else " |"))
    print("|---" * (len(packages) + 1 + bool(args.compare)) + "|")
    for n in args.workers:
        times = {name: [] for name in packages}
        for _ in range(args.jobs):
            for name, path in packages.items():
                times[name].append(job_seconds(path, n))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = " | ".join(f"{med[name]:.0f}" for name in packages)
        ratio = f" | {med['this'] / med['compare']:.2f} |" if args.compare else " |"
        print(f"| {n} | {row}{ratio}")


if __name__ == "__main__":
    main()
