"""Asynchronous training with ParameterServerStrategy: variables on a ps task, steps on two workers.

The same program runs on every task (TF's model). Run as it is, it plays the chief (the coordinator) and
starts the ps and worker tasks itself on this machine, each this script with its own ``TF_CONFIG``; on a
real cluster, start it on every task with ``TF_CONFIG`` set, and the ps and worker tasks serve until killed.

    PYTHONPATH=python python3 examples/train_parameter_server.py --steps 200
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

import mirrored as md

FEATURES = 8
TRUE_W = np.linspace(-1.0, 1.0, FEATURES).astype(np.float32)


# What the workers run must be defined before a worker task reaches server.join() below: functions travel by
# reference (this module's name and the function's).
def dataset_fn():
    """Each worker's own endless stream of batches (seeded by its index: different data per worker)."""
    rng = np.random.default_rng(md.distribute.coordinator.experimental_get_current_worker_index())
    x = rng.standard_normal((1024, FEATURES)).astype(np.float32)
    y = x @ TRUE_W + np.float32(0.5)
    return md.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=0).batch(32).repeat()


class LinearModel:
    def __init__(self):
        self.w = md.Variable(np.zeros(FEATURES, np.float32), name="w")
        self.b = md.Variable(np.float32(0), name="b")
        self.optimizer = md.optimizers.SGD(0.05)

    def train_step(self, iterator):
        def replica(x, y):
            err = x @ np.asarray(self.w) + np.asarray(self.b) - y
            loss = float(np.mean(err ** 2))
            scale = np.float32(2.0 / err.size)
            self.optimizer.apply_gradients([((x.T @ err) * scale, self.w), (err.sum() * scale, self.b)])
            return loss
        return md.distribute.get_strategy().run(replica, args=next(iterator))


def start_local_cluster(num_workers: int) -> tuple:
    """This script as a ps task and ``num_workers`` worker tasks on loopback ports; the chief's cluster spec."""
    from mirrored.tools.run import free_ports

    ports = free_ports(2 + num_workers)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
               "worker": [f"127.0.0.1:{p}" for p in ports[2:]]}
    tasks = [subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                              env=dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster,
                                                                         "task": {"type": job, "index": i}})))
             for job in ("ps", "worker") for i in range(len(cluster[job]))]
    return cluster, tasks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    tasks = []
    if "TF_CONFIG" in os.environ:
        resolver = md.distribute.cluster_resolver.TFConfigClusterResolver()
    else:
        cluster, tasks = start_local_cluster(args.workers)
        resolver = md.distribute.cluster_resolver.SimpleClusterResolver(cluster, task_type="chief", task_id=0)
    if resolver.task_type in ("ps", "worker"):
        md.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                             task_index=resolver.task_id).join()
        return
    try:
        strategy = md.distribute.ParameterServerStrategy(resolver)
        coordinator = md.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = LinearModel()
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        losses = [coordinator.schedule(model.train_step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        losses = [loss.fetch() for loss in losses]
        print(f"loss: first 10 steps {np.mean(losses[:10]):.4f}, last 10 steps {np.mean(losses[-10:]):.4f}")
        print("w:", np.round(model.w.numpy(), 3), "(true:", np.round(TRUE_W, 3), ")  b:", round(float(model.b), 3))
    finally:
        for task in tasks:
            task.kill()
            task.wait()


if __name__ == "__main__":
    main()
