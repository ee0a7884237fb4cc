"""MirroredStrategy's replica threads: they end when the strategy goes
(without the garbage collector), Ctrl-C during ``run`` leaves the strategy
usable, and ``run`` from two threads at once is serialised."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np

import mirrored as md


def replica_threads() -> int:
    return sum(t.name.startswith("mirrored-replica-") for t in threading.enumerate())


def wait_until(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def use_and_drop_a_strategy():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
    with s.scope():
        v = md.Variable(1.0)
    got = s.run(lambda: md.get_replica_context().all_reduce("sum", v.read_value()))
    assert [float(x) for x in s.experimental_local_results(got)] == [4.0] * 4
    return weakref.ref(s), [weakref.ref(c) for c in s.extended._replica_contexts]


def test_dropped_strategies_end_their_threads_without_gc():
    """Neither a dropped strategy nor its replica contexts (which keep their all_reduce combines, with
    the cross-device ops) wait for the garbage collector."""
    before = replica_threads()
    gc.disable()
    try:
        refs = [use_and_drop_a_strategy() for _ in range(50)]
        assert all(r() is None for r, _ in refs), "a dropped strategy is kept alive by a reference cycle"
        assert all(c() is None for _, cs in refs for c in cs), "a cycle keeps the replica contexts alive"
        assert wait_until(lambda: replica_threads() <= before), f"{replica_threads() - before} replica threads left"
    finally:
        gc.enable()


def test_dropped_strategies_whose_steps_ran_on_the_replica_threads_end_them():
    """Long steps run on the replica threads; a thread that ran one must not keep its strategy alive."""
    def use_and_drop():
        s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])

        def long_step():  # (waits: handed to the replica threads from the second step on)
            time.sleep(0.15)
            return threading.current_thread().name

        names = []
        for _ in range(3):
            names += s.experimental_local_results(s.run(long_step))
        assert any(name.startswith("mirrored-replica-") for name in names), names
        return weakref.ref(s)

    before = replica_threads()
    refs = [use_and_drop() for _ in range(3)]
    gc.collect()
    assert all(r() is None for r in refs), "a replica thread keeps its dropped strategy alive"
    assert wait_until(lambda: replica_threads() <= before), f"{replica_threads() - before} replica threads left"


def test_a_strategy_dropped_after_steps_that_hold_it_ends_its_threads():
    """What a run held (its function, which holds the optimizer, and a merge_call's results: here the strategy
    itself) goes when the run ends, not at the next run: the replica threads sleeping in the pool's group must
    not keep a strategy the program dropped (nor, through it, its optimizer and arrays)."""
    def use_and_drop():
        s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with s.scope():
            w = md.Variable(np.ones(4, np.float32))
            opt = md.optimizers.Adam(0.1)

        def step():
            opt.apply_gradients([(np.ones(4, np.float32), w)])
            return md.get_replica_context().merge_call(lambda strategy: strategy) is s

        for _ in range(2):
            assert all(s.experimental_local_results(s.run(step)))
        return weakref.ref(s), weakref.ref(opt)

    before = replica_threads()
    refs = [use_and_drop() for _ in range(3)]
    gc.collect()
    assert [r() for r, _ in refs] == [None] * 3, "the pool's sleeping threads keep their dropped strategy alive"
    assert [o() for _, o in refs] == [None] * 3, "the dropped strategy's optimizer is kept alive"
    assert wait_until(lambda: replica_threads() <= before), f"{replica_threads() - before} replica threads left"


def test_concurrent_runs_from_two_threads_are_serialised():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    errors, counts = [], [0, 0]

    def worker(k):
        try:
            for i in range(150):
                x = np.float32(i + k)
                got = s.run(lambda: md.get_replica_context().all_reduce("sum", x))
                values = [float(v) for v in s.experimental_local_results(got)]
                assert values == [3.0 * (i + k)] * 3, values
                counts[k] += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "concurrent runs hung"
    assert not errors, errors[0]
    assert counts == [150, 150]


def test_long_replicas_still_run_in_parallel():
    """The caller runs replicas no thread has claimed yet; long ones still overlap on their threads."""
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
    s.run(lambda: None)  # threads started
    t0 = time.perf_counter()
    got = s.run(lambda: (time.sleep(0.25), md.get_replica_context().replica_id_in_sync_group)[1])
    elapsed = time.perf_counter() - t0
    assert [int(x) for x in s.experimental_local_results(got)] == [0, 1, 2, 3]
    assert elapsed < 0.75, f"4 replicas sleeping 0.25 s took {elapsed:.2f} s: they ran one after another"


def test_a_failing_replica_fails_the_run_and_the_next_run_works():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])

    def fn():
        rid = md.get_replica_context().replica_id_in_sync_group
        if rid == 1:
            raise ValueError("replica 1 fails")
        return md.get_replica_context().all_reduce("sum", 1.0)

    for _ in range(20):
        try:
            s.run(fn)
            raise AssertionError("no error")
        except ValueError as e:
            assert "replica 1 fails" in str(e)
        got = s.run(lambda: md.get_replica_context().all_reduce("sum", 2.0))
        assert [float(v) for v in s.experimental_local_results(got)] == [6.0] * 3


# Real SIGINTs need the process's main thread: run in a child process.
CTRL_C = textwrap.dedent("""
    import os, signal, threading, time
    import mirrored as md
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])

    started = threading.Event()

    def slow():
        rid = md.get_replica_context().replica_id_in_sync_group
        started.set()
        time.sleep(5.0 if rid == 0 else 1.0)
        return rid

    def ids():
        return md.get_replica_context().replica_id_in_sync_group

    def ctrl_c_twice():
        started.wait()  # the replicas are running: the Ctrl-Cs land inside run, however busy the machine
        for _ in range(2):
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)

    killer = threading.Thread(target=ctrl_c_twice, daemon=True)
    killer.start()
    t0 = time.monotonic()
    try:
        s.run(slow)
        print("no interrupt")
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - t0, 1))
    # The second Ctrl-C lands in run, or here once run has returned: absorb it.
    while killer.is_alive():
        try:
            killer.join()
        except KeyboardInterrupt:
            pass
    try:
        time.sleep(0.2)  # (a signal sent just before the thread ended is handled here)
    except KeyboardInterrupt:
        pass
