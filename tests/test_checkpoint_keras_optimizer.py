"""Optimizer state in checkpoints under Keras 3's names (tests/data/keras_optimizer_checkpoints.json and the
checkpoints beside it, written by TF 2.21 + Keras 3.15: tests/data/record_keras_optimizer_checkpoints.py).

For each recorded optimizer configuration, with no strategy and MirroredStrategy over 2 CPU replicas: mirrored's
file lists exactly Keras' names, shapes and dtypes (``_iterations``, ``_learning_rate``, the slots as
``_variables/N`` in build order, Nadam's ``_u_product``, a LossScaleOptimizer's own state); a TF-written file
restored before the first step leaves the slots waiting for the build (as Keras) and the model then continues as
Keras continued from that file; files of earlier mirrored builds (slots keyed by their variable's path) still
restore; another optimizer kind's file and a shape mismatch are refused, naming the slot.
"""

import json
import os

import numpy as np
import pytest

import mirrored as md
from mirrored.train.checkpoint import _write_atomic

DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "keras_optimizer_checkpoints.json")) as _f:
    RECORDED = json.load(_f)
CASES = sorted(RECORDED["cases"])
STEPS = RECORDED["steps"]


def _halving(step):
    return 0.1 if step < 2 else 0.05  # the recorder's Halving schedule


def make_optimizer(description):
    kind, kwargs = description
    if kind == "LossScaleOptimizer":
        return md.mixed_precision.LossScaleOptimizer(make_optimizer(kwargs["inner"]),
                                                     initial_scale=kwargs["initial_scale"])
    kwargs = dict(kwargs)
    if kwargs.get("learning_rate") == "halving":
        kwargs["learning_rate"] = _halving
    return getattr(md.optimizers, kind)(**kwargs)


_STRATEGIES = {}


def strategy(n):
    if n not in _STRATEGIES:
        _STRATEGIES[n] = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    return _STRATEGIES[n]


def setup(case, n, w=None, b=None):
    with strategy(n).scope():
        model = {"w": md.Variable(np.array(RECORDED["w0"] if w is None else w, np.float32)),
                 "b": md.Variable(np.array(RECORDED["b0"] if b is None else b, np.float32))}
        return model, make_optimizer(RECORDED["cases"][case]["mirrored"])


def train(n, model, opt, first, count):
    for k in range(first, first + count):
        gw, gb = (np.array(g, np.float32) for g in RECORDED["grads"][k])
        strategy(n).run(lambda: opt.apply_gradients([(gw, model["w"]), (gb, model["b"])]))


def replicas(v):
    return [np.asarray(x) for x in v.values] if hasattr(v, "values") else [np.asarray(v.numpy())]


def tf_file(case, n):
    return os.path.join(DATA, "keras_optimizer_checkpoints", f"{case}_{n}", "ckpt")


