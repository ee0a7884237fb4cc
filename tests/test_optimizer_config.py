"""md.optimizers.get / serialize / deserialize and every optimizer's get_config / from_config against Keras
3.15's, recorded in tests/data/keras_optimizer_configs.json (tests/data/record_keras_optimizer_configs.py)."""

import json
import os

import numpy as np
import pytest

import mirrored as md

O = md.optimizers
S = O.schedules

with open(os.path.join(os.path.dirname(__file__), "data", "keras_optimizer_configs.json")) as _f:
    KERAS = json.load(_f)

OURS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax", "Adadelta", "Lion", "Ftrl", "Lamb",
        "Adafactor", "ScheduleFreeAdamW", "Muon"]


@pytest.mark.parametrize("cls", OURS)
def test_default_names_are_keras(cls):
    assert getattr(O, cls)().name == KERAS["default_names"][cls]
    assert getattr(O, cls)(name="mine").name == "mine"


def test_the_name_names_iterations():
    opt = O.RMSprop()
    opt.build([md.Variable(np.ones(2, np.float32), name="w")])
    assert opt.iterations.name == "rm_sprop/iterations:0"


@pytest.mark.parametrize("label", sorted(KERAS["configs"]))
def test_config_round_trips_keras_config(label):
    recorded = KERAS["configs"][label]
    opt = getattr(O, recorded["class"]).from_config(recorded["config"])
    assert opt.get_config() == recorded["config"]
    assert type(opt) is getattr(O, recorded["class"])


@pytest.mark.parametrize("label", sorted(KERAS["serialized"]))
def test_deserialize_keras_serialized_and_serialize_back(label):
    recorded = KERAS["serialized"][label]
    opt = O.deserialize(json.loads(json.dumps(recorded)))
    assert type(opt).__name__ == recorded["class_name"]
    assert O.serialize(opt) == recorded


def test_config_of_directly_built_optimizers_is_keras():
    cases = {
        "sgd nesterov": O.SGD(0.1, momentum=0.9, nesterov=True, clipnorm=1.0, name="opt_sgd_nesterov"),
        "adam amsgrad": O.Adam(0.01, amsgrad=True, weight_decay=0.01, use_ema=True, ema_momentum=0.9,
                               ema_overwrite_frequency=3, name="opt_adam_amsgrad"),
        "ftrl": O.Ftrl(learning_rate_power=-0.7, l1_regularization_strength=0.01, beta=0.1, name="opt_ftrl"),
        "sgd schedule": O.SGD(S.ExponentialDecay(0.1, 10, 0.5, staircase=True), name="opt_sgd_schedule"),
        "rmsprop piecewise": O.RMSprop(S.PiecewiseConstantDecay([10, 20], [0.1, 0.01, 0.001]),
                                       name="opt_rmsprop_piecewise"),
    }
    for label, opt in cases.items():
        assert opt.get_config() == KERAS["configs"][label]["config"], label


@pytest.mark.parametrize("name", sorted(KERAS["get"]))
def test_get_a_name_in_any_case(name):
    recorded = KERAS["get"][name]
    opt = O.get(name)
    assert type(opt) is getattr(O, recorded["class"])
    config = opt.get_config()
    assert config.pop("name") == KERAS["default_names"][recorded["class"]]
    assert config == recorded["config"]


@pytest.mark.parametrize("name", sorted(KERAS["bad"]))
def test_get_an_unknown_name_is_keras_value_error(name):
    with pytest.raises(ValueError) as info:
        O.get(name)
    assert str(info.value) == KERAS["bad"][name]


@pytest.mark.parametrize("identifier", [42, 0.1, O.Adam, ["adam"], {"class_name": "Nope", "config": {}},
                                        {"config": {}}, {"class_name": 3}])
def test_get_anything_else_names_it(identifier):
    with pytest.raises(ValueError, match="Could not interpret optimizer identifier"):
        O.get(identifier)


def test_get_passes_instances_and_none_through_and_reads_dicts():
    opt = O.Lion()
    assert O.get(opt) is opt
    assert O.get(None) is None
    made = O.get({"class_name": "adamax", "config": {"learning_rate": 0.5, "beta_1": 0.8}})
    assert type(made) is O.Adamax and (made.learning_rate, made.beta_1) == (0.5, 0.8)
    assert type(O.get({"class_name": "Nadam"})) is O.Nadam  # (the config is optional, as in Keras)
    lso = O.LossScaleOptimizer(O.SGD())
    assert O.get(lso) is lso
    # Keras 3.15 leaves Lamb out of its lookup table (its get("lamb") raises); ours finds it.
    assert type(O.get("Lamb")) is O.Lamb and O.deserialize(O.serialize(O.Lamb(0.5))).learning_rate == 0.5


