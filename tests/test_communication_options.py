"""Per-call CommunicationOptions (``options=`` of every collective call): TensorFlow 2.21's merge, signatures and
results (recorded by tests/data/record_tf_communication_options.py), bad input, and a real two-worker job where
one call's own timeout ends it."""

import inspect
import json
import os
import time

import numpy as np
import pytest

import mirrored as md
from data_parity import DATA, logical_cpus
from multiworker_launch import launch
from multiworker_marks import MULTIWORKER
from recorded_results import replica_values

with open(os.path.join(DATA, "tf_communication_options_reference.json")) as f:
    REF = json.load(f)

CO = md.distribute.experimental.CommunicationOptions
IMPL = md.distribute.experimental.CommunicationImplementation
SUM = md.ReduceOp.SUM

# The recorder's CALL_OPTIONS, in mirrored's names.
CALL_OPTIONS = {
    "none": lambda: None,
    "packed_ring": lambda: CO(bytes_per_pack=8, timeout_seconds=30.0, implementation=IMPL.RING),
    "timeout_only": lambda: CO(timeout_seconds=30.0),
    "no_timeout": lambda: CO(timeout_seconds=0),
    "nccl": lambda: CO(implementation=IMPL.NCCL),
    "wrong_str": lambda: "RING",
    "wrong_int": lambda: 5,
    "wrong_dict": lambda: {"timeout_seconds": 1.0},
}


# A difference older than per-call options (TF returns a pair reduced to one device string as a two-component
# Mirrored under a two-CPU MirroredStrategy; mirrored returns the array): there the calls with options must
# give what the call without gives.
BEFORE_OPTIONS = {("mirrored", "2", "extended.batch_reduce_to")}


def test_reference_is_tf_2_21():
    assert REF["tensorflow"].startswith("2.21")


@pytest.mark.parametrize("case", REF["merge"], ids=lambda c: f"{c['base']}<-{c['call']}")
def test_merge_matches_tensorflow(case):
    b, t, i = case["base"]
    base = CO(b, t, implementation=IMPL[i])
    call = None if case["call"] is None else CO(*case["call"][:2], implementation=IMPL[case["call"][2]])
    merged = base.merge(call)
    assert merged is not base and merged is not call  # a new object, as TF's deep copy
    assert {"bytes_per_pack": merged.bytes_per_pack, "timeout_seconds": merged.timeout_seconds,
            "implementation": merged.implementation.name} == case["merged"]


@pytest.mark.parametrize("name", sorted(REF["signatures"]))
def test_which_calls_take_options_matches_tensorflow(name):
    owner, method = name.split(".")
    ours = getattr(getattr(md.distribute, owner), method, None)
    expected = REF["signatures"][name]
    if expected is None:  # TF has no such public method
        return
    assert ours is not None, name
    params = [p for p in inspect.signature(ours).parameters if p != "self"]
    assert params[:len(expected)] == expected, (name, params)


def _outcome(thunk):
    try:
        return {"value": replica_values(thunk(), md.distribute.DistributedValues)}
    except Exception as e:  # (compared with what TF raised)
        return {"raises": e, "msg": str(e)}


def _calls(strategy, options):
    """The recorder's calls, each with ``options()``."""
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([1.0 + ctx.replica_id_in_sync_group, 2.0, 3.0], np.float32))
    dest = strategy.extended.worker_devices[0]

    def replica(fn):
        return lambda: strategy.run(lambda v: fn(md.distribute.get_replica_context(), v), args=(pr,))

    cdo = strategy.extended._cross_device_ops
    return {
        "ctx.all_reduce": replica(lambda ctx, v: ctx.all_reduce("sum", v, options=options())),
        "ctx.all_reduce_nest": replica(lambda ctx, v: ctx.all_reduce("sum", [v, v * 2.0], options=options())),
        "ctx.all_gather": replica(lambda ctx, v: ctx.all_gather(v, axis=0, options=options())),
        "extended.reduce_to_self": lambda: strategy.extended.reduce_to(SUM, pr, pr, options=options()),
        "extended.reduce_to_device": lambda: strategy.extended.reduce_to(SUM, pr, dest, options=options()),
        "extended.batch_reduce_to": lambda: strategy.extended.batch_reduce_to(
            SUM, [(pr, pr), (pr, dest)], options=options()),
        "cdo.reduce": lambda: md.distribute.ReductionToOneDevice().reduce(SUM, pr, dest, options=options()),
        "cdo.batch_reduce": lambda: md.distribute.ReductionToOneDevice().batch_reduce(
            SUM, [(pr, pr)], options=options()),
        "strategy_cdo.reduce": lambda: cdo.reduce(SUM, pr, pr, options=options()),
        "strategy_cdo.batch_reduce": lambda: cdo.batch_reduce(SUM, [(pr, pr)], options=options()),
    }


