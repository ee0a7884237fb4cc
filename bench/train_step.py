"""Training-step throughput: the demo's MLP, fused gradient all-reduce, N CPU replicas.

    python bench/train_step.py --replicas 1 2 4 --hidden 512 512 --batch-size 256 --steps 100

For each replica count, times ``strategy.run(step)`` where a step is the
forward/backward pass of examples/train_digits.py on this replica's slice of
the global batch plus ``optimizer.apply_gradients`` (one fused SUM
all-reduce of all gradients, then the SGD update of every copy). The baseline
in the same run is plain NumPy: the same forward/backward and update on the
whole global batch in the calling thread (BLAS with its own threads), no
strategy at all.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import numpy as np

import mirrored as md

HERE = os.path.dirname(os.path.abspath(__file__))


def load_demo():
    spec = importlib.util.spec_from_file_location("train_digits", os.path.join(HERE, "..", "examples",
                                                                               "train_digits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_step(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(max(1, steps // 5)):
            fn()
        samples.append((time.perf_counter() - t0) / max(1, steps // 5))
    return statistics.median(samples)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 512])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)
    demo = load_demo()
    x, y, _, _ = demo.load_data("float32", 0)
    xb, yb = x[:args.batch_size], y[:args.batch_size]
    sizes = [x.shape[1], *args.hidden, 10]
    params = [np.asarray(v.numpy()) for v in demo.MLP(sizes, "float32", 0).trainable_variables]
    nbytes = sum(a.nbytes for a in params)

    def numpy_step():
        _, grads, _ = demo.loss_and_grads(params, xb, yb)
        for a, g in zip(params, grads):
            a -= 0.01 * g

    base = per_step(numpy_step, args.steps)
    print(f"MLP {sizes}, {nbytes / 1e6:.2f} MB of gradients, global batch {args.batch_size}\n")
    print("| replicas | step time | samples/s | vs plain NumPy step |\n|---|---|---|---|")
    print(f"| plain NumPy, one process | {base * 1e3:.2f} ms | {args.batch_size / base:,.0f} | 1.00x |")
    for n in args.replicas:
        strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            model = demo.MLP(sizes, "float32", 0)
            optimizer = md.optimizers.SGD(0.01)
        variables = model.trainable_variables
        batch = next(iter(strategy.experimental_distribute_dataset([(xb, yb)])))

        def step_fn(xs, ys):
            _, grads, _ = demo.loss_and_grads([demo.local(v) for v in variables], xs, ys)
            optimizer.apply_gradients(zip(grads, variables))

        t = per_step(lambda: strategy.run(step_fn, args=batch), args.steps)
        print(f"| {n} | {t * 1e3:.2f} ms | {args.batch_size / t:,.0f} | {base / t:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
