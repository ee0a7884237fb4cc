"""md.IndexedSlices on GPU replicas (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

CuPy values stay on their GPU: densifying, the reductions (each replica's result on its own GPU) and
Keras' optimizers fed CuPy IndexedSlices give what the CPU replicas and TensorFlow give. A row named more
than once adds its slices in their order on a GPU too (csrc/cuda/scatter_rows.h), so GPU replicas stay
bit-identical; the stand-in's ``add.at`` adds in a random order per run, as CuPy's atomics may, and the
tests below show that it would catch the old ``cupy.add.at`` densify.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpu_env import SKIP_REASON, cupy, gpu_pair, mirrored_strategy, needs_gpus

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from test_indexed_slices import REF, _check_optimizer, _sparse_inputs, _train  # noqa: E402


def _on_gpu(s: md.IndexedSlices, ordinal: int = 0) -> md.IndexedSlices:
    with cupy.cuda.Device(ordinal):
        return md.IndexedSlices(cupy.asarray(s.values), cupy.asarray(s.indices), s.dense_shape)


def _device_of(x) -> int:
    return x.data.device_id


@pytest.mark.parametrize("ordinal", [0, pytest.param(1, marks=needs_gpus(2))])
def test_densifying_stays_on_the_values_gpu(ordinal):
    host = md.IndexedSlices(np.arange(12, dtype=np.float32).reshape(4, 3), np.array([3, 0, 3, 5]), (7, 3))
    with gpu_pair():
        s = _on_gpu(host, ordinal)
        assert s.device.endswith(f"GPU:{ordinal}")
        dense = md.convert_to_tensor(s)
        assert isinstance(dense, cupy.ndarray) and _device_of(dense) == ordinal
        np.testing.assert_array_equal(cupy.asnumpy(dense), md.convert_to_tensor(host))
        # Out of range on a GPU: dropped, as TensorFlow's GPU kernel drops it (no host sync to raise).
        wild = md.IndexedSlices(s.values, cupy.asarray(np.array([3, -1, 3, 9])), (7, 3))
        expected = np.zeros((7, 3), np.float32)
        np.add.at(expected, [3, 3], host.values[[0, 2]])
        np.testing.assert_array_equal(cupy.asnumpy(md.convert_to_tensor(wild)), expected)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [2, 3])
def test_reductions_on_gpu_replicas_match_the_cpu_replicas(n, op):
    with gpu_pair(), mirrored_strategy(n) as strategy:
        def step():
            ctx = md.get_replica_context()
            s = _sparse_inputs(ctx.replica_id_in_sync_group, "float32", "int32")
            return ctx.all_reduce(op, md.IndexedSlices(cupy.asarray(s.values), cupy.asarray(s.indices),
                                                       s.dense_shape))
        per_replica = strategy.run(step)
        reduced = strategy.reduce(op, strategy.run(
            lambda: _on_gpu(_sparse_inputs(md.get_replica_context().replica_id_in_sync_group, "float32", "int32"))),
            axis=None)
        got = [(cupy.asnumpy(c.values), cupy.asnumpy(c.indices)) for c in per_replica.values]
        for c in per_replica.values:
            assert isinstance(c.values, cupy.ndarray)
    cpu = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    expected = cpu.reduce(op, cpu.run(lambda: _sparse_inputs(md.get_replica_context().replica_id_in_sync_group,
                                                             "float32", "int32")), axis=None)
    for values, indices in got:
        np.testing.assert_array_equal(values, expected.values)
        np.testing.assert_array_equal(indices, expected.indices)
    assert isinstance(reduced.values, np.ndarray)  # strategy.reduce: on the host, as TF's
    np.testing.assert_array_equal(reduced.values, expected.values)


@pytest.mark.parametrize("name", ["SGD momentum", "Adam", "RMSprop centered momentum", "Adagrad", "SGD clipnorm"])
def test_optimizers_on_gpu_replicas_match_keras(name):
    with gpu_pair():
        opt, e, w = _train(name, 2, xp=cupy)
        _check_optimizer(name, 2, opt, e, w)


def _order_sensitive(rng, shape, dtype=np.float32):
    """Values whose sums depend on the order they are added in: large and small magnitudes mixed."""
    magnitudes = np.array([1.0, 1e-3, 3e4, 1e7])[rng.integers(0, 4, shape)]
    return (rng.integers(-50, 51, shape) * magnitudes / 7).astype(dtype)


def _heavy_batches(steps):
    """Per step: 60 slices of a (7, 3) embedding naming rows 0, 1 and 5 only, order-sensitive values."""
    rng = np.random.default_rng(5)
    return [(_order_sensitive(rng, (60, 3)), np.array([0, 1, 5])[rng.integers(0, 3, 60)],
             np.full(3, 0.5 - s, np.float32)) for s in range(steps)]


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "uint16", "int64", "float16", "complex64",
                                   "complex128"])
def test_densifying_every_dtype_sums_repeated_rows_as_numpy(dtype):
    """Dtypes CuPy's add.at refuses (8/16-bit integers, complex) too: repeated rows summed, integers wrapping."""
    rng = np.random.default_rng(11)
    values = rng.integers(0 if dtype.startswith("u") else -100, 100, (6, 3))
    if dtype.startswith("complex"):
        values = values + 1j * rng.standard_normal((6, 3))
    values = values.astype(dtype)
    indices = np.array([3, 0, 3, 5, 3, 0])  # row 3 three times: 8-bit sums wrap
    want = np.zeros((7, 3), dtype)
    np.add.at(want, indices, values)
    with gpu_pair():
        dense = md.convert_to_tensor(_on_gpu(md.IndexedSlices(values, indices, (7, 3))))
        assert isinstance(dense, cupy.ndarray) and dense.dtype == values.dtype
        np.testing.assert_array_equal(cupy.asnumpy(dense), want)


