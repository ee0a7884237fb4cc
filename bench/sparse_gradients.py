"""IndexedSlices against dense gradients of the same embedding table, in one run (same-run ratios).

    PYTHONPATH=python python bench/sparse_gradients.py [--replicas 2] [--rows 100000] [--width 64] [--repeat 7]
        [--compare /work/main/python]

1. Reduction: ``strategy.reduce(SUM, ...)`` of every replica's k rows (an all-gather of values and of
   indices) against the all-reduce of the dense rows x width table.
2. Densifying one replica's gathered slices with their squares (what a sparse Adam step does): the
   native one-pass scatter-add (md's) against ``np.add.at`` twice (the gradient, then the squares).
3. Training step: ``Adam.apply_gradients`` inside ``strategy.run`` with the embedding's gradient as
   IndexedSlices (gathered, densified with its squares, the fused kernel reading them) against the same
   step with the gradient densified by the caller (the fused kernel), beside a dense 64 x 64 variable.
   ``--compare PATH`` times the sparse step of another build's package too (e.g. main's ``python/``,
   which recomputed the named rows after finding them with ``np.unique``), each build in a process of
   its own, rounds interleaved.
4. ``--sim``: the sparse Adam step (IndexedSlices with their squares, rows named many times) on two
   simulated GPUs (the tests' CuPy stand-in over mirrored._cuda_sim), per step: the launches (ours and
   CuPy's kernels), the host waits and the host time to issue it (the GPU's work runs after, untimed),
   of this build and of ``--compare``'s, each in a process of its own. The simulator counts, it does not
   time a GPU: a GPU's time is measured on one.
5. ``--gpu`` (CuPy and a GPU): the densify with squares on the GPU, mirrored's ordered kernel against
   ``cupy.add.at`` twice after zeroing (the atomics it replaced), GPU time by CUDA events.
Prints one table per part: the median time of each and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import mirrored as md


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up: plans, slots
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _slices(rng, k: int, rows: int, width: int) -> md.IndexedSlices:
    return md.IndexedSlices(rng.standard_normal((k, width)).astype(np.float32), rng.integers(0, rows, k),
                            (rows, width))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--compare", default=None, help="another build's package directory (its python/)")
    parser.add_argument("--sim", action="store_true", help="only part 4: the GPU step on the simulated runtime")
    parser.add_argument("--gpu", action="store_true", help="only part 5: the densify on a real GPU (CuPy)")
    parser.add_argument("--step-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sim-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_child:
        return _step_child(args)
    if args.sim_child:
        return _sim_child(args)
    if args.sim:
        return _sim_table(args)
    if args.gpu:
        return _gpu_table(args)
    n, rows, width = args.replicas, args.rows, args.width
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    rng = np.random.default_rng(0)
    print(f"{n} CPU replicas, table {rows} x {width} float32 ({rows * width * 4 / 2**20:.1f} MiB)\n")

    print("| rows per replica | reduce IndexedSlices (ms) | all-reduce dense (ms) | sparse / dense |")
    print("|---:|---:|---:|---:|")
    for k in (256, 4096, rows // 2):
        parts = [_slices(rng, k, rows, width) for _ in range(n)]
        sparse = strategy.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])
        dense = strategy.experimental_distribute_values_from_function(
            lambda ctx: md.convert_to_tensor(parts[ctx.replica_id_in_sync_group]))
        t_sparse = _median_seconds(lambda: strategy.extended.reduce_to("SUM", sparse, sparse), args.repeat)
        t_dense = _median_seconds(lambda: strategy.extended.reduce_to("SUM", dense, dense), args.repeat)
        print(f"| {k} | {t_sparse * 1e3:.2f} | {t_dense * 1e3:.2f} | {t_sparse / t_dense:.2f} |")

    print("\n| slices | native scatter-add with squares (ms) | np.add.at twice (ms) | native / add.at |")
    print("|---:|---:|---:|---:|")
    from mirrored.device.indexed_slices import scatter_add_rows
    for k in (256, 4096, 65536):
        s = _slices(rng, k, rows, width)
        out, squares = np.zeros((rows, width), np.float32), np.zeros((rows, width), np.float32)

        def native(s=s, out=out, squares=squares):
            scatter_add_rows(out, s, squares=squares)

        def add_at(s=s, out=out, squares=squares):
            np.add.at(out, s.indices, s.values)
            np.add.at(squares, s.indices, s.values * s.values)
        t_native, t_add_at = _median_seconds(native, args.repeat), _median_seconds(add_at, args.repeat)
        print(f"| {k} | {t_native * 1e3:.3f} | {t_add_at * 1e3:.3f} | {t_native / t_add_at:.2f} |")

    builds = [("this build", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))]
    if args.compare:
        builds.append(("compared", args.compare))
    steps = {name: _step_times(path, args) for name, path in builds}
    head = "| rows per replica | Adam step, dense (ms) | Adam step, IndexedSlices (ms) | sparse / dense |"
    rule = "|---:|---:|---:|---:|"
    if args.compare:
        head += " compared build: IndexedSlices (ms) | compared sparse / dense | this / compared (sparse) |"
        rule += "---:|---:|---:|"
    print("\n" + head + "\n" + rule)
    for k in _STEP_ROWS:
        dense, sparse = steps["this build"][str(k)]
        line = f"| {k} | {dense * 1e3:.2f} | {sparse * 1e3:.2f} | {sparse / dense:.2f} |"
        if args.compare:
            dense_c, sparse_c = steps["compared"][str(k)]
            line += f" {sparse_c * 1e3:.2f} | {sparse_c / dense_c:.2f} | {sparse / sparse_c:.2f} |"
        print(line)


_STEP_ROWS = (256, 4096, 32768)


def _step_times(package: str, args, child: str = "--step-child") -> dict:
    """A part run by ``package``'s mirrored in a process of its own (``child``: which), its JSON result."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(package))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), child, "--replicas",
                           str(args.replicas), "--rows", str(args.rows), "--width", str(args.width), "--repeat",
                           str(args.repeat)], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def _gpu_table(args) -> None:
    import cupy

    from mirrored.device.indexed_slices import scatter_add_rows

    rows, width = args.rows, args.width
    rng = np.random.default_rng(3)
    print(f"GPU {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, table {rows} x {width} float32\n")
    print("| slices | rows they name | ordered kernel (ms) | cupy.add.at twice (ms) | ordered / add.at |")
    print("|---:|---:|---:|---:|---:|")
    for k, named in ((4096, rows), (65536, rows), (65536, 1024), (65536, 8)):
        values = cupy.asarray(rng.standard_normal((k, width)).astype(np.float32))
        indices = cupy.asarray(rng.integers(0, named, k))
        s = md.IndexedSlices(values, indices, (rows, width))
        out, squares = cupy.empty((rows, width), np.float32), cupy.empty((rows, width), np.float32)

        def ordered(s=s, out=out, squares=squares):
            scatter_add_rows(out, s, squares=squares, overwrite=True)

        def atomics(values=values, indices=indices, out=out, squares=squares):
            out.fill(0)
            squares.fill(0)
            cupy.add.at(out, indices, values)
            cupy.add.at(squares, indices, values * values)
        t_ordered, t_atomics = _gpu_median_seconds(ordered, args.repeat), _gpu_median_seconds(atomics, args.repeat)
        print(f"| {k} | {named} | {t_ordered * 1e3:.3f} | {t_atomics * 1e3:.3f} | {t_ordered / t_atomics:.2f} |")


