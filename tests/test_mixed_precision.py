"""md.mixed_precision: LossScaleOptimizer against Keras 3's recorded trajectories, the finite-check agreed by every
replica and worker, float16 / bfloat16 gradients reduced natively, Keras 2's API, Policy, and the demo's flag.

TensorFlow 2.21 / Keras 3.15.1 values: tests/data/tfport_reference.json (tests/data/record_tfport_reference.py)."""

import importlib.util
import inspect
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from conftest import cpus

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "data" / "tfport_reference.json").read_text())["loss_scale"]
LSO = md.mixed_precision.LossScaleOptimizer


def _decode(rows):
    return np.array([[float(x) for x in row] for row in rows], np.float32)  # "inf"/"nan" strings included


def _state(opt, w):
    return {"scale": float(opt.dynamic_scale.numpy()), "counter": int(opt.step_counter.numpy()),
            "iterations": int(opt.iterations.numpy()), "w": w.numpy().tolist()}


def _run_sequence(strategy, grads_per_step, initial_scale, growth, lr, split):
    """Apply each step's gradient split over the replicas (``split(g, n)`` -> one gradient per replica)."""
    with strategy.scope():
        w = md.Variable(np.array([1.0, 2.0], np.float32))
        opt = LSO(md.optimizers.SGD(lr), initial_scale=initial_scale, dynamic_growth_steps=growth)
    states = []
    for g in grads_per_step:
        parts = split(g, strategy.num_replicas_in_sync)

        def step():
            opt.apply_gradients([(parts[md.get_replica_context().replica_id_in_sync_group], w)])
        strategy.run(step)
        states.append(_state(opt, w))
    return states


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_scale_trajectory_is_keras_3s(replicas):
    """Keras 3 on one device: skip + halve on inf / -inf / nan, double after `growth` finite steps.
    Split over N replicas (each g / N, exact for powers of two), the SUM is the recorded gradient."""
    ref = REFERENCE["single"]
    states = _run_sequence(md.MirroredStrategy(cpus(replicas)), _decode(ref["grads"]), ref["initial_scale"],
                           ref["growth"], ref["lr"], lambda g, n: [g / np.float32(n)] * n)
    assert states == ref["steps"]


def test_defaults_and_scale_loss_are_keras_3s():
    ref = REFERENCE["defaults"]
    opt = LSO(md.optimizers.SGD(0.1))
    assert opt.initial_scale == ref["initial_scale"] == 2.0 ** 15
    assert opt.dynamic_growth_steps == ref["dynamic_growth_steps"] == 2000
    assert opt.dynamic
    assert float(opt.scale_loss(3.0)) == ref["scale_loss_unbuilt"]
    scaled = opt.scale_loss(np.float16(3.0))  # Keras' multiply promotes float16 by the float32 scale
    assert scaled.dtype == np.float32 and scaled == 98304.0


@pytest.mark.parametrize("statement", [
    "from mirrored.train.optimizers import LossScaleOptimizer",  # the first import of the package
    "from mirrored.optimizers import LossScaleOptimizer",
    "import mirrored as md; LossScaleOptimizer = md.optimizers.LossScaleOptimizer",
])
def test_keras_3s_optimizers_name_is_the_same_class(statement):
    # keras.optimizers.LossScaleOptimizer is keras.mixed_precision.LossScaleOptimizer in Keras 3.
    check = f"{statement}\nimport mirrored as md\nassert LossScaleOptimizer is md.mixed_precision.LossScaleOptimizer"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert md.optimizers.LossScaleOptimizer is LSO
    assert isinstance(md.optimizers.LossScaleOptimizer(md.optimizers.SGD(0.1)), LSO)


def test_a_non_finite_gradient_on_a_later_replica_skips_the_step_everywhere():
    """Keras 3 checks the first replica's gradients only: recorded, its step 3 (NaN on replica 1) reached the
    weights. Here every replica's counts; the run equals one device given the summed gradients."""
    ref = REFERENCE["mirrored2"]
    per_replica = [_decode(step) for step in ref["replica_grads"]]
    two = _run_sequence(md.MirroredStrategy(cpus(2)), per_replica, ref["initial_scale"], ref["growth"],
                        ref["lr"], lambda g, n: list(g))
    one = _run_sequence(md.MirroredStrategy(cpus(1)), [g.sum(axis=0) for g in per_replica], ref["initial_scale"],
                        ref["growth"], ref["lr"], lambda g, n: [g])
    assert two == one
    assert two[:2] == ref["steps"][:2]  # where Keras' replica 0 sees the inf, it agrees
    assert np.isnan(ref["steps"][2]["w"][0]) and two[2]["w"] == two[1]["w"] and two[2]["scale"] == 1.0
    assert all(np.isfinite(s["w"]).all() for s in two)


