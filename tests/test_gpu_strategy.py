"""MirroredStrategy on GPU replicas (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

Two logical GPUs on physical GPU 0, so a one-GPU machine runs multi-replica
GPU code; with more GPUs the same examples also run one replica per GPU.
"""

import numpy as np
import pytest

from gpu_env import NGPU, SKIP_REASON, cupy, gpu_pair

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402


@pytest.fixture(params=["logical", "physical"])
def gpus(request):
    with gpu_pair(request.param) as ordinals:
        yield ["/gpu:0", "/gpu:1"], ordinals


def test_default_strategy_takes_every_gpu():
    s = md.MirroredStrategy()
    assert s.num_replicas_in_sync == NGPU
    assert all("GPU" in d for d in s.extended.worker_devices)


def test_run_and_all_reduce(gpus):
    devices, ordinals = gpus
    s = md.MirroredStrategy(devices)
    assert s.num_replicas_in_sync == 2

    def step():
        ctx = md.get_replica_context()
        x = cupy.full(5, ctx.replica_id_in_sync_group + 1, cupy.float32)
        return ctx.all_reduce("sum", {"x": x, "y": x * 2})

    out = s.run(step)
    for v, ordinal in zip(s.experimental_local_results(out["x"]), ordinals):
        assert isinstance(v, cupy.ndarray) and v.device.id == ordinal
        np.testing.assert_array_equal(cupy.asnumpy(v), np.full(5, 3, np.float32))
    np.testing.assert_array_equal(s.reduce("mean", out["y"], axis=None), np.full(5, 6, np.float32))
    np.testing.assert_array_equal(s.reduce("sum", out["y"], axis=0), np.float32(60))


def test_reduce_of_a_gpu_array_that_is_not_distributed_follows_tfs_rules_for_tensors(gpus):
    """One replica: every op gives the value (on the host, as strategy.reduce does). Several: MEAN gives it,
    SUM raises, also for zeros (TF's shortcut for 0 is for non-tensors only: a GPU array is not read back)."""
    devices, _ = gpus
    x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3) - 2
    one = md.MirroredStrategy(devices[:1])
    for op in ("SUM", "MEAN", "MIN", "MAX"):
        got = one.reduce(op, x, axis=None)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, cupy.asnumpy(x))
    np.testing.assert_array_equal(one.reduce("MEAN", x, axis=0), np.float32([-0.5, 0.5, 1.5]))
    two = md.MirroredStrategy(devices)
    np.testing.assert_array_equal(two.reduce("MEAN", x, axis=None), cupy.asnumpy(x))
    for value in (x, cupy.zeros(3, cupy.float32)):
        with pytest.raises(ValueError, match="cannot be reduced with the given reduce op.*use ReduceOp.MEAN"):
            two.reduce("SUM", value, axis=None)
    np.testing.assert_array_equal(two.reduce("SUM", np.zeros(3, np.float32), axis=None), np.zeros(3))


def test_mirrored_variable_lives_on_each_gpu(gpus):
    devices, ordinals = gpus
    s = md.MirroredStrategy(devices)
    with s.scope():
        v = md.Variable(np.ones(3, np.float32), aggregation=md.VariableAggregation.MEAN)
    for component, ordinal in zip(s.experimental_local_results(v), ordinals):
        arr = getattr(component, "value", component)
        arr = arr() if callable(arr) else arr
        assert isinstance(arr, cupy.ndarray) and arr.device.id == ordinal

    def step():
        ctx = md.get_replica_context()
        v.assign_add(cupy.full(3, ctx.replica_id_in_sync_group + 1, cupy.float32))

    s.run(step)
    np.testing.assert_array_equal(np.asarray(v.numpy()), np.full(3, 2.5, np.float32))


