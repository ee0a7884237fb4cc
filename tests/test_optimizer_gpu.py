"""Keras' optimizers on GPU replicas (marker ``gpu``: on the simulated GPUs without a GPU, see gpu_env.py).

Every optimizer, its clipping and weight decay, on two logical GPUs: the same weights as the values
recorded from TensorFlow (tests/data/keras_optimizers.npz) and as the same run on CPU replicas. The
fused CUDA update kernel (csrc/cuda/fused_update.cu) against the host kernel, bit for bit, and its
cost: one launch per GPU and dtype, whatever the number of variables.
"""

import collections

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
from test_fused_update import CASES, SIZES, _tables  # noqa: E402
from test_optimizer_keras_parity import DATA, train_in_replicas  # noqa: E402


def _train(name, devices, xp):
    _, w, b = train_in_replicas(md.MirroredStrategy(devices), name, xp)
    return [np.asarray(c.numpy()) for var in (w, b) for c in var.values]


@pytest.mark.parametrize("name", ["SGD nesterov", "Adam", "AdamW", "RMSprop centered momentum", "Adagrad", "Nadam",
                                  "SGD clipnorm", "Adam weight_decay global_clipnorm", "RMSprop clipvalue weight_decay",
                                  "Adam amsgrad", "AdamW amsgrad", "SGD momentum use_ema overwrite",
                                  "Adam loss_scale_factor clipnorm", "SGD momentum accumulation clipnorm weight_decay",
                                  "AdamW amsgrad use_ema accumulation loss_scale", "Adamax weight_decay clipnorm",
                                  "Adadelta clipvalue weight_decay", "Lion weight_decay global_clipnorm",
                                  "Ftrl regularized", "Ftrl power", "Adam CosineDecay warmup",
                                  "Lion use_ema overwrite loss_scale"])
