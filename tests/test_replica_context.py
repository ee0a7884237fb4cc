"""ReplicaContext: all_reduce (nested, fused), all_gather, merge_call — TF's examples and results."""

import numpy as np
import pytest

import mirrored as md
from conftest import replica_id


def test_all_reduce_doc_example(two):
    def step_fn():
        return md.get_replica_context().all_reduce(md.ReduceOp.SUM, np.float32(1.0))
    assert [float(v) for v in two.experimental_local_results(two.run(step_fn))] == [2.0, 2.0]


def test_all_reduce_nested_structure_in_one_batch_call(four):
    calls = []

    class Counting(md.cross_device_ops.RingAllReduce):
        def batch_reduce_implementation(self, reduce_op, pairs, options):
            calls.append(len(pairs))
            return super().batch_reduce_implementation(reduce_op, pairs, options)

    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(4)], cross_device_ops=Counting())

    def fn():
        r = np.float32(replica_id())
        return md.get_replica_context().all_reduce("mean", {"w": np.full((2, 2), r), "b": (r * 2, [np.ones(3) * r])})
    out = s.run(fn)
    assert calls == [3]  # one fused call for the three leaves
    np.testing.assert_allclose(out["w"].values[3], np.full((2, 2), 1.5))
    np.testing.assert_allclose(out["b"][0].values[0], 3.0)
    np.testing.assert_allclose(out["b"][1][0].values[2], [1.5] * 3)


def test_all_reduce_integer_mean_is_float64_like_tensorflow(two):
    out = two.run(lambda: md.get_replica_context().all_reduce("MEAN", np.array([1, 2], np.int32) + replica_id()))
    for v in out.values:  # (1+2)/2, (2+3)/2: NumPy's (and TF's) true division of integers
        np.testing.assert_array_equal(v, [1.5, 2.5])
        assert v.dtype == np.float64


def test_all_reduce_in_default_context_returns_value():
    x = np.arange(3)
    assert md.get_replica_context().all_reduce("SUM", x) is x


def test_all_gather_doc_example(two):
    dataset = [np.array([1, 2, 3, 4])]
    batch = next(iter(two.experimental_distribute_dataset(dataset)))
    out = two.run(lambda x: md.get_replica_context().all_gather(x, axis=0), args=(batch,))
    for v in out.values:
        np.testing.assert_array_equal(v, [1, 2, 3, 4])


def test_all_gather_different_sizes_along_axis(two):
    def fn():
        return md.get_replica_context().all_gather(np.ones((replica_id() + 1, 2)) * replica_id(), axis=0)
    out = two.run(fn)
    np.testing.assert_array_equal(out.values[1], [[0, 0], [1, 1], [1, 1]])

    def bad():
        return md.get_replica_context().all_gather(np.ones((2, replica_id() + 1)), axis=0)
    with pytest.raises(ValueError, match="axis 0 only"):
        two.run(bad)


def test_merge_call_merges_args_and_returns_each_replica_its_part(two):
    seen = {}

    def merge_fn(strategy, value, const, scale=1):
        seen["cross"] = md.in_cross_replica_context()
        seen["strategy"] = strategy
        seen["const"] = const
        assert isinstance(value, md.PerReplica)
        total = strategy.reduce("SUM", value, axis=None)
        return md.PerReplica([total * scale, total * scale + 1]), "shared"

    def fn():
        return md.get_replica_context().merge_call(merge_fn, args=(np.float32(replica_id() + 1), "c"),
                                                   kwargs={"scale": 10})
    parts, tag = two.run(fn)
    assert parts.values == (30, 31) and tag == "shared"
    assert seen == {"cross": True, "strategy": two, "const": "c"}


def test_merge_call_exception_reaches_caller(two):
    def merge_fn(strategy):
        raise ZeroDivisionError("in merge")
    with pytest.raises(ZeroDivisionError, match="in merge"):
        two.run(lambda: md.get_replica_context().merge_call(merge_fn))
    assert two.run(replica_id).values == (0, 1)


def test_mismatched_collectives_raise(two):
    def fn():
        ctx = md.get_replica_context()
        return ctx.all_reduce("sum", 1.0) if replica_id() == 0 else ctx.all_gather(np.ones(1), axis=0)
    with pytest.raises(RuntimeError, match="different collective"):
        two.run(fn)


def test_update_in_replica_context_is_a_merge_call(two):
    with two.scope():
        v = md.Variable(0.0)
    two.run(lambda: two.extended.update(v, lambda var, x: var.assign(x), args=(np.float32(replica_id() + 5),)))
    assert [float(c) for c in v.values] == [5.0, 6.0]  # each copy takes its own replica's component


def test_all_gather_nested_doc_example(two):
    def gather_nest():
        return md.get_replica_context().all_gather([np.array([1, 2, 3]), np.array([[1, 2], [3, 4]])], axis=0)
    result = two.run(gather_nest)
    assert isinstance(result, list) and all(isinstance(r, md.PerReplica) for r in result)
    local = two.experimental_local_results(result)
    assert isinstance(local, tuple) and len(local) == 2 and isinstance(local[0], list)
    np.testing.assert_array_equal(local[1][0], [1, 2, 3, 1, 2, 3])
    np.testing.assert_array_equal(local[0][1], [[1, 2], [3, 4], [1, 2], [3, 4]])


def test_all_gather_different_shapes_doc_example(two):
    values = [{"a": np.array([0]), "b": np.array([[0, 1]])},
              {"a": np.array([1]), "b": np.array([[2, 3], [4, 5]])}]
    out = two.run(lambda: md.get_replica_context().all_gather(values[replica_id()], axis=0))
    for r in two.experimental_local_results(out):
        np.testing.assert_array_equal(r["a"], [0, 1])
        np.testing.assert_array_equal(r["b"], [[0, 1], [2, 3], [4, 5]])
