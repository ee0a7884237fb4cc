"""Adafactor's fused GPU update (csrc/cuda/fused_adafactor.cu; marker ``gpu``: on the simulated GPUs without a
GPU, see gpu_env.py) against the host kernel bit for bit: eager, with the scalars read from device memory, under
md.function, loss-scaled (the gate's skip and unscale), with IndexedSlices' squares; and its cost, a fixed number
of launches per GPU whatever the number of variables.
"""

import numpy as np
import pytest

from gpu_env import NGPU, SIMULATED, SKIP_REASON, cupy, gpu_pair

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from mirrored._core import fused_update as host_fused_update  # noqa: E402
from mirrored.device import gpu as _gpu  # noqa: E402
from mirrored.device.dtypes import dtype_code  # noqa: E402
from mirrored.train.optimizers import base, rules  # noqa: E402
from test_fused_adafactor import COEFFICIENTS, OPTIONS, SHAPES, _variables, train  # noqa: E402
from test_optimizer_gpu import _count_launches  # noqa: E402

# (130, 70) and (9000,): more threads than the simulated grid's 8192, so every phase's grid-stride loop turns
GPU_SHAPES = SHAPES + [(9000,), (3, 1, 1)]
PHASES = 6  # core/adafactor_rule.h's kAdafactorPhases


def _table(device, weights, slots, decay, shapes=True):
    return _gpu.cuda_module().FusedUpdateTable(
        device, dtype_code(weights[0].dtype), [w.data.ptr for w in weights],
        [[s.data.ptr for s in ss] for ss in slots], [w.size for w in weights], decay,
        [w.shape for w in weights] if shapes else None)


def _on_gpu(weights, slots):
    return [cupy.asarray(w) for w in weights], [[cupy.asarray(s) for s in ss] for ss in slots]


def _assert_same_bits(gpu_weights, gpu_slots, weights, slots):
    for k, shape in enumerate(GPU_SHAPES):
        assert cupy.asnumpy(gpu_weights[k]).tobytes() == weights[k].tobytes(), f"weight {k} {shape}"
        for j in range(3):
            assert cupy.asnumpy(gpu_slots[k][j]).tobytes() == slots[k][j].tobytes(), f"slot {j} of {k} {shape}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scalars", ["host", "device"])
def test_gpu_kernels_equal_the_host_kernel_bit_for_bit(scalars, dtype):
    """Three steps, the packed gradients in a new buffer at each (the table follows it), weight decay on and
    off; the scalars passed by value, or read when the kernels run from a device buffer."""
    t = np.dtype(dtype).type
    c = [float(t(x)) for x in COEFFICIENTS]
    wd, lr = float(t(0.004)), float(t(0.01))
    weights, _, slots = _variables(dtype, GPU_SHAPES, 1)
    decay = [k % 3 == 0 for k in range(len(GPU_SHAPES))]
    with cupy.cuda.Device(NGPU - 1):
        gpu_weights, gpu_slots = _on_gpu(weights, slots)
        table = _table(NGPU - 1, gpu_weights, gpu_slots, decay)
        stream = cupy.cuda.get_current_stream().ptr
        for step in range(3):
            _, grads, _ = _variables(dtype, GPU_SHAPES, 10 + step)
            host_fused_update(rules.ADAFACTOR, weights, grads, slots, decay, c, wd, lr)
            packed = cupy.asarray(np.concatenate([g.reshape(-1) for g in grads]))
            if scalars == "host":
                table.apply(rules.ADAFACTOR, packed.data.ptr, c, wd, lr, stream)
            else:
                buffer = cupy.asarray(np.array(c + [wd, lr], dtype))
                table.apply_from_device(rules.ADAFACTOR, packed.data.ptr, buffer.data.ptr, len(c), stream)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)