def _gpu_median_seconds(fn, repeat: int) -> float:
    """The median GPU time of fn's work on the current stream (CUDA events around it)."""
    import cupy

    fn()  # warm-up: kernels loaded, pool blocks made
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)


_SIM_SLICES = (256, 4096)


def _sim_table(args) -> None:
    builds = [("this build", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))]
    if args.compare:
        builds.append(("compared", args.compare))
    counts = {name: _step_times(path, args, "--sim-child") for name, path in builds}
    print(f"2 simulated GPUs, table {args.rows} x {args.width} float32, Adam, IndexedSlices of k slices per "
          "replica naming 64 rows (gathered: 2k slices densified per replica)\n")
    print("| build | k | our launches per step | CuPy kernels per step | host waits | host time per step (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _ in builds:
        for k in _SIM_SLICES:
            launches, kernels, waits, seconds = counts[name][str(k)]
            print(f"| {name} | {k} | {launches} | {kernels} | {waits} | {seconds * 1e3:.2f} |")


def _sim_child(args) -> None:
    """Prints {k: (our launches, CuPy kernels, host waits, host seconds)} of one sparse Adam step on two
    simulated GPUs (medians over --repeat steps; the GPU's work drained after each, untimed)."""
    import gc

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import gpu_env

    gpu_env.install(0)
    cupy = gpu_env.cupy
    rng = np.random.default_rng(2)
    out = {}
    for k in _SIM_SLICES:
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with strategy.scope():
            e = md.Variable(np.zeros((args.rows, args.width), np.float32))
            opt = md.optimizers.Adam(1e-3)
        parts = [(rng.standard_normal((k, args.width)).astype(np.float32), rng.integers(0, 64, k)) for _ in range(2)]

        def step():
            r = md.get_replica_context().replica_id_in_sync_group
            with cupy.cuda.Device(r):
                values, indices = (cupy.asarray(a) for a in parts[r])
            opt.apply_gradients([(md.IndexedSlices(values, indices, (args.rows, args.width)), e)])
        samples = []
        for s in range(args.repeat + 1):
            cupy.sim.drain()
            gc.collect()
            gc.disable()  # (a collection inside the step would free, and wait, there)
            cupy.sim.reset_counters()
            start = time.perf_counter()
            strategy.run(step)
            seconds = time.perf_counter() - start
            counted = cupy.sim.counters()
            gc.enable()
            if s:  # (the first builds the plan)
                samples.append((sum(counted["launches"].values()), sum(counted["kernels"].values()),
                                counted["host_waits"], seconds))
        out[k] = [int(statistics.median(c[i] for c in samples)) for i in range(3)] + \
            [statistics.median(c[3] for c in samples)]
    print(json.dumps(out))


def _step_child(args) -> None:
    """Prints {rows per replica: (dense step s, sparse step s)} as JSON (medians, the two interleaved)."""
    n, rows, width = args.replicas, args.rows, args.width
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    rng = np.random.default_rng(1)
    out = {}
    for k in _STEP_ROWS:
        parts = [_slices(rng, k, rows, width) for _ in range(n)]
        denses = [md.convert_to_tensor(p) for p in parts]
        small = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(n)]
        steps = []
        for grads in (denses, parts):
            with strategy.scope():
                e = md.Variable(np.zeros((rows, width), np.float32))
                w = md.Variable(np.zeros((64, 64), np.float32))
                opt = md.optimizers.Adam(1e-3)

            def step(grads=grads, e=e, w=w, opt=opt):
                r = md.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(grads[r], e), (small[r], w)])
            steps.append(lambda step=step: strategy.run(step))
        times = [[], []]
        for f in steps:
            f()  # warm-up: plans, slots
        for _ in range(args.repeat):
            for j, f in enumerate(steps):
                start = time.perf_counter()
                f()
                times[j].append(time.perf_counter() - start)
        out[k] = [statistics.median(t) for t in times]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