def consumed(status):
    try:
        status.assert_consumed()
        return True
    except AssertionError:
        return False


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_our_file_lists_keras_names_shapes_dtypes_and_values(case, n, tmp_path):
    model, opt = setup(case, n)
    train(n, model, opt, 0, STEPS)
    path = md.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    want = RECORDED["cases"][case]["runs"][str(n)]
    assert [[name, shape] for name, shape in md.train.list_variables(path)] == \
        [[name, shape] for name, shape, _ in want["names"]]
    for name, _, dtype in want["names"]:
        value = md.train.load_variable(path, name)
        assert value.dtype == np.dtype(dtype), name
        np.testing.assert_allclose(value, np.asarray(want["values"][name], dtype), rtol=2e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_tf_file_restores_and_training_continues_as_keras(case, n):
    want = RECORDED["cases"][case]["runs"][str(n)]
    model, opt = setup(case, n, np.zeros((3, 2)), np.zeros(2))
    status = md.train.Checkpoint(model=model, optimizer=opt).read(tf_file(case, n))
    # As Keras: the slots are created at the first step, so until then the file's slots are unresolved (a
    # LossScaleOptimizer's scale state is created with it here, at build in Keras: only slots wait).
    assert consumed(status) == (want["status_before_build"] == "consumed" or case.startswith("loss_scale")
                                and "_variables" not in str(want["names"]))
    train(n, model, opt, STEPS, STEPS)
    status.assert_consumed()
    assert int(opt.iterations) == want["iterations"]
    for name in ("w", "b"):
        # TF 2.21 fills slots created after a restore under MirroredStrategy on its first replica only
        # (docs/tf_semantics.md): each of mirrored's replicas continues as TF's uninterrupted run.
        for got in replicas(model[name]):
            np.testing.assert_allclose(got, want["continued"][name][0], rtol=2e-6, atol=2e-7, err_msg=name)
        if n == 1 and case != "schedule_free_adamw":
            np.testing.assert_allclose(replicas(model[name])[0], want["resumed"][name][0], rtol=2e-6, atol=2e-7)


def test_schedule_free_momentum_survives_a_restore_before_the_build_unlike_keras():
    """Keras 3.15's ScheduleFreeAdamW.build restores a file read before it, then assigns each momentum a copy of
    its variable, so its resumed run loses z (velocity and iterations survive). Here momentum survives: the
    resumed run is the uninterrupted one, as for every other optimizer."""
    want = RECORDED["cases"]["schedule_free_adamw"]["runs"]["1"]
    assert not np.allclose(want["resumed"]["w"][0], want["continued"]["w"][0], rtol=1e-3)
    model, opt = setup("schedule_free_adamw", 1, np.zeros((3, 2)), np.zeros(2))
    md.train.Checkpoint(model=model, optimizer=opt).read(tf_file("schedule_free_adamw", 1))
    opt.build([model["w"], model["b"]])
    for k, name in enumerate(("w", "b")):  # _variables/2..5: w's momentum and velocity, then b's
        key = f"optimizer/_variables/{2 + 2 * k}/.ATTRIBUTES/VARIABLE_VALUE"
        np.testing.assert_array_equal(opt.get_slot(model[name], "momentum").numpy(),
                                      md.train.load_variable(tf_file("schedule_free_adamw", 1), key))


@pytest.mark.parametrize("case", ["adam_all", "rmsprop_centered_momentum", "nadam"])
def test_restore_into_a_built_optimizer(case):
    want = RECORDED["cases"][case]["runs"]["1"]
    model, opt = setup(case, 1, np.zeros((3, 2)), np.zeros(2))
    opt.build([model["w"], model["b"]])
    md.train.Checkpoint(model=model, optimizer=opt).read(tf_file(case, 1)).assert_consumed()
    train(1, model, opt, STEPS, STEPS)
    np.testing.assert_allclose(model["w"].numpy(), want["continued"]["w"][0], rtol=2e-6, atol=2e-7)


def test_our_file_round_trips_through_a_fresh_optimizer(tmp_path):
    model, opt = setup("adam_all", 2)
    train(2, model, opt, 0, STEPS)
    path = md.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    train(2, model, opt, STEPS, STEPS)
    model2, opt2 = setup("adam_all", 2, np.zeros((3, 2)), np.zeros(2))
    status = md.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
    assert not consumed(status)  # the slots wait for the build, as Keras'
    train(2, model2, opt2, STEPS, STEPS)
    status.assert_consumed()
    for name in ("w", "b"):
        for got, expected in zip(replicas(model2[name]), replicas(model[name])):
            np.testing.assert_array_equal(got, expected)


def test_restored_learning_rate_replaces_the_constructed_one():
    model, opt = setup("adam", 1)
    opt.learning_rate = 0.5
    md.train.Checkpoint(model=model, optimizer=opt).read(tf_file("adam", 1))
    assert opt.learning_rate == float(np.float32(0.1))


def _legacy_file(path, model, opt):
    """The file an earlier mirrored wrote for ``model`` and ``opt`` (built and stepped): tensors under TF's
    names, slots under ``optimizer/slots/<variable path>/<slot name>``, no learning rate."""
    arrays = {f"model/{k}/.ATTRIBUTES/VARIABLE_VALUE": replicas(v)[0] for k, v in model.items()}
    arrays["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] = np.asarray(opt.iterations.numpy())
    for k, v in model.items():
        for slot in ("momentum", "velocity"):
            arrays[f"optimizer/slots/model/{k}/{slot}/.ATTRIBUTES/VARIABLE_VALUE"] = replicas(opt.get_slot(v, slot))[0]
    _write_atomic(path, arrays)


@pytest.mark.parametrize("n", [1, 2])
def test_files_of_earlier_builds_still_restore(n, tmp_path):
    model, opt = setup("adam", n)
    train(n, model, opt, 0, STEPS)
    path = str(tmp_path / "old")
    _legacy_file(path, model, opt)
    train(n, model, opt, STEPS, STEPS)
    model2, opt2 = setup("adam", n, np.zeros((3, 2)), np.zeros(2))
    status = md.train.Checkpoint(model=model2, optimizer=opt2).read(path)
    status.assert_consumed()  # slots of a file that names their variables are created at once
    train(n, model2, opt2, STEPS, STEPS)
    for name in ("w", "b"):
        for got, expected in zip(replicas(model2[name]), replicas(model[name])):
            np.testing.assert_array_equal(got, expected)


def test_another_optimizer_kinds_file_is_refused_naming_the_slots():
    model, opt = setup("adam", 1, np.zeros((3, 2)), np.zeros(2))
    status = md.train.Checkpoint(model=model, optimizer=opt).read(tf_file("sgd_momentum", 1))
    with pytest.raises(md.train.CheckpointError,
                       match=r"the file holds the slot variables optimizer/_variables/2\.\.3 \(2\), Adam 'adam' has "
                             r"optimizer/_variables/2\.\.5 \(4\) \(momentum, velocity of 2 variables.*"
                             r"another optimizer kind"):
        train(1, model, opt, STEPS, 1)
    assert not consumed(status)


def test_another_optimizer_kinds_file_into_a_built_optimizer_assigns_nothing():
    model, opt = setup("adam", 1)
    opt.build([model["w"], model["b"]])
    before = model["w"].numpy().copy()
    with pytest.raises(md.train.CheckpointError, match="another optimizer kind"):
        md.train.Checkpoint(model=model, optimizer=opt).read(tf_file("adam_amsgrad", 1))
    np.testing.assert_array_equal(model["w"].numpy(), before)


def test_shape_mismatch_names_the_slot():
    # The recorded model's w is (3, 2); the same optimizer over a w of (2, 3) builds slots of another shape.
    model, opt = setup("sgd_momentum", 1, np.zeros((2, 3)), np.zeros(2))
    md.train.Checkpoint(optimizer=opt).read(tf_file("sgd_momentum", 1))
    with pytest.raises(md.train.CheckpointError,
                       match=r"optimizer/_variables/2 \(the momentum of variable '.*'\) has float32\[3, 2\].*"
                             r"float32\[2, 3\]"):
        opt.build([model["w"], model["b"]])


def test_shape_mismatch_of_a_built_optimizer_names_the_slot():
    model, opt = setup("sgd_momentum", 1, np.zeros((2, 3)), np.zeros(2))
    opt.build([model["w"], model["b"]])
    with pytest.raises(md.train.CheckpointError, match=r"optimizer/_variables/2 \(the momentum of variable .*\): "
                                                       r"file has float32\[3, 2\], variable is float32\[2, 3\]"):
        md.train.Checkpoint(optimizer=opt).read(tf_file("sgd_momentum", 1))


def test_slots_are_numbered_in_build_order_not_by_name(tmp_path):
    # Keras numbers by the build's var_list order: built over [b, w], b's momentum is _variables/2.
    model, opt = setup("sgd_momentum", 1)
    opt.build([model["b"], model["w"]])
    train(1, model, opt, 0, 1)
    path = md.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ckpt"))
    assert [shape for name, shape in md.train.list_variables(path) if "_variables" in name] == [[2], [3, 2]]
    np.testing.assert_array_equal(md.train.load_variable(path, "optimizer/_variables/2/.ATTRIBUTES/VARIABLE_VALUE"),
                                  opt.get_slot(model["b"], "momentum").numpy())
    # TF's file was built over [w, b]: an optimizer built the other way round is told which slot does not fit.
    model2, opt2 = setup("sgd_momentum", 1)
    opt2.build([model2["b"], model2["w"]])
    with pytest.raises(md.train.CheckpointError, match=r"optimizer/_variables/2 \(the momentum of variable "
                                                       r"'.*'\): file has float32\[3, 2\], variable is float32\[2\]"):
        md.train.Checkpoint(model=model2, optimizer=opt2).read(tf_file("sgd_momentum", 1))


@pytest.mark.parametrize("case,order", [
    ("adam_all", [("average", "w"), ("average", "b"), ("gradient_accumulator", "w"), ("gradient_accumulator", "b"),
                  ("momentum", "w"), ("velocity", "w"), ("momentum", "b"), ("velocity", "b"),
                  ("velocity_hat", "w"), ("velocity_hat", "b")]),
    ("rmsprop_centered_momentum", [("velocity", "w"), ("velocity", "b"), ("momentum", "w"), ("momentum", "b"),
                                   ("average_gradient", "w"), ("average_gradient", "b")])])
def test_variables_lists_the_slots_in_keras_order(case, order):
    # Keras' _variables less its learning rate (a number here): iterations, then the slots in build order.
    model, opt = setup(case, 1)
    train(1, model, opt, 0, 1)
    assert [id(v) for v in opt.variables] == [id(opt._iterations)] + [
        id(opt.get_slot(model[var], slot)) for slot, var in order]
    recorded = {int(name.split("/")[2]): shape for name, shape, _ in RECORDED["cases"][case]["runs"]["1"]["names"]
                if "/_variables/" in name}
    assert [list(v.shape) for v in opt.variables[1:]] == [recorded[i] for i in sorted(recorded)]
