"""md.IndexedSlices: the class, its reductions and the optimizers taking it, against TensorFlow 2.21 / Keras 3.

tests/data/tf_indexed_slices_reference.json was written by tests/data/record_tf_indexed_slices.py (the suite
never imports TensorFlow): the class's attributes and densifying, tf.Variable's scatter methods, the
reductions of MirroredStrategy at 1, 2 and 4 replicas with each CrossDeviceOps (every replica's rows
concatenated in replica order, MEAN scaling the values), and Keras 3's optimizers fed an embedding's
IndexedSlices gradient (repeated indices, untouched rows) beside a dense one, in a plain loop and under
MirroredStrategy.
"""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from mirrored.device.indexed_slices import to_dense

with open(os.path.join(os.path.dirname(__file__), "data", "tf_indexed_slices_reference.json")) as _f:
    REF = json.load(_f)
REPLICAS = (1, 2, 4)
ROWS, WIDTH, STEPS = REF["rows"], REF["width"], REF["steps"]
INPUTS = REF["optimizer_inputs"]
TYPES = {"IndexedSlices": md.IndexedSlices, "Mirrored": md.Mirrored, "PerReplica": md.PerReplica,
         "EagerTensor": np.ndarray}


def _array(record):
    return np.array(record["values"], record["dtype"]).reshape(record["shape"])


def _slices(record) -> md.IndexedSlices:
    shape = record["dense_shape"]
    return md.IndexedSlices(_array(record["values"]), _array(record["indices"]),
                            None if shape is None else _array(shape))


def _check_slices(got, record, rtol=0.0):
    """``got`` against a recorded IndexedSlices (or Tensor): type, values, indices, dense shape, dtypes."""
    assert isinstance(got, TYPES[record["type"]]), (type(got), record["type"])
    if record["type"] != "IndexedSlices":
        np.testing.assert_allclose(np.asarray(got), _array(record), rtol=rtol)
        return
    values, indices = np.asarray(got.values), np.asarray(got.indices)
    assert values.dtype == np.dtype(record["values"]["dtype"])
    assert indices.dtype == np.dtype(record["indices"]["dtype"])
    np.testing.assert_allclose(values, _array(record["values"]), rtol=rtol)
    np.testing.assert_array_equal(indices, _array(record["indices"]))
    np.testing.assert_array_equal(got.dense_shape, record["dense_shape"]["values"])


def _check_distributed(got, record, rtol=0.0):
    if "components" not in record:
        return _check_slices(got, record, rtol)
    assert isinstance(got, TYPES[record["type"]]), (type(got), record["type"])
    assert len(got.values) == len(record["components"])
    for component, expected in zip(got.values, record["components"]):
        _check_slices(component, expected, rtol)


# --- the class ------------------------------------------------------------------------------------------


def test_attributes_densifying_and_negation_match_tf():
    basic = REF["slices"]["basic"]
    s = _slices(basic["slices"])
    assert s.dtype == np.float32 and s.dtype.name == basic["dtype"]
    assert s.shape == tuple(basic["shape"]) and isinstance(s.shape, md.TensorShape)
    assert s.device.endswith(basic["device_endswith"])
    dense = md.convert_to_tensor(s)
    np.testing.assert_array_equal(dense, _array(basic["dense"]))  # row 0 named twice: its slices add up
    assert dense.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(s), dense)
    _check_slices(-s, basic["neg"])
    assert repr(s).startswith("IndexedSlices(indices=")  # (TF's str form)
    int64 = REF["slices"]["int64"]
    s64 = _slices(int64["slices"])
    np.testing.assert_array_equal(md.convert_to_tensor(s64), _array(int64["dense"]))
    assert md.convert_to_tensor(s64).dtype == np.int64


def test_without_dense_shape_the_rank_is_unknown_and_densifying_raises():
    record = REF["slices"]["no_dense_shape"]
    s = md.IndexedSlices(np.ones((3, 2), np.float32), np.array([0, 2, 0]))
    assert s.dense_shape is None and record["dense_shape"]
    assert s.shape.rank is None and record["shape_rank"] is None
    assert record["densify"]["raised"] == "ValueError"
    with pytest.raises(ValueError, match="without a dense_shape"):
        md.convert_to_tensor(s)


