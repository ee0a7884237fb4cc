"""PyTorch CPU tensors go into run / reduce / all_reduce through DLPack, without copies."""

import importlib.util
import pathlib

import numpy as np
import pytest

import mirrored as md
from mirrored import device_util

torch = pytest.importorskip("torch")


def _strategy(n=2):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])


def test_placing_a_tensor_on_a_cpu_replica_shares_its_memory():
    t = torch.arange(6, dtype=torch.float32)
    placed = device_util.place(t, "/cpu:0")
    assert isinstance(placed, np.ndarray)
    assert np.shares_memory(placed, t.numpy())
    back = torch.from_dlpack(placed)  # and back to torch, still the same memory
    assert back.data_ptr() == t.data_ptr()


def test_collectives_read_tensors_in_place():
    a, b = torch.ones(5, dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64)
    out = md.collectives.all_reduce([a, b], "sum")
    np.testing.assert_array_equal(out[0], np.full(5, 3.0))
    np.testing.assert_array_equal(a.numpy(), np.ones(5))  # inputs untouched


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


def test_torch_gradients_train_a_mirrored_variable():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlpack_torch.py"
    spec = importlib.util.spec_from_file_location("dlpack_torch", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--replicas", "2", "--steps", "120"]) < 0.02
