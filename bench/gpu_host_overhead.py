"""Host-side cost of mirrored's GPU call path, measured without a GPU: the engine
runs on the simulated CUDA runtime (mirrored._cuda_sim) with the tests' CuPy
stand-in (tests/fake_cupy.py), and only the calls are timed, not the queued
kernels (they are drained after each call, outside the clock).

    python bench/gpu_host_overhead.py [--replicas 2 4] [--repeat 2000]
    python bench/gpu_host_overhead.py --run-only --replicas 2 4 8    # strategy.run only
    python bench/gpu_host_overhead.py --no-optimizer --clock cpu     # the collectives' table only
    python bench/gpu_host_overhead.py --driver --replicas 2 8        # driver work per call instead of time
    python bench/gpu_host_overhead.py --calls --replicas 2 4 8       # Python function calls per call instead
    python bench/gpu_host_overhead.py --gpus 2 --logical 2           # a mix: hierarchical engine vs native ring
    python bench/gpu_host_overhead.py --calls --replicas 2 4 8 --compare /tmp/base/python    # two builds
    python bench/gpu_host_overhead.py --run-only --clock cpu --compare /tmp/base/python --rounds 5

``--compare PATH`` (with ``--calls`` or ``--run-only``): the same table for the package under PATH (another
build's ``python/``, e.g. main's) beside this one's, each build in processes of its own, alternating for
``--rounds`` rounds; each cell is the median of the rounds, with this build's / the other's ratio.

Reports µs per call for a 4-byte all_reduce (out= preallocated and not), a
200-tensor batch_all_reduce and strategy.run(replica-context all_reduce) on
logical GPUs; then a training step's update, strategy.run(Adam's
apply_gradients) over 200 variables, through the fused CUDA kernel (one
launch per GPU) and through the rule applied variable by variable (the path
without the kernel), and wrapped in a dynamic LossScaleOptimizer: the GPU
selecting the step's scalars by its own count, and the step read back first
(the path before it), same run (--driver: the host waits of those too). The
stand-in's arrays are Python objects where CuPy's are Cython, so calls that
allocate cost more here than on a GPU machine; compare numbers of this script
with each other, same run. (A host wait here runs the simulated kernels queued
before it, inside the clock, as a GPU's wait would wait for them.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import numpy as np  # noqa: E402

import gpu_env  # noqa: E402

if not gpu_env.SIMULATED or gpu_env.cupy is None:
    raise SystemExit("this benchmark runs on the simulated GPUs; this machine has real ones (use compare_gpu.py)")
gpu_env.install(0)
cupy = gpu_env.cupy

import mirrored as md  # noqa: E402
from mirrored import collectives  # noqa: E402


clock = time.perf_counter


def per_call_us(call, repeat: int) -> float:
    """Median µs of one call, its queued kernels drained after it, outside the clock (so an engine's
    own host wait for an earlier call's work finds it done, as it mostly would on a GPU)."""
    call()
    cupy.sim.drain()
    times = []
    for _ in range(repeat):
        t0 = clock()
        call()
        times.append(clock() - t0)
        cupy.sim.drain()
    return statistics.median(times) * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--run-only", action="store_true",
                   help="only strategy.run: of a trivial step, a replica-context all_reduce (4 B) and merge_calls")
    p.add_argument("--no-optimizer", action="store_true", help="skip the optimizer step's table")
    p.add_argument("--driver", action="store_true",
                   help="the simulated driver's work per repeated call (launches, stream operations, host waits)")
    p.add_argument("--calls", action="store_true",
                   help="Python function calls per call (sys.setprofile), mirrored's own and the CuPy stand-in's")
    p.add_argument("--gpus", type=int, default=0,
                   help="a mix instead: this many simulated GPUs x --logical replicas each, the hierarchical "
                        "engine (algorithm='auto') against the native ring (algorithm='ring'), same run")
    p.add_argument("--logical", type=int, default=2, help="replicas per GPU with --gpus")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU time (all threads), steadier than wall time on a loaded machine")
    p.add_argument("--compare", metavar="PATH", default=None,
                   help="with --calls or --run-only: also the package under PATH (another build's python/), "
                        "alternating, in processes of their own")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per build with --compare")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # (a --compare child's output)
    args = p.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.compare:
        return compare(args)
    if args.gpus:
        return mix(args)
    if args.run_only:
        return run_only(args)
    if args.driver:
        return driver(args)
    if args.calls:
        return calls(args)
    print("| replicas | all_reduce 4 B (µs) | all_reduce 4 B, out= (µs) | batch 200 tensors (µs) | "
          "run(all_reduce 4 B) (µs) |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.replicas:
        xs = [cupy.ones(1, cupy.float32) for _ in range(n)]
        outs = [cupy.empty(1, cupy.float32) for _ in range(n)]
        sizes = np.random.default_rng(0).integers(1, 3000, 200)
        lists = [[cupy.ones(int(s), cupy.float32) for s in sizes] for _ in range(n)]
        md.config.set_logical_device_configuration("GPU", 0, count=n)
        try:
            s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
            step_x = s.run(lambda: cupy.ones(1, cupy.float32))
            run = lambda: s.run(lambda x: md.get_replica_context().all_reduce("sum", x), args=(step_x,))  # noqa: E731
            row = [per_call_us(lambda: collectives.all_reduce(xs, "sum"), args.repeat),
                   per_call_us(lambda: collectives.all_reduce(xs, "sum", out=outs), args.repeat),
                   per_call_us(lambda: collectives.batch_all_reduce(lists, "sum"), args.repeat // 10),
                   per_call_us(run, args.repeat // 4)]
        finally:
            md.config.set_logical_device_configuration("GPU:0", None)
        rows += [(n, name, v) for name, v in zip(names, row)]
        show(f"| {n} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    report(args, rows)
    if args.no_optimizer:
        return
    print()
    print("| replicas | apply_gradients, 200 variables, fused kernel (µs) | variable by variable (µs) | ratio | "
          "Adam + dynamic LossScaleOptimizer, GPU selects the step (µs) | step read back first (µs) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.replicas:
        fused, each = (optimizer_step_us(n, kernel, args.repeat // 20) for kernel in (True, False))
        selects, reads = (optimizer_step_us(n, True, args.repeat // 20, loss_scale=mode)
                          for mode in ("selects", "reads back"))
        print(f"| {n} | {fused:.0f} | {each:.0f} | {fused / each:.2f} | {selects:.0f} | {reads:.0f} | "
              f"{selects / reads:.2f} |")


def driver(args):
    """Kernel launches, stream operations (records, waits, copies) and host waits for the GPU of one
    repeated call (its results dropped, as in a training loop), on n logical GPUs."""
    print("| replicas | call | launches | stream ops | host waits |")
    print("|---:|---|---:|---:|---:|")
    for n in args.replicas:
        xs = [cupy.ones(1, cupy.float32) for _ in range(n)]
        sizes = np.random.default_rng(0).integers(1, 3000, 200)
        lists = [[cupy.ones(int(s), cupy.float32) for s in sizes] for _ in range(n)]
        for name, call in (("all_reduce 4 B", lambda: collectives.all_reduce(xs, "sum")),
                           ("batch 200 tensors", lambda: collectives.batch_all_reduce(lists, "sum"))):
            c = repeated_call_counters(call)
            print(f"| {n} | {name} | {sum(c['launches'].values())} | {c['stream_ops']} | {c['host_waits']} |")
        for mode in ("selects", "reads back"):
            c = optimizer_step_counters(n, mode)
            how = "the GPU selects the step's scalars" if mode == "selects" else "the step read back first"
            print(f"| {n} | run(Adam + LossScaleOptimizer apply_gradients, 200 variables), {how} | "
                  f"{sum(c['launches'].values())} | {c['stream_ops']} | {c['host_waits']} |")


def mix(args):
    """A repeated call on --gpus GPUs x --logical replicas each: the hierarchical engine (one fold kernel per
    GPU, NCCL with one rank per GPU, one copy kernel per GPU) against the native ring over the same replicas
    (events between GPUs), same run: kernel launches, NCCL calls, stream operations (event records and waits,
    copies), host waits, and µs per call on the host (the simulated kernels drained outside the clock)."""
    devices = [g for g in range(args.gpus) for _ in range(args.logical)]
    cupy.configure(args.gpus, [(a, b) for a in range(args.gpus) for b in range(args.gpus) if a != b], 0)
    md.config.set_logical_device_configuration("GPU:0", None)

    def on(d, make):
        with cupy.cuda.Device(d):
            return make()

    sizes = np.random.default_rng(0).integers(1, 3000, 200)
    calls = []
    for nbytes in (4, 1 << 16):
        xs = [on(d, lambda: cupy.ones(nbytes // 4, cupy.float32)) for d in devices]
        outs = [on(d, lambda: cupy.empty(nbytes // 4, cupy.float32)) for d in devices]
        calls.append((f"all_reduce {nbytes} B, out=",
                      lambda algo, xs=xs, outs=outs: collectives.all_reduce(xs, "sum", out=outs, algorithm=algo)))
    lists = [on(d, lambda: [cupy.ones(int(n), cupy.float32) for n in sizes]) for d in devices]
    calls.append(("batch 200 tensors", lambda algo: collectives.batch_all_reduce(lists, "sum", algorithm=algo)))
    print(f"{args.gpus} GPUs x {args.logical} replicas; ratio: ring / hierarchical")
    print("| call | engine | launches | NCCL calls | stream ops | host waits | µs per call | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, call in calls:
        times = {}
        for algo, engine in (("ring", "native ring"), ("auto", "hierarchical")):
            c = repeated_call_counters(lambda: call(algo))
            nccl = sum(v for k, v in c["calls"].items() if k.startswith("nccl"))
            times[algo] = per_call_us(lambda: call(algo), args.repeat // 10)
            ratio = f"{times['ring'] / times['auto']:.2f}" if algo == "auto" else ""
            print(f"| {name} | {engine} | {sum(c['launches'].values())} | {nccl} | {c['stream_ops']} | "
                  f"{c['host_waits']} | {times[algo]:.1f} | {ratio} |")


def compare(args):
    """--calls or --run-only for this build and the one under --compare, alternating --rounds times."""
    if not (args.calls or args.run_only):
        raise SystemExit("--compare goes with --calls or --run-only")
    argv = [a for a in sys.argv[1:]]
    at = argv.index("--compare")
    del argv[at:at + 2]
    builds = {"this": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"),
              "compared": os.path.abspath(args.compare)}
    cells = {name: {} for name in builds}  # build -> (replicas, call) -> [value per round]
    for _ in range(args.rounds):
        for name, path in builds.items():
            env = dict(os.environ, PYTHONPATH=path + os.pathsep + os.environ.get("PYTHONPATH", ""))
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json"], env=env,
                                  capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{name} ({path}): {done.stderr}")
            for n, call, value in json.loads(done.stdout.splitlines()[-1]):
                cells[name].setdefault((n, call), []).append(value)
    unit = "calls" if args.calls else "µs"
    print(f"this build: {builds['this']}; compared: {builds['compared']}; median of {args.rounds} alternating rounds")
    print(f"| replicas | call | this build ({unit}) | compared ({unit}) | this / compared |")
    print("|---:|---|---:|---:|---:|")
    for (n, call), values in cells["this"].items():
        mine, theirs = statistics.median(values), statistics.median(cells["compared"][(n, call)])
        print(f"| {n} | {call} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} |")


def report(args, rows):
    """``rows``: [(replicas, call, value)], printed as one JSON line for a --compare parent."""
    if args.json:
        print(json.dumps(rows))


def calls(args):
    """Python function calls of one call (gpu_env.python_calls: 'call' and 'c_call' events, the median of the
    calls) of strategy.run of a trivial step, of strategy.run(replica-context all_reduce of 4 B) and of
    collectives.all_reduce of 4 B on n logical GPUs. `mirrored`: events in mirrored's files; `CuPy calls`:
    the CuPy functions mirrored calls (CuPy charges them too); `stand-in`: all events in tests/fake_cupy.py
    (CuPy does its part in Cython). Deterministic: unlike time, a loaded machine does not move them."""
    show = print if not args.json else (lambda *a, **k: None)
    show("| replicas | call | mirrored | CuPy calls by mirrored | mirrored + CuPy calls | stand-in, all | all |")
    show("|---:|---|---:|---:|---:|---:|---:|")
    repeat = max(10, args.repeat // 20)
    rows = []
    for n in args.replicas:
        xs = [cupy.ones(1, cupy.float32) for _ in range(n)]
        md.config.set_logical_device_configuration("GPU", 0, count=n)
        try:
            s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
            step_x = s.experimental_distribute_values_from_function(lambda ctx: cupy.ones(1, cupy.float32))
            step = lambda v: md.get_replica_context().all_reduce("sum", v)  # noqa: E731
            for name, call in (("run(trivial)", lambda: s.run(lambda: None)),
                               ("run(all_reduce 4 B)", lambda: s.run(step, args=(step_x,))),
                               ("all_reduce 4 B", lambda: collectives.all_reduce(xs, "sum"))):
                c = gpu_env.python_calls(call, repeat)
                own = c["mirrored"] + c["cupy_by_mirrored"]
                rows += [(n, f"{name}: mirrored", c["mirrored"]), (n, f"{name}: mirrored + CuPy calls", own)]
                show(f"| {n} | {name} | {c['mirrored']:.0f} | {c['cupy_by_mirrored']:.0f} | {own:.0f} | "
                     f"{c['stand_in']:.0f} | {c['total']:.0f} |")
        finally:
            md.config.set_logical_device_configuration("GPU:0", None)
    report(args, rows)


def run_only(args):
    """µs per strategy.run of a trivial step, of one replica-context all_reduce of 4 B, of one merge_call
    of a 4 B array whose merge_fn returns a number (no array handed over), and of one whose merge_fn
    hands replica 0's array to every replica (ordered and kept across the replicas' streams)."""
    show = print if not args.json else (lambda *a, **k: None)
    names = ("run(trivial)", "run(all_reduce 4 B)", "run(merge_call 4 B)",
             "run(merge_call handing replica 0's 4 B to all)")
    show("| replicas | " + " | ".join(f"{name} (µs)" for name in names) + " |")
    show("|---:|---:|---:|---:|---:|")
    rows = []
    steps = (lambda: None,
             lambda x: md.get_replica_context().all_reduce("sum", x),
             lambda x: md.get_replica_context().merge_call(lambda s, v: len(v.values), args=(x,)),
             lambda x: md.get_replica_context().merge_call(lambda s, v: v.values[0], args=(x,)))
    for n in args.replicas:
        md.config.set_logical_device_configuration("GPU", 0, count=n)
        try:
            s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
            step_x = s.run(lambda: cupy.ones(1, cupy.float32))
            row = [per_call_us(lambda: s.run(step, args=(step_x,) if k else ()), args.repeat)
                   for k, step in enumerate(steps)]
        finally:
            md.config.set_logical_device_configuration("GPU:0", None)
        rows += [(n, name, v) for name, v in zip(names, row)]
        show(f"| {n} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    report(args, rows)


def optimizer_step_us(n: int, kernel: bool, repeat: int, loss_scale=None) -> float:
    """µs of strategy.run(Adam.apply_gradients) over 200 small variables (100 of 32x32, 100 of 32: the
    host's cost, not the simulated kernels') on n logical GPUs; kernel False: the optimizer's path
    without the fused CUDA kernel. ``loss_scale``: Adam in a dynamic LossScaleOptimizer, the GPU selecting
    the step's scalars ("selects") or the step read back before each step ("reads back", the path before)."""
    with optimizer_step(n, kernel, loss_scale) as step:
        return per_call_us(step, repeat)


def optimizer_step_counters(n: int, loss_scale: str) -> dict:
    """The simulator's counters of one repeated optimizer_step (planned first), as driver()'s."""
    with optimizer_step(n, True, loss_scale) as step:
        return repeated_call_counters(step)


def repeated_call_counters(call) -> dict:
    """The simulator's counters of one ``call()`` after 8 untimed ones (planned, and the engine's tables
    grown), its queued kernels drained before and after."""
    for _ in range(8):
        call()
    return gpu_env.sim_counters(call)


@contextlib.contextmanager
def optimizer_step(n: int, kernel: bool, loss_scale):
    from mirrored.train.optimizers import base

    shapes = [(32, 32) if k % 2 == 0 else (32,) for k in range(200)]
    md.config.set_logical_device_configuration("GPU", 0, count=n)
    saved, selects = base._gpu_kernel, base.Optimizer._selects_on_device
    if not kernel:
        base._gpu_kernel = lambda: None
    if loss_scale == "reads back":
        base.Optimizer._selects_on_device = lambda self: False
    try:
        s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
        with s.scope():
            variables = [md.Variable(np.zeros(shape, np.float32)) for shape in shapes]
            opt = md.optimizers.Adam(0.001)
            if loss_scale is not None:
                opt = md.mixed_precision.LossScaleOptimizer(opt)
        grads = s.run(lambda: [cupy.ones(shape, cupy.float32) for shape in shapes])
        yield lambda: s.run(lambda g: opt.apply_gradients(zip(g, variables)), args=(grads,))
    finally:
        base._gpu_kernel, base.Optimizer._selects_on_device = saved, selects
        md.config.set_logical_device_configuration("GPU:0", None)


if __name__ == "__main__":
    main()
