"""A GPU out of memory is TF's ``ResourceExhaustedError`` (marker ``gpu``; on the simulated GPUs, whose memory
limit ``sim.set_device_memory_limit`` makes cudaMalloc and the CuPy stand-in's allocations fail past it).

Each of an all-reduce, a batch of tensors, ``strategy.run`` with a replica-context all-reduce, an optimizer step
and a distributed dataset's placement runs out of memory with ``md.errors.ResourceExhaustedError`` (a
``MemoryError``, and still CuPy's ``OutOfMemoryError``) whose message starts as TF's ("OOM when allocating ... on
/job:localhost/replica:0/task:0/device:GPU:n by allocator ...", recorded in tests/data/tf_oom_reference.json),
names the bytes and the fix; then the same call with a smaller input works and is right: no half-built plan, no
poisoned cache, no stuck rendezvous.
"""

import contextlib
import gc
import json
import pathlib
import pickle
import re

import numpy as np
import pytest

from gpu_env import NGPU, SIMULATED, SKIP_REASON, cupy, gpu_pair

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
if not SIMULATED:
    pytest.skip("the device memory limit is the simulated GPUs'", allow_module_level=True)

import mirrored as md  # noqa: E402
from mirrored import collectives  # noqa: E402

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "tf_oom_reference.json").read_text())
# TF's words up to the device, the device as TF names it, then the allocator.
OOM_WORDS = re.compile(r"^OOM when allocating (tensor with shape\[[\d,]*\] and type \w+|\d+ bytes( for .+)?) on "
                       r"/job:localhost/replica:0/task:0/device:GPU:(\d) by allocator \w+: ")


def test_the_words_are_tfs():
    """The recorded TF message (an OOM on TF's CPU) has the shape mirrored's GPU messages follow."""
    tf_message = REFERENCE["message"]
    assert REFERENCE["type"] == "ResourceExhaustedError" and REFERENCE["error_code"] == md.errors.RESOURCE_EXHAUSTED
    start = tf_message.index("OOM when allocating")
    assert re.match(r"OOM when allocating tensor with shape\[4,1099511627776\] and type int32 on "
                    r"/job:localhost/replica:0/task:0/device:CPU:0 by allocator \w+", tf_message[start:])
    error = md.errors.gpu_out_of_memory(4 * (1 << 40) * 4, 1, shape=(4, 1 << 40), dtype=np.dtype("int32"))
    assert str(error).startswith(tf_message[start:].split(" by allocator")[0].replace("CPU:0", "GPU:1"))
    assert str(md.errors.gpu_out_of_memory(8, 0, shape=(2,), dtype=np.float32)).startswith(
        "OOM when allocating tensor with shape[2] and type float on /job:localhost/replica:0/task:0/device:GPU:0")


@contextlib.contextmanager
def device_memory(extra: int):
    """Each simulated GPU's memory limited to what is in use on the fullest one now, plus ``extra`` bytes (garbage
    of earlier tests freed first: the allocator would free it to make room)."""
    sim = cupy.sim
    gc.collect()
    sim.drain()
    # (Memory an earlier test's threads let go of later makes room: the calls meant to fail ask for far more.)
    sim.set_device_memory_limit(max(sim.bytes_in_use(d) for d in range(NGPU)) + extra)
    try:
        yield
    finally:
        sim.set_device_memory_limit(0)


def assert_oom(caught, device=None):
    """A ResourceExhaustedError in TF's words, also a MemoryError and CuPy's OutOfMemoryError, naming the fix."""
    error = caught.value
    assert isinstance(error, md.errors.ResourceExhaustedError) and isinstance(error, MemoryError)
    assert isinstance(error, cupy.cuda.memory.OutOfMemoryError)
    assert error.error_code == md.errors.RESOURCE_EXHAUSTED
    found = OOM_WORDS.match(str(error))
    assert found, str(error)
    if device is not None:
        assert found.group(3) == str(device), str(error)
    assert "smaller batch" in str(error) and "fewer replicas per GPU" in str(error)
    return error