def test_bad_input_raises_naming_the_argument():
    errors = REF["slices"]["errors"]
    values = np.array([[1., 2.], [3., 4.], [5., 6.]], np.float32)
    # TF checks these when it densifies (InvalidArgumentError); here they are refused at once.
    assert errors["float_indices"]["raised"] == "InvalidArgumentError"
    with pytest.raises(TypeError, match="indices: dtype float"):
        md.IndexedSlices(values, np.array([0., 1., 2.]), (4, 2))
    assert errors["indices_2d"]["raised"] == "InvalidArgumentError"
    with pytest.raises(ValueError, match=r"indices: shape \(3, 1\) is not 1-D"):
        md.IndexedSlices(values, np.array([[0], [1], [2]]), (4, 2))
    assert errors["scalar_values"]["raised"] == "InvalidArgumentError"
    with pytest.raises(ValueError, match="values: a scalar"):
        md.IndexedSlices(np.float32(1), np.array([0]), (4,))
    assert errors["leading_dims"]["raised"] == "InvalidArgumentError"
    with pytest.raises(ValueError, match="indices: 2 indices for 3 rows"):
        md.IndexedSlices(values, np.array([0, 1]), (4, 2))
    with pytest.raises(ValueError, match="dense_shape=.*does not fit"):
        md.IndexedSlices(values, np.array([0, 1, 2]), (4, 3))
    # Out of range: TF's CPU kernel raises for an index past the rows, and drops a negative one.
    assert errors["index_out_of_range"]["raised"] == "InvalidArgumentError"
    s = md.IndexedSlices(values, np.array([0, 5, 0]), (4, 2))
    with pytest.raises(IndexError, match=r"indices\[1\] = 5 is out of range \[0, 4\)"):
        md.convert_to_tensor(s)
    assert errors["negative_index"]["raised"] is None
    dropped = md.convert_to_tensor(md.IndexedSlices(values, np.array([0, -1, 0]), (4, 2)))
    np.testing.assert_array_equal(dropped, [[6., 8.], [0., 0.], [0., 0.], [0., 0.]])
    with pytest.raises(ValueError, match="Incompatible tensor conversion requested to `dtype` float64"):
        md.convert_to_tensor(md.IndexedSlices(values, np.array([0, 1, 2]), (4, 2)), dtype=np.float64)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(0, 4), k=st.integers(0, 12), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.float16]),
       index_dtype=st.sampled_from([np.int32, np.int64]))
def test_densifying_adds_repeated_rows_as_numpy(rows, width, k, seed, dtype, index_dtype):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((k, width)) * 10).astype(dtype)
    indices = rng.integers(0, rows, k).astype(index_dtype)
    expected = np.zeros((rows, width), dtype)
    np.add.at(expected, indices, values)
    got = md.convert_to_tensor(md.IndexedSlices(values, indices, (rows, width)))
    assert got.dtype == np.dtype(dtype) and got.shape == (rows, width)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("repeats", [1, 3, 64, 65, 300])
def test_a_row_repeated_many_times_adds_up_in_order(repeats):
    rng = np.random.default_rng(repeats)
    indices = np.concatenate([np.full(repeats, 2), rng.integers(0, 5, 20)])
    rng.shuffle(indices)
    values = rng.standard_normal((len(indices), 3)).astype(np.float32)
    expected = np.zeros((5, 3), np.float32)
    np.add.at(expected, indices, values)  # one slice at a time, in order
    np.testing.assert_array_equal(md.convert_to_tensor(md.IndexedSlices(values, indices, (5, 3))), expected)



@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(0, 4), k=st.integers(0, 30), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]), negative=st.booleans(),
       index_dtype=st.sampled_from([np.int32, np.int64]))
