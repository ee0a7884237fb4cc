"""md.OneDeviceStrategy and md.TensorShape against TensorFlow 2.21's answers (tests/one_device_scenarios.py,
recorded by tests/data/record_tf_one_device.py), and OneDeviceStrategy training like MirroredStrategy with one
device and like the plain loop, on the CPU and on a (simulated) GPU."""

import json
import os
import pickle
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
import one_device_scenarios as scenarios
from gpu_env import SKIP_REASON, cupy
import test_tf_semantics_parity as semantics_parity

with open(os.path.join(os.path.dirname(__file__), "data", "tf_one_device_reference.json")) as _f:
    REFERENCE = json.load(_f)


class Mirrored(semantics_parity.Mirrored):
    """The scenarios' adapter over mirrored: tf_semantics' and what one_device_scenarios adds."""

    TensorShape = md.TensorShape
    optimizers = md.optimizers

    @staticmethod
    def one_device(device):
        return md.OneDeviceStrategy(device)

    @staticmethod
    def mirrored_one():
        return md.MirroredStrategy(["/cpu:0"])

    @staticmethod
    def checkpoint_keys(root):
        path = md.train.Checkpoint(**root).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
        return sorted(md.train.load_checkpoint(path))  # the variables' object paths


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE["scenarios"]) == sorted(scenarios.SCENARIOS)


def assert_scenario_matches(scenarios_module, reference, adapter, name):
    """Scenario ``name`` of ``scenarios_module`` over ``adapter`` gives TF's recorded result (``reference``), and
    where TF raised, mirrored's message carries the scenario's key words."""
    fn, words = scenarios_module.SCENARIOS[name]
    want = reference["scenarios"][name]
    got = scenarios_module.run_scenario(adapter, fn)
    semantics_parity.assert_same(got, want)
    if "raises" in want:
        for word in words:
            assert word.lower() in got["msg"].lower(), (word, got["msg"])


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_strategy_matches_tensorflow(name):
    assert_scenario_matches(scenarios, REFERENCE, Mirrored(), name)


def test_tensor_shape_matches_tensorflow():
    want = REFERENCE["tensor_shape"]
    got = scenarios.tensor_shape_cases(Mirrored())
    assert sorted(got) == sorted(want)
    for case in want:
        if isinstance(want[case], dict) and "raises" in want[case]:
            assert got[case]["raises"] == want[case]["raises"], (case, got[case], want[case])
            assert got[case]["msg"] == want[case]["msg"] or want[case]["raises"] == "IndexError", case
        else:
            assert got[case] == want[case] and type(got[case]) is type(want[case]), (case, got[case], want[case])


# --- TensorShape where NumPy code meets it ---------------------------------------------------------------------

dims = st.lists(st.one_of(st.none(), st.integers(0, 5)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(dims, dims)
def test_tensor_shape_is_the_tuple_for_tuple_code(a, b):
    s = md.TensorShape(a)
    assert s == tuple(a) and hash(s) == hash(tuple(a)) and tuple(s) == tuple(a) and list(s) == a
    assert (s == md.TensorShape(b)) == (a == b) and (s != tuple(b)) == (a != b)
    assert {s: 1}[tuple(a)] == 1
    assert pickle.loads(pickle.dumps(s)) == s and type(pickle.loads(pickle.dumps(s))) is md.TensorShape
    compatible = len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))
    assert s.is_compatible_with(b) == compatible
    assert s.concatenate(b) == tuple(a + b)
    if None not in a:
        assert s.num_elements() == int(np.prod(a, dtype=np.int64)) and np.zeros(s).shape == s


def test_unknown_rank_and_bad_dims():
    unknown = md.TensorShape(None)
    assert unknown.rank is None and unknown.dims is None and unknown != () and unknown == md.TensorShape(None)
    assert unknown.merge_with([2, None]) == (2, None)
    assert pickle.loads(pickle.dumps(unknown)) == unknown
    with pytest.raises(TypeError, match="dims=.*'a' is not an int or None"):
        md.TensorShape([2, "a"])
    with pytest.raises(ValueError, match="dims=.*-1 is negative; use None"):
        md.TensorShape([-1])


