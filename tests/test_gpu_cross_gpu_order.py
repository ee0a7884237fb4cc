"""Data crossing GPUs between the caller's streams and the replicas' (docs/gpu_ordering.md): an eager
``strategy.run`` over several physical GPUs orders the caller's work on every GPU before the replicas',
and the replicas' after it for readers on every other GPU, as TensorFlow orders every read after its
tensor's producer. On the simulated machine (gpu_env.py) queued kernels run at synchronisation in an
order drawn from the seed and freed memory is poisoned, so a read left unordered shows as wrong values;
each test runs over several seeds (kernel orders), on 2 and 4 GPUs."""

import contextlib
import gc
import warnings

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import SIMULATED, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(gpu_env.SKIP_REASON, allow_module_level=True)

SEEDS = range(6)
SIZE = 64


@contextlib.contextmanager
def peer_kernels():
    """A kernel on one GPU over another GPU's array: CuPy warns that it turns peer access on (a
    PerformanceWarning, an error under pytest); the peer read is what these tests are about."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", getattr(getattr(cupy, "_util", None), "PerformanceWarning", Warning))
        yield


@contextlib.contextmanager
def strategy_on(gpus: int, seed: int):
    """A MirroredStrategy with one replica on each of ``gpus`` physical GPUs (of a simulated machine
    seeded by ``seed``), GPU 0 current, as a training script's caller is."""
    with gpu_env.physical_gpus(gpus, seed), cupy.cuda.Device(0):
        yield md.MirroredStrategy([f"/gpu:{i}" for i in range(gpus)])


def host_inputs(gpus: int):
    return [np.arange(SIZE, dtype=np.float32) + 100 * r for r in range(gpus)]


def per_replica(strategy, hosts):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: cupy.asarray(hosts[ctx.replica_id_in_sync_group]))


def step(v):
    """A replica's work on its own stream: a few kernels on GPU 0, a dozen on the others, so that the
    caller's work on GPU 0 (ordered after GPU 0's replica by CUDA) may well run before theirs ends."""
    for _ in range(0 if v.data.device_id == 0 else 10):
        v = v * np.float32(1)
    return (v * np.float32(2) + np.float32(1)) * np.float32(3)


