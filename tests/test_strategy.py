"""MirroredStrategy: contexts, run, reduce/gather, extended — TF's API-page examples with TF's results."""

import threading
import time

import numpy as np
import pytest

import mirrored as md
from conftest import cpus, replica_id


# --- contexts ------------------------------------------------------------------------------------

def test_default_context_outside_any_strategy():
    assert not md.has_strategy()
    assert not md.in_cross_replica_context()
    ctx = md.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.num_replicas_in_sync == 1
    default = md.get_strategy()
    assert default.num_replicas_in_sync == 1
    assert default.run(lambda x: x + 1, args=(1,)) == 2


def test_scope_makes_strategy_current_in_cross_replica_context(two):
    with two.scope() as s:
        assert s is two
        assert md.get_strategy() is two and md.has_strategy()
        assert md.in_cross_replica_context()
        assert md.get_replica_context() is None
        with two.scope():  # re-entering the same scope is fine
            assert md.get_strategy() is two
    assert not md.has_strategy()


def test_entering_another_strategy_scope_inside_raises(two, one):
    with two.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            with one.scope():
                pass


def test_replica_context_inside_run(two):
    def fn():
        ctx = md.get_replica_context()
        assert not md.in_cross_replica_context()
        assert md.get_strategy() is two and ctx.strategy is two
        return ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.devices
    ids, nums, devices = two.run(fn)
    assert ids.values == (0, 1)
    assert nums == 2  # the same object on both replicas stays unwrapped, as in TF's regroup
    # TF's MirroredStrategy returns the replica's devices nested: [[device]].
    assert devices[0][0].values == ("/job:localhost/replica:0/task:0/device:CPU:0",
                                    "/job:localhost/replica:0/task:0/device:CPU:1")
    assert md.get_replica_context().devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)


def test_device_spellings_are_canonicalised():
    s = md.MirroredStrategy(["CPU:0", "/cpu:1", "/job:localhost/replica:0/task:0/device:CPU:2", "/device:cpu:3"])
    assert s.extended.worker_devices == tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4))
    assert s.num_replicas_in_sync == 4 and s.cluster_resolver is None


def test_default_devices_without_gpus_is_one_cpu_replica():
    if md.config.list_logical_devices("GPU"):
        pytest.skip("GPUs present: the default is every GPU")
    s = md.MirroredStrategy()
    assert s.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)


# --- run -----------------------------------------------------------------------------------------

def test_run_unwraps_per_replica_args_and_nests_results(two):
    x = two.experimental_distribute_values_from_function(lambda ctx: np.full(2, ctx.replica_id_in_sync_group + 1.0))

    def fn(v, scale, extra=None):
        return {"a": v * scale, "b": (v, extra)}
    out = two.run(fn, args=(x, 2.0), kwargs={"extra": 7})
    assert isinstance(out["a"], md.PerReplica)
    np.testing.assert_array_equal(out["a"].values[1], [4.0, 4.0])
    assert out["b"][1] == 7


def test_run_single_replica_returns_plain_value(one):
    assert one.run(lambda: replica_id() + 10) == 10


def test_run_trivial_returns_same_constant(two):
    assert two.run(lambda: 1.0) == 1.0


def test_exception_in_one_replica_propagates_and_strategy_stays_usable(four):
    def fn():
        if replica_id() == 2:
            raise KeyError("replica 2 failed")
        return md.get_replica_context().all_reduce("sum", np.ones(3))  # others wait here; must be released
    with pytest.raises(KeyError, match="replica 2 failed"):
        four.run(fn)
    out = four.run(lambda: md.get_replica_context().all_reduce("sum", np.ones(3)))
    np.testing.assert_array_equal(out.values[3], [4, 4, 4])


def test_replica_that_skips_a_collective_does_not_hang(two):
    def fn():
        if replica_id() == 0:
            return md.get_replica_context().all_reduce("sum", 1.0)
    with pytest.raises(RuntimeError, match="same collective"):
        two.run(fn)
    assert two.run(lambda: replica_id()).values == (0, 1)