def test_variables_shapes_are_tensor_shapes_and_arrays_keep_theirs():
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        mirrored = md.Variable(np.zeros((2, 3), np.float32))
        on_read = md.Variable(np.zeros(4), synchronization=md.VariableSynchronization.ON_READ,
                              aggregation=md.VariableAggregation.SUM)
    for v in (mirrored, on_read, mirrored.values[1], md.Variable(np.float32(1))):
        assert type(v.shape) is md.TensorShape and v.get_shape() is v.shape
        assert v.shape.as_list() == list(np.shape(v.numpy()))
        assert type(v.numpy().shape) is tuple and type(v.read_value().shape) is tuple
    assert repr(mirrored.values[0]) == ("<mirrored.Variable 'Variable:0' shape=(2, 3) dtype=float32, "
                              "numpy=\narray([[0., 0., 0.],\n       [0., 0., 0.]], dtype=float32)>")  # TF's line break


# --- OneDeviceStrategy ----------------------------------------------------------------------------------------

def test_bad_devices_name_the_argument():
    for bad in (3, ["/cpu:0"], ("/cpu:0", "/cpu:1"), "/tpu:0", "/cpu:0/gpu:0"):
        with pytest.raises(ValueError, match="device"):
            md.OneDeviceStrategy(bad)
    with pytest.raises(TypeError):
        md.OneDeviceStrategy()  # TF's: the device is required


def test_exported_where_tf_has_it():
    assert md.OneDeviceStrategy is md.distribute.OneDeviceStrategy
    assert "OneDeviceStrategy" in md.distribute.__all__
    assert isinstance(md.OneDeviceStrategy("/cpu:0"), md.distribute.Strategy)


def test_update_takes_any_variable_and_runs_on_the_device():
    s = md.OneDeviceStrategy("/cpu:0")
    outside = md.Variable(np.float32(1))  # TF's OneDeviceStrategy applies fn to whatever it is given
    seen = []
    s.extended.update(outside, lambda v: (seen.append(md.device_util.current()), v.assign_add(1.0)))
    assert outside.numpy() == 2.0 and seen == ["/job:localhost/replica:0/task:0/device:CPU:0"]


def test_checkpoint_restores_one_device_variables_into_mirrored_ones(tmp_path):
    """TF's names are the object graph's, not the strategy's: a checkpoint of OneDeviceStrategy variables
    restores into MirroredStrategy variables and back."""
    one = md.OneDeviceStrategy("/cpu:0")
    with one.scope():
        w = md.Variable(np.arange(3, dtype=np.float32))
    assert_restores_into_mirrored_and_back(w, tmp_path)


def assert_restores_into_mirrored_and_back(w, tmp_path):
    """A checkpoint of ``w`` (0, 1, 2 in float32) restores into a variable of a 2-replica MirroredStrategy, and
    a checkpoint of that one back into ``w``."""
    path = md.train.Checkpoint(w=w).save(str(tmp_path / "original"))
    mirrored = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with mirrored.scope():
        m = md.Variable(np.zeros(3, np.float32))
    md.train.Checkpoint(w=m).restore(path)
    assert [c.numpy().tolist() for c in m.values] == [[0, 1, 2]] * 2
    m.assign(np.full(3, 7, np.float32))
    md.train.Checkpoint(w=w).restore(md.train.Checkpoint(w=m).save(str(tmp_path / "mirrored")))
    assert w.numpy().tolist() == [7, 7, 7]


