"""Randomised differential test of the Keras optimizers on the strategies against TensorFlow 2.21 + Keras 3: the
cases tests/optimizer_differential.py draws from its seed (every optimizer, its arguments, clipping, weight decay,
moving averages, gradient accumulation, learning-rate schedules, LossScaleOptimizer with a step that is not
finite, float16/32/64 variables of several shapes, MirroredStrategy at 1, 2 and 4 replicas,
CentralStorageStrategy, OneDeviceStrategy, eager or in md.function), recorded from TF by
tests/data/record_optimizer_differential.py and replayed here. The suite never imports TensorFlow.

Each case must give TF's variables, optimizer variables (every copy), ``iterations``, learning rate and loss scale
at float32 rounding, or raise as TF does. Where TF cannot trace a step (Keras' gradient accumulation under
MirroredStrategy in a tf.function; mixed dtypes in one traced all-reduce), md.function must give TF's eager
result.
"""

import json
import os
import warnings

import numpy as np
import pytest

import mirrored as md
import optimizer_differential as cases

_PATH = os.path.join(os.path.dirname(__file__), "data", "optimizer_differential_reference.json")
with open(_PATH) as _f:
    _RECORD = json.load(_f)
REFERENCE = _RECORD["cases"]
CASES = {str(c["id"]): c for c in cases.generate(_RECORD["seed"], _RECORD["count"])}

# TF's exception -> the exception mirrored raises for the same bad input.
_TYPES = {"InvalidArgumentError": "ValueError"}
# The words mirrored's message must hold, by bad input.
_WORDS = {"two_clips": ("Only one of", "clipnorm", "clipvalue"),
          "accumulation_one": ("gradient_accumulation_steps",), "ema_momentum": ("ema_momentum",),
          "gradient_shape": ("shape",)}


# TF 2.21 + Keras 3.15 refuse these valid cases; mirrored runs them (docs/central_storage.md, docs/training.md):
# CentralStorageStrategy with several compute devices cannot update Keras' accumulators or moving averages in
# replica context; Keras' global norm multiplies float32 by float64 when the variables' dtypes are mixed; a
# Keras cond around merge_call (LossScaleOptimizer's, gradient accumulation's) fails on one device in a function.
_LIMITATIONS = ("AggregatingVariable", "cannot compute Mul as input", "Cond.call()")


class Mirrored:
    """The cases' adapter over mirrored."""

    optimizers = md.optimizers
    constant = staticmethod(np.asarray)
    function = staticmethod(md.function)
    Variable = staticmethod(md.Variable)

    @staticmethod
    def strategy(kind, n):
        devices = [f"/cpu:{i}" for i in range(n)]
        if kind == "mirrored":
            return md.MirroredStrategy(devices)
        if kind == "central":
            return md.experimental.CentralStorageStrategy(devices, "/cpu:0")
        return md.OneDeviceStrategy("/cpu:0")

    @staticmethod
    def loss_scale_optimizer(inner, dynamic, initial_scale, dynamic_growth_steps):
        return md.mixed_precision.LossScaleOptimizer(inner, dynamic=dynamic, initial_scale=initial_scale,
                                                     dynamic_growth_steps=dynamic_growth_steps)

    @staticmethod
    def inner(opt):
        return opt.inner_optimizer

    @staticmethod
    def numpy(x):
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x)

    @staticmethod
    def copies(v):
        return [np.asarray(c) for c in v.values] if hasattr(v, "values") else [np.asarray(v.numpy())]

    @staticmethod
    def optimizer_variables(opt):
        return opt.variables

    @staticmethod
    def u_product(opt):
        """Nadam's running product of its momentum schedule (a variable in Keras, a number here)."""
        return opt._keras_scalars()["_u_product"]

    @staticmethod
    def learning_rate(opt):
        """Keras' ``learning_rate``: a schedule's value at the raw step count (``_iterations``)."""
        lr = opt.learning_rate
        return opt.learning_rate_at(int(opt.variables[0].numpy())) if callable(lr) else lr


def _tolerance(dtype):
    # float32 rounding: the element-wise rules are Keras' own; a sum (all-reduce, a clipping norm) may differ by
    # an ulp and a few steps amplify it. float16: its ulp is 1e-3. Ftrl's pow is Eigen's in TF (not correctly
    # rounded): see test_optimizer_keras_parity.
    return {"float16": 4e-3, "float32": 3e-5}.get(dtype, 3e-6)


def _assert_close(got, expected, what):
    expected_array = cases.decode(expected)
    got = np.asarray(got)
    assert got.dtype.name == expected["dtype"], f"{what}: dtype {got.dtype.name}, TF's {expected['dtype']}"
    assert list(got.shape) == expected["shape"], f"{what}: shape {got.shape}, TF's {expected['shape']}"
    rtol = _tolerance(expected["dtype"])
    np.testing.assert_allclose(got.astype(np.float64), expected_array, rtol=rtol, atol=rtol, err_msg=what)