def want(host):
    return (host * np.float32(2) + np.float32(1)) * np.float32(3)


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_results_summed_on_the_callers_gpu(gpus, seed):
    """``sum(strategy.experimental_local_results(out))`` on GPU 0: kernels on GPU 0's stream read every
    GPU's result."""
    hosts = host_inputs(gpus)
    with strategy_on(gpus, seed) as strategy:
        out = strategy.run(step, args=(per_replica(strategy, hosts),))
        with peer_kernels():
            total = sum(strategy.experimental_local_results(out))
        np.testing.assert_array_equal(cupy.asnumpy(total), sum(want(h) for h in hosts))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_results_copied_onto_the_callers_gpu(gpus, seed):
    """``cupy.array(out.values[r])`` under GPU 0: a copy queued on GPU 0's stream reads GPU r's result."""
    hosts = host_inputs(gpus)
    with strategy_on(gpus, seed) as strategy:
        out = strategy.run(step, args=(per_replica(strategy, hosts),))
        with peer_kernels():  # (CuPy copies with a kernel of the current GPU)
            copies = [cupy.array(v) for v in strategy.experimental_local_results(out)]
        for c, h in zip(copies, hosts):
            assert c.data.device_id == 0
            np.testing.assert_array_equal(cupy.asnumpy(c), want(h))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_replicas_read_an_array_the_caller_just_computed_on_its_gpu(gpus, seed):
    """An array the caller computes on GPU 0 right before the run, passed to every replica (TF hands a
    tensor to each replica as it is): the replicas on other GPUs read it on their own streams."""
    hosts = host_inputs(gpus)
    scale = np.linspace(1, 2, SIZE, dtype=np.float32)
    with strategy_on(gpus, seed) as strategy:
        x = per_replica(strategy, hosts)
        shared = cupy.asarray(scale) * np.float32(3)  # queued on GPU 0's legacy stream

        def scaled(v, w):
            with peer_kernels():
                return v * w
        out = strategy.run(scaled, args=(x, shared))
        for got, h in zip(strategy.experimental_local_results(out), hosts):
            np.testing.assert_array_equal(cupy.asnumpy(got), h * (scale * np.float32(3)))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_replicas_read_arrays_the_caller_wrote_from_another_gpu(gpus, seed):
    """The caller fills each replica's input from GPU 0 (a kernel on GPU 0's stream writes GPU r's
    memory), then runs: replica r reads it on its stream on GPU r."""
    hosts = host_inputs(gpus)
    with strategy_on(gpus, seed) as strategy:
        x = per_replica(strategy, [np.zeros(SIZE, np.float32)] * gpus)
        sources = [cupy.asarray(h) for h in hosts]  # on GPU 0
        with peer_kernels():
            for target, source in zip(strategy.experimental_local_results(x), sources):
                target[...] = source * np.float32(1)
        out = strategy.run(step, args=(x,))
        for got, h in zip(strategy.experimental_local_results(out), hosts):
            np.testing.assert_array_equal(cupy.asnumpy(got), want(h))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_an_array_the_caller_drops_after_the_run_is_read_first(gpus, seed):
    """The replicas read an array of GPU 0 that the caller drops once the run returns: its memory is
    handed out again in GPU 0's stream order (poisoned on the simulator), which must come after the
    replicas' reads on the other GPUs."""
    hosts = host_inputs(gpus)
    scale = np.linspace(1, 2, SIZE, dtype=np.float32)
    with strategy_on(gpus, seed) as strategy:
        x = per_replica(strategy, hosts)
        shared = cupy.asarray(scale)
        cupy.cuda.Stream.null.synchronize()  # (written: only the free is left unordered)

        def scaled(v, w):
            with peer_kernels():
                return step(v) * w  # (read last, after the replica's other kernels)
        out = strategy.run(scaled, args=(x, shared))
        del shared
        reused = cupy.asarray(np.full(SIZE, -1, np.float32))  # (the freed block, written again)
        for got, h in zip(strategy.experimental_local_results(out), hosts):
            np.testing.assert_array_equal(cupy.asnumpy(got), want(h) * scale)
        np.testing.assert_array_equal(cupy.asnumpy(reused), np.full(SIZE, -1, np.float32))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_callers_stream_of_its_own_is_joined_both_ways(gpus, seed):
    """The caller works on a non-blocking stream of its own on GPU 0 (the legacy stream's rule orders it
    with nothing): what it writes there before the run, and reads there after it, are ordered too."""
    hosts = host_inputs(gpus)
    scale = np.linspace(1, 2, SIZE, dtype=np.float32)
    with strategy_on(gpus, seed) as strategy:
        x = per_replica(strategy, hosts)
        cupy.cuda.Device(0).synchronize()
        with cupy.cuda.Stream(non_blocking=True) as mine:
            shared = cupy.asarray(scale) * np.float32(3)

            def scaled(v, w):
                with peer_kernels():
                    return step(v) * w
            out = strategy.run(scaled, args=(x, shared))
            with peer_kernels():
                total = sum(strategy.experimental_local_results(out))
            got = cupy.asnumpy(total, stream=mine)
        np.testing.assert_array_equal(got, sum(want(h) * (scale * np.float32(3)) for h in hosts))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_reduce_gather_and_host_reads_after_a_run(gpus, seed):
    """strategy.reduce / gather, reduce_to another GPU, and host reads (variables, checkpoints) after an
    eager run: the package reads each value on its own GPU's stream or orders its copies between GPUs."""
    hosts = host_inputs(gpus)
    with strategy_on(gpus, seed) as strategy:
        x = per_replica(strategy, hosts)
        out = strategy.run(step, args=(x,))
        np.testing.assert_array_equal(strategy.reduce("SUM", out, axis=None), sum(want(h) for h in hosts))
        np.testing.assert_array_equal(strategy.gather(out, axis=0), np.concatenate([want(h) for h in hosts]))
        last = f"/gpu:{gpus - 1}"
        reduced = strategy.extended.reduce_to("MAX", strategy.run(step, args=(x,)), last)
        assert reduced.data.device_id == gpus - 1
        np.testing.assert_array_equal(cupy.asnumpy(reduced), want(hosts[-1]))
        with strategy.scope():
            v = md.Variable(np.zeros(SIZE, np.float32), aggregation=md.VariableAggregation.ONLY_FIRST_REPLICA)
        strategy.run(lambda value: v.assign(step(value)), args=(x,))  # (replica 0's value, on every copy)
        np.testing.assert_array_equal(v.numpy(), want(hosts[0]))
        for copy in v.values:
            np.testing.assert_array_equal(cupy.asnumpy(copy.read_value()), want(hosts[0]))
        v.assign(cupy.asarray(hosts[-1]) * np.float32(2))  # the caller's assign, read by every replica
        out = strategy.run(lambda value: value + v.read_value(), args=(x,))
        for got, h in zip(strategy.experimental_local_results(out), hosts):
            np.testing.assert_array_equal(cupy.asnumpy(got), h + hosts[-1] * np.float32(2))


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("seed", SEEDS)
def test_reduction_to_one_device_accumulates_on_that_device(seed, op):
    """ReductionToOneDevice's accumulation_fn runs on reduce_to_device (TF runs it under that device),
    over the components copied there: on the caller's GPU it would read them unordered."""
    hosts = host_inputs(2)
    with gpu_env.physical_gpus(2, seed), cupy.cuda.Device(0):
        ops = md.ReductionToOneDevice(reduce_to_device="/gpu:1", accumulation_fn=sum)
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"], cross_device_ops=ops)
        out = strategy.run(step, args=(per_replica(strategy, hosts),))
        reduced = strategy.extended.reduce_to(op, out, "/gpu:1")
        assert reduced.data.device_id == 1
        total = want(hosts[0]) + want(hosts[1])
        np.testing.assert_array_equal(cupy.asnumpy(reduced), total if op == "SUM" else total / np.float32(2))


