"""MultiWorkerMirroredStrategy across worker processes on 127.0.0.1, against single-process MirroredStrategy."""

import sys
import time

import numpy as np
import pytest

from multiworker_launch import kill_self, launch
from multiworker_marks import needs_gloo

import mirrored as md
from mirrored.cluster_resolver import SimpleClusterResolver
from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

pytestmark = pytest.mark.multiworker

GLOBAL_BATCH = 8


def batches(steps=6):
    rng = np.random.default_rng(7)
    true_w = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)
        out.append((x, x @ true_w))
    return out


def train(strategy, seed, steps=6):
    """Linear regression: replica-context all_reduce of gradients, MEAN-aggregated variable updates."""
    with strategy.scope():
        # Each process draws a different initial value; the strategy must start every worker from the chief's.
        w = md.Variable(np.random.default_rng(seed).normal(size=(4, 1)).astype(np.float32), name="w",
                        aggregation=md.VariableAggregation.MEAN)

    def step(x, y):
        ctx = md.get_replica_context()
        grad = 2 * x.T @ (x @ w.read_value() - y) / GLOBAL_BATCH
        w.assign_sub(0.1 * ctx.all_reduce("sum", grad))
        return ((x @ w.read_value() - y) ** 2).sum()

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches(steps)):
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(x, y)), axis=None)))
    return w.numpy(), losses


# Generous: the timeout also bounds start-up, which a loaded machine can stretch to many seconds.
def _strategy(local_replicas, timeout=60.0):
    return MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=timeout),
                                       devices=[f"/cpu:{i}" for i in range(local_replicas)])


# --- task functions --------------------------------------------------------------------------


def train_task(local_replicas):
    strategy = _strategy(local_replicas)
    rank = strategy.extended._worker_index
    return train(strategy, seed=rank)


def api_task(local_replicas):
    s = _strategy(local_replicas)
    ext = s.extended
    me = ext._worker_index
    out = {"num_replicas": s.num_replicas_in_sync, "worker": me, "chief": ext.should_checkpoint,
           "resolver": (s.cluster_resolver.task_type, s.cluster_resolver.task_id)}
    ids = s.run(lambda: np.array([md.get_replica_context().replica_id_in_sync_group], np.float32))
    out["worker_devices"] = list(ext.worker_devices)
    out["local_ids"] = [float(v[0]) for v in s.experimental_local_results(ids)]
    out["sum"] = s.reduce("SUM", ids, axis=None)
    out["mean_axis"] = s.reduce("MEAN", s.run(lambda: np.ones((md.get_replica_context().replica_id_in_sync_group + 1,
                                                                2))), axis=0)
    out["gather"] = s.gather(ids, axis=0)
    out["all_gather"] = s.experimental_local_results(
        s.run(lambda: md.get_replica_context().all_gather(np.full((1, 2), md.get_replica_context()
                                                                   .replica_id_in_sync_group), axis=0)))[0]
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return [np.full((2, 1), ctx.input_pipeline_id, np.float32)] * 2  # one batch per local replica

    first = next(iter(s.distribute_datasets_from_function(dataset_fn)))
    out["pipelines"] = contexts
    out["from_function"] = [float(v[0, 0]) for v in s.experimental_local_results(first)]
    shard = next(iter(s.experimental_distribute_dataset([np.arange(12, dtype=np.float32)[:, None]])))
    out["shard"] = [v[:, 0].tolist() for v in s.experimental_local_results(shard)]
    return out


def train_until_a_peer_dies(victim, timeout):
    strategy = _strategy(1, timeout=timeout)
    with strategy.scope():
        w = md.Variable(np.zeros(1000, np.float32), aggregation=md.VariableAggregation.MEAN)
    last_ok = time.time()
    for step in range(50):
        if strategy.extended._worker_index == victim and step == 3:
            kill_self()
        try:
            strategy.run(lambda: w.assign_add(np.ones(1000, np.float32)))
        except ConnectionError as e:
            raise type(e)(f"{time.time() - last_ok:.2f}s {e}") from None
        last_ok = time.time()
        time.sleep(0.02)
    raise AssertionError("training survived the death of a peer")  # pragma: no cover


# --- tests -----------------------------------------------------------------------------------


@needs_gloo
@pytest.mark.parametrize("num_workers, local_replicas", [(2, 2), (3, 1)])
def test_training_equals_single_process_mirrored_strategy(num_workers, local_replicas):
    results = launch(train_task, num_workers - 1, chief=True, kwargs={"local_replicas": local_replicas})
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-3000:])
    n = num_workers * local_replicas
    want_w, want_losses = train(md.MirroredStrategy([f"/cpu:{i}" for i in range(n)]), seed=0)
    for r in results:
        w, losses = r.value
        np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6, err_msg=r.task)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=r.task)
    assert want_losses[-1] < want_losses[0] / 4  # and it did learn


