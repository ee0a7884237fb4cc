"""md.config answers as TF 2.21's tf.config does (tests/data/tf_config_reference.json, recorded by
tests/data/record_tf_config.py, a process per scenario), and its settings act: hidden GPUs are absent from every
strategy, run_functions_eagerly skips md.function's trace and capture, the thread count reaches the host pool."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import gpu_env
import mirrored as md
from config_cases import DIFFERS, OWN_WORDS, SCENARIOS
from mirrored.device.config import _devices, _execution, experimental, threading as config_threading
from mirrored.distribute.function import EagerFallbackWarning

with open(os.path.join(os.path.dirname(__file__), "data", "tf_config_reference.json")) as _f:
    REFERENCE = json.load(_f)
ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError, "RuntimeError": RuntimeError}


@pytest.fixture(autouse=True)
def fresh_config(monkeypatch):
    """Each test starts from the default configuration (as each recorded scenario's process did) and leaves it."""
    saved = (set(_devices._hidden), dict(_devices._logical), dict(experimental._memory_growth),
             dict(_execution._flags), dict(config_threading._threads))
    _devices._hidden.clear()
    _devices._logical.clear()
    _devices._tables.clear()
    monkeypatch.delenv(config_threading._ENV, raising=False)
    monkeypatch.setattr(config_threading, "_environment_default", None)
    # (a fresh process's host pool has not started; this test process's may have: thread counts are then fixed,
    # which test_the_counts_reach_the_environment_and_are_fixed_once_the_pool_started checks in a process of its own)
    monkeypatch.setattr(config_threading, "_pool_started", lambda: False)
    yield
    for state, value in zip((_devices._hidden, _devices._logical, experimental._memory_growth, _execution._flags,
                             config_threading._threads), saved):
        state.clear()
        state.update(value)
    _devices._tables.clear()


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE) == sorted(SCENARIOS)
    assert all(len(REFERENCE[name]) == len(expressions) for name, expressions in SCENARIOS.items())


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_tensorflow(name):
    if md.config.list_physical_devices("GPU"):
        pytest.skip("recorded on a machine without a GPU")
    scope = {"config": md.config, "cpu": lambda: md.config.list_physical_devices("CPU")[0],
             "phantom_gpu": md.config.PhysicalDevice("/physical_device:GPU:0", "GPU")}
    for i, (expression, want) in enumerate(zip(SCENARIOS[name], REFERENCE[name])):
        if (name, i) in DIFFERS:
            try:
                eval(expression, scope)
            except ValueError:
                pass
            continue
        if "raises" in want:
            with pytest.raises(ERRORS[want["raises"]]) as caught:
                eval(expression, scope)
            if (name, i) not in OWN_WORDS:
                assert want["msg"] in str(caught.value), expression
        else:
            assert repr(eval(expression, scope)) == want["repr"], expression


# --- where md.config differs from TF on purpose (docs/config.md) ---------------------------------------------------

@pytest.mark.parametrize("devices, device_type", [([], "CPU"), ([], None)])
def test_hiding_the_cpu_is_refused_where_it_is_asked(devices, device_type):
    with pytest.raises(ValueError, match="would hide the CPU"):
        md.config.set_visible_devices(devices, device_type)
    assert md.config.get_visible_devices("CPU") == md.config.list_physical_devices("CPU")


@pytest.mark.parametrize("count", [-1, "a", 2.5, True, None])
@pytest.mark.parametrize("which", ["inter", "intra"])
def test_a_thread_count_is_an_integer_of_zero_or_more(which, count):
    with pytest.raises(ValueError, match="num_threads=.*>= 0"):
        getattr(md.config.threading, f"set_{which}_op_parallelism_threads")(count)
    assert getattr(md.config.threading, f"get_{which}_op_parallelism_threads")() == 0


def test_devices_may_change_after_their_first_use_and_apply_to_later_strategies():
    assert len(md.config.list_logical_devices("CPU")) == 1
    md.config.set_logical_device_configuration(md.config.list_physical_devices("CPU")[0],
                                               [md.config.LogicalDeviceConfiguration()] * 2)
    assert md.MirroredStrategy().num_replicas_in_sync == 2
    md.config.set_logical_device_configuration("CPU:0", None)
    assert md.MirroredStrategy().num_replicas_in_sync == 1


