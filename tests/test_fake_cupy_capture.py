"""The CuPy stand-in (fake_cupy.py) keeps CuPy 14's rules for a capturing stream, so that a step that
cannot be captured on a GPU cannot be captured on the simulator either: every host-to-device copy on a
capturing stream is refused (cupy.array/asarray of host data, ndarray.set, arange, and the pointer table
that concatenate and stack upload when they copy many small arrays in one kernel). Both sides of each
rule are checked: refused while capturing, fine otherwise."""

import contextlib

import numpy as np
import pytest

from gpu_env import SIMULATED, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
if not SIMULATED:
    pytest.skip("checks of the CuPy stand-in; this machine has real CuPy", allow_module_level=True)

REFUSAL = "the current stream is capturing, so H2D transfers are disallowed"
HOST = np.arange(6, dtype=np.float32)


@contextlib.contextmanager
def captured(graphs: list):
    """A capture on a stream of GPU 0 of its own, with memory from a graph-private pool (as md.function
    captures); the graph is appended to ``graphs`` at the end."""
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            with stream, cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc):
                yield stream
        finally:
            graphs.append(stream.end_capture())


def replayed(graph, *arrays) -> list:
    with cupy.cuda.Device(0):
        graph.launch()
        return [cupy.asnumpy(a) for a in arrays]


UPLOADS = {
    "asarray": lambda: cupy.asarray(HOST),
    "array": lambda: cupy.array(HOST.tolist(), dtype=np.float32),
    "arange": lambda: cupy.arange(6, dtype=np.float32),
    "set": lambda: _set(cupy.empty(6, np.float32)),
}


def _set(target):
    target.set(HOST)
    return target


@pytest.mark.parametrize("upload", sorted(UPLOADS))
def test_a_host_to_device_copy_is_refused_while_the_current_stream_captures(upload):
    graphs = []
    with captured(graphs), pytest.raises(RuntimeError, match=REFUSAL):
        UPLOADS[upload]()


@pytest.mark.parametrize("upload", sorted(UPLOADS))
def test_a_host_to_device_copy_outside_a_capture_is_queued_as_usual(upload):
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            got = UPLOADS[upload]()
        np.testing.assert_array_equal(cupy.asnumpy(got, stream=stream), HOST)


def test_copy_from_host_async_is_refused_on_a_capturing_stream_and_allowed_on_another():
    graphs = []
    with cupy.cuda.Device(0):
        target = cupy.zeros(6, np.float32)
        other = cupy.cuda.Stream(non_blocking=True)
    with captured(graphs) as stream:
        with pytest.raises(RuntimeError, match=REFUSAL):
            target.data.copy_from_host_async(HOST.ctypes.data, HOST.nbytes, stream)
        target.data.copy_from_host_async(HOST.ctypes.data, HOST.nbytes, other)  # not capturing: queued
    other.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(target), HOST)


def _parts(n: int, size: int = 3, dtype=np.float32) -> list:
    with cupy.cuda.Device(0):
        return [cupy.full(size, k, dtype) for k in range(n)]


def _expected(parts) -> np.ndarray:
    return np.concatenate([cupy.asnumpy(p) for p in parts])


@pytest.mark.parametrize("join", ["concatenate", "concatenate_out", "ravel", "stack"])
def test_more_than_8_small_arrays_of_one_dtype_upload_a_pointer_table_refused_while_capturing(join):
    parts = _parts(9)
    with cupy.cuda.Device(0):
        out = cupy.empty(27, np.float32)
    calls = {"concatenate": lambda: cupy.concatenate(parts),
             "concatenate_out": lambda: cupy.concatenate(parts, out=out),
             "ravel": lambda: cupy.concatenate([p.reshape(3, 1) for p in parts], axis=None),
             "stack": lambda: cupy.stack(parts)}
    graphs = []
    with captured(graphs), pytest.raises(RuntimeError, match=REFUSAL):
        calls[join]()
    with cupy.cuda.Device(0):  # outside a capture the same call is fine
        np.testing.assert_array_equal(cupy.asnumpy(calls[join]()).ravel(), _expected(parts))


@pytest.mark.parametrize("case", ["8 arrays", "mixed dtypes", "other out dtype", "large arrays"])
def test_concatenations_copied_array_by_array_capture(case):
    """CuPy copies array by array (no table) with at most 8 arrays, arrays of another dtype than the
    result, or arrays of 2 MiB or more on average: such a concatenation captures and replays."""
    if case == "8 arrays":
        parts, dtype = _parts(8), None
    elif case == "mixed dtypes":
        parts, dtype = _parts(8) + _parts(1, dtype=np.float64), None
    elif case == "other out dtype":
        parts, dtype = _parts(9), np.float64
    else:
        parts, dtype = _parts(9, size=(2 << 20) // 4), None
    expected = _expected(parts)
    with cupy.cuda.Device(0):
        out = cupy.empty(expected.size, dtype or expected.dtype)
    graphs = []
    with captured(graphs):
        cupy.concatenate(parts, out=out)
    with cupy.cuda.Device(0):
        out.fill(-1)
    np.testing.assert_array_equal(replayed(graphs[0], out)[0], expected.astype(out.dtype))


def test_stack_of_few_arrays_captures():
    parts = _parts(2)
    graphs = []
    with captured(graphs):
        stacked = cupy.stack(parts, axis=1)
    np.testing.assert_array_equal(replayed(graphs[0], stacked)[0], np.stack([cupy.asnumpy(p) for p in parts], 1))


def test_the_single_kernel_concatenation_takes_arrays_of_the_current_device_only():
    parts = _parts(8)
    with cupy.cuda.Device(1):
        parts.append(cupy.zeros(3, np.float32))
    with cupy.cuda.Device(0), pytest.raises(ValueError, match="Array device must be same as the current device"):
        cupy.concatenate(parts)