def test_run_or_scope_in_replica_context_raises(two):
    with pytest.raises(RuntimeError, match="cross-replica"):
        two.run(lambda: two.run(lambda: 1))
    with pytest.raises(RuntimeError, match="cross-replica"):
        two.run(lambda: two.scope().__enter__())


def test_variable_created_inside_run_is_one_variable(two):
    out = two.run(lambda: md.Variable(np.float32(1.0), name="lazy"))
    assert isinstance(out, md.MirroredVariable) and out.name == "lazy:0"


def test_experimental_run_v2_is_run(two):
    assert md.MirroredStrategy.experimental_run_v2 is md.MirroredStrategy.run


# --- reduce / gather / local results (TF API-page examples) --------------------------------------

def test_reduce_replica_ids_doc_example(two):
    per_replica = two.run(lambda: np.int32(replica_id()))
    total = two.reduce("SUM", per_replica, axis=None)
    assert total == 1 and isinstance(total, np.ndarray) and total.dtype == np.int32


def test_reduce_axis_none_elementwise_and_axis_0(two):
    # Global batch 8 over 2 replicas: [0..3] on replica 0, [4..7] on replica 1.
    ds = two.experimental_distribute_dataset([np.arange(8, dtype=np.float32)])
    batch = next(iter(ds))
    np.testing.assert_array_equal(two.reduce("SUM", batch, axis=None), [4, 6, 8, 10])
    assert two.reduce("SUM", batch, axis=0) == 28
    assert two.reduce("MEAN", batch, axis=0) == 3.5


def test_reduce_mean_partial_batch_rule(two):
    # 7 examples split 4 + 3: MEAN with axis divides by 7, not by 2 replicas x per-replica mean.
    batch = next(iter(two.experimental_distribute_dataset([np.arange(7, dtype=np.float32)])))
    assert two.reduce(md.ReduceOp.MEAN, batch, axis=0) == pytest.approx(3.0)
    x = np.arange(7, dtype=np.float32).reshape(7, 1) * np.array([[1, 10]], np.float32)
    batch = next(iter(two.experimental_distribute_dataset([x])))
    np.testing.assert_allclose(two.reduce("mean", batch, axis=0), x.mean(axis=0))


def test_reduce_min_max_prod(four):
    x = four.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group + 1.0, -ctx.replica_id_in_sync_group]))
    np.testing.assert_array_equal(four.reduce("max", x, axis=None), [4, 0])
    np.testing.assert_array_equal(four.reduce("min", x, axis=None), [1, -3])
    np.testing.assert_array_equal(four.reduce("prod", x, axis=None), [24, 0])


@pytest.mark.parametrize("axis", [0, 3])
def test_reduce_along_an_axis_checks_the_dtype_before_the_axis(two, one, axis):
    # TF 2.21's reduction kernels refuse the dtype (TypeError) before they look at the axis; ours named an axis
    # out of range first (ValueError) (found by tests/test_tf_differential.py).
    v = np.ones((2, 3), bool)
    for strategy in (two, one):
        per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: v)
        for value in (v, per_replica):
            with pytest.raises(TypeError, match="dtype bool is not supported"):
                strategy.reduce("SUM", value, axis=axis)
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        two.reduce("SUM", np.ones((2, 3), np.float32), axis=3)


def test_reduce_non_distributed_value_rules(two, one):
    v = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(two.reduce("MEAN", v, axis=None), v)
    with pytest.raises(ValueError, match="cannot be reduced"):
        two.reduce("SUM", v, axis=None)
    np.testing.assert_array_equal(two.reduce("SUM", np.zeros(2), axis=None), [0, 0])
    for op in ("SUM", "MEAN", "MIN", "MAX"):
        np.testing.assert_array_equal(one.reduce(op, v, axis=None), v)


def test_reduce_op_strings(two):
    pr = md.PerReplica([np.float32(1.0), np.float32(3.0)])
    assert two.reduce("sum", pr, axis=None) == 4 and two.reduce("Mean", pr, axis=None) == 2
    for bad in ("avg", "average", "SUMM", 3):
        with pytest.raises(ValueError, match="ReduceOp"):
            two.reduce(bad, pr, axis=None)
    assert md.ReduceOp.SUM.value == "SUM" and md.ReduceOp("MEAN") is md.ReduceOp.MEAN