@pytest.fixture
def no_cluster(monkeypatch):
    for name in ("TF_CONFIG", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("cpus", ["1", "2"])
@pytest.mark.parametrize("kind", ["mirrored", "multi_worker"])
def test_every_call_with_options_matches_tensorflow(kind, cpus, no_cluster):
    """Values with options equal TF's (and the values without); options of a wrong type raise an AttributeError
    (as TF's) naming the argument, also where TF ignores them (one replica, ReductionToOneDevice)."""
    recorded = REF["by_cpus"]["strategies"][cpus][kind]
    n = int(cpus)
    with logical_cpus(n):
        strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)]) if kind == "mirrored" else \
            md.MultiWorkerMirroredStrategy()
        for option, thunk in CALL_OPTIONS.items():
            assert strategy.num_replicas_in_sync == recorded[option]["replicas"]
            for call, run in _calls(strategy, thunk).items():
                want, got = recorded[option]["results"][call], _outcome(run)
                if option.startswith("wrong"):
                    assert "raises" in got, (option, call, got)
                    assert isinstance(got["raises"], (AttributeError, TypeError)), (option, call, got)
                    assert "options=" in got["msg"] and "CommunicationOptions" in got["msg"], got["msg"]
                    if "raises" in want:
                        assert want["raises"] == "AttributeError" and isinstance(got["raises"], AttributeError)
                    continue
                assert "raises" not in want, want
                if (kind, cpus, call) in BEFORE_OPTIONS:  # options change nothing there
                    assert got == _outcome(_calls(strategy, CALL_OPTIONS["none"])[call]), (option, call)
                    continue
                assert got == want, (option, call)


def test_strategy_level_nccl_on_cpu_stays_refused(no_cluster):
    """(TF builds it and falls back; mirrored refuses it up front, naming the fix: a documented difference.)"""
    assert "raises" not in REF["by_cpus"]["strategies"]["1"]["multi_worker_nccl"]
    with pytest.raises(ValueError, match="NCCL needs GPU replicas"):
        md.MultiWorkerMirroredStrategy(communication_options=CO(implementation=IMPL.NCCL))


def test_bytes_per_pack_per_call_gives_the_same_numbers():
    with logical_cpus(2):
        strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        rng = np.random.default_rng(3)
        values = [strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: rng.integers(-9, 9, size=s).astype(np.float32)) for s in [(5,), (3, 4), (1,), (40,)]]
        pairs = [(v, v) for v in values]
        plain = strategy.extended.batch_reduce_to(SUM, pairs)
        for bpp in (4, 16, 100, 1 << 20):
            packed = strategy.extended.batch_reduce_to(SUM, pairs, options=CO(bytes_per_pack=bpp))
            for p, q in zip(plain, packed):
                for a, b in zip(p.values, q.values):
                    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", ["RING", 5, {"timeout_seconds": 1.0}, md.distribute.InputOptions()])
