"""A small linear model and the functions a ParameterServerStrategy test schedules on its workers.

Scheduled functions travel by reference, so they live in a module every task imports: the worker processes of
the multi-process tests have tests/ on their path. ``plain_loop`` trains the same model without a strategy.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

import mirrored as md
from mirrored.distribute.parameter_server import rpc

FEATURES, OUTPUTS = 6, 3


def data(steps: int, batch: int = 8, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, FEATURES)).astype(np.float32),
             rng.standard_normal((batch, OUTPUTS)).astype(np.float32)) for _ in range(steps)]


def requests_of_later_steps(strategy, coordinator, model, batches) -> int:
    """The requests ps task 0 serves while ``model`` trains on ``batches[1:]`` (the first step, which builds
    the optimizer's state, is not counted), plus 1: the stats request that reads the count."""
    ps = rpc.pool(strategy.extended._ps_addresses[0], strategy.extended._token)
    coordinator.schedule(model.train_step, args=batches[0]).fetch()
    before = ps.call("stats")["requests"]
    for batch in batches[1:]:
        coordinator.schedule(model.train_step, args=batch)
    coordinator.join()
    return ps.call("stats")["requests"] - before


def initial():
    rng = np.random.default_rng(42)
    return rng.standard_normal((FEATURES, OUTPUTS)).astype(np.float32), np.zeros(OUTPUTS, np.float32)


def gradients(w, b, x, y):
    """Mean squared error of ``x @ w + b``: its gradients by w and b."""
    err = x @ np.asarray(w) + np.asarray(b) - y
    scale = np.float32(2.0 / err.size)
    return (x.T @ err) * scale, err.sum(axis=0) * scale


def make_optimizer(name: str):
    return md.optimizers.SGD(0.1, momentum=0.5) if name == "sgd" else md.optimizers.Adam(0.01)


class Model:
    """The weights and the optimizer; ``train_step`` is what a worker runs (``strategy.run`` of one replica)."""

    def __init__(self, optimizer: str):
        w, b = initial()
        self.w = md.Variable(w, name="w")
        self.b = md.Variable(b, name="b")
        self.optimizer = make_optimizer(optimizer)

    def train_step(self, x, y):
        def replica(x, y):
            gw, gb = gradients(self.w, self.b, x, y)
            return self.optimizer.apply_gradients([(gw, self.w), (gb, self.b)])
        return md.distribute.get_strategy().run(replica, args=(x, y))


def plain_loop(optimizer: str, batches) -> tuple:
    """The same training without a strategy: the reference weights."""
    model = Model(optimizer)
    for x, y in batches:
        gw, gb = gradients(model.w, model.b, x, y)
        model.optimizer.apply_gradients([(gw, model.w), (gb, model.b)])
    return model.w.numpy(), model.b.numpy()


def constant_step(w, optimizer, c):
    """SGD on ``sum(w * c)``: the gradient is ``c`` whatever ``w`` is, so asynchronous steps add up exactly;
    returns the index of the worker that ran it."""
    md.distribute.get_strategy().run(lambda: optimizer.apply_gradients([(c, w)]))
    return md.distribute.coordinator.experimental_get_current_worker_index()


def next_batch(iterator):
    return md.distribute.coordinator.experimental_get_current_worker_index(), next(iterator)


def range_dataset(n: int = 10, batch: int = 2):
    return md.data.Dataset.range(n).batch(batch)


def small_dataset():
    return range_dataset()


def sharded_by_worker():
    index = md.distribute.coordinator.experimental_get_current_worker_index()
    return md.data.Dataset.range(8).shard(2, index).batch(2)


def context_dataset(input_context):
    return md.data.Dataset.from_tensors(np.array([input_context.num_input_pipelines,
                                                  input_context.input_pipeline_id,
                                                  input_context.num_replicas_in_sync]))


def where_am_i():
    ctx = md.distribute.get_replica_context()
    strategy = md.distribute.get_strategy()
    inside = strategy.run(lambda: (md.distribute.get_replica_context().replica_id_in_sync_group,
                                   md.distribute.get_replica_context().num_replicas_in_sync))
    return (type(strategy).__name__, ctx is None, strategy.num_replicas_in_sync, inside,
            md.distribute.coordinator.experimental_get_current_worker_index())


def fail(message: str):
    raise ValueError(message)


def identity(x):
    return x


@md.function
def step_function(x):
    return x * 2


def apply_one(optimizer, gradient, variable):
    return md.distribute.get_strategy().run(lambda: optimizer.apply_gradients([(gradient, variable)]))


def scatter(v, rows):
    return v.scatter_sub(rows) is v


def read_and_add(v, delta):
    v.assign_add(delta)
    return v.read_value()


def wait_for_release(directory: str):
    """Says which worker started it (a file), then waits for the test's ``release`` file; returns the worker."""
    index = md.distribute.coordinator.experimental_get_current_worker_index()
    open(os.path.join(directory, f"started.{index}"), "w").close()
    release = os.path.join(directory, "release")
    deadline = time.monotonic() + 300
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} did not appear")
        time.sleep(0.01)  # (polls a file another process creates)
    return index