def test_cupy_out_of_memory_stays_catchable_and_pickles():
    with device_memory(1000):
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
            cupy.zeros(1 << 20, cupy.float32)  # CuPy's own call: CuPy's own error
        cupy.zeros(16, cupy.float32)
    error = md.errors.from_gpu_out_of_memory(cupy.cuda.memory.OutOfMemoryError(4096, 10, 20), 1)
    assert "4096 bytes" in str(error) and "device:GPU:1" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert type(md.errors.gpu_out_of_memory(1, 0)) is type(error)  # one class, made once


def _on_gpus(n, value):
    arrays = []
    for d in range(2):
        with cupy.cuda.Device(d):
            arrays.append(cupy.full(n, value + d, cupy.float32))
    return arrays


def test_all_reduce_out_of_memory_then_a_smaller_one():
    big = _on_gpus(1 << 22, 1.0)
    with device_memory(4096):
        with pytest.raises(md.errors.ResourceExhaustedError) as caught:
            collectives.all_reduce(big, "sum")
        assert_oom(caught)
        small = _on_gpus(100, 1.0)
        out = collectives.all_reduce(small, "sum")
        for o in out:
            np.testing.assert_array_equal(cupy.asnumpy(o), np.full(100, 3.0, np.float32))
    out = collectives.all_reduce(big, "sum")  # the plan of the failed call is no poisoned cache entry
    np.testing.assert_array_equal(cupy.asnumpy(out[1]), np.full(1 << 22, 3.0, np.float32))


def test_all_reduce_staged_through_the_engine_scratch_out_of_memory():
    """GPUs without peer access: the engine's ring stages through scratch of its own (cudaMalloc)."""
    cupy.configure(2, [], 7)
    md.config.set_logical_device_configuration("GPU:0", None)
    try:
        n = 1 << 16
        inputs, outputs = _on_gpus(n, 1.0), _on_gpus(n, 0.0)
        with device_memory(0):
            with pytest.raises(md.errors.ResourceExhaustedError) as caught:
                collectives.all_reduce(inputs, "sum", out=outputs, algorithm="ring", chunk_bytes=1 << 16)
        error = assert_oom(caught)
        assert "by allocator cudaMalloc" in str(error) and "ring scratch chunk" in str(error)
        collectives.all_reduce(inputs, "sum", out=outputs, algorithm="ring", chunk_bytes=1 << 16)
        for o in outputs:
            np.testing.assert_array_equal(cupy.asnumpy(o), np.full(n, 3.0, np.float32))
    finally:
        cupy.configure(2, [(0, 1), (1, 0)], 7)
        md.config.set_logical_device_configuration("GPU:0", None)


def test_batch_all_reduce_out_of_memory_then_a_smaller_batch():
    shapes = [(3000, 400), (7,), (1000,), (1024, 1024)]
    per_replica = []
    for r in range(2):
        with cupy.cuda.Device(r):
            per_replica.append([cupy.full(s, r + 1, cupy.float32) for s in shapes])
    with device_memory(16384):  # (room for a small batch's results, fusion buffer and pointer table)
        with pytest.raises(md.errors.ResourceExhaustedError) as caught:
            collectives.batch_all_reduce(per_replica, "sum")
        assert_oom(caught)
        small = []
        for r in range(2):
            with cupy.cuda.Device(r):
                small.append([cupy.full((5,), r + 1, cupy.float32), cupy.full((3, 2), r, cupy.float32)])
        out = collectives.batch_all_reduce(small, "sum")
        np.testing.assert_array_equal(cupy.asnumpy(out[1][0]), np.full(5, 3.0, np.float32))
        np.testing.assert_array_equal(cupy.asnumpy(out[0][1]), np.full((3, 2), 1.0, np.float32))
    out = collectives.batch_all_reduce(per_replica, "sum")
    for t, s in enumerate(shapes):
        np.testing.assert_array_equal(cupy.asnumpy(out[0][t]), np.full(s, 3.0, np.float32))