def test_reduce_in_replica_context_raises(two):
    with pytest.raises(RuntimeError, match="cross-replica"):
        two.run(lambda: two.reduce("SUM", np.ones(1), axis=None))


def test_gather_doc_example(two):
    values = two.experimental_distribute_values_from_function(lambda _: np.array([[1], [2]]))
    np.testing.assert_array_equal(two.gather(values, axis=0), [[1], [2], [1], [2]])
    np.testing.assert_array_equal(two.gather(values, axis=1), [[1, 1], [2, 2]])
    plain = np.ones(3)
    assert two.gather(plain, axis=0) is plain


def test_local_results_and_values_from_function_doc_example(two):
    values = two.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync)
    assert two.experimental_local_results(values) == (0.0, 0.5)
    assert two.experimental_local_results(5) == (5,)


def test_local_results_of_a_plain_structure_repeat_it_per_replica(two, four):
    # TF 2.21: a structure (list, tuple, dict) of plain values comes back once per replica, a single plain value
    # once (tests/test_tf_differential.py found the structure returned once).
    a = np.array([1.0, 2.0], np.float32)
    assert two.experimental_local_results([a, 3]) == ([a, 3], [a, 3])
    assert four.experimental_local_results({"k": (a,)}) == ({"k": (a,)},) * 4
    assert two.experimental_local_results(a)[0] is a and len(two.experimental_local_results(a)) == 1


# --- extended ------------------------------------------------------------------------------------

def test_reduce_to_and_batch_reduce_to_doc_examples(two):
    per_replica = two.run(lambda: np.int32(replica_id()))
    reduced = two.extended.reduce_to(md.ReduceOp.SUM, per_replica, destinations=per_replica)
    assert isinstance(reduced, md.Mirrored)
    assert [int(v) for v in two.experimental_local_results(reduced)] == [1, 1]
    on_host = two.extended.reduce_to("SUM", per_replica, destinations="/cpu:0")
    assert on_host == 1 and not isinstance(on_host, md.DistributedValues)
    a, b = two.extended.batch_reduce_to("SUM", [(per_replica, per_replica), (per_replica, per_replica)])
    assert [int(v) for v in a.values] == [1, 1] and [int(v) for v in b.values] == [1, 1]
    mean = two.extended.reduce_to("MEAN", per_replica, destinations=["/cpu:0", "/cpu:1"]).values[1]
    assert mean == 0.5 and mean.dtype == np.float64  # TF: the MEAN of integers is float64


def test_broadcast_to(two):
    out = two.extended.broadcast_to(np.arange(3), destinations=list(two.extended.worker_devices))
    assert isinstance(out, md.Mirrored) and len(out.values) == 2
    assert out.values[0] is not out.values[1]


def test_update_and_value_container(two):
    with two.scope():
        v = md.Variable(5.0, aggregation=md.VariableAggregation.SUM)
    result = two.extended.update(v, lambda var, x: var.assign(x), args=(1.0,))
    assert result is v and float(v) == 1.0
    ungrouped = two.extended.update(v, lambda var: var.read_value() * 2, group=False)
    assert [float(x) for x in ungrouped] == [2.0, 2.0]
    assert two.extended.value_container(v.values[1]) is v
    assert two.extended.value_container(3) == 3


def test_extended_properties(two):
    e = two.extended
    assert e.worker_devices == e.parameter_devices and len(e.worker_devices) == 2
    assert e.experimental_between_graph is False
    assert e.should_checkpoint and e.should_save_summary and e.experimental_should_init
    assert e.call_for_each_replica(lambda: replica_id()).values == (0, 1)
    with two.scope():
        v = md.Variable(1.0)
        with e.colocate_vars_with(v):
            w = md.Variable(2.0)
    assert w.values[1].device == v.values[1].device
    with pytest.raises(ValueError, match="colocate_vars_with"):
        e.colocate_vars_with(md.Variable(1.0))


