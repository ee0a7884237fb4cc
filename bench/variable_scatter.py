"""Cost of a variable's indexed update or read (host) beside the bare NumPy operation it comes down to.

    python bench/variable_scatter.py [--repeat 200]

For each table size (rows x width) and number of indices: md.Variable.scatter_nd_add (indices [N, 1]),
scatter_add (an md.IndexedSlices), sparse_read and gather_nd, against np.add.at / fancy indexing of a bare
array of the same shape, in the same run. What the variable adds is the checks TensorFlow makes (index
dtypes and bounds, shapes) and the cast of the updates; the update itself is the same ufunc. The two calls
alternate (a busy machine slows both alike); median of --repeat calls each; the ratio is the variable's time
over the bare one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mirrored as md

SIZES = ((1_000, 16, 100), (100_000, 64, 1_000), (100_000, 64, 20_000))


def median_seconds(calls, repeat: int) -> list:
    """The median time of each of ``calls``, called in turn ``repeat`` times."""
    times = [[] for _ in calls]
    for _ in range(repeat):
        for fn, spent in zip(calls, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| rows x width | indices | operation | variable (us) | bare NumPy (us) | ratio |")
    print("|---|---|---|---|---|---|")
    for rows, width, count in SIZES:
        table = rng.standard_normal((rows, width)).astype(np.float32)
        indices = rng.integers(0, rows, count).astype(np.int64)
        updates = rng.standard_normal((count, width)).astype(np.float32)
        v = md.Variable(table)
        bare = table.copy()
        slices = md.IndexedSlices(updates, indices)
        nd = indices[:, None]
        cases = (
            ("scatter_nd_add", lambda: v.scatter_nd_add(nd, updates), lambda: np.add.at(bare, indices, updates)),
            ("scatter_add", lambda: v.scatter_add(slices), lambda: np.add.at(bare, indices, updates)),
            ("sparse_read", lambda: v.sparse_read(indices), lambda: bare[indices]),
            ("gather_nd", lambda: v.gather_nd(nd), lambda: bare[indices]),
        )
        for name, ours, floor in cases:
            t_ours, t_floor = median_seconds((ours, floor), args.repeat)
            print(f"| {rows} x {width} | {count} | {name} | {t_ours * 1e6:.1f} | {t_floor * 1e6:.1f} | "
                  f"{t_ours / t_floor:.2f} |")


if __name__ == "__main__":
    main()