def _train(strategy, optimizer, xp, steps=4, loss_scale=False):
    """Weights after ``steps`` steps of a least-squares fit, under ``strategy`` (None: no strategy)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)

    def build():
        w = md.Variable(np.linspace(-1, 1, 3, dtype=np.float32).reshape(3, 1), name="w")
        b = md.Variable(np.zeros(1, np.float32), name="b")
        opt = optimizer()
        if loss_scale:
            opt = md.mixed_precision.LossScaleOptimizer(opt, dynamic=False, initial_scale=128.0)
        return w, b, opt

    if strategy is None:
        w, b, opt = build()
    else:
        with strategy.scope():
            w, b, opt = build()

    def step(xb, yb):
        xb, yb = xp.asarray(xb), xp.asarray(yb)
        err = xb @ w.read_value() + b.read_value() - yb
        scale = 128.0 if loss_scale else 1.0
        gw, gb = (xb.T @ err) * (2 * scale / len(xb)), err.sum(axis=0) * (2 * scale / len(xb))
        grads = opt.get_unscaled_gradients([gw, gb]) if loss_scale else [gw, gb]
        opt.apply_gradients(zip(grads, [w, b]))

    for _ in range(steps):
        if strategy is None:
            step(x, y)
        else:
            strategy.run(step, args=(x, y))
    return [np.asarray(md.device_util.to_host(v.read_value())) for v in (w, b)]


OPTIMIZERS = {"sgd": lambda: md.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: md.optimizers.Adam(0.05)}


@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_trains_as_mirrored_with_one_device_and_as_the_plain_loop(name, loss_scale):
    optimizer = OPTIMIZERS[name]
    one = _train(md.OneDeviceStrategy("/cpu:0"), optimizer, np, loss_scale=loss_scale)
    for other in (_train(md.MirroredStrategy(["/cpu:0"]), optimizer, np, loss_scale=loss_scale),
                  _train(None, optimizer, np, loss_scale=loss_scale)):
        for a, b in zip(one, other):
            np.testing.assert_array_equal(a, b)


def function_steps(s, compiled, xp=np):
    """Four SGD steps of ``s`` (eager, or through md.function when ``compiled``): the weights and the losses."""
    with s.scope():
        w = md.Variable(np.ones(3, np.float32))
        opt = md.optimizers.SGD(0.1)

    def step(x):
        opt.apply_gradients([(w.read_value() * x, w)])
        return md.get_replica_context().all_reduce("SUM", (w.read_value() ** 2).sum())

    fn = md.function(step) if compiled else step
    losses = [float(s.reduce("SUM", s.run(fn, args=(xp.float32(i + 1),)), axis=None)) for i in range(4)]
    return np.asarray(md.device_util.to_host(w.read_value())), losses


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
def test_md_function_step_on_a_gpu_matches_the_eager_one():
    """md.function captures a OneDeviceStrategy's GPU step as it does a one-replica MirroredStrategy's."""
    eager = function_steps(md.OneDeviceStrategy("/gpu:0"), False)
    compiled = function_steps(md.OneDeviceStrategy("/gpu:0"), True)
    np.testing.assert_allclose(eager[0], compiled[0], rtol=1e-6)
    np.testing.assert_allclose(eager[1], compiled[1], rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None, reason=SKIP_REASON)
@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_on_a_gpu_trains_as_on_the_cpu(name, loss_scale):
    s = md.OneDeviceStrategy("/gpu:0")
    assert s.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:GPU:0",)
    with s.scope():
        v = md.Variable(np.ones(2, np.float32))
    assert v.device.endswith("GPU:0") and isinstance(v.read_value(), cupy.ndarray)
    batches = list(s.experimental_distribute_dataset(md.data.Dataset.range(6).batch(4)))
    assert [type(b) for b in batches] == [cupy.ndarray] * 2 and [b.shape for b in batches] == [(4,), (2,)]
    out = s.run(lambda: md.get_replica_context().all_reduce("SUM", v.read_value() * 2))
    assert isinstance(out, cupy.ndarray) and s.reduce("SUM", out, axis=0) == 4.0
    on_gpu = _train(s, OPTIMIZERS[name], cupy, loss_scale=loss_scale)
    on_cpu = _train(md.OneDeviceStrategy("/cpu:0"), OPTIMIZERS[name], np, loss_scale=loss_scale)
    for a, b in zip(on_gpu, on_cpu):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_tf1_spelling():
    s = md.compat.v1.distribute.OneDeviceStrategy("/cpu:0")
    assert isinstance(s, md.OneDeviceStrategy) and s.num_replicas_in_sync == 1
    rows = list(s.experimental_distribute_dataset(s.experimental_make_numpy_dataset(np.arange(5), session=None)
                                                 .batch(2)))
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4]]
