"""md.function with inputs that live on another device than the replica that reads them.

TensorFlow copies a replica's inputs to the replica's device. Here a replica on GPU 1 reads an array of
GPU 0 where it is (peer access), in the eager step and in the captured graph alike; a replay must then read
this call's values, never the last call's: every call's result is compared, bit for bit, with the NumPy
reference (which the eager step gives), at the first call (eager), the capture and every replay. The
neighbouring cases are audited too: host inputs, a dtype or shape that changes, an input written in place
between calls, a closure constant, an input that aliases a variable the step updates, CPU replicas.
"""

import contextlib
import gc
import warnings

import numpy as np
import pytest

import mirrored as md
import gpu_env
from gpu_env import cupy
from mirrored.device import config
from mirrored.distribute.function import EagerFallbackWarning

STEPS = 6
LAYOUTS = ("logical-2", "physical-2", "2x2")  # 2 logical GPUs of GPU 0, 2 GPUs, 2 GPUs of 2 logical GPUs each


@contextlib.contextmanager
def _layout_strategy(layout):
    if layout != "2x2":
        with gpu_env.layout_strategy(layout) as strategy:
            yield strategy
        return
    if gpu_env.NGPU < 2:
        pytest.skip("needs 2 GPUs")
    try:
        for gpu in (0, 1):
            config.set_logical_device_configuration("GPU", gpu, count=2)
        strategy = md.MirroredStrategy([f"/gpu:{i}" for i in range(4)])
        if not isinstance(strategy.extended._cross_device_ops, md.NcclAllReduce):
            pytest.skip("without NCCL, logical GPUs on several GPUs are not captured (docs/function.md)")
        yield strategy
    finally:
        for gpu in (0, 1):
            config.set_logical_device_configuration(f"GPU:{gpu}", None)


def _on_gpu0(host):
    with cupy.cuda.Device(0):
        return cupy.asarray(host)


def _a(s, dtype=np.float32, n=3):
    """Step ``s``'s shared input (the array given to every replica)."""
    return (np.arange(n) * 1.5 + s).astype(dtype)


def _x(strategy, s, dtype=np.float32, n=3):
    """Step ``s``'s per-replica input, on each replica's own device."""
    devices = strategy.extended.worker_devices
    return md.PerReplica([md.device_util.place((np.arange(n) + 10.0 * r - s).astype(dtype), d)
                          for r, d in enumerate(devices)], devices)


def _replica(a, x):
    return a * a.dtype.type(2) + x


def _want(strategy, s, dtype=np.float32, n=3):
    return [_a(s, dtype, n) * dtype(2) + (np.arange(n) + 10.0 * r - s).astype(dtype)
            for r in range(strategy.num_replicas_in_sync)]


def _results(strategy, out):
    return [cupy.asnumpy(v) for v in strategy.experimental_local_results(out)]