def test_gpu_replicas_match_keras_and_the_cpu_replicas(name):
    with gpu_pair():
        on_gpu = _train(name, ["/gpu:0", "/gpu:1"], cupy)
    on_cpu = _train(name, ["/cpu:0", "/cpu:1"], np)
    w, b = DATA[f"{name}|2|w"], DATA[f"{name}|2|b"]
    for got, cpu, expected in zip(on_gpu, on_cpu, (w, w, b, b)):
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-7)
        np.testing.assert_allclose(got, cpu, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(on_gpu[0], on_gpu[1])  # the copies stay bit-identical
    np.testing.assert_array_equal(on_gpu[2], on_gpu[3])


def _table(device, weights, slots, decay):
    return _gpu.cuda_module().FusedUpdateTable(device, dtype_code(weights[0].dtype), [w.data.ptr for w in weights],
                                               [[s.data.ptr for s in ss] for ss in slots],
                                               [w.size for w in weights], decay)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_kernel_equals_the_host_kernel_bit_for_bit(case, dtype):
    """Every rule and variant, both dtypes, sizes with every tail and beyond one grid's threads, weight decay
    on and off: three steps, the packed gradients in a new buffer at each (the table follows it)."""
    rule, coefficients, n_slots = CASES[case]
    t = np.dtype(dtype).type
    c = [float(t(x)) for x in coefficients]
    sizes = SIZES + [20011]
    weights, _, slots = _tables(dtype, n_slots, sizes)
    decay = [k % 3 == 0 for k in range(len(sizes))]
    wd, lr = float(t(0.004)), c[0]
    with cupy.cuda.Device(NGPU - 1):
        gpu_weights = [cupy.asarray(w) for w in weights]
        gpu_slots = [[cupy.asarray(s) for s in ss] for ss in slots]
        table = _table(NGPU - 1, gpu_weights, gpu_slots, decay)
        assert table.total_count == sum(sizes)
        stream = cupy.cuda.get_current_stream().ptr
        for _ in range(3):
            grads = [np.random.default_rng(len(sizes)).normal(size=n).astype(dtype) for n in sizes]
            host_fused_update(rule, weights, grads, slots, decay, c, wd, lr)
            packed = cupy.asarray(np.concatenate(grads))
            table.apply(rule, packed.data.ptr, c, wd, lr, stream)
        # A float64 pow is the platform's (core/optimizer_rules.h, power()): CUDA's and the host's libm may
        # differ by an ulp, and FTRL's linear slot takes the difference of two powers, which cancels: an H100
        # gave weights 440 ulps apart (a relative 1e-13). Everything else is bit for bit.
        platform_pow = case == "ftrl_power" and dtype == np.float64 and not SIMULATED
        for k, n in enumerate(sizes):
            for got, expected, what in [(gpu_weights[k], weights[k], f"weight {k} (size {n})")] + \
                    [(gpu_slots[k][j], slots[k][j], f"slot {j} of {k}") for j in range(n_slots)]:
                if platform_pow:
                    np.testing.assert_allclose(cupy.asnumpy(got), expected, rtol=1e-11, atol=1e-13, err_msg=what)
                else:
                    np.testing.assert_array_equal(cupy.asnumpy(got), expected, err_msg=what)


def test_gpu_kernel_refuses_bad_arguments_naming_them():
    w = cupy.zeros(4, np.float32)
    table = _table(0, [w], [[cupy.zeros(4, np.float32)]], [False])
    g = cupy.ones(4, np.float32)
    unknown = len(md.optimizers.rules.RULES)  # (the first code past the rules)
    with pytest.raises(ValueError, match=f"rule={unknown}: no such rule"):
        table.apply(unknown, g.data.ptr, [0.1, 0.9], 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="coefficients: 1 given, the rule takes 2"):
        table.apply(1, g.data.ptr, [0.1], 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="float16.*float32 and float64"):
        _table(0, [cupy.zeros(4, np.float16)], [[]], [False])
    with pytest.raises(ValueError, match="device: GPU 7 does not exist"):
        _table(7, [w], [[]], [False])
    with pytest.raises(ValueError, match="one entry per variable"):
        _gpu.cuda_module().FusedUpdateTable(0, dtype_code(np.float32), [w.data.ptr], [], [4], [False])


def _count_launches(monkeypatch, step):
    """Launches per GPU of step(): the engine's kernels and the CuPy stand-in's (its own counter)."""
    import fake_cupy

    stand_in = collections.Counter()
    real = fake_cupy.sim

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def launch(self, stream, device, fn):
            stand_in[device] += 1
            return real.launch(stream, device, fn)

    cupy.sim.drain()
    cupy.sim.reset_counters()
    with monkeypatch.context() as m:
        m.setattr(fake_cupy, "sim", Counting())
        step()
    engine = collections.Counter(cupy.sim.counters()["launches"])
    cupy.sim.drain()
    return engine, stand_in


@pytest.mark.skipif(not SIMULATED, reason="counts the simulated runtime's launches")
@pytest.mark.parametrize("optimizer", ["Adam", "Adam amsgrad", "Adamax", "Adadelta", "Lion", "Ftrl",
                                       "Ftrl learning_rate_power=-0.3", "Lamb", "ScheduleFreeAdamW"])
@pytest.mark.parametrize("aggregate", [True, False])
def test_apply_gradients_on_200_variables_costs_a_fixed_number_of_launches_per_gpu_plus_the_all_reduce(
        monkeypatch, aggregate, optimizer):
    make = {"Adam": lambda: md.optimizers.Adam(0.01), "Adam amsgrad": lambda: md.optimizers.Adam(0.01, amsgrad=True),
            "Adamax": lambda: md.optimizers.Adamax(0.01), "Adadelta": lambda: md.optimizers.Adadelta(1.0),
            "Lion": lambda: md.optimizers.Lion(0.01), "Ftrl": lambda: md.optimizers.Ftrl(0.1),
            "Ftrl learning_rate_power=-0.3": lambda: md.optimizers.Ftrl(0.1, learning_rate_power=-0.3),
            "Lamb": lambda: md.optimizers.Lamb(0.01, weight_decay=0.1),
            "ScheduleFreeAdamW": lambda: md.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=2, weight_decay=0.1),
            }[optimizer]
    # The rule's launches: one, or its phases (Lamb: lanes, groups, ratios, apply; csrc/core/lamb.h).
    rule_launches = 4 if optimizer == "Lamb" else 1
    strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
    shapes = [(16, 8) if k % 2 else (8,) for k in range(200)]
    with strategy.scope():
        variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]
        opt = make()
    host_opt = make()
    host_variables = [md.Variable(np.full(shape, 0.5, np.float32)) for shape in shapes]

    def step():
        r = md.get_replica_context().replica_id_in_sync_group
        grads = [cupy.full(shape, 0.25 * (r + 1), np.float32) for shape in shapes]
        opt.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=aggregate)

    for _ in range(2):  # the plan, the slots and the tables are made outside the count
        strategy.run(step)
    packed = [cupy.asarray(np.zeros(sum(int(np.prod(s)) for s in shapes), np.float32)) for _ in range(2)]
    with cupy.cuda.Device(1):
        packed[1] = cupy.asarray(np.zeros(packed[0].size, np.float32))
    all_reduce, _ = _count_launches(monkeypatch, lambda: strategy.extended.batch_reduce_to(
        md.ReduceOp.SUM, [(md.distribute.values.PerReplica(packed, strategy.extended.worker_devices), variables[0])]))
    engine, stand_in = _count_launches(monkeypatch, lambda: strategy.run(step))
    for gpu in (0, 1):
        update = engine[gpu] - (all_reduce[gpu] if aggregate else 0)
        # The engine's: the gradients packed into the fusion buffer (one multi-tensor copy), the fused update.
        assert update == 1 + rule_launches, f"GPU {gpu}: {engine[gpu]} engine launches, the all-reduce's are " \
                                            f"{all_reduce[gpu]}"
        # The stand-in's kernels besides the step's own 200 gradients: the step count, nothing per variable.
        assert stand_in[gpu] - 200 <= 1, f"GPU {gpu}: {stand_in[gpu]} CuPy kernels"

    # Three steps on the GPUs equal the host's bits: every copy with the summed gradients, or
    # (not aggregated) replica 0's copy with its own.
    for _ in range(3):
        host_opt.apply_gradients([(np.full(shape, 0.75 if aggregate else 0.25, np.float32), v)
                                  for shape, v in zip(shapes, host_variables)])
    for k in (0, 1, 199):
        for copy in variables[k].values if aggregate else variables[k].values[:1]:
            np.testing.assert_array_equal(cupy.asnumpy(copy.read_value()), host_variables[k].numpy())