def test_deserialized_schedule_drives_the_steps():
    opt = O.deserialize(O.serialize(O.SGD(S.ExponentialDecay(0.5, 1, 0.5))))
    assert isinstance(opt._learning_rate, S.ExponentialDecay) and opt.learning_rate == np.float32(0.5)
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = md.Variable(np.zeros(3, np.float32), name="w")
        opt.build([w])
    for _ in range(2):
        strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), w)]))
    # Two replicas sum their gradients (2 per element): 0.5 * 2 at step 0, then 0.25 * 2.
    np.testing.assert_allclose(np.asarray(w.numpy()), np.full(3, -1.5, np.float32))


def test_arguments_survive_the_round_trip_and_state_does_not():
    opt = O.Adam(0.02, beta_1=0.8, clipvalue=0.5, gradient_aggregation="mean", name="a")
    opt.build([md.Variable(np.ones(2, np.float32))])
    copy = O.deserialize(O.serialize(opt))
    assert copy.get_config() == opt.get_config()
    assert copy.get_config()["gradient_aggregation"] == "mean"  # (ours: only when not Keras' sum)
    assert "gradient_aggregation" not in O.Adam().get_config()
    assert not copy.built and copy.variables == []


def test_loss_scale_optimizer_round_trip():
    lso = O.LossScaleOptimizer(O.Adam(0.01, name="inner"), initial_scale=64.0, dynamic_growth_steps=10)
    config = O.serialize(lso)
    assert config["class_name"] == "LossScaleOptimizer" and config["module"] == "keras.optimizers"
    assert config["config"]["initial_scale"] == 64.0 and config["config"]["dynamic_growth_steps"] == 10
    assert config["config"]["inner_optimizer"] == O.serialize(lso.inner_optimizer)
    back = O.deserialize(config)
    assert type(back) is O.LossScaleOptimizer and type(back.inner_optimizer) is O.Adam
    assert back.get_config() == lso.get_config()
    fixed = O.deserialize(O.serialize(O.LossScaleOptimizer(O.SGD(), dynamic=False)))
    assert fixed.dynamic is False
    with pytest.raises(ValueError, match="inner_optimizer"):
        O.deserialize({"class_name": "LossScaleOptimizer", "config": {}})


class Tuned(O.SGD):
    def __init__(self, scale=2.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


class Halving(S.LearningRateSchedule):
    def __init__(self, start):
        self.start = start

    def __call__(self, step):
        return self.start / 2 ** step

    def get_config(self):
        return {"start": self.start}


def test_custom_classes_through_custom_objects():
    opt = Tuned(scale=3.0, learning_rate=Halving(0.4))
    config = O.serialize(opt)
    assert config["class_name"] == "Tuned" and config["registered_name"] == "Tuned"
    assert opt.name == "tuned"
    back = O.deserialize(config, custom_objects={"Tuned": Tuned, "Halving": Halving})
    assert type(back) is Tuned and back.scale == 3.0 and back.learning_rate_at(1) == 0.2
    with pytest.raises(ValueError, match="Unknown optimizer: 'Tuned'.*custom_objects"):
        O.deserialize(config)


@pytest.mark.parametrize("config, match", [
    ("adam", "config: expected a dict"),
    ({"config": {}}, "config: expected a dict with 'class_name'"),
    ({"class_name": "Adam", "config": [1]}, r"config\['config'\]=\[1\]"),
    ({"class_name": "Adam", "config": {"beta_9": 1}}, r"not recognized: \{'beta_9': 1\}"),
    ({"class_name": "Adam", "config": {"beta_1": 2.0}}, "beta_1=2.0"),
])
def test_deserialize_bad_input_names_it(config, match):
    with pytest.raises(ValueError, match=match):
        O.deserialize(config)


def test_serialize_passes_none_and_names_and_rejects_the_rest():
    assert O.serialize(None) is None and O.serialize("adam") == "adam"
    with pytest.raises(TypeError, match="optimizer=3"):
        O.serialize(3)


def test_the_learning_rate_property_is_keras_current_value():
    """Keras 3.15: a schedule's value at the current step (not the schedule), a callable of no arguments' value,
    and a schedule's learning rate is not settable (TypeError); recorded from Keras."""
    w = md.Variable(np.ones(2, np.float32))  # (no strategy: Keras' own loop)
    opt = O.SGD(S.ExponentialDecay(0.1, 1, 0.5))
    assert opt.learning_rate == np.float32(0.1)
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    assert opt.learning_rate == np.float32(0.05) and np.allclose(w.numpy(), [0.9, 0.9])
    with pytest.raises(TypeError, match="learning rate is not settable"):
        opt.learning_rate = 0.3
    plain = O.SGD(learning_rate=lambda: 0.25)  # Keras' callable of no arguments
    assert plain.learning_rate == 0.25
    v = md.Variable(np.ones(2, np.float32))
    plain.apply_gradients([(np.ones(2, np.float32), v)])
    np.testing.assert_allclose(v.numpy(), [0.75, 0.75])
    by_step = O.SGD(learning_rate=lambda step: 0.5)  # a function of the step is given as is
    assert callable(by_step.learning_rate)