@settings(max_examples=25, deadline=None)
@given(replicas=st.sampled_from([2, 3, 4]), bad=st.data(), value=st.sampled_from([np.inf, -np.inf, np.nan]))
def test_any_replica_with_any_non_finite_value_skips(replicas, bad, value):
    culprit = bad.draw(st.integers(0, replicas - 1))
    strategy = md.MirroredStrategy(cpus(replicas))
    with strategy.scope():
        w = md.Variable(np.ones(3, np.float32))
        opt = LSO(md.optimizers.SGD(1.0), initial_scale=64.0)

    def step():
        g = np.ones(3, np.float32)
        if md.get_replica_context().replica_id_in_sync_group == culprit:
            g[1] = value
        return opt.apply_gradients([(g, w)])
    assert strategy.run(step) == 0  # every replica is told: iterations unchanged
    assert w.numpy().tolist() == [1.0] * 3 and float(opt.dynamic_scale.numpy()) == 32.0
    assert all(np.array_equal(c.numpy(), [1.0] * 3) for c in w.values)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_half_precision_gradients_are_reduced_in_their_dtype_then_unscaled_to_float32(dtype, replicas):
    dtype = np.dtype(dtype) if dtype == "float16" else np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    strategy = md.MirroredStrategy(cpus(replicas))
    rng = np.random.default_rng(replicas)
    grads = [(rng.standard_normal(5) * 256).astype(dtype) for _ in range(replicas)]
    with strategy.scope():
        w = md.Variable(np.zeros(5, np.float32))
        opt = LSO(md.optimizers.SGD(1.0), initial_scale=256.0)

    def step():
        ctx = md.get_replica_context()
        g = grads[ctx.replica_id_in_sync_group]
        reduced = ctx.all_reduce("sum", g)
        assert reduced.dtype == dtype  # the collective takes and returns the half dtype
        opt.apply_gradients([(g, w)])
        return reduced
    reduced = strategy.experimental_local_results(strategy.run(step))[0]
    expected_sum = np.sum([g.astype(np.float32) for g in grads], axis=0)
    np.testing.assert_allclose(reduced.astype(np.float32), expected_sum, rtol=2e-2 if replicas > 1 else 0)
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w.numpy(), -(reduced.astype(np.float32) / np.float32(256.0)))


def test_a_float16_sum_that_overflows_is_caught_after_the_reduction():
    strategy = md.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32))
        opt = LSO(md.optimizers.SGD(1.0), initial_scale=2.0 ** 15)
    big = np.array([40000.0, 1.0], np.float16)  # finite on each replica, 80000 > float16's max once summed
    strategy.run(lambda: opt.apply_gradients([(big, w)]))
    assert w.numpy().tolist() == [0.0, 0.0] and float(opt.loss_scale) == 2.0 ** 14 and opt.dynamic_counter == 0
    strategy.run(lambda: opt.apply_gradients([(big / np.float16(2), w)]))  # 40000 summed: fits
    np.testing.assert_allclose(w.numpy(), [-40000.0 / 2 ** 14, -1.0 / 2 ** 14], rtol=1e-3)
    assert opt.dynamic_counter == 1 and int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_half_precision_finite_check_at_the_edges(dtype):
    dtype = np.dtype(dtype) if dtype == "float16" else np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    largest = float(np.finfo(np.float16).max) if dtype == np.float16 else 3.3895313892515355e38
    smallest = 2.0 ** -24 if dtype == np.float16 else 2.0 ** -133
    nan_bits = np.array([0x7C01 if dtype == np.float16 else 0x7F81, 0xFFFF], np.uint16).view(dtype)
    cases = [(np.array([largest, -largest, smallest, -0.0], dtype), True),
             (np.zeros((3, 0), dtype), True),
             (np.array([[1.0, np.inf]], dtype)[:, ::-1], False),  # not contiguous
             (np.array([-np.inf], dtype), False), (nan_bits[:1], False), (nan_bits[1:], False)]
    for grad, finite in cases:
        w = md.Variable(np.zeros(grad.shape, np.float32))
        opt = LSO(md.optimizers.SGD(1.0), initial_scale=1.0)
        opt.apply_gradients([(grad, w)])
        assert (int(opt.iterations.numpy()) == 1) is finite, (grad, finite)


