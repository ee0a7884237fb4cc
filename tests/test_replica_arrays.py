"""CPU replicas allocate their arrays from the replica array pool (csrc/host/array_pool.h): on their
threads and, during a run that follows a long one, on the caller's, which gets its own allocator back
afterwards (short steps keep NumPy's there). Arrays
made in a replica stay valid after the step, wherever they are freed, and np.zeros / resize keep
NumPy's contracts on reused blocks."""

import threading
import time

import numpy as np
import pytest

import mirrored as md
from mirrored import _core

try:
    from numpy._core.multiarray import get_handler_name
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import get_handler_name

POOL = "mirrored_replica_arrays"


def compute(seconds=0.02):
    """Keeps this thread's CPU busy: a step that computes this long is long (mirrored_strategy._is_long)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def long_runs(strategy, fn, steps):
    """``steps`` runs of ``fn`` (which must compute long, see ``compute``) after one that makes the steps
    long, so that the replica threads take replicas (the first long step runs them one after another on
    the caller's thread)."""
    strategy.run(compute)
    return [strategy.run(fn) for _ in range(steps)]


def test_every_cpu_replica_allocates_from_the_pool_and_the_caller_gets_its_allocator_back():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    callers = get_handler_name()

    def fn():
        compute()  # a long step: replica 1 on its thread
        return get_handler_name(np.ones((256, 128), np.float32)), get_handler_name(), threading.current_thread().name

    threads = set()
    for got in long_runs(s, fn, 3):
        array, context, thread = [s.experimental_local_results(x) for x in got]
        assert list(zip(array, context)) == [(POOL, POOL)] * 2
        assert get_handler_name() == callers
        threads.update(thread)
    assert "mirrored-replica-1" in threads
    # Short steps (the caller runs both replicas): the first still after a long one, the next not.
    short_step = lambda: list(s.experimental_local_results(s.run(lambda: get_handler_name(np.ones(100_000)))))  # noqa: E731
    assert short_step() == [POOL, POOL]
    # (a short step that a loaded machine preempts past BLOCKED_SECONDS counts as long: the next one is tried)
    assert any(short_step() == [callers, callers] for _ in range(50))
    assert get_handler_name() == callers
    assert get_handler_name(np.ones(100_000)) == callers


def test_the_caller_gets_its_allocator_back_when_a_replica_fails():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    callers = get_handler_name()

    def fn():
        if md.get_replica_context().replica_id_in_sync_group == 0:
            raise ValueError("replica 0 fails")

    with pytest.raises(ValueError, match="replica 0 fails"):
        s.run(fn)
    assert get_handler_name() == callers


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_arrays_made_in_replicas_outlive_the_step_and_blocks_are_reused(replicas):
    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])

    def fn(step):
        compute()  # long steps: from the second on, the caller's replicas take the pool too
        rid = md.get_replica_context().replica_id_in_sync_group
        scratch = [np.full((300, 128), step, np.float32) for _ in range(4)]  # freed in the step
        kept = np.full((200, 129), 1000 * step + rid, np.float64)  # returned, freed later by the caller
        return kept + sum(a.sum() for a in scratch) * 0

    before = _core.replica_array_stats()
    kept = [s.run(fn, args=(step,)) for step in range(12)]
    for step, per_replica in enumerate(kept):
        for rid, a in enumerate(s.experimental_local_results(per_replica)):
            assert a.shape == (200, 129) and np.all(a == 1000 * step + rid)
    after = _core.replica_array_stats()
    assert after["hits"] - before["hits"] >= 10 * 4 * replicas, (before, after)
    assert after["live_bytes"] + after["cached_bytes"] <= after["peak_bytes"]
    del kept, per_replica, a
    stats = _core.replica_array_stats()
    assert stats["live_bytes"] + stats["cached_bytes"] <= stats["peak_bytes"]


def test_zeros_and_resize_in_a_replica_keep_numpys_contracts_on_reused_blocks():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        compute()
        dirty = np.full((512, 256), 7.5, np.float32)
        del dirty
        zeros = np.zeros((512, 256), np.float32)  # the dirty block again, which must come back zeroed
        grown = np.arange(40_000, dtype=np.float64)
        grown.resize(90_000, refcheck=False)  # a reallocation: the values kept, the new part zeroed
        return float(np.abs(zeros).sum()), float(grown[:40_000].sum()), float(np.abs(grown[40_000:]).sum())

    for got in long_runs(s, fn, 3):
        for zeros, head, tail in zip(*[s.experimental_local_results(x) for x in got]):
            assert (zeros, head, tail) == (0.0, float(np.arange(40_000).sum()), 0.0)

