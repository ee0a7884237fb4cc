"""md.optimizers.schedules against Keras 3's schedules, recorded from real Keras 3 / TensorFlow 2.21 by
tests/data/record_keras_schedules.py (values over steps incl. boundaries, warmup, staircase, cycle, restarts;
get_config and serialize), and as an optimizer's learning rate."""

import json
import os

import numpy as np
import pytest

import mirrored as md

S = md.optimizers.schedules
with open(os.path.join(os.path.dirname(__file__), "data", "keras_schedules.json")) as _f:
    DATA = json.load(_f)
STEPS = DATA["steps"]


@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_values_match_keras_over_steps(name):
    case = DATA["cases"][name]
    schedule = getattr(S, case["class"])(**case["kwargs"])
    got = np.array([schedule(s) for s in STEPS])
    assert all(np.asarray(schedule(s)).dtype == np.dtype(case["dtype"]) for s in (0, 3))
    # float32 rounding: cos/pow/log may differ from TensorFlow's by an ulp or two.
    np.testing.assert_allclose(got, np.float32(case["values"]), rtol=5e-7, atol=1e-9)
    # The step may come as a NumPy integer or an int64 variable (an optimizer's `iterations`).
    assert schedule(np.int64(STEPS[7])) == got[7]
    assert schedule(md.Variable(np.int64(STEPS[9]))) == got[9]


@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_config_and_serialize_round_trip_as_keras(name):
    case = DATA["cases"][name]
    schedule = getattr(S, case["class"])(**case["kwargs"])
    assert schedule.get_config() == case["config"]
    assert S.serialize(schedule) == case["serialized"]
    again = S.deserialize(case["serialized"])
    assert type(again) is type(schedule) and again.get_config() == case["config"]
    clone = type(schedule).from_config(schedule.get_config())
    assert [clone(s) for s in STEPS] == [schedule(s) for s in STEPS]


def test_defaults_are_keras():
    assert S.PolynomialDecay(0.1, 10).get_config() == {
        "initial_learning_rate": 0.1, "decay_steps": 10, "end_learning_rate": 0.0001, "power": 1.0, "cycle": False,
        "name": "PolynomialDecay"}
    assert S.CosineDecayRestarts(0.1, 10).get_config()["t_mul"] == 2.0
    assert S.CosineDecayRestarts(0.1, 10).name == "SGDRDecay"
    assert S.PiecewiseConstantDecay([1], [1.0, 0.5]).name == "PiecewiseConstant"
    assert S.CosineDecay(0.1, 10).get_config()["warmup_target"] is None


@pytest.mark.parametrize("cls, argument", [(S.ExponentialDecay, "decay_steps"), (S.InverseTimeDecay, "decay_steps"),
                                           (S.PolynomialDecay, "decay_steps"), (S.CosineDecay, "decay_steps"),
                                           (S.CosineDecayRestarts, "first_decay_steps")])
def test_bad_decay_steps_name_the_argument(cls, argument):
    extra = (0.5,) if cls in (S.ExponentialDecay, S.InverseTimeDecay) else ()
    with pytest.raises(ValueError, match=argument):
        cls(0.1, 0, *extra)
    with pytest.raises(TypeError, match=argument):
        cls(0.1, "10", *extra)


def test_piecewise_lengths_and_unknown_deserialize():
    with pytest.raises(ValueError, match="boundaries should be 1 less"):
        S.PiecewiseConstantDecay([1, 2], [1.0, 0.5])
    with pytest.raises(ValueError, match="Unknown decay"):
        S.deserialize({"class_name": "NoSuch", "config": {}})
    with pytest.raises(ValueError, match="class_name"):
        S.deserialize("ExponentialDecay")


def test_custom_schedule_subclass_and_custom_objects():
    class Halving(S.LearningRateSchedule):
        def __init__(self, rate):
            self.rate = rate

        def __call__(self, step):
            return self.rate / 2 ** int(step)

        def get_config(self):
            return {"rate": self.rate}

    config = S.serialize(Halving(0.8))
    assert config["class_name"] == "Halving" and config["registered_name"] == "Halving"
    assert S.deserialize(config, custom_objects={"Halving": Halving})(2) == 0.2
    with pytest.raises(NotImplementedError, match="__call__"):
        S.LearningRateSchedule()(0)


class _Counting(S.ExponentialDecay):
    calls: list

    def __call__(self, step):
        self.calls.append(int(step))
        return super().__call__(step)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_optimizer_calls_a_schedule_once_per_step_with_iterations_before_the_update(n):
    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])
    schedule = _Counting(0.1, 2, 0.5)
    schedule.calls = []
    with strategy.scope():
        variables = [md.Variable(np.ones(5, np.float32)), md.Variable(np.ones((2, 3), np.float32)),
                     md.Variable(np.float32(1.0))]
        opt = md.optimizers.SGD(learning_rate=schedule)
    expected = [np.ones(5, np.float32), np.ones((2, 3), np.float32), np.float32(1.0)]
    for step in range(5):
        def replica_step():
            opt.apply_gradients([(np.ones_like(np.asarray(v.values[0])), v) for v in variables])
        strategy.run(replica_step)
        lr = np.float32(0.1) * np.power(np.float32(0.5), np.float32(step) / np.float32(2))
        expected = [e - np.float32(n) * lr for e in expected]
    assert schedule.calls == list(range(5))  # once per step, not per variable or replica
    for var, e in zip(variables, expected):
        for copy in var.values:
            np.testing.assert_allclose(np.asarray(copy), e, rtol=1e-6)
