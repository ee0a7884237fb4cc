"""CrossDeviceOps: the plug-in shape, the built-ins, and property tests against NumPy."""

import os
import runpy

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from mirrored import cross_device_ops as cdo
from conftest import cpus, replica_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recording(cdo.CrossDeviceOps):
    """Counts every hook call and delegates to the native ring."""

    def __init__(self):
        self.inner = cdo.RingAllReduce()
        self.log = []

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.log.append("reduce")
        return self.inner.reduce_implementation(reduce_op, per_replica_value, destinations, options)

    def batch_reduce_implementation(self, reduce_op, pairs, options):
        self.log.append("batch_reduce")
        return self.inner.batch_reduce_implementation(reduce_op, pairs, options)

    def broadcast_implementation(self, tensor, destinations):
        self.log.append("broadcast")
        return self.inner.broadcast_implementation(tensor, destinations)


def test_user_plugin_carries_every_reduction():
    plugin = Recording()
    s = md.MirroredStrategy(cpus(2), cross_device_ops=plugin)
    pr = s.run(lambda: np.float32(replica_id() + 1))
    s.run(lambda: md.get_replica_context().all_reduce("SUM", np.ones(2)))
    assert plugin.log == ["batch_reduce"]
    assert s.reduce("SUM", pr, axis=None) == 3 and plugin.log[-1] == "reduce"
    s.extended.reduce_to("MEAN", pr, destinations=pr)
    s.extended.batch_reduce_to("SUM", [(pr, pr)])
    s.extended.broadcast_to(np.ones(1), destinations=list(s.extended.worker_devices))
    with s.scope():
        v = md.Variable(0.0, aggregation=md.VariableAggregation.SUM)
    s.run(lambda: v.assign_add(np.float32(1.0 + replica_id())))
    assert float(v) == 3.0
    assert plugin.log == ["batch_reduce", "reduce", "reduce", "batch_reduce", "broadcast", "reduce"]


def test_example_fp16_plugin_runs():
    calls, total, w = runpy.run_path(os.path.join(ROOT, "examples", "custom_cross_device_ops.py"))["main"]()
    assert calls == 3
    np.testing.assert_allclose(total, [2.5] * 4)
    np.testing.assert_allclose(w, [-0.0625] * 4, rtol=1e-3)


def test_public_methods_call_hooks_and_handle_single_values():
    ops = Recording()
    dev = "/cpu:0"
    assert ops.reduce("SUM", np.ones(2), destinations=dev).tolist() == [1, 1]  # one value, same device: itself
    assert ops.log == []
    pr = md.PerReplica([np.ones(2), np.ones(2) * 3], ("/cpu:0", "/cpu:1"))
    out = ops.reduce(md.ReduceOp.MEAN, pr, destinations=pr)
    assert isinstance(out, md.Mirrored) and out.values[1].tolist() == [2, 2] and ops.log == ["reduce"]
    assert [r.values[0].tolist() for r in ops.batch_reduce("SUM", [(pr, pr), (pr, pr)])] == [[4, 4], [4, 4]]
    with pytest.raises(ValueError, match="destinations"):
        ops.reduce("SUM", pr, destinations=42)
    with pytest.raises(ValueError, match="empty"):
        ops.reduce("SUM", pr, destinations=[])


def test_base_class_hooks_must_be_implemented():
    pr = md.PerReplica([np.ones(1), np.ones(1)], ("/cpu:0", "/cpu:1"))
    with pytest.raises(NotImplementedError):
        cdo.CrossDeviceOps().reduce("SUM", pr, destinations=pr)


@pytest.mark.parametrize("ops", [cdo.RingAllReduce(), cdo.RingAllReduce(num_packs=0),
                                 cdo.RingAllReduce(bytes_per_pack=64), cdo.HierarchicalCopyAllReduce(num_packs=2),
                                 cdo.ReductionToOneDevice(), cdo.ReductionToOneDevice(reduce_to_device="/cpu:1")])
def test_builtins_agree_with_numpy(ops):
    s = md.MirroredStrategy(cpus(4), cross_device_ops=ops)
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(4)]
    ys = [rng.normal(size=(7,)).astype(np.float32) for _ in range(4)]
    out = s.run(lambda: md.get_replica_context().all_reduce("SUM", (xs[replica_id()], ys[replica_id()])))
    np.testing.assert_allclose(out[0].values[2], sum(xs), rtol=1e-5)
    np.testing.assert_allclose(out[1].values[0], sum(ys), rtol=1e-5)
    np.testing.assert_allclose(s.reduce("MEAN", md.PerReplica(xs), axis=None), np.mean(xs, axis=0), rtol=1e-5)