class ScaledModel(Model):
    """The model trained through a dynamic ``LossScaleOptimizer``: the gradients are the scaled loss's (times the
    scale), and ``blow_up`` makes one of them inf (a step the scale halves on and skips)."""

    def __init__(self, optimizer: str, growth_steps: int = 2):
        super().__init__(optimizer)
        self.optimizer = md.mixed_precision.LossScaleOptimizer(self.optimizer, initial_scale=2.0 ** 4,
                                                               dynamic_growth_steps=growth_steps)

    def train_step(self, x, y, blow_up=False):
        def replica(x, y):
            return self.optimizer.apply_gradients(list(zip(scaled_gradients(self, x, y, blow_up),
                                                           [self.w, self.b])))
        return md.distribute.get_strategy().run(replica, args=(x, y))


def scaled_gradients(model, x, y, blow_up: bool) -> list:
    scale = np.float32(model.optimizer.loss_scale)
    gw, gb = gradients(model.w, model.b, x, y)
    gw, gb = gw * scale, gb * scale
    if blow_up:
        gw[0, 0] = np.inf
    return [gw, gb]


def scaled_plain_loop(optimizer: str, batches, blow_ups, growth_steps: int = 2) -> "ScaledModel":
    model = ScaledModel(optimizer, growth_steps)
    for (x, y), blow_up in zip(batches, blow_ups):
        model.optimizer.apply_gradients(list(zip(scaled_gradients(model, x, y, blow_up), [model.w, model.b])))
    return model


RELEASE_HUNG = threading.Event()  # (in-process clusters: the test and its workers share this module)


def hang_worker(index: int):
    """On worker ``index``: the worker stops answering any request (a hung process: alive, its connections
    open) until ``RELEASE_HUNG`` is set. Returns the index of the worker that ran it."""
    from mirrored.distribute.parameter_server.values import serving

    here = md.distribute.coordinator.experimental_get_current_worker_index()
    if here == index:
        listener = serving.server._listener
        answer = listener._handle

        def hung(method, args):
            RELEASE_HUNG.wait()
            return answer(method, args)

        listener._handle = hung
        RELEASE_HUNG.wait()
    return here


# --- a worker's replicas (one per GPU): each computes its share of the batch's gradients on its device ---

def batch_dataset(batches):
    """The batches as one dataset of (x, y), in order (a worker's replicas split each batch, TF's rule)."""
    x = np.concatenate([b[0] for b in batches])
    return md.data.Dataset.from_tensor_slices((x, np.concatenate([b[1] for b in batches]))).batch(len(batches[0][0]))


def replica_gradients(w, b, x, y, global_rows: int):
    """A replica's share of the mean squared error's gradients over the whole batch (``global_rows`` rows): the
    replicas' shares sum to ``gradients``' result. Operators only, so that x, y, w and b may be NumPy arrays or
    one GPU's CuPy arrays (a GPU replica reads the variables into its GPU, its batch is there)."""
    err = x @ w + b - y
    scale = np.float32(2.0 / (global_rows * OUTPUTS))
    return (x.T @ err) * scale, err.sum(axis=0) * scale


