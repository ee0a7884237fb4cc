"""Every public GPU entry point leaves the caller's current device as it found it, whichever GPU
that is: collectives (planned or not, on logical GPUs or across two GPUs), batches, the
optimizer's update with its gradient pack, md.linalg.matmul (fast path and general path) and an
md.function capture and its replays. The native engine skips switches to the GPU already current
(csrc/cuda/device.h's DeviceGuard), so a wrong record of what is current would show here as a
device left switched. On two simulated GPUs (gpu_env.py) or two real ones."""

import numpy as np
import pytest

from gpu_env import NGPU, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
if NGPU < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)

import mirrored as md  # noqa: E402
from mirrored import collectives  # noqa: E402

DEVICE_SETS = [(0, 0), (1, 1), (0, 1), (1, 0), (1, 1, 1)]


def on(device, host):
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def keeps_current(call, current):
    """Runs ``call`` twice (the first plans, the second takes the planned path) with ``current``
    current, checking after each that it still is; returns the second call's result."""
    with cupy.cuda.Device(current):
        call()
        assert cupy.cuda.runtime.getDevice() == current
        result = call()
        assert cupy.cuda.runtime.getDevice() == current
    return result


@pytest.mark.parametrize("current", [0, 1])
@pytest.mark.parametrize("devices", DEVICE_SETS, ids=str)
def test_collectives_leave_the_current_device(devices, current):
    xs = [on(d, np.full(5, r + 1, np.float32)) for r, d in enumerate(devices)]
    total = sum(range(1, len(devices) + 1))
    for out in keeps_current(lambda: collectives.all_reduce(xs, "sum"), current), \
            keeps_current(lambda: collectives.all_reduce(xs, "sum", algorithm="ring"), current):
        for o, d in zip(out, devices):
            assert o.data.device_id == d
            np.testing.assert_array_equal(cupy.asnumpy(o), np.full(5, total, np.float32))
    outs = [on(d, np.zeros(5, np.float32)) for d in devices]
    keeps_current(lambda: collectives.all_reduce(xs, "max", out=outs), current)
    for o in outs:
        np.testing.assert_array_equal(cupy.asnumpy(o), np.full(5, len(devices), np.float32))
    for o in keeps_current(lambda: collectives.broadcast(xs, root=len(devices) - 1), current):
        np.testing.assert_array_equal(cupy.asnumpy(o), np.full(5, len(devices), np.float32))
    lists = [[on(d, np.full(n, r + 1, dt)) for n, dt in ((3, np.float32), (700, np.float32), (9, np.int32))]
             for r, d in enumerate(devices)]
    for row in keeps_current(lambda: collectives.batch_all_reduce(lists, "sum"), current):
        for got, (n, dt) in zip(row, ((3, np.float32), (700, np.float32), (9, np.int32))):
            np.testing.assert_array_equal(cupy.asnumpy(got), np.full(n, total, dt))


@pytest.mark.parametrize("current", [0, 1])
@pytest.mark.parametrize("where", [0, 1])
@pytest.mark.parametrize("shapes", [((4, 3), (3, 5)), ((2, 4, 3), (2, 3, 5)), ((0, 3), (3, 5))], ids=str)
def test_matmul_leaves_the_current_device(where, current, shapes):
    """On the current GPU (the fast path) or another one (the general path)."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    out = keeps_current(lambda: md.linalg.matmul(on(where, a), on(where, b)), current)
    assert out.data.device_id == where
    np.testing.assert_allclose(cupy.asnumpy(out), np.matmul(a, b), rtol=1e-5, atol=1e-5)


def _strategy(kind):
    if kind == "logical":
        md.config.set_logical_device_configuration("GPU", 0, count=2)
    return md.MirroredStrategy(["/gpu:0", "/gpu:1"])


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "md.function"])
@pytest.mark.parametrize("current", [0, 1])
@pytest.mark.parametrize("kind", ["logical", "physical"])
def test_a_training_step_leaves_the_current_device(kind, current, captured):
    """strategy.run of a step with md.linalg.matmul and apply_gradients over enough variables for the
    optimizer's gradient pack, eagerly or captured and replayed."""
    rng = np.random.default_rng(2)
    w0 = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(12)]
    x0 = rng.standard_normal((2, 4, 4)).astype(np.float32)
    try:
        strategy = _strategy(kind)
        with strategy.scope():
            ws = [md.Variable(w) for w in w0]
            opt = md.optimizers.Adam(0.01)

        def step(x):
            grads = [md.linalg.matmul(x, w.read_value(), transpose_a=True) for w in ws]
            opt.apply_gradients(zip(grads, ws))
            return grads[0].sum()

        run = md.function(step) if captured else step
        x = md.PerReplica([md.device_util.place(x0[r], d) for r, d in enumerate(strategy.extended.worker_devices)],
                          strategy.extended.worker_devices)
        with cupy.cuda.Device(current):
            for _ in range(3):  # (captured: the capture, then replays)
                strategy.run(run, args=(x,))
                assert cupy.cuda.runtime.getDevice() == current
        assert int(opt.iterations.numpy()) == 3
        for w in ws:
            np.testing.assert_array_equal(w.values[0].numpy(), w.values[1].numpy())
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


@pytest.mark.parametrize("devices", [(0, 0), (0, 1)], ids=str)
def test_plans_result_rings_and_matmul_from_threads_at_once(devices):
    """Four threads (as GPU replicas on threads of their own) share the cached plans, their result
    rings and the cuBLAS handles: each call's results are its own values, whatever the others do,
    held or dropped, and each thread's current device is its own."""
    import threading

    def work(t, errors, barrier):
        try:
            rng = np.random.default_rng(t)
            current = t % 2
            with cupy.cuda.Device(current):
                barrier.wait()
                held = []
                for k in range(12):
                    host = [rng.integers(-4, 5, 33).astype(np.float32) for _ in devices]
                    xs = [on(d, h) for d, h in zip(devices, host)]
                    lists = [[x, on(d, 2 * h)] for x, d, h in zip(xs, devices, host)]
                    out = collectives.all_reduce(xs, "sum")
                    batch = collectives.batch_all_reduce(lists, "sum")
                    a = rng.standard_normal((3, 4)).astype(np.float32)
                    b = rng.standard_normal((4, 5)).astype(np.float32)
                    product = md.linalg.matmul(on(current, a), on(current, b))
                    total = np.sum(host, axis=0)
                    for o in out:
                        np.testing.assert_array_equal(cupy.asnumpy(o), total)
                    for row in batch:
                        np.testing.assert_array_equal(cupy.asnumpy(row[0]), total)
                        np.testing.assert_array_equal(cupy.asnumpy(row[1]), 2 * total)
                    np.testing.assert_allclose(cupy.asnumpy(product), a @ b, rtol=1e-5, atol=1e-5)
                    if k % 3 == 0:
                        held.append((out, total))  # held across the later calls: never written again
                    assert cupy.cuda.runtime.getDevice() == current
                for out, total in held:
                    for o in out:
                        np.testing.assert_array_equal(cupy.asnumpy(o), total)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    errors, barrier = [], threading.Barrier(4)
    threads = [threading.Thread(target=work, args=(t, errors, barrier)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
