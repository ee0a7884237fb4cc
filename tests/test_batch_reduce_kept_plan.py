"""``extended.batch_reduce_to`` of one ``(v, v)`` pair, repeated, runs the all-reduce plan its first call
kept (MirroredExtended._batch_reduce_to). Whatever differs from the call the plan was kept for — shape,
dtype, layout or type of an array, the op, the destinations, the options, the cross-device ops, the
value's devices — gives what a first call gives: NumPy's reduction, on the devices TF puts it, through a
user's CrossDeviceOps where there is one. Each test makes the plan first, then changes one thing."""

import json

import numpy as np
import pytest

import mirrored as md
from mirrored import timeline
from mirrored.collective import plan as plan_cache

N = 3
REFERENCE = {"SUM": np.sum, "MEAN": np.mean, "MIN": np.min, "MAX": np.max, "PROD": np.prod}


def _strategy(ops=None, n=N, first=0):
    return md.MirroredStrategy([f"/cpu:{i}" for i in range(first, first + n)], ops)


def _value(s, shape=(2,), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return s.experimental_distribute_values_from_function(
        lambda ctx: rng.integers(1, 5, shape).astype(dtype))


def _expected(op, v, s):
    """NumPy's reduction in the dtype the collectives give: the inputs' (in native byte order); MEAN of
    integers: float64."""
    stacked = np.stack(s.experimental_local_results(v))
    expected = REFERENCE[op](stacked, axis=0)
    if op == "MEAN" and stacked.dtype.kind in "iu":
        return expected
    return expected.astype(stacked.dtype.newbyteorder("="))


def _check(s, result, op, v, devices=None):
    """``result`` is the Mirrored of op over v's components, a new array on every one of ``devices``."""
    assert isinstance(result, md.Mirrored)
    assert result._devices == tuple(devices or s.extended.worker_devices)
    expected = _expected(op, v, s)
    inputs = s.experimental_local_results(v)
    for got in s.experimental_local_results(result):
        got = np.asarray(got)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-6)
        assert not any(np.shares_memory(got, a) for a in inputs)


def _kept(s, op="SUM", **value):
    """A strategy's value whose one-pair batch_reduce_to has kept its plan (asserted)."""
    v = _value(s, **value)
    for _ in range(2):
        _check(s, s.extended.batch_reduce_to(op, [(v, v)])[0], op, v)
    ops, native = s.extended._native_all_reduces[id(md.ReduceOp[op])]
    assert ops is s.extended._cross_device_ops and native._plan is not None
    return v


class _Counting:
    """Counts the cross-device ops' batch_reduce calls."""

    def __init__(self, monkeypatch, s):
        self.batches = 0
        ops = s.extended._cross_device_ops
        batch_reduce = ops.batch_reduce

        def counted(*a, **k):
            self.batches += 1
            return batch_reduce(*a, **k)

        monkeypatch.setattr(ops, "batch_reduce", counted)  # (the instance: its class still takes the route)


def test_a_repeated_call_is_one_run_of_the_kept_plan(monkeypatch):
    s = _strategy()
    v = _kept(s)
    runs = []
    ops, native = s.extended._native_all_reduces[id(md.ReduceOp.SUM)]
    kept = native._plan

    class Spy:
        def run(self, buffers, out):
            runs.append(buffers)
            return kept.run(buffers, out)

    native._plan = Spy()
    monkeypatch.setattr(plan_cache, "lookup", lambda *a: pytest.fail("the plan cache was asked"))
    _check(s, s.extended.batch_reduce_to(md.ReduceOp.SUM, [(v, v)])[0], "SUM", v)
    assert len(runs) == 1 and list(runs[0]) == list(s.experimental_local_results(v))


@pytest.mark.parametrize("shape,dtype", [((3,), np.float32), ((2, 1), np.float32), ((), np.float32),
                                         ((0,), np.float32), ((2,), np.float64), ((2,), np.int32),
                                         ((2,), np.float16), ((2,), ">f4")])
