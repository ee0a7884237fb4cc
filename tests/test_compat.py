"""compat.v1 and compat.contrib: the TF 1.x names doing what TF's docs say."""

import copy
import inspect

import numpy as np
import pytest

import mirrored as md
from mirrored.compat import contrib, v1
from conftest import cpus


def test_v1_iterators_and_experimental_run():
    s = v1.MirroredStrategy(cpus(2))
    it = s.make_dataset_iterator([np.arange(4.0), np.arange(4.0, 8.0)])
    assert it.initialize() == []
    out = s.experimental_run(lambda x: x.sum(), it)
    assert s.reduce("SUM", out, axis=None) == 6
    out = s.experimental_run(lambda x: x.sum(), it)
    assert s.reduce("SUM", out, axis=None) == 22
    it.initialize()  # starts over
    assert s.experimental_local_results(it.get_next())[0].tolist() == [0, 1]
    assert s.experimental_run(lambda: 3) == 3


def test_v1_input_fn_iterator_and_numpy_dataset():
    s = v1.MirroredStrategy(cpus(2))
    it = s.make_input_fn_iterator(lambda ctx: [np.full((2,), ctx.num_replicas_in_sync * 10 + i) for i in range(4)])
    it.initialize()
    assert [v.tolist() for v in it.get_next().values] == [[20, 20], [21, 21]]
    data = s.experimental_make_numpy_dataset((np.arange(5), np.arange(5) * 2))
    assert [tuple(b[0].tolist()) for b in data.batch(2)] == [(0, 1), (2, 3), (4,)]
    assert len(list(data.batch(2, drop_remainder=True).repeat(2))) == 4
    per_replica = next(iter(s.experimental_distribute_dataset(data.batch(4))))
    assert [v.tolist() for v in per_replica[1].values] == [[0, 2], [4, 6]]
    config = {"allow_soft_placement": True}
    updated = s.update_config_proto(config)
    assert updated == config and updated is not config
    assert md.compat.v1.get_replica_context is md.get_replica_context


def test_contrib_towers():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert s.num_towers == 2 and s.worker_devices == s.parameter_devices
    # Each tower gets its own int (TF 1.11: a per-device value).
    assert s.call_for_each_tower(lambda i: i * 10, s.worker_device_index).values == (0, 10)
    assert contrib.MirroredStrategy(["/cpu:0"]).worker_device_index == 0

    def tower_fn(x):
        ctx = contrib.get_tower_context()
        assert ctx.device == s.worker_devices[ctx.tower_id]
        return ctx.tower_id * x + ctx.merge_call(lambda strategy, v: strategy.num_replicas_in_sync, x)
    out = s.call_for_each_tower(tower_fn, 10)
    assert s.unwrap(out) == [2, 12]
    assert s.unwrap(5) == [5]
    assert contrib.get_tower_context() is not None  # default context outside
    with s.scope():
        assert contrib.get_tower_context() is None and contrib.get_cross_tower_context() is s


def test_contrib_reduce_batch_reduce_broadcast_update():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_tower_ops=md.cross_device_ops.ReductionToOneDevice())
    pr = s.call_for_each_tower(lambda: np.float32(contrib.get_tower_context().tower_id + 1))
    summed = s.reduce(md.VariableAggregation.SUM, pr)  # default destinations: every tower's device
    assert [float(v) for v in s.unwrap(summed)] == [3.0, 3.0]
    assert float(s.reduce(md.VariableAggregation.MEAN, pr, "/cpu:0")) == 1.5
    (r,) = s.batch_reduce(md.VariableAggregation.SUM, [(pr, "/cpu:1")])
    assert float(r) == 3.0
    assert len(s.unwrap(s.broadcast(np.ones(2)))) == 2
    with s.scope():
        v = md.Variable(1.0)
    s.update(v, lambda var, x: var.assign_add(x), 2.0)
    assert float(s.read_var(v)) == 3.0
    with s.colocate_vars_with(v):
        pass
    assert s.group(pr) is None
    ups = s.update_non_slot(v, lambda: md.device_util.current())
    assert ups.values == tuple(s.worker_devices)


