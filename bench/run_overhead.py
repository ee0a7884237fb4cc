"""Host overhead of the collective face and of ``strategy.run``, as ratios to
the same 4-byte all-reduce written by hand in NumPy, measured in one run.

On N CPU replicas (default 4), float32, SUM, every figure is the median of
interleaved rounds (each round times the NumPy reference right before the
call it divides), so the ratios hold on a loaded machine:

    unit          s = b0 + b1; s += b2 ...; np.copyto(o, s) for every replica
    all_reduce    md.collectives.all_reduce(buffers, out=outs)
    batch_reduce  strategy.extended.batch_reduce_to(SUM, [(x, x)]) (one small pair)
    run_trivial   strategy.run(lambda: None)
    run_ident     strategy.run(lambda v: v, args=(x,)): the run plus splitting one PerReplica
    run_exchange  ... plus the replicas' bare rendezvous (_Group.exchange, a combine that hands back
                  its input): run_exchange - run_ident is the rendezvous alone
    run_all_reduce strategy.run(replica-context all_reduce of a 4 B value)

``--device gpu`` runs the GPU call path on N logical GPUs of GPU 0 (CuPy);
``--device sim`` the same path on the simulated CUDA runtime with the CuPy
stand-in of tests/ (run from the repository root), so the host-side
microseconds per call (4 B all-reduce, a 200-tensor batch, run with an
all-reduce) are measured without a GPU. ``--compare PATH`` also times the package
found under PATH (another build's ``mirrored``) in the same run, alternating.

    python bench/run_overhead.py --replicas 4
    python bench/run_overhead.py --replicas 2 4 8 --compare /tmp/base --clock cpu
    python bench/run_overhead.py --device sim --replicas 2 4 8 --calls run_trivial run_all_reduce --compare /tmp/base
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
n, device, iters, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
only = set(sys.argv[6].split(",")) if len(sys.argv) > 6 else None
clock = time.process_time if sys.argv[5] == "cpu" else time.perf_counter
if device == "sim":  # the GPU call path over the simulated CUDA runtime and tests/fake_cupy.py
    sys.path.insert(0, "tests")
    import gpu_env
    gpu_env.install(0)
    device = "gpu"
if device == "gpu":
    md.config.set_logical_device_configuration("GPU", 0, count=n)
    s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
    import cupy as xp
else:
    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    xp = np
x = s.experimental_distribute_values_from_function(lambda ctx: xp.ones(1, xp.float32))
bufs = [np.ones(1, np.float32) for _ in range(n)]
outs = [np.empty(1, np.float32) for _ in range(n)]
SUM = md.ReduceOp.SUM


def unit():
    t = bufs[0] + bufs[1]
    for b in bufs[2:]:
        t += b
    for o in outs:
        np.copyto(o, t)


def reduce_one(v):
    return md.get_replica_context().all_reduce(SUM, v)


group = s.extended._pool.group


def exchange_one(v):
    return group.exchange(md.get_replica_context()._local_replica_id, "exchange", v, list)


calls = {
    "all_reduce": lambda: md.collectives.all_reduce(bufs, out=outs),
    "batch_reduce": lambda: s.extended.batch_reduce_to(SUM, [(x, x)]),
    "run_trivial": lambda: s.run(lambda: None),
    "run_ident": lambda: s.run(lambda v: v, args=(x,)),
    "run_exchange": lambda: s.run(exchange_one, args=(x,)),
    "run_all_reduce": lambda: s.run(reduce_one, args=(x,)),
}
if device == "gpu":  # host microseconds per call of the GPU path (kernels are enqueued, not waited for)
    gbufs = [xp.ones(1, xp.float32) for _ in range(n)]
    with xp.cuda.Device(0):
        batch = [[xp.ones(64, xp.float32) for _ in range(200)] for _ in range(n)]
    calls["all_reduce"] = lambda: md.collectives.all_reduce(gbufs)
    calls["all_reduce_inplace"] = lambda: md.collectives.all_reduce(gbufs, out=gbufs)
    calls["batch_200"] = lambda: md.collectives.batch_all_reduce(batch)


def per_call(fn, k):
    t = clock()
    for _ in range(k):
        fn()
    return (clock() - t) / k * 1e6


out = {}
for name, fn in calls.items():
    if only is not None and name not in only:
        continue
    k = max(1, iters // (10 if name.startswith("run") else 1))
    for _ in range(3):
        per_call(fn, k)
    us, ratios = [], []
    for _ in range(rounds):
        ref = per_call(unit, iters)
        t = per_call(fn, k)
        us.append(t)
        ratios.append(t / ref)
    out[name] = {"us": statistics.median(us), "ratio": statistics.median(ratios)}
out["unit"] = {"us": min(per_call(unit, iters) for _ in range(rounds)), "ratio": 1.0}
if hasattr(xp, "sim"):  # the simulator's queued kernels run now, not during interpreter shutdown
    xp.sim.drain()
print(json.dumps(out))
"""

TARGETS = {"all_reduce": 0.7, "batch_reduce": 2, "run_trivial": 4, "run_all_reduce": 8}


def measure(path, n, device, iters, rounds, clock, calls):
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(n), device, str(iters), str(rounds), clock]
                          + ([",".join(calls)] if calls else []), env=env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[4])
    p.add_argument("--device", choices=("cpu", "gpu", "sim"), default="cpu",
                   help="sim: the GPU call path on the simulated CUDA runtime (host overhead without a GPU)")
    p.add_argument("--iters", type=int, default=2000, help="calls per timed round (run: a tenth)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--compare", default=None, help="directory with another build's mirrored package")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: process CPU time (all threads), steadier than wall time on a loaded machine")
    p.add_argument("--calls", nargs="+", default=None,
                   help="time only these calls (e.g. run_trivial run_all_reduce; the unit always)")
    a = p.parse_args()
    builds = [("this build", None)] + ([("--compare", a.compare)] if a.compare else [])
    print(f"{'build':<12} {'replicas':>8} {'call':<16} {'us/call':>9} {'x NumPy':>8} {'target':>7}")
    for n in a.replicas:
        results = {label: measure(path, n, a.device, a.iters, a.rounds, a.clock, a.calls) for label, path in builds}
        for label, _ in builds:
            for name, r in results[label].items():
                target = f"<= {TARGETS[name]}" if name in TARGETS and a.device == "cpu" else ""
                print(f"{label:<12} {n:>8} {name:<16} {r['us']:>9.2f} {r['ratio']:>8.2f} {target:>7}")


if __name__ == "__main__":
    main()
