"""Distributed datasets: TF's split rule, nesting, prefetch, element_spec, datasets from a function."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from conftest import cpus


def sizes(element):
    return [len(v) for v in (element.values if isinstance(element, md.PerReplica) else (element,))]


# TensorFlow 2.x today (checked against real TF): 6 rows over 2 replicas 3+3, over 4 replicas 2+2+2+0
# (older TF documents show [0, 1, 2, 3] + [4, 5]; docs/guide.md says which we follow).
@pytest.mark.parametrize("n,b,expected", [(2, 7, [4, 3]), (4, 10, [3, 3, 3, 1]), (2, 6, [3, 3]), (4, 6, [2, 2, 2, 0]),
                                          (4, 3, [1, 1, 1, 0]), (3, 8, [3, 3, 2]), (1, 5, [5])])
def test_split_rule(n, b, expected):
    s = md.MirroredStrategy(cpus(n))
    x = np.arange(b * 2, dtype=np.float32).reshape(b, 2)
    (element,) = list(s.experimental_distribute_dataset([x]))
    assert sizes(element) == expected
    parts = element.values if n > 1 else (element,)
    np.testing.assert_array_equal(np.concatenate(parts), x)
    assert all(p.shape[1:] == (2,) for p in parts)  # empty slices keep the trailing shape


def test_nested_batches_and_last_partial_batch(two):
    data = [({"x": np.arange(8).reshape(4, 2), "y": np.arange(4)}, np.ones(4)),
            ({"x": np.arange(6).reshape(3, 2), "y": np.arange(3)}, np.ones(3))]
    first, last = list(two.experimental_distribute_dataset(data))
    assert isinstance(first[0]["x"], md.PerReplica) and isinstance(first[1], md.PerReplica)
    np.testing.assert_array_equal(first[0]["x"].values[1], [[4, 5], [6, 7]])
    assert sizes(last[0]["y"]) == [2, 1]


def test_element_spec(two, one):
    ds = two.experimental_distribute_dataset([(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))])
    x_spec, y_spec = ds.element_spec
    assert repr(x_spec) == ("PerReplicaSpec(TensorSpec(shape=(None, 3), dtype=float32, name=None), "
                            "TensorSpec(shape=(None, 3), dtype=float32, name=None))")
    assert repr(one.experimental_distribute_dataset([np.zeros((2, 5))]).element_spec) == \
        "TensorSpec(shape=(None, 5), dtype=float64, name=None)"


def test_one_shot_generator_loses_no_batch_to_element_spec(two):
    gen = (np.full((2, 1), i) for i in range(3))
    ds = two.experimental_distribute_dataset(gen)
    assert ds.element_spec is not None
    assert [int(e.values[0][0, 0]) for e in ds] == [0, 1, 2]


def test_a_consumed_one_shot_iterator_raises_on_the_next_epoch(two):
    ds = two.experimental_distribute_dataset(np.full((2, 1), i) for i in range(3))
    assert len(list(ds)) == 3
    with pytest.raises(ValueError, match="one-shot iterator.*consumed.*fresh iterator"):
        iter(ds)
    fn_ds = two.distribute_datasets_from_function(lambda ctx: iter([np.ones((1, 1))] * 2))
    assert len(list(fn_ds)) == 1
    with pytest.raises(ValueError, match=r"dataset_fn\(\) is a one-shot iterator"):
        list(fn_ds)


def test_a_one_shot_iterator_stopped_early_continues(two):
    ds = two.experimental_distribute_dataset(np.full((2, 1), i) for i in range(20))  # more than prefetched
    assert int(next(iter(ds)).values[0][0, 0]) == 0
    assert len(list(ds)) >= 1  # not exhausted yet: no error, the next pass takes the rest


def test_reiterable_dataset_restarts(two):
    ds = two.experimental_distribute_dataset([np.ones((2, 1)), np.zeros((2, 1))])
    assert len(list(ds)) == 2 and len(list(ds)) == 2


def test_prefetch_runs_ahead_in_background(four):
    produced = []
    gate = threading.Event()

    def source():
        for i in range(10):
            produced.append(i)
            yield np.full((4, 1), i)
        gate.set()
    it = iter(four.experimental_distribute_dataset(source()))
    deadline = time.time() + 5
    while len(produced) < 4 and time.time() < deadline:
        time.sleep(0.01)
    assert len(produced) >= 4  # N batches ready before the first next()
    assert len(produced) < 10  # bounded: it does not read the whole dataset
    assert [int(e.values[0][0, 0]) for e in it] == list(range(10))


def test_errors_in_the_source_reach_the_consumer(two):
    def source():
        yield np.ones((2, 1))
        raise OSError("disk gone")
    it = iter(two.experimental_distribute_dataset(source()))
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_fetch_to_device_false_keeps_host_arrays(two):
    ds = two.experimental_distribute_dataset([np.ones((2, 1))], options=md.InputOptions(
        experimental_fetch_to_device=False))
    assert isinstance(next(iter(ds)).values[0], np.ndarray)
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):
        two.experimental_distribute_dataset([np.ones(2)], md.InputOptions(
            experimental_replication_mode=md.InputReplicationMode.PER_REPLICA))


def test_distribute_datasets_from_function(four):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        batch = ctx.get_per_replica_batch_size(8)
        return [np.full((batch, 1), i) for i in range(5)]
    ds = four.distribute_datasets_from_function(dataset_fn)
    steps = list(ds)
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 4)
    assert [int(v[0, 0]) for v in steps[0].values] == [0, 1, 2, 3]
    assert [len(v) for v in steps[1].values] == [2, 0, 0, 0]  # a short last step: empty batches
    assert four.experimental_distribute_datasets_from_function is not None


def test_per_replica_pipelines(two):
    ds = two.distribute_datasets_from_function(
        lambda ctx: [np.full((1,), ctx.input_pipeline_id)] * 2,
        md.InputOptions(experimental_replication_mode=md.InputReplicationMode.PER_REPLICA))
    assert [tuple(int(v[0]) for v in e.values) for e in ds] == [(0, 1), (0, 1)]


def test_input_context():
    ctx = md.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(8) == 2
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(7)
    assert str(ctx) == "tf.distribute.InputContext(input pipeline id 1, total: 2)"
    vctx = md.ValueContext(1, 2)
    assert (vctx.replica_id_in_sync_group, vctx.num_replicas_in_sync) == (1, 2)


def test_bad_batches_are_rejected(two):
    with pytest.raises(ValueError, match="leading"):
        list(two.experimental_distribute_dataset([(np.ones(3), np.ones(2))]))
    with pytest.raises(TypeError, match="not iterable"):
        two.experimental_distribute_dataset(5)


_BY_N = {n: md.MirroredStrategy(cpus(n)) for n in range(1, 6)}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), b=st.integers(0, 23), width=st.integers(0, 3))
def test_split_rule_property(n, b, width):
    c = -(-b // n)
    x = np.arange(b * width).reshape(b, width)
    element = next(iter(_BY_N[n].experimental_distribute_dataset([x])))
    parts = element.values if n > 1 else (element,)
    assert [len(p) for p in parts] == [max(0, min(c, b - i * c)) for i in range(n)]
    assert all(p.shape[1:] == (width,) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), x)


def test_options_are_named_tuples_like_tf():
    assert repr(md.InputOptions()) == (
        "InputOptions(experimental_fetch_to_device=True, experimental_replication_mode="
        "<InputReplicationMode.PER_WORKER: 'PER_WORKER'>, experimental_place_dataset_on_device=False, "
        "experimental_per_replica_buffer_size=1)")
    assert md.RunOptions() == (True, False, None)
    with pytest.raises(ValueError, match="buffer_size"):
        md.InputOptions(experimental_per_replica_buffer_size=-1)


def test_get_next_as_optional_and_reduce(two):
    ds = two.experimental_distribute_dataset([np.ones((2, 1)), np.ones((2, 1)) * 2])
    it = iter(ds)
    first = it.get_next_as_optional()
    assert first.has_value() and float(first.get_value().values[1][0, 0]) == 1.0
    it.get_next()
    end = it.get_next_as_optional()
    assert not end.has_value()
    with pytest.raises(ValueError, match="has_value"):
        end.get_value()
    total = ds.reduce(0.0, lambda state, x: state + float(two.reduce("SUM", x, axis=0)[0]))
    assert total == 6.0


# --- md.data pipelines as distributed input ---------------------------------------------------------------

def _rows(strategy, element):
    return np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(element)]).tolist()


def test_md_data_pipelines_are_split_like_any_batches(four):
    ds = md.data.Dataset.from_tensor_slices((np.arange(22), np.arange(22) * 2)).shuffle(22, seed=4).batch(8)
    steps = list(four.experimental_distribute_dataset(ds.prefetch(md.data.AUTOTUNE)))
    assert [sizes(x) for x, _ in steps] == [[2, 2, 2, 2], [2, 2, 2, 2], [2, 2, 2, 0]]
    rows = [r for x, _ in steps for r in _rows(four, x)]
    assert sorted(rows) == list(range(22))
    assert all(_rows(four, y) == [2 * r for r in _rows(four, x)] for x, y in steps)
    spec = four.experimental_distribute_dataset(ds).element_spec[0]
    assert repr(spec).startswith("PerReplicaSpec(TensorSpec(shape=(None,), dtype=int64")


def _distributed_pipelines():
    slices = md.data.Dataset.from_tensor_slices({"i": np.arange(30), "x": np.ones((30, 2), np.float32)})
    return {
        "shuffle-batch": lambda: slices.shuffle(12, seed=3).batch(4).repeat(2).prefetch(2),
        "map-filter": lambda: slices.map(lambda e: {"i": e["i"] * 10, "x": e["x"]}, num_parallel_calls=3)
        .filter(lambda e: e["i"] % 20 == 0).batch(3),
        "list": lambda: [{"i": np.arange(k, k + 4), "x": np.zeros((4, 2))} for k in range(0, 40, 4)],
    }


@pytest.mark.parametrize("kind", sorted(_distributed_pipelines()))
@pytest.mark.parametrize("position", [0, 1, 4])
def test_a_checkpointed_distributed_iterator_resumes_at_the_next_step(two, tmp_path, kind, position):
    make = _distributed_pipelines()[kind]
    expected = [_rows(two, e["i"]) for e in two.experimental_distribute_dataset(make())]
    it = iter(two.experimental_distribute_dataset(make()))
    for _ in range(position):
        next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt"))
    next(it)
    restored = iter(two.experimental_distribute_dataset(make()))
    md.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert [_rows(two, e["i"]) for e in restored] == expected[position:]


def test_pipelines_from_a_function_checkpoint_too(two, tmp_path):
    def dataset_fn(ctx):
        return md.data.Dataset.range(ctx.input_pipeline_id * 100, ctx.input_pipeline_id * 100 + 9).batch(2)

    options = md.InputOptions(experimental_replication_mode=md.InputReplicationMode.PER_REPLICA)
    make = lambda: two.distribute_datasets_from_function(dataset_fn, options)  # noqa: E731
    expected = [[np.asarray(v).tolist() for v in e.values] for e in make()]
    assert expected[0] == [[0, 1], [100, 101]]
    it = iter(make())
    next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt"))
    restored = iter(make())
    md.train.Checkpoint(iterator=restored).restore(path)
    assert [[np.asarray(v).tolist() for v in e.values] for e in restored] == expected[1:]


def test_a_one_shot_source_cannot_be_restored_and_says_why(two, tmp_path):
    it = iter(two.experimental_distribute_dataset(np.full((2, 1), i) for i in range(5)))
    next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt"))
    again = iter(two.experimental_distribute_dataset(np.full((2, 1), i) for i in range(5)))
    with pytest.raises(ValueError, match="one-shot iterator.*md.data.Dataset"):
        md.train.Checkpoint(iterator=again).restore(path)


def test_no_prefetch_thread_outlives_a_distributed_iterator(two):
    import gc

    def prefetching():
        return [t for t in threading.enumerate() if t.name.startswith(("mirrored-prefetch", "md.data"))]

    ds = two.experimental_distribute_dataset(md.data.Dataset.range(100).map(
        lambda x: np.full(2, x), num_parallel_calls=2).prefetch(2).batch(2))
    it = iter(ds)
    next(it)
    del it
    gc.collect()
    assert prefetching() == []
    assert len(list(ds)) == 50
    gc.collect()
    assert prefetching() == []
