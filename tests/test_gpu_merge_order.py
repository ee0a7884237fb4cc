"""Cross-replica work of GPU replicas (an all_reduce's combine, a merge_call's merge_fn) is
ordered with every replica's stream, and the arrays it hands the replicas live as long as
their reads (marker ``gpu``: simulated GPUs without a GPU, see gpu_env.py).

The bug these pin down: the combine ran on the last-arriving replica's stream, so the
results it allocated for the other replicas were filed in CuPy's pool under that stream;
a replica that dropped its result after queuing a read of it on its own stream let the
combining stream's next allocation rewrite it under the read (freed-memory poison on the
simulator, a silently wrong value on a GPU).
"""

import numpy as np
import pytest

from gpu_env import LAYOUTS, SKIP_REASON, cupy, layout_strategy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402

REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max}


@pytest.fixture(params=LAYOUTS)
def strategy(request):
    with layout_strategy(request.param) as s:
        yield s


def _inputs(n, seed, shape):
    rng = np.random.default_rng(seed)
    return [rng.integers(-8, 9, shape).astype(np.float32) for _ in range(n)]


def _strategy_reduce(op, values, axis):
    """NumPy's ``strategy.reduce(op, PerReplica(values), axis)``: over replicas, and along ``axis`` too."""
    stacked = np.stack(values) if axis is None else np.concatenate(values, axis=axis)
    return REDUCE[op](stacked, axis=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("merge", ["after", "before"])
def test_all_reduce_and_merge_call_results_match_numpy(strategy, merge, op, axis, seed):
    n = strategy.num_replicas_in_sync
    shape = [(3,), (5, 4), (2, 3, 7)][seed]
    host = _inputs(n, seed, shape)

    def step():
        ctx = md.get_replica_context()
        x = cupy.asarray(host[ctx.replica_id_in_sync_group])
        if merge == "before":
            z = ctx.merge_call(lambda s, v: s.reduce(op, v, axis=axis), args=(x,))
            y = ctx.all_reduce(op, x)
        else:
            y = ctx.all_reduce(op, x)
            z = ctx.merge_call(lambda s, v: s.reduce(op, v, axis=axis), args=(y,))
        return y + cupy.asarray(z), y * 2

    out, twice = strategy.run(step)
    reduced = REDUCE[op](np.stack(host), axis=0)
    z = _strategy_reduce(op, host if merge == "before" else [reduced] * n, axis)
    for r, (o, t) in enumerate(zip(strategy.experimental_local_results(out),
                                   strategy.experimental_local_results(twice))):
        np.testing.assert_allclose(cupy.asnumpy(o), reduced + z, rtol=1e-6, err_msg=f"replica {r}")
        np.testing.assert_allclose(cupy.asnumpy(t), reduced * 2, rtol=1e-6, err_msg=f"replica {r}")


@pytest.mark.parametrize("seed", range(4))
def test_all_reduce_result_read_after_an_empty_merge_call(strategy, seed):
    """``y = all_reduce(x); merge_call(lambda s: None); return y * 2``: y is read on each
    replica's stream after the merge and dropped at once."""
    n = strategy.num_replicas_in_sync
    host = _inputs(n, seed, (4 + seed, 3))

    def step():
        ctx = md.get_replica_context()
        y = ctx.all_reduce("sum", cupy.asarray(host[ctx.replica_id_in_sync_group]))
        ctx.merge_call(lambda s: None)
        return y * 2

    want = np.sum(host, axis=0) * 2
    for r, v in enumerate(strategy.experimental_local_results(strategy.run(step))):
        np.testing.assert_array_equal(cupy.asnumpy(v), want, err_msg=f"replica {r}")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("non_blocking", [True, False])
def test_replicas_on_streams_of_their_own(strategy, op, non_blocking, seed):
    """Each replica computes on a stream of its own (a non-blocking one is not ordered by the legacy
    stream; a blocking one is, but not with the other replicas' streams): the collective still reads
    every replica's finished input, each replica's later work sees the result, and the merge_fn sees
    every replica's value."""
    n = strategy.num_replicas_in_sync
    host = _inputs(n, seed, (6, 5))
    streams = {}

    def step():
        ctx = md.get_replica_context()
        r = ctx.replica_id_in_sync_group
        stream = streams.setdefault(r, cupy.cuda.Stream(non_blocking=non_blocking))
        with stream:
            x = cupy.asarray(host[r]) * 3 - 1  # written on the user's stream just before the collective
            y = ctx.all_reduce(op, x)
            biggest = ctx.merge_call(lambda s, v: max(float(cupy.asnumpy(c).max()) for c in v.values), args=(x,))
            return y * 2 + biggest

    out = strategy.run(step)
    for stream in streams.values():  # (the results were computed on the replicas' streams)
        stream.synchronize()
    scaled = [h * 3 - 1 for h in host]
    want = REDUCE[op](np.stack(scaled), axis=0) * 2 + max(float(s.max()) for s in scaled)
    for r, v in enumerate(strategy.experimental_local_results(out)):
        np.testing.assert_array_equal(cupy.asnumpy(v), want, err_msg=f"replica {r}")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stream", ["replica's", "non-blocking", "blocking"])
def test_repeated_all_reduces_run_on_the_merge_streams(strategy, stream, seed):
    """From the second step on, a replica context's all_reduce runs its kept plan straight, on the merge
    streams (the legacy default stream outside md.function) without looking each GPU's stream up: it
    still reads every replica's input written just before it on the replica's stream (its own, or one
    the replica entered), and each replica's work after it sees the result, step after step."""
    n = strategy.num_replicas_in_sync
    streams = {}

    def step(k):
        ctx = md.get_replica_context()
        r = ctx.replica_id_in_sync_group
        if stream == "replica's":
            x = cupy.full((7,), float(r + 1), np.float32) * (k + 1)
            return ctx.all_reduce("sum", x) - k
        with streams.setdefault(r, cupy.cuda.Stream(non_blocking=stream == "non-blocking")):
            x = cupy.full((7,), float(r + 1), np.float32) * (k + 1)
            return ctx.all_reduce("sum", x) - k

    for k in range(4):  # (the seed: the simulator's order of queued work differs by the test's id)
        out = strategy.run(step, args=(k,))
        for s in streams.values():
            s.synchronize()
        want = np.full((7,), n * (n + 1) / 2 * (k + 1) - k, np.float32)
        for r, v in enumerate(strategy.experimental_local_results(out)):
            np.testing.assert_array_equal(cupy.asnumpy(v), want, err_msg=f"step {k}, replica {r}")


@pytest.mark.parametrize("seed", range(3))
def test_repeated_all_reduces_whose_results_are_held_get_new_ones_from_the_merge_streams(strategy, seed):
    """A repeated all_reduce whose latest results are still held runs before the merge order (the rendezvous
    tries the kept plan first) and has new results allocated in the order: every step's results and the reads
    each replica queued of them on its own stream, the results dropped a step later, hold the reduction (the
    simulator poisons freed memory and runs queued work late)."""
    n = strategy.num_replicas_in_sync
    reads = []  # each step's reads of its results, checked at the end (nothing waits for the GPU before)

    def step(k):
        ctx = md.get_replica_context()
        r = ctx.replica_id_in_sync_group
        y = ctx.all_reduce("sum", cupy.full((256,), float(r + 1), np.float32) * (k + 1))
        return y, y * 2 + 1  # (the read, queued on the replica's stream)

    out = None
    for k in range(6):
        y, read = strategy.run(step, args=(k,))  # (the previous step's results still held: new ones)
        reads.append(read)
        out = y  # (the previous results dropped here, their reads maybe still queued)
    del out
    for k, read in enumerate(reads):
        want = np.full((256,), n * (n + 1) / 2 * (k + 1) * 2 + 1, np.float32)
        for r, v in enumerate(strategy.experimental_local_results(read)):
            np.testing.assert_array_equal(cupy.asnumpy(v), want, err_msg=f"step {k}, replica {r}")
