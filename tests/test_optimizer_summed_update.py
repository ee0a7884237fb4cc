"""CPU replicas' apply_gradients without a pack or an all-reduce: each replica's fused update sums every
replica's gradients itself, in replica order (optimizers/base.py, ``_Summands``).

The results must be bit-identical to the path it replaces (gradients packed, all-reduced by the host
engine's direct fold, then applied), the copies bit-identical to each other, and no replica may read a
gradient another replica has started to overwrite: the merge_call orders the reads after every
gradient is final, the exchange after the update orders every later write after the reads.
"""

import random
import threading
import time

import numpy as np
import pytest

import mirrored as md
from mirrored._core import fused_update
from mirrored.distribute.mirrored_strategy import MirroredExtended
from mirrored.train.optimizers import base
from mirrored.train.optimizers.rules import SGD

# Sizes around the kernel's 8 KiB blocks of summed gradients (2048 float32, 1024 float64), and empty.
SHAPES = [(7, 5), (5,), (2048,), (1025,), (3, 700), (0,), (3, 4, 2)]

OPTIMIZERS = {
    "sgd": lambda: md.optimizers.SGD(0.1),
    "momentum": lambda: md.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: md.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: md.optimizers.Adam(0.01),
    "adamw": lambda: md.optimizers.AdamW(0.01, weight_decay=0.05),
    "rmsprop": lambda: md.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: md.optimizers.Adagrad(0.05),
    "nadam": lambda: md.optimizers.Nadam(0.01),
    "schedule_free_adamw": lambda: md.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=2, weight_decay=0.05),
}


@pytest.fixture
def all_reduced(monkeypatch):
    """Switches the summed update off: gradients packed and all-reduced, as before it."""
    def switch():
        monkeypatch.setattr(MirroredExtended, "_sums_host_replicas_in_order", lambda self: False)
    return switch


def _train(n, make_optimizer, dtypes, steps=3, seed=0, cross_device_ops=None, step_hook=None):
    """Variables of SHAPES (dtype i % len(dtypes)) after `steps` apply_gradients of random per-replica
    gradients; returns every copy of every variable, and the optimizer."""
    rng = np.random.default_rng(seed)
    kinds = [dtypes[i % len(dtypes)] for i in range(len(SHAPES))]
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=cross_device_ops)
    with strategy.scope():
        variables = [md.Variable(rng.standard_normal(s).astype(t)) for s, t in zip(SHAPES, kinds)]
        optimizer = make_optimizer()
    grads = [[[rng.standard_normal(s).astype(t) for s, t in zip(SHAPES, kinds)] for _ in range(n)]
             for _ in range(steps)]
    for t in range(steps):
        def step():
            r = md.get_replica_context().replica_id_in_sync_group
            own = [g.copy() for g in grads[t][r]]
            optimizer.apply_gradients(zip(own, variables))
            if step_hook is not None:
                step_hook(r, own, variables)
        strategy.run(step)
    return [[np.array(c._value) for c in v.values] for v in variables], optimizer


def _assert_identical(got, expected):
    for copies, reference in zip(got, expected):
        for copy in copies:
            assert copy.dtype == reference[0].dtype
            np.testing.assert_array_equal(copy, reference[0])
        for copy in reference:
            np.testing.assert_array_equal(copy, reference[0])


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtypes", [(np.float32,), (np.float64,), (np.float32, np.float64)],
                         ids=["float32", "float64", "mixed"])
def test_bit_identical_to_the_all_reduced_update(n, name, dtypes, all_reduced):
    summed, optimizer = _train(n, OPTIMIZERS[name], dtypes)
    assert all(plan.sums_replicas for plan in optimizer._plans.values())
    all_reduced()
    reference, optimizer = _train(n, OPTIMIZERS[name], dtypes)
    assert not any(plan.sums_replicas for plan in optimizer._plans.values())
    _assert_identical(summed, reference)


def test_one_replica_and_float16_keep_their_paths():
    _, optimizer = _train(1, OPTIMIZERS["momentum"], (np.float32,))
    assert not any(plan.sums_replicas for plan in optimizer._plans.values())
    _, optimizer = _train(2, OPTIMIZERS["momentum"], (np.float16, np.float32))
    assert not any(plan.sums_replicas for plan in optimizer._plans.values())


@pytest.mark.parametrize("ops", [md.cross_device_ops.RingAllReduce(algorithm="ring"),
                                 md.cross_device_ops.ReductionToOneDevice()], ids=["ring", "reduction_to_one"])
def test_other_summation_orders_keep_the_all_reduce(ops):
    # A ring sums each chunk starting at another replica: its sum is not the replica-order sum.
    _, optimizer = _train(3, OPTIMIZERS["momentum"], (np.float32,), cross_device_ops=ops)
    assert not any(plan.sums_replicas for plan in optimizer._plans.values())


def test_mean_aggregation_keeps_the_all_reduce():
    _, optimizer = _train(2, lambda: md.optimizers.SGD(0.1, gradient_aggregation="mean"), (np.float32,))
    assert not any(plan.sums_replicas for plan in optimizer._plans.values())