def test_gate_skips_a_nonfinite_step_and_unscales_a_finite_one():
    c = [float(np.float32(x)) for x in COEFFICIENTS]
    weights, grads, slots = _variables(np.float32, GPU_SHAPES, 2)
    with cupy.cuda.Device(0):
        gpu_weights, gpu_slots = _on_gpu(weights, slots)
        table = _table(0, gpu_weights, gpu_slots, [True] * len(GPU_SHAPES))
        stream = cupy.cuda.get_current_stream().ptr
        packed = cupy.asarray(np.concatenate([g.reshape(-1) for g in grads]) * np.float32(8))
        nonfinite, scale = cupy.asarray(np.array(1, np.int32)), cupy.asarray(np.array(8, np.float32))
        table.apply(rules.ADAFACTOR, packed.data.ptr, c, 0.01, 0.1, stream, nonfinite.data.ptr, scale.data.ptr)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)  # skipped: nothing written
        nonfinite[...] = 0
        table.apply(rules.ADAFACTOR, packed.data.ptr, c, 0.01, 0.1, stream, nonfinite.data.ptr, scale.data.ptr)
        unscaled = [np.asarray(g * np.float32(8) / np.float32(8)) for g in grads]
        host_fused_update(rules.ADAFACTOR, weights, unscaled, slots, [True] * len(GPU_SHAPES), c, 0.01, 0.1)
        _assert_same_bits(gpu_weights, gpu_slots, weights, slots)


def test_squares_replace_g_times_g_on_the_gpu():
    c = [float(np.float32(x)) for x in COEFFICIENTS]
    weights, grads, slots = _variables(np.float32, GPU_SHAPES, 3)
    squares = [np.asarray(g * g * np.float32(1.5)) for g in grads]
    with cupy.cuda.Device(0):
        gpu_weights, gpu_slots = _on_gpu(weights, slots)
        table = _table(0, gpu_weights, gpu_slots, [False] * len(GPU_SHAPES))
        packed = cupy.asarray(np.concatenate([g.reshape(-1) for g in grads]))
        packed_squares = cupy.asarray(np.concatenate([s.reshape(-1) for s in squares]))
        table.apply(rules.ADAFACTOR, packed.data.ptr, c, 0.0, 0.0, cupy.cuda.get_current_stream().ptr,
                    squares=packed_squares.data.ptr)
    host_fused_update(rules.ADAFACTOR, weights, grads, slots, [False] * len(GPU_SHAPES), c, 0.0, 0.0, squares)
    _assert_same_bits(gpu_weights, gpu_slots, weights, slots)


def test_a_table_without_shapes_refuses_adafactor_and_bad_shapes_are_named():
    w = cupy.zeros((3, 4), np.float32)
    slots = [cupy.zeros(3, np.float32), cupy.zeros(4, np.float32), cupy.zeros((3, 4), np.float32)]
    g = cupy.ones(12, np.float32)
    table = _table(0, [w], [slots], [False], shapes=False)
    with pytest.raises(ValueError, match="Adafactor on a table made without the variables' shapes"):
        table.apply(rules.ADAFACTOR, g.data.ptr, list(COEFFICIENTS), 0.0, 0.0, 0)
    with pytest.raises(ValueError, match=r"shapes\[0\]: 10 elements, counts\[0\] is 12"):
        _gpu.cuda_module().FusedUpdateTable(0, dtype_code(np.float32), [w.data.ptr], [[s.data.ptr for s in slots]],
                                            [12], [False], [(2, 5)])
    with pytest.raises(ValueError, match="one entry per variable"):
        _gpu.cuda_module().FusedUpdateTable(0, dtype_code(np.float32), [w.data.ptr], [[s.data.ptr for s in slots]],
                                            [12], [False], [(3, 4), (3, 4)])


def _steps(devices, n=3, captured=False, loss_scale=False, sparse=False, variables=8):
    """n steps of md.optimizers.Adafactor on ``devices`` (two replicas), eager or through md.function, plain or
    under a dynamic LossScaleOptimizer (one step's gradient inf: skipped), dense or IndexedSlices gradients;
    every copy of every variable."""
    strategy = md.MirroredStrategy(devices)
    shapes = [[(6, 5), (7,), (2, 3, 4), ()][k % 4] for k in range(variables)]
    with strategy.scope():
        ws = [md.Variable(np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) + k / 10)
              for k, s in enumerate(shapes)]
        opt = md.optimizers.Adafactor(0.05, weight_decay=0.01)
        if loss_scale:
            opt = md.mixed_precision.LossScaleOptimizer(opt, initial_scale=4.0, dynamic_growth_steps=2)

    def step(s, poison):
        r = md.get_replica_context().replica_id_in_sync_group
        grads = []
        for k, (w, shape) in enumerate(zip(ws, shapes)):
            g = w.read_value() * (r + 1.0) * 0.5 - s * 0.1
            if loss_scale:
                g = g * 4.0
            if sparse and len(shape) >= 2:
                rows = np.array([0, 1, 1] if k % 2 else [1], np.int64)
                g = md.IndexedSlices(g[rows], rows, shape)
            grads.append(g)
        if loss_scale:
            grads = [g * poison for g in grads]
        opt.apply_gradients(zip(grads, ws))

    run = md.function(step) if captured else step
    for s in range(n):
        strategy.run(run, args=(np.float32(s), np.float32(np.inf if s == 1 else 1.0)))
    return [np.asarray(c.numpy()) for w in ws for c in w.values]