def test_the_intra_op_count_is_the_host_pools_thread_count_in_a_new_process():
    script = textwrap.dedent("""
        import mirrored as md
        md.config.threading.set_intra_op_parallelism_threads(3)
        from mirrored import _core
        print(_core.num_threads(), md.config.threading.get_intra_op_parallelism_threads())
    """)
    env = {k: v for k, v in os.environ.items() if k != "MIRRORED_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True).stdout
    assert out.split() == ["3", "3"]


def test_the_counts_reach_the_environment_and_are_fixed_once_the_pool_started():
    """As TF: set first thing; after the first host collective a different count is a RuntimeError (not a
    setting silently ignored), the same count a no-op."""
    script = textwrap.dedent("""
        import os
        import numpy as np
        import mirrored as md
        from mirrored import _core
        t = md.config.threading
        t.set_intra_op_parallelism_threads(2)
        assert os.environ["MIRRORED_NUM_THREADS"] == "2"
        t.set_intra_op_parallelism_threads(0)
        assert "MIRRORED_NUM_THREADS" not in os.environ
        t.set_intra_op_parallelism_threads(2)
        t.set_inter_op_parallelism_threads(4)
        assert not _core.host_pool_started()
        s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        assert s.reduce("sum", s.run(lambda: np.ones(3)), axis=None).tolist() == [2.0] * 3
        assert _core.host_pool_started() and _core.num_threads() == 2
        t.set_intra_op_parallelism_threads(2)
        t.set_inter_op_parallelism_threads(4)
        for kind, count in (("intra", 1), ("intra", 0), ("inter", 1)):
            try:
                getattr(t, f"set_{kind}_op_parallelism_threads")(count)
            except RuntimeError as e:
                assert "parallelism cannot be modified after initialization" in str(e), e
                assert "first thing" in str(e), e
            else:
                raise AssertionError(f"{kind} {count}: no RuntimeError")
        assert (t.get_intra_op_parallelism_threads(), t.get_inter_op_parallelism_threads()) == (2, 4)
        assert os.environ["MIRRORED_NUM_THREADS"] == "2" and _core.num_threads() == 2
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "MIRRORED_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["ok"], out.stderr


# --- the namespace -----------------------------------------------------------------------------------------------

TF_NAMES = {"LogicalDevice", "LogicalDeviceConfiguration", "PhysicalDevice", "experimental",
            "experimental_functions_run_eagerly", "experimental_run_functions_eagerly", "functions_run_eagerly",
            "get_logical_device_configuration", "get_soft_device_placement", "get_visible_devices",
            "list_logical_devices", "list_physical_devices", "run_functions_eagerly",
            "set_logical_device_configuration",
            "set_soft_device_placement", "set_visible_devices", "threading"}
OURS = {"VirtualDeviceConfiguration", "engine_name", "is_cuda_available", "is_gloo_available", "is_nccl_available",
        "num_gpus", "physical_gpu_index", "hidden_note", "net_module", "net_load_error", "GLOO_NOT_BUILT"}
TF_EXPERIMENTAL = {"VirtualDeviceConfiguration", "get_device_details", "get_memory_growth", "get_memory_info",
                   "get_memory_usage", "get_virtual_device_configuration", "get_visible_devices",
                   "list_logical_devices", "list_physical_devices", "reset_memory_stats", "set_memory_growth",
                   "set_virtual_device_configuration", "set_visible_devices"}
TF_THREADING = {"get_inter_op_parallelism_threads", "get_intra_op_parallelism_threads",
                "set_inter_op_parallelism_threads", "set_intra_op_parallelism_threads"}


def _public(namespace) -> set:
    return {n for n in vars(namespace) if not n.startswith("_")}


def test_the_namespaces_are_tfs_names_and_our_documented_extras():
    assert _public(md.config) == set(md.config.__all__) == TF_NAMES | OURS
    assert _public(md.config.experimental) == set(md.config.experimental.__all__) == TF_EXPERIMENTAL
    assert _public(md.config.threading) == TF_THREADING


# --- run_functions_eagerly --------------------------------------------------------------------------------------

def test_run_functions_eagerly_runs_the_python_function_every_call_and_traces_nothing():
    calls = []

    def step(x):
        calls.append(x.shape)
        return x * 2 + 1

    for eagerly in (True, False):
        md.config.run_functions_eagerly(eagerly)
        fn = md.function(step)
        calls.clear()
        with warnings.catch_warnings():  # (captured, a CPU step falls back to eager, and says so once)
            warnings.simplefilter("ignore", EagerFallbackWarning)
            results = [fn(np.full(3, i, np.float32)) for i in range(3)]
        for i, r in enumerate(results):
            np.testing.assert_array_equal(r, np.full(3, 2 * i + 1, np.float32))
        assert len(calls) == 3  # (a CPU step runs its Python every call either way; on a GPU see the gpu test)
        assert fn.experimental_get_tracing_count() == (0 if eagerly else 1)


@pytest.mark.gpu
def test_run_functions_eagerly_skips_the_capture_and_gives_the_captured_results():
    def step(x):
        traced.append(1)
        return x * 2 + md.get_replica_context().all_reduce("sum", x)

    data = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2)  # (step, global batch, feature)
    results = {}
    for eagerly in (False, True):
        md.config.run_functions_eagerly(eagerly)
        traced = []
        with gpu_env.mirrored_strategy(2) as strategy:
            fn = md.function(step)
            for s in range(3):
                out = strategy.run(fn, args=gpu_env.replica_batches(strategy, s, data))
                local = strategy.experimental_local_results(out)
                results.setdefault(s, []).append([gpu_env.cupy.asnumpy(v) for v in local])
        # captured: the warm-up and the capture run the Python (twice per replica), the replay none; eager: every call
        assert len(traced) == (4 if not eagerly else 6)
        assert fn.experimental_get_tracing_count() == (0 if eagerly else 1)
    for s, (captured, eager) in results.items():
        for a, b in zip(captured, eager):
            np.testing.assert_array_equal(a, b)


# --- GPUs (the simulated machine: two GPUs) ----------------------------------------------------------------------

def _ordinals(strategy):
    return [md.device_util.physical_ordinal(d) if "GPU" in d else None for d in strategy.extended.worker_devices]


@pytest.mark.gpu
@gpu_env.needs_gpus(2)
def test_hidden_gpus_are_absent_from_every_strategy_and_refused_by_name():
    gpus = md.config.list_physical_devices("GPU")
    assert len(gpus) == gpu_env.NGPU >= 2
    md.config.set_visible_devices([], "GPU")
    assert md.config.list_logical_devices("GPU") == [] and md.config.get_visible_devices("GPU") == []
    assert md.config.list_physical_devices("GPU") == gpus  # hidden, still there
    assert md.MirroredStrategy().extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert md.experimental.CentralStorageStrategy().extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",)
    with pytest.raises(ValueError, match="'/gpu:0' is not available.*0 GPU.*2 hidden by md.config.set_visible_devices"):
        md.MirroredStrategy(["/gpu:0"])
    with pytest.raises(ValueError, match="not available.*hidden"):
        md.OneDeviceStrategy("/gpu:0")
    if md.config.is_gloo_available():
        assert md.MultiWorkerMirroredStrategy().extended.worker_devices == (
            "/job:localhost/replica:0/task:0/device:CPU:0",)


@pytest.mark.gpu
@gpu_env.needs_gpus(2)
def test_the_visible_gpus_are_renumbered_from_zero():
    gpus = md.config.list_physical_devices("GPU")
    md.config.set_visible_devices(gpus[1:], "GPU")
    assert md.config.get_visible_devices() == md.config.list_physical_devices("CPU") + gpus[1:]
    assert [d.name for d in md.config.list_logical_devices("GPU")] == [f"/device:GPU:{i}" for i in range(len(gpus) - 1)]
    strategy = md.MirroredStrategy()
    assert _ordinals(strategy) == list(range(1, len(gpus)))
    out = strategy.run(lambda: md.get_replica_context().all_reduce("sum", gpu_env.cupy.ones(2, np.float32)))
    np.testing.assert_array_equal(gpu_env.cupy.asnumpy(strategy.experimental_local_results(out)[0]),
                                  np.full(2, len(gpus) - 1, np.float32))
    md.config.set_visible_devices(gpus, "GPU")
    assert _ordinals(md.MirroredStrategy()) == list(range(len(gpus)))


@pytest.mark.gpu
def test_memory_growth_of_a_gpu_is_kept_as_set():
    gpu = md.config.list_physical_devices("GPU")[0]
    assert md.config.experimental.get_memory_growth(gpu) is False
    md.config.experimental.set_memory_growth(gpu, True)
    assert md.config.experimental.get_memory_growth(gpu) is True
    md.config.set_logical_device_configuration(gpu, [md.config.LogicalDeviceConfiguration()] * 2)
    with pytest.raises(ValueError, match="virtual devices configured"):
        md.config.experimental.set_memory_growth(gpu, False)


@pytest.mark.gpu
@gpu_env.needs_gpus(2)
def test_device_details_of_a_gpu_are_the_runtimes():
    from mirrored.device import engine

    gpu = md.config.list_physical_devices("GPU")[1]
    properties = engine.extension().device_properties(1)
    assert md.config.experimental.get_device_details(gpu) == {
        "compute_capability": tuple(properties["compute_capability"]), "device_name": properties["name"]}


@pytest.mark.gpu
@gpu_env.needs_gpus(2)
def test_memory_info_of_a_gpu_counts_its_arrays_and_the_peak_starts_again_at_reset():
    cupy = gpu_env.cupy
    with cupy.cuda.Device(1):
        md.config.experimental.reset_memory_stats("GPU:1")
        before = md.config.experimental.get_memory_info("/device:GPU:1")
        assert before["peak"] == before["current"]
        x = cupy.zeros(1 << 16, np.float32)
        during = md.config.experimental.get_memory_info("GPU:1")
        assert during["current"] >= before["current"] + x.nbytes and during["peak"] >= during["current"]
        del x
        after = md.config.experimental.get_memory_info("GPU:1")
        assert after["current"] < during["current"] and after["peak"] >= during["current"]
        md.config.experimental.reset_memory_stats("GPU:1")
        assert md.config.experimental.get_memory_info("GPU:1")["peak"] == after["current"]
    assert md.config.experimental.get_memory_usage("GPU:1") == after["current"] if gpu_env.SIMULATED else True
    with pytest.raises(ValueError, match="No matching devices found for 'GPU:5'"):
        md.config.experimental.get_memory_info("GPU:5")
