"""IndexedSlices against dense gradients of the same embedding table, in one run (same-run ratios).

    PYTHONPATH=python python bench/sparse_gradients.py [--replicas 2] [--rows 100000] [--width 64] [--repeat 7]

1. Reduction: ``strategy.reduce(SUM, ...)`` of every replica's k rows (an all-gather of values and of
   indices) against the all-reduce of the dense rows x width table.
2. Training step: ``Adam.apply_gradients`` inside ``strategy.run`` with the embedding's gradient as
   IndexedSlices (gathered, densified with its squares, the rule element-wise) against the same step
   with the gradient densified by the caller (the fused kernel), beside a dense 64 x 64 variable.
Prints one table per part: the median time of each and the ratio sparse / dense.
"""

from __future__ import annotations

import argparse
import statistics
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
    args = parser.parse_args()
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

    print("\n| rows per replica | Adam step, IndexedSlices (ms) | Adam step, dense (ms) | sparse / dense |")
    print("|---:|---:|---:|---:|")
    for k in (256, 4096):
        parts = [_slices(rng, k, rows, width) for _ in range(n)]
        denses = [md.convert_to_tensor(p) for p in parts]
        small = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(n)]
        times = []
        for grads in (parts, denses):
            with strategy.scope():
                e = md.Variable(np.zeros((rows, width), np.float32))
                w = md.Variable(np.zeros((64, 64), np.float32))
                opt = md.optimizers.Adam(1e-3)

            def step(grads=grads, e=e, w=w, opt=opt):
                r = md.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(grads[r], e), (small[r], w)])
            times.append(_median_seconds(lambda step=step: strategy.run(step), args.repeat))
        print(f"| {k} | {times[0] * 1e3:.2f} | {times[1] * 1e3:.2f} | {times[0] / times[1]:.2f} |")


if __name__ == "__main__":
    main()