@pytest.mark.parametrize("op", ["SUM", "MAX"])
def test_another_shape_or_dtype_is_reduced_as_a_first_call(shape, dtype, op):
    s = _strategy()
    _kept(s, op)
    v = _value(s, shape, dtype, seed=1)
    for _ in range(2):  # the other signature's first call, and its own kept plan
        _check(s, s.extended.batch_reduce_to(op, [(v, v)])[0], op, v)
    old = _value(s, seed=2)  # and back
    _check(s, s.extended.batch_reduce_to(op, [(old, old)])[0], op, old)


@pytest.mark.parametrize("op", ["MEAN", "MIN", "MAX", "PROD"])
def test_another_op_is_not_the_kept_sum(op):
    s = _strategy()
    v = _kept(s, "SUM")
    for _ in range(2):
        _check(s, s.extended.batch_reduce_to(op, [(v, v)])[0], op, v)
    _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)


def test_the_mean_of_integers_after_their_sum_is_a_float64_mean():
    s = _strategy()
    v = _kept(s, "SUM", dtype=np.int32)
    for _ in range(2):
        got = s.experimental_local_results(s.extended.batch_reduce_to("MEAN", [(v, v)])[0])
        for a in got:
            assert a.dtype == np.float64
            np.testing.assert_allclose(a, np.stack(s.experimental_local_results(v)).mean(axis=0))


def test_arrays_that_stop_fitting_the_plan_are_reduced_as_they_are():
    s = _strategy()
    v = _kept(s, shape=(4,))
    base = [np.arange(8.0, dtype=np.float32) * (r + 1) for r in range(N)]
    strided = md.PerReplica([b[::2] for b in base])  # same shape and dtype, not contiguous
    _check(s, s.extended.batch_reduce_to("SUM", [(strided, strided)])[0], "SUM", strided)

    class Sub(np.ndarray):
        pass

    sub = md.PerReplica([np.full(4, r + 1.0, np.float32).view(Sub) for r in range(N)])
    _check(s, s.extended.batch_reduce_to("SUM", [(sub, sub)])[0], "SUM", sub)
    readonly = [np.full(4, r + 1.0, np.float32) for r in range(N)]
    for a in readonly:
        a.flags.writeable = False
    ro = md.PerReplica(readonly)
    _check(s, s.extended.batch_reduce_to("SUM", [(ro, ro)])[0], "SUM", ro)
    _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)


def test_results_are_fresh_and_inputs_are_read_at_each_call():
    s = _strategy()
    v = _kept(s)
    first = [a.copy() for a in s.experimental_local_results(s.extended.batch_reduce_to("SUM", [(v, v)])[0])]
    held = s.experimental_local_results(s.extended.batch_reduce_to("SUM", [(v, v)])[0])
    for a in s.experimental_local_results(v):
        a += 10  # in place: the same arrays, so the same plan
    again = s.extended.batch_reduce_to("SUM", [(v, v)])[0]
    _check(s, again, "SUM", v)
    for a, b in zip(held, first):  # the earlier results are not reused
        np.testing.assert_array_equal(a, b)


def test_other_destinations_take_the_cross_device_ops_and_land_there(monkeypatch):
    s = _strategy()
    v = _kept(s)
    count = _Counting(monkeypatch, s)
    one = s.extended.batch_reduce_to("SUM", [(v, "/cpu:1")])[0]  # one device: the array itself, as TF's
    assert type(one) is np.ndarray
    np.testing.assert_allclose(one, _expected("SUM", v, s))
    two = s.extended.batch_reduce_to("SUM", [(v, ["/cpu:2", "/cpu:0"])])[0]
    _check(s, two, "SUM", v, devices=tuple(md.device_util.canonicalize(d) for d in ("/cpu:2", "/cpu:0")))
    same = s.extended.batch_reduce_to("SUM", [(v, list(s.extended.worker_devices))])[0]
    _check(s, same, "SUM", v)
    with s.scope():
        var = md.Variable(np.zeros(2, np.float32))
    _check(s, s.extended.batch_reduce_to("SUM", [(v, var)])[0], "SUM", v)
    assert count.batches == 4