class RecordingSGD(md.optimizers.SGD):
    """SGD that records what the loss-scale optimizer hands it."""

    calls = []

    def apply_gradients(self, grads_and_vars, options=None, **kwargs):
        grads_and_vars = list(grads_and_vars)
        self.calls.append(([g for g, _ in grads_and_vars], kwargs.get("experimental_aggregate_gradients", True)))
        return super().apply_gradients(grads_and_vars, options, **kwargs)


@pytest.mark.parametrize("clips", [False, True])
def test_a_clipping_optimizer_gets_each_replicas_unscaled_gradient_to_clip_and_reduce(clips):
    """Keras clips each replica's unscaled gradient, then sums: with clipping set, the wrapped optimizer reduces;
    without, the sum is taken first, in the gradients' dtype, and the wrapped optimizer only applies it."""
    strategy = md.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32))
        inner = RecordingSGD(1.0)
        opt = LSO(inner, initial_scale=4.0)
    inner.calls = []
    if clips:
        inner.clipnorm = 1e9  # large: the sums compare, whoever clips

    def step():
        g = np.array([4.0, 8.0], np.float16) * (1 + md.get_replica_context().replica_id_in_sync_group)
        opt.apply_gradients([(g, w)])
    strategy.run(step)
    (grad,), aggregate = inner.calls[0]
    assert aggregate is clips
    parts = [np.asarray(p) for p in grad.values]
    assert all(p.dtype == np.float32 for p in parts)  # unscaled into float32 either way
    if clips:
        assert isinstance(grad, md.PerReplica) and [p.tolist() for p in parts] == [[1.0, 2.0], [2.0, 4.0]]
    else:
        assert isinstance(grad, md.Mirrored) and [p.tolist() for p in parts] == [[3.0, 6.0]] * 2
    assert w.numpy().tolist() == [-3.0, -6.0]


def test_clipnorm_trajectory_is_keras_3s():
    ref = REFERENCE["mirrored2_clipnorm"]
    if "clipnorm" not in inspect.signature(md.optimizers.SGD).parameters:
        pytest.skip("md.optimizers.SGD takes no clipnorm yet (issue #19 item 1)")
    strategy = md.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = md.Variable(np.array([1.0, 2.0], np.float32))
        inner = md.optimizers.SGD(ref["lr"], clipnorm=ref["clipnorm"])
        opt = LSO(inner, initial_scale=ref["initial_scale"], dynamic_growth_steps=ref["growth"])
    for grads, expected in zip(ref["replica_grads"], ref["steps"]):
        parts = _decode(grads)
        strategy.run(lambda: opt.apply_gradients([(parts[md.get_replica_context().replica_id_in_sync_group], w)]))
        got = _state(opt, w)
        np.testing.assert_allclose(got.pop("w"), expected["w"], rtol=1e-6)
        assert got == {k: v for k, v in expected.items() if k != "w"}


def test_cross_replica_apply_with_per_replica_gradients():
    strategy = md.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32))
        opt = LSO(md.optimizers.SGD(0.5), initial_scale=4.0)
        assert opt.apply_gradients([(md.PerReplica([np.array([4.0, 8.0], np.float32)] * 2), w)]) == 1
        assert opt.apply_gradients([(md.PerReplica([np.array([np.nan, 0], np.float32),
                                                    np.zeros(2, np.float32)]), w)]) == 1
    assert w.numpy().tolist() == [-1.0, -2.0] and float(opt.loss_scale) == 2.0


def test_keras_2_api_scaled_loss_and_unscaled_gradients():
    w = md.Variable(np.zeros(2, np.float32))
    opt = LSO(md.optimizers.SGD(1.0), initial_scale=8.0)
    scaled = opt.get_scaled_loss(np.float16(0.5))
    assert scaled.dtype == np.float16 and scaled == 4.0  # Keras 2 keeps the loss's dtype
    assert opt.get_scaled_loss(lambda: 2.0)() == 16.0
    assert opt.loss_scale == np.float32(8.0) and opt.dynamic_counter == 0
    unscaled = opt.get_unscaled_gradients([np.array([8.0, 16.0], np.float16), None])
    assert unscaled[0].dtype == np.float16 and unscaled[0].tolist() == [1.0, 2.0] and unscaled[1] is None
    opt.apply_gradients([(unscaled[0], w)])  # already unscaled: not divided again
    assert w.numpy().tolist() == [-1.0, -2.0] and opt.dynamic_counter == 1
    opt.apply_gradients([(np.array([np.inf, 0], np.float32), w)])
    assert w.numpy().tolist() == [-1.0, -2.0] and opt.loss_scale == 4.0