class ReplicatedModel(Model):
    """``train_step`` of a worker's replicas: each reads the weights (onto its device) and computes its share of
    the gradients; ``apply_gradients`` sums the shares on the worker and updates the ps tasks once."""

    def train_step(self, iterator, global_rows: int):
        def replica(x, y):
            gw, gb = replica_gradients(self.w.read_value(), self.b.read_value(), x, y, global_rows)
            step = self.optimizer.apply_gradients([(gw, self.w), (gb, self.b)])
            on_gpu = hasattr(gw, "__cuda_array_interface__")
            return step, on_gpu, md.distribute.get_replica_context().num_replicas_in_sync

        strategy = md.distribute.get_strategy()
        return strategy.run(replica, args=next(iterator))


def replicated_plain_loop(optimizer: str, batches, replicas: int) -> tuple:
    """The reference of ``ReplicatedModel`` without a strategy: each batch split into ``replicas`` equal parts,
    their gradients summed in replica order, applied by the plain optimizer."""
    model = Model(optimizer)
    for x, y in batches:
        rows = len(x) // replicas
        shares = [replica_gradients(model.w.numpy(), model.b.numpy(), x[r * rows:(r + 1) * rows],
                                    y[r * rows:(r + 1) * rows], len(x)) for r in range(replicas)]
        gw, gb = shares[0]
        for sw, sb in shares[1:]:
            gw, gb = gw + sw, gb + sb
        model.optimizer.apply_gradients([(gw, model.w), (gb, model.b)])
    return model.w.numpy(), model.b.numpy()


def replicas_assign(v, delta):
    """Each replica adds ``delta * (its id + 1)`` to ``v`` (an aggregating update) and reads it back."""
    def replica():
        r = md.distribute.get_replica_context().replica_id_in_sync_group
        v.assign_add(delta * np.float32(r + 1))
        return hasattr(v.read_value(), "__cuda_array_interface__")
    return md.distribute.get_strategy().run(replica)


class ReplicatedScaledModel(ScaledModel):
    """``ReplicatedModel``'s step through a dynamic ``LossScaleOptimizer``: each replica scales its share of the
    gradients; ``blow_up`` makes replica 0's first one inf (the step the scale halves on and skips)."""

    def train_step(self, iterator, global_rows: int, blow_up: bool = False):
        def replica(x, y):
            scale = np.float32(self.optimizer.loss_scale)
            gw, gb = replica_gradients(self.w.read_value(), self.b.read_value(), x, y, global_rows)
            gw, gb = gw * scale, gb * scale
            if blow_up and md.distribute.get_replica_context().replica_id_in_sync_group == 0:
                gw[0, 0] = np.inf
            return self.optimizer.apply_gradients([(gw, self.w), (gb, self.b)])

        return md.distribute.get_strategy().run(replica, args=next(iterator))


def replicated_scaled_plain_loop(optimizer: str, batches, blow_ups, replicas: int) -> "ScaledModel":
    """``ReplicatedScaledModel``'s reference without a strategy: the replicas' scaled shares summed in order."""
    model = ScaledModel(optimizer)
    for (x, y), blow_up in zip(batches, blow_ups):
        scale = np.float32(model.optimizer.loss_scale)
        rows = len(x) // replicas
        shares = [[g * scale for g in replica_gradients(model.w.numpy(), model.b.numpy(), x[r * rows:(r + 1) * rows],
                                                         y[r * rows:(r + 1) * rows], len(x))]
                  for r in range(replicas)]
        if blow_up:
            shares[0][0][0, 0] = np.inf
        gw, gb = shares[0]
        for sw, sb in shares[1:]:
            gw, gb = gw + sw, gb + sb
        model.optimizer.apply_gradients([(gw, model.w), (gb, model.b)])
    return model


def replicas_scatter_and_gather(v):
    """Each replica sets row 0 of ``v`` to 5 from an array on its device (a scatter) and gathers rows back;
    returns whether the gathered rows were on the replica's GPU."""
    def replica():
        row = v.sparse_read(np.array([1])) * 0 + 5  # (on the replica's device)
        v.scatter_update(md.IndexedSlices(row, np.array([0])))
        return hasattr(v.sparse_read(np.array([0, 1])), "__cuda_array_interface__")
    return md.distribute.get_strategy().run(replica)
