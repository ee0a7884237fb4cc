"""compat.v1 and compat.contrib: the TF 1.x names doing what TF's docs say."""

import copy

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
    assert s.worker_device_index == {d: i for i, d in enumerate(s.worker_devices)}

    def tower_fn(x):
        ctx = contrib.get_tower_context()
        assert ctx.device == s.worker_devices[ctx.tower_id]
        return ctx.tower_id * x + ctx.merge_call(lambda strategy, v: strategy.num_replicas_in_sync, x)
    out = s.call_for_each_tower(tower_fn, 10)
    assert s.unwrap(out) == (2, 12)
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

    def step(ctx, inputs):
        ctx.set_last_step_output("loss", inputs.sum(), aggregation=md.VariableAggregation.SUM)
    it = ds.make_initializable_iterator()
    it.initialize()
    ctx = s2.run_steps_on_dataset(step, it, iterations=2)
    assert float(ctx.last_step_outputs["loss"]) == (2 + 3) * 2
    assert s2.initialize() == [] and s2.finalize() == []
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
