"""A replica context's all_reduce of CuPy arrays on GPU replicas goes straight to the built-in native
ops (one array, or a structure's leaves, each already on its replica's GPU), and through
batch_reduce_to otherwise (variables, host arrays, a user's ops): the same
results either way, equal to NumPy's (marker ``gpu``: simulated GPUs without a GPU, see gpu_env.py)."""

import gc
import weakref

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from recording_ops import RecordingImplementation  # noqa: E402

REFERENCE = {"SUM": np.sum, "MEAN": np.mean, "MIN": np.min, "MAX": np.max, "PROD": np.prod}


@pytest.fixture(params=[2, 3, 4])
def replicas(request):
    n = request.param
    md.config.set_logical_device_configuration("GPU", 0, count=n)
    try:
        yield n
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


def _strategies(n, ops="RingAllReduce"):
    """Built-in ``ops`` (direct route) and a ring whose batch path is overridden (batch_reduce_to route)."""
    devices = [f"/gpu:{i}" for i in range(n)]
    return md.MirroredStrategy(devices, getattr(md.cross_device_ops, ops)()), \
        md.MirroredStrategy(devices, RecordingImplementation())


def _host(x):
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("dtype,shape", [("float32", (1,)), ("float64", (3, 2)), ("int32", (5,)),
                                         ("float16", (0,)), ("uint8", (2, 3))])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("ops", ["RingAllReduce", "HierarchicalCopyAllReduce"])
def test_the_direct_route_gives_what_batch_reduce_to_and_numpy_give(replicas, op, dtype, shape, nested, ops):
    rng = np.random.default_rng(replicas)
    host = [[rng.integers(0, 4, size=shape).astype(dtype) for _ in range(3)] for _ in range(replicas)]
    direct, recorded = _strategies(replicas, ops)

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        leaves = [cupy.asarray(a) for a in host[r]]
        value = {"a": leaves[0], "rest": (leaves[1], leaves[2])} if nested else leaves[0]
        return md.get_replica_context().all_reduce(op, value)

    spied = []
    direct.extended._cross_device_ops.batch_reduce = lambda *a, **k: spied.append(a)  # must not be reached
    routes = []
    for s in (direct, recorded):
        results = []
        for got in s.experimental_local_results(s.run(step)):
            flat = [got["a"], *got["rest"]] if nested else [got]
            assert all(isinstance(leaf, cupy.ndarray) for leaf in flat)
            results.append([_host(leaf) for leaf in flat])
        routes.append(results)
    for direct_leaves, recorded_leaves in zip(*routes):
        for t, (a, b) in enumerate(zip(direct_leaves, recorded_leaves)):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
            if not (op == "MEAN" and np.dtype(dtype).kind in "iu"):  # (integer MEAN: the engine's own rule)
                assert a.dtype == np.dtype(dtype)
                expected = REFERENCE[op](np.stack([h[t] for h in host]), axis=0).astype(dtype)
                np.testing.assert_allclose(a, expected, rtol=1e-3 if dtype == "float16" else 1e-6)
    assert not spied
    assert recorded.extended._cross_device_ops.calls == 1


def test_values_native_ops_cannot_take_as_they_are_go_through_batch_reduce_to(replicas):
    """Host arrays and variables inside GPU replicas: batch_reduce_to moves or reads them first."""
    direct, _ = _strategies(replicas)
    reached = []
    cdo = direct.extended._cross_device_ops
    original = cdo.batch_reduce
    cdo.batch_reduce = lambda *a, **k: reached.append(1) or original(*a, **k)
    with direct.scope():
        v = md.Variable(np.zeros(3, np.float32), synchronization=md.VariableSynchronization.ON_READ,
                        aggregation=md.VariableAggregation.SUM)

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        v.assign(np.full(3, r + 1, np.float32))
        return md.get_replica_context().all_reduce("sum", [v, np.full(2, r, np.float32)])

    total = replicas * (replicas + 1) // 2
    for reduced_v, reduced_host in direct.experimental_local_results(direct.run(step)):
        np.testing.assert_array_equal(_host(reduced_v), np.full(3, total, np.float32))
        np.testing.assert_array_equal(_host(reduced_host), np.full(2, total - replicas, np.float32))
    assert reached


