"""The GPU plans' native check (csrc/bindings/device_fit.h): a repeated all_reduce, broadcast or
batch_all_reduce of GPU buffers runs its cached plan only when every array is exactly the planned
CuPy array type with the planned dtype, shape and strides, on its replica's GPU, with device
memory; anything else is validated afresh, so it is either planned again (and right, as NumPy says)
or refused with the same clear error as a first call, never run on the wrong buffers. On real
GPUs or the simulated ones (gpu_env.py)."""

import numpy as np
import pytest

from gpu_env import NGPU, SIMULATED, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from mirrored import collectives  # noqa: E402
from mirrored.collective import cuda as cc, plan as face  # noqa: E402

REPLICAS = (2, 3, 4)
SHAPES = [(1,), (7,), (3, 5), (2, 1, 4)]
DTYPES = [np.float32, np.float64, np.int32, np.float16]
NP_OPS = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def devices_of(n):
    """Replicas spread over the GPUs (logical GPUs where there is one)."""
    return tuple(r % NGPU for r in range(n))


def on(device, host):
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def inputs(devices, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    host = [rng.integers(-3, 4, shape).astype(dtype) for _ in devices]
    return host, [on(d, h) for d, h in zip(devices, host)]


def assert_all_reduced(out, host, op, devices):
    want = NP_OPS[op](np.stack(host), axis=0).astype(host[0].dtype)
    assert len(out) == len(devices)
    for got, d in zip(out, devices):
        assert type(got) is cupy.ndarray and got.data.device_id == d
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def planned(kind, params, buffers):
    plan = face.lookup(kind, params, buffers)
    assert isinstance(plan, cc.CallPlan), plan
    return plan


class NoMemory(cupy.ndarray):
    """A CuPy array type whose ``data`` is None (as a freed or never-allocated one would read)."""

    data = property(lambda self: None)


def without_memory(a):
    """``a`` with no device memory: ``data`` None on an array of the very planned type where the stand-in
    allows it (the native check meets it), else on a subclass (the validating path meets it)."""
    if SIMULATED:
        b = a.reshape(a.shape)
        b.data = None
        return b
    return NoMemory(a.shape, a.dtype, memptr=a.data)


def null_pointer(a):
    """An array like ``a`` whose data pointer is 0 (not device memory)."""
    memory = cupy.cuda.UnownedMemory(0, a.nbytes, None, a.data.device_id)
    return cupy.ndarray(a.shape, a.dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_repeated_calls_run_the_plan_and_match_numpy(n, shape, dtype):
    devices = devices_of(n)
    for seed, op in enumerate(["sum", "max", "sum", "min", "prod", "sum"]):
        host, xs = inputs(devices, shape, dtype, seed)
        assert_all_reduced(collectives.all_reduce(xs, op), host, op, devices)
        planned("all_reduce", (op, "auto", 0), xs)
    # out= (a tuple of outputs), in place, and a broadcast, each planned then repeated on new arrays
    for seed in range(3):
        host, xs = inputs(devices, shape, dtype, 10 + seed)
        outs = tuple(on(d, np.zeros(shape, dtype)) for d in devices)
        got = collectives.all_reduce(tuple(xs), "sum", out=outs)
        assert isinstance(got, list) and all(g is o for g, o in zip(got, outs))
        assert_all_reduced(got, host, "sum", devices)
        assert_all_reduced(collectives.all_reduce(xs, "max", out=xs), host, "max", devices)
        host, xs = inputs(devices, shape, dtype, 20 + seed)
        out = collectives.broadcast(xs, n - 1)
        for got, d in zip(out, devices):
            assert got.data.device_id == d
            np.testing.assert_array_equal(cupy.asnumpy(got), host[n - 1])
    planned("broadcast", (n - 1, "auto"), xs)


@pytest.mark.parametrize("n", REPLICAS)
def test_results_of_replicas_sharing_a_gpu_are_their_own_arrays(n):
    devices = (0,) * n
    host, xs = inputs(devices, (5,), np.float32, 0)
    first = collectives.all_reduce(xs)
    second = collectives.all_reduce(xs)  # the plan's outputs: fresh every call, one per replica
    assert_all_reduced(first, host, "sum", devices)
    assert_all_reduced(second, host, "sum", devices)
    pointers = [a.data.ptr for a in first + second]
    assert len(set(pointers)) == 2 * n
    first[0] += 1  # writing one replica's result leaves the others alone
    for a in first[1:] + second:
        np.testing.assert_array_equal(cupy.asnumpy(a), np.sum(host, 0))


def misfits(xs, k, devices):
    """(name, replacement for replica k's array, the error a validated call raises or None: planned again)."""
    a = xs[k]
    other = (devices[k] + 1) % NGPU
    cases = [
        ("dtype", a.astype(cupy.float64 if a.dtype != np.float64 else cupy.float32), (TypeError, "same dtype")),
        ("shape", on(devices[k], np.ones(a.size + 1, a.dtype)), (ValueError, "same shape")),
        ("strides", on(devices[k], np.ones((a.size, 2), a.dtype))[:, 0].reshape(a.shape), None),
        ("host array", cupy.asnumpy(a), (TypeError, r"\[%d\] is a host array" % k)),
        ("not an array", [1.0] * a.size, (TypeError, r"\[%d\] is list; expected a CuPy array" % k)),
        ("no memory", without_memory(a), (ValueError, r"\[%d\] has no device memory" % k)),
        ("null pointer", null_pointer(a), (ValueError, r"\[%d\] has no device memory" % k)),
    ]
    if k == 0:  # a host buffer 0 makes the call a host one, which refuses the GPU buffers after it
        host_call = (TypeError, r"buffers\[1\] is a GPU array but buffers\[0\] is a host array")
        # (and an array without memory there cannot say it is on a GPU: the call is not a GPU call)
        cases = [(name, bad, host_call if name in ("host array", "not an array") else error)
                 for name, bad, error in cases if name != "no memory"]
    if other != devices[k]:
        cases.append(("device", on(other, cupy.asnumpy(a)), None))
    return cases


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("shape", [(6,), (2, 3)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=lambda d: np.dtype(d).name)
def test_an_array_that_does_not_fit_is_validated_afresh(n, shape, dtype):
    devices = devices_of(n)
    for k in range(n):  # (replica 0 names the signature: a misfit there finds no plan or another one)
        host, xs = inputs(devices, shape, dtype, k)
        assert_all_reduced(collectives.all_reduce(xs), host, "sum", devices)
        planned("all_reduce", ("sum", "auto", 0), xs)
        for name, bad, error in misfits(xs, k, devices):
            call = xs[:k] + [bad] + xs[k + 1:]
            if error is None:
                want_devices = tuple(b.data.device_id for b in call)
                got_host = host[:k] + [cupy.asnumpy(bad).reshape(shape)] + host[k + 1:]
                assert_all_reduced(collectives.all_reduce(call), got_host, "sum", want_devices)
            else:
                with pytest.raises(error[0], match=error[1]):
                    collectives.all_reduce(call)
            # and the plan still serves fitting calls, right
            assert_all_reduced(collectives.all_reduce(xs), host, "sum", devices)


@pytest.mark.parametrize("n", REPLICAS)
def test_an_output_that_does_not_fit_is_validated_afresh(n):
    devices = devices_of(n)
    host, xs = inputs(devices, (4,), np.float32, 0)
    outs = [on(d, np.zeros(4, np.float32)) for d in devices]
    assert_all_reduced(collectives.all_reduce(xs, out=outs), host, "sum", devices)
    k = n - 1
    for bad, error in [(on(devices[k], np.zeros(4, np.float64)), r"out\[%d\] has shape \(4,\) and dtype float64"),
                       (on(devices[k], np.zeros(5, np.float32)), r"out\[%d\] has shape \(5,\)"),
                       (np.zeros(4, np.float32), r"out\[%d\] is ndarray; out must hold GPU arrays")]:
        with pytest.raises((TypeError, ValueError), match=error % k):
            collectives.all_reduce(xs, out=outs[:k] + [bad])
    with pytest.raises(ValueError, match=r"out: expected a list of %d arrays" % n):
        collectives.all_reduce(xs, out=outs[:k])
    strided = on(devices[k], np.zeros((4, 2), np.float32))[:, 1]  # written in place through its strides
    got = collectives.all_reduce(xs, out=outs[:k] + [strided])
    assert got[k] is strided
    assert_all_reduced(got, host, "sum", devices)
    if NGPU > 1:
        elsewhere = on((devices[k] + 1) % NGPU, np.zeros(4, np.float32))
        with pytest.raises(ValueError, match=r"out\[%d\] is on GPU" % k):
            collectives.all_reduce(xs, out=outs[:k] + [elsewhere])


def batch(devices, shapes, dtypes, seed):
    rng = np.random.default_rng(seed)
    host = [[rng.integers(-3, 4, s).astype(dt) for s, dt in zip(shapes, dtypes)] for _ in devices]
    return host, [[on(d, h) for h in row] for d, row in zip(devices, host)]


def assert_batch_reduced(out, host, devices):
    assert len(out) == len(devices)
    for row, d in zip(out, devices):
        for t, got in enumerate(row):
            want = np.sum([h[t] for h in host], 0).astype(host[0][t].dtype)
            assert got.data.device_id == d and got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(cupy.asnumpy(got), want)


BATCH_SHAPES = [(3,), (2, 2), (0,), (5,)]
BATCH_DTYPES = [np.float32, np.float64, np.float32, np.int32]


@pytest.mark.parametrize("n", REPLICAS)
def test_a_batch_tensor_that_does_not_fit_is_validated_afresh(n):
    devices = devices_of(n)
    T = len(BATCH_SHAPES)
    for r, t in [(0, 1), (n - 1, T - 1), (n // 2, 0)]:
        host, lists = batch(devices, BATCH_SHAPES, BATCH_DTYPES, r * T + t)
        assert_batch_reduced(collectives.batch_all_reduce(lists), host, devices)
        assert isinstance(face.lookup_batch(("sum", 0, None, "auto", 0), lists), cc.BatchPlan)
        assert_batch_reduced(collectives.batch_all_reduce(lists), host, devices)  # the plan's run
        a = lists[r][t]
        column = r"per_replica_lists\[\*\]\[%d\]" % t
        cases = [("strides", on(devices[r], np.stack([cupy.asnumpy(a)] * 2, -1))[..., 0], None),
                 ("host array", cupy.asnumpy(a), (TypeError, column + r"\[%d\] is a host array" % r)),
                 ("no memory", without_memory(a), (ValueError, column + r"\[%d\] has no device memory" % r))]
        if a.size:
            cases.append(("null pointer", null_pointer(a), (ValueError, column + r"\[%d\] has no device memory" % r)))
        if (r, t) != (0, 0):  # (tensor 0 of replica 0 names the signature)
            cases.append(("dtype", a.astype(cupy.float16), (TypeError, column + r".*same dtype")))
            cases.append(("shape", on(devices[r], np.ones(a.size + 2, a.dtype)), (ValueError, column + r".*same shape")))
        for name, bad, error in cases:
            call = [list(row) for row in lists]
            call[r][t] = bad
            if error is None:
                assert_batch_reduced(collectives.batch_all_reduce(call), host, devices)
            else:
                with pytest.raises(error[0], match=error[1]):
                    collectives.batch_all_reduce(call)
            assert_batch_reduced(collectives.batch_all_reduce(lists), host, devices)
        with pytest.raises(ValueError):  # a replica short of a tensor
            collectives.batch_all_reduce([row if i != r else row[:-1] for i, row in enumerate(lists)])
        assert_batch_reduced(collectives.batch_all_reduce(tuple(tuple(row) for row in lists)), host, devices)


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_a_batch_on_other_gpus_than_planned_is_planned_again():
    host, lists = batch((0, 1), BATCH_SHAPES, BATCH_DTYPES, 0)
    assert_batch_reduced(collectives.batch_all_reduce(lists), host, (0, 1))
    moved = [[on(d, h) for h in row] for d, row in zip((1, 0), host)]
    assert_batch_reduced(collectives.batch_all_reduce(moved), host, (1, 0))
    one_moved = [list(row) for row in lists]
    one_moved[1][2] = on(0, host[1][2])
    with pytest.raises(ValueError, match=r"per_replica_lists\[\*\]\[2\] lies on GPUs"):
        collectives.batch_all_reduce(one_moved)
