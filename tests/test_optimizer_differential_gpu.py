"""The optimizer differential's cases on GPU replicas inside md.function (marker ``gpu``: on the simulated GPUs
without a GPU, see gpu_env.py): MirroredStrategy's cases of float32/float64 variables, their gradients CuPy
arrays, so md.function captures the step (on CPU replicas it runs NumPy steps eagerly; here too where it
cannot capture one, docs/function.md). Each must give TF's
result (tests/data/optimizer_differential_reference.json), as on CPU replicas."""

import warnings

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy, physical_gpus

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
import optimizer_differential as cases  # noqa: E402
from test_optimizer_differential import (CASES, REFERENCE, Mirrored, _compare, _several_compute_devices_accumulate,  # noqa: E402
                                         _tf_limitation)


class OnGpus(Mirrored):
    """The cases' adapter over mirrored's GPU replicas: /gpu:i for /cpu:i, gradients as CuPy arrays."""

    constant = staticmethod(lambda a: cupy.asarray(a))

    @staticmethod
    def strategy(kind, n):
        devices = [f"/gpu:{i}" for i in range(n)]
        if kind == "central":  # the variables on the host, as TF keeps them with several GPUs
            return md.experimental.CentralStorageStrategy(devices, "/cpu:0")
        if kind == "central_on_gpu":  # (one GPU: TF keeps the variables on it)
            return md.experimental.CentralStorageStrategy(devices)
        if kind == "one_device":
            return md.OneDeviceStrategy("/gpu:0")
        return md.MirroredStrategy(devices)

    @staticmethod
    def numpy(x):
        value = x.numpy() if hasattr(x, "numpy") else x
        return cupy.asnumpy(value) if isinstance(value, cupy.ndarray) else np.asarray(value)

    @classmethod
    def copies(cls, v):
        return [cls.numpy(c) for c in v.values] if hasattr(v, "values") else [cls.numpy(v)]


def _on_gpus(case):
    return (case["mode"] == "function" and "bad" not in case
            and all(v["dtype"] in ("float32", "float64") for v in case["variables"])
            and _tf_limitation(case, REFERENCE[str(case["id"])]) is None and not _several_compute_devices_accumulate(case))


GPU_CASES = [k for k in sorted(CASES, key=int) if _on_gpus(CASES[k])]


def test_the_gpu_cases_cover_every_optimizer():
    assert {CASES[k]["optimizer"] for k in GPU_CASES} == set(cases.OPTIMIZERS)


@pytest.mark.parametrize("case_id", GPU_CASES)
def test_case_in_a_function_on_gpu_replicas_matches_tensorflow(case_id):
    case = CASES[case_id]
    with physical_gpus(case["n"]), warnings.catch_warnings():
        # A step md.function cannot capture (LossScaleOptimizer deciding on the host) runs eagerly, saying so.
        warnings.simplefilter("ignore", md.distribute.function.EagerFallbackWarning)
        got = cases.run_case(OnGpus(), case)
    _compare(case, got, REFERENCE[case_id])


@pytest.mark.parametrize("clip", [{"clipvalue": 0.2}, {"clipnorm": 0.2}])
def test_cross_replica_accumulated_step_clips_each_gpus_average_after_it_is_computed(clip):
    # apply_gradients in cross-replica context with PerReplica gradients (as LossScaleOptimizer passes them) on
    # an update step of gradient accumulation: each replica's accumulated average is computed on its GPU's merge
    # stream; its clipping used to run on another stream, reading it unfinished (case 342: a wrong sign).
    grads = np.random.RandomState(0).standard_normal((3, 2, 4)).astype(np.float32)

    def train(devices, xp):
        strategy = md.MirroredStrategy(devices)
        with strategy.scope():
            w = md.Variable(np.zeros(4, np.float32))
            opt = md.optimizers.SGD(1.0, gradient_accumulation_steps=3, **clip)
        for step in range(3):
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx: xp.asarray(grads[step, ctx.replica_id_in_sync_group]))
            with strategy.scope():
                opt.apply_gradients([(per_replica, w)])
        return [OnGpus.numpy(c) for c in w.values]

    with physical_gpus(2):
        on_gpus = train(["/gpu:0", "/gpu:1"], cupy)
    on_cpus = train(["/cpu:0", "/cpu:1"], np)
    for got in on_gpus:
        np.testing.assert_allclose(got, on_cpus[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs, expected", [({}, -0.2), ({"clipvalue": 0.2}, -0.04),
                                              ({"momentum": 0.5, "gradient_accumulation_steps": 2}, -0.1)])
def test_central_storage_one_gpu_replica_updates_host_parameters(kwargs, expected):
    # CentralStorageStrategy(["/gpu:0"], "/cpu:0"): one compute GPU, the variables on the host. The step used
    # to apply the GPU's gradients to the host copy as if they were on it (TypeError: implicit conversion of a
    # GPU array); they are taken to the host, as with several compute devices (cases 45, 123, 351, ...).
    strategy = md.experimental.CentralStorageStrategy(["/gpu:0"], "/cpu:0")
    with strategy.scope():
        w = md.Variable(np.zeros(4, np.float32))
        opt = md.optimizers.SGD(0.1, **kwargs)
    for _ in range(2):
        grads = strategy.experimental_distribute_values_from_function(lambda ctx: cupy.ones(4, np.float32))
        strategy.run(lambda g: opt.apply_gradients([(g, w)]), args=(grads,))
    np.testing.assert_allclose(OnGpus.numpy(w), np.full(4, expected, np.float32), rtol=1e-6)
    assert int(opt.iterations.numpy()) == (1 if "gradient_accumulation_steps" in kwargs else 2)
