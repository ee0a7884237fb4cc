"""What routing variables to two optimizers costs per step: ``md.optimizers.MultiOptimizer`` on N CPU replicas.

    python bench/multi_optimizer.py --replicas 1 2 4 --variables 200 --side 64 --steps 140
    python bench/multi_optimizer.py --gpu --replicas 1 2 --variables 200 --side 64 --steps 140

For each replica count, times ``strategy.run(step)`` where a step only applies one gradient per variable (no
forward/backward pass) of ``--variables`` variables (alternately side x side and side elements: a small side
shows the per-step overhead, a large one the arithmetic): one Adam over all of
them (the baseline of the same run), a MultiOptimizer whose OptimizerMap sends half of them to Adam by a pattern
and the rest to SGD with momentum (its default), and a MultiOptimizer of one Adam (the routing alone). Median
microseconds per step (the cases timed in interleaved rounds) and the ratio to the baseline. ``--gpu``: the
replicas on GPUs (one per GPU while there are enough, else logical GPUs of GPU 0) with CuPy gradients, each step
ended by a wait for every GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mirrored as md
from mirrored.device import device_util


def per_step(fns, steps: int, rounds: int = 7) -> list:
    """Median seconds per call of each function, timed in interleaved rounds so that a busy machine's slow
    spells hit every case alike."""
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


CASES = {
    "Adam (baseline)": lambda: md.optimizers.Adam(1e-6),
    "MultiOptimizer Adam + SGD": lambda: md.optimizers.MultiOptimizer(md.optimizers.OptimizerMap(
        md.optimizers.SGD(1e-6, momentum=0.9), {"enc/.*": md.optimizers.Adam(1e-6)})),
    "MultiOptimizer of one Adam": lambda: md.optimizers.MultiOptimizer(
        md.optimizers.OptimizerMap(md.optimizers.Adam(1e-6))),
}


def step_function(strategy, count: int, side: int, make):
    rng = np.random.default_rng(0)
    shapes = [(side, side) if k % 2 else (side,) for k in range(count)]
    with strategy.scope():
        variables = [md.Variable(rng.standard_normal(s).astype(np.float32),
                                 name=f"{'enc' if k < count // 2 else 'dec'}/v{k}") for k, s in enumerate(shapes)]
        optimizer = make()
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    devices = strategy.extended.worker_devices
    # Each replica's gradients on its own device (NumPy on CPUs, CuPy on GPUs), made once.
    grads = [[device_util.place(g, device) for g in host] for device in devices]

    def step():
        ctx = md.get_replica_context()
        optimizer.apply_gradients(zip(grads[ctx.replica_id_in_sync_group], variables))

    def run():
        strategy.run(step)
        if "GPU" in devices[0].upper():
            variables[-1].values[-1].numpy()  # (a read waits for the step)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--variables", type=int, default=200)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--steps", type=int, default=140)
    parser.add_argument("--gpu", action="store_true", help="replicas on GPUs, CuPy gradients")
    args = parser.parse_args(argv)
    print(f"{'replicas':>8}  {'case':<28} {'us/step':>10} {'ratio':>7}")
    for n in args.replicas:
        if args.gpu:
            if n > md.config.num_gpus():
                md.config.set_logical_device_configuration("GPU", 0, count=n)
            strategy = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
        else:
            strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        fns = [step_function(strategy, args.variables, args.side, make) for make in CASES.values()]
        times = per_step(fns, args.steps)
        for name, t in zip(CASES, times):
            print(f"{n:>8}  {name:<28} {t * 1e6:>10.1f} {t / times[0]:>7.2f}")
        if args.gpu and n > md.config.num_gpus():
            md.config.set_logical_device_configuration("GPU:0", None)


if __name__ == "__main__":
    main()
