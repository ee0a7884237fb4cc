"""Auto-sharding of multi-worker datasets with tf.data's names: md.data.Options / AutoShardPolicy."""

import logging

import numpy as np
import pytest

import mirrored as md


def test_options_are_set_as_tf_users_set_them():
    options = md.data.Options()
    assert options.experimental_distribute.auto_shard_policy is md.data.experimental.AutoShardPolicy.AUTO
    options.experimental_distribute.auto_shard_policy = md.data.experimental.AutoShardPolicy.DATA
    ds = md.data.Dataset([np.zeros(2)]).with_options(options)
    assert ds.options().experimental_distribute.auto_shard_policy is md.data.AutoShardPolicy.DATA
    assert [int(p) for p in md.data.AutoShardPolicy] == [-1, 0, 1, 2, 3]  # TF's values
    with pytest.raises(ValueError, match="auto_shard_policy='BYROW'"):
        options.experimental_distribute.auto_shard_policy = "BYROW"
    numpy_ds = md.MirroredStrategy(["/cpu:0"]).experimental_make_numpy_dataset(np.arange(4)).with_options(options)
    assert numpy_ds.batch(2).options() is options


def test_one_worker_splits_the_same_under_every_policy():
    two = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for policy in md.data.AutoShardPolicy:
        options = md.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        ds = md.data.Dataset([np.arange(4)]).with_options(options)
        (step,) = list(two.experimental_distribute_dataset(ds))
        assert [v.tolist() for v in step.values] == [[0, 1], [2, 3]], policy


def _worker(policy, items=4):
    from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("mirrored").addHandler(Keep())
    strategy = MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=30), devices=["/cpu:0"])
    batches = [np.arange(4) + 10 * i for i in range(items)]  # global batches of 4 rows
    dataset = batches
    if policy is not None:
        options = md.data.Options()
        options.experimental_distribute.auto_shard_policy = md.data.AutoShardPolicy[policy]
        dataset = md.data.Dataset(batches).with_options(options)
    try:
        steps = [np.asarray(x).tolist() for x in strategy.experimental_distribute_dataset(dataset)]
    except ValueError as e:
        return "error", str(e)
    return steps, records


@pytest.mark.multiworker
def test_multiworker_policies():
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    got = {}
    for policy in (None, "DATA", "OFF", "FILE"):
        results = launch(_worker, 2, kwargs={"policy": policy}, timeout=120)
        for r in results:
            assert r.ok, (policy, r.task, r.error, r.message, r.stderr[-2000:])
        got[policy] = [r.value for r in results]
    # AUTO on a plain list: DATA, and TensorFlow's fall-back warning.
    (w0, log0), (w1, _) = got[None]
    assert w0 == [[0, 1], [10, 11], [20, 21], [30, 31]] and w1 == [[2, 3], [12, 13], [22, 23], [32, 33]]
    assert any("AUTO sharding policy will apply DATA sharding policy as it failed to apply FILE sharding "
               "policy" in m for m in log0)
    assert [v[0] for v in got["DATA"]] == [w0, w1] and got["DATA"][0][1] == []  # explicit: no warning
    # OFF: every worker reads every batch, its replica taking the per-replica batches in turn.
    off = [[0, 1], [2, 3], [10, 11], [12, 13], [20, 21], [22, 23], [30, 31], [32, 33]]
    assert [v[0] for v in got["OFF"]] == [off, off]
    # FILE: the items are the files; worker w reads items w, w+2.
    assert [v[0] for v in got["FILE"]] == [[[0, 1], [2, 3], [20, 21], [22, 23]],
                                          [[10, 11], [12, 13], [30, 31], [32, 33]]]
    results = launch(_worker, 2, kwargs={"policy": "FILE", "items": 1}, timeout=120)
    for r in results:
        assert r.ok and r.value[0] == "error" and "at least as many files" in r.value[1]