def test_densifying_with_squares_adds_each_slices_square_in_order(rows, width, k, seed, dtype, negative,
                                                                    index_dtype):
    # The squares a rule takes for a sparse step: row by row, a*a + b*b for a row named twice.
    from mirrored.device.indexed_slices import scatter_add_rows

    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((k, width)) * 10).astype(dtype)
    indices = rng.integers(-2 if negative else 0, rows, k).astype(index_dtype)
    kept = indices >= 0  # (a negative index is dropped on host)
    expected, expected_squares = np.zeros((rows, width), dtype), np.zeros((rows, width), dtype)
    np.add.at(expected, indices[kept], values[kept])
    np.add.at(expected_squares, indices[kept], values[kept] * values[kept])
    squares = np.zeros((rows, width), dtype)
    got = scatter_add_rows(np.zeros((rows, width), dtype), md.IndexedSlices(values, indices, (rows, width)),
                           squares=squares)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(squares, expected_squares)


def test_densifying_with_squares_refuses_an_index_past_the_rows_before_writing():
    from mirrored.device.indexed_slices import scatter_add_rows

    out, squares = np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    slices = md.IndexedSlices(np.ones((3, 2), np.float32), np.array([1, 4, 0]), (4, 2))
    with pytest.raises(IndexError, match=r"indices\[1\] = 4 is out of range \[0, 4\)"):
        scatter_add_rows(out, slices, squares=squares)
    assert not out.any() and not squares.any()


