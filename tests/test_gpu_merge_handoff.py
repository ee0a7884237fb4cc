"""A merge_fn that hands one replica's input array (or a view of it) to other replicas, in an eager
step on GPU replicas, and under md.function between GPUs (marker ``gpu``: simulated GPUs without a
GPU, see gpu_env.py).

The bug these pin down: replica k's array, written on replica k's stream and filed in CuPy's pool
under it, was read by replica r on replica r's stream with nothing ordering the two: r could read
it before k's stream had written it, and once the last reference went, k's stream could hand the
block to its next array while r's reads were still queued (the simulator's freed-memory poison,
or a silently wrong value on a GPU).
"""

import numpy as np
import pytest

from gpu_env import (LAYOUTS, NGPU, SIMULATED, SKIP_REASON, check_hand_off, cupy, hand_off_step, launches_and_ops,
                     layout_strategy)

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from mirrored._nest import flatten  # noqa: E402


@pytest.fixture(params=LAYOUTS)
def strategy(request):
    with layout_strategy(request.param) as s:
        yield s


# merge_fn(strategy, v) -> what every replica gets; want(hosts) -> the same from the replicas' `mine` on the host.
HAND_OFFS = {
    "first": (lambda s, v: v.values[0], lambda h: h[0]),
    "last local result": (lambda s, v: s.experimental_local_results(v)[-1], lambda h: h[-1]),
    "view": (lambda s, v: v.values[0][1:].reshape(3, 5), lambda h: h[0][1:].reshape(3, 5)),
    "strided view": (lambda s, v: v.values[-1][::2], lambda h: h[-1][::2]),
    "nest": (lambda s, v: (v.values[0], [v.values[-1][2:]], {"a": v.values[0][::3]}),
             lambda h: (h[0], [h[-1][2:]], {"a": h[0][::3]})),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hand_off", sorted(HAND_OFFS))
def test_arrays_a_merge_fn_hands_across_replicas_read_right(strategy, hand_off, seed):
    """Each replica writes its `mine` just before the merge_call and drops it after; the replica that owns
    the handed array drops the result first, so the last reference goes in another replica right after it
    queued its read; then every replica allocates arrays of the same size (its stream's blocks)."""
    merge_fn, want_of = HAND_OFFS[hand_off]
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(seed)
    devices = strategy.extended.worker_devices
    for step_no in range(3):
        hosts = [rng.standard_normal(16).astype(np.float32) for _ in range(n)]
        x = md.PerReplica([md.device_util.place(h, d) for h, d in zip(hosts, devices)], devices)

        def step(x):
            ctx = md.get_replica_context()
            r = ctx.replica_id_in_sync_group
            mine = x * np.float32(2) + np.float32(1)  # written on this replica's stream just before the hand-off
            got = ctx.merge_call(merge_fn, args=(mine,))
            del mine
            order = [n - 1 - i for i in range(n)] if seed % 2 else list(range(n))
            seen = [leaf + np.float32(0) for leaf in flatten(got)]  # queued on this replica's stream
            if r != order[-1]:
                del got
            later = [x * np.float32(3) for _ in range(4)]  # blocks of this replica's stream handed out again
            return seen, later

        seen, later = strategy.run(step, args=(x,))
        mine = [h * np.float32(2) + np.float32(1) for h in hosts]
        want = flatten(want_of(mine))
        for r in range(n):
            got = [cupy.asnumpy(strategy.experimental_local_results(leaf)[r]) for leaf in seen]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"step {step_no} replica {r} ({hand_off})")
            for leaf in later:
                np.testing.assert_array_equal(cupy.asnumpy(strategy.experimental_local_results(leaf)[r]),
                                              hosts[r] * np.float32(3))


