"""Training-step time of a 200-parameter model or an MLP: MirroredStrategy against a plain loop, in one run.

    python bench/train_step.py                                  # CPU: 1 and 2 replicas, 100 layers 128x128
    python bench/train_step.py --device gpu --replicas 1 2      # GPU: 100 layers 256x256 (logical GPUs
                                                                 # when replicas outnumber the GPUs)
    python bench/train_step.py --model mlp --replicas 1 2 4     # the MLP [1024, 4096, 4096, 10], batch 2048

The ``deep`` model (the default) is ``--layers`` dense layers ``width x width``
plus bias (200 parameter tensors by default: ResNet-50 has 161, BERT-base 199);
``--model mlp`` is issue 17's MLP [1024, 4096, 4096, 10] (3 weight tensors plus
biases, 84 MB of gradients, global batch 2048 unless ``--batch-size`` says
otherwise). tanh between layers, a squared-error loss, global batch
``--batch-size``. Each step is the
forward/backward pass plus the update, SGD with momentum 0.9 unless
``--optimizer`` says otherwise:

* plain: NumPy (CuPy with ``--device gpu``) in one process, the whole global
  batch, then ``p -= lr*g`` per parameter (plain SGD, the cheapest update);
* forward/backward alone (what any update adds to);
* plain CuPy with md.linalg.matmul (``--device gpu``): the plain loop with
  its products on mirrored's cuBLAS handle instead of CuPy's;
* mirrored: ``strategy.run(step)`` where each replica runs the same
  forward/backward on its share of the batch (products by
  ``md.linalg.matmul``, so that md.function can capture them) and calls
  ``optimizer.apply_gradients`` (gradients summed across replicas, one fused
  update per device);
* with ``--central``: the same step under CentralStorageStrategy over the same devices (the variables
  once, on the CPU; with ``--device gpu`` on GPU 0, and again on the CPU, TF's default for several GPUs;
  gradients all-reduced, one update there, the replicas on other GPUs reading refreshed copies);
* PyTorch DDP (gloo, one process per replica, CPU only) for the same model,
  when torch is importable (``--torch-python`` runs it in another venv);
* with ``--function``: ``strategy.run(md.function(step))``, the same step
  captured once and replayed as one CUDA graph per GPU (docs/function.md),
  and, when torch sees a GPU, PyTorch's eager step and its step captured
  in one CUDA graph (``torch.cuda.CUDAGraph``), SGD with momentum;
* with ``--accumulate N``: the mirrored step again with
  ``gradient_accumulation_steps=N`` (Keras' accumulation: N-1 steps in N only
  add the gradients to the accumulators, the N-th applies their average), in
  the same run;
* with ``--numpy-allocator`` (CPU): the mirrored step again with NumPy's own
  allocator inside the replicas instead of the replica array pool
  (docs/replica_arrays.md), in the same run;
* with ``--host-only`` (for the simulated GPUs, ``MIRRORED_CUDA_ENGINE=sim``,
  where kernels run on the CPU when the host waits): the host's time per
  call alone, the queued kernels drained outside the clock.

The table gives milliseconds per step and the ratio to the plain loop of the
same run (lower is better).
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


def per_step(fn, steps: int, sync=lambda: None) -> float:
    """Median seconds per call over 5 rounds of ``steps // 5`` calls, after 3 warm-up calls."""
    return interleaved([fn], steps, sync)[0]


# OpenBLAS's worker threads spin for 2**28 cycles (~0.13 s) after their last multi-threaded product
# before they sleep: a column timed right after one that used them (the plain loop, one replica) would
# share the cores with a spinning thread, which no training loop of its own steps does.
SETTLE_SECONDS = 0.2


def settle(fn, sync) -> None:
    """Untimed calls of ``fn`` for SETTLE_SECONDS, so that its round starts in its own steady state (the
    cores kept busy: no idle gap either)."""
    end = time.perf_counter() + SETTLE_SECONDS
    while time.perf_counter() < end:
        fn()
    sync()


