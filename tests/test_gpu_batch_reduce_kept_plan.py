"""GPU replicas' ``extended.batch_reduce_to`` of one ``(v, v)`` pair, repeated, runs the all-reduce plan its
first call kept; what differs from that call (shape, dtype, op, the arrays' GPUs or memory, the
destinations, the value's devices) gives a first call's results: NumPy's reduction, each replica's on
its own GPU (marker ``gpu``: simulated GPUs without a GPU, see gpu_env.py)."""

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy, needs_gpus

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402

REFERENCE = {"SUM": np.sum, "MEAN": np.mean, "MAX": np.max}


@pytest.fixture(params=["two GPUs", "three replicas of GPU 0"])
def strategy(request):
    if request.param == "two GPUs":
        if cupy.cuda.runtime.getDeviceCount() < 2:
            pytest.skip("needs two GPUs")
        yield md.MirroredStrategy(["/gpu:0", "/gpu:1"], md.cross_device_ops.RingAllReduce())
        return
    md.config.set_logical_device_configuration("GPU", 0, count=3)
    try:
        yield md.MirroredStrategy(["/gpu:0", "/gpu:1", "/gpu:2"], md.cross_device_ops.RingAllReduce())
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


def _ordinals(s):
    return [md.device_util.physical_ordinal(d) for d in s.extended.worker_devices]


def _value(s, shape=(2,), dtype=np.float32, seed=0, gpus=None):
    """A PerReplica of CuPy arrays, replica r's on GPU ``gpus[r]`` (default: its own)."""
    rng = np.random.default_rng(seed)
    gpus = gpus or _ordinals(s)
    host = [rng.integers(1, 5, shape).astype(dtype) for _ in gpus]
    arrays = []
    for h, g in zip(host, gpus):
        with cupy.cuda.Device(g):
            arrays.append(cupy.asarray(h))
    return md.PerReplica(arrays, s.extended.worker_devices), host


def _check(s, result, op, host):
    assert isinstance(result, md.Mirrored) and result._devices == s.extended.worker_devices
    expected = REFERENCE[op](np.stack(host), axis=0)
    if not (op == "MEAN" and host[0].dtype.kind in "iu"):
        expected = expected.astype(host[0].dtype)
    for got, ordinal in zip(s.experimental_local_results(result), _ordinals(s)):
        assert isinstance(got, cupy.ndarray) and got.device.id == ordinal
        assert got.dtype == expected.dtype
        np.testing.assert_allclose(cupy.asnumpy(got), expected, rtol=1e-6)


def _kept(s, op="SUM"):
    v, host = _value(s)
    for _ in range(2):
        _check(s, s.extended.batch_reduce_to(op, [(v, v)])[0], op, host)
    ops, native = s.extended._native_all_reduces[id(md.ReduceOp[op])]
    assert ops is s.extended._cross_device_ops and native._plan is not None
    return v, host


@pytest.mark.parametrize("shape,dtype", [((3,), np.float32), ((2, 2), np.float32), ((2,), np.float64),
                                         ((2,), np.int32)])
def test_another_shape_or_dtype_is_reduced_as_a_first_call(strategy, shape, dtype):
    _kept(strategy)
    v, host = _value(strategy, shape, dtype, seed=1)
    for _ in range(2):
        _check(strategy, strategy.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", host)


@pytest.mark.parametrize("op", ["MEAN", "MAX"])
def test_another_op_is_not_the_kept_sum(strategy, op):
    v, host = _kept(strategy)
    for _ in range(2):
        _check(strategy, strategy.extended.batch_reduce_to(op, [(v, v)])[0], op, host)


def test_arrays_elsewhere_are_moved_to_their_replicas_gpus(strategy):
    _kept(strategy)
    ordinals = _ordinals(strategy)
    others = [1 - o if cupy.cuda.runtime.getDeviceCount() > 1 else o for o in ordinals]
    v, host = _value(strategy, seed=2, gpus=others)
    _check(strategy, strategy.extended.batch_reduce_to("SUM", [(v, v)])[0], "SUM", host)
    strided = md.PerReplica([a[::2] for a in _value(strategy, (4,), seed=3)[0].values],
                            strategy.extended.worker_devices)
    _check(strategy, strategy.extended.batch_reduce_to("SUM", [(strided, strided)])[0], "SUM",
           [cupy.asnumpy(a) for a in strided.values])
    rng = np.random.default_rng(4)
    on_host = [rng.integers(1, 5, 2).astype(np.float32) for _ in ordinals]
    numpy_value = md.PerReplica(on_host, strategy.extended.worker_devices)
    _check(strategy, strategy.extended.batch_reduce_to("SUM", [(numpy_value, numpy_value)])[0], "SUM", on_host)


def test_the_host_as_destination_gets_a_host_array(strategy):
    v, host = _kept(strategy)
    got = strategy.extended.batch_reduce_to("SUM", [(v, "/cpu:0")])[0]
    assert type(got) is np.ndarray
    np.testing.assert_allclose(got, np.sum(np.stack(host), axis=0))


@needs_gpus(2)
def test_a_per_replica_of_other_gpus_stays_on_them():
    s = md.MirroredStrategy(["/gpu:0", "/gpu:1"], md.cross_device_ops.RingAllReduce())
    _kept(s)
    swapped = md.MirroredStrategy(["/gpu:1", "/gpu:0"], md.cross_device_ops.RingAllReduce())
    v, host = _value(swapped, seed=5)
    for _ in range(2):
        got = s.extended.batch_reduce_to("SUM", [(v, v)])[0]
        assert got._devices == swapped.extended.worker_devices
        for a, ordinal in zip(swapped.experimental_local_results(got), (1, 0)):
            assert a.device.id == ordinal
            np.testing.assert_allclose(cupy.asnumpy(a), np.sum(np.stack(host), axis=0))
