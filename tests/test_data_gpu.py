"""InputOptions(experimental_fetch_to_device=True) on GPU replicas: every step's batches arrive on the replicas'
devices, correct, copied ahead in the background (marker ``gpu``: on the simulated GPUs without a GPU, see
gpu_env.py)."""

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy, gpu_pair

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402


@pytest.fixture(params=["logical", "physical"])
def two_gpus(request):
    """Two replicas: on one GPU (two logical GPUs), or on two GPUs."""
    with gpu_pair(request.param):
        yield md.MirroredStrategy(["/gpu:0", "/gpu:1"])


def test_batches_are_fetched_onto_the_replicas_devices(two_gpus):
    x = np.arange(60, dtype=np.float32).reshape(30, 2)
    ds = md.data.Dataset.from_tensor_slices({"x": x, "i": np.arange(30)}).batch(8).prefetch(2)
    seen = []
    for step in two_gpus.experimental_distribute_dataset(ds):
        parts = two_gpus.experimental_local_results(step["x"])
        assert all(isinstance(p, cupy.ndarray) for p in parts)
        seen.append(np.concatenate([cupy.asnumpy(p) for p in parts]))
    np.testing.assert_array_equal(np.concatenate(seen), x)


def test_fetch_to_device_false_keeps_host_batches(two_gpus):
    ds = md.data.Dataset.range(8).batch(4)
    options = md.InputOptions(experimental_fetch_to_device=False)
    step = next(iter(two_gpus.experimental_distribute_dataset(ds, options)))
    assert all(isinstance(p, np.ndarray) for p in two_gpus.experimental_local_results(step))


def test_a_restored_gpu_iterator_continues_after_the_save(two_gpus, tmp_path):
    def make():
        return two_gpus.experimental_distribute_dataset(
            md.data.Dataset.range(40).shuffle(40, seed=2).batch(4).prefetch(2))

    expected = [np.concatenate([cupy.asnumpy(p) for p in two_gpus.experimental_local_results(s)]).tolist()
                for s in make()]
    it = iter(make())
    for _ in range(3):
        next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "c"))
    restored = iter(make())
    md.train.Checkpoint(iterator=restored).restore(path)
    got = [np.concatenate([cupy.asnumpy(p) for p in two_gpus.experimental_local_results(s)]).tolist()
           for s in restored]
    assert got == expected[3:]


def test_a_pipeline_over_device_arrays_stays_on_the_device(two_gpus):
    x = cupy.asarray(np.arange(24, dtype=np.float32).reshape(12, 2))
    ds = md.data.Dataset.from_tensor_slices((x, np.arange(12))).shuffle(12, seed=1).batch(4)
    batches = list(ds)
    assert all(isinstance(xb, cupy.ndarray) and xb.shape == (4, 2) for xb, _ in batches)
    for xb, yb in batches:
        np.testing.assert_array_equal(cupy.asnumpy(xb)[:, 0], 2 * yb)
    assert [b.shape for b in md.data.Dataset.from_tensor_slices(x).batch(5)] == [(5, 2), (5, 2), (2, 2)]
    assert [type(b) for b in md.data.Dataset.from_tensor_slices(x).take(3).batch(3).as_numpy_iterator()] \
        == [np.ndarray]


def test_device_elements_in_a_saved_buffer_come_back_on_their_gpu(two_gpus, tmp_path):
    def make():
        return (md.data.Dataset.range(12).map(lambda i: cupy.full((2,), float(i), cupy.float32))
                .shuffle(6, seed=3).batch(4))

    expected = [cupy.asnumpy(b).tolist() for b in make()]
    it = iter(make())
    next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "c"))
    restored = iter(make())
    md.train.Checkpoint(iterator=restored).restore(path)
    rest = list(restored)
    assert all(isinstance(b, cupy.ndarray) for b in rest)
    assert [cupy.asnumpy(b).tolist() for b in rest] == expected[1:]


def test_string_components_stay_on_the_host_with_every_byte(two_gpus):
    """TF keeps string tensors on the host; a batch of records ending in NUL bytes arrives whole."""
    records = [b"a\x00", b"b", b"\x00", b"", b"c\x00\x00", b"d"]
    ds = md.data.Dataset.from_tensor_slices({"r": records, "x": np.arange(6, dtype=np.float32)}).batch(4)
    strings, numbers = [], []
    for step in two_gpus.experimental_distribute_dataset(ds):
        for r, x in zip(two_gpus.experimental_local_results(step["r"]), two_gpus.experimental_local_results(step["x"])):
            assert isinstance(r, np.ndarray) and r.dtype == object and isinstance(x, cupy.ndarray)
            strings += [bytes(s) for s in r]
            numbers += cupy.asnumpy(x).tolist()
    assert strings == records and numbers == list(range(6))