def _check_every_call(strategy, call, want=_want, captured=True):
    """``call(s)`` for STEPS steps gives ``want(strategy, s)`` bit for bit at every call; with ``captured``,
    no call fell back to eager."""
    with warnings.catch_warnings():
        if captured:
            warnings.simplefilter("error", EagerFallbackWarning)
        for s in range(STEPS):
            got = _results(strategy, call(s))
            for r, (g, w) in enumerate(zip(got, want(strategy, s))):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_array_equal(g, w, err_msg=f"step {s}, replica {r}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["plain", "nested", "keyword"])
def test_an_array_of_gpu0_given_to_every_replica_reads_this_calls_values(layout, form):
    with _layout_strategy(layout) as strategy:
        @md.function
        def step(a, x):
            return strategy.run(_replica, args=(a, x))

        @md.function
        def nested_step(inputs, x):
            return strategy.run(lambda i, x: _replica(i["a"][0], x), args=(inputs, x))

        @md.function
        def keyword_step(x, *, a):
            return strategy.run(_replica, args=(a, x))

        calls = {"plain": lambda s: step(_on_gpu0(_a(s)), _x(strategy, s)),
                 "nested": lambda s: nested_step({"a": (_on_gpu0(_a(s)),)}, _x(strategy, s)),
                 "keyword": lambda s: keyword_step(_x(strategy, s), a=_on_gpu0(_a(s)))}
        _check_every_call(strategy, calls[form])
        run = {"plain": step, "nested": nested_step, "keyword": keyword_step}[form]
        assert run.experimental_get_tracing_count() == 1
        if gpu_env.SIMULATED:  # a replay is still one graph launch per GPU and no kernel from Python
            counted = gpu_env.sim_counters(lambda: calls[form](0))
            gpus = {md.device_util.physical_ordinal(d) for d in strategy.extended.worker_devices}
            assert counted["graph_launches"] == {g: 1 for g in gpus}
            assert not any(counted["launches"].values()) if isinstance(counted["launches"], dict) else \
                not counted["launches"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_per_replica_whose_components_all_live_on_gpu0(layout):
    with _layout_strategy(layout) as strategy:
        devices = strategy.extended.worker_devices

        @md.function
        def step(a, x):
            return strategy.run(_replica, args=(a, x))

        _check_every_call(strategy, lambda s: step(md.PerReplica([_on_gpu0(_a(s)) for _ in devices], devices),
                                                   _x(strategy, s)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_replica_step_itself_captured_with_an_array_of_gpu0(layout):
    """strategy.run(md.function(fn), args=(a_on_gpu0, per_replica)): the replica step is the captured step."""
    with _layout_strategy(layout) as strategy:
        run = md.function(_replica)
        _check_every_call(strategy, lambda s: strategy.run(run, args=(_on_gpu0(_a(s)), _x(strategy, s))))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_distributed_iterator_and_an_array_of_gpu0(layout):
    with _layout_strategy(layout) as strategy:
        n = strategy.num_replicas_in_sync
        rows = np.arange(STEPS * n * 3, dtype=np.float32).reshape(STEPS * n, 3)
        iterator = iter(strategy.experimental_distribute_dataset(md.data.Dataset.from_tensor_slices(rows).batch(n)))

        @md.function
        def step(it, a):
            return strategy.run(lambda x, a: a * np.float32(2) + x[0], args=(next(it), a))

        def want(strategy, s):
            return [_a(s) * np.float32(2) + rows[s * n + r] for r in range(n)]

        _check_every_call(strategy, lambda s: step(iterator, _on_gpu0(_a(s))), want)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_input_written_in_place_between_calls_is_read_at_its_current_value(layout):
    with _layout_strategy(layout) as strategy:
        a = _on_gpu0(_a(0))

        @md.function
        def step(a, x):
            return strategy.run(_replica, args=(a, x))

        def call(s):
            with cupy.cuda.Device(0):
                a[...] = cupy.asarray(_a(s))
            return step(a, _x(strategy, s))

        _check_every_call(strategy, call)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_closure_constant_of_gpu0_written_in_place_between_calls(layout):
    """A captured array is not an input: the graph reads its memory, so a replay sees what was written there."""
    with _layout_strategy(layout) as strategy:
        a = _on_gpu0(_a(0))

        @md.function
        def step(x):
            return strategy.run(lambda x: _replica(a, x), args=(x,))

        def call(s):
            with cupy.cuda.Device(0):
                a[...] = cupy.asarray(_a(s))
            return step(_x(strategy, s))

        _check_every_call(strategy, call)


class _Model:
    """A plain object holding an array, as a model holds its constants."""

    def __init__(self, a):
        self.table = {"a": a}

    @md.function
    def method_step(self, strategy, x):
        return strategy.run(lambda x: _replica(self.table["a"], x), args=(x,))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reach", ["closure", "global", "method"])
def test_a_closure_constant_rebound_between_calls_keeps_the_captured_array(layout, reach):
    """Rebinding the name of an array the step reads without being given it (a dict in its closure or its globals,
    a decorated method's instance): the capture holds the array it captured and keeps reading it (TF's
    tf.function captures closure tensors by value), never the memory of a freed one (poisoned here)."""
    with _layout_strategy(layout) as strategy:
        holder = {"a": _on_gpu0(_a(0))}
        _GLOBAL_HOLDER.clear()
        _GLOBAL_HOLDER.update(holder)
        model = _Model(holder["a"])

        @md.function
        def closure_step(x):
            return strategy.run(lambda x: _replica(holder["a"], x), args=(x,))

        @md.function
        def global_step(x):
            return strategy.run(lambda x: _replica(_GLOBAL_HOLDER["a"], x), args=(x,))

        steps = {"closure": closure_step, "global": global_step,
                 "method": lambda x: model.method_step(strategy, x)}

        def call(s):
            out = steps[reach](_x(strategy, s))
            for table in (holder, _GLOBAL_HOLDER, model.table):  # the old array's last references go
                table["a"] = _on_gpu0(_a(s + 1))
            gc.collect()
            return out

        _check_every_call(strategy, call, want=lambda strategy, s: [
            w - _a(s) * np.float32(2) + _a(0) * np.float32(2) for w in _want(strategy, s)] if s else
            _want(strategy, s))
        _GLOBAL_HOLDER.clear()


_GLOBAL_HOLDER = {}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_host_array_given_to_gpu_replicas_runs_eagerly_and_gives_the_reference(layout):
    with _layout_strategy(layout) as strategy:
        @md.function
        def step(a, x):  # the replica step uploads the host array itself (NumPy and CuPy do not mix)
            return strategy.run(lambda a, x: _replica(cupy.asarray(a), x), args=(a, x))

        with pytest.warns(EagerFallbackWarning, match="host NumPy array argument has no GPU"):
            _check_every_call(strategy, lambda s: step(_a(s), _x(strategy, s)), captured=False)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_new_dtype_or_shape_of_an_input_captures_again(layout):
    with _layout_strategy(layout) as strategy:
        @md.function
        def step(a, x):
            return strategy.run(_replica, args=(a, x))

        kinds = [(np.float32, 3), (np.float64, 3), (np.float32, 5), (np.float32, 3), (np.float64, 3)]
        for s in range(STEPS * 2):
            dtype, n = kinds[s % len(kinds)]
            got = _results(strategy, step(_on_gpu0(_a(s, dtype, n)), _x(strategy, s, dtype, n)))
            for g, w in zip(got, _want(strategy, s, dtype, n)):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_array_equal(g, w)
        assert step.experimental_get_tracing_count() == 3


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_input_that_aliases_a_variable_the_step_updates_keeps_the_value_it_was_given(layout):
    """The input is the variable's value before the step (TF's: a read is a value), on every call."""
    with _layout_strategy(layout) as strategy:
        with strategy.scope():
            v = md.Variable(_a(0), aggregation=md.VariableAggregation.SUM)

        @md.function
        def step(a, x):
            def replica(a, x):
                v.assign_add(x)
                return a * np.float32(2)
            return strategy.run(replica, args=(a, x))

        before = _a(0)
        for s in range(STEPS):
            got = _results(strategy, step(v.read_value(), _x(strategy, s)))
            for g in got:
                np.testing.assert_array_equal(g, before * np.float32(2))
            # SUM aggregation: the replicas' increments, summed
            before = before + sum((np.arange(3) + 10.0 * r - s).astype(np.float32)
                                  for r in range(strategy.num_replicas_in_sync))
            for c in v.values:
                np.testing.assert_array_equal(c.numpy(), before)


def test_cpu_replicas_run_eagerly_and_give_the_reference():
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])

    @md.function
    def step(a, x):
        return strategy.run(_replica, args=(a, x))

    with pytest.warns(EagerFallbackWarning, match="runs eagerly for these inputs"):
        for s in range(STEPS):
            devices = strategy.extended.worker_devices
            x = md.PerReplica([(np.arange(3) + 10.0 * r - s).astype(np.float32) for r in range(2)], devices)
            got = strategy.experimental_local_results(step(_a(s), x))
            for g, w in zip(got, _want(strategy, s)):
                np.testing.assert_array_equal(np.asarray(g), w)
