"""What ordering an eager ``strategy.run`` across physical GPUs costs (docs/gpu_ordering.md): per run,
the runtime calls that queue work or wait (the simulated runtime's counters: event records, stream
waits, stream operations in all), the device reads and switches CuPy's runtime makes for the package
(``cudaGetDevice`` / ``cudaSetDevice``: real driver calls on a GPU, uncounted by the simulator), and
the host µs per run, for one replica per GPU on 1..4 simulated GPUs and for logical GPUs of one.

Measured without a GPU, on the simulated CUDA runtime with the tests' CuPy stand-in (run from the
repository root); ``--compare PATH`` measures another build's package (e.g. main's ``python/``) in the
same run, in a process of its own, so the columns compare builds::

    python bench/gpu_run_join.py --compare /work/main/python
    python bench/gpu_run_join.py --gpus 2 4 --step all_reduce --repeat 500

The stand-in's kernels are Python objects, so host µs are the package's Python plus the stand-in's;
compare them with each other, same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import gc, json, statistics, sys, time
import numpy as np
sys.path.insert(0, "tests")
import gpu_env
gpu_env.install(0)
from gpu_env import cupy
import mirrored as md

layouts, step_name, repeat, rounds = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
runtime = cupy.cuda.runtime
counted = {"cudaGetDevice": 0, "cudaSetDevice": 0}
get, set_ = runtime.getDevice, runtime.setDevice


def getDevice():
    counted["cudaGetDevice"] += 1
    return get()


def setDevice(device):
    counted["cudaSetDevice"] += 1
    return set_(device)


runtime.getDevice, runtime.setDevice = getDevice, setDevice
STEPS = {"identity": lambda v: v,
         "all_reduce": lambda v: md.get_replica_context().all_reduce("SUM", v)}
out = {}
for kind, n in layouts:
    with gpu_env.physical_gpus(max(n, 2) if kind == "physical" else 2), cupy.cuda.Device(0):
        if kind == "logical":
            md.config.set_logical_device_configuration("GPU", 0, count=n)
        s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
        x = s.experimental_distribute_values_from_function(lambda ctx: cupy.ones(1, cupy.float32))
        step = STEPS[step_name]
        for _ in range(3):
            s.run(step, args=(x,))
        gc.collect()
        cupy.sim.drain()
        cupy.sim.reset_counters()
        counted.update(cudaGetDevice=0, cudaSetDevice=0)
        s.run(step, args=(x,))
        sim = cupy.sim.counters()
        calls = {"cudaEventRecord": sim["calls"].get("cudaEventRecord", 0),
                 "cudaStreamWaitEvent": sim["calls"].get("cudaStreamWaitEvent", 0),
                 "stream_ops": sim["stream_ops"], **counted}
        cupy.sim.drain()
        times = []
        for _ in range(rounds):
            gc.collect()
            began = time.perf_counter()
            for _ in range(repeat):
                s.run(step, args=(x,))
            times.append((time.perf_counter() - began) / repeat * 1e6)
            cupy.sim.drain()
        calls["us_per_run"] = round(statistics.median(times), 1)
        out[f"{n} {kind}"] = calls
        if kind == "logical":
            md.config.set_logical_device_configuration("GPU:0", None)
print(json.dumps(out))
"""


def measure(package: str, layouts, step: str, repeat: int, rounds: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package, os.path.join(ROOT, "tests")]),
               MIRRORED_LOG_LEVEL="ERROR")
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(layouts), step, str(repeat), str(rounds)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 3, 4], help="physical GPUs, one replica each")
    p.add_argument("--logical", type=int, nargs="+", default=[2, 4], help="logical GPUs of GPU 0")
    p.add_argument("--step", choices=("identity", "all_reduce"), default="identity")
    p.add_argument("--repeat", type=int, default=300, help="runs per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compare", default=None, help="another build's package directory (its python/)")
    args = p.parse_args()
    layouts = [("physical", n) for n in args.gpus] + [("logical", n) for n in args.logical]
    builds = {"this build": os.path.join(ROOT, "python")}
    if args.compare:
        builds["compared"] = args.compare
    results = {name: measure(path, layouts, args.step, args.repeat, args.rounds) for name, path in builds.items()}
    columns = ["cudaEventRecord", "cudaStreamWaitEvent", "stream_ops", "cudaGetDevice", "cudaSetDevice", "us_per_run"]
    print(f"strategy.run({args.step}) per run; " + ", ".join(f"{k}: {v}" for k, v in builds.items()))
    print("| GPUs | build | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for layout in results["this build"]:
        for name, got in results.items():
            print(f"| {layout} | {name} | " + " | ".join(str(got[layout][c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
