"""A repeated batch all-reduce of GPU buffers runs the face's cached plan (collective/cuda.py's
BatchPlan): the same Python steps of mirrored and the same driver calls whatever the tensor count,
results as NumPy's, and any call that no longer fits the plan validated afresh. On real GPUs or the
simulated ones (gpu_env.py)."""

import gc
import sys

import numpy as np
import pytest

from gpu_env import NGPU, SIMULATED, SKIP_REASON, check_batch, cupy, launches_and_ops

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from mirrored import collectives  # noqa: E402
from mirrored.collective import cuda as cc, plan as face  # noqa: E402

# Replicas sharing GPU 0, and spread over two GPUs where there are two (always on the simulator).
DEVICE_SETS = [s for s in [(0, 0), (0, 1), (0, 1, 0, 1)] if max(s) < NGPU]
TWO = (0, 1) if NGPU > 1 else (0, 0)


def on(device, host):
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def make_batch(devices, sizes, dtypes, seed=0):
    rng = np.random.default_rng(seed)
    host = [[rng.integers(-3, 4, size).astype(dtype) for size, dtype in zip(sizes, dtypes)] for _ in devices]
    return host, [[on(d, x) for x in row] for d, row in zip(devices, host)]


def mirrored_steps(call):
    """(the number of mirrored's Python functions ``call`` enters, its result)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and "/mirrored/" in frame.f_code.co_filename:
            count += 1

    # Garbage left by earlier tests must not run its finalizers (mirrored's among them) inside the call.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count, result


def counted(call):
    """(launches per GPU, driver calls) of ``call`` on the simulated machine (None on real GPUs)."""
    if not SIMULATED:
        call()
        return None
    return launches_and_ops(call)


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=str)
def test_a_repeated_batch_takes_the_same_python_steps_and_driver_calls_for_10_and_200_tensors(devices):
    rng = np.random.default_rng(7)
    steps, driver = {}, {}
    for count in (10, 200):
        sizes = rng.integers(0, 300, count)
        dtypes = [np.float32 if t % 3 else np.float64 for t in range(count)]
        host, lists = make_batch(devices, sizes, dtypes, seed=count)
        check_batch(collectives.batch_all_reduce(lists, "sum"), host, "sum", devices)  # plans it
        assert isinstance(face.lookup_batch(("sum", 0, None, "auto", 0), lists), cc.BatchPlan)
        steps[count], out = mirrored_steps(lambda: collectives.batch_all_reduce(lists, "sum"))
        check_batch(out, host, "sum", devices)
        driver[count] = counted(lambda: collectives.batch_all_reduce(lists, "sum"))
    assert steps[10] == steps[200], steps
    assert steps[200] <= 30, steps  # the face, the plan's check and run, a few per GPU; none per tensor
    assert driver[10] == driver[200]


@pytest.mark.parametrize("devices", DEVICE_SETS, ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
@pytest.mark.parametrize("packing", [{}, {"num_packs": 3}, {"bytes_per_pack": 512}], ids=str)
def test_planned_batches_match_numpy_across_ops_dtypes_and_packing(devices, op, packing):
    sizes = [5, 0, 130, 1, 64, 33, 7]
    dtypes = [np.float32, np.float64, np.float16, np.float32, np.int32, np.int64, np.float32]
    if op == "mean":  # integer MEAN is a float64 division of the sums: its own rule, tested below
        dtypes = [np.float32, np.float64, np.float16, np.float32, np.float32, np.float64, np.float32]
    for seed in range(3):  # the first call plans; the others run the plan on new arrays
        host, lists = make_batch(devices, sizes, dtypes, seed)
        check_batch(collectives.batch_all_reduce(lists, op, **packing), host, op, devices)


def test_integer_mean_of_a_batch_is_float64_every_time():
    devices = TWO
    for seed in range(3):
        host, lists = make_batch(devices, [4, 9], [np.int32, np.int64], seed)
        check_batch(collectives.batch_all_reduce(lists, "mean"), host, "mean", devices)


def test_a_call_that_no_longer_fits_the_plan_is_validated_afresh():
    devices = TWO
    sizes, dtypes = [6, 8, 10], [np.float32] * 3
    host, lists = make_batch(devices, sizes, dtypes)
    check_batch(collectives.batch_all_reduce(lists, "sum"), host, "sum", devices)

    # another dtype for tensor 1 (the signature names tensor 0 only)
    host, lists = make_batch(devices, sizes, [np.float32, np.float64, np.float32], seed=1)
    check_batch(collectives.batch_all_reduce(lists, "sum"), host, "sum", devices)

    # a strided view for tensor 2: converted, still right
    host, lists = make_batch(devices, [6, 8, 20], dtypes, seed=2)
    strided = [[row[0], row[1], row[2][::2]] for row in lists]
    want_host = [[row[0], row[1], row[2][::2]] for row in host]
    check_batch(collectives.batch_all_reduce(strided, "sum"), want_host, "sum", devices)

    # one replica's tensor on the other replica's GPU: refused, naming the tensor (where there are two GPUs)
    if devices[0] != devices[1]:
        host, lists = make_batch(devices, sizes, dtypes, seed=3)
        lists[1][2] = on(0, host[1][2])
        with pytest.raises(ValueError, match=r"per_replica_lists\[\*\]\[2\]"):
            collectives.batch_all_reduce(lists, "sum")

    # a missing tensor on one replica: refused, naming the argument
    host, lists = make_batch(devices, sizes, dtypes, seed=4)
    with pytest.raises(ValueError, match="per_replica_lists"):
        collectives.batch_all_reduce([lists[0], lists[1][:2]], "sum")

    # and the plan still serves the batch it was made for
    host, lists = make_batch(devices, sizes, dtypes, seed=5)
    check_batch(collectives.batch_all_reduce(lists, "sum"), host, "sum", devices)