@pytest.mark.parametrize("seed", range(3))
def test_an_array_handed_across_is_read_after_the_owner_dropped_it_and_two_collectives(strategy, seed):
    """md.function's hand-off test, eagerly: replica 0's array read by the others two all-reduces later,
    after replica 0 dropped it and wrote an array of its size."""
    rng = np.random.default_rng(seed)
    devices = strategy.extended.worker_devices
    for _ in range(3):
        hosts = [rng.standard_normal(64).astype(np.float32) for _ in devices]
        x = md.PerReplica([md.device_util.place(h, d) for h, d in zip(hosts, devices)], devices)

        check_hand_off(strategy, hosts, strategy.run(hand_off_step, args=(x,)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("where", ["non-blocking", "blocking", "legacy"])
def test_hand_offs_between_replicas_on_streams_of_their_own(strategy, where, seed):
    """Odd replicas compute on a stream of the user's (or the legacy default stream), even ones on their
    replica stream: the array of the last replica, handed to all, is still read after its writes and
    before its block is handed out again."""
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(seed)
    streams = {}
    for _ in range(3):
        hosts = [rng.standard_normal(24).astype(np.float32) for _ in range(n)]

        def step():
            ctx = md.get_replica_context()
            r = ctx.replica_id_in_sync_group
            if r % 2:
                if where == "legacy":
                    stream = cupy.cuda.Stream.null
                else:
                    stream = streams.setdefault(r, cupy.cuda.Stream(non_blocking=where == "non-blocking"))
                stream.use()
            x = cupy.asarray(hosts[r])  # (on the replica's current stream, as everything it computes)
            mine = x * np.float32(2)
            got = ctx.merge_call(lambda s, v: v.values[-1], kwargs={"v": mine})
            del mine
            seen = got - np.float32(1)
            del got
            later = [x * np.float32(5) for _ in range(3)]
            return seen, later

        seen, later = strategy.run(step)
        for stream in streams.values():
            stream.synchronize()
        for r in range(n):
            np.testing.assert_array_equal(cupy.asnumpy(strategy.experimental_local_results(seen)[r]),
                                          hosts[-1] * np.float32(2) - np.float32(1), err_msg=f"replica {r}")
            for leaf in later:
                np.testing.assert_array_equal(cupy.asnumpy(strategy.experimental_local_results(leaf)[r]),
                                              hosts[r] * np.float32(5))


@pytest.mark.parametrize("merge_fn", [
    lambda s, v: None,
    lambda s, v: v,  # each replica gets its own array back
    lambda s, v: s.experimental_local_results(v)[0] * 2,  # a new array, made on the merge stream
    lambda s, v: len(v.values),
], ids=["none", "own", "new", "number"])
def test_results_not_handed_across_replicas_cost_no_stream_work(strategy, merge_fn):
    """Only an array of one replica handed to another is ordered: every other merge_fn result costs no
    event record or wait (the simulator counts them), as many as a merge_call that returns nothing."""
    if not SIMULATED:
        pytest.skip("counts the simulated runtime's stream operations")
    n = strategy.num_replicas_in_sync
    x = strategy.run(lambda: cupy.ones(4, cupy.float32) * md.get_replica_context().replica_id_in_sync_group)

    def ops(fn):
        step = lambda v: md.get_replica_context().merge_call(fn, args=(v,))  # noqa: E731
        strategy.run(step, args=(x,))
        return launches_and_ops(lambda: strategy.run(step, args=(x,)))[1]

    assert ops(merge_fn) == ops(lambda s, v: None)
    handed = ops(lambda s, v: v.values[0])
    assert handed > ops(lambda s, v: None) or n == 1


@pytest.mark.parametrize("seed", range(2))
def test_md_function_does_not_capture_a_hand_off_between_gpus(seed):
    """md.function captures one graph per GPU, which cannot order GPU 1's reads of GPU 0's array after
    GPU 0's writes: the capture fails naming the fix and the step runs eagerly, right at every call; the
    fix it names (a collective in replica context) captures."""
    if NGPU < 2:
        pytest.skip("needs 2 GPUs")
    from mirrored.distribute.function import EagerFallbackWarning

    strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
    devices = strategy.extended.worker_devices
    rng = np.random.default_rng(seed)

    def handed(ctx, mine):
        return ctx.merge_call(lambda s, v: v.values[0], args=(mine,))

    def all_reduced(ctx, mine):
        return ctx.all_reduce(md.ReduceOp.SUM, mine * np.float32(ctx.replica_id_in_sync_group == 0))

    for share, captures in ((handed, False), (all_reduced, True)):
        def step(x):
            ctx = md.get_replica_context()
            mine = x * np.float32(2)
            got = share(ctx, mine)
            del mine
            seen = got + x
            del got
            return seen, [x * np.float32(3) for _ in range(3)]

        run = md.function(step)
        for call in range(4):
            hosts = [rng.standard_normal(32).astype(np.float32) for _ in devices]
            x = md.PerReplica([md.device_util.place(h, d) for h, d in zip(hosts, devices)], devices)
            if call == 0 and not captures:
                with pytest.warns(EagerFallbackWarning, match=r"handed replica 0's array \(on GPU 0\) to replica 1 "
                                  r"\(on GPU 1\).*ReplicaContext.all_reduce"):
                    seen, later = strategy.run(run, args=(x,))
            else:
                if SIMULATED:
                    cupy.sim.drain()
                    cupy.sim.reset_counters()
                seen, later = strategy.run(run, args=(x,))
                if SIMULATED and call > 1:  # (after the warm-up and the capture: a replay, or the eager step)
                    assert bool(cupy.sim.counters()["graph_launches"]) == captures
            for r in range(2):
                np.testing.assert_array_equal(cupy.asnumpy(strategy.experimental_local_results(seen)[r]),
                                              hosts[0] * np.float32(2) + hosts[r], err_msg=f"call {call}")
                for leaf in later:
                    np.testing.assert_array_equal(cupy.asnumpy(strategy.experimental_local_results(leaf)[r]),
                                                  hosts[r] * np.float32(3))
        assert run.experimental_get_tracing_count() == 1