def test_the_native_scatter_and_the_kernels_squares_refuse_bad_input_naming_it():
    from mirrored import _core

    out = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="indices: expected a C-contiguous 1-D int64"):
        _core.scatter_add_rows(out, None, np.ones((2, 2), np.float32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="values: expected one row"):
        _core.scatter_add_rows(out, None, np.ones((2, 3), np.float32), np.array([0, 1]))
    with pytest.raises(ValueError, match="squares: dtype float64"):
        _core.scatter_add_rows(out, np.zeros((4, 2)), np.ones((2, 2), np.float32), np.array([0, 1]))
    assert _core.scatter_add_rows(out, None, np.ones((2, 2), np.float32), np.array([0, 9])) == 1
    w, g, m, v = (np.full(3, x, np.float32) for x in (1.0, 0.5, 0.0, 0.0))
    coefficients = [0.1, 0.001, 0.0031, 1e-7]
    with pytest.raises(ValueError, match="squares: expected None or a list with one entry"):
        _core.fused_update(3, [w], [g], [[m, v]], [False], coefficients, 0.0, 0.0, [g, g])
    with pytest.raises(ValueError, match=r"squares\[0\]: 2 elements, the variable has 3"):
        _core.fused_update(3, [w], [g], [[m, v]], [False], coefficients, 0.0, 0.0, [np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="squares: not with a tuple"):
        _core.fused_update(3, [w], ([g], [g]), [[m, v]], [False], coefficients, 0.0, 0.0, [g])
    # Squares equal to g * g: the dense update's bits; other squares: Adam's second moment takes them.
    dense = [a.copy() for a in (w, m, v)]
    _core.fused_update(3, [dense[0]], [g], [dense[1:]], [False], coefficients, 0.0, 0.0)
    given = [a.copy() for a in (w, m, v)]
    _core.fused_update(3, [given[0]], [g], [given[1:]], [False], coefficients, 0.0, 0.0, [g * g])
    for a, b in zip(dense, given):
        np.testing.assert_array_equal(a, b)
    other = [a.copy() for a in (w, m, v)]
    _core.fused_update(3, [other[0]], [g], [other[1:]], [False], coefficients, 0.0, 0.0, [np.full(3, 2.0, np.float32)])
    np.testing.assert_array_equal(other[2], np.float32(0) + (np.float32(2.0) - np.float32(0)) * np.float32(0.001))




@pytest.mark.parametrize("name", ["Adam", "SGD"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_sparse_step_that_failed_half_way_leaves_the_next_steps_exact(name, n):
    # A step densifies into buffers it keeps (zeroing only the rows it wrote after the update): a step
    # that raised after writing some rows (the second variable's index is out of range) must not leak them.
    def train(fail: bool):
        strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            a, b = md.Variable(np.ones((6, 2), np.float32)), md.Variable(np.ones((5, 2), np.float32))
            opt = getattr(md.optimizers, name)(0.1)

        def step(s, bad=False):
            values = np.arange(6, dtype=np.float32).reshape(3, 2) * (s + 1)
            grads = [md.IndexedSlices(values, np.array([1, 3, 1]), (6, 2)),
                     md.IndexedSlices(values, np.array([0, 9 if bad else 2, 2]), (5, 2))]
            strategy.run(lambda: opt.apply_gradients(zip(grads, [a, b])))
        for s in range(4):
            if fail and s == 2:
                with pytest.raises(IndexError, match="out of range"):
                    step(s, bad=True)
            step(s)
        return [c.numpy() for v in (a, b) for c in v.values]

    for got, want in zip(train(True), train(False)):
        np.testing.assert_array_equal(got, want)



# --- variables ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_max",
                                    "scatter_min", "scatter_update"])
def test_variable_scatter_methods_match_tf(method):
    record = REF["variables"]
    base = _array(record["base"])
    delta = record[method]["delta"]
    v = md.Variable(base)
    assert getattr(v, method)(_slices(delta)) is v
    np.testing.assert_allclose(np.asarray(v), _array(record[method]["result"]), rtol=1e-7)
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mv = md.Variable(base)
    getattr(mv, method)(_slices(delta))  # cross-replica context: every copy
    for copy in mv.values:
        np.testing.assert_allclose(np.asarray(copy), _array(record[method]["result"]), rtol=1e-7)


def test_variable_scatter_bad_input():
    record = REF["variables"]
    v = md.Variable(_array(record["base"]))
    assert record["not_slices"]["raised"] == "TypeError"
    with pytest.raises(TypeError, match="sparse_delta: scatter_add takes an md.IndexedSlices"):
        v.scatter_add(np.ones((1, 3), np.float32))
    assert record["out_of_range"]["raised"] == "InvalidArgumentError"
    assert "indices[0] = 9 is not in [0, 4)" in record["out_of_range"]["message"]
    with pytest.raises(IndexError, match=r"indices\[0\] = 9 is not in \[0, 4\)"):
        v.scatter_add(md.IndexedSlices(np.ones((1, 3), np.float32), np.array([9])))
    # TF 2.21 takes rows of another width without a word and writes past them (garbage): refused here.
    assert record["bad_shape"]["raised"] is None
    with pytest.raises(ValueError, match=r"rows of shape \(2,\) do not fit"):
        v.scatter_add(md.IndexedSlices(np.ones((1, 2), np.float32), np.array([1])))
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        summed = md.Variable(np.zeros((4, 3), np.float32), aggregation=md.VariableAggregation.SUM)
    # TF 2.21 refuses scatter_min/max/update of a SUM or MEAN variable and runs the others on every copy
    # (tests/test_variable_scatter_nd.py checks each against TF's record).
    with pytest.raises(NotImplementedError, match="scatter_update is only supported for mirrored variable"):
        summed.scatter_update(md.IndexedSlices(np.ones((1, 3), np.float32), np.array([1])))
    summed.scatter_add(md.IndexedSlices(np.ones((1, 3), np.float32), np.array([1])))
    for copy in summed.values:
        np.testing.assert_array_equal(np.asarray(copy), [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]])


# --- reductions -----------------------------------------------------------------------------------------


def _sparse_inputs(r, dtype, index_dtype):
    """The recorder's replica r: r + 2 rows, indices repeating one row."""
    k = r + 2
    values = (np.arange(k * WIDTH).reshape(k, WIDTH) + 10 * r + 1).astype(dtype) * np.asarray(0.5, dtype)
    indices = np.array([(3 * r + 2 * j) % 5 for j in range(k - 1)] + [(3 * r) % 5], index_dtype)
    return md.IndexedSlices(values, indices, np.array([ROWS, WIDTH], index_dtype))


CROSS_DEVICE_OPS = {  # ours -> the recording it matches (TF's default on CPU is its CollectiveAllReduce)
    "RingAllReduce": "default", "CollectiveAllReduce": "default", "ReductionToOneDevice": "ReductionToOneDevice",
    "NcclAllReduce": "NcclAllReduce", "HierarchicalCopyAllReduce": "HierarchicalCopyAllReduce"}


def _strategy(n, ops):
    cls = getattr(md.cross_device_ops, ops)
    return md.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=cls())