@pytest.mark.parametrize("ops", ["RingAllReduce", "NcclAllReduce", "HierarchicalCopyAllReduce"])
@pytest.mark.parametrize("shape", [(5,), (64, 3)])
def test_a_value_on_the_other_gpu_is_copied_in_order(ops, shape):
    """Each replica all-reduces an array it made on the OTHER GPU: the copy onto its own GPU waits for the
    write there, and that GPU's stream waits for the copy before the array's memory goes back to its pool
    (a freed array read by a copy still queued came back as the pool's poison)."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"], getattr(md.cross_device_ops, ops)())

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        with cupy.cuda.Device(1 - r):
            x = cupy.full(shape, r + 1, np.float32)
        return md.get_replica_context().all_reduce("sum", x)

    for _ in range(3):
        for got in strategy.experimental_local_results(strategy.run(step)):
            np.testing.assert_array_equal(_host(got), np.full(shape, 3, np.float32))


def test_a_repeated_all_reduce_whose_arrays_stop_fitting_its_plan_takes_the_validating_way():
    """The direct route runs the plan of its latest call straight: arrays that no longer fit it (another
    shape, a strided view, the other GPU's memory) go the validating way, results on each replica's own
    GPU; a plan of the same signature made by a collectives call on other GPUs is not taken for it."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"], md.cross_device_ops.RingAllReduce())
    on_gpu = {"own": lambda r: r, "other": lambda r: 1 - r, "GPU 1": lambda r: 1}

    def step(shape, gpu, strided):
        r = md.get_replica_context().replica_id_in_sync_group
        with cupy.cuda.Device(on_gpu[gpu](r)):
            x = cupy.full((shape[0] * 2,) + shape[1:] if strided else shape, r + 1, np.float32)
        return md.get_replica_context().all_reduce("sum", x[::2] if strided else x)

    def check(shape, gpu="own", strided=False):
        got = strategy.experimental_local_results(strategy.run(step, args=(shape, gpu, strided)))
        for r, v in enumerate(got):
            assert v.data.device_id == r and v.shape == shape
            np.testing.assert_array_equal(_host(v), np.full(shape, 3, np.float32))

    for _ in range(2):
        check((4,))  # planned, then the plan run straight
    check((4,), gpu="other")
    check((4,), strided=True)
    check((2, 3))
    check((4,))
    with cupy.cuda.Device(1):  # the same signature's plan for two buffers on GPU 1
        others = [cupy.ones(4, np.float32) for _ in range(2)]
    np.testing.assert_array_equal(_host(md.collectives.all_reduce(others, "SUM")[0]), np.full(4, 2, np.float32))
    check((4,), strided=True)  # (validated, and no plan made: the signature's plan found is GPU 1's)
    for _ in range(2):  # (that plan, run straight, would hand replica 0 a result on GPU 1)
        check((4,), gpu="GPU 1")
    check((4,))



def test_a_dropped_gpu_strategy_goes_at_once_with_its_kept_plans(replicas):
    """A replica context keeps its all_reduce's combine, and that its kept plan (with the plan's result
    memory). Neither the strategy nor its contexts hold a cycle: dropped, they go at once, with the plans'
    memory, without a garbage collection."""
    def use_and_drop():
        s = md.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
        for _ in range(3):  # planned, then the kept plan run straight
            s.run(lambda: md.get_replica_context().all_reduce("sum", cupy.ones(3, np.float32)))
        return weakref.ref(s), [weakref.ref(c) for c in s.extended._replica_contexts]

    gc.collect()
    gc.disable()
    try:
        strategy, contexts = use_and_drop()
        assert strategy() is None, "a reference cycle keeps the dropped strategy alive"
        assert [c() for c in contexts] == [None] * replicas, "a cycle keeps the replica contexts (and plans)"
    finally:
        gc.enable()