@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_md_function_replays_are_ordered_across_gpus_too(gpus, seed):
    """A captured step over several GPUs: each replay orders the GPUs as an eager run does, so its outputs
    summed on GPU 0 and the inputs the caller wrote from GPU 0 are read in order."""
    hosts = host_inputs(gpus)
    with gpu_env.physical_gpus(gpus, seed), cupy.cuda.Device(0):
        strategy = gpu_env.nccl_strategy(gpus)
        x = per_replica(strategy, [np.zeros(SIZE, np.float32)] * gpus)

        @md.function
        def run(v):
            return strategy.run(lambda u: step(md.get_replica_context().all_reduce("SUM", u)), args=(v,))

        for k in range(4):  # the warm-up, the capture, then replays
            sources = [cupy.asarray(h + k) for h in hosts]
            with peer_kernels():
                for target, source in zip(strategy.experimental_local_results(x), sources):
                    target[...] = source * np.float32(1)
            out = run(x)
            with peer_kernels():
                total = sum(strategy.experimental_local_results(out))
            np.testing.assert_array_equal(cupy.asnumpy(total), want(sum(h + k for h in hosts)) * gpus)
        assert run.experimental_get_tracing_count() == 1


def stream_operations_per_run(gpus: int) -> tuple:
    """(event records, stream waits, stream operations) of one repeated eager run of a step that queues
    nothing, on ``gpus`` one-replica GPUs of the simulated machine."""
    strategy = md.MirroredStrategy([f"/gpu:{i}" for i in range(gpus)])
    x = per_replica(strategy, host_inputs(gpus))
    strategy.run(lambda v: v, args=(x,))  # (what runs make once: streams, events)
    gc.collect()  # (earlier garbage freed inside the count would add stream operations)
    cupy.sim.drain()
    cupy.sim.reset_counters()
    strategy.run(lambda v: v, args=(x,))
    counted = cupy.sim.counters()
    cupy.sim.drain()
    return counted["calls"].get("cudaEventRecord", 0), counted["calls"].get("cudaStreamWaitEvent", 0), \
        counted["stream_ops"]


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's calls")
@pytest.mark.parametrize("gpus", [1, 2, 3, 4])
def test_a_run_joins_its_gpus_with_a_chain_of_events_and_one_gpu_with_nothing(gpus):
    """A run joins its GPUs at entry and exit; a join records an event on each GPU and waits 2 (G - 1) times
    (down the chain and back). One GPU: nothing (logical GPUs: tests/test_gpu_simulator.py)."""
    with gpu_env.physical_gpus(max(gpus, 2)), cupy.cuda.Device(0):
        records, waits, operations = stream_operations_per_run(gpus)
    assert (records, waits) == (2 * gpus, 4 * (gpus - 1)) if gpus > 1 else (0, 0)
    assert operations == records + waits
