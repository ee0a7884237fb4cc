"""Train an MLP on scikit-learn's digits with MirroredStrategy over CPU replicas.

    python examples/train_digits.py                    # 4 replicas, ~40 epochs
    python examples/train_digits.py --replicas 1       # same global batch: same weights
    python examples/train_digits.py --steps 20 --out /tmp/run   # a quick check
    python examples/train_digits.py --device gpu       # replicas on GPUs, arrays in CuPy
    python examples/train_digits.py --mixed-precision  # float16 compute, float32 weights, loss scaling

The forward and backward passes are hand-written NumPy; `mirrored` supplies
the rest: `strategy.experimental_distribute_dataset` splits each global batch
over the replicas, `strategy.run` runs the step on every replica in parallel,
the optimizer sums the gradients with one fused all-reduce (as Keras does)
and updates every mirrored copy, `md.train.Checkpoint` saves the run.
With `--mixed-precision` (Keras' "mixed_float16" policy) the passes run in
float16 from float32 master weights: the backward pass starts from the loss
scaled by `md.mixed_precision.LossScaleOptimizer`, whose `apply_gradients`
all-reduces the float16 gradients, skips a step whose gradients overflowed
(on any replica) and unscales the rest into float32 updates. Outputs, in --out: a
loss-curve PNG, the checkpoint, and the history as JSON. The last line printed
is ``final test accuracy: 0.xxxx``.

Why `--replicas 1` gives the same weights: each replica's loss is the sum of
its examples' losses divided by the GLOBAL batch size
(`md.nn.compute_average_loss`, as in TensorFlow), so the all-reduced SUM of the
replicas' gradients is the gradient of the mean over the global batch —
exactly the one-replica gradient, up to float rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time

import numpy as np

import mirrored as md


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4, help="replicas (default 4)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="cpu: CPU replicas; gpu: GPU replicas with CuPy arrays (logical GPUs when replicas "
                        "outnumber the GPUs)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size (default 64)")
    p.add_argument("--epochs", type=int, default=40, help="length of the run and its learning-rate schedule")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many training batches (default: all epochs)")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 64], help="hidden layer widths")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.05 SGD, 0.002 Adam)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--mixed-precision", action="store_true",
                   help="compute in float16 with float32 weights and dynamic loss scaling (Keras' mixed_float16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/digits", help="output directory (default ./out/digits)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas {args.replicas}: expected at least 1")
    if args.mixed_precision and args.dtype != "float32":
        p.error(f"--mixed-precision keeps float32 weights: it cannot be combined with --dtype {args.dtype}")
    if args.batch_size % args.replicas:
        p.error(f"--batch-size {args.batch_size} is not divisible by --replicas {args.replicas}: "
                "every replica needs an equal share for the gradient mean to equal the global mean")
    return args


# --- data -----------------------------------------------------------------------------------------

def load_data(dtype, seed: int):
    """Digits (8x8 images, 10 classes), a stratified 80/20 split, standardised on the train set."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-6
    # A pixel constant over the train set stays 0 after it: its tiny std would blow a test image's
    # other value there up past float16's range (--mixed-precision).
    std[std <= 1e-6] = 1.0
    prep = lambda a: ((a - mean) / std).astype(dtype)  # noqa: E731
    return prep(x_train), y_train.astype(np.int64), prep(x_test), y_test.astype(np.int64)


def train_dataset(x, y, batch_size: int, seed: int):
    """tf.data's idiom: reshuffled every epoch, full global batches, endless, prepared in the background
    (the same order whatever the replica count)."""
    return (md.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=seed)
            .batch(batch_size, drop_remainder=True)
            .repeat()
            .prefetch(md.data.AUTOTUNE))


# --- the model: a ReLU MLP with softmax cross-entropy, backprop by hand ------------------------------

class MLP:
    """Weights are md.Variables, mirrored on every replica when created in strategy.scope()."""

    def __init__(self, sizes, dtype, seed: int):
        rng = np.random.default_rng(seed)
        self.layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out)).astype(dtype)  # He init
            self.layers.append({"w": md.Variable(w, name=f"dense{i}/w"),
                                "b": md.Variable(np.zeros(fan_out, dtype), name=f"dense{i}/b")})

    @property
    def trainable_variables(self):
        return [v for layer in self.layers for v in (layer["w"], layer["b"])]