def interleaved(fns, steps: int, sync=lambda: None, host_only=False) -> list:
    """Median seconds per call of each function, measured in turns (round r of every function, then
    round r + 1): a machine whose load drifts during the run weighs on every column alike. Each round
    starts after :func:`settle`, so that no column pays for the one before it.
    ``host_only``: each call is timed alone and its queued GPU work drained after the clock stops."""
    for fn in fns:
        for _ in range(3):
            fn()
    sync()
    samples = [[] for _ in fns]
    calls = max(1, steps // 5)
    for _ in range(5):
        for fn, column in zip(fns, samples):
            settle(fn, sync)
            spent = 0.0
            t0 = time.perf_counter()
            for _ in range(calls):
                if host_only:
                    t0 = time.perf_counter()
                fn()
                if host_only:
                    spent += time.perf_counter() - t0
                    sync()
            sync()
            column.append((spent if host_only else time.perf_counter() - t0) / calls)
    return [statistics.median(column) for column in samples]


MLP_SIZES = [1024, 4096, 4096, 10]


def layer_sizes(config: dict) -> list:
    """The widths of the model's layers, input first: ``[width] * (layers + 1)``, or the MLP's."""
    if config["model"] == "mlp":
        return MLP_SIZES
    return [config["width"]] * (config["layers"] + 1)


def init_params(sizes: list, seed: int = 0) -> list:
    """A weight ``(fan_in, fan_out)`` and a zero bias per layer of ``sizes``."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def operator_matmul(a, b, transpose_a=False, transpose_b=False):
    """The products as a plain loop writes them: ``a @ b`` (CuPy's cuBLAS on GPU arrays)."""
    return (a.T if transpose_a else a) @ (b.T if transpose_b else b)


def loss_and_grads(xp, params, x, y, global_batch: int, matmul=operator_matmul):
    """Squared error of a tanh MLP, and its gradients (loss divided by the GLOBAL batch size).
    ``matmul(a, b, transpose_a=, transpose_b=)`` makes every product: ``@``, or md.linalg.matmul
    (mirrored's cuBLAS, which md.function's capture records; CuPy refuses its own there)."""
    acts = [x]
    h = x
    n = len(params) // 2
    for i in range(n):
        h = matmul(h, params[2 * i]) + params[2 * i + 1]
        if i < n - 1:
            h = xp.tanh(h)
        acts.append(h)
    diff = h - y
    loss = (diff * diff).sum() / global_batch
    d = diff * (2.0 / global_batch)
    grads = [None] * len(params)
    for i in reversed(range(n)):
        grads[2 * i] = matmul(acts[i], d, transpose_a=True)
        grads[2 * i + 1] = d.sum(axis=0)
        if i:
            d = matmul(d, params[2 * i], transpose_b=True) * (1.0 - acts[i] * acts[i])
    return loss, grads


# --optimizer's Keras classes beside SGD (their default arguments, learning rate 1e-4).
KERAS_OPTIMIZERS = {"adam": "Adam", "adamax": "Adamax", "adadelta": "Adadelta", "lion": "Lion", "ftrl": "Ftrl",
                    "nadam": "Nadam", "rmsprop": "RMSprop", "adagrad": "Adagrad", "lamb": "Lamb",
                    "adafactor": "Adafactor", "schedule-free-adamw": "ScheduleFreeAdamW", "muon": "Muon"}


def make_optimizer(name: str, accumulate: int | None = None):
    if name in KERAS_OPTIMIZERS:
        return getattr(md.optimizers, KERAS_OPTIMIZERS[name])(1e-4, gradient_accumulation_steps=accumulate)
    return md.optimizers.SGD(0.01, momentum=0.0 if name == "sgd-plain" else 0.9,
                             gradient_accumulation_steps=accumulate)


def _slot(optimizer, slot: str, value: float, param):
    """The slot ``slot`` of ``param``, a NumPy array of its shape and dtype (Adafactor's factored ones differ)."""
    shape, dtype = optimizer._slot_shape(slot, param)
    return np.full(shape, value, dtype)


def numpy_rule_step(name: str, params: list, grads: list):
    """The optimizer's own rule as a NumPy loop over the parameters (its Keras sequence, one parameter at a
    time: md.optimizers.rules, the fused kernels' reference), slots in NumPy arrays; a call is one step."""
    from mirrored.train.optimizers.muon import variable_step

    optimizer = make_optimizer(name)
    muon = isinstance(optimizer, md.optimizers.Muon)
    # (Muon: a 2-D parameter takes its own step, slot momentum; the others AdamW's, momentum and velocity)
    slots = [[_slot(optimizer, slot, value, p) for slot, value in optimizer._slot_specs
              if not muon or slot == "momentum" or p.ndim != 2] for p in params]
    t = params[0].dtype.type
    step = [0]

    def run():
        coefficients = optimizer._coefficients(t, t(np.float32(optimizer.learning_rate_at(step[0]))), step[0])
        for p, g, s in zip(params, grads, slots):
            if muon:
                variable_step(optimizer, p, g, s, coefficients, p.ndim != 2, True)
            else:
                md.optimizers.rules.apply(optimizer._rule, p, g, s, coefficients)
        step[0] += 1

    return run


def torch_ddp(args) -> float | None:
    """Seconds per step of PyTorch DDP (gloo) over ``args.replicas_now`` processes, or None without torch."""
    python = args.torch_python or sys.executable
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        return None
    out = subprocess.run([python, os.path.abspath(__file__), "--torch-worker", json.dumps(vars(args))],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the torch DDP run failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def torch_worker(config: dict) -> None:
    """Spawns one process per replica; rank 0 prints the median seconds per step."""
    import torch.multiprocessing as mp

    n = config["replicas_now"]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_torch_rank, args=(n, config, queue), nprocs=n, join=True)
    print(queue.get())


def _torch_rank(rank: int, n: int, config: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(config["blas_threads"] or max(1, len(os.sched_getaffinity(0)) // n))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config["torch_port"]))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    sizes, batch = layer_sizes(config), config["batch_size"]
    layers = len(sizes) - 1
    model = torch.nn.Sequential(*[m for i in range(layers) for m in
                                  ([torch.nn.Linear(sizes[i], sizes[i + 1])]
                                   + ([torch.nn.Tanh()] if i < layers - 1 else []))])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((batch // n, sizes[0]), dtype=np.float32))
    y = torch.from_numpy(rng.standard_normal((batch // n, sizes[-1]), dtype=np.float32))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = ((ddp(x) - y) ** 2).sum() / batch
        loss.backward()
        opt.step()

    t = per_step(step, config["steps"])
    dist.barrier()
    if rank == 0:
        queue.put(t)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", choices=("deep", "mlp"), default="deep",
                   help="deep: --layers dense layers --width square (200 tensors); mlp: [1024, 4096, 4096, 10]")
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--width", type=int, default=None, help="default: 128 on CPU, 256 on GPU")
    p.add_argument("--batch-size", type=int, default=None, help="default: 512, 2048 for the MLP")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--optimizer", choices=("sgd", "sgd-plain", *KERAS_OPTIMIZERS), default="sgd",
                   help="sgd: momentum 0.9; sgd-plain: no momentum, the plain loop's own rule; the others: Keras' "
                        "defaults at learning rate 1e-4 (with --update-only, also the same rule as a NumPy loop "
                        "over the parameters)")
    p.add_argument("--update-only", action="store_true",
                   help="time the update alone: p -= lr*g per parameter against apply_gradients with fixed "
                        "gradients (the optimizer's own cost, without the forward/backward pass)")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="BLAS threads for every column (default: the library's own count; replicas cap it "
                        "to cores / replicas)")
    p.add_argument("--function", action="store_true",
                   help="also strategy.run(md.function(step)): the step captured as CUDA graphs (GPU only), and "
                        "PyTorch's eager and CUDA-graph steps when torch sees a GPU")
    p.add_argument("--host-only", action="store_true",
                   help="time the host's part of each call only: queued GPU work is drained outside the clock "
                        "(for the simulated GPUs)")
    p.add_argument("--numpy-allocator", action="store_true",
                   help="also the mirrored step with NumPy's own allocator in the replicas (CPU; the default is "
                        "the replica array pool, docs/replica_arrays.md)")
    p.add_argument("--accumulate", type=int, default=None, metavar="N",
                   help="also the mirrored step with gradient_accumulation_steps=N")
    p.add_argument("--central", action="store_true",
                   help="also md.distribute.experimental.CentralStorageStrategy over the same devices")
    p.add_argument("--torch-python", default=None, help="a Python with torch for the DDP column")
    p.add_argument("--torch-port", type=int, default=29533)
    p.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_worker:
        return torch_worker(json.loads(args.torch_worker))
    args.width = args.width or (256 if args.device == "gpu" else 128)
    args.batch_size = args.batch_size or (2048 if args.model == "mlp" else 512)
    sizes = layer_sizes(vars(args))
    if args.blas_threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")
    gpu = args.device == "gpu"
    if gpu:
        from mirrored.device import gpu as _gpu

        xp = _gpu.cupy_module()
        sync = xp.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    rng = np.random.default_rng(1)
    x = xp.asarray(rng.standard_normal((args.batch_size, sizes[0]), dtype=np.float32))
    y = xp.asarray(rng.standard_normal((args.batch_size, sizes[-1]), dtype=np.float32))
    params = [xp.asarray(a) for a in init_params(sizes)]
    nbytes = sum(a.nbytes for a in params)

    fixed_grads = loss_and_grads(xp, params, x, y, args.batch_size)[1] if args.update_only else None

    def plain_step():
        _, grads = (None, fixed_grads) if args.update_only else loss_and_grads(xp, params, x, y, args.batch_size)
        for a, g in zip(params, grads):
            a -= 0.01 * g

    columns = [("plain " + ("CuPy" if gpu else "NumPy") + " (p -= lr*g)", 1, plain_step)]
    if args.update_only and not gpu and args.optimizer in KERAS_OPTIMIZERS:
        columns.append((f"NumPy loop of {KERAS_OPTIMIZERS[args.optimizer]}'s rule per parameter", 1,
                        numpy_rule_step(args.optimizer, [a.copy() for a in params], fixed_grads)))
    if gpu and not args.update_only:
        def plain_step_own_cublas():
            _, grads = loss_and_grads(xp, params, x, y, args.batch_size, md.linalg.matmul)
            for a, g in zip(params, grads):
                a -= 0.01 * g

        columns.append(("plain CuPy with md.linalg.matmul", 1, plain_step_own_cublas))
    if not args.update_only:
        columns.append(("forward/backward alone", 1, lambda: loss_and_grads(xp, params, x, y, args.batch_size)))
    ngpu = len(md.config.list_physical_devices("GPU")) if gpu else 0
    logical = [n for n in args.replicas if gpu and n > ngpu]
    # When a count outnumbers the GPUs, GPU 0 is split into that many logical GPUs and every
    # count runs on the first n of them (one split serves all).
    for n in logical[-1:]:
        md.config.set_logical_device_configuration("GPU", 0, count=n)
    for n in args.replicas:
        columns.append(("mirrored MirroredStrategy", n, mirrored_step(args, xp, x, y, n, gpu, fixed_grads)))
        if args.accumulate:
            columns.append((f"mirrored MirroredStrategy, gradient_accumulation_steps={args.accumulate}", n,
                            mirrored_step(args, xp, x, y, n, gpu, fixed_grads, accumulate=args.accumulate)))
        if args.central:
            for parameter_device in ("/gpu:0", "/cpu:0") if gpu else ("/cpu:0",):
                columns.append((f"mirrored CentralStorageStrategy, variables on {parameter_device}", n,
                                mirrored_step(args, xp, x, y, n, gpu, fixed_grads, central=parameter_device)))
        if args.numpy_allocator and not gpu:
            columns.append(("mirrored, NumPy's allocator in the replicas", n,
                            mirrored_step(args, xp, x, y, n, gpu, fixed_grads, numpy_allocator=True)))
        if args.function and gpu:
            columns.append(("mirrored md.function (CUDA graphs)", n,
                            mirrored_step(args, xp, x, y, n, gpu, fixed_grads, captured=True)))
    if args.function and gpu and not args.update_only:
        columns += torch_gpu_columns(args)
    times = interleaved([fn for _, _, fn in columns], args.steps, sync, host_only=args.host_only)
    base = times[0]
    model = (f"MLP {sizes}" if args.model == "mlp" else
             f"{args.layers} dense layers {args.width}x{args.width}")
    print(f"{model} + bias ({len(params)} parameter tensors, {nbytes / 1e6:.1f} MB), "
          f"global batch {args.batch_size}, {args.device}, optimizer {args.optimizer}, "
          f"BLAS threads {args.blas_threads or 'default'}{', the update alone' if args.update_only else ''}"
          f"{', host time per call only (GPU work drained outside the clock)' if args.host_only else ''}\n")
    # With the optimizer's rule as a NumPy loop (column 1), each column's ratio to it as well.
    rule_loop = times[1] if columns[1][0].startswith("NumPy loop of") else None
    print("| step | replicas | ms/step | vs plain |" + (" vs NumPy rule loop |" if rule_loop else "")
          + "\n|---|---|---|---|" + ("---|" if rule_loop else ""))
    for (label, n, _), t in zip(columns, times):
        print(f"| {label} | {n} | {t * 1e3:.2f} | {t / base:.2f}x |" + (f" {t / rule_loop:.2f}x |" if rule_loop else ""),
              flush=True)
    if logical:
        md.config.set_logical_device_configuration("GPU:0", None)
    if not gpu and not args.update_only:
        for n in args.replicas:
            args.replicas_now = n
            t_torch = torch_ddp(args)
            if t_torch is not None:
                print(f"| PyTorch DDP (gloo), measured after | {n} | {t_torch * 1e3:.2f} | {t_torch / base:.2f}x |",
                      flush=True)


def torch_gpu_columns(args) -> list:
    """PyTorch eager and whole-step CUDA-graph columns of the same model (SGD with momentum 0.9), when
    torch sees a GPU; none otherwise."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available() or os.environ.get("MIRRORED_CUDA_ENGINE") == "sim":
        return []
    dev = torch.device("cuda")
    sizes = layer_sizes(vars(args))
    params = [torch.tensor(a, device=dev, requires_grad=True) for a in init_params(sizes)]
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.standard_normal((args.batch_size, sizes[0]), dtype=np.float32), device=dev)
    y = torch.tensor(rng.standard_normal((args.batch_size, sizes[-1]), dtype=np.float32), device=dev)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)

    def step():
        h = x
        for i in range(0, len(params), 2):
            h = h @ params[i] + params[i + 1]
            if i + 2 < len(params):
                h = torch.tanh(h)
        loss = ((h - y) ** 2).sum() / args.batch_size
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph recipe asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return [("PyTorch eager (foreach SGD)", 1, step), ("PyTorch, step in one CUDA graph", 1, graph.replay)]


def mirrored_step(args, xp, x, y, n: int, gpu: bool, fixed_grads=None, captured=False, numpy_allocator=False,
                  central=None, accumulate=None):
    """``strategy.run(step)`` on ``n`` replicas: forward/backward on each replica's share, apply_gradients
    (only apply_gradients of ``fixed_grads`` when given); ``captured``: the step wrapped in md.function;
    ``numpy_allocator``: each replica's arrays from NumPy's own allocator, not the replica array pool;
    ``central``: CentralStorageStrategy with its variables on that device, not MirroredStrategy;
    ``accumulate``: the optimizer's ``gradient_accumulation_steps``."""
    devices = [f"/gpu:{i}" if gpu else f"/cpu:{i}" for i in range(n)]
    strategy = (md.distribute.experimental.CentralStorageStrategy(devices, central)
                if central else md.MirroredStrategy(devices))
    with strategy.scope():
        variables = [md.Variable(a) for a in init_params(layer_sizes(vars(args)))]
        optimizer = make_optimizer(args.optimizer, accumulate)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def step_fn(xs, ys):
        if fixed_grads is not None:
            grads = fixed_grads
        else:
            _, grads = loss_and_grads(xp, [v.read_value() for v in variables], xs, ys, args.batch_size,
                                      md.linalg.matmul)
        optimizer.apply_gradients(zip(grads, variables))

    run = md.function(step_fn) if captured else step_fn
    if numpy_allocator:
        from mirrored import _core

        numpy_default = _core.set_array_handler(_core.replica_array_handler)
        _core.set_array_handler(numpy_default)
        pooled = run

        def run(xs, ys):
            replicas = _core.set_array_handler(numpy_default)
            try:
                pooled(xs, ys)
            finally:
                _core.set_array_handler(replicas)

    return lambda: strategy.run(run, args=batch)


if __name__ == "__main__":
    main()
