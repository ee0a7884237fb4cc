"""TensorFlow's signatures: md.Variable in tf.Variable's positional order, MultiWorkerMirroredStrategy's
(cluster_resolver, communication_options), md.train.ClusterSpec's methods. Expected values recorded from
TensorFlow 2.21 (tests/data/tfport_reference.json)."""

import importlib
import json
import pathlib

import numpy as np
import pytest

import mirrored as md
from conftest import cpus
from mirrored.cluster_resolver import SimpleClusterResolver

REFERENCE = json.loads((pathlib.Path(__file__).resolve().parent / "data" / "tfport_reference.json").read_text())
TF_VARIABLE, TF_SPEC = REFERENCE["variable"], REFERENCE["cluster_spec"]


def clip(x):
    return np.clip(x, -1.0, 1.0)


# --- md.Variable ---------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [None, 2])
def test_trainable_is_the_second_positional_argument(replicas):
    strategy = md.MirroredStrategy(cpus(replicas)) if replicas else md.get_strategy()
    with strategy.scope():
        assert md.Variable(1.0, False).trainable is TF_VARIABLE["positional_trainable_false"] is False
        assert md.Variable(1.0, True).trainable and md.Variable(1.0).trainable
        on_read = md.Variable(1.0, synchronization=md.VariableSynchronization.ON_READ,
                              aggregation=md.VariableAggregation.SUM)
        assert on_read.trainable is TF_VARIABLE["on_read_default_trainable"] is False
        full = md.Variable(np.zeros(2), True, True, "/cpu:0", "w", None, np.float32, None, clip,
                           md.VariableSynchronization.ON_WRITE, md.VariableAggregation.MEAN, (2,))
    assert (full.name, full.dtype, full.shape, full.aggregation, full.constraint) == (
        "w:0", np.float32, (2,), md.VariableAggregation.MEAN, clip)


@pytest.mark.parametrize("replicas", [None, 2])
def test_constraint_is_kept_and_assign_ignores_it_as_in_tensorflow(replicas):
    strategy = md.MirroredStrategy(cpus(replicas)) if replicas else md.get_strategy()
    with strategy.scope():
        v = md.Variable(np.array([1.0, -2.0, 3.0], np.float32), constraint=clip)
        v.assign(np.array([5.0, 5.0, 5.0], np.float32))
    assert v.constraint is clip and md.Variable(1.0).constraint is None
    assert v.numpy().tolist() == TF_VARIABLE["assign_ignores_constraint"]
    assert v.constraint(v).tolist() == [1.0, 1.0, 1.0]  # what an optimizer assigns after its update


@pytest.mark.parametrize("kwargs, words", [
    ({"constraint": 3}, "constraint=3: Argument `constraint` must be None or a callable"),
    ({"variable_def": object()}, "variable_def and initial_value args to `tf.Variable` are mutually exclusive.*"
                                 "pass initial_value only"),
    ({"caching_device": 0}, "caching_device=0: expected a device string"),
    ({"shape": (3,)}, r"the initial value's shape \(\(2,\)\) is not compatible with the explicitly supplied "
                      r"`shape` argument \(\[3\]\). \(variable 'Variable': pass shape=\(2,\)"),
    ({"shape": (None,)}, r"shape=\(None,\).*unknown dimensions are not supported"),
    ({"shape": "ab"}, "shape='ab'"),
    ({"trainable": "w"}, r"trainable='w': expected True, False or None.*md.Variable\(x, name='w'\)"),
])
def test_arguments_without_meaning_here_are_refused_by_name(kwargs, words):
    assert "must be None or a callable" in TF_VARIABLE["constraint_not_callable"]
    with pytest.raises(ValueError, match=words):
        md.Variable(np.zeros(2), **kwargs)


def test_the_earlier_positional_order_is_refused_not_misread():
    with pytest.raises(ValueError, match="trainable='w'"):
        md.Variable(1.0, "w", True, "float64")  # (initial_value, name, trainable, dtype) before TF's order


