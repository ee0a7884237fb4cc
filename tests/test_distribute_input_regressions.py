"""Distributed-input differences from TF 2.21 that tests/test_distribute_input_differential.py found, each
pinned by the smallest case (the expected values are TF 2.21's, 3 logical CPUs)."""

import warnings

import numpy as np
import pytest

import mirrored as md
from mirrored.distribute.function import EagerFallbackWarning
from data_parity import logical_cpus

D = md.data.Dataset


@pytest.fixture
def strategy():
    with logical_cpus(4), warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)  # (md.function on CPU replicas runs eagerly)
        yield md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])


def _local(strategy, value):
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def test_empty_optional_raises_tf_invalid_argument(strategy):
    it = iter(strategy.experimental_distribute_dataset(D.range(3).batch(3)))
    next(it)
    optional = it.get_next_as_optional()
    assert not optional.has_value()
    with pytest.raises(md.errors.InvalidArgumentError, match="The given optional does not have a value"):
        optional.get_value()


def test_short_step_of_scalars_pads_zeros_in_get_next_as_optional(strategy):
    # One scalar element for three replicas: next() ends the input (fixed shapes), the optional still gives
    # the step, the missing replicas' elements zeros of the dtype.
    dist = strategy.distribute_datasets_from_function(lambda ctx: D.from_tensor_slices({"q": np.array([True])}))
    assert list(dist) == []
    optional = iter(dist).get_next_as_optional()
    assert optional.has_value()
    value = optional.get_value()["q"]
    assert _local(strategy, value) == [True, False, False]
    assert [np.asarray(v).dtype for v in value.values] == [np.bool_] * 3


def test_short_step_pads_scalar_leaf_beside_a_batch_of_unknown_size(strategy):
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: D.zip((D.range(10, 12), D.range(6).batch(3).map(lambda x: x.astype(np.float32)))))
    steps = [(_local(strategy, a), _local(strategy, b)) for a, b in dist]
    assert steps == [([10, 11, 0], [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], []])]


@pytest.mark.parametrize("make,eager,total", [
    (lambda ctx: D.range(5).batch(2, drop_remainder=True), 0, 4),  # [0 1] [2 3] [] : 2 + 2 + 0
    (lambda ctx: D.range(4), 3, 6),  # scalars (0 1 2) (3 0 0): 3 + 3
])
def test_for_loop_inside_function_takes_the_short_step(strategy, make, eager, total):
    # Autograph loops on get_next_as_optional: the short last step that ends an eager loop is taken.
    @md.function
    def loop(dist):
        n = np.int32(0)
        for x in dist:
            n += strategy.reduce("SUM", strategy.run(lambda e: np.int32(np.size(e)), args=(x,)), axis=None)
        return n

    dist = strategy.distribute_datasets_from_function(make)
    assert sum(np.size(v) for x in dist for v in strategy.experimental_local_results(x)) == eager
    assert int(loop(dist)) == total


def test_for_loop_with_functions_run_eagerly_is_plain_python(strategy):
    # TF's run_functions_eagerly(True) runs the body without autograph: the eager loop's steps.
    md.config.run_functions_eagerly(True)
    try:
        steps = md.function(lambda dist: len([x for x in dist]))(
            strategy.distribute_datasets_from_function(lambda ctx: D.range(4)))
    finally:
        md.config.run_functions_eagerly(False)
    assert steps == 1  # (0 1 2); the short (3) ends the loop


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
def test_central_storage_makes_one_pipeline_per_worker_in_every_mode(mode):
    # TF's CentralStorageStrategy calls dataset_fn once per worker even under PER_REPLICA, and its replicas take
    # that pipeline's batches in turn.
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return D.from_tensors(np.array([ctx.input_pipeline_id, 7])).repeat(3)

    with logical_cpus(4):
        strategy = md.distribute.experimental.CentralStorageStrategy(compute_devices=["/cpu:0", "/cpu:1"],
                                                                     parameter_device="/cpu:0")
        dist = strategy.distribute_datasets_from_function(dataset_fn, md.distribute.InputOptions(
            experimental_replication_mode=getattr(md.distribute.InputReplicationMode, mode)))
        assert [_local(strategy, x) for x in dist] == [[[0, 7], [0, 7]]]
    assert contexts == [(1, 0, 2)]


def test_function_step_past_the_end_raises_out_of_range(strategy):
    # TF's train_step(iterator) pattern: the call after the last step raises OutOfRangeError (End of sequence).
    step = md.function(lambda iterator: strategy.run(lambda x: np.int32(np.size(x)), args=(next(iterator),)))
    it = iter(strategy.experimental_distribute_dataset(D.range(3).batch(3)))
    assert _local(strategy, step(it)) == [1, 1, 1]
    with pytest.raises(md.errors.OutOfRangeError, match="End of sequence"):
        step(it)
