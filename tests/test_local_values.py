"""Local values that used to pass validation and give wrong answers: byte order, aliased outputs,
reduce's axis, variable assigns that do not fit, unavailable reduce devices, bad accumulation_fn."""

import numpy as np
import pytest

import mirrored as md
from mirrored import collectives
from mirrored import cross_device_ops as cdo

ALGORITHMS = ["direct", "ring", "tree"]
SWAPPED = [">i4", ">f4", ">f8", ">i8"] if np.little_endian else ["<i4", "<f4", "<f8", "<i8"]


def _strategy(n=2, **kwargs):
    return md.MirroredStrategy([f"/cpu:{i}" for i in range(n)], **kwargs)


def _replica_values(n, size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size).astype(dtype) for _ in range(n)]


# --- byte order -----------------------------------------------------------------


def test_big_endian_sum_is_numpys():
    a = np.array([255, 1, 1000], ">i4")
    b = np.array([1, 2, 3000], ">i4")
    for r in collectives.all_reduce([a, b], "sum"):
        np.testing.assert_array_equal(r, [256, 3, 4000])
        assert r.dtype.isnative  # results are in native byte order


@pytest.mark.parametrize("dtype", SWAPPED)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
def test_swapped_byte_order_reduces_the_numbers_held(dtype, op):
    xs = _replica_values(3, 17, dtype)
    native = [x.astype(np.dtype(dtype).newbyteorder("=")) for x in xs]
    expected = {"sum": sum(native), "max": np.maximum.reduce(native), "min": np.minimum.reduce(native),
                "prod": native[0] * native[1] * native[2], "mean": sum(n.astype(np.float64) for n in native) / 3}[op]
    for algorithm in ALGORITHMS:
        for r in collectives.all_reduce(xs, op, algorithm=algorithm):
            np.testing.assert_allclose(r, expected, rtol=1e-6)
    np.testing.assert_allclose(collectives.reduce(xs, op, root=1), expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", SWAPPED)
def test_swapped_broadcast_gather_and_batch(dtype):
    xs = _replica_values(2, 6, dtype)
    native = [x.astype(np.dtype(dtype).newbyteorder("=")) for x in xs]
    for r in collectives.broadcast(xs, root=1):
        np.testing.assert_array_equal(r, native[1])
    for r in collectives.all_gather(xs):
        np.testing.assert_array_equal(r, np.concatenate(native))
    rows = collectives.batch_all_reduce([[xs[0], native[0]], [xs[1], native[1]]], "sum")
    for row in rows:
        np.testing.assert_array_equal(row[0], native[0] + native[1])
        np.testing.assert_array_equal(row[1], native[0] + native[1])


def test_mixed_byte_orders_and_swapped_out_arrays():
    a = np.array([1.5, -2.0, 1e30], ">f4")
    b = np.array([0.5, 4.0, 1e30], "<f4")
    expected = np.array([2.0, 2.0, 2e30], np.float32)
    # out in the swapped order: written in place, holding the same numbers
    out = [np.empty(3, ">f4"), np.empty(3, "<f4")]
    assert collectives.all_reduce([a, b], "sum", out=out) == out
    for o in out:
        np.testing.assert_allclose(o, expected, rtol=1e-6)
    assert out[0].dtype.str == ">f4"
    # in place on swapped inputs
    x, y = a.copy(), b.copy()
    collectives.all_reduce([x, y], "sum", out=[x, y])
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    # broadcast and reduce into swapped outputs
    out = [np.empty(3, ">f4"), np.empty(3, ">f4")]
    collectives.broadcast([a, b], root=0, out=out)
    np.testing.assert_array_equal(out[1], a)
    target = np.empty(3, ">f4")
    r = collectives.reduce([a, b], "sum", root=1, out=[np.empty(3, ">f4"), target])
    assert r is target
    np.testing.assert_allclose(target, expected, rtol=1e-6)


def test_strategy_reduces_swapped_values():
    strategy = _strategy(2)
    values = md.PerReplica([np.array([255, 1000], ">i4"), np.array([1, 3000], ">i4")])
    with strategy.scope():
        total = strategy.reduce("SUM", strategy.experimental_distribute_values_from_function(
            lambda ctx: values.values[ctx.replica_id_in_sync_group]), axis=None)
    np.testing.assert_array_equal(total, [256, 4000])


def test_dtype_code_refuses_swapped_dtypes_by_name():
    from mirrored.device import dtypes as _dtypes

    with pytest.raises(TypeError, match=r"byte order.*astype\('<i4'\)|byte order.*astype\('>i4'\)"):
        _dtypes.dtype_code(np.dtype(SWAPPED[0]), "buffers")


# --- aliasing ---------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_rotated_outputs_are_right(algorithm, n):
    xs = [np.random.default_rng(i).random(4096).astype(np.float32) for i in range(n)]
    expected = sum(x.astype(np.float64) for x in xs)
    out = xs[1:] + xs[:1]  # out[i] is another replica's input
    result = collectives.all_reduce(xs, "sum", out=out, algorithm=algorithm)
    assert result == out
    for r in result:
        np.testing.assert_allclose(r, expected, rtol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shift", [1, 7, -3])
def test_partially_overlapping_in_place_views_are_right(algorithm, shift):
    base = np.arange(3 * 5000, dtype=np.float64)
    starts = [100, 5100, 10100]
    xs = [base[s:s + 4000] for s in starts]
    expected = sum(x.copy() for x in xs)
    out = [base[s + shift:s + shift + 4000] for s in starts]  # each overlaps its own input, shifted
    collectives.all_reduce(xs, "sum", out=out, algorithm=algorithm)
    for o in out:
        np.testing.assert_array_equal(o, expected)


def test_output_overlapping_another_input_partially():
    base = np.arange(64, dtype=np.int64)
    x0, x1 = base[0:32], base[32:64]
    expected = x0 + x1
    out = [base[16:48], np.empty(32, np.int64)]  # straddles both inputs
    collectives.all_reduce([x0, x1], "sum", out=out)
    np.testing.assert_array_equal(out[1], expected)
    np.testing.assert_array_equal(base[16:48], expected)


def test_outputs_sharing_memory_are_refused():
    a = np.ones(8, np.float32)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        collectives.all_reduce([a, a], "sum", out=[a, a])
    base = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match=r"share memory"):
        collectives.all_reduce([np.ones(8, np.float32)] * 2, "sum", out=[base[0:8], base[4:12]])
    with pytest.raises(ValueError, match=r"share memory"):
        collectives.broadcast([np.ones(8, np.float32), np.ones(8, np.float32)], out=[base[0:8], base[4:12]])


def test_repeated_inputs_out_of_place_are_fine():
    a = np.arange(5, dtype=np.float32)
    for r in collectives.all_reduce([a, a, a], "sum"):
        np.testing.assert_array_equal(r, 3 * np.arange(5))


def test_broadcast_and_reduce_with_aliased_outputs():
    xs = [np.full(1000, float(i)) for i in range(3)]
    out = xs[1:] + xs[:1]
    collectives.broadcast(xs, root=1, out=out)
    for o in out:
        np.testing.assert_array_equal(o, 1.0)
    base = np.arange(40, dtype=np.float64)
    xs = [base[0:16], base[16:32]]
    expected = xs[0] + xs[1]
    target = base[8:24]  # the root's output straddles both inputs
    collectives.reduce(xs, "sum", root=0, out=[target, np.empty(16)])
    np.testing.assert_array_equal(target, expected)
    # broadcast into a shifted view of the root's own input
    base = np.arange(40, dtype=np.float64)
    src = base[0:16].copy()
    out = [base[4:20], np.empty(16)]
    collectives.broadcast([base[0:16], np.zeros(16)], root=0, out=out)
    np.testing.assert_array_equal(out[0], src)
    np.testing.assert_array_equal(out[1], src)


def test_reduce_leaves_the_other_replicas_outputs_alone():
    # Only the root's output is written: a non-root output that is not contiguous keeps its values
    # (it was staged like a written one, and the uninitialised staging buffer copied into it).
    xs = [np.full(6, 1.0, np.float32), np.full(6, 2.0, np.float32)]
    for root in (0, 1):
        for _ in range(2):
            other = np.arange(12, dtype=np.float32)[::2]
            out = [np.zeros(6, np.float32), np.zeros(6, np.float32)]
            out[1 - root] = other
            target = collectives.reduce(xs, "sum", root=root, out=out)
            np.testing.assert_array_equal(target, 3.0)
            np.testing.assert_array_equal(other, np.arange(12, dtype=np.float32)[::2])


def test_in_place_stays_zero_copy():
    xs = [np.full(1 << 16, float(i), np.float32) for i in range(4)]
    pointers = [x.ctypes.data for x in xs]
    result = collectives.all_reduce(xs, "sum", out=xs)
    assert [r.ctypes.data for r in result] == pointers
    for r in result:
        np.testing.assert_array_equal(r, 6.0)


# --- strategy.reduce axis ------------------------------------------------------------


def test_reduce_axis_out_of_range_names_axis_and_rank():
    strategy = _strategy(2)
    values = strategy.run(lambda: np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"axis=5 is out of range for a value of rank 2.*-2\.\.1"):
        strategy.reduce("SUM", values, axis=5)
    with pytest.raises(ValueError, match=r"axis=-3 .* rank 2"):
        strategy.reduce("MEAN", values, axis=-3)
    scalars = strategy.run(lambda: np.float32(1))
    with pytest.raises(ValueError, match=r"rank 0"):
        strategy.reduce("SUM", scalars, axis=0)
    np.testing.assert_array_equal(strategy.reduce("SUM", values, axis=-1), [6.0, 6.0])


# --- variable assigns -----------------------------------------------------------------


def test_assign_refuses_a_value_that_does_not_fit():
    v = md.Variable(np.int8(1))
    with pytest.raises(TypeError, match=r"cannot assign 300 .*int8"):
        v.assign(np.int64(300))
    with pytest.raises(TypeError, match=r"int8"):
        v.assign(300)
    with pytest.raises(TypeError, match=r"delta.*-300"):
        v.assign_add(-300)
    with pytest.raises(TypeError, match=r"delta.*int8"):
        v.assign_sub(np.array(1000, np.int32))
    assert v.numpy() == 1  # unchanged by the refused assigns
    v.assign(np.int64(100))  # fits: converted, as TF converts it
    assert v.numpy() == 100 and v.dtype == np.int8
    v.assign_add(20)
    assert v.numpy() == 120


def test_assign_refuses_other_dtypes_that_tf_refuses():
    v = md.Variable(np.zeros(3, np.int32))
    with pytest.raises(TypeError, match=r"float64.*int32"):
        v.assign(np.array([1.5, 2.0, 3.0]))
    w = md.Variable(np.zeros(3, np.int64))
    with pytest.raises(TypeError, match=r"int64.*int32"):
        v.assign(w)  # a variable (tensor) of another dtype
    f = md.Variable(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"float32"):
        f.assign(np.array([1e300, 0.0]))  # would overflow float32 to inf
    f.assign(np.array([0.5, -2.0]))  # float64 values that fit
    np.testing.assert_array_equal(f.numpy(), [0.5, -2.0])
    f.assign([np.inf, 1.0])
    assert np.isinf(f.numpy()[0])


def test_mirrored_variable_assign_checks_too():
    strategy = _strategy(2)
    with strategy.scope():
        v = md.Variable(np.int8(0))
    with pytest.raises(TypeError, match=r"300.*int8"):
        v.assign(300)
    v.assign(7)
    assert all(c.numpy() == 7 for c in strategy.experimental_local_results(v))


# --- ReductionToOneDevice ----------------------------------------------------------------


def test_reduction_to_an_unavailable_gpu_explains():
    if md.config.list_logical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    strategy = _strategy(2, cross_device_ops=cdo.ReductionToOneDevice("/gpu:3"))
    values = strategy.run(lambda: np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"reduce_to_device is .*GPU:3.*0 GPU\(s\).*'/cpu:0'"):
        strategy.reduce("SUM", values, axis=None)


@pytest.mark.parametrize("fn, what", [(lambda xs: np.stack(xs), r"shape \(2, 3\)"),
                                      (lambda xs: np.add.reduce(xs)[:2], r"shape \(2,\)"),
                                      (lambda xs: np.add.reduce(xs).astype(np.float64), r"shape \(3,\) and dtype float64")])
def test_accumulation_fn_of_the_wrong_shape_or_dtype_is_refused(fn, what):
    strategy = _strategy(2, cross_device_ops=cdo.ReductionToOneDevice(accumulation_fn=fn))
    values = strategy.run(lambda: np.ones(3, np.float32))
    with pytest.raises(ValueError, match=rf"accumulation_fn=.*returned {what}"):
        strategy.reduce("SUM", values, axis=None)


def test_good_accumulation_fn_still_works():
    strategy = _strategy(2, cross_device_ops=cdo.ReductionToOneDevice(accumulation_fn=sum))
    values = strategy.run(lambda: np.ones(3, np.float32))
    np.testing.assert_array_equal(strategy.reduce("MEAN", values, axis=None), [1.0, 1.0, 1.0])