def test_options_of_a_wrong_type_name_the_argument(bad):
    with logical_cpus(2):
        strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        pr = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(3, np.float32))
        for call in (lambda: strategy.extended.reduce_to(SUM, pr, pr, options=bad),
                     lambda: strategy.extended.batch_reduce_to(SUM, [(pr, pr)], options=bad),
                     lambda: md.distribute.RingAllReduce().reduce(SUM, pr, pr, options=bad),
                     lambda: md.distribute.RingAllReduce().batch_reduce(SUM, [(pr, pr)], options=bad),
                     lambda: strategy.run(lambda: md.distribute.get_replica_context().all_reduce(
                         "sum", np.ones(2), options=bad)),
                     lambda: strategy.run(lambda: md.distribute.get_replica_context().all_gather(
                         np.ones(2), 0, options=bad)),
                     lambda: CO().merge(bad)):
            with pytest.raises(AttributeError, match=r"options=.*expected md\.distribute\.experimental\."
                                                     r"CommunicationOptions") as caught:
                call()
            assert isinstance(caught.value, TypeError)


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan"), "2", 1e10])
def test_a_bad_timeout_names_timeout_seconds(timeout):
    with pytest.raises(ValueError, match="timeout_seconds="):
        CO(timeout_seconds=timeout)


# --- a two-worker job: one call's own timeout -------------------------------------------------


def one_call_times_out(folder, deadline, call):
    """Both workers: batch_reduce_to with and without a per-call bytes_per_pack, and a per-call NCCL (refused on
    CPU replicas before anything is sent). Then worker 0 all-reduces with options=CommunicationOptions(
    timeout_seconds=2) while worker 1 does not arrive (it waits for worker 0's file), and once more without
    options; the strategy has no timeout."""
    from mirrored.cluster_resolver import TFConfigClusterResolver

    resolver = TFConfigClusterResolver()
    strategy = md.MultiWorkerMirroredStrategy(resolver)
    rank = resolver.task_id
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(12, dtype=np.float32) * (1 + rank))
    pr2 = strategy.experimental_distribute_values_from_function(lambda ctx: np.full((3, 3), 1.0 + rank))
    def local(results):
        return [np.asarray(strategy.experimental_local_results(v)[0]) for v in results]

    out = {"plain": local(strategy.extended.batch_reduce_to(SUM, [(pr, pr), (pr2, pr2)])),
           "packed": local(strategy.extended.batch_reduce_to(SUM, [(pr, pr), (pr2, pr2)],
                                                             options=CO(bytes_per_pack=8)))}
    try:
        strategy.extended.reduce_to(SUM, pr, pr, options=CO(implementation=IMPL.NCCL))
    except ValueError as e:
        out["nccl"] = str(e)
    done = os.path.join(folder, "done")
    if rank == 1:
        while not os.path.exists(done) and time.monotonic() < deadline:  # not arriving: waiting on worker 0
            time.sleep(0.05)
        return out

    calls = {
        "ctx.all_reduce": lambda o: strategy.run(
            lambda: md.distribute.get_replica_context().all_reduce("sum", np.ones(2), options=o)),
        "ctx.all_gather": lambda o: strategy.run(
            lambda: md.distribute.get_replica_context().all_gather(np.ones(2), 0, options=o)),
        "reduce_to": lambda o: strategy.extended.reduce_to(SUM, pr, pr, options=o),
    }

    def all_reduce(options):
        started = time.monotonic()
        try:
            calls[call](options)
            return ("returned", None, time.monotonic() - started)
        except Exception as e:
            return (type(e).__mro__[1:], str(e), time.monotonic() - started)

    try:
        out["timed"] = all_reduce(CO(timeout_seconds=2))
        out["after"] = all_reduce(None)
    finally:
        open(done, "w").close()
    out["timed"] = ([c.__name__ for c in out["timed"][0]],) + out["timed"][1:]
    out["after"] = ([c.__name__ for c in out["after"][0]],) + out["after"][1:]
    return out


@pytest.mark.parametrize("call, shm", [("ctx.all_reduce", "1"), ("ctx.all_reduce", "0"), ("reduce_to", "1"),
                                       ("ctx.all_gather", "0")])