def _captured_steps(kwargs, steps, captured=True):
    """``steps`` steps of SGD-with-momentum or Adam options ``kwargs`` on two logical GPUs, through
    md.function when ``captured``; the weights' copies."""
    md.config.set_logical_device_configuration("GPU", 0, count=2)
    try:
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with strategy.scope():
            w = md.Variable(np.linspace(-1, 1, 8, dtype=np.float32))
            opt = md.optimizers.Adam(0.01, **kwargs)

        def step(g):
            opt.apply_gradients([(g * g - w.read_value(), w)])

        run = md.function(step) if captured else step
        devices = strategy.extended.worker_devices
        for s in range(steps):
            g = md.PerReplica([md.device_util.place(np.linspace(s, r + 1, 8, dtype=np.float32), d)
                               for r, d in enumerate(devices)], devices)
            strategy.run(run, args=(g,))
        return [np.asarray(c.numpy()) for c in w.values]
    finally:
        md.config.set_logical_device_configuration("GPU:0", None)


def test_amsgrad_and_loss_scale_factor_replay_as_the_eager_steps():
    kwargs = {"amsgrad": True, "beta_2": 0.5, "loss_scale_factor": 2.0}
    captured, eager = _captured_steps(kwargs, 5), _captured_steps(kwargs, 5, captured=False)
    for c, e in zip(captured, eager):
        np.testing.assert_array_equal(c, e)


@pytest.mark.parametrize("kwargs", [{"use_ema": True, "ema_overwrite_frequency": 2},
                                    {"gradient_accumulation_steps": 2}])
def test_the_options_that_branch_on_the_step_run_eagerly_under_md_function_saying_why(kwargs):
    from mirrored.distribute.function import EagerFallbackWarning

    with pytest.warns(EagerFallbackWarning, match="use_ema and gradient_accumulation_steps branch on the step"):
        captured = _captured_steps(kwargs, 5)
    for c, e in zip(captured, _captured_steps(kwargs, 5, captured=False)):
        np.testing.assert_array_equal(c, e)
