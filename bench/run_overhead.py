"""Host overhead of ``strategy.run``: microseconds per call of a trivial
replica function (and of one 4-byte all-reduce inside it) on N CPU replicas,
or on N logical GPUs with ``--device gpu``.

``--compare PATH``: also time the package found under PATH (a directory
holding another build's ``mirrored``) in the same run, alternating rounds,
so both numbers share the machine's load.

    python bench/run_overhead.py --replicas 4
    python bench/run_overhead.py --replicas 4 --compare /tmp/base
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import numpy as np
import mirrored as md
n, device, iters = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if device == "gpu":
    md.config.set_logical_device_configuration("GPU", 0, count=n)
    s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
    import cupy
    x = s.experimental_distribute_values_from_function(lambda ctx: cupy.ones(1, cupy.float32))
else:
    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    x = s.experimental_distribute_values_from_function(lambda ctx: np.ones(1, np.float32))
def trivial():
    return None
def reduce_one(v):
    return md.get_replica_context().all_reduce("sum", v)
out = {}
for name, fn, args in (("trivial", trivial, ()), ("all_reduce_4B", reduce_one, (x,))):
    for _ in range(200):
        s.run(fn, args=args)
    rounds = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(iters):
            s.run(fn, args=args)
        rounds.append((time.perf_counter() - t) / iters * 1e6)
    out[name] = statistics.median(rounds)
print(json.dumps(out))
"""


def measure(path, n, device, iters):
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(n), device, str(iters)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[4])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare", default=None, help="directory with another build's mirrored package")
    a = p.parse_args()
    builds = [("this build", None)] + ([("--compare", a.compare)] if a.compare else [])
    print(f"{'build':<12} {'replicas':>8} {'run(trivial) us':>16} {'run(all_reduce 4 B) us':>23}")
    for n in a.replicas:
        best = {}
        for _ in range(a.repeats):  # alternate builds so both see the same load
            for label, path in builds:
                r = measure(path, n, a.device, a.iters)
                b = best.setdefault(label, r)
                for k in r:
                    b[k] = min(b[k], r[k])
        for label, _ in builds:
            r = best[label]
            print(f"{label:<12} {n:>8} {r['trivial']:>16.1f} {r['all_reduce_4B']:>23.1f}")


if __name__ == "__main__":
    main()
