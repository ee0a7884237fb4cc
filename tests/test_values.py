"""Distributed values and variables: reprs, aggregation and synchronization rules (SPEC §3 Values)."""

import numpy as np
import pytest

import mirrored as md
from conftest import replica_id


def test_per_replica_repr_and_str():
    pr = md.PerReplica([np.array([1.0]), np.array([2.0])])
    assert repr(pr) == "PerReplica:{\n  0: array([1.]),\n  1: array([2.])\n}"
    assert str(pr) == "PerReplica:{\n  0: [1.],\n  1: [2.]\n}"
    assert repr(md.Mirrored([1, 1])) == "Mirrored:{\n  0: 1,\n  1: 1\n}"
    assert isinstance(pr, md.DistributedValues) and pr.values == tuple(pr.values)


def test_mirrored_variable_doc_example(two):
    with two.scope():
        x = md.Variable(1.0)
    assert isinstance(x, md.MirroredVariable) and isinstance(x, md.Variable)
    assert repr(x) == (
        "MirroredVariable:{\n"
        "  0: <mirrored.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>,\n"
        "  1: <mirrored.Variable 'Variable/replica_1:0' shape=() dtype=float32, numpy=1.0>\n}")
    assert x.name == "Variable:0" and x.shape == () and x.dtype == np.float32
    assert x.trainable and x.aggregation is md.VariableAggregation.NONE
    assert x.synchronization is md.VariableSynchronization.ON_WRITE
    assert x.device == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert [v.device for v in x.values][1].endswith("CPU:1")


def test_plain_variable_outside_scope():
    v = md.Variable(lambda: np.arange(3), name="w", dtype="float64")
    assert type(v).__name__ == "DeviceVariable" and isinstance(v, md.Variable)
    assert v.name == "w:0" and v.dtype == np.float64
    v.assign_add(np.ones(3))
    np.testing.assert_array_equal(v.numpy(), [1, 2, 3])
    np.testing.assert_array_equal(v * 2, [2, 4, 6])  # arithmetic reads the value
    with pytest.raises(ValueError, match="shape"):
        v.assign(np.ones(4))
    with pytest.raises(TypeError):
        hash(v)
    assert {v.ref(): 1}[v.ref()] == 1


def test_read_value_is_never_changed_by_a_later_assign(two):
    with two.scope():
        v = md.Variable(np.zeros(2, np.float32))
    before = v.read_value()
    src = np.ones(2, np.float32)
    v.assign(src)
    src[:] = 7  # the caller's array is copied, not aliased
    np.testing.assert_array_equal(before, [0, 0])
    np.testing.assert_array_equal(v.numpy(), [1, 1])


def test_cross_replica_assign_updates_every_copy(four):
    with four.scope():
        v = md.Variable([1.0, 2.0])
    v.assign([3.0, 4.0])
    v.assign_add([1.0, 1.0])
    v.assign_sub([0.5, 0.5])
    for copy in v.values:
        np.testing.assert_array_equal(copy.numpy(), [3.5, 4.5])
    with pytest.raises(ValueError, match="PerReplica"):
        v.assign(md.PerReplica([np.ones(2, np.float32)] * 4))


def test_replica_assign_with_aggregation_none_raises(two):
    with two.scope():
        v = md.Variable(1.0)
    with pytest.raises(ValueError, match="aggregation"):
        two.run(lambda: v.assign(2.0))
    assert float(v) == 1.0  # strategy still usable, variable untouched
    two.run(lambda: 0)


@pytest.mark.parametrize("aggregation,expected", [
    (md.VariableAggregation.SUM, 1.0 + 1.0 + 2.0),
    (md.VariableAggregation.MEAN, 1.0 + 1.5),
    (md.VariableAggregation.ONLY_FIRST_REPLICA, 1.0 + 1.0),
])
def test_replica_assign_add_aggregates_and_copies_never_drift(two, aggregation, expected):
    with two.scope():
        v = md.Variable(1.0, aggregation=aggregation)
    result = two.run(lambda: v.assign_add(np.float32(replica_id() + 1)))
    assert result is v
    assert [float(c) for c in v.values] == [expected, expected]


def test_replica_assign_sum_of_same_python_value_raises(two):
    with two.scope():
        v = md.Variable(1.0, aggregation=md.VariableAggregation.SUM)
    with pytest.raises(ValueError, match="non-DistributedValues"):
        two.run(lambda: v.assign(5.0))
    with two.scope():
        m = md.Variable(1.0, aggregation=md.VariableAggregation.MEAN)
    two.run(lambda: m.assign(5.0))  # MEAN of one value is that value
    assert float(m) == 5.0


def test_read_inside_replica_sees_own_copy(two):
    with two.scope():
        v = md.Variable(3.0, synchronization=md.VariableSynchronization.ON_READ,
                        aggregation=md.VariableAggregation.SUM)
    two.run(lambda: v.assign(np.float32(replica_id() + 1)))
    assert two.run(lambda: float(v.read_value())).values == (1.0, 2.0)
    assert float(v.read_value()) == 3.0  # cross-replica read: SUM of the copies
    assert v.numpy() == 3.0


