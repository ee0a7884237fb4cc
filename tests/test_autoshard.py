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
    assert numpy_ds.batch(2).options() == options  # (a read-only copy, as TF's)


def test_one_worker_splits_the_same_under_every_policy():
    two = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for policy in md.data.AutoShardPolicy:
        options = md.data.Options()
        options.experimental_distribute.auto_shard_policy = policy
        ds = md.data.Dataset([np.arange(4)]).with_options(options)
        (step,) = list(two.experimental_distribute_dataset(ds))
        assert [v.tolist() for v in step.values] == [[0, 1], [2, 3]], policy


def _strategy_and_log_messages():
    """This task's one-CPU-replica MultiWorkerMirroredStrategy, and the list its "mirrored" log messages go to."""
    from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("mirrored").addHandler(Keep())
    return MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=30), devices=["/cpu:0"]), records


def _worker(policy, items=4):
    strategy, records = _strategy_and_log_messages()
    batches = [np.arange(4) + 10 * i for i in range(items)]  # global batches of 4 rows
    dataset = batches
    if policy is not None:
        options = md.data.Options()
        options.experimental_distribute.auto_shard_policy = md.data.AutoShardPolicy[policy]
        dataset = md.data.Dataset(batches).with_options(options)
    try:
        steps = [np.asarray(strategy.experimental_local_results(x)[0]).tolist()
                 for x in strategy.experimental_distribute_dataset(dataset)]
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


def _pipeline_worker(directory, kinds):
    strategy, records = _strategy_and_log_messages()
    D = md.data.Dataset
    pattern = f"{directory}/part*.txt"
    datasets = {
        "text": lambda: md.data.TextLineDataset(D.list_files(pattern, shuffle=False)).batch(2),
        "interleave": lambda: D.list_files(pattern, seed=3).interleave(md.data.TextLineDataset, cycle_length=2)
        .batch(2),
        "one_file": lambda: md.data.TextLineDataset(f"{directory}/part0.txt").batch(2),
        "slices": lambda: D.from_tensor_slices(np.arange(8)).batch(4),
        "unseeded": lambda: D.from_tensor_slices(np.arange(8)).shuffle(8).batch(4),
    }
    out = {}
    for kind in kinds:  # one job for all of them: a job's start-up costs seconds
        records.clear()
        dataset = datasets[kind.replace("file:", "")]()
        if kind.startswith("file:"):
            options = md.data.Options()
            options.experimental_distribute.auto_shard_policy = md.data.AutoShardPolicy.FILE
            dataset = dataset.with_options(options)
        try:
            # (across workers each step is a PerReplica, of this worker's one replica here)
            steps = [[bytes(v) if isinstance(v, bytes) else int(v)
                      for v in np.asarray(strategy.experimental_local_results(x)[0]).tolist()]
                     for x in strategy.experimental_distribute_dataset(dataset)]
        except ValueError as e:
            out[kind] = ("error", str(e))
            continue
        out[kind] = (steps, list(records))
    return out


@pytest.mark.multiworker
def test_file_sharding_of_md_data_pipelines(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    for i in range(4):
        (tmp_path / f"part{i}.txt").write_bytes(b"".join(b"f%d-%d\n" % (i, j) for j in range(4)))

    kinds = ["text", "interleave", "slices", "unseeded", "one_file", "file:slices", "file:one_file"]
    results = launch(_pipeline_worker, 2, kwargs={"directory": str(tmp_path), "kinds": kinds}, timeout=180)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])

    def run(kind):
        return [r.value[kind] for r in results]

    fallback = "AUTO sharding policy will apply DATA sharding policy as it failed to apply FILE sharding policy"
    for kind in ("text", "interleave"):
        (w0, log0), (w1, _) = run(kind)
        # AUTO finds the list_files source: worker w reads files w and w+2; each global batch of 2 lines is
        # split over the 2 replicas, and this worker's replica runs both halves in turn.
        lines0 = [line for step in w0 for line in step]
        lines1 = [line for step in w1 for line in step]
        assert {line.split(b"-")[0] for line in lines0} == {b"f0", b"f2"}
        assert {line.split(b"-")[0] for line in lines1} == {b"f1", b"f3"}
        assert sorted(lines0 + lines1) == sorted(b"f%d-%d" % (i, j) for i in range(4) for j in range(4))
        assert not any(fallback in m for m in log0)
    assert run("text")[0][0][:2] == [[b"f0-0"], [b"f0-1"]]
    # AUTO without files (or with fewer files than workers): DATA, with TensorFlow's warning.
    (w0, log0), (w1, _) = run("slices")
    assert (w0, w1) == ([[0, 1], [4, 5]], [[2, 3], [6, 7]])
    assert any(fallback in m and "Did not find a shardable source" in m for m in log0)
    assert not any("has no seed" in m for m in log0)
    (_, log0), _ = run("unseeded")
    assert any("its shuffle has no seed" in m for m in log0)
    (w0, log0), _ = run("one_file")
    assert any("the dataset only has 1 file(s), which is not enough for the required 2 shards/workers" in m
               for m in log0)
    # FILE asked for explicitly where it cannot apply: an error naming the way out.
    for kind, message in (("file:slices", "found no file source"), ("file:one_file", "only has 1 file")):
        for verdict, text in run(kind):
            assert verdict == "error" and message in text and "AutoShardPolicy.DATA" in text