# --- training equivalence ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_training_equals_single_replica(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5))
    y = x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(64, 1))
    w0 = rng.normal(size=(5, 1))
    lr, global_batch = 0.1, 16

    def grad(w, xb, yb):
        return 2.0 * xb.T @ (xb @ w - yb) / len(xb)

    w_ref = w0.copy()
    for i in range(0, 64, global_batch):
        w_ref -= lr * grad(w_ref, x[i:i + global_batch], y[i:i + global_batch])

    strategy = md.MirroredStrategy(cpus(n))
    with strategy.scope():
        w_a = md.Variable(w0)  # updated in cross-replica context from all-reduced gradients
        w_b = md.Variable(w0, aggregation=md.VariableAggregation.MEAN)  # updated inside the replicas
    batches = [(x[i:i + global_batch], y[i:i + global_batch]) for i in range(0, 64, global_batch)]

    def step(xb, yb):
        g = md.get_replica_context().all_reduce("MEAN", grad(w_a.read_value(), xb, yb))
        w_b.assign_sub(lr * grad(w_b.read_value(), xb, yb))
        return g

    for xb, yb in strategy.experimental_distribute_dataset(batches):
        g = strategy.run(step, args=(xb, yb))
        w_a.assign_sub(lr * strategy.experimental_local_results(g)[0])
    for w in (w_a, w_b):
        np.testing.assert_allclose(w.numpy(), w_ref, atol=1e-6)
        for copy in w.values:
            np.testing.assert_array_equal(copy.numpy(), w.numpy())


# --- more of TF's API-page examples ---------------------------------------------------------------

def test_gather_four_replicas_doc_example(four):
    single = np.arange(6, dtype=np.int32).reshape(1, 2, 3)
    values = four.experimental_distribute_values_from_function(lambda _: single)
    assert four.gather(values, axis=0).shape == (4, 2, 3)
    np.testing.assert_array_equal(four.gather(values, axis=1)[0], np.tile(single[0], (4, 1)))
    np.testing.assert_array_equal(four.gather(values, axis=2),
                                  [[[0, 1, 2] * 4, [3, 4, 5] * 4]])


@pytest.mark.parametrize("batched", [False, True])
def test_reduce_to_in_merge_call_doc_example(two, batched):
    def step_fn(var):
        def merge_fn(strategy, value, var):
            if batched:
                reduced = strategy.extended.batch_reduce_to(md.ReduceOp.SUM, [(value, var)])[0]
            else:
                reduced = strategy.extended.reduce_to(md.ReduceOp.SUM, value, destinations=var)
            strategy.extended.update(var, lambda var, value: var.assign(value), args=(reduced,))
        md.get_replica_context().merge_call(merge_fn, args=(np.float32(1.0), var))

    with two.scope():
        v = md.Variable(0.0)
        two.run(step_fn, args=(v,))
    assert repr(v) == (
        "MirroredVariable:{\n"
        "  0: <mirrored.Variable 'Variable:0' shape=() dtype=float32, numpy=2.0>,\n"
        "  1: <mirrored.Variable 'Variable/replica_1:0' shape=() dtype=float32, numpy=2.0>\n}")


def test_call_for_each_replica_merge_doc_example(two):
    def merge_fn(distribution, three_plus_replica_id):
        return sum(distribution.experimental_local_results(three_plus_replica_id))

    def fn(three):
        v = three + md.get_replica_context().replica_id_in_sync_group
        return md.get_replica_context().merge_call(merge_fn, args=(v,)) + v
    with two.scope():
        merged = two.run(fn, args=[3])
    assert two.experimental_local_results(merged) == (10, 11)


def test_update_doc_example_and_created_in_scope(two):
    with two.scope():
        v = md.Variable(5.0, aggregation=md.VariableAggregation.SUM)
    result = two.extended.update(v, lambda v: v.assign(1.0))
    assert isinstance(result, md.Mirrored)
    assert [float(x) for x in two.experimental_local_results(result)] == [1.0, 1.0]
    assert two.extended.variable_created_in_scope(v)
    assert not two.extended.variable_created_in_scope(md.Variable(1.0))


