"""Steps per second of ParameterServerStrategy with 1 and 2 workers against a plain loop, and the bytes
each step moves, in one run.

    python bench/parameter_server.py                      # a dense layer 256x64, batch 64, SGD, 1 ps
    python bench/parameter_server.py --features 1024 --outputs 1024 --workers 1 2 --ps 2

The model is one dense layer ``features x outputs`` plus bias and a squared-error loss. Each step is the
forward/backward pass plus ``optimizer.apply_gradients``:

* plain: the step on plain ``md.Variable``\\ s in this process;
* ParameterServerStrategy: the ps and worker tasks are processes of this machine (loopback TCP); this process
  is the coordinator and schedules ``--steps`` steps, each reading the weights from the ps tasks, computing the
  gradients on the worker (its batch from a per-worker dataset) and sending them to the ps tasks, which apply
  them (one request per ps task). Steps/s counts from the first schedule to ``join``, after a warm-up.

Bytes per step: what the ps tasks received and sent (weights out, gradients in) and what the coordinator and
workers exchanged (the scheduled closures and their results), counted by the servers. Every process runs
one BLAS thread (``OPENBLAS_NUM_THREADS=1`` unless set), the plain loop too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# One BLAS thread per process (this one and the tasks, which inherit it), unless set: several processes on a
# few cores otherwise spend the step in OpenBLAS threads spinning against each other (tens of ms per matmul).
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402  (after the thread counts)

import mirrored as md  # noqa: E402
from mirrored.tools.run import free_ports  # noqa: E402

if __name__ == "__main__":  # the tasks import this file as a module: the scheduled functions live there
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Model:
    def __init__(self, features: int, outputs: int):
        rng = np.random.default_rng(0)
        self.w = md.Variable(rng.standard_normal((features, outputs)).astype(np.float32) * 0.01, name="w")
        self.b = md.Variable(np.zeros(outputs, np.float32), name="b")
        self.optimizer = md.optimizers.SGD(0.01)

    def step(self, x, y):
        w = np.asarray(self.w)
        err = x @ w + np.asarray(self.b) - y
        scale = np.float32(2.0 / err.size)
        return self.optimizer.apply_gradients([((x.T @ err) * scale, self.w), (err.sum(axis=0) * scale, self.b)])


def batches(features: int, outputs: int, batch: int):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch * 8, features)).astype(np.float32)
    y = rng.standard_normal((batch * 8, outputs)).astype(np.float32)
    return x, y


def dataset_fn(features: int, outputs: int, batch: int):
    return md.data.Dataset.from_tensor_slices(batches(features, outputs, batch)).batch(batch).repeat()


class DatasetFn:
    """``dataset_fn`` with its arguments (picklable by reference)."""

    def __init__(self, *args):
        self.args = args

    def __call__(self):
        return dataset_fn(*self.args)


def train_step(model, iterator):
    x, y = next(iterator)
    return md.distribute.get_strategy().run(model.step, args=(x, y))


def plain(args) -> float:
    model = Model(args.features, args.outputs)
    it = iter(dataset_fn(args.features, args.outputs, args.batch))
    for _ in range(args.warmup):
        model.step(*next(it))
    start = time.perf_counter()
    for _ in range(args.steps):
        model.step(*next(it))
    return args.steps / (time.perf_counter() - start)


def parameter_server(args, num_workers: int) -> tuple:
    import parameter_server as this  # (this file as a module: the tasks import the same)

    ports = free_ports(1 + num_workers + args.ps)
    spec = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:1 + num_workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[1 + num_workers:]]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(md.__file__)), os.path.dirname(os.path.abspath(__file__))]))
    code = "import sys, json, mirrored as md; md.distribute.Server(json.loads(sys.argv[1]), sys.argv[2], " \
           "int(sys.argv[3])).join()"
    tasks = [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), job, str(i)], env=env)
             for job in ("ps", "worker") for i in range(len(spec[job]))]
    try:
        strategy = md.distribute.ParameterServerStrategy(
            md.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0))
        coordinator = md.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = this.Model(args.features, args.outputs)
        iterator = iter(coordinator.create_per_worker_dataset(this.DatasetFn(args.features, args.outputs,
                                                                             args.batch)))
        for _ in range(args.warmup):
            coordinator.schedule(this.train_step, args=(model, iterator))
        coordinator.join()
        from mirrored.distribute.parameter_server import rpc
        from mirrored.distribute.collective_all_reduce import job_token

        token = job_token(spec)

        def served(job):
            stats = [rpc.pool(address, token).call("stats") for address in spec[job]]
            return sum(s["bytes_received"] + s["bytes_sent"] for s in stats)

        before = served("ps"), served("worker")
        start = time.perf_counter()
        for _ in range(args.steps):
            coordinator.schedule(this.train_step, args=(model, iterator))
        coordinator.join()
        rate = args.steps / (time.perf_counter() - start)
        after = served("ps"), served("worker")
        coordinator._cluster.stop()
        return rate, (after[0] - before[0]) / args.steps, (after[1] - before[1]) / args.steps
    finally:
        for task in tasks:
            task.kill()
            task.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    weights = (args.features + 1) * args.outputs * 4
    print(f"dense {args.features}x{args.outputs} + bias ({weights} bytes of weights), batch {args.batch}, SGD, "
          f"{args.ps} ps, {args.steps} steps")
    base = plain(args)
    print(f"{'setup':<26} {'steps/s':>9} {'x plain':>8} {'ps bytes/step':>14} {'closure bytes/step':>19}")
    print(f"{'plain loop':<26} {base:9.1f} {1.0:8.2f} {'-':>14} {'-':>19}")
    for n in args.workers:
        rate, ps_bytes, closure_bytes = parameter_server(args, n)
        print(f"{f'PSS, {n} worker(s)':<26} {rate:9.1f} {rate / base:8.2f} {ps_bytes:14.0f} {closure_bytes:19.0f}")


if __name__ == "__main__":
    main()