@pytest.mark.parametrize("dtype,index_dtype", [("float32", "int32"), ("float64", "int64")])
@pytest.mark.parametrize("ops", sorted(CROSS_DEVICE_OPS))
@pytest.mark.parametrize("n", REPLICAS)
def test_reductions_concatenate_every_replicas_rows_as_tf(n, ops, dtype, index_dtype):
    ref = REF[f"reduce|{n}|{CROSS_DEVICE_OPS[ops]}"]
    key = f"{CROSS_DEVICE_OPS[ops]}|{dtype}"
    strategy = _strategy(n, ops)
    per_replica = strategy.run(lambda: _sparse_inputs(md.get_replica_context().replica_id_in_sync_group,
                                                      dtype, index_dtype))
    dense = strategy.run(lambda: np.ones(2, np.float32) * (md.get_replica_context().replica_id_in_sync_group + 1))
    for op in ("SUM", "MEAN"):
        _check_distributed(strategy.reduce(op, per_replica, axis=None), ref[f"{key}|reduce|{op}"])
        _check_distributed(strategy.extended.reduce_to(op, per_replica, destinations=per_replica),
                           ref[f"{key}|reduce_to|{op}"])
        _check_distributed(strategy.extended.reduce_to(op, per_replica, destinations="/cpu:0"),
                           ref[f"{key}|reduce_to_cpu0|{op}"])
        recorded = ref[f"{key}|batch_reduce_to|{op}"]
        if "raised" in recorded:  # NCCL has no CPU replicas: the dense value is refused, here as in TF
            assert n > 1 and "NcclAllReduce" in recorded["message"]
            with pytest.raises(ValueError, match="NcclAllReduce needs GPU replicas"):
                strategy.extended.batch_reduce_to(op, [(per_replica, per_replica), (dense, dense)])
        else:
            batch = strategy.extended.batch_reduce_to(op, [(per_replica, per_replica), (dense, dense)])
            for got, expected in zip(batch, recorded):
                _check_distributed(got, expected)
        for got, expected in zip(strategy.extended.batch_reduce_to(op, [(per_replica, per_replica)] * 2),
                                 ref[f"{key}|batch_reduce_to_sparse|{op}"]):
            _check_distributed(got, expected)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("ops", sorted(CROSS_DEVICE_OPS))
@pytest.mark.parametrize("n", REPLICAS)
def test_replica_all_reduce_of_slices_and_nests_mixing_dense_and_sparse(n, ops, op):
    ref = REF[f"reduce|{n}|{CROSS_DEVICE_OPS[ops]}"]
    mixed = "raised" not in ref[f"{CROSS_DEVICE_OPS[ops]}|float32|all_reduce|{op}"]  # (NCCL: no CPU replicas)
    recorded = ref[f"{CROSS_DEVICE_OPS[ops]}|float32|all_reduce{'' if mixed else '_sparse'}|{op}"]

    def step():
        ctx = md.get_replica_context()
        s = _sparse_inputs(ctx.replica_id_in_sync_group, "float32", "int32")
        d = np.ones(2, np.float32) * (ctx.replica_id_in_sync_group + 1)
        return ctx.all_reduce(op.lower(), s), ctx.all_reduce(op.lower(), {"dense": d, "sparse": [s, s]} if mixed
                                                             else {"sparse": [s, s]})

    single, nest = _strategy(n, ops).run(step)
    _check_distributed(single, recorded["single"])
    if mixed:
        _check_distributed(nest["dense"], recorded["nest_dense"])
    for got, expected in zip(nest["sparse"], recorded["nest_sparse"]):
        _check_distributed(got, expected)


def test_all_gather_refuses_slices_as_tf():
    record = REF["reduce|2|default"]["all_gather"]
    assert record["raised"] == "NotImplementedError"
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(NotImplementedError, match=record["message"]):
        strategy.run(lambda: md.get_replica_context().all_gather(_sparse_inputs(0, "float32", "int32"), axis=0))


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from(REPLICAS), width=st.integers(1, 3), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([np.float32, np.float64, np.int32]), op=st.sampled_from(["SUM", "MEAN"]),
       counts=st.lists(st.integers(0, 5), min_size=4, max_size=4))