""")
CTRL_C_AFTER = textwrap.dedent("""
    # The strategy still works: the interrupted run's replicas are waited for, its results dropped.
    for _ in range(3):
        got = s.run(ids)
        print("ids", [int(x) for x in s.experimental_local_results(got)])
    # And from another thread.
    out = []
    t = threading.Thread(target=lambda: out.append(s.experimental_local_results(s.run(ids))))
    t.start(); t.join(30)
    print("thread ids", [int(x) for x in out[0]])
    x = s.run(lambda: md.get_replica_context().all_reduce("sum", 1.0))
    print("sum", [float(v) for v in s.experimental_local_results(x)])
""")


def test_ctrl_c_twice_during_run_leaves_the_strategy_usable():
    code = CTRL_C + CTRL_C_AFTER
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("interrupted after"), lines
    assert float(lines[0].split()[-1]) < 1.0, "Ctrl-C did not interrupt run promptly"
    assert lines[1:4] == ["ids [0, 1, 2]"] * 3, lines
    assert lines[4] == "thread ids [0, 1, 2]", lines
    assert lines[5] == "sum [3.0, 3.0, 3.0]", lines



def test_a_run_interrupted_between_its_replicas_leaves_the_pool_usable():
    # Ctrl-C landing in the caller's own loop (here: the pool's wake-up check, asked at a claim, raises it)
    # with replicas not started yet: they count as finished, the run raises, and the next run is whole.
    import pytest

    pytest.importorskip("greenlet")
    from mirrored.distribute.mirrored_strategy import _ReplicaPool

    pool = _ReplicaPool(3, cooperative=True)
    asked, ran, got = [], [], []

    def wake():
        asked.append(True)
        if len(asked) == 1:
            raise KeyboardInterrupt
        return False

    def two_runs():
        try:
            pool.run(ran.append)
        except KeyboardInterrupt:
            got.append("interrupted")
        got.append(pool.run(lambda i: i * 2))

    pool.group.pool(pool._complete, wake, 0.0)  # (asked at every claim)
    runner = threading.Thread(target=two_runs, daemon=True)
    runner.start()
    runner.join(60)
    pool.close()
    assert got == ["interrupted", [0, 2, 4]], "the interrupted run hung, or the next one was not whole"
    assert ran == [0]
