"""CuPy's own rules that mirrored's GPU path relies on, pinned where the stand-in (fake_cupy.py) must keep
them: the same assertions run against real CuPy on a GPU machine (gpu_env.py), so a run there checks the
stand-in's fidelity too. Sources: cupy/cuda/device.pyx (``Device.__enter__/__exit__``: one stack per thread),
stream.pyx (``get_current_stream``, ``Event.record``), _core/core.pyx (``ndarray.set``, a view's ``base``), memory.pyx
(``copy_from_device_async``), cupy/cuda/__init__.py (``using_allocator``)."""

import numpy as np
import pytest

from gpu_env import NGPU, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

two_gpus = pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")


@two_gpus
def test_device_exits_pop_the_threads_latest_entry_whichever_device_object_exits():
    # CuPy keeps one `with Device` stack per thread, not one per object: blocks that interleave on one
    # thread (replicas sharing it as greenlets) unwind to each other's devices.
    runtime = cupy.cuda.runtime
    runtime.setDevice(0)
    first, second = cupy.cuda.Device(1), cupy.cuda.Device(0)
    first.__enter__()  # pushes 0, makes 1 current
    second.__enter__()  # pushes 1, makes 0 current
    first.__exit__(None, None, None)  # pops the latest entry: 1
    assert runtime.getDevice() == 1
    second.__exit__(None, None, None)
    assert runtime.getDevice() == 0


def test_device_use_returns_the_device_and_a_with_block_restores_the_device():
    with cupy.cuda.Device(NGPU - 1) as device:
        assert device.use() is device
        assert cupy.cuda.runtime.getDevice() == NGPU - 1
    assert cupy.cuda.runtime.getDevice() == 0


def test_get_current_stream_of_minus_one_is_the_current_gpus_and_other_ordinals_are_refused():
    stream = cupy.cuda.Stream()
    with stream:
        assert cupy.cuda.get_current_stream(-1) == stream
        assert cupy.cuda.get_current_stream() == stream
        assert cupy.cuda.get_current_stream(0) == stream
    with pytest.raises(IndexError):
        cupy.cuda.get_current_stream(cupy.cuda.runtime.getDeviceCount())


@two_gpus
def test_an_event_records_on_the_current_gpus_streams():
    with cupy.cuda.Device(1):
        stream = cupy.cuda.Stream()
        with stream:
            event = cupy.cuda.Event()
        event.record(stream)
    with cupy.cuda.Device(1):
        event.record()  # the current GPU's current stream
        event.record(cupy.cuda.Stream.null)
    # Stream.null is the current GPU's legacy stream: GPU 0's, where GPU 1's event cannot be recorded.
    with pytest.raises(RuntimeError):
        event.record(cupy.cuda.Stream.null)
    with pytest.raises(RuntimeError):
        event.record()
    cupy.cuda.Stream.null.wait_event(event)  # (a wait may cross GPUs)


@pytest.mark.parametrize("bad, error", [
    (np.zeros(4, np.float64), TypeError),  # another dtype: no cast
    (np.zeros(5, np.float32), ValueError),  # another shape, even of as many bytes or fewer
    (np.zeros((2, 2), np.float32), ValueError),
    ([0.0] * 4, TypeError),  # not a NumPy array
])
def test_ndarray_set_takes_a_numpy_array_of_its_dtype_and_shape_only(bad, error):
    out = cupy.zeros(4, cupy.float32)
    with pytest.raises(error):
        out.set(bad)
    out.set(np.arange(4, dtype=np.float32)[::-1].copy())
    np.testing.assert_array_equal(out.get(), [3, 2, 1, 0])


@two_gpus
def test_ndarray_set_copies_with_the_arrays_gpu_current():
    with cupy.cuda.Device(1):
        out = cupy.zeros(3, cupy.int32)
        stream = cupy.cuda.Stream()
    out.set(np.arange(3, dtype=np.int32), stream=stream)  # (GPU 0 current)
    stream.synchronize()
    np.testing.assert_array_equal(out.get(), [0, 1, 2])
    assert cupy.cuda.runtime.getDevice() == 0


def test_copy_from_device_async_takes_a_memory_pointer():
    src, dst = cupy.arange(4, dtype=cupy.float32), cupy.zeros(4, cupy.float32)
    with pytest.raises(TypeError):
        dst.data.copy_from_device_async(src.data.ptr, src.nbytes)
    dst.data.copy_from_device_async(src.data, src.nbytes)
    np.testing.assert_array_equal(dst.get(), [0, 1, 2, 3])


def test_a_view_holds_the_array_that_owns_its_memory():
    # _core/core.pyx ``_view``: ``v.base = self.base if self.base is not None else self``. Copy-on-write (a
    # variable's buffer, CentralStorageStrategy's copies on the replicas' GPUs) counts these references: an
    # array derived from a read holds the buffer itself, however many views it was made through.
    a = cupy.arange(6, dtype=cupy.float32)
    assert a.base is None and a.copy().base is None and a[1:4].copy().base is None
    for view in (a[1:4], a[1:4][::2], a.reshape(2, 3).T, a.view(cupy.int32), a[1:4].reshape(3, 1)):
        assert view.base is a


def test_using_allocator_puts_back_the_allocator_of_its_enter_and_is_entered_once():
    pool = cupy.cuda.MemoryPool()
    context = cupy.cuda.using_allocator(pool.malloc)
    with context:
        cupy.zeros(1000, cupy.float32)
        assert pool.used_bytes() > 0 or pool.total_bytes() > 0
    with pytest.raises((AttributeError, RuntimeError, TypeError)):
        with context:
            pass
