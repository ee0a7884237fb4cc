"""The short cuts of the CPU hot path give what the long way gives.

``extended.batch_reduce_to`` of ``(v, v)`` pairs of NumPy arrays goes straight
to the native fused all-reduce (MirroredExtended._fused_all_reduce); every
other pair takes the cross-device ops' ``batch_reduce``. And runs read the CPU
clock only after a step took long: a series of computing steps still ends up
on the replica threads.
"""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from mirrored.distribute import mirrored_strategy

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8]
OPS = [md.ReduceOp.SUM, md.ReduceOp.MEAN, md.ReduceOp.MIN, md.ReduceOp.MAX]


def _strategy(n):
    return md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 5), dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       shapes=st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_batch_reduce_to_matches_numpy_and_the_cross_device_ops(n, dtype, op, shapes, seed):
    if op is md.ReduceOp.MEAN and np.dtype(dtype).kind in "iu":
        op = md.ReduceOp.SUM
    s = _strategy(n)
    rng = np.random.default_rng(seed)
    values = [s.experimental_distribute_values_from_function(
        lambda ctx, shape=shape: (rng.integers(0, 5, shape)).astype(dtype)) for shape in shapes]
    fused = s.extended.batch_reduce_to(op, [(v, v) for v in values])
    long_way = s.extended._cross_device_ops.batch_reduce(op, [(v, v) for v in values])
    reduce = {md.ReduceOp.SUM: np.sum, md.ReduceOp.MEAN: np.mean, md.ReduceOp.MIN: np.min,
              md.ReduceOp.MAX: np.max}[op]
    for v, got, ref in zip(values, fused, long_way):
        assert isinstance(got, md.Mirrored)
        stacked = np.stack(s.experimental_local_results(v))
        expected = reduce(stacked, axis=0) if stacked.size else np.zeros(stacked.shape[1:])
        assert got._devices == s.extended.worker_devices
        for a, b in zip(s.experimental_local_results(got), s.experimental_local_results(ref)):
            assert a.dtype == b.dtype == np.dtype(dtype) and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, expected.astype(dtype), rtol=1e-2 if dtype == np.float16 else 1e-6)
    outs = [a for got in fused for a in s.experimental_local_results(got)]
    ins = [a for v in values for a in s.experimental_local_results(v)]
    assert not any(np.shares_memory(o, i) for o in outs for i in ins)  # fresh results, as the long way's


def test_batch_reduce_to_takes_the_long_way_for_other_pairs(monkeypatch):
    s = _strategy(3)
    x = s.experimental_distribute_values_from_function(lambda ctx: np.full(2, ctx.replica_id_in_sync_group + 1.0))
    with s.scope():
        var = md.Variable(np.ones(2))
    calls = []
    cdo = s.extended._cross_device_ops
    original = cdo.batch_reduce

    def spy(*a, **k):
        calls.append(a)
        return original(*a, **k)

    monkeypatch.setattr(cdo, "batch_reduce", spy)  # (on the instance: a class that reroutes it gets no short cut)
    np.testing.assert_array_equal(s.experimental_local_results(s.extended.batch_reduce_to("sum", [(x, x)])[0])[0],
                                  np.full(2, 6.0))
    assert not calls  # the fused short cut
    other = s.extended.batch_reduce_to("sum", [(x, s.extended.worker_devices[0])])  # destinations not x's own
    np.testing.assert_array_equal(np.asarray(s.experimental_local_results(other[0])[0]), np.full(2, 6.0))
    mean_var = s.extended.batch_reduce_to("mean", [(var, var)])  # a variable's copies
    np.testing.assert_array_equal(s.experimental_local_results(mean_var[0])[0], np.ones(2))
    s.extended.batch_reduce_to("sum", [(x, x)], options=md.CommunicationOptions())  # options: the long way
    assert len(calls) == 3


def test_a_series_of_computing_steps_still_ends_up_on_the_replica_threads():
    s = _strategy(3)
    s.run(lambda: None)
    pool = s.extended._pool
    assert not pool._read_cpu  # short steps read no CPU clock

    def compute():
        end = time.thread_time() + 2 * mirrored_strategy.HANDOFF_SECONDS
        while time.thread_time() < end:  # CPU-bound, longer than the hand-off threshold
            pass
        return threading.get_ident()

    idents = [set(s.experimental_local_results(s.run(compute))) for _ in range(2)]
    assert pool._read_cpu and pool._long_steps
    # Once steps are long, each wakes the replica threads as it starts; they take the replicas the
    # caller has not begun, so the steps run in parallel (on a busy machine a thread may start
    # late and the caller take a replica more itself: a few steps show it).
    for _ in range(20):
        idents.append(set(s.experimental_local_results(s.run(compute))))
        if len(idents[-1]) > 1:
            break
    assert len(idents[-1]) > 1, idents