def forward(params, x):
    """Logits and the activations backprop needs; ``params`` = [w0, b0, w1, b1, ...] arrays."""
    xp = array_module(x)
    acts = [x]
    for i in range(0, len(params), 2):
        z = acts[-1] @ params[i] + params[i + 1]
        acts.append(xp.maximum(z, 0) if i + 2 < len(params) else z)
    return acts


def loss_and_grads(params, x, y, global_batch_size=None, loss_scale=1.0):
    """Cross-entropy summed over the rows of ``x`` / the global batch size, the gradients of that
    loss times ``loss_scale``, and the number of correct rows. ``global_batch_size`` defaults to
    ``md.nn.compute_average_loss``'s: this replica's rows times the number of replicas in sync.
    The passes run in ``params``' dtype, the softmax in float32 (at least), as Keras advises for
    mixed precision."""
    xp = array_module(x)
    acts = forward(params, x)
    logits = acts[-1].astype(np.promote_types(acts[-1].dtype, np.float32), copy=False)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    per_example_loss = -log_probs[xp.arange(len(x)), y]
    loss = md.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
    if global_batch_size is None:
        global_batch_size = len(x) * md.get_replica_context().num_replicas_in_sync
    delta = xp.exp(log_probs)
    delta[xp.arange(len(x)), y] -= 1
    delta /= max(global_batch_size, 1)
    delta = (delta * loss_scale).astype(acts[-1].dtype, copy=False)  # d(scaled loss)/d(logits)
    grads = [None] * len(params)
    for i in range(len(params) - 2, -1, -2):
        a = acts[i // 2]
        grads[i], grads[i + 1] = a.T @ delta, delta.sum(axis=0)
        if i:
            delta = (delta @ params[i].T) * (a > 0)
    correct = int((logits.argmax(axis=1) == y).sum())
    return loss, grads, correct


# --- training -------------------------------------------------------------------------------------

def local(var):
    """This replica's copy of a mirrored variable, as an array (inside strategy.run): NumPy or CuPy."""
    value = var.read_value()
    return value if hasattr(value, "__cuda_array_interface__") else np.asarray(value)


def array_module(x):
    """CuPy for GPU arrays, else NumPy: the model code runs unchanged on either."""
    if hasattr(x, "__cuda_array_interface__"):
        import cupy

        return cupy
    return np


def make_strategy(args):
    if args.device == "cpu":
        return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(args.replicas)])
    gpus = md.config.list_physical_devices("GPU")
    if not gpus:
        raise SystemExit("--device gpu: no GPU visible (needs CuPy and a CUDA GPU; see docs/gpu.md)")
    if args.replicas > len(gpus):  # several replicas per GPU: logical GPUs, TensorFlow's way
        for i, gpu in enumerate(gpus):
            count = args.replicas // len(gpus) + (i < args.replicas % len(gpus))
            md.config.set_logical_device_configuration(gpu, [md.config.LogicalDeviceConfiguration()] * count)
    return md.MirroredStrategy(devices=[f"/gpu:{i}" for i in range(args.replicas)])


