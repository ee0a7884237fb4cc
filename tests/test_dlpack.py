"""Arrays of other libraries in and out of the collectives without copies: DLPack (NumPy's own, a
minimal producer, PyTorch CPU tensors when torch is installed), ``__cuda_array_interface__`` (refused
clearly among host arrays) and the buffer protocol (memoryview, bytearray, array.array)."""

import array
import importlib.util
import pathlib

import numpy as np
import pytest

import mirrored as md
from mirrored import collectives, device_util

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


class DLPackOnly:
    """A producer that offers nothing but DLPack (wrapping a NumPy array)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class CudaInterfaceOnly:
    """A stand-in for a GPU array: it exposes only __cuda_array_interface__ (over host memory here)."""

    def __init__(self, array):
        self.array = array

    @property
    def __cuda_array_interface__(self):
        return dict(self.array.__array_interface__, version=3)


def _inputs(n=2, size=5, dtype=np.float32):
    return [np.arange(size, dtype=dtype) * (r + 1) for r in range(n)]


def test_out_takes_numpy_dlpack_views_and_writes_them_in_place():
    xs = _inputs()
    targets = [np.zeros(5, np.float32), np.zeros(5, np.float32)]
    out = [np.from_dlpack(t) for t in targets]  # NumPy's own __dlpack__
    assert collectives.all_reduce(xs, "sum", out=out) == out
    for t in targets:
        np.testing.assert_array_equal(t, np.arange(5) * 3)


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "reduce"])
def test_out_takes_a_dlpack_only_producer(collective):
    xs = _inputs(3)
    targets = [np.full(5, -1.0, np.float32) for _ in xs]
    out = [DLPackOnly(t) for t in targets]
    if collective == "all_reduce":
        result = collectives.all_reduce(xs, "max", out=out)
        assert result == out
        expected = [xs[2]] * 3
    elif collective == "broadcast":
        assert collectives.broadcast(xs, root=1, out=out) == out
        expected = [xs[1]] * 3
    else:
        assert collectives.reduce(xs, "sum", root=2, out=out) is out[2]
        expected = [np.full(5, -1.0), np.full(5, -1.0), xs[0] + xs[1] + xs[2]]
    for t, e in zip(targets, expected):
        np.testing.assert_array_equal(t, e)


def test_dlpack_only_inputs_in_place():
    targets = _inputs(2, dtype=np.int64)
    wrapped = [DLPackOnly(t) for t in targets]
    collectives.all_reduce(wrapped, "sum", out=wrapped)
    for t in targets:
        np.testing.assert_array_equal(t, np.arange(5) * 3)


@pytest.mark.parametrize("make", [lambda: array.array("f", [0.0] * 5),
                                  lambda: memoryview(bytearray(20)).cast("f"),
                                  lambda: np.zeros(5, np.float32).data])
def test_out_takes_buffer_protocol_objects(make):
    xs = _inputs()
    out = [make(), make()]
    assert collectives.all_reduce(xs, "sum", out=out) == out
    for o in out:
        np.testing.assert_array_equal(np.asarray(o), np.arange(5) * 3)


def test_bytearray_out_holds_uint8_buffers():
    xs = [np.array([1, 2, 3], np.uint8), np.array([10, 20, 30], np.uint8)]
    out = [bytearray(3), bytearray(3)]
    collectives.all_reduce(xs, "sum", out=out)
    assert out == [bytearray([11, 22, 33])] * 2


def test_out_that_cannot_be_written_in_place_is_refused():
    xs = _inputs()
    with pytest.raises(TypeError, match=r"out\[0\] is list; out must hold arrays the collective can write in place"):
        collectives.all_reduce(xs, "sum", out=[[0.0] * 5, np.zeros(5, np.float32)])
    with pytest.raises(ValueError, match=r"out\[1\] is read-only"):
        collectives.all_reduce(xs, "sum", out=[np.zeros(5, np.float32), memoryview(bytes(20)).cast("f")])
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(20,\) and dtype uint8"):
        collectives.all_reduce(xs, "sum", out=[bytearray(20), bytearray(20)])


def test_cuda_array_interface_outputs_for_host_buffers_are_refused():
    xs = _inputs()
    with pytest.raises(TypeError, match=r"out\[1\] is a GPU array but buffers\[0\] is a host array"):
        collectives.all_reduce(xs, "sum", out=[np.zeros(5, np.float32), CudaInterfaceOnly(np.zeros(5, np.float32))])
    with pytest.raises(TypeError, match=r"buffers\[1\] is a GPU array but buffers\[0\] is a host array"):
        collectives.all_reduce([xs[0], CudaInterfaceOnly(xs[1])], "sum")


def test_cuda_array_interface_buffers_go_to_the_gpu_engine():
    if md.config.list_logical_devices("GPU"):
        pytest.skip("this machine has a GPU: the GPU tests cover it")
    wrapped = [CudaInterfaceOnly(x) for x in _inputs()]
    with pytest.raises(RuntimeError, match=r"CuPy|CUDA"):
        collectives.all_reduce(wrapped, "sum", out=wrapped)


def test_integer_mean_into_dlpack_and_buffer_outputs():
    xs = [np.array([1, 2], np.int32), np.array([2, 2], np.int32)]
    targets = [np.zeros(2), np.zeros(2)]
    collectives.all_reduce(xs, "mean", out=[DLPackOnly(targets[0]), array.array("d", [0.0, 0.0])])
    np.testing.assert_array_equal(targets[0], [1.5, 2.0])


def _strategy(n=2):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])


@needs_torch
def test_placing_a_tensor_on_a_cpu_replica_shares_its_memory():
    t = torch.arange(6, dtype=torch.float32)
    placed = device_util.place(t, "/cpu:0")
    assert isinstance(placed, np.ndarray)
    assert np.shares_memory(placed, t.numpy())
    back = torch.from_dlpack(placed)  # and back to torch, still the same memory
    assert back.data_ptr() == t.data_ptr()


@needs_torch
def test_collectives_read_tensors_in_place():
    a, b = torch.ones(5, dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64)
    out = md.collectives.all_reduce([a, b], "sum")
    np.testing.assert_array_equal(out[0], np.full(5, 3.0))
    np.testing.assert_array_equal(a.numpy(), np.ones(5))  # inputs untouched


@needs_torch
def test_replica_all_reduce_and_strategy_reduce_take_tensors():
    strategy = _strategy(2)

    def fn():
        rid = md.get_replica_context().replica_id_in_sync_group
        t = torch.full((3,), float(rid + 1))
        return md.get_replica_context().all_reduce("sum", t), t

    summed, tensors = strategy.run(fn)
    for local in strategy.experimental_local_results(summed):
        np.testing.assert_array_equal(np.asarray(local), [3.0, 3.0, 3.0])
    mean = strategy.reduce("MEAN", tensors, axis=None)
    assert isinstance(mean, np.ndarray)
    np.testing.assert_array_equal(mean, [1.5, 1.5, 1.5])
    np.testing.assert_array_equal(strategy.reduce("SUM", tensors, axis=0), 9.0)


@needs_torch
def test_bfloat16_tensors_through_the_strategy():
    """replica all_reduce and strategy.reduce read bfloat16 tensors by DLPack (torch has no NumPy bf16)."""
    import ml_dtypes

    strategy = _strategy(2)

    def fn():
        rid = md.get_replica_context().replica_id_in_sync_group
        t = torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16) * (rid + 1)
        return md.get_replica_context().all_reduce("sum", t), t

    summed, tensors = strategy.run(fn)
    for local in strategy.experimental_local_results(summed):
        assert np.asarray(local).dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(np.asarray(local).astype(np.float32), [3.0, 7.5, -9.0])
    total = strategy.reduce("SUM", tensors, axis=None)
    np.testing.assert_array_equal(np.asarray(total).astype(np.float32), [3.0, 7.5, -9.0])


@needs_torch
def test_torch_gradients_train_a_mirrored_variable():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlpack_torch.py"
    spec = importlib.util.spec_from_file_location("dlpack_torch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--replicas", "2", "--steps", "120"]) < 0.02


@needs_torch
@pytest.mark.parametrize("algorithm", ["direct", "ring", "tree"])
def test_all_reduce_writes_torch_tensors_in_place(algorithm):
    tensors = [torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(3)]
    pointers = [t.data_ptr() for t in tensors]
    result = md.collectives.all_reduce(tensors, "sum", out=tensors, algorithm=algorithm)
    assert all(r is t for r, t in zip(result, tensors))
    assert [t.data_ptr() for t in tensors] == pointers
    for t in tensors:
        assert torch.equal(t, torch.arange(6, dtype=torch.float32) * 6)


@needs_torch
def test_torch_outputs_of_numpy_inputs_and_strided_tensors():
    xs = [np.ones((2, 3), np.float64), np.full((2, 3), 2.0)]
    out = [torch.empty(2, 3, dtype=torch.float64), torch.empty(3, 2, dtype=torch.float64).t()]  # one transposed
    md.collectives.all_reduce(xs, "sum", out=out)
    for o in out:
        assert torch.equal(o, torch.full((2, 3), 3.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(2, 3\) and dtype float32"):
        md.collectives.all_reduce(xs, "sum", out=[torch.empty(2, 3), torch.empty(2, 3)])


@needs_torch
def test_bfloat16_tensors_by_dlpack():
    pytest.importorskip("ml_dtypes")
    tensors = [torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16) * (r + 1) for r in range(2)]
    expected = tensors[0].float() + tensors[1].float()
    out = [torch.empty(3, dtype=torch.bfloat16) for _ in tensors]
    md.collectives.all_reduce(tensors, "sum", out=out)
    for o in out:
        assert o.dtype == torch.bfloat16
        assert torch.equal(o.float(), expected)
    md.collectives.all_reduce(tensors, "max", out=tensors)  # in place
    for t in tensors:
        assert torch.equal(t.float(), torch.tensor([2.0, 5.0, -3.0]))
    gathered = md.collectives.all_gather([torch.ones(2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)])
    np.testing.assert_array_equal(gathered[0].astype(np.float32), [1.0, 1.0, 0.0])
    # strided bfloat16 (every other element of a longer tensor)
    wide = [torch.arange(8, dtype=torch.bfloat16)[::2] for _ in range(2)]
    np.testing.assert_array_equal(md.collectives.all_reduce(wide, "sum")[0].astype(np.float32), [0, 4, 8, 12])


@needs_torch
def test_a_tensor_that_cannot_export_dlpack_is_named():
    t = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"buffers\[0\]: cannot read this DLPack tensor"):
        md.collectives.all_reduce([t, t], "sum")


@needs_torch
def test_a_dtype_dlpack_cannot_carry_to_numpy_is_refused_with_the_reason():
    t = torch.zeros(3, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"buffers\[0\]: cannot read this DLPack tensor on the host \(.*dtype"):
        md.collectives.all_reduce([t, t], "sum")
    with pytest.raises(TypeError, match=r"out\[1\]: cannot read this DLPack tensor"):
        md.collectives.all_reduce([torch.ones(3), torch.ones(3)], "sum", out=[torch.zeros(3), t])
