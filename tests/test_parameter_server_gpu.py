"""ParameterServerStrategy with workers that have GPUs (TF's in-graph replication): a scheduled function runs
one replica per logical GPU of the worker, as MirroredStrategy runs them; the replicas read the ps variables onto
their GPUs and an optimizer's update sums their gradients on the worker (one batched all-reduce) and sends it to
each ps task once. On the simulated CUDA machine (docs/gpu_simulator.md): one GPU, two logical GPUs of one GPU,
two GPUs; weights equal to the NumPy reference and to the CPU worker's run, requests per step unchanged."""

import contextlib

import numpy as np
import pytest

from gpu_env import physical_gpus

import mirrored as md
from mirrored.distribute.values import PerReplica

import ps_model
from test_parameter_server_strategy import Coordinator, in_process_cluster, partitioners

LAYOUTS = {"one-gpu": (1, 1), "two-logical-gpus": (1, 2), "two-gpus": (2, 1)}  # GPUs, logical GPUs on each


@contextlib.contextmanager
def worker_gpus(layout: str):
    """The machine the in-process workers see: ``layout``'s GPUs (LAYOUTS); yields the replica count."""
    gpus, logical = LAYOUTS[layout]
    with physical_gpus(gpus):
        if logical > 1:
            md.config.set_logical_device_configuration("GPU", 0, count=logical)
        try:
            yield gpus * logical
        finally:
            md.config.set_logical_device_configuration("GPU:0", None)


def train(strategy, model, batches) -> list:
    """``model`` trained on ``batches`` by the workers; the values of the scheduled steps."""
    coordinator = Coordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(
        strategy.experimental_distribute_dataset(ps_model.batch_dataset(batches))))
    values = [coordinator.schedule(model.train_step, args=(iterator, len(batches[0][0]))) for _ in batches]
    coordinator.join()
    return coordinator.fetch(values)