def test_arguments_eager_tensorflow_ignores_are_accepted_and_change_nothing():
    """TF 2.21 eager: validate_shape=False keeps the shape (an assign of another shape is still refused),
    import_scope without variable_def and experimental_enable_variable_lifting are ignored."""
    v = md.Variable(np.zeros(2, np.float32), validate_shape=False, import_scope="scope",
                    experimental_enable_variable_lifting=False)
    assert v.shape == (2,) and v.name == "Variable:0"
    with pytest.raises(ValueError):
        v.assign(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="Creating a `tf.Variable` with a `variable_def` arg is not supported"):
        md.Variable(variable_def=object())
    with pytest.raises(ValueError, match="The `initial_value` arg to `tf.Variable` must be specified"):
        md.Variable()
    with pytest.raises(TypeError, match="Cannot convert 1.5 to EagerTensor of dtype int32"):
        md.Variable(1.5, dtype="int32")  # (a NumPy value casts, as in TF)
    assert md.Variable(np.float64(1.5), dtype="int32").numpy() == 1
    assert md.Variable([1, 2], dtype="float64").dtype == np.float64


def test_shape_equal_to_the_initial_values_and_a_caching_device_are_accepted():
    assert md.Variable(np.zeros((2, 3)), shape=(2, 3)).shape == (2, 3)
    assert md.Variable(np.zeros(4), shape=4).shape == (4,)
    assert md.Variable(np.float32(1), shape=[]).shape == ()
    assert md.Variable(1.0, caching_device="/cpu:0").numpy() == 1.0


def test_variables_created_inside_run_keep_the_replicas_name_scope():
    strategy = md.MirroredStrategy(cpus(2))

    def make():
        with md.name_scope("layer"):
            return md.Variable(np.zeros(2, np.float32), False, name="w")
    w = strategy.run(make)
    assert isinstance(w, md.MirroredVariable) and w.name == "layer/w:0" and not w.trainable


@pytest.mark.parametrize("replicas", [2, 4])
def test_every_replica_starts_in_the_callers_name_scope(replicas):
    """Each replica sees the scope strategy.run was called in, plus its own, whichever thread runs it."""
    current_scope = importlib.import_module("mirrored.distribute.name_scope").current_scope  # (the name is the class)
    strategy = md.MirroredStrategy(cpus(replicas))

    def scope_of_each():
        with md.name_scope("block"):
            seen = current_scope()
            md.get_replica_context().merge_call(lambda s: None)  # the other replicas run meanwhile
            return seen, current_scope()

    with md.name_scope("model"):
        results = strategy.experimental_local_results(strategy.run(scope_of_each))
        assert current_scope() == "model/"
    assert list(results) == [("model/block/", "model/block/")] * replicas


# --- MultiWorkerMirroredStrategy ---------------------------------------------------------------------

class DuckResolver:
    """A resolver that is not a subclass of ours (TF's interface: cluster_spec(), task_type, task_id)."""

    task_type, task_id = None, None

    def cluster_spec(self):
        return md.train.ClusterSpec({})


@pytest.mark.parametrize("make", [
    lambda r, o: md.MultiWorkerMirroredStrategy(r, o, devices=["/cpu:0"]),  # TF's order
    lambda r, o: md.MultiWorkerMirroredStrategy(cluster_resolver=r, communication_options=o, devices=["/cpu:0"]),
    lambda r, o: md.MultiWorkerMirroredStrategy(o, r, devices=["/cpu:0"]),  # mirrored's earlier order, by type
    lambda r, o: md.distribute.MultiWorkerMirroredStrategy(r, o, devices=["/cpu:0"]),
], ids=["positional", "keywords", "earlier-order", "md.distribute"])
def test_resolver_and_options_in_tensorflows_order(make):
    resolver, options = SimpleClusterResolver({}), md.CommunicationOptions(timeout_seconds=5)
    strategy = make(resolver, options)
    assert strategy.cluster_resolver is resolver and strategy.extended._options is options