def _sparse_train(xp, devices, wrap, name="Adam", steps=6, counted_step=None, batches=None):
    """A step of Keras optimizer ``name`` on a (7, 3) embedding and a dense (3,) bias whose IndexedSlices
    repeat a row (its squares are a*a + b*b, not (a + b)**2), ``steps`` times (the host ``batches`` of
    (values, indices, bias gradient) if given); returns the copies of both and the simulator's counters of
    step ``counted_step`` (None: none counted)."""
    import gc

    from gpu_env import SIMULATED

    with gpu_pair():
        strategy = md.MirroredStrategy(devices)
        with strategy.scope():
            e = md.Variable(np.linspace(-1, 1, 21, dtype=np.float32).reshape(7, 3))
            b = md.Variable(np.zeros(3, np.float32))
            opt = {"Adam": md.optimizers.Adam, "RMSprop": md.optimizers.RMSprop,
                   "Adagrad": md.optimizers.Adagrad, "Nadam": md.optimizers.Nadam}[name](0.01)

        def step(values, indices, bias_grad):
            opt.apply_gradients([(md.IndexedSlices(values, indices, (7, 3)), e), (bias_grad, b)])
        step = wrap(step)
        counted = None
        batches = [tuple(map(xp.asarray, b)) for b in batches] if batches is not None else \
            [(xp.asarray(np.arange(9, dtype=np.float32).reshape(3, 3) * (s + 1) - 4),
              xp.asarray(np.array([1, 4, 1]) if s % 2 else np.array([6, 6, 0])),
              xp.asarray(np.full(3, 0.5 - s, np.float32))) for s in range(steps)]
        for s, batch in enumerate(batches):
            if s == counted_step and SIMULATED:
                cupy.sim.drain()
                gc.collect()  # earlier arrays freed now, not inside the counted step (a free waits)
                gc.disable()
                cupy.sim.reset_counters()
            try:
                strategy.run(step, args=batch)
            finally:
                if s == counted_step and SIMULATED:
                    counted = cupy.sim.counters()
                    gc.enable()
        state = [cupy.asnumpy(c.read_value()) if xp is cupy else c.numpy() for v in (e, b) for c in v.values]
        return state, counted, step


@pytest.mark.parametrize("name", ["Adam", "RMSprop", "Adagrad", "Nadam"])
def test_md_function_captures_a_sparse_step_of_a_squaring_rule(name):
    # The squares are scattered beside the gradient (no cupy.unique, no host wait): the step captures, and
    # every replay gives the eager step's bits (and the CPU replicas').
    import warnings

    from mirrored.distribute.function import EagerFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        captured, _, run = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], md.function, name)
    assert run.experimental_get_tracing_count() == 1
    eager, _, _ = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], lambda f: f, name)
    on_cpus, _, _ = _sparse_train(np, ["/cpu:0", "/cpu:1"], lambda f: f, name)
    for got, gpu, cpu in zip(captured, eager, on_cpus):
        np.testing.assert_array_equal(got, gpu)
        np.testing.assert_array_equal(got, cpu)


@pytest.mark.parametrize("captured", [False, True])
def test_a_sparse_adam_step_on_gpus_makes_no_host_wait(captured):
    from gpu_env import SIMULATED

    if not SIMULATED:
        pytest.skip("host waits are counted by the simulated CUDA runtime")
    wrap = md.function if captured else (lambda f: f)
    _, counted, _ = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], wrap, counted_step=4)
    assert counted["host_waits"] == 0
    if captured:
        assert counted["graph_launches"] == {0: 1}