@MULTIWORKER[0]
@MULTIWORKER[1]
def test_a_calls_own_timeout_ends_it_in_bounded_time(call, shm, tmp_path):
    started = time.monotonic()
    results = launch(one_call_times_out, 2, kwargs={"folder": str(tmp_path), "deadline": time.monotonic() + 120,
                                                    "call": call},
                     env={"MIRRORED_SHM": shm}, timeout=150)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
        for a, b in zip(r.value["plain"], r.value["packed"]):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(r.value["plain"][0], np.arange(12) * 3.0)
        assert "implementation NCCL needs GPU replicas" in r.value["nccl"]
    bases, message, seconds = results[0].value["timed"]
    # TF's error type (tf.errors.DeadlineExceededError), naming the late task and the call's timeout.
    assert "DeadlineExceededError" in bases and "TimeoutError" in bases, bases
    assert "worker:1 did not reach this collective within its timeout of 2" in message, message
    assert f"since {'all_gather' if call == 'ctx.all_gather' else 'all_reduce'} #" in message, message
    assert 1.5 < seconds < 2 + 20, seconds  # 2 s, scaled generously for a loaded machine
    # The job's collectives are broken from then on (docs/multi_worker.md): the next call raises at once.
    bases, message, seconds = results[0].value["after"]
    assert "ConnectionError" in bases and "broken since" in message, (bases, message)
    assert seconds < 10
    assert time.monotonic() - started < 150


# --- a call's implementation picks the engine of GPU replicas across workers ----------------


@pytest.mark.parametrize("strategy_impl, nccl_installed, calls, engines", [
    # (the strategy's implementation, whether NCCL is installed, the calls' implementations,
    #  the engine each call runs on, and so the engines made: at most one of each kind)
    ("AUTO", True, [None, "RING", "NCCL", "RING", None], ["nccl", "host", "nccl", "host", "nccl"]),
    ("AUTO", False, [None, "NCCL", "RING"], ["host", "nccl", "host"]),
    ("RING", True, ["NCCL", None, "RING", "NCCL"], ["nccl", "host", "host", "nccl"]),
    ("NCCL", True, ["RING", "NCCL", None], ["host", "nccl", "nccl"]),
])
def test_a_calls_implementation_picks_the_engine_of_gpu_replicas(strategy_impl, nccl_installed, calls, engines,
                                                                  monkeypatch):
    from mirrored.collective import multi_worker
    from mirrored.device import gpu

    made = []

    class Nccl:
        def __init__(self, group):
            made.append("nccl")

    class Host:
        def __init__(self, group):
            made.append("host")

    monkeypatch.setattr(multi_worker, "_NcclJob", Nccl)
    monkeypatch.setattr(multi_worker, "_HostStaged", Host)
    monkeypatch.setattr(gpu, "nccl_available", lambda: nccl_installed)
    group = multi_worker.WorkerCollectives.__new__(multi_worker.WorkerCollectives)
    group._implementation, group._device_engine, group._call_engine = strategy_impl, None, None
    picked = [group._device(implementation) for implementation in calls]
    assert ["nccl" if isinstance(e, Nccl) else "host" for e in picked] == engines
    assert sorted(made) == sorted(set(engines))  # each kind made once, on its first call


def test_host_staged_gpu_calls_pass_the_calls_timeout_on():
    """GPU replicas staged through host memory run the Gloo collectives with the call's own timeout."""
    from mirrored.collective import multi_worker

    seen = []

    class Group:
        devices, local_replicas = ["/cpu:0"], 1

        def _record(self, name, result):
            def call(*args, timeout=None, **kwargs):
                seen.append((name, timeout))
                return result
            return call

        def __getattr__(self, name):
            if name == "batch_all_reduce":
                return self._record(name, [[np.ones(2)]])
            return self._record(name, np.ones(2) if name == "reduce" else [np.ones(2)])

    staged = multi_worker._HostStaged(Group())
    x = [np.ones(2)]
    staged.all_reduce(x, timeout=2.5)
    staged.broadcast(x, timeout=3)
    staged.reduce(x, timeout=0)
    staged.all_gather(x, 0, timeout=4.0)
    staged.batch_all_reduce([x], timeout=None)
    assert seen == [("all_reduce", 2.5), ("broadcast", 3), ("reduce", 0), ("all_gather", 4.0),
                    ("batch_all_reduce", None)]


@pytest.mark.parametrize("timeout, native", [(None, -1.0), (0, 0.0), (float("inf"), 0.0), (2, 2.0), (0.25, 0.25)])
def test_native_timeout_of_a_call(timeout, native):
    from mirrored.collective.multi_worker import native_timeout

    assert native_timeout(timeout) == native