def test_contrib_map_dataset_and_steps():
    s = contrib.MirroredStrategy(num_gpus=0)
    assert s.num_towers == 1
    s2 = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    mapped = s2.map([1, 2, 3], lambda x, k: x * k, 10)
    assert mapped.values == ([10, 30], [20])
    ds = s2.distribute_dataset(lambda: [np.full((2,), i) for i in range(4)])
    it = ds.make_one_shot_iterator()
    assert [v.tolist() for v in it.get_next().values] == [[0, 0], [1, 1]]

    # TF 1.11: fn(ctx, *inputs) runs once per step in cross-tower context and calls call_for_each_tower.
    def step(ctx, inputs):
        assert contrib.get_cross_tower_context() is s2
        def tower(x):
            ctx.set_last_step_output("loss", x.sum(), aggregation=md.VariableAggregation.SUM)
            ctx.set_non_tensor_output("tower", contrib.get_tower_context().tower_id)
            return x.sum()
        return s2.call_for_each_tower(tower, inputs)
    it = ds.make_initializable_iterator()
    it.initialize()
    ctx = s2.run_steps_on_dataset(step, it, iterations=2)
    assert float(ctx.last_step_outputs["loss"]) == (2 + 3) * 2
    assert ctx.non_tensor_outputs == {"tower": [0, 1]}
    assert [int(v) for v in ctx.run_op.values] == [4, 6]
    assert s2.initialize() is None and s2.finalize() is None
    s2.configure(session_config={"x": 1})
    with pytest.raises(ValueError, match="MultiWorkerMirroredStrategy"):
        s2.configure(cluster_spec={"worker": ["a:1"]})
    with pytest.raises(ValueError, match="num_gpus"):
        contrib.MirroredStrategy(devices=["/cpu:0"], num_gpus=1)


def test_update_config_proto_deep_copies():
    s = v1.MirroredStrategy(cpus(1))
    proto = {"a": [1]}
    out = s.update_config_proto(proto)
    out["a"].append(2)
    assert proto == {"a": [1]} and copy.deepcopy(proto) == proto


def test_v1_deprecated_names():
    s = v1.MirroredStrategy(cpus(2))
    pr = s.run(lambda: contrib.get_tower_context().tower_id)
    assert s.unwrap(pr) == (0, 1) and s.group(pr) is None
    with s.scope():
        v = md.Variable(1.0)
        with s.colocate_vars_with(v):
            pass
    s.configure(session_config={"a": 1})
    assert isinstance(contrib.MirroredStrategy(cpus(1)), v1.MirroredStrategy)


def test_contrib_tuple_inputs_are_unpacked_and_cross_tower_outputs_kept():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ds = s.distribute_dataset(lambda: [(np.full((2,), i), np.full((2,), 10 * i)) for i in range(2)])
    seen = []

    def step(ctx, x, y):
        seen.append((x.values[0].tolist(), y.values[1].tolist()))
        ctx.set_last_step_output("pair", (x, y))  # NONE: kept per tower
        ctx.set_non_tensor_output("note", "cross-tower")
    ctx = s.run_steps_on_dataset(step, ds.make_one_shot_iterator(), iterations=1)
    assert seen == [([0, 0], [10, 10])]
    assert ctx.last_step_outputs["pair"][0].values[1].tolist() == [1, 1]
    assert ctx.non_tensor_outputs == {"note": "cross-tower"}


