"""The replicas' rendezvous (_core.Rendezvous, distribute_lib._Group): collectives inside strategy.run
give NumPy's answer whichever way the replicas run (plain calls, greenlets on the caller's thread,
replica threads, or a mix), and every misuse ends in a clear error, never a hang."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from mirrored.distribute import mirrored_strategy
from mirrored.distribute.distribute_lib import _Group

OPS = {"sum": np.sum, "mean": np.mean, "min": np.min, "max": np.max}
STRATEGIES = {}


def strategy(n):
    if n not in STRATEGIES:
        STRATEGIES[n] = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    return STRATEGIES[n]


def per_replica(s, values):
    return s.experimental_distribute_values_from_function(lambda ctx: values[ctx.replica_id_in_sync_group])


def expected(op, values):
    return OPS[op](np.stack(values), axis=0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), op=st.sampled_from(sorted(OPS)), dtype=st.sampled_from([np.float32, np.float64, np.int32]),
       shape=st.sampled_from([(1,), (3,), (2, 5)]), collectives=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_steps_with_several_collectives_match_numpy(n, op, dtype, shape, collectives, seed):
    rng = np.random.default_rng(seed)
    values = [rng.integers(-50, 50, shape).astype(dtype) for _ in range(n)]
    s = strategy(n)

    def step(v):
        ctx = md.get_replica_context()
        got = []
        for k in range(collectives):  # each collective parks and resumes every replica but the last to arrive
            got.append(ctx.all_reduce(op, v + k))
        return got

    got = s.run(step, args=(per_replica(s, values),))
    for k in range(collectives):
        want = expected(op, [v + k for v in values])
        for r in s.experimental_local_results(got[k]):
            np.testing.assert_allclose(r, want, rtol=1e-6)


@pytest.mark.parametrize("n", [3, 4])
def test_replicas_on_threads_meet_replicas_on_greenlets(monkeypatch, n):
    if mirrored_strategy._greenlet is None:
        pytest.skip("without greenlet every replica but the caller's runs on its thread")
    # Every step counts as long, so the caller wakes the replica threads once it needs a second replica.
    # Replica 1, claimed by the caller (a greenlet on its thread), blocks until a replica thread has taken a
    # replica: the collectives then meet the caller's replicas and the threads' ones.
    monkeypatch.setattr(mirrored_strategy, "HANDOFF_SECONDS", 0.0)
    monkeypatch.setattr(mirrored_strategy, "BLOCKED_SECONDS", 0.0)
    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    values = [np.full(4, i + 1, np.float64) for i in range(n)]
    x = per_replica(s, values)
    caller = threading.get_ident()
    on_threads, on_greenlets = [], []

    def step(v):
        ctx = md.get_replica_context()
        if threading.get_ident() != caller:
            on_threads.append(ctx.replica_id_in_sync_group)
            thread_took_one.set()
        elif ctx.replica_id_in_sync_group:  # (before replica 0 returns: a greenlet)
            on_greenlets.append(ctx.replica_id_in_sync_group)
            assert thread_took_one.wait(timeout=60), "no replica thread took a replica"
        a = ctx.all_reduce("sum", v)
        b = ctx.merge_call(lambda strategy, parts: parts, args=(v * 2,))
        return a, ctx.all_reduce("max", b)

    for _ in range(20):
        thread_took_one = threading.Event()
        got_sum, got_max = s.run(step, args=(x,))
        for r in s.experimental_local_results(got_sum):
            np.testing.assert_array_equal(r, expected("sum", values))
        for r in s.experimental_local_results(got_max):
            np.testing.assert_array_equal(r, expected("max", [v * 2 for v in values]))
    assert on_threads and on_greenlets, (on_threads, on_greenlets)


def test_a_replica_may_pass_an_array_or_a_structure_and_gets_its_own_back():
    s = strategy(3)
    values = [np.arange(3.0) + i for i in range(3)]
    got = {}

    def step(v):
        ctx = md.get_replica_context()
        r = ctx.replica_id_in_sync_group
        got[r] = ctx.all_reduce("sum", v if r == 1 else [v])

    s.run(step, args=(per_replica(s, values),))
    want = expected("sum", values)
    np.testing.assert_array_equal(got[1], want)
    for r in (0, 2):
        assert isinstance(got[r], list) and len(got[r]) == 1
        np.testing.assert_array_equal(got[r][0], want)


def test_a_replica_that_skips_the_collective_strands_the_others_with_an_error_naming_them():
    s = strategy(4)

    def step():
        ctx = md.get_replica_context()
        if ctx.replica_id_in_sync_group == 2:
            return None
        return ctx.all_reduce("sum", np.ones(2))

    with pytest.raises(RuntimeError, match=r"replica\(s\) \[0, 1, 3\] wait in all_reduce"):
        s.run(step)
    got = s.run(lambda: md.get_replica_context().all_reduce("sum", np.ones(2)))  # the strategy still works
    np.testing.assert_array_equal(s.experimental_local_results(got)[3], [4.0, 4.0])


def test_a_failing_combine_fails_every_replica_once_and_the_next_run_works():
    s = strategy(3)

    def step():
        ctx = md.get_replica_context()
        return ctx.all_reduce("sum", np.ones(2 + ctx.replica_id_in_sync_group))  # shapes differ

    with pytest.raises(ValueError):
        s.run(step)
    got = s.run(lambda: md.get_replica_context().all_reduce("sum", np.ones(2)))
    np.testing.assert_array_equal(s.experimental_local_results(got)[0], [3.0, 3.0])


def test_a_replica_raising_while_others_are_parked_fails_the_run_with_its_error():
    s = strategy(4)

    def step():
        ctx = md.get_replica_context()
        if ctx.replica_id_in_sync_group == 3:
            raise KeyError("replica 3")
        return ctx.all_reduce("sum", np.ones(1))

    for _ in range(3):
        with pytest.raises(KeyError, match="replica 3"):
            s.run(step)
    got = s.run(lambda: md.get_replica_context().all_reduce("sum", np.ones(1)))
    assert [float(r[0]) for r in s.experimental_local_results(got)] == [4.0] * 4


def test_the_group_checks_its_arguments():
    with pytest.raises(ValueError, match="at least one replica"):
        _Group(0)
    group = _Group(2)
    with pytest.raises(ValueError, match=r"rid=2: expected a replica index in \[0, 2\)"):
        group.exchange(2, "all_reduce", None, list)
    with pytest.raises(TypeError, match="takes 4 or 5 arguments"):
        group.exchange(0, "all_reduce", None)
    with pytest.raises(TypeError, match="cooperate"):
        group.reset([])
    single = _Group(1)
    assert single.exchange(0, "all_reduce", 5, lambda slots: [slots[0] + 1]) == 6


def test_an_exchange_checks_its_context_is_the_threads_current_one():
    # exchange(..., context): natively when the context is the top of the thread's context stack (a replica's
    # collective), else through context._require_current(kind), which raises before the replica arrives.
    from mirrored.distribute.context import _Context, _local

    class Context:
        asked = []

        def _require_current(self, kind):
            self.asked.append(kind)
            raise RuntimeError(f"{kind}: not this thread's replica context")

    group, context, other = _Group(1), Context(), Context()
    saved = getattr(_local, "stack", None)
    try:
        _local.stack = [_Context(None, context)]
        assert group.exchange(0, "all_reduce", 5, lambda slots: [slots[0] + 1], context) == 6
        assert Context.asked == []
        for stack in ([_Context(None, other)], [], None):
            _local.stack = stack
            with pytest.raises(RuntimeError, match="all_gather: not this thread's"):
                group.exchange(0, "all_gather", 5, lambda slots: [slots[0] + 1], context)
        assert Context.asked == ["all_gather"] * 3
        del _local.stack  # (a thread that never entered a strategy)
        with pytest.raises(RuntimeError, match="not this thread's"):
            group.exchange(0, "all_reduce", 5, lambda slots: [slots[0] + 1], context)
    finally:
        _local.stack = saved


def test_a_greenlet_whose_wait_fails_leaves_no_stale_wake_up():
    # A parked greenlet whose wait fails (here the claim of the next replica raises: the pool's wake(),
    # asked at a claim once the step has run `handoff` seconds, raises, as Ctrl-C may make it) leaves the
    # collective: no later notify may resume it where it no longer waits. The failed claim loses no replica.
    greenlet = pytest.importorskip("greenlet")
    from mirrored.distribute.distribute_lib import _Aborted

    group, seen = _Group(3), {}
    wakes = iter([False, "fail"])

    def wake():
        if next(wakes, False) == "fail":
            raise RuntimeError("claim failed")
        return False

    def replica(i):
        try:
            return group.exchange(i, "all_reduce", i, lambda slots: [sum(slots)] * 3)
        except BaseException as e:
            seen[i] = e
            raise

    group.pool(lambda: None, wake, 0.0)
    group.cooperate((), None, greenlet)
    mine, claims, arrived, outputs, errors = object(), {}, [False] * 3, [None] * 3, []
    group.reset([], replica, outputs, errors, claims, mine, arrived, False)
    group.run_replica(0)  # the hub: serves replica 1 as a greenlet, whose wait fails
    while group.unclaimed:
        i = group.claim()
        if i is None:
            break
        group.run_replica(i)  # (skipped: the run failed; it arrives all the same)
    group.drain()
    assert [type(e) for e in errors] == [RuntimeError] and str(errors[0]) == "claim failed", errors
    assert isinstance(seen[0], _Aborted) and 2 not in seen, seen
    assert outputs == [None] * 3 and arrived == [False, True, True] and group.completed
    assert group.unfinished == 0
    assert claims == {1: mine, 2: mine}


def test_the_native_claims_runs_and_arrivals_of_a_run():
    group = _Group(4)
    calls = []
    group.pool(lambda: calls.append("complete"), lambda: calls.append("wake") or True, 0.0)
    mine, claims, arrived, outputs, errors = object(), {2: "a thread's"}, [False] * 4, [None] * 4, []

    def replica(i):
        if i == 3:
            raise KeyError("replica 3")
        return i * 10

    group.reset(None, replica, outputs, errors, claims, mine, arrived, False)
    assert group.unclaimed and not group.completed
    assert [group.claim(), group.claim(), group.claim()] == [1, 3, None]  # 2 is the thread's
    assert calls == ["wake"] and claims == {1: mine, 2: "a thread's", 3: mine}  # woken once: asked no more
    assert not group.unclaimed
    group.run_replica(0)
    group.run_replica(1)
    group.run_replica(3)
    assert outputs == [0, 10, None, None] and [str(e) for e in errors] == ["'replica 3'"]
    assert arrived == [False, True, False, True] and not group.completed
    group.run_replica(2, False)  # the last, on a thread of its own: the pool hears of it by complete()
    assert outputs == [0, 10, 20, None] and arrived == [False, True, True, True]
    assert calls == ["wake", "complete"] and not group.completed
    outputs, errors = [None] * 4, []
    group.reset(None, replica, outputs, errors, {}, mine, [False] * 4, True)
    assert [group.claim() for _ in range(4)] == [1, 2, 3, None]
    for i in (0, 3, 2, 1):  # replica 3 fails: the caller's replicas not started yet are skipped
        group.run_replica(i)
    assert outputs == [0, None, None, None] and len(errors) == 1
    assert group.completed and calls == ["wake", "complete"]  # the last on the caller's thread: no call
    with pytest.raises(TypeError, match="claims"):
        group.reset(None, replica, [None] * 4, [], [], mine, [False] * 4, True)
    with pytest.raises(TypeError, match="lists of 4 items"):
        group.reset(None, replica, [None] * 4, [], {}, mine, [False] * 3, True)
    with pytest.raises(TypeError, match="fn needs outputs and errors"):
        group.reset(None, replica)
    group.reset(None)
    with pytest.raises(RuntimeError, match="no run under way"):
        group.run_replica(0)
    for i in (0, 4):
        with pytest.raises(ValueError, match=r"expected a replica index in \[1, 4\)"):
            group.arrive(i, True)
    with pytest.raises(RuntimeError, match=r"cooperate\(\) first"):
        group.save_state()


def test_the_thread_state_goes_and_comes_back_natively():
    import threading

    here = threading.local()
    here.a = 1
    group = _Group(2)
    group.cooperate(((here, "a", None), (here, "b", "default")), None, None)
    saved = group.save_state()
    assert saved == (1, "default")
    here.a, here.b = 2, 3
    group.restore_state(saved)
    assert (here.a, here.b) == (1, "default")
    with pytest.raises(TypeError, match="what save_state"):
        group.restore_state((1,))
    with pytest.raises(TypeError, match="triples"):
        group.cooperate(((here, "a"),), None, None)


MISUSED_RENDEZVOUS = textwrap.dedent("""
    from mirrored._core import Rendezvous
    from mirrored.distribute.distribute_lib import _Group

    def refused(call):
        try:
            call()
        except (TypeError, RuntimeError) as e:
            print(type(e).__name__, e)

    uninitialised = Rendezvous.__new__(Rendezvous)
    refused(lambda: uninitialised.exchange(0, "all_reduce", 1, list))
    refused(lambda: uninitialised._exchange(0, "all_reduce", 1, list))
    refused(lambda: uninitialised.abort())
    refused(lambda: _Group(2).run_replica(0))
    print("alive")