def train(args):
    strategy = make_strategy(args)
    x_train, y_train, x_test, y_test = load_data(args.dtype, args.seed)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "digits.ckpt")
    steps_per_epoch = len(x_train) // args.batch_size
    run_steps = args.epochs * steps_per_epoch
    total = run_steps if args.steps is None else min(args.steps, run_steps)
    peak = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 0.002)
    # Cosine decay to zero over the whole run (--steps only stops early, so a run cut
    # short and resumed follows the same schedule): any callable of the step will do.
    schedule = lambda step: peak * 0.5 * (1 + np.cos(np.pi * min(step, run_steps) / run_steps))  # noqa: E731

    md.mixed_precision.set_global_policy("mixed_float16" if args.mixed_precision else args.dtype)
    policy = md.mixed_precision.global_policy()
    with strategy.scope():
        model = MLP([x_train.shape[1], *args.hidden, 10], policy.variable_dtype, args.seed)
        optimizer = (md.optimizers.SGD(schedule, momentum=0.9) if args.optimizer == "sgd"
                     else md.optimizers.Adam(schedule))
        if args.mixed_precision:
            optimizer = md.mixed_precision.LossScaleOptimizer(optimizer)
        # Batches taken so far: they place a resumed run in its epoch. optimizer.iterations lags
        # behind by the steps that loss scaling skipped.
        batches_taken = md.Variable(np.int64(0), trainable=False, name="batches_taken")
    variables = model.trainable_variables

    def compute(array):
        """``array`` in the policy's compute dtype (float16 under mixed precision)."""
        return array.astype(policy.compute_dtype, copy=False)

    # The input iterator is checkpointed too: a resumed run continues with the batch that followed the save.
    iterator = iter(strategy.experimental_distribute_dataset(
        train_dataset(x_train, y_train, args.batch_size, args.seed)))
    checkpoint = md.train.Checkpoint(model=model, optimizer=optimizer, batches_taken=batches_taken,
                                     iterator=iterator)
    if args.resume and os.path.exists(ckpt_path):
        checkpoint.read(ckpt_path)  # a file of write(): no save_counter in it

    def step_fn(x, y):
        # 1.0 without mixed precision; else the gradients are those of the loss times the scale
        scale = optimizer.scale_loss(1.0) if args.mixed_precision else 1.0
        # A float16 overflow is expected now and then: the loss-scale optimizer sees it, skips the step
        # and lowers the scale, so NumPy need not warn.
        with np.errstate(over="ignore", invalid="ignore") if args.mixed_precision else contextlib.nullcontext():
            loss, grads, correct = loss_and_grads([compute(local(v)) for v in variables], compute(x), y,
                                                  args.batch_size, scale)
        optimizer.apply_gradients(zip(grads, variables))  # summed across replicas (unscaled, checked)
        # float(): a GPU loss comes back to the host
        return np.asarray(float(loss), dtype=np.float64), np.asarray(correct, dtype=np.int64)

    def eval_fn(x, y):
        return np.asarray(loss_and_grads([compute(local(v)) for v in variables], compute(x), y)[2], dtype=np.int64)

    def evaluate():
        # Uneven last batch on purpose: a replica may get fewer (or zero) rows; SUM of counts is exact.
        batches = md.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)
        correct = sum(int(strategy.reduce("SUM", strategy.run(eval_fn, args=batch), axis=None))
                      for batch in strategy.experimental_distribute_dataset(batches))
        return correct / len(x_test)

    history = {"step": [], "loss": [], "epoch_step": [], "test_accuracy": []}
    step = int(batches_taken.numpy())
    bar = None if args.no_progress else _progress(total, step)
    started = time.perf_counter()
    epoch = step // steps_per_epoch
    while step < total:
        for x, y in itertools.islice(iterator, min(steps_per_epoch - step % steps_per_epoch, total - step)):
            loss, correct = strategy.run(step_fn, args=(x, y))
            loss = float(strategy.reduce("SUM", loss, axis=None))  # each replica's share of the global mean
            accuracy = int(strategy.reduce("SUM", correct, axis=None)) / args.batch_size
            step += 1
            history["step"].append(step)
            history["loss"].append(loss)
            if bar is not None:
                bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", acc=f"{accuracy:.3f}", refresh=False)
                bar.update(1)
        epoch += 1
        history["epoch_step"].append(step)
        history["test_accuracy"].append(evaluate())
        batches_taken.assign(np.int64(step))
        checkpoint.write(ckpt_path)  # every epoch: a stopped run loses at most one epoch (--resume)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - started

    accuracy = evaluate()
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump({**history, "final_test_accuracy": accuracy, "seconds": elapsed,
                   "replicas": args.replicas, "global_batch": args.batch_size}, f)
    plot(history, os.path.join(args.out, "loss_curve.png"), args)
    print(f"{args.replicas} {args.device.upper()} replicas, {step} steps in {elapsed:.1f} s; checkpoint {ckpt_path}; "
          f"plot {os.path.join(args.out, 'loss_curve.png')}")
    print(f"final test accuracy: {accuracy:.4f}")
    return accuracy


def _progress(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                dynamic_ncols=True, mininterval=0.2)


def plot(history, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["loss"], lw=0.8, label="train loss (global batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    handles = ax.get_lines()
    if history["test_accuracy"]:
        acc_ax = ax.twinx()
        handles += acc_ax.plot(history["epoch_step"], history["test_accuracy"], "o-", color="tab:green",
                               ms=3, label="test accuracy")
        acc_ax.set_ylabel("test accuracy")
        acc_ax.set_ylim(0, 1.02)
    ax.legend(handles=handles, loc="center right")
    ax.set_title(f"digits MLP, MirroredStrategy x{args.replicas} {args.device.upper()}, global batch {args.batch_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