@pytest.mark.parametrize("case", ["eager", "captured", "loss_scale", "captured loss_scale", "sparse"])
def test_gpu_replicas_equal_the_cpu_replicas_bit_for_bit(case, monkeypatch):
    """Eager or captured (md.function: the scalars read from device memory at each replay) on the GPUs, eager on
    the CPUs (the host kernel); neither runs the rule variable by variable."""
    def per_variable(*args):
        raise AssertionError("Adafactor ran variable by variable")

    monkeypatch.setattr(base, "apply_rule", per_variable)
    kwargs = {"loss_scale": "loss_scale" in case, "sparse": case == "sparse"}
    with gpu_pair():
        on_gpu = _steps(["/gpu:0", "/gpu:1"], captured="captured" in case, **kwargs)
    on_cpu = _steps(["/cpu:0", "/cpu:1"], **kwargs)
    for got, expected in zip(on_gpu, on_cpu):
        assert got.tobytes() == expected.tobytes()


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches")
def test_apply_gradients_on_200_variables_costs_the_same_launches_per_gpu_as_on_2(monkeypatch):
    """The engine's launches: the gradients packed (one), Adafactor's phases (PHASES), nothing per variable;
    the stand-in CuPy's kernels: the step's own gradients and nothing per variable."""
    counted = {}
    for n in (2, 200):
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        shapes = [(16, 8) if k % 2 else (8,) for k in range(n)]
        with strategy.scope():
            variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
            opt = md.optimizers.Adafactor(0.01)

        def step():
            r = md.get_replica_context().replica_id_in_sync_group
            grads = [cupy.full(shape, 0.25 * (r + 1), np.float32) for shape in shapes]
            opt.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)

        for _ in range(2):  # the plan, the slots and the tables are made outside the count
            strategy.run(step)
        counted[n] = _count_launches(monkeypatch, lambda: strategy.run(step))
    for gpu in (0, 1):
        engine, stand_in = counted[200][0][gpu], counted[200][1][gpu]
        assert engine == 1 + PHASES, f"GPU {gpu}: {engine} engine launches"
        assert stand_in - 200 == counted[2][1][gpu] - 2, f"GPU {gpu}: {stand_in} CuPy kernels for 200 variables"


GPU_STRATEGIES = {
    "mirrored": lambda: md.MirroredStrategy(["/gpu:0", "/gpu:1"]),
    "central storage": lambda: md.distribute.experimental.CentralStorageStrategy(["/gpu:0", "/gpu:1"]),
    "central storage on the host": lambda: md.distribute.experimental.CentralStorageStrategy(["/gpu:0", "/gpu:1"],
                                                                                             "/cpu:0"),
}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("strategy", sorted(GPU_STRATEGIES))
def test_gpu_strategies_and_options_give_the_reference_bits(strategy, options, monkeypatch):
    """Gradient accumulation, Keras' moving average, clipping, constraints and central storage on GPU replicas
    (the parameters on a GPU or on the host): the fused path's bits are the reference's, variable by variable."""
    with gpu_pair():
        fused = train(GPU_STRATEGIES[strategy], True, monkeypatch, **OPTIONS[options])
        reference = train(GPU_STRATEGIES[strategy], False, monkeypatch, **OPTIONS[options])
    assert len(fused) == len(reference)
    for got, expected in zip(fused, reference):
        assert got.tobytes() == expected.tobytes()
