"""A replica context's all_reduce on CPU replicas goes straight to the built-in native ops when
nothing reroutes them, and through batch_reduce_to otherwise: the same results either way, and
a user's CrossDeviceOps (or a subclass that overrides the batch path) still sees every call."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from recording_ops import RecordingImplementation

OPS = ["SUM", "MEAN", "MIN", "MAX", "PROD"]
DTYPES = ["float32", "float64", "int32", "int64", "float16", "uint8"]


def cpus(n):
    return [f"/cpu:{i}" for i in range(n)]


_STRATEGIES = {n: md.MirroredStrategy(cpus(n)) for n in (2, 3, 4)}


def replica_id():
    return md.get_replica_context().replica_id_in_sync_group


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([2, 3, 4]), op=st.sampled_from(OPS), dtypes=st.lists(st.sampled_from(DTYPES), min_size=1,
                                                                               max_size=4),
       shape=st.lists(st.integers(0, 3), max_size=2), nested=st.booleans(), seed=st.integers(0, 2**16))
def test_the_direct_route_gives_what_batch_reduce_to_gives(n, op, dtypes, shape, nested, seed):
    rng = np.random.default_rng(seed)
    per_replica = [[rng.integers(0, 4, size=shape).astype(d) for d in dtypes] for _ in range(n)]
    s = _STRATEGIES[n]

    def step():
        leaves = per_replica[replica_id()]
        value = {"a": leaves[0], "rest": tuple(leaves[1:])} if nested else leaves[0]
        return md.get_replica_context().all_reduce(op, value)

    got = s.experimental_local_results(s.run(step))
    taken = dtypes if nested else dtypes[:1]
    pairs = [(md.PerReplica([per_replica[r][t] for r in range(n)]),) * 2 for t in range(len(taken))]
    want = [s.experimental_local_results(m) for m in s.extended.batch_reduce_to(op, pairs)]
    for r in range(n):
        leaves = [got[r]["a"], *got[r]["rest"]] if nested else [got[r]]
        for t, leaf in enumerate(leaves):
            assert leaf.dtype == want[t][r].dtype and leaf.shape == want[t][r].shape
            np.testing.assert_array_equal(leaf, want[t][r])


def test_results_are_new_arrays_the_inputs_can_change_under():
    s = _STRATEGIES[3]
    xs = [np.full(4, r + 1, np.float32) for r in range(3)]
    out = s.experimental_local_results(s.run(lambda: md.get_replica_context().all_reduce("sum", xs[replica_id()])))
    for x in xs:
        x[:] = 100
    for o in out:
        assert all(o is not x for x in xs)
        np.testing.assert_array_equal(o, np.full(4, 6, np.float32))


def test_a_repeated_all_reduce_whose_arrays_stop_fitting_its_plan_is_still_right():
    """The direct route runs the plan of its latest call straight; arrays that no longer fit it (a strided
    view, the other byte order, another dtype or shape) are validated afresh, and the results stay right."""
    s = _STRATEGIES[2]
    made = [lambda r: np.full(4, r + 1, np.float32)] * 2 + [
        lambda r: np.full(8, r + 1, np.float32)[::2], lambda r: np.full(4, r + 1, ">f4"),
        lambda r: np.full(4, r + 1, np.float64), lambda r: np.full((2, 2), r + 1, np.float32),
        lambda r: np.full(4, r + 1, np.float32)]
    for make in made:
        out = s.experimental_local_results(s.run(lambda: md.get_replica_context().all_reduce("sum", make(replica_id()))))
        want = make(0) * 3
        for o in out:
            assert o.shape == want.shape and o.dtype == want.dtype.newbyteorder("=")
            np.testing.assert_array_equal(o, want)


class RecordingBatchReduce(md.cross_device_ops.RingAllReduce):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        self.calls += 1
        return super().batch_reduce(reduce_op, value_destination_pairs, options)


class Doubling(md.cross_device_ops.CrossDeviceOps):
    """A user's ops whose batch result differs from a plain sum: the route must reach it."""

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return [md.Mirrored([np.sum(v.values, axis=0) * 2] * len(v.values), v._devices)
                for v, _ in value_destination_pairs]


@pytest.mark.parametrize("ops", [RecordingImplementation, RecordingBatchReduce])
def test_a_subclass_overriding_the_batch_path_sees_every_replica_all_reduce(ops):
    cdo = ops()
    s = md.MirroredStrategy(cpus(2), cross_device_ops=cdo)
    xs = [np.ones(3, np.float32), np.full(3, 2, np.float32)]
    for step in range(3):
        out = s.run(lambda: md.get_replica_context().all_reduce("sum", xs[replica_id()]))
        for o in s.experimental_local_results(out):
            np.testing.assert_array_equal(o, np.full(3, 3, np.float32))
        assert cdo.calls == step + 1


def test_a_user_cross_device_ops_decides_the_replica_all_reduce():
    s = md.MirroredStrategy(cpus(2), cross_device_ops=Doubling())
    xs = [np.ones(3), np.full(3, 2.0)]
    out = s.run(lambda: md.get_replica_context().all_reduce("sum", xs[replica_id()]))
    for o in s.experimental_local_results(out):
        np.testing.assert_array_equal(o, np.full(3, 6.0))


def test_variables_as_leaves_take_the_batch_reduce_to_route_and_are_right():
    s = _STRATEGIES[2]
    with s.scope():
        v = md.Variable(np.arange(3, dtype=np.float32), synchronization=md.VariableSynchronization.ON_READ,
                        aggregation=md.VariableAggregation.SUM)

    def step():
        v.assign(np.full(3, replica_id() + 1, np.float32))
        return md.get_replica_context().all_reduce("sum", [v, np.ones(3, np.float32)])

    out = s.experimental_local_results(s.run(step))
    for reduced_v, reduced_ones in out:
        np.testing.assert_array_equal(np.asarray(reduced_v), np.full(3, 3, np.float32))
        np.testing.assert_array_equal(reduced_ones, np.full(3, 2, np.float32))
