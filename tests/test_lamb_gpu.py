"""Lamb's fused update on GPUs (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

The CUDA kernels (csrc/cuda/fused_update.cu over csrc/core/lamb.h: lanes, groups, ratios, apply) against the
host kernel bit for bit (which tests/test_fused_update_lamb.py holds to rules.lamb): every size around a lane
block's edge, several variables per table, weight decay on some, IndexedSlices' squares, the scalars read
from device memory; a loss-scaled step decided on the device (skipped, unscaled) and captured by md.function
as the eager steps. (Its launches per step: tests/test_optimizer_gpu.py.)
"""

import numpy as np
import pytest

from gpu_env import NGPU, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from mirrored._core import fused_update as host_fused_update  # noqa: E402
from mirrored.train.optimizers import rules  # noqa: E402
from test_fused_update_lamb import LANES, SIZES, _state, coefficients  # noqa: E402
from test_optimizer_gpu import _table  # noqa: E402


def _on_gpu(weights, slots, decay):
    gpu_weights = [cupy.asarray(w) for w in weights]
    gpu_slots = [[cupy.asarray(s) for s in ss] for ss in slots]
    return gpu_weights, gpu_slots, _table(NGPU - 1, gpu_weights, gpu_slots, decay)


def _assert_same_bits(gpu_weights, gpu_slots, weights, slots):
    for k, w in enumerate(weights):
        np.testing.assert_array_equal(cupy.asnumpy(gpu_weights[k]), w, err_msg=f"weight {k} (size {w.size})")
        for j in range(2):
            np.testing.assert_array_equal(cupy.asnumpy(gpu_slots[k][j]), slots[k][j], err_msg=f"slot {j} of {k}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sizes", [[n] for n in SIZES if n] + [SIZES, [5, 0, LANES + 3, 64, 65]],
                         ids=lambda sizes: "+".join(map(str, sizes)))
def test_gpu_kernels_equal_the_host_kernel_bit_for_bit(sizes, dtype):
    """Three steps, the packed gradients in a new buffer at each (the table follows it)."""
    rng = np.random.default_rng(len(sizes) + sizes[0])
    weights, slots = _state(rng, dtype, sizes)
    decay = [k % 2 == 1 or len(sizes) == 1 for k in range(len(sizes))]
    wd = float(np.dtype(dtype).type(0.05))
    with cupy.cuda.Device(NGPU - 1):
        gpu_weights, gpu_slots, table = _on_gpu(weights, slots, decay)
        stream = cupy.cuda.get_current_stream().ptr
        for step in range(1, 4):
            c = [float(x) for x in coefficients(dtype, step)]
            grads = [rng.normal(size=n).astype(dtype) for n in sizes]
            host_fused_update(rules.LAMB, weights, grads, slots, decay, c, wd, c[2])
            packed = cupy.asarray(np.concatenate(grads))
            table.apply(rules.LAMB, packed.data.ptr, c, wd, c[2], stream)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squares_and_scalars_from_device_memory(dtype):
    """IndexedSlices' squares in place of g * g (the host kernel's `squares`), then a step whose scalars the
    kernels read from a device buffer when they run (a captured or device-selected step's way)."""
    rng = np.random.default_rng(8)
    sizes = [LANES + 9, 12, 0, 7]
    weights, slots = _state(rng, dtype, sizes)
    decay = [True, False, False, True]
    wd = float(np.dtype(dtype).type(0.01))
    with cupy.cuda.Device(NGPU - 1):
        gpu_weights, gpu_slots, table = _on_gpu(weights, slots, decay)
        stream = cupy.cuda.get_current_stream().ptr
        c = [float(x) for x in coefficients(dtype, 2)]
        a = [rng.normal(size=n).astype(dtype) for n in sizes]
        b = [rng.normal(size=n).astype(dtype) for n in sizes]
        grads, squares = [x + y for x, y in zip(a, b)], [x * x + y * y for x, y in zip(a, b)]
        host_fused_update(rules.LAMB, weights, grads, slots, decay, c, wd, c[2], squares)
        packed, packed_squares = cupy.asarray(np.concatenate(grads)), cupy.asarray(np.concatenate(squares))
        table.apply(rules.LAMB, packed.data.ptr, c, wd, c[2], stream, squares=packed_squares.data.ptr)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)

        c = [float(x) for x in coefficients(dtype, 3)]
        grads = [rng.normal(size=n).astype(dtype) for n in sizes]
        host_fused_update(rules.LAMB, weights, grads, slots, decay, c, wd, c[2])
        scalars = cupy.asarray(np.array(c + [wd, c[2]], dtype))
        packed = cupy.asarray(np.concatenate(grads))
        table.apply_from_device(rules.LAMB, packed.data.ptr, scalars.data.ptr, len(c), stream)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)


def test_the_gate_skips_every_phase_and_unscales_the_gradients():
    """A non-finite step (the gate's flag set) writes nothing; a finite one divides each gradient by the
    scale first, in the variable's dtype, as the host's grad / scale."""
    rng = np.random.default_rng(4)
    sizes = [LANES + 1, 9]
    weights, slots = _state(rng, np.float32, sizes)
    with cupy.cuda.Device(NGPU - 1):
        gpu_weights, gpu_slots, table = _on_gpu(weights, slots, [True, False])
        stream = cupy.cuda.get_current_stream().ptr
        nonfinite, scale = cupy.asarray(np.array([1], np.int32)), cupy.asarray(np.array([1024.0], np.float32))
        c = [float(x) for x in coefficients(np.float32, 1)]
        grads = [rng.normal(size=n).astype(np.float32) * 1024 for n in sizes]
        packed = cupy.asarray(np.concatenate(grads))
        table.apply(rules.LAMB, packed.data.ptr, c, 0.01, c[2], stream, nonfinite.data.ptr, scale.data.ptr)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)  # skipped: the state as it was
        nonfinite[...] = 0
        table.apply(rules.LAMB, packed.data.ptr, c, 0.01, c[2], stream, nonfinite.data.ptr, scale.data.ptr)
        host_fused_update(rules.LAMB, weights, [g / np.float32(1024) for g in grads], slots, [True, False], c,
                          0.01, c[2])
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)


@pytest.mark.parametrize("mode", ["device", "captured"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_loss_scaled_lamb_step_on_the_device_gives_the_host_decided_bits(replicas, mode, monkeypatch):
    """LossScaleOptimizer(Lamb) on GPU replicas: inf and nan steps skipped on the device, the scale halved and
    grown, the step's scalars selected by the device from its own count; eagerly and replayed by md.function,
    the bits of the step the host decides."""
    from test_mixed_precision_device import _assert_same, _train

    host = _train(monkeypatch, replicas, "lamb", mode="host")
    _assert_same(_train(monkeypatch, replicas, "lamb", mode=mode), host)
    assert host[1][-1][2] == 8  # (two of ten steps skipped)