def test_keras_3_apply_scales_too():
    w = md.Variable(np.zeros(2, np.float32))
    opt = LSO(md.optimizers.SGD(1.0), initial_scale=4.0)
    with pytest.raises(ValueError, match="trainable_variables: none given"):
        opt.apply([np.ones(2, np.float32)])
    opt.build([w])
    opt.apply([np.array([4.0, 8.0], np.float32)])  # the variables given to build
    opt.apply([np.array([np.nan, 8.0], np.float32)], [w])  # skipped
    assert w.numpy().tolist() == [-1.0, -2.0] and opt.loss_scale == 2.0
    with pytest.raises(ValueError, match="grads: 2 gradients for 1 trainable_variables"):
        opt.apply([np.ones(2), np.ones(2)], [w])


def test_fixed_scale_applies_every_step():
    w = md.Variable(np.zeros(2, np.float32))
    opt = LSO(md.optimizers.SGD(1.0), dynamic=False, initial_scale=4.0)
    for _ in range(3):
        opt.apply_gradients([(np.array([4.0, 8.0], np.float32), w)])
    assert w.numpy().tolist() == [-3.0, -6.0] and opt.loss_scale == 4.0 and int(opt.iterations.numpy()) == 3


def test_the_wrapped_optimizers_attributes_are_reachable():
    strategy = md.MirroredStrategy(cpus(2))
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32), name="w")
        inner = md.optimizers.SGD(0.25, momentum=0.5)
        opt = LSO(inner, initial_scale=2.0)
    strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), w)]))
    assert opt.inner_optimizer is inner and opt.learning_rate == 0.25 and opt.momentum == 0.5
    opt.learning_rate = 0.5
    assert inner.learning_rate == 0.5
    assert opt.iterations is inner.iterations and int(opt.iterations.numpy()) == 1
    assert opt.get_slot(w, "momentum").numpy().tolist() == [-0.25, -0.25]
    names = [v.name for v in opt.variables]
    assert names[:2] == ["loss_scale_optimizer/step_counter:0", "loss_scale_optimizer/dynamic_scale:0"]
    inner_variables = inner.variables() if callable(inner.variables) else inner.variables
    assert names[2:] == [v.name for v in inner_variables]
    assert "LossScaleOptimizer" in repr(opt)
    with pytest.raises(AttributeError):
        opt.no_such_attribute  # noqa: B018


def test_checkpoint_saves_and_restores_the_scale_and_the_wrapped_state(tmp_path):
    w = md.Variable(np.zeros(2, np.float32))
    opt = LSO(md.optimizers.SGD(1.0), initial_scale=8.0, dynamic_growth_steps=5)
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    opt.apply_gradients([(np.full(2, np.nan, np.float32), w)])
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    path = md.train.Checkpoint(model=[w], optimizer=opt).save(str(tmp_path / "ckpt"))
    w2 = md.Variable(np.ones(2, np.float32))
    fresh = LSO(md.optimizers.SGD(1.0), initial_scale=8.0, dynamic_growth_steps=5)
    md.train.Checkpoint(model=[w2], optimizer=fresh).restore(path).assert_consumed()
    assert (float(fresh.loss_scale), fresh.dynamic_counter, int(fresh.iterations.numpy())) == (4.0, 1, 2)
    assert w2.numpy().tolist() == w.numpy().tolist()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"inner_optimizer": object()}, TypeError, "inner_optimizer=.*apply_gradients"),
    ({"initial_scale": 0}, ValueError, "initial_scale=0"),
    ({"initial_scale": float("inf")}, ValueError, "initial_scale=inf"),
    ({"initial_scale": True}, ValueError, "initial_scale=True"),
    ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps=0"),
    ({"dynamic_growth_steps": 2.5}, ValueError, "dynamic_growth_steps=2.5"),
    ({"dynamic": "yes"}, ValueError, "dynamic='yes'"),
])
def test_bad_arguments_are_named(kwargs, error, words):
    kwargs = {"inner_optimizer": md.optimizers.SGD(0.1), **kwargs}
    with pytest.raises(error, match=words):
        LSO(**kwargs)