def test_reduced_slices_densify_to_the_sum_of_each_replicas_dense(n, width, seed, dtype, op, counts):
    rng = np.random.default_rng(seed)
    parts = [md.IndexedSlices((rng.standard_normal((c, width)) * 4).astype(dtype), rng.integers(0, 6, c), (6, width))
             for c in counts[:n]]
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])
    reduced = strategy.reduce(op, per_replica, axis=None)
    assert isinstance(reduced, md.IndexedSlices)
    np.testing.assert_array_equal(reduced.indices, np.concatenate([p.indices for p in parts]))
    expected = sum(to_dense(p).astype(np.float64) for p in parts)
    if op == "MEAN":
        expected = expected / n
    np.testing.assert_allclose(to_dense(reduced), expected, rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_reduce_with_an_axis_or_max_raises_naming_the_fix():
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    per_replica = strategy.run(lambda: _sparse_inputs(0, "float32", "int32"))
    with pytest.raises(ValueError, match="axis=0: IndexedSlices reduce across replicas only"):
        strategy.reduce("SUM", per_replica, axis=0)
    with pytest.raises(ValueError, match="reduce_op=.*MAX.*SUM or MEAN only"):
        strategy.reduce("MAX", per_replica, axis=None)


# --- optimizers -----------------------------------------------------------------------------------------


def _recorded_slices(s, r):
    g = INPUTS["sparse"][f"{s}|{r}"]
    return md.IndexedSlices(np.array(g["values"], np.float32), np.array(g["indices"], np.int32), (ROWS, WIDTH))


def _train(name, n, xp=np, in_replicas=True):
    """The recorded model trained STEPS steps: n = 0 in a plain loop, else in MirroredStrategy's replicas
    (or, ``in_replicas=False``, with PerReplica gradients in cross-replica context)."""
    cls, kwargs = REF["optimizer_configs"][name]
    strategy = md.MirroredStrategy([f"/{'gpu' if xp is not np else 'cpu'}:{i}" for i in range(n)]) if n else \
        md.get_strategy()
    with strategy.scope():
        e = md.Variable(np.array(INPUTS["embedding0"], np.float32), name="embedding")
        w = md.Variable(np.array(INPUTS["w0"], np.float32), name="w")
        opt = getattr(md.optimizers, cls)(**kwargs)
    grads_w = np.array(INPUTS["grads_w"], np.float32)

    def on(x, r):
        s = x if isinstance(x, md.IndexedSlices) else None
        if s is None:
            return xp.asarray(x)
        return md.IndexedSlices(xp.asarray(s.values), xp.asarray(s.indices), s.dense_shape)

    for s in range(STEPS):
        if not n:
            opt.apply_gradients([(_recorded_slices(s, 0), e), (grads_w[s, 0], w)])
        elif in_replicas:
            def step(s=s):
                r = md.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(on(_recorded_slices(s, r), r), e), (on(grads_w[s, r], r), w)])
            strategy.run(step)
        else:
            sparse = strategy.experimental_distribute_values_from_function(
                lambda ctx, s=s: _recorded_slices(s, ctx.replica_id_in_sync_group))
            dense = strategy.experimental_distribute_values_from_function(
                lambda ctx, s=s: grads_w[s, ctx.replica_id_in_sync_group])
            with strategy.scope():
                opt.apply_gradients([(sparse, e), (dense, w)])
    return opt, e, w


def _check_optimizer(name, n, opt, e, w, rtol=2e-6):
    ref = REF[f"optimizers|{n}|{name}"]
    for var, key in ((e, "embedding"), (w, "w")):
        copies = var.values if isinstance(var, md.DistributedValues) else (var,)
        for copy in copies:
            np.testing.assert_allclose(np.asarray(copy.numpy()), _array(ref[key]), rtol=rtol, atol=rtol * 0.1)
        assert all(np.array_equal(np.asarray(c.numpy()), np.asarray(copies[0].numpy())) for c in copies)
    for path, expected in ref["slots"].items():  # e.g. "adam/embedding_0_velocity"
        var_name, _, slot = path.split("/")[-1].partition("_0_")
        if not slot:  # Nadam's u_product: no gradient in it (tests/test_optimizer_keras_parity.py)
            continue
        slot_var = opt.get_slot(e if var_name == "embedding" else w, slot)
        got = slot_var.values[0] if isinstance(slot_var, md.DistributedValues) else slot_var
        np.testing.assert_allclose(np.asarray(got.numpy()), np.array(expected, np.float32), rtol=rtol,
                                   atol=rtol * 0.1, err_msg=path)
    assert int(opt.iterations.numpy()) == ref["iterations"]