# --- the ordered GPU densify ----------------------------------------------------------------------------

GPU_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def _reference(out, squares, values, indices):
    """The host's slice order: np.add.at adds repeated rows in turn, each addition rounded."""
    keep = (indices >= 0) & (indices < out.shape[0])
    with np.errstate(over="ignore", invalid="ignore"):  # (float16 sums may reach inf, as on the GPU)
        np.add.at(out, indices[keep], values[keep])
        if squares is not None:
            np.add.at(squares, indices[keep], values[keep] * values[keep])


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(GPU_DTYPES), index_dtype=st.sampled_from(["int32", "int64", "uint8", "int16"]),
       rows=st.integers(1, 30), trailing=st.sampled_from([(), (1,), (3,), (2, 3)]), k=st.integers(0, 90),
       named=st.sampled_from([1, 2, 5, None]), wild=st.booleans(), with_squares=st.booleans(),
       mode=st.sampled_from(["new", "accumulate", "overwrite"]), seed=st.integers(0, 2 ** 16))
def test_the_gpu_densify_adds_each_rows_slices_in_slice_order(dtype, index_dtype, rows, trailing, k, named, wild,
                                                             with_squares, mode, seed):
    from mirrored.device.indexed_slices import scatter_add_rows

    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    values = _order_sensitive(rng, (k,) + trailing, np.float64)
    values = (values / 1e4 if dt == np.float16 else values).astype(dt) if dt.kind == "f" else \
        (values % 97).astype(np.int64).astype(dt)
    span = rows if named is None else min(named, rows)
    indices = rng.integers(0, span, k)
    if wild and k and index_dtype != "uint8":  # dropped on a GPU: negative, and past the rows
        indices[rng.integers(0, k, 3)] = rng.choice([-1, -7, rows, rows + 5], 3)
    if index_dtype == "uint8":
        indices = indices % min(rows + 2, 256)  # (some past the rows)
    indices = indices.astype(index_dtype)
    squares = with_squares and dt.kind == "f"
    start = np.zeros((rows,) + trailing, dt) if mode == "new" else \
        (_order_sensitive(rng, (rows,) + trailing, np.float64) % 89).astype(dt)
    want = np.zeros_like(start) if mode != "accumulate" else start.copy()
    want_squares = (np.full_like(start, 3) if mode == "new" else want.copy()) if squares else None
    _reference(want, want_squares, values, indices)
    with cupy.cuda.Device(0):
        s = md.IndexedSlices(cupy.asarray(values), cupy.asarray(indices), (rows,) + trailing)
        if mode == "new":  # a new out; squares (if any) added into
            got_squares = cupy.full(start.shape, 3, dt) if squares else None
            out = scatter_add_rows(None, s, (rows,) + trailing, squares=got_squares)
        else:
            out, got_squares = cupy.asarray(start), cupy.asarray(start) if squares else None
            scatter_add_rows(out, s, squares=got_squares, overwrite=mode == "overwrite")
        assert out.dtype == dt and out.shape == want.shape
        np.testing.assert_array_equal(cupy.asnumpy(out), want, strict=True)
        if got_squares is not None:
            np.testing.assert_array_equal(cupy.asnumpy(got_squares), want_squares, strict=True)


def test_the_gpu_densify_is_one_kernel_sequence_without_a_wait():
    from gpu_env import SIMULATED

    if not SIMULATED:
        pytest.skip("launches and host waits are counted by the simulated CUDA runtime")
    rng = np.random.default_rng(1)
    values = _order_sensitive(rng, (200, 4))
    indices = rng.integers(0, 3, 200)
    with cupy.cuda.Device(0):
        s = md.IndexedSlices(cupy.asarray(values), cupy.asarray(indices), (10, 4))
        cupy.sim.drain()
        cupy.sim.reset_counters()
        dense = md.convert_to_tensor(s)
        counted = cupy.sim.counters()
        want = np.zeros((10, 4), np.float32)
        np.add.at(want, indices, values)
        np.testing.assert_array_equal(cupy.asnumpy(dense), want)
        # The order mattered: the same slices backwards give other bits.
        backwards = np.zeros((10, 4), np.float32)
        np.add.at(backwards, indices[::-1], values[::-1])
        assert not np.array_equal(backwards, want)
    assert counted["launches"] == {0: 6}
    assert counted["host_waits"] == 0