def test_sync_on_read_cross_replica_rules(four):
    with four.scope():
        s = md.Variable(0.0, synchronization=md.VariableSynchronization.ON_READ,
                        aggregation=md.VariableAggregation.SUM)
        m = md.Variable(0.0, synchronization=md.VariableSynchronization.ON_READ,
                        aggregation=md.VariableAggregation.MEAN)
    assert isinstance(s, md.SyncOnReadVariable) and not s.trainable
    s.assign(8.0)  # each copy holds 8 / 4 so the SUM read gives 8 back
    assert [float(c) for c in s.values] == [2.0] * 4 and float(s) == 8.0
    with pytest.raises(ValueError, match="assign_add"):
        s.assign_add(1.0)
    m.assign(3.0)
    m.assign_add(1.0)
    assert float(m) == 4.0 and [float(c) for c in m.values] == [4.0] * 4
    four.run(lambda: m.assign(np.float32(replica_id())))
    assert float(m) == 1.5


def test_sync_on_read_with_none_aggregation_cannot_be_read_cross_replica(two):
    with two.scope():
        v = md.Variable(1.0, synchronization=md.VariableSynchronization.ON_READ)
    with pytest.raises(ValueError, match="Could not convert"):
        v.read_value()


@pytest.mark.parametrize("n", [1, 2])
def test_sync_on_read_none_aggregation_cross_replica_update_updates_then_raises(n):
    # TF 2.21: the copies are updated, then the update's result (their aggregate read) raises; with
    # read_value=False nothing is read (found by tests/test_tf_differential.py: ours returned quietly).
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    with strategy.scope():
        v = md.Variable(np.array([1.0, 2.0], np.float32), synchronization=md.VariableSynchronization.ON_READ)
    ones = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="Could not convert"):
        v.assign(ones)
    assert [c.numpy().tolist() for c in strategy.experimental_local_results(v)] == [[1.0, 1.0]] * n
    with pytest.raises(ValueError, match="Could not convert"):
        v.assign_add(ones)
    assert v.assign_sub(ones, read_value=False) is None
    assert [c.numpy().tolist() for c in strategy.experimental_local_results(v)] == [[1.0, 1.0]] * n
    strategy.run(lambda: v.assign_add(ones))  # in replica context: the replica's own copy, no read
    assert [c.numpy().tolist() for c in strategy.experimental_local_results(v)] == [[2.0, 2.0]] * n


def test_variable_creation_rules(two):
    with two.scope():
        with pytest.raises(ValueError, match="MEAN"):
            md.Variable(1, aggregation=md.VariableAggregation.MEAN)
        with pytest.raises(ValueError, match="NONE"):
            md.Variable(1.0, synchronization=md.VariableSynchronization.NONE)
        # TF 2.x keeps an explicit trainable=True on an ON_READ variable (only the default becomes False).
        assert md.Variable(1.0, trainable=True, synchronization=md.VariableSynchronization.ON_READ,
                           aggregation=md.VariableAggregation.SUM).trainable
        with pytest.raises(ValueError, match="aggregation"):
            md.Variable(1.0, aggregation="sum")
        v = md.Variable(lambda: np.ones((2, 2)), name="kernel", trainable=False, dtype=np.float32)
    assert v.name == "kernel:0" and v.values[1].name == "kernel/replica_1:0"
    assert not v.trainable and v.dtype == np.float32
    assert md.Variable(1).dtype == np.int32 and md.Variable(1.5).dtype == np.float32  # TF's Python conversion


def test_copies_are_independent_buffers(two):
    with two.scope():
        v = md.Variable(np.zeros(3, np.float32))
    a, b = (c.read_value() for c in v.values)
    assert not np.shares_memory(a, b)


def test_run_returns_the_variable_itself(two):
    with two.scope():
        v = md.Variable(1.0)
    assert two.run(lambda: v) is v
    assert two.run(lambda: v.values[replica_id()]) is v  # its copies regroup into it


def test_distributed_values_doc_examples(two):
    # From a distributed dataset: [5., 6., 7., 8.] batched by 2 -> 5. on replica 0, 6. on replica 1.
    dataset = [np.array([5.0, 6.0], np.float32), np.array([7.0, 8.0], np.float32)]
    distributed_values = next(iter(two.experimental_distribute_dataset(dataset)))
    assert isinstance(distributed_values, md.PerReplica)
    assert [v.tolist() for v in distributed_values.values] == [[5.0], [6.0]]
    # Passed to run, and reduced.
    result = two.run(lambda x: x * 2, args=(distributed_values,))
    assert [v.tolist() for v in result.values] == [[10.0], [12.0]]
    np.testing.assert_array_equal(two.reduce("SUM", result, axis=None), [22.0])
    # Returned by run with a per-replica computation.
    per_replica_ids = two.run(lambda: np.int32(replica_id()))
    assert two.experimental_local_results(per_replica_ids) == (0, 1)