@pytest.mark.gpu
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replicas_on_the_workers_gpus_train_as_the_numpy_reference(layout, optimizer, sharded):
    batches = ps_model.data(4, batch=8)
    partitioner = partitioners.FixedShardsPartitioner(2) if sharded else None
    with worker_gpus(layout) as replicas, \
            in_process_cluster(num_workers=1, num_ps=2, variable_partitioner=partitioner) as strategy:
        with strategy.scope():
            model = ps_model.ReplicatedModel(optimizer)
        assert strategy.num_replicas_in_sync == replicas  # (TF's: the GPUs of a worker, asked of the workers)
        assert strategy.extended.worker_devices == tuple(f"/device:GPU:{i}" for i in range(replicas))
        results = train(strategy, model, batches)
        w, b = ps_model.replicated_plain_loop(optimizer, batches, replicas)
        np.testing.assert_allclose(model.w.numpy(), w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(model.b.numpy(), b, rtol=1e-6, atol=1e-7)
        # one update per step (not one per replica): the step count is the number of steps
        assert int(model.optimizer.iterations.numpy()) == len(batches)
        for step, result in enumerate(results, 1):
            # (equal values of every replica come back as one, MirroredStrategy's regrouping)
            parts = result.values if isinstance(result, PerReplica) else (result,) * replicas
            assert [tuple(p) for p in parts] == [(step, True, replicas)] * replicas


REQUESTS_PER_LATER_STEP = 3  # (reads of w and b, one update: ps task 0 of one)


def test_a_cpu_worker_runs_one_replica_as_the_reference_with_as_many_requests():
    batches = ps_model.data(5, batch=8)
    with in_process_cluster(num_workers=1) as strategy:  # (a CPU test: the workers see no GPU)
        with strategy.scope():
            model = ps_model.ReplicatedModel("sgd")
        assert strategy.num_replicas_in_sync == 1 and strategy.extended.worker_devices == ("/device:CPU:0",)
        assert requests_per_later_step(strategy, model, batches) == REQUESTS_PER_LATER_STEP * (len(batches) - 1) + 1
        w, b = ps_model.replicated_plain_loop("sgd", batches, 1)
        np.testing.assert_array_equal(model.w.numpy(), w)
        np.testing.assert_array_equal(model.b.numpy(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["one-gpu", "two-logical-gpus"])
def test_gpu_replicas_equal_the_cpu_replica_and_send_as_many_requests(layout):
    batches = ps_model.data(5, batch=8)
    with worker_gpus(layout) as replicas, in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            model = ps_model.ReplicatedModel("sgd")
        # the replicas share one read of each variable per step, and send one update
        assert requests_per_later_step(strategy, model, batches) == REQUESTS_PER_LATER_STEP * (len(batches) - 1) + 1
        w, b = ps_model.replicated_plain_loop("sgd", batches, replicas)
        np.testing.assert_allclose(model.w.numpy(), w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(model.b.numpy(), b, rtol=1e-6, atol=1e-7)
        cpu_w, cpu_b = ps_model.replicated_plain_loop("sgd", batches, 1)  # (the CPU worker's weights, above)
        np.testing.assert_allclose(model.w.numpy(), cpu_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(model.b.numpy(), cpu_b, rtol=1e-5, atol=1e-6)


def requests_per_later_step(strategy, model, batches) -> int:
    """ps task 0's requests over the steps after the first (2 reads, 1 update each), plus the stats request."""
    from mirrored.distribute.parameter_server import rpc

    coordinator = Coordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(
        strategy.experimental_distribute_dataset(ps_model.batch_dataset(batches))))
    coordinator.schedule(model.train_step, args=(iterator, len(batches[0][0]))).fetch()
    ps = rpc.pool(strategy.extended._ps_addresses[0], strategy.extended._token)
    before = ps.call("stats")["requests"]
    for _ in batches[1:]:
        coordinator.schedule(model.train_step, args=(iterator, len(batches[0][0])))
    coordinator.join()
    return ps.call("stats")["requests"] - before


@pytest.mark.gpu
@pytest.mark.parametrize("aggregation, expected", [("SUM", 3.0), ("MEAN", 1.5), ("ONLY_FIRST_REPLICA", 1.0)])
def test_an_assign_in_the_replicas_is_aggregated_and_sent_once(aggregation, expected):
    with worker_gpus("two-logical-gpus"), in_process_cluster(num_workers=1) as strategy:
        with strategy.scope():
            v = md.Variable(np.zeros(2, np.float32), name="v",
                            aggregation=getattr(md.VariableAggregation, aggregation))
            plain = md.Variable(np.zeros(2, np.float32), name="plain")
        coordinator = Coordinator(strategy)
        on_gpu = coordinator.schedule(ps_model.replicas_assign, args=(v, np.ones(2, np.float32))).fetch()
        assert on_gpu is True  # (each replica read it onto its GPU; equal values come back as one)
        np.testing.assert_array_equal(v.numpy(), np.full(2, expected, np.float32))
        with pytest.raises(ValueError, match="aggregation"):  # (NONE: TF's refusal in replica context)
            coordinator.schedule(ps_model.replicas_assign, args=(plain, np.ones(2, np.float32))).fetch()


@pytest.mark.gpu
def test_a_loss_scaled_step_sums_the_replicas_then_scales_on_the_ps_as_the_reference():
    batches = ps_model.data(6, batch=8)
    blow_ups = [False, False, True, False, False, False]
    with worker_gpus("two-logical-gpus") as replicas, in_process_cluster(num_workers=1, num_ps=2) as strategy:
        with strategy.scope():
            model = ps_model.ReplicatedScaledModel("adam")
        coordinator = Coordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(
            strategy.experimental_distribute_dataset(ps_model.batch_dataset(batches))))
        for blow_up in blow_ups:
            coordinator.schedule(model.train_step, args=(iterator, len(batches[0][0]), blow_up))
        coordinator.join()
        reference = ps_model.replicated_scaled_plain_loop("adam", batches, blow_ups, replicas)
        np.testing.assert_allclose(model.w.numpy(), reference.w.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(model.b.numpy(), reference.b.numpy(), rtol=1e-6, atol=1e-7)
        assert float(model.optimizer.loss_scale) == float(reference.optimizer.loss_scale)
        assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_gradients_of_the_replicas_are_summed_by_their_rows(optimizer):
    value = np.random.default_rng(5).standard_normal((11, 3)).astype(np.float32)
    steps = [md.IndexedSlices(np.full((3, 3), 0.5 * k, np.float32), np.array([10, k, 10])) for k in range(4)]
    plain = md.Variable(value, name="table")
    reference = ps_model.make_optimizer(optimizer)
    for g in steps:  # (both replicas pass g: their sum is g's rows twice)
        twice = md.IndexedSlices(np.concatenate([g.values, g.values]), np.concatenate([g.indices, g.indices]))
        reference.apply_gradients([(twice, plain)])
    with worker_gpus("two-logical-gpus"), in_process_cluster(
            num_workers=1, num_ps=2, variable_partitioner=partitioners.FixedShardsPartitioner(3)) as strategy:
        coordinator = Coordinator(strategy)
        with strategy.scope():
            table = md.Variable(value, name="table")
            trained = ps_model.make_optimizer(optimizer)
        for g in steps:
            coordinator.schedule(ps_model.apply_one, args=(trained, g, table))
        coordinator.join()
        np.testing.assert_array_equal(table.numpy(), plain.numpy())
        assert int(trained.iterations.numpy()) == len(steps)


@pytest.mark.gpu
@pytest.mark.parametrize("sharded", [False, True])
def test_gpu_replicas_scatter_and_gather_rows_of_the_ps_variables(sharded):
    value = np.arange(12, dtype=np.float32).reshape(4, 3)
    partitioner = partitioners.FixedShardsPartitioner(2) if sharded else None
    with worker_gpus("two-logical-gpus"), in_process_cluster(num_workers=1, num_ps=2,
                                                             variable_partitioner=partitioner) as strategy:
        with strategy.scope():
            v = md.Variable(value, name="rows")
        on_gpu = Coordinator(strategy).schedule(ps_model.replicas_scatter_and_gather, args=(v,)).fetch()
        assert on_gpu is True
        expected = value.copy()
        expected[0] = 5
        np.testing.assert_array_equal(v.numpy(), expected)


def test_workers_with_different_gpu_counts_are_refused_as_tf():
    with in_process_cluster(num_workers=2) as strategy:
        listener = strategy.test_servers[("worker", 1)]._listener
        answer = listener._handle
        listener._handle = lambda method, args: 2 if method == "num_gpus" else answer(method, args)
        with pytest.raises(ValueError, match="Mismatched number of GPUs per worker.*same number of GPUs"):
            strategy.num_replicas_in_sync
        with pytest.raises(ValueError, match="Mismatched number of GPUs per worker"):
            strategy.extended.worker_devices