def test_resolver_alone_positionally_and_a_duck_typed_resolver():
    resolver = SimpleClusterResolver({})
    assert md.MultiWorkerMirroredStrategy(resolver, devices=["/cpu:0"]).cluster_resolver is resolver
    duck = DuckResolver()
    assert md.MultiWorkerMirroredStrategy(duck, devices=["/cpu:0"]).cluster_resolver is duck
    options = md.CommunicationOptions(implementation="RING")
    assert md.MultiWorkerMirroredStrategy(options, devices=["/cpu:0"]).extended._options is options


def test_tensorflow_2_0_forms():
    ring = md.CommunicationImplementation.RING
    s = md.MultiWorkerMirroredStrategy(ring, devices=["/cpu:0"])
    assert s.extended._options.implementation is ring
    s = md.experimental.MultiWorkerMirroredStrategy(ring, SimpleClusterResolver({}), devices=["/cpu:0"])
    assert s.extended._options.implementation is ring and isinstance(s, md.MultiWorkerMirroredStrategy)
    s = md.MultiWorkerMirroredStrategy(SimpleClusterResolver({}), communication=ring, devices=["/cpu:0"])
    assert s.extended._options.implementation is ring


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((5,), {}, TypeError, "cluster_resolver=5: expected a cluster resolver"),
    ((SimpleClusterResolver({}), 5), {}, ValueError, "communication_options=5: expected md.CommunicationOptions"),
    ((md.CommunicationOptions(), md.CommunicationOptions()), {}, TypeError, "cluster_resolver=CommunicationOptions"),
    ((md.CommunicationOptions(),), {"communication": md.CommunicationImplementation.RING}, ValueError, "not both"),
])
def test_bad_arguments_are_named(args, kwargs, error, words):
    with pytest.raises(error, match=words):
        md.MultiWorkerMirroredStrategy(*args, devices=["/cpu:0"], **kwargs)


# --- ClusterSpec -------------------------------------------------------------------------------------

def test_cluster_spec_answers_as_tensorflows():
    spec = md.train.ClusterSpec({"worker": ["w0:2222", "w1:2222"], "chief": ["c:2222"],
                                 "ps": {3: "p3:2222", 1: "p1:2222"}})
    as_dict = spec.as_dict()
    assert {**as_dict, "ps": {str(k): v for k, v in as_dict["ps"].items()}} == TF_SPEC["as_dict"]
    assert spec.jobs == TF_SPEC["jobs"] == ["worker", "chief", "ps"]
    assert spec.num_tasks("ps") == TF_SPEC["num_tasks_ps"]
    assert spec.task_indices("ps") == TF_SPEC["task_indices_ps"]
    assert spec.task_address("ps", 3) == TF_SPEC["task_address_ps3"]
    assert spec.job_tasks("ps") == TF_SPEC["job_tasks_ps"] and spec.job_tasks("worker") == TF_SPEC["job_tasks_worker"]
    assert bool(md.train.ClusterSpec({})) is TF_SPEC["bool_empty"] and bool(spec) is TF_SPEC["bool_full"]
    assert (spec == md.train.ClusterSpec(spec.as_dict())) is TF_SPEC["eq_dict_copy"]
    with pytest.raises(ValueError, match="job_name='nope'"):
        spec.num_tasks("nope")
    with pytest.raises(ValueError, match="task_index=2"):
        spec.task_address("ps", 2)


@pytest.mark.parametrize("replicas, key", [(1, "keras_sgd_applies_constraint"),
                                           (2, "mirrored_keras_sgd_applies_constraint")])
def test_optimizers_apply_the_constraint_after_the_update_as_keras_does(replicas, key):
    # TF: SGD(0.5) on w = [1, -2, 3] with gradient [1, 1, -10] from every replica, constraint clip(-1, 1).
    strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        w = md.Variable(np.array([1.0, -2.0, 3.0], np.float32), constraint=lambda x: np.clip(x, -1.0, 1.0))
        opt = md.optimizers.SGD(0.5)
    strategy.run(lambda: opt.apply_gradients([(np.array([1.0, 1.0, -10.0], np.float32), w)]))
    assert [np.asarray(c).tolist() for c in w.values] == [TF_VARIABLE[key]] * replicas