def test_bad_calls_are_named():
    opt = LSO(md.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        LSO(opt)
    with pytest.raises(ValueError, match="no gradient"):
        opt.apply_gradients([(None, md.Variable(1.0))])
    with pytest.raises(ValueError, match=r"grads_and_vars\[0\]"):
        opt.apply_gradients([1.0])


def test_policies():
    try:
        assert md.mixed_precision.global_policy().name == "float32"
        md.mixed_precision.set_global_policy("mixed_float16")
        policy = md.mixed_precision.global_policy()
        assert (policy.name, policy.compute_dtype, policy.variable_dtype) == ("mixed_float16", "float16", "float32")
        bf = md.mixed_precision.Policy("mixed_bfloat16")
        assert (bf.compute_dtype, bf.variable_dtype) == ("bfloat16", "float32")
        assert md.mixed_precision.DTypePolicy("float64").compute_dtype == "float64"
        md.mixed_precision.set_global_policy(bf)
        assert md.mixed_precision.global_policy() == bf
        with pytest.raises(ValueError, match="name='mixed_int8'.*'mixed_float16'"):
            md.mixed_precision.Policy("mixed_int8")
    finally:
        md.mixed_precision.set_global_policy(None)
    assert md.mixed_precision.global_policy().name == "float32"


def _multiworker_task(culprit_rank):
    from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

    # TF's positional order: (cluster_resolver, communication_options)
    strategy = MultiWorkerMirroredStrategy(md.cluster_resolver.TFConfigClusterResolver(),
                                           md.CommunicationOptions(timeout_seconds=60), devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32))
        opt = LSO(md.optimizers.SGD(1.0), initial_scale=4.0)
    rank = strategy.extended._worker_index
    trajectory = []
    for step in range(3):
        def fn():
            g = np.ones(2, np.float32)
            replica = md.get_replica_context().replica_id_in_sync_group
            if step == 1 and rank == culprit_rank and replica == 3:  # the last replica of the job
                g[0] = np.inf
            return opt.apply_gradients([(g, w)])
        strategy.run(fn)
        trajectory.append(_state(opt, w))
    return trajectory


@pytest.mark.multiworker
def test_two_workers_agree_to_skip_when_one_replica_of_one_worker_overflows():
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    results = launch(_multiworker_task, 2, kwargs={"culprit_rank": 1}, timeout=180)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
    first, second = (r.value for r in results)
    assert first == second
    # 4 replicas of ones summed, divided by the scale 4: one unit per good step; step 2 skipped
    assert [s["w"] for s in first] == [[-1.0, -1.0], [-1.0, -1.0], [-3.0, -3.0]]
    assert [(s["scale"], s["iterations"]) for s in first] == [(4.0, 1), (2.0, 1), (2.0, 2)]


# --- the demo's --mixed-precision ----------------------------------------------------------------

def _demo():
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples" / "train_digits.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_trains_with_mixed_precision(tmp_path):
    demo = _demo()
    try:
        accuracy = demo.main(["--steps", "30", "--replicas", "2", "--no-progress", "--mixed-precision",
                              "--out", str(tmp_path)])
    finally:
        md.mixed_precision.set_global_policy(None)
    assert accuracy > 0.8  # 30 float16 steps learn most digits, as float32 ones do
    state = md.checkpoint.load_checkpoint(tmp_path / "digits.ckpt")
    assert state["model/layers/0/w"].dtype == np.float32  # float32 master weights
    assert int(state["optimizer/inner_optimizer/_iterations"]) == 30
    assert float(state["optimizer/dynamic_scale"]) == 2.0 ** 15  # no overflow: never lowered
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["loss"][-1] < history["loss"][0] / 2


def test_demo_skips_overflowing_steps_quietly_and_resumes_by_batches(tmp_path, monkeypatch):
    """A scale far too high: the first float16 backward passes overflow (no NumPy warning escapes; warnings are
    errors here), those steps are skipped and the scale comes down; a resumed run continues after the batches
    taken, not after the optimizer's (fewer) steps."""
    demo = _demo()
    monkeypatch.setattr(LSO.__init__, "__defaults__", (True, 2.0 ** 40, 2000, None))
    args = ["--replicas", "2", "--no-progress", "--mixed-precision", "--out", str(tmp_path)]
    try:
        demo.main(["--steps", "30", *args])
        first = md.checkpoint.load_checkpoint(tmp_path / "digits.ckpt")
        demo.main(["--steps", "40", *args, "--resume"])
    finally:
        md.mixed_precision.set_global_policy(None)
    skipped = 30 - int(first["optimizer/inner_optimizer/_iterations"])
    assert skipped > 0 and float(first["optimizer/dynamic_scale"]) == 2.0 ** (40 - skipped)
    resumed = md.checkpoint.load_checkpoint(tmp_path / "digits.ckpt")
    assert int(resumed["batches_taken"]) == 40
    assert int(resumed["optimizer/inner_optimizer/_iterations"]) == 40 - skipped
