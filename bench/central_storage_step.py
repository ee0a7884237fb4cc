"""CentralStorageStrategy's training step on GPUs: kernel launches, stream operations, host waits and the
host's microseconds per step, for 10 and for 200 parameter tensors (bench/train_step.py's deep model: 5 or
100 dense layers plus bias, SGD with momentum), variables on the CPU or on GPU 0, beside MirroredStrategy's
step and a plain loop over the same gradients, in one run. ``--kinds`` picks the steps:

* ``plain``: ``apply_gradients``;
* ``loss_scale`` / ``loss_scale_fixed``: under md.mixed_precision.LossScaleOptimizer, dynamic (every step
  checked for inf and nan) or fixed;
* ``accumulate``: ``gradient_accumulation_steps`` too large to be reached, so every step only accumulates.

The plain loop runs on GPU 0 with the whole gradients, per parameter: ``p -= lr*g`` (plain, accumulate:
``acc += g``), the loss-scaled ones divided by the scale first, the dynamic one's finiteness read once
(``isfinite`` of every gradient, stacked: one host wait). By default the step is what the strategy does per
step: each replica reads every variable and applies fixed gradients of its own (``--forward-backward``: the
model's forward/backward pass too, whose CuPy kernels then dominate).

Made for the simulated GPUs, where the runtime counts every launch and copy (kernels run on the CPU when
the host waits; their time is drained outside the clock, so the times are the host's part of a step):

    PYTHONPATH=python:tests python -c "import runpy, sys, gpu_env; gpu_env.install(0); \\
        sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" \\
        bench/central_storage_step.py --layouts physical logical

On real GPUs the counters are "-" (they are the simulator's) and the times are whole steps. Compare builds
by running it with each build's package first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import mirrored as md

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import init_params, interleaved, layer_sizes, loss_and_grads  # noqa: E402

KINDS = ("plain", "loss_scale", "loss_scale_fixed", "accumulate")
LR = 0.01


def make_optimizer(kind: str):
    """SGD with momentum, wrapped or configured for ``kind``'s step."""
    accumulation = 10 ** 9 if kind == "accumulate" else None
    optimizer = md.optimizers.SGD(LR, momentum=0.9, gradient_accumulation_steps=accumulation)
    if kind.startswith("loss_scale"):
        optimizer = md.mixed_precision.LossScaleOptimizer(optimizer, dynamic=kind == "loss_scale")
    return optimizer


def step_of(strategy, kind: str, layers: int, xp, width: int, batch: int, forward_backward: bool):
    """The replicas' step: every variable read, then apply_gradients of fixed gradients, or of the gradients of
    a forward/backward pass on the replica's share of the batch."""
    args = {"model": "deep", "layers": layers, "width": width}
    with strategy.scope():
        variables = [md.Variable(a) for a in init_params(layer_sizes(args))]
        optimizer = make_optimizer(kind)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, width), dtype=np.float32)
    y = rng.standard_normal((batch, width), dtype=np.float32)
    data = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    fixed = strategy.run(lambda xs, ys: loss_and_grads(xp, [v.read_value() for v in variables], xs, ys, batch,
                                                      md.linalg.matmul)[1], args=data)

    def step_fn(xs, ys, fixed_grads):
        # (the weights read are dropped before the update, as a step that computes its gradients from them
        # does: a read still held would be copied by the update, copy-on-write)
        weights = [v.read_value() for v in variables]
        grads = loss_and_grads(xp, weights, xs, ys, batch, md.linalg.matmul)[1] if forward_backward else fixed_grads
        del weights
        optimizer.apply_gradients(zip(grads, variables))

    data = (*data, fixed)
    return lambda: strategy.run(step_fn, args=data)


def plain_loop_of(kind: str, layers: int, xp, width: int, batch: int, forward_backward: bool):
    """The plain loop's step on GPU 0 (see the module's docstring)."""
    args = {"model": "deep", "layers": layers, "width": width}
    params = [xp.asarray(a) for a in init_params(layer_sizes(args))]
    accumulators = [xp.zeros_like(p) for p in params]
    rng = np.random.default_rng(1)
    x = xp.asarray(rng.standard_normal((batch, width), dtype=np.float32))
    y = xp.asarray(rng.standard_normal((batch, width), dtype=np.float32))
    fixed = loss_and_grads(xp, params, x, y, batch)[1]
    scale = np.float32(2.0 ** 15)

    def step():
        grads = loss_and_grads(xp, params, x, y, batch)[1] if forward_backward else fixed
        if kind == "accumulate":
            for a, g in zip(accumulators, grads):
                a += g
            return
        if kind.startswith("loss_scale"):
            grads = [g / scale for g in grads]
            if kind == "loss_scale" and not bool(xp.stack([xp.isfinite(g).all() for g in grads]).all()):
                return
        for p, g in zip(params, grads):
            p -= LR * g

    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--layers", type=int, nargs="+", default=[5, 100])
    p.add_argument("--layouts", nargs="+", choices=("physical", "logical"), default=["physical"],
                   help="physical: one replica per GPU; logical: two logical GPUs on GPU 0")
    p.add_argument("--parameter-devices", nargs="+", default=["/cpu:0", "/gpu:0"])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--forward-backward", action="store_true", help="the model's forward/backward pass in the step")
    args = p.parse_args(argv)
    from mirrored.device import gpu as _gpu

    cupy = _gpu.cupy_module()
    sim = getattr(cupy, "sim", None)
    drain = sim.drain if sim is not None else (lambda: cupy.cuda.Device().synchronize())
    shape = (args.width, args.batch_size, args.forward_backward)
    print("| step | layout | variables on | parameter tensors | engine launches | CuPy kernels | stream ops (copies, "
          "event waits, ...) | host waits | central us/step | vs MirroredStrategy | vs plain loop |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        if layout == "logical":
            md.config.set_logical_device_configuration("GPU", 0, count=2)
        for kind in args.kinds:
            for layers in args.layers:
                mirrored = step_of(md.MirroredStrategy(["/gpu:0", "/gpu:1"]), kind, layers, cupy, *shape)
                plain = plain_loop_of(kind, layers, cupy, *shape)
                for parameter_device in args.parameter_devices:
                    central = md.distribute.experimental.CentralStorageStrategy(["/gpu:0", "/gpu:1"],
                                                                                parameter_device)
                    step = step_of(central, kind, layers, cupy, *shape)
                    for _ in range(3):  # plans, slots, tables and the replicas' copies made
                        step()
                    drain()
                    counted = ("-",) * 4
                    if sim is not None:
                        sim.reset_counters()
                        step()
                        c = sim.counters()
                        drain()
                        counted = (sum(c["launches"].values()), sum(c["kernels"].values()) + sum(c["blas"].values()),
                                   c["stream_ops"], c["host_waits"])
                    t_central, t_mirrored, t_plain = interleaved([step, mirrored, plain], args.steps, drain,
                                                                 host_only=sim is not None)
                    print(f"| {kind} | {layout} | {parameter_device} | {2 * layers} | "
                          + " | ".join(map(str, counted))
                          + f" | {t_central * 1e6:.0f} | {t_central / t_mirrored:.2f}x | {t_central / t_plain:.2f}x |",
                          flush=True)
        if layout == "logical":
            md.config.set_logical_device_configuration("GPU:0", None)


if __name__ == "__main__":
    main()
