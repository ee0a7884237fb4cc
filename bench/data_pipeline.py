"""md.data overlap: parallel map and prefetch against the sequential pipeline, threads against processes, and
(when installed) grain doing the same work — every ratio measured in one run, best of ``--repeats``.

    PYTHONPATH=python python bench/data_pipeline.py              # md.data only
    PYTHONPATH=python /work/venvs/data/bin/python bench/data_pipeline.py   # + grain (pip install grain)

Workloads of 40 elements, each ~10 ms: ``sleep`` (I/O-like: releases the GIL), ``numpy`` (sorting an array:
releases the GIL), ``python`` (a pure-Python loop: holds the GIL). Prefetch: a 5 ms producer and a 5 ms
consumer. Interleave: 8 datasets of 5 reads of ~5 ms (files being read), sequential against
``num_parallel_calls``.
"""

import argparse
import importlib.util
import multiprocessing
import os
import time

import numpy as np

import mirrored as md

D = md.data.Dataset
N = 40


def work_sleep(x):
    time.sleep(0.010)
    return x


_ARRAY = np.random.default_rng(0).random(400_000)


def work_numpy(x):
    np.sort(_ARRAY)  # ~10 ms on one core of the development machine; releases the GIL
    return x


def work_python(x):
    total = 0
    for i in range(150_000):  # ~10 ms of bytecode: holds the GIL
        total += i * i
    return x + (total & 0)


WORK = {"sleep": work_sleep, "numpy": work_numpy, "python": work_python}


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def consume(ds):
    for _ in ds:
        pass


def process_pool_map(work, pool):
    # What a process pool would give: the same 40 calls, elements pickled to and from the workers.
    for _ in pool.imap(work, range(N), chunksize=1):
        pass


def grain_map(work, threads):
    import grain

    ds = grain.MapDataset.range(N).map(work).to_iter_dataset(grain.ReadOptions(num_threads=threads,
                                                                                prefetch_buffer_size=threads))
    for _ in ds:
        pass


def grain_processes(work, workers):
    import grain

    ds = grain.MapDataset.range(N).to_iter_dataset().map(work).mp_prefetch(
        grain.MultiprocessingOptions(num_workers=workers))
    for _ in ds:
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    have_grain = importlib.util.find_spec("grain") is not None
    cpus = os.cpu_count()
    print(f"# {N} elements of ~10 ms, {cpus} CPUs, best of {args.repeats}; ratio = time / sequential time")
    print(f"| work | sequential s | md.data AUTOTUNE (threads) | process pool ({cpus}) |"
          + (" grain threads (16) | grain processes |" if have_grain else ""))
    print("|---|---|---|---|" + ("---|---|" if have_grain else ""))
    with multiprocessing.get_context("fork").Pool(cpus) as pool:
        for name, work in WORK.items():
            seq = best(lambda: consume(D.range(N).map(work)), args.repeats)
            par = best(lambda: consume(D.range(N).map(work, num_parallel_calls=md.data.AUTOTUNE)), args.repeats)
            proc = best(lambda: process_pool_map(work, pool), args.repeats)
            row = f"| {name} | {seq:.3f} | {par / seq:.2f} | {proc / seq:.2f} |"
            if have_grain:
                gt = best(lambda: grain_map(work, 16), args.repeats)
                gp = best(lambda: grain_processes(work, cpus), args.repeats)
                row += f" {gt / seq:.2f} | {gp / seq:.2f} |"
            print(row, flush=True)

    def producer(x):
        time.sleep(0.005)
        return x

    def pipeline(prefetch):
        ds = D.range(N).map(producer)
        if prefetch is not None:
            ds = ds.prefetch(prefetch)
        for _ in ds:
            time.sleep(0.005)  # the consumer's 5 ms (a training step)

    # Batching rows of arrays: md.data gathers a batch with one indexing per component; `.take(-1)` in
    # between (which passes every element through) makes it slice and stack row by row, as a general
    # pipeline must; NumPy's own indexing is the bound.
    x = np.random.default_rng(0).random((60_000, 784), dtype=np.float32)
    y = np.arange(60_000)
    order = np.random.default_rng(1).permutation(len(x))
    rows = {
        "NumPy x[perm[i:i+128]] (bound)": lambda: [x[order[i:i + 128]] for i in range(0, len(x), 128)],
        "from_tensor_slices.batch(128)": lambda: consume(D.from_tensor_slices((x, y)).batch(128)),
        "... .take(-1).batch(128) (row by row)": lambda: consume(D.from_tensor_slices((x, y)).take(-1).batch(128)),
        "from_tensor_slices.shuffle(60000).batch(128)":
            lambda: consume(D.from_tensor_slices((x, y)).shuffle(60_000, seed=0).batch(128)),
        "... .shuffle(60000).take(-1).batch(128) (row by row)":
            lambda: consume(D.from_tensor_slices((x, y)).shuffle(60_000, seed=0).take(-1).batch(128)),
    }
    times = {name: best(fn, args.repeats) for name, fn in rows.items()}
    bound = times["NumPy x[perm[i:i+128]] (bound)"]
    print("\n# one epoch of 60000 x 784 float32 rows in batches of 128; ratio = time / NumPy's")
    print("| pipeline | seconds | ratio |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t:.3f} | {t / bound:.1f} |")

    base = best(lambda: pipeline(None), args.repeats)
    print(f"\n# prefetch: {N} elements, 5 ms producer + 5 ms consumer; ideal ratio 0.50")
    print("| pipeline | seconds | ratio |\n|---|---|---|")
    print(f"| no prefetch | {base:.3f} | 1.00 |")
    for size in (1, md.data.AUTOTUNE):
        t = best(lambda: pipeline(size), args.repeats)
        print(f"| prefetch({'AUTOTUNE' if size == md.data.AUTOTUNE else size}) | {t:.3f} | {t / base:.2f} |")


    def read(x):
        time.sleep(0.005)  # one read of a file: waits, releases the GIL
        return x

    def interleaved(**kwargs):
        consume(D.range(8).interleave(lambda f: D.range(5).map(read), cycle_length=4, **kwargs))

    base = best(lambda: interleaved(), args.repeats)
    print("\n# interleave: 8 datasets x 5 reads of 5 ms, cycle_length=4; ratio = time / sequential")
    print("| interleave | seconds | ratio |\n|---|---|---|")
    print(f"| sequential | {base:.3f} | 1.00 |")
    for calls, deterministic in ((2, None), (4, None), (md.data.AUTOTUNE, None), (4, False)):
        t = best(lambda: interleaved(num_parallel_calls=calls, deterministic=deterministic), args.repeats)
        name = "AUTOTUNE" if calls == md.data.AUTOTUNE else calls
        print(f"| num_parallel_calls={name}{', deterministic=False' if deterministic is False else ''} | {t:.3f} | "
              f"{t / base:.2f} |")


if __name__ == "__main__":
    main()