def test_contrib_read_var_of_tower_local_variables():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        total = md.Variable(np.zeros(2), trainable=False, synchronization=md.VariableSynchronization.ON_READ,
                            aggregation=md.VariableAggregation.SUM)
        mean = md.Variable(0.0, trainable=False, synchronization=md.VariableSynchronization.ON_READ,
                           aggregation=md.VariableAggregation.MEAN)

    def tower():
        tid = contrib.get_tower_context().tower_id
        total.assign_add(np.full(2, tid + 1.0))
        mean.assign(float(tid + 1))
    s.call_for_each_tower(tower)
    np.testing.assert_array_equal(s.read_var(total), [3.0, 3.0])
    assert float(s.read_var(mean)) == 1.5 and float(mean) == 1.5 and mean.numpy() == 1.5
    np.testing.assert_array_equal(total.numpy(), [3.0, 3.0])
    # Saving reads them the same way.
    import tempfile
    path = md.train.Checkpoint(t=total, m=mean).write(tempfile.mkdtemp() + "/c")
    assert md.train.load_variable(path, "t/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [3.0, 3.0]


def test_contrib_missing_members():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert s.between_graph is False and s.is_single_tower is False
    assert contrib.MirroredStrategy(["/cpu:0"]).is_single_tower is True
    assert s.should_checkpoint and s.should_init and s.should_save_summary
    assert s.non_slot_devices([]) == list(s.worker_devices)
    with s.scope():
        v = md.Variable(1.0)
    assert s.value_container(v.values[1]) is v and s.value_container(3) == 3


def test_contrib_only_first_tower_and_cross_tower_ops_names():
    assert md.VariableAggregation.ONLY_FIRST_TOWER is md.VariableAggregation.ONLY_FIRST_REPLICA
    assert contrib.VariableAggregation is md.VariableAggregation
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_tower_ops=contrib.ReductionToOneDeviceCrossTowerOps())
    pr = s.call_for_each_tower(lambda: np.array([contrib.get_tower_context().tower_id + 5.0]))
    first = s.reduce(md.VariableAggregation.ONLY_FIRST_TOWER, pr)
    assert [v.tolist() for v in s.unwrap(first)] == [[5.0], [5.0]]
    (r,) = s.batch_reduce(md.VariableAggregation.ONLY_FIRST_REPLICA, [(pr, "/cpu:1")])
    assert s.unwrap(r)[0].tolist() == [5.0]
    assert isinstance(contrib.ReductionToOneDeviceCrossTowerOps(), contrib.CrossTowerOps)
    assert isinstance(contrib.AllReduceCrossTowerOps("hierarchical_copy", num_packs=2),
                      md.HierarchicalCopyAllReduce)
    with pytest.raises(ValueError, match="all_reduce_alg"):
        contrib.AllReduceCrossTowerOps("ring")


def test_contrib_call_for_each_tower_consumes_run_concurrently():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = s.call_for_each_tower(lambda x, **kw: (x, sorted(kw)), 1, run_concurrently=False, extra=2)
    assert s.unwrap(out)[0] == (1, ["extra"])


def test_contrib_update_unwraps_mirrored_args_per_device():
    s = contrib.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        v = md.Variable(np.zeros(2))
        step = md.Variable(np.ones(2))
    seen = []

    def fn(copy, other, scale):
        seen.append((copy.device, other.device))
        return copy.assign(np.asarray(other.read_value()) * scale)
    s.update(v, fn, step, 3.0)
    assert seen and all(a == b for a, b in seen)  # each copy got the component on its own device
    np.testing.assert_array_equal(v.numpy(), [3.0, 3.0])


def test_numpy_dataset_on_v2_strategies_and_v1_stacks_lists():
    two = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ds = two.experimental_make_numpy_dataset((np.arange(6.0).reshape(3, 2), np.arange(3)))
    rows = list(ds)
    assert len(rows) == 3 and rows[1][0].tolist() == [2.0, 3.0] and int(rows[1][1]) == 1
    (step,) = list(two.experimental_distribute_dataset(ds.batch(4)))
    assert [len(p) for p in step[0].values] == [2, 1]
    stacked = v1.MirroredStrategy(cpus(1)).experimental_make_numpy_dataset([np.ones(3), np.zeros(3)])
    assert [r.tolist() for r in stacked] == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # 2 rows of shape (3,)
    assert len(list(md.MultiWorkerMirroredStrategy(devices=["/cpu:0"]).experimental_make_numpy_dataset(
        {"x": [[1, 2], [3, 4]]}))) == 2
    with pytest.raises(ValueError, match="stacked"):
        two.experimental_make_numpy_dataset([np.ones(3), np.ones(2)])


def test_experimental_namespace_has_the_tf_2_0_spellings():
    # TF's experimental class keeps TF 2.0's argument order (communication, cluster_resolver)
    assert issubclass(md.experimental.MultiWorkerMirroredStrategy, md.MultiWorkerMirroredStrategy)
    assert list(inspect.signature(md.experimental.MultiWorkerMirroredStrategy).parameters)[:2] == [
        "communication", "cluster_resolver"]
    assert md.experimental.CollectiveCommunication.RING is md.experimental.CommunicationImplementation.RING
    assert md.experimental.CommunicationOptions is md.CommunicationOptions
    s = md.experimental.MultiWorkerMirroredStrategy(communication=md.experimental.CollectiveCommunication.AUTO,
                                                    devices=["/cpu:0"])
    assert s.num_replicas_in_sync == 1