def test_distributed_dataset_lands_on_the_replica_gpus(gpus):
    devices, ordinals = gpus
    s = md.MirroredStrategy(devices)
    batches = [np.arange(14, dtype=np.float32).reshape(7, 2)]
    for batch in s.experimental_distribute_dataset(batches):
        parts = s.experimental_local_results(batch)
        assert [p.shape[0] for p in parts] == [4, 3]
        for p, ordinal in zip(parts, ordinals):
            assert isinstance(p, cupy.ndarray) and p.device.id == ordinal
        np.testing.assert_array_equal(np.concatenate([cupy.asnumpy(p) for p in parts]), batches[0])


def test_nccl_all_reduce_on_gpus(gpus):
    devices, ordinals = gpus
    from mirrored.device import gpu as _gpu

    ops = md.cross_device_ops.NcclAllReduce()
    s = md.MirroredStrategy(devices, cross_device_ops=ops)
    fn = lambda: md.get_replica_context().all_reduce("sum", cupy.ones(4, cupy.float32))  # noqa: E731
    if len(set(ordinals)) < len(ordinals):
        with pytest.raises(ValueError, match="use algorithm='ring' for logical GPUs"):
            s.run(fn)
    elif not _gpu.nccl_available():
        with pytest.raises(RuntimeError, match="pip install nvidia-nccl-cu13"):
            s.run(fn)
    else:
        for v in s.experimental_local_results(s.run(fn)):
            np.testing.assert_array_equal(cupy.asnumpy(v), np.full(4, 2, np.float32))


def test_demo_trains_on_gpu_replicas_to_the_cpu_accuracy(tmp_path):
    """examples/train_digits.py --device gpu: 4 replicas (logical GPUs when there are fewer GPUs)
    reach the accuracy the same run reaches on CPU replicas."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("sklearn")
    import gpu_env

    demo = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
    # Without a GPU the demo's own process runs on the simulated machine too.
    launcher = ["-c", gpu_env.RUN_SIMULATED] if gpu_env.SIMULATED else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    accuracy = {}
    for device in ("cpu", "gpu"):
        proc = subprocess.run([sys.executable, *launcher, str(demo), "--device", device, "--replicas", "4",
                               "--steps", "60", "--no-progress", "--out", str(tmp_path / device)],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.strip().splitlines()
        assert lines[-2].startswith(f"4 {device.upper()} replicas, 60 steps")
        accuracy[device] = float(lines[-1].split(":")[1])
    assert accuracy["gpu"] > 0.8
    assert abs(accuracy["gpu"] - accuracy["cpu"]) <= 0.02, accuracy


@pytest.mark.parametrize("per_gpu", [2, 4])
def test_optimizer_steps_on_replicas_sharing_a_gpu_match_cpu_replicas(per_gpu):
    """Replicas sharing a GPU run on their own streams, and each step's merged update may run on
    another replica's thread: the variables' old values must outlive every read of them (the
    simulator poisons freed memory; this diverged before updates ran on the legacy stream)."""
    gpus = min(NGPU, 2) if per_gpu == 2 else 1
    n = per_gpu * gpus

    def train(devices, xp):
        s = md.MirroredStrategy(devices)
        with s.scope():
            w = md.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
            b = md.Variable(np.zeros(4, np.float32))
            opt = md.optimizers.SGD(0.05, momentum=0.9)

        def step():
            r = md.get_replica_context().replica_id_in_sync_group
            gw = w.read_value() * (r + 1) - 0.5
            gb = xp.full(4, r - 1.5, xp.float32)
            opt.apply_gradients([(gw, w), (gb, b)])

        for _ in range(6):
            s.run(step)
        return np.asarray(w.numpy()), np.asarray(b.numpy())

    for i in range(gpus):
        md.config.set_logical_device_configuration("GPU", i, count=per_gpu)
    try:
        on_gpus = train([f"/gpu:{i}" for i in range(n)], cupy)
    finally:
        for i in range(gpus):
            md.config.set_logical_device_configuration(f"GPU:{i}", None)
    on_cpus = train([f"/cpu:{i}" for i in range(n)], np)
    for g, c in zip(on_gpus, on_cpus):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6)
