"""What dynamic loss scaling costs per step, and what float16 / bfloat16 gradients save: N CPU replicas.

    python bench/loss_scale.py --replicas 2 4 --sizes 64x512 512 512x512 512 512x10 10 --steps 60

For each replica count, times ``strategy.run(step)`` where a step only applies
one gradient per variable (no forward/backward pass): the plain
``md.optimizers.SGD`` with float32 gradients (the baseline of the same run),
then ``md.mixed_precision.LossScaleOptimizer`` around it with float32,
float16 and bfloat16 gradients (the fused all-reduce runs in that dtype; the
check, its one-flag all-reduce and the unscaling are the added work).
Median microseconds per step (the cases timed in interleaved rounds) and the
ratio to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mirrored as md


def per_step(fns, steps: int, rounds: int = 7) -> list:
    """Median seconds per call of each function, timed in interleaved rounds so that a busy
    machine's slow spells hit every case alike."""
    for fn in fns:
        for _ in range(3):
            fn()
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            for _ in range(max(1, steps // rounds)):
                fn()
            out.append((time.perf_counter() - t0) / max(1, steps // rounds))
    return [statistics.median(out) for out in samples]


def shape(text: str) -> tuple:
    return tuple(int(d) for d in text.split("x"))


def step_function(strategy, shapes, dtype, loss_scaled: bool):
    rng = np.random.default_rng(0)
    with strategy.scope():
        variables = [md.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        optimizer = md.optimizers.SGD(1e-6)
        if loss_scaled:
            optimizer = md.mixed_precision.LossScaleOptimizer(optimizer)
    grads = [rng.standard_normal(s).astype(dtype) for s in shapes]

    def step():
        optimizer.apply_gradients(zip(grads, variables))
    return lambda: strategy.run(step)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=shape, nargs="+", default=[(64, 512), (512,), (512, 512), (512,), (512, 10), (10,)])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    import ml_dtypes

    cases = [("SGD, float32 gradients", np.float32, False), ("LossScale(SGD), float32", np.float32, True),
             ("LossScale(SGD), float16", np.float16, True), ("LossScale(SGD), bfloat16", ml_dtypes.bfloat16, True)]
    elements = sum(int(np.prod(s)) for s in args.sizes)
    print(f"{len(args.sizes)} variables, {elements} elements; median us per step (ratio to plain SGD)")
    print(f"{'replicas':>8}  " + "  ".join(f"{name:>26}" for name, _, _ in cases))
    for n in args.replicas:
        strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        times = per_step([step_function(strategy, args.sizes, dtype, scaled) for _, dtype, scaled in cases],
                         args.steps)
        print(f"{n:>8}  " + "  ".join(f"{t * 1e6:>17.0f} ({t / times[0]:.2f}x)" for t in times))

if __name__ == "__main__":
    main()