@pytest.mark.parametrize("kind", ["logical", "physical"])
def test_strategy_run_with_a_replica_all_reduce_out_of_memory_then_smaller(kind):
    with gpu_pair(kind) as ordinals:
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])

        def step(n):
            ctx = md.get_replica_context()
            x = cupy.full(n, ctx.replica_id_in_sync_group + 1, cupy.float32)
            return ctx.all_reduce("sum", x)

        strategy.run(step, args=(10,))  # (the strategy's first step: its streams and plans made)
        with device_memory(1 << 16):
            with pytest.raises(md.errors.ResourceExhaustedError) as caught:
                strategy.run(step, args=(1 << 28,))
            assert_oom(caught)
            result = strategy.run(step, args=(1000,))
        for value in strategy.experimental_local_results(result):
            np.testing.assert_array_equal(cupy.asnumpy(value), np.full(1000, 3.0, np.float32))
        assert ordinals


def test_one_replica_out_of_memory_does_not_strand_the_other_in_its_all_reduce():
    """Replica 1 runs out of memory before the all-reduce replica 0 already waits in: the step ends with
    replica 1's ResourceExhaustedError (naming its GPU), and the next step works."""
    with gpu_pair("physical"):
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])

        def step(n1):
            ctx = md.get_replica_context()
            n = n1 if ctx.replica_id_in_sync_group == 1 else 10
            x = cupy.full(n, ctx.replica_id_in_sync_group + 1, cupy.float32)
            return ctx.all_reduce("sum", x[:10])

        strategy.run(step, args=(10,))
        with device_memory(1 << 16):
            with pytest.raises(md.errors.ResourceExhaustedError) as caught:
                strategy.run(step, args=(1 << 28,))
            assert_oom(caught, device=1)
        result = strategy.run(step, args=(10,))
        for value in strategy.experimental_local_results(result):
            np.testing.assert_array_equal(cupy.asnumpy(value), np.full(10, 3.0, np.float32))


def test_optimizer_step_out_of_memory_then_the_step_works():
    with gpu_pair("physical"):
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with strategy.scope():
            w = md.Variable(np.ones((256, 256), np.float32))
            b = md.Variable(np.zeros(256, np.float32))
            opt = md.optimizers.Adam(0.1)

        def step(scale):
            ctx = md.get_replica_context()
            g = cupy.full((256, 256), scale * (ctx.replica_id_in_sync_group + 1), cupy.float32)
            opt.apply_gradients([(g, w), (g[0], b)])

        with device_memory(0):
            with pytest.raises(md.errors.ResourceExhaustedError) as caught:
                strategy.run(step, args=(1.0,))
            assert_oom(caught)
        strategy.run(step, args=(1.0,))
        for copy in w.values:  # Adam's first step moves each weight by the learning rate
            np.testing.assert_allclose(cupy.asnumpy(copy.value() if hasattr(copy, "value") else copy), 0.9,
                                       rtol=1e-5)


def test_dataset_placement_out_of_memory_then_a_smaller_batch():
    with gpu_pair("physical"):
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        data = np.ones((64, 1 << 16), np.float32)
        with device_memory(1 << 16):
            big = strategy.experimental_distribute_dataset(md.data.Dataset.from_tensor_slices(data).batch(32))
            with pytest.raises(md.errors.ResourceExhaustedError) as caught:
                next(iter(big))
            assert_oom(caught)
            small = strategy.experimental_distribute_dataset(md.data.Dataset.from_tensor_slices(data[:4, :8]).batch(2))
            batch = next(iter(small))
            parts = strategy.experimental_local_results(batch)
            assert [p.shape for p in parts] == [(1, 8), (1, 8)]
            assert all(isinstance(p, cupy.ndarray) for p in parts)


def test_variable_too_large_for_its_gpus_then_a_smaller_one():
    with gpu_pair("physical"):
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with device_memory(1 << 16), strategy.scope():
            with pytest.raises(md.errors.ResourceExhaustedError) as caught:
                md.Variable(np.ones((4096, 4096), np.float32))
            error = assert_oom(caught)
            assert "tensor with shape[4096,4096] and type float" in str(error)
            v = md.Variable(np.ones((8, 8), np.float32))
        for copy in v.values:
            np.testing.assert_array_equal(cupy.asnumpy(copy.read_value()), np.ones((8, 8), np.float32))