def test_no_pack_and_no_all_reduce_on_the_step(monkeypatch):
    calls = []
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        variables = [md.Variable(np.ones((4, 3), np.float32)), md.Variable(np.zeros(3, np.float32))]
        optimizer = md.optimizers.SGD(0.5, momentum=0.5)

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        optimizer.apply_gradients([(np.full((4, 3), r + 1.0, np.float32), variables[0]),
                                   (np.full(3, 2.0 * r, np.float32), variables[1])])

    strategy.run(step)
    monkeypatch.setattr(base._Plan, "pack", lambda *a: calls.append("pack"))
    monkeypatch.setattr(type(strategy.extended), "batch_reduce_to", lambda *a, **k: calls.append("all-reduce"))
    strategy.run(step)
    assert calls == []
    # w -= lr * m with m = 0.5 m + g, g = 1 + 2 = 3: after two steps 1 - 0.5*3 - 0.5*(1.5 + 3)
    for copy in variables[0].values:
        np.testing.assert_array_equal(copy._value, np.full((4, 3), 1 - 1.5 - 2.25, np.float32))
    for copy in variables[1].values:
        np.testing.assert_array_equal(copy._value, np.full(3, -0.5 * 2 - 0.5 * (1 + 2), np.float32))


def test_gradients_that_are_variables_arrays(all_reduced):
    # Each replica passes its own copy's array, then the other replica's copy, as the gradient: the
    # updates write fresh buffers (copy-on-write) rather than an array another replica still reads.
    def run():
        strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            variables = [md.Variable(np.arange(12, dtype=np.float32).reshape(3, 4)),
                         md.Variable(np.linspace(-1, 1, 3000).astype(np.float32))]
            optimizer = md.optimizers.SGD(0.25, momentum=0.5)
        for mine in (True, False, True):
            def step():
                r = md.get_replica_context().replica_id_in_sync_group
                source = r if mine else 1 - r
                grads = [v.values[source].read_value() for v in variables]
                grads[1] = grads[1][::-1]  # a view
                optimizer.apply_gradients(zip(grads, variables))
            strategy.run(step)
        return [[np.array(c._value) for c in v.values] for v in variables]

    summed = run()
    all_reduced()
    _assert_identical(summed, run())


def test_non_contiguous_and_other_dtype_gradients(all_reduced):
    def run():
        strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            variable = md.Variable(np.ones((5, 4), np.float32))
            optimizer = md.optimizers.Adam(0.1)
        for _ in range(2):
            def step():
                r = md.get_replica_context().replica_id_in_sync_group
                g = np.arange(20, dtype=np.float64).reshape(4, 5).T * (r + 1)  # float64, F-ordered
                optimizer.apply_gradients([(g, variable)])
            strategy.run(step)
        return [[np.array(c._value) for c in variable.values]]

    summed = run()
    all_reduced()
    _assert_identical(summed, run())


@pytest.mark.parametrize("n", [2, 4])
def test_ordered_under_random_delays_and_gradients_overwritten_after_the_update(n, all_reduced):
    # A test hook delays each replica at random before and after its update, and every replica scribbles
    # NaN over its gradients the moment apply_gradients returns: no other replica may still read them.
    rng = random.Random(5)
    lock = threading.Lock()

    def delay():
        with lock:
            seconds = rng.random() * 0.003
        time.sleep(seconds)

    original = base._Plan.apply

    def delayed_apply(self, *args, **kwargs):
        delay()
        original(self, *args, **kwargs)
        delay()

    def scribble(r, own, variables):
        for g in own:
            g[...] = np.nan

    base._Plan.apply = delayed_apply
    try:
        summed, _ = _train(n, OPTIMIZERS["momentum"], (np.float32,), steps=40, seed=3, step_hook=scribble)
    finally:
        base._Plan.apply = original
    assert all(np.isfinite(c).all() for copies in summed for c in copies)
    all_reduced()
    reference, _ = _train(n, OPTIMIZERS["momentum"], (np.float32,), steps=40, seed=3)
    _assert_identical(summed, reference)


def test_kernel_sums_in_replica_order():
    # Values whose float32 sum depends on the order: ((a + b) + c) rounds differently from a + (b + c).
    a = np.array([1e8, 1.0, -1e8], np.float32)
    b = np.array([-1e8, 1e-8, 1e8], np.float32)
    c = np.array([1.0, 1.0, 3.0], np.float32)
    w = np.zeros(3, np.float32)
    fused_update(SGD, [w], ([a], [b], [c]), [[]], [False], [1.0], 0.0, 0.0)
    np.testing.assert_array_equal(w, -((a + b) + c))


def test_kernel_refuses_malformed_replica_lists():
    w = np.zeros(3, np.float32)
    g = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="pass the list itself"):
        fused_update(SGD, [w], ([g],), [[]], [False], [1.0], 0.0, 0.0)
    with pytest.raises(ValueError, match="one array per variable"):
        fused_update(SGD, [w], ([g], [g, g]), [[]], [False], [1.0], 0.0, 0.0)
    with pytest.raises(ValueError, match=r"grads\[1\]\[0\]: dtype float64"):
        fused_update(SGD, [w], ([g], [g.astype(np.float64)]), [[]], [False], [1.0], 0.0, 0.0)