def test_dtypes_the_kernel_lacks_still_densify_on_the_gpu():
    # uint32: CuPy's add.at (atomics; integer sums do not depend on their order).
    values = np.array([[7], [2 ** 31], [5], [2 ** 31 + 1]], np.uint32)
    with cupy.cuda.Device(0):
        dense = md.convert_to_tensor(md.IndexedSlices(cupy.asarray(values), cupy.asarray(np.array([2, -1, 2, 0])),
                                                      (4, 1)))
    np.testing.assert_array_equal(cupy.asnumpy(dense), np.array([[2 ** 31 + 1], [0], [12], [0]], np.uint32),
                                  strict=True)


def test_the_gpu_densify_refuses_an_out_it_cannot_write():
    from mirrored.device.indexed_slices import scatter_add_rows

    with cupy.cuda.Device(0):
        s = md.IndexedSlices(cupy.ones((2, 3), np.float32), cupy.asarray(np.array([0, 1])), (3, 3))
        with pytest.raises(ValueError, match="out: .*C-contiguous"):
            scatter_add_rows(cupy.zeros((3, 6), np.float32)[:, ::2], s)
        with pytest.raises(ValueError, match="squares: .*shape"):
            scatter_add_rows(cupy.zeros((3, 3), np.float32), s, squares=cupy.zeros((4, 3), np.float32))


def _two_replicas_train(xp, devices, kind="logical", steps=4):
    """Adam on two replicas (GPUs of gpu_pair's ``kind``), each passing its own heavily repeated
    order-sensitive IndexedSlices (gathered: every replica densifies the same 240 slices of 3 rows); returns
    both replicas' copies of the embedding."""
    rng = np.random.default_rng(11)
    batches = [[(_order_sensitive(rng, (120, 3)), rng.integers(0, 3, 120)) for _ in range(2)] for _ in range(steps)]
    with gpu_pair(kind):
        strategy = md.MirroredStrategy(devices)
        with strategy.scope():
            e = md.Variable(np.linspace(-1, 1, 21, dtype=np.float32).reshape(7, 3))
            opt = md.optimizers.Adam(0.01)

        def step(batch):
            values, indices = batch[md.get_replica_context().replica_id_in_sync_group]
            opt.apply_gradients([(md.IndexedSlices(xp.asarray(values), xp.asarray(indices), (7, 3)), e)])
        for batch in batches:
            strategy.run(step, args=(batch,))
        return [cupy.asnumpy(c.read_value()) if xp is cupy else c.numpy() for c in e.values]


@pytest.mark.parametrize("kind", ["logical", "physical"])
def test_gpu_replicas_stay_bit_identical_when_rows_are_named_many_times(kind):
    first, second = _two_replicas_train(cupy, ["/gpu:0", "/gpu:1"], kind)
    np.testing.assert_array_equal(first, second)
    on_cpus = _two_replicas_train(np, ["/cpu:0", "/cpu:1"])
    np.testing.assert_array_equal(first, on_cpus[0])  # the host densify's bits: the same order


def test_the_stand_in_catches_an_unordered_gpu_densify(monkeypatch):
    # CuPy's add.at (atomics), which the GPU densify used before: the stand-in adds a repeated row's slices in
    # a random order per run, so the two replicas' copies drift apart in their last bits.
    from gpu_env import SIMULATED

    if not SIMULATED:
        pytest.skip("the stand-in's add.at models the atomics' order")
    from mirrored.device import indexed_slices

    monkeypatch.setattr(indexed_slices, "_scatter_kernel", lambda: None)
    monkeypatch.setattr(indexed_slices._scatter_gather, "gpu_apply",
                        lambda buffer, op, rows, slices: cupy.add.at(buffer, rows, slices))
    first, second = _two_replicas_train(cupy, ["/gpu:0", "/gpu:1"])
    assert not np.array_equal(first, second)


def test_heavily_repeated_rows_capture_and_replay_the_eager_bits():
    import warnings

    from mirrored.distribute.function import EagerFallbackWarning

    batches = _heavy_batches(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        captured, _, run = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], md.function, batches=batches)
    assert run.experimental_get_tracing_count() == 1
    eager, counted, _ = _sparse_train(cupy, ["/gpu:0", "/gpu:1"], lambda f: f, batches=batches, counted_step=3)
    on_cpus, _, _ = _sparse_train(np, ["/cpu:0", "/cpu:1"], lambda f: f, batches=batches)
    for got, gpu, cpu in zip(captured, eager, on_cpus):
        np.testing.assert_array_equal(got, gpu)
        np.testing.assert_array_equal(got, cpu)
    np.testing.assert_array_equal(eager[0], eager[1])  # the two GPU replicas' embeddings
    if counted is not None:
        assert counted["host_waits"] == 0