def _tf_limitation(case, expected):
    """The words of TF's refusal when TF cannot run a valid case (None otherwise)."""
    if "raises" not in expected or "bad" in case:
        return None
    return next((w for w in _LIMITATIONS if w in expected["msg"]), f"unexpected: {expected['msg'][-300:]}")


def _compare(case, got, expected):
    if "raises" in expected:
        assert "raises" in got, f"TF raised {expected['raises']}: {expected['msg'][-300:]}; mirrored returned"
        assert got["raises"] == _TYPES.get(expected["raises"], expected["raises"]), (got, expected)
        for word in _WORDS.get(case.get("bad"), ()):
            assert word.lower() in got["msg"].lower(), (word, got["msg"])
        return
    assert "raises" not in got, f"mirrored raised {got['raises']}: {got['msg']}"
    assert len(got["variables"]) == len(expected["variables"])
    for i, (g, e) in enumerate(zip(got["variables"], expected["variables"])):
        _assert_close(cases.decode(g).astype(g["dtype"]), e, f"variable {i}")
    assert len(got["optimizer_variables"]) == len(expected["optimizer_variables"]), \
        ([c[0]["shape"] for c in got["optimizer_variables"]], [c[0]["shape"] for c in expected["optimizer_variables"]])
    for i, (g, e) in enumerate(zip(got["optimizer_variables"], expected["optimizer_variables"])):
        # TF keeps CentralStorageStrategy's state in one copy; mirrored's copies must each hold it.
        pairs = zip(g, e) if len(g) == len(e) else ((c, e[0]) for c in g) if len(e) == 1 else None
        assert pairs is not None, f"optimizer variable {i}: {len(g)} copies, TF's {len(e)}"
        for r, (gc, ec) in enumerate(pairs):
            _assert_close(cases.decode(gc).astype(gc["dtype"]), ec, f"optimizer variable {i} copy {r}")
    assert got["iterations"] == expected["iterations"]
    np.testing.assert_allclose(got["learning_rate"], expected["learning_rate"], rtol=1e-6)
    if "u_product" in expected:
        np.testing.assert_allclose(got["u_product"], expected["u_product"], rtol=3e-5)
    if "loss_scale" in case:
        assert got["dynamic_scale"] == expected["dynamic_scale"]
        if case["loss_scale"]["dynamic"]:
            assert got["step_counter"] == expected["step_counter"]


def test_every_case_is_recorded():
    assert sorted(REFERENCE, key=int) == sorted(CASES, key=int)


def _run(case):
    with warnings.catch_warnings():
        # md.function runs a step eagerly for host NumPy arguments (CPU replicas), saying so.
        warnings.simplefilter("ignore", md.distribute.function.EagerFallbackWarning)
        return cases.run_case(Mirrored(), case)


def _several_compute_devices_accumulate(case):
    """Keras' accumulation under CentralStorageStrategy with several compute devices: TF keeps the first
    replica's gradients only (then refuses the update step); mirrored sums the replicas' (docs/central_storage.md)."""
    return case["strategy"] == "central" and case["n"] > 1 and case["kwargs"].get("gradient_accumulation_steps", 0) > 1


def _clips(case):
    return any(k in case["kwargs"] for k in ("clipnorm", "clipvalue", "global_clipnorm"))


@pytest.mark.parametrize("case_id", sorted(CASES, key=int))
def test_case_matches_tensorflow(case_id):
    case, expected = CASES[case_id], REFERENCE[case_id]
    got = _run(case)
    limitation = _tf_limitation(case, expected)
    assert limitation is None or limitation in _LIMITATIONS, limitation
    if limitation is not None or _several_compute_devices_accumulate(case):
        # What TF cannot give, MirroredStrategy's step does: the same variables and step count.
        assert "raises" not in got, f"mirrored raised {got['raises']}: {got['msg']}"
        if _several_compute_devices_accumulate(case) and _clips(case):
            # The sum of the replicas' gradients is accumulated and clipped once: one replica's step on it.
            mirrored = _run(dict(case, strategy="mirrored", n=1, summed_replicas=case["n"]))
        else:
            mirrored = _run(dict(case, strategy="mirrored"))
        for g, e in zip(got["variables"], mirrored["variables"]):
            _assert_close(cases.decode(g).astype(g["dtype"]), e, "variable (vs MirroredStrategy)")
        assert got["iterations"] == mirrored["iterations"]
        return
    _compare(case, got, expected)
