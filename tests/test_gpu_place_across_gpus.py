"""device_util.place of a CuPy array onto another GPU: a copy (not a kernel reading the other GPU's
memory), so it needs no peer access, keeps the values of contiguous and strided arrays of every
dtype, and is ordered with the work that writes the source and with the source's reuse. On two
simulated GPUs without peer access (the stand-in refuses a kernel that reads across them), or on
two real GPUs."""

import numpy as np
import pytest

import gpu_env
from gpu_env import NGPU, SIMULATED, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
if NGPU < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)

from mirrored.device import device_util  # noqa: E402

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_]


@pytest.fixture(params=[0, 1, 2], ids=lambda s: f"seed{s}")
def no_peer_access(request):
    """Two GPUs with no peer access between them, kernels drained in a seeded random order."""
    if SIMULATED:
        cupy.configure(2, [], request.param)
        try:
            yield
        finally:
            cupy.configure(gpu_env.SIM_DEVICES, gpu_env.SIM_PEERS, 0)
    else:
        yield


def _source(host, ordinal: int, view):
    """``host`` written on GPU ``ordinal`` by a kernel (so the copy must wait for it), then viewed."""
    with cupy.cuda.Device(ordinal):
        a = cupy.asarray(np.zeros_like(host))
        a += cupy.asarray(host)
        return view(a)


VIEWS = {
    "contiguous": lambda a: a,
    "transposed": lambda a: a.T,
    "every_other_row": lambda a: a[::2],
    "reversed_columns": lambda a: a[:, ::-1],
    "empty": lambda a: a[:0],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("source,target", [(1, 0), (0, 1)])
def test_an_array_placed_on_another_gpu_keeps_its_values(no_peer_access, dtype, view, source, target):
    host = (np.arange(6 * 5).reshape(6, 5) % 7).astype(dtype)
    x = _source(host, source, VIEWS[view])
    y = device_util.place(x, f"/gpu:{target}")
    assert y.data.device_id == target
    assert y.shape == x.shape and y.dtype == x.dtype
    with cupy.cuda.Device(target):
        got = cupy.asnumpy(y)
    np.testing.assert_array_equal(got, VIEWS[view](host))


def test_the_source_may_be_overwritten_and_dropped_right_after(no_peer_access):
    """The copy reads the source before later work on the source's GPU writes it or reuses its memory."""
    host = np.arange(1 << 12, dtype=np.float32)
    copies = []
    for step in range(8):
        x = _source(host + step, 1, VIEWS["contiguous"])
        copies.append(device_util.place(x, "/gpu:0"))
        with cupy.cuda.Device(1):
            x.fill(-1)  # queued on GPU 1 after the copy was
        del x  # its memory goes back to GPU 1's pool
        with cupy.cuda.Device(1):
            cupy.full(1 << 12, -2, np.float32)  # and may be handed out again at once
    with cupy.cuda.Device(0):
        for step, y in enumerate(copies):
            np.testing.assert_array_equal(cupy.asnumpy(y), host + step)