def test_reduction_to_one_device_honours_accumulation_fn():
    seen = []

    def accumulate(arrays):
        seen.append(len(arrays))
        return np.add.reduce(arrays)
    s = md.MirroredStrategy(cpus(2), cross_device_ops=cdo.ReductionToOneDevice(accumulation_fn=accumulate))
    pr = md.PerReplica([np.array([2.0]), np.array([4.0])])
    assert s.reduce("MEAN", pr, axis=None) == 3.0 and seen == [2]
    with pytest.raises(ValueError, match="SUM and MEAN"):
        s.reduce("MAX", pr, axis=None)


def test_nccl_on_cpu_replicas_names_the_fix():
    s = md.MirroredStrategy(cpus(2), cross_device_ops=cdo.NcclAllReduce())
    with pytest.raises(ValueError, match="RingAllReduce"):
        s.run(lambda: md.get_replica_context().all_reduce("SUM", np.ones(2)))
    assert s.run(replica_id).values == (0, 1)


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="num_packs"):
        cdo.NcclAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="bytes_per_pack"):
        cdo.RingAllReduce(bytes_per_pack=-5)
    with pytest.raises(ValueError, match="cross_device_ops"):
        md.MirroredStrategy(cpus(2), cross_device_ops="ring")
    with pytest.raises(ValueError, match="reduce_to_device"):
        cdo.ReductionToOneDevice(reduce_to_device="/tpu:0")


def test_communication_options_bytes_per_pack_reaches_fusion(two):
    opts = md.CommunicationOptions(bytes_per_pack=8)
    out = two.run(lambda: md.get_replica_context().all_reduce("SUM", [np.ones(5), np.ones(3)], options=opts))
    np.testing.assert_array_equal(out[0].values[1], [2] * 5)
    with pytest.raises(ValueError, match="bytes_per_pack"):
        md.CommunicationOptions(bytes_per_pack=-1)


# --- properties against NumPy ---------------------------------------------------------------------

DTYPES = ["float32", "float64", "int32", "int64", "int8", "uint8", "float16"]
NP_OPS = {"SUM": np.sum, "MAX": np.max, "MIN": np.min, "PROD": np.prod}
_STRATEGIES = {n: md.MirroredStrategy(cpus(n)) for n in (1, 2, 3, 4)}


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([1, 2, 3, 4]), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(["SUM", "MAX", "MIN", "PROD", "MEAN"]),
       shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), seed=st.integers(0, 2**16))
def test_reduce_and_all_reduce_match_numpy(n, dtype, op, shape, seed):
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-3 if np.dtype(dtype).kind != "u" else 0, 4, size=shape).astype(dtype) for _ in range(n)]
    stacked = np.stack(xs)
    # The MEAN of integers over several replicas is float64 (NumPy's and TF's true division);
    # with one replica every op returns the value as it is.
    integer_mean = op == "MEAN" and np.dtype(dtype).kind in "iu" and n > 1
    result_dtype = np.float64 if integer_mean else np.dtype(dtype)
    if op == "MEAN":
        expected = (np.sum(stacked, axis=0, dtype=dtype) / n).astype(result_dtype)
    else:
        expected = NP_OPS[op](stacked, axis=0).astype(dtype)
    s = _STRATEGIES[n]
    got = s.reduce(op, md.PerReplica(xs) if n > 1 else xs[0], axis=None)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expected, np.float64), rtol=1e-3)
    out = s.run(lambda: md.get_replica_context().all_reduce(op, xs[replica_id()]))
    for v in s.experimental_local_results(out):
        assert v.dtype == result_dtype and v.shape == tuple(shape)
        np.testing.assert_allclose(np.asarray(v, np.float64), np.asarray(expected, np.float64), rtol=1e-3)


def test_ring_all_reduce_chunk_bytes_is_honoured_and_validated():
    import numpy as np

    s = md.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"],
                            cross_device_ops=md.cross_device_ops.RingAllReduce(chunk_bytes=8, algorithm="ring"))
    v = s.experimental_distribute_values_from_function(lambda ctx: np.arange(1000.0) + ctx.replica_id_in_sync_group)
    np.testing.assert_array_equal(s.reduce("sum", v, axis=None), 3 * np.arange(1000.0) + 3)
    with pytest.raises(ValueError, match="chunk_bytes"):
        md.cross_device_ops.RingAllReduce(chunk_bytes=-1)
