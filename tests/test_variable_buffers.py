"""Variables' buffers: reads cost a pointer, updates write in place, and an array read earlier keeps its
value (TensorFlow's promise, kept by copy-on-write)."""

import numpy as np
import pytest

import mirrored as md


def _address(var, i=0):
    return var.values[i].read_value().ctypes.data if isinstance(var, md.DistributedVariable) else \
        var.read_value().ctypes.data


@pytest.mark.parametrize("n", [0, 2])
@pytest.mark.parametrize("method, arg, expected", [
    ("assign", np.array([5.0, 6.0, 7.0]), [5, 6, 7]),
    ("assign_add", np.array([1.0, 1.0, 1.0]), [2, 3, 4]),
    ("assign_sub", np.ones(3, np.float32), [0, 1, 2]),
])
def test_updates_write_into_the_same_buffer_when_nobody_holds_it(n, method, arg, expected):
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)]) if n else None
    if strategy:
        with strategy.scope():
            v = md.Variable(np.array([1.0, 2.0, 3.0], np.float32), aggregation=md.VariableAggregation.MEAN)
    else:
        v = md.Variable(np.array([1.0, 2.0, 3.0], np.float32))  # outside any strategy: one plain variable
    address = _address(v)
    getattr(v, method)(arg)
    assert _address(v) == address
    np.testing.assert_array_equal(v.numpy(), expected)
    assert v.dtype == np.float32
    if strategy:
        assert all(np.array_equal(np.asarray(c), expected) for c in v.values)


@pytest.mark.parametrize("read", [lambda v: v.read_value(), lambda v: v.read_value()[1:], lambda v: np.asarray(v),
                                  lambda v: v.value()])
def test_an_array_read_before_an_update_keeps_its_value(read):
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        v = md.Variable(np.array([1.0, 2.0, 3.0]), aggregation=md.VariableAggregation.SUM)
    held = read(v)
    before = np.array(held, copy=True)
    v.assign([9.0, 9.0, 9.0])
    np.testing.assert_array_equal(held, before)
    np.testing.assert_array_equal(v.numpy(), [9, 9, 9])
    del held
    address = _address(v)
    v.assign_add([1.0, 1.0, 1.0])  # nothing holds the new buffer: in place again
    assert _address(v) == address


def test_inside_run_a_read_is_the_replicas_own_copy_and_in_replica_assigns_stay_in_sync():
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        v = md.Variable(np.zeros(2), aggregation=md.VariableAggregation.MEAN)
    addresses = [c.read_value().ctypes.data for c in v.values]

    def step():
        rid = md.get_replica_context().replica_id_in_sync_group
        mine = v.read_value()
        assert mine is v.values[rid].read_value()
        v.assign_add(np.full(2, float(rid)))  # MEAN of 0, 1, 2 -> +1 on every copy
        return mine.ctypes.data

    seen = strategy.experimental_local_results(strategy.run(step))
    assert list(seen) == addresses
    for c in v.values:
        np.testing.assert_array_equal(np.asarray(c), [1, 1])


def test_assign_copies_the_value_it_is_given():
    v = md.Variable(np.zeros(3))
    source = np.ones(3)
    v.assign(source)
    source[:] = 7
    np.testing.assert_array_equal(v.numpy(), [1, 1, 1])
    v.assign(v.read_value()[::-1] + np.array([0.0, 1.0, 2.0]))  # a value computed from the buffer itself
    np.testing.assert_array_equal(v.numpy(), [1, 2, 3])
