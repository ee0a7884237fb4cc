"""PyTorch computes the gradients, `mirrored` sums them across replicas and updates the replicas.

    pip install torch    # a CPU wheel is enough
    python examples/dlpack_torch.py

Each replica wraps its own copy of the weights as a torch tensor with
``torch.from_dlpack`` (no copy: the tensor and the replica's NumPy buffer are
the same memory), lets autograd compute the gradient of a least-squares loss
on its slice of the batch (summed, divided by the GLOBAL batch size, as
TensorFlow's ``compute_average_loss`` does), and hands the torch gradient straight to
``optimizer.apply_gradients``: the strategy reads torch tensors through
DLPack, so nothing is converted by hand. ``strategy.reduce`` takes the
replicas' torch losses the same way, and the summed result converts back to
torch without a copy either.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import mirrored as md


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)

    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(8, 1)).astype(np.float32)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = x @ true_w + 0.01 * rng.normal(size=(256, 1)).astype(np.float32)

    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(args.replicas)])
    with strategy.scope():
        w = md.Variable(np.zeros((8, 1), np.float32), name="w")
        optimizer = md.optimizers.SGD(0.1, momentum=0.9)

    def step(xb, yb):
        # This replica's copy of w as a torch leaf tensor sharing its memory.
        w_t = torch.from_dlpack(np.asarray(w.read_value())).requires_grad_()
        per_example = ((torch.from_dlpack(xb) @ w_t - torch.from_dlpack(yb)) ** 2).sum(dim=1)
        loss = per_example.sum() / global_batch  # the optimizer sums the replicas' gradients
        loss.backward()
        optimizer.apply_gradients([(w_t.grad, w)])  # a torch tensor, read through DLPack
        return loss.detach()

    global_batch = 64
    batches = md.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    for epoch in range(args.steps // len(batches)):
        for xb, yb in strategy.experimental_distribute_dataset(batches):
            losses = strategy.run(step, args=(xb, yb))
        loss = torch.from_dlpack(strategy.reduce("SUM", losses, axis=None))
        if epoch % 10 == 0:
            print(f"epoch {epoch:3d}  loss {loss.item():.6f}")
    error = float(np.abs(w.numpy() - true_w).max())
    print(f"max |w - true_w| = {error:.4f}")
    return error


if __name__ == "__main__":
    main()