""")


def test_a_group_used_before_it_is_set_up_raises_instead_of_crashing():
    # (A subprocess: before the fix these calls dereferenced null callables and killed the interpreter.)
    done = subprocess.run([sys.executable, "-c", MISUSED_RENDEZVOUS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "alive"
    assert sum("Rendezvous.__init__ was not called" in line for line in lines) == 3, lines
    assert any("no run under way" in line for line in lines), lines


CTRL_C_IN_A_COLLECTIVE = textwrap.dedent("""
    import os, signal, threading, time
    import numpy as np
    import mirrored as md
    from mirrored.distribute import mirrored_strategy
    # Every step counts as long, so from the second run on the replica threads take replicas from the start.
    mirrored_strategy.HANDOFF_SECONDS = mirrored_strategy.BLOCKED_SECONDS = 0.0
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    s.run(lambda: None)
    caller, on_thread = threading.get_ident(), threading.Event()

    def step():
        ctx = md.get_replica_context()
        if threading.get_ident() != caller:  # replica 1, on its thread: late to the collective
            on_thread.set()
            time.sleep(3.0)
            return ctx.all_reduce("sum", np.ones(1))
        # The caller's replica waits for it in the collective, asleep in the rendezvous.
        assert on_thread.wait(60), "no replica thread took a replica"
        try:
            return ctx.all_reduce("sum", np.ones(1))
        except KeyboardInterrupt:
            print("the caller's replica interrupted after", round(time.monotonic() - t0, 1))
            raise

    def ctrl_c():
        on_thread.wait()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    t0 = time.monotonic()
    try:
        s.run(step)
        print("no interrupt")
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - t0, 1))
    got = s.run(lambda: md.get_replica_context().all_reduce("sum", np.ones(1)))  # waits for the late replica
    print("sum", [float(v[0]) for v in s.experimental_local_results(got)])
""")


def test_ctrl_c_reaches_a_caller_asleep_in_a_collective_and_the_strategy_stays_usable():
    proc = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_COLLECTIVE], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # Interrupted in its wait (Ctrl-C ~0.3 s after replica 1 started, far from its 3 s); the run then waits
    # for replica 1, which finds the group broken.
    assert lines[0].startswith("the caller's replica interrupted after"), lines
    assert float(lines[0].split()[-1]) < 2.5, lines
    assert lines[1].startswith("interrupted after"), lines
    assert lines[2] == "sum [2.0, 2.0]", lines