def test_run_doc_examples(two):
    result = two.run(lambda x: x * 2.0, args=(np.float32(3.0),))
    assert isinstance(result, md.PerReplica) and [float(v) for v in result.values] == [6.0, 6.0]
    values = two.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert two.run(lambda x: x * 2, args=(values,)) == 4  # the same object on both replicas: unwrapped
    ids = two.experimental_distribute_values_from_function(lambda ctx: np.int32(ctx.replica_id_in_sync_group))
    out = two.run(lambda x: md.get_replica_context().all_reduce("sum", x), args=(ids,))
    assert [int(v) for v in out.values] == [1, 1]


def test_values_from_function_doc_examples(two):
    array_value = np.array([3.0, 2.0, 1.0])
    values = two.experimental_distribute_values_from_function(lambda ctx: array_value[ctx.replica_id_in_sync_group])
    assert two.experimental_local_results(values) == (3.0, 2.0)
    ones = two.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    assert two.experimental_local_results(ones) == (1.0, 1.0)
    assert two.experimental_local_results(
        two.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)) == (2, 2)


def test_distribute_dataset_doc_example(two):
    dataset = [np.arange(0, 2, dtype=np.int64), np.arange(2, 4, dtype=np.int64)]  # range(4).batch(2)
    result = [two.run(lambda x: x * 2, args=(x,)) for x in two.experimental_distribute_dataset(dataset)]
    assert [[v.tolist() for v in r.values] for r in result] == [[[0], [2]], [[4], [6]]]


def test_reduce_non_distributed_value_with_axis_follows_tf(two):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    # TF runs the in-replica reduction on every replica, so SUM counts the value once per replica...
    assert two.reduce("SUM", x, axis=0) == 12.0
    # ...while MEAN divides by every replica's count too and gives the plain mean.
    assert two.reduce("MEAN", x, axis=0) == 2.0


def test_replica_threads_end_with_their_strategy():
    import gc

    before = threading.active_count()
    for _ in range(10):
        md.MirroredStrategy(cpus(4)).run(lambda: 1)
    gc.collect()
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before


def test_cpu_replicas_running_in_parallel_share_the_cores_with_blas():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import os

    controller = threadpoolctl.ThreadpoolController().select(user_api="blas")
    if not controller.lib_controllers:
        pytest.skip("NumPy loaded no BLAS library that threadpoolctl knows")
    n = 4
    cap = max(1, len(os.sched_getaffinity(0)) // n)

    def blas_threads():
        return max(lib.num_threads for lib in controller.lib_controllers)

    def long_step():
        time.sleep(0.2)  # long steps run on the replica threads, in parallel
        return threading.current_thread().name.startswith("mirrored-replica-"), blas_threads()

    with threadpoolctl.threadpool_limits(limits=8, user_api="blas"):  # as if the machine had many cores
        s = md.MirroredStrategy(cpus(n))
        seen = []
        for _ in range(3):
            seen += s.experimental_local_results(s.run(long_step))
        on_threads = [threads for on_thread, threads in seen if on_thread]
        assert on_threads, "no replica of three long steps ran on a replica thread"
        assert max(on_threads) <= cap
        assert blas_threads() == 8  # restored after the step


def test_reduce_min_max_along_axis_with_an_empty_replica_slice():
    s = md.MirroredStrategy(cpus(4))
    batch = np.array([[5.0, -1.0], [2.0, 7.0], [3.0, 0.0]], np.float32)  # 3 rows over 4 replicas: 1+1+1+0
    (x,) = [b for b in s.experimental_distribute_dataset([batch])]
    assert s.experimental_local_results(x)[3].shape == (0, 2)
    np.testing.assert_array_equal(s.reduce("MAX", x, axis=0), [5.0, 7.0])
    np.testing.assert_array_equal(s.reduce("MIN", x, axis=0), [2.0, -1.0])
    ints = s.experimental_distribute_values_from_function(
        lambda ctx: np.arange(ctx.replica_id_in_sync_group, dtype=np.int32))  # replica 0 is empty
    assert s.reduce("MAX", ints, axis=0) == 2 and s.reduce("MIN", ints, axis=0) == 0