@pytest.mark.parametrize("n", (0, *REPLICAS))
@pytest.mark.parametrize("name", sorted(REF["optimizer_configs"]))
def test_optimizers_with_sparse_gradients_match_keras(name, n):
    # Untouched rows (5, 6) decay Adam's moments as Keras' do; a repeated row adds its rows' squares to the
    # second moments (Keras squares IndexedSlices row by row), and the clipping sees the rows.
    _check_optimizer(name, n, *_train(name, n))


@pytest.mark.parametrize("n", (2, 4))
@pytest.mark.parametrize("name", ["SGD momentum", "Adam", "Adagrad", "RMSprop centered momentum", "SGD clipnorm",
                                  "SGD global_clipnorm"])
def test_optimizers_with_per_replica_sparse_gradients_in_cross_replica_context(name, n):
    _check_optimizer(name, n, *_train(name, n, in_replicas=False))


def test_loss_scale_optimizer_checks_the_rows_and_skips_a_step_with_an_inf():
    record = REF["loss_scale"]
    # Keras 3.15's check misses an inf in IndexedSlices: it applies it (the weights become -inf) and keeps the
    # scale. Here the step is skipped and the scale halved, as for a dense gradient.
    assert record["scales"] == [4.0, 4.0, 4.0] and np.isinf(_array(record["after_skip"])).any()
    e = md.Variable(np.array(INPUTS["embedding0"], np.float32))
    opt = md.mixed_precision.LossScaleOptimizer(md.optimizers.SGD(0.1), initial_scale=4.0)
    expected = np.array(INPUTS["embedding0"], np.float32)
    scales = []
    for s in range(3):
        g = _recorded_slices(s, 0)
        values = g.values * np.float32(4.0)
        if s == 1:
            values[0, 1] = np.inf
        scale = float(opt.dynamic_scale.numpy())
        opt.apply_gradients([(md.IndexedSlices(values, g.indices, g.dense_shape), e)])
        scales.append(float(opt.dynamic_scale.numpy()))
        if s != 1:
            unscaled = md.IndexedSlices(values / np.float32(scale), g.indices, (ROWS, WIDTH))
            expected -= np.float32(0.1) * to_dense(unscaled)
        np.testing.assert_allclose(np.asarray(e), expected, rtol=1e-6)
        if s == 0:  # a finite step: Keras' result
            np.testing.assert_allclose(np.asarray(e), _array(record["after_first"]), rtol=1e-6)
    assert scales == [4.0, 2.0, 2.0]


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from(REPLICAS), rows=st.integers(4, 12), width=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       config=st.sampled_from(sorted(name for name, (_, kwargs) in REF["optimizer_configs"].items()
                                     if not {"clipnorm", "clipvalue", "global_clipnorm"} & set(kwargs))))
def test_slices_naming_each_row_once_train_as_their_dense_gradient(n, rows, width, seed, config):
    # Each row named once over all replicas: the rows' squares are the squares of the sums, and the sparse step
    # gives the dense step's bits (weights on every replica, and slots).
    cls, kwargs = REF["optimizer_configs"][config]
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    w0 = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)

    def train(densify):
        rng = np.random.default_rng(seed + 1)
        with strategy.scope():
            e = md.Variable(w0)
            opt = getattr(md.optimizers, cls)(**kwargs)
        for _ in range(3):
            named = np.array_split(rng.permutation(rows)[:rng.integers(1, rows + 1)], n)
            grads = [md.IndexedSlices(rng.standard_normal((len(p), width)).astype(np.float32), p, (rows, width))
                     for p in named]
            if densify:
                grads = [md.convert_to_tensor(g) for g in grads]
            strategy.run(lambda: opt.apply_gradients([(grads[md.get_replica_context().replica_id_in_sync_group],
                                                       e)]))
        slots = [opt.get_slot(e, name) for name in opt._slot_names]
        return [np.asarray(c) for c in e.values] + [np.asarray(c) for s in slots for c in s.values]

    for sparse, dense in zip(train(False), train(True)):
        np.testing.assert_array_equal(sparse, dense)