@needs_gloo
def test_strategy_api_spans_the_job():
    results = launch(api_task, 1, chief=True, kwargs={"local_replicas": 2})
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-3000:])
    chief, worker = (r.value for r in results)
    assert chief["resolver"] == ("chief", 0) and worker["resolver"] == ("worker", 0)
    assert (chief["chief"], worker["chief"]) == (True, False)
    # Devices are named by task, as TensorFlow names them across a job.
    for v, (job, task) in ((chief, ("chief", 0)), (worker, ("worker", 0))):
        want = [f"/job:{job}/replica:0/task:{task}/device:CPU:{i}" for i in range(2)]
        assert v["worker_devices"] == want
    for me, v in enumerate((chief, worker)):
        assert v["num_replicas"] == 4 and v["worker"] == me
        assert v["local_ids"] == [2 * me, 2 * me + 1]
        np.testing.assert_array_equal(v["sum"], [6.0])
        # MEAN along axis 0 divides by every row of every replica: (1+2+3+4) rows of ones.
        np.testing.assert_array_equal(v["mean_axis"], [1.0, 1.0])
        np.testing.assert_array_equal(v["gather"], [0, 1, 2, 3])
        np.testing.assert_array_equal(v["all_gather"], [[0, 0], [1, 1], [2, 2], [3, 3]])
        assert v["pipelines"] == [(2, me, 4)]
        assert v["from_function"] == [me, me]
        # 12 rows over 4 replicas: 3 each; TF's DATA sharding keeps every other per-replica batch from the
        # worker's index on: worker 1 keeps rows 3..5 and 9..11.
        assert v["shard"] == [list(range(3 * me, 3 * me + 3)), list(range(3 * me + 6, 3 * me + 9))]


@needs_gloo
def test_a_worker_killed_mid_training_is_named_within_the_timeout():
    # The timeout bounds start-up too: long enough for three tasks to start on a loaded machine (at 3 s a
    # slow task failed the job's start-up). A death is seen at once, through its sockets, not after it.
    timeout = 10.0
    results = launch(train_until_a_peer_dies, 2, chief=True, kwargs={"victim": 1, "timeout": timeout}, timeout=60)
    assert results[1].returncode == -9
    for r in (results[0], results[2]):
        assert r.error == "PeerLostError", (r.task, r.error, r.message, r.stderr[-2000:])
        assert "worker:0" in r.message, r.message
        assert float(r.message.split("s ", 1)[0]) < timeout + 5


def test_one_worker_without_tf_config_needs_no_network(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    s = MultiWorkerMirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    assert s.num_replicas_in_sync == 2 and s.extended._num_workers == 1
    ids = s.run(lambda: np.array(md.get_replica_context().replica_id_in_sync_group, np.float64))
    assert s.reduce("SUM", ids, axis=None) == 1.0
    assert s.extended.should_checkpoint and s.extended.experimental_between_graph


def test_tf_2_0_communication_argument():
    s = MultiWorkerMirroredStrategy(communication=md.CollectiveCommunication.RING,
                                    cluster_resolver=SimpleClusterResolver({}))
    assert s.extended._options.implementation is md.CommunicationImplementation.RING
    # tf.distribute.experimental's order: (communication, cluster_resolver)
    s = md.experimental.MultiWorkerMirroredStrategy(md.CollectiveCommunication.RING, SimpleClusterResolver({}))
    assert s.extended._options.implementation is md.CommunicationImplementation.RING
    assert isinstance(s, md.MultiWorkerMirroredStrategy)
    s = MultiWorkerMirroredStrategy(md.CollectiveCommunication.AUTO)  # TF 2.0's positional form, by its type
    assert s.extended._options.implementation is md.CommunicationImplementation.AUTO
    with pytest.raises(ValueError, match="not both"):
        MultiWorkerMirroredStrategy(md.CommunicationOptions(), communication=md.CollectiveCommunication.RING)


@pytest.mark.parametrize("kwargs, message", [
    ({"communication_options": md.CommunicationOptions(implementation="NCCL")}, "NCCL needs GPU replicas"),
    ({"communication_options": 5}, "expected md.CommunicationOptions"),
    ({"cluster_resolver": SimpleClusterResolver({"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
                                                task_type="ps", task_id=0)}, "ps:0 does not take part"),
    ({"cluster_resolver": SimpleClusterResolver({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})}, "has no task"),
])
def test_bad_configurations_raise_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiWorkerMirroredStrategy(**kwargs)


def test_missing_gloo_names_the_package(monkeypatch):
    # As if the extension had not been built: neither imported nor importable.
    monkeypatch.delattr(md, "_net", raising=False)
    monkeypatch.setitem(sys.modules, "mirrored._net", None)
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, task_type="worker", task_id=1)
    with pytest.raises(RuntimeError, match="apt-get install libgloo-dev"):
        MultiWorkerMirroredStrategy(cluster_resolver=resolver)