def test_a_mirrored_variable_value_is_reduced_from_its_copies():
    s = _strategy()
    v = _kept(s)
    with s.scope():
        var = md.Variable(np.arange(2, dtype=np.float32))
    for _ in range(2):
        got = s.extended.batch_reduce_to("SUM", [(var, var)])[0]
        for a in s.experimental_local_results(got):
            np.testing.assert_allclose(np.asarray(a), N * np.arange(2))
    _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)


def test_options_take_the_cross_device_ops(monkeypatch):
    s = _strategy()
    v = _kept(s)
    count = _Counting(monkeypatch, s)
    for options in (md.CommunicationOptions(), md.CommunicationOptions(bytes_per_pack=64)):
        _check(s, s.extended.batch_reduce_to("SUM", [(v, v)], options=options)[0], "SUM", v)
    assert count.batches == 2
    _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)
    assert count.batches == 2


class _UserOps(md.cross_device_ops.CrossDeviceOps):
    """A pluggable CrossDeviceOps: every reduction its own, in NumPy, counted."""

    def __init__(self):
        self.calls = 0

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.calls += 1
        values = [np.asarray(a) for a in per_replica_value.values]
        total = REFERENCE[md.ReduceOp(reduce_op).value](np.stack(values), axis=0).astype(values[0].dtype)
        devices = md.cross_device_ops.get_devices_from(destinations)
        return md.Mirrored([total.copy() for _ in devices], devices)


def test_other_cross_device_ops_are_used_not_the_plan_kept_with_the_first():
    s = _strategy()
    v = _kept(s)
    user = _UserOps()
    s.extended._cross_device_ops = user
    for k in range(1, 3):
        _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)
        assert user.calls == k
    ring = md.cross_device_ops.RingAllReduce()
    s.extended._cross_device_ops = ring
    for _ in range(2):
        _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)
    assert user.calls == 2
    ops, native = s.extended._native_all_reduces[id(md.ReduceOp.SUM)]
    assert ops is ring and native._plan is not None


def test_a_strategy_with_a_users_ops_beside_one_with_a_kept_plan():
    kept = _strategy()
    v = _kept(kept)
    user = _UserOps()
    other = _strategy(user)
    w = _value(other)
    for k in range(1, 3):
        _check(other, other.extended.batch_reduce_to("SUM", [(w, w)])[0], "SUM", w)
        assert user.calls == k
    _check(kept, kept.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)
    assert user.calls == 2


def test_a_per_replica_of_other_devices_stays_on_them():
    s = _strategy()
    _kept(s)
    other = _strategy(first=2)
    w = _value(other, seed=3)
    assert w._devices != s.extended.worker_devices
    for _ in range(2):
        _check(other, s.extended.batch_reduce_to("SUM", [(w, w)])[0], "SUM", w, devices=w._devices)
    bare = md.PerReplica(list(other.experimental_local_results(w)))  # no devices: the strategy's own
    _check(s, s.extended.batch_reduce_to("SUM", [(bare, bare)])[0], "SUM", bare)


def test_a_recording_timeline_sees_a_repeated_call(tmp_path):
    s = _strategy()
    v = _kept(s)
    path = tmp_path / "trace.json"
    timeline.start(path)
    try:
        _check(s, s.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", v)
    finally:
        timeline.stop()
    with open(path) as f:
        names = {e["name"] for e in json.load(f) if e.get("cat") == "collective"}
    assert "all_reduce" in names


def test_components_that_are_lists_of_arrays_are_refused_as_the_cross_device_ops_refuse_them():
    s = _strategy()
    _kept(s, shape=(1, 2))
    lists = md.PerReplica([[np.full(2, r + 1.0, np.float32)] for r in range(N)], s.extended.worker_devices)
    with pytest.raises(ValueError, match="unsupported type") as direct:
        s.extended._cross_device_ops.batch_reduce("SUM", [(lists, lists)])
    for _ in range(2):
        with pytest.raises(ValueError, match="unsupported type") as error:
            s.extended.batch_reduce_to("SUM", [(lists, lists)])
        assert str(error.value) == str(direct.value)
