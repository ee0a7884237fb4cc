"""Behaviour recorded from real TensorFlow 2.21.0 (tensorflow-cpu, Keras 3.15.1), MirroredStrategy over
logical CPU devices, asserted here as literals (the suite never imports TensorFlow). Each test names
the TF calls it mirrors; values, dtypes, shapes and error types/words are TF's."""

import os

import numpy as np
import pytest

import mirrored as md


def _strategy(n):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])


def _check(value, expected, dtype, shape=()):
    value = np.asarray(value)
    assert value.dtype == np.dtype(dtype) and value.shape == shape, (value.dtype, value.shape)
    np.testing.assert_allclose(value, expected, rtol=1e-6)


# --- tf.nn.compute_average_loss / scale_regularization_loss ---------------------------------------

L = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
L2 = np.arange(8, dtype=np.float32).reshape(4, 2)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, 2.5),
    ({"global_batch_size": 8}, 1.25),
    ({"global_batch_size": np.int64(8)}, 1.25),
    ({"global_batch_size": np.int32(8)}, 1.25),
    ({"global_batch_size": np.array(8)}, 1.25),
    ({"global_batch_size": 0}, 0.0),
    ({"sample_weight": 2.0}, 5.0),
    ({"sample_weight": np.array([1, 0, 1, 0], np.float32)}, 1.0),
    ({"sample_weight": np.array([[1], [0], [1], [0]], np.float32)}, 1.0),
    ({"sample_weight": np.array([1, 0, 1, 0])}, 1.0),
    ({"sample_weight": np.array([1, 0, 1, 0], np.float64)}, 1.0),
])
def test_compute_average_loss_outside_any_strategy(kwargs, expected):
    _check(md.nn.compute_average_loss(L, **kwargs), expected, np.float32)


@pytest.mark.parametrize("weight, expected", [
    (None, 7.0), (np.array([1, 0, 1, 0], np.float32), 2.5),
    (np.array([[1], [0], [1], [0]], np.float32), 2.5), (np.ones((4, 2), np.float32), 7.0)])
def test_compute_average_loss_of_rank_2_losses(weight, expected):
    _check(md.nn.compute_average_loss(L2, sample_weight=weight), expected, np.float32)


def test_compute_average_loss_dtypes_follow_tf():
    _check(md.nn.compute_average_loss(L.astype(np.float64)), 2.5, np.float64)
    _check(md.nn.compute_average_loss(L.astype(np.float16)), 2.5, np.float16)
    # Python floats convert as tf.convert_to_tensor does: float32.
    _check(md.nn.compute_average_loss([1.0, 2.0, 3.0, 4.0]), 2.5, np.float32)
    _check(md.nn.compute_average_loss(np.ones((4, 1), np.float32)), 1.0, np.float32)
    # Integer losses divide as TF's integer division does: a float64 result; weighted ones are cast back
    # to the integer dtype first ([0.5, 1, 1.5, 2] -> [0, 1, 1, 2]).
    _check(md.nn.compute_average_loss(np.array([1, 2, 3, 4])), 2.5, np.float64)
    _check(md.nn.compute_average_loss(np.array([1, 2, 3, 4], np.int32)), 2.5, np.float64)
    _check(md.nn.compute_average_loss([1, 2, 3, 4]), 2.5, np.float64)
    _check(md.nn.compute_average_loss(np.array([1, 2, 3, 4]), global_batch_size=3), 10 / 3, np.float64)
    _check(md.nn.compute_average_loss(np.array([1, 2, 3, 4]), sample_weight=np.full(4, 0.5)), 1.0, np.float64)
    _check(md.nn.compute_average_loss(np.array([1, 2], np.float16), sample_weight=np.array([.5, .5], np.float32)),
           0.75, np.float16)
    _check(md.nn.compute_average_loss(np.array([1, 2], np.float32), sample_weight=[1, 0]), 0.5, np.float32)
    _check(md.nn.compute_average_loss(np.zeros((0,), np.float32)), 0.0, np.float32)


def test_scale_regularization_loss_dtypes_follow_tf():
    _check(md.nn.scale_regularization_loss(np.float32(3.0)), 3.0, np.float32)
    _check(md.nn.scale_regularization_loss(np.array([1.0, 2.0], np.float32)), 3.0, np.float32)
    _check(md.nn.scale_regularization_loss(np.float64(3.0)), 3.0, np.float64)
    _check(md.nn.scale_regularization_loss(3.0), 3.0, np.float32)
    _check(md.nn.scale_regularization_loss([1.0, 2.0]), 3.0, np.float32)
    _check(md.nn.scale_regularization_loss(3), 3.0, np.float64)
    _check(md.nn.scale_regularization_loss(np.int32(3)), 3.0, np.float64)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"global_batch_size": 8.0}, TypeError, "global_batch_size must be an integer"),
    ({"global_batch_size": True}, TypeError, "global_batch_size must be an integer"),
    ({"global_batch_size": "8"}, TypeError, "global_batch_size must be an integer"),
    ({"global_batch_size": np.array([8])}, ValueError, r"global_batch_size must be scalar.*\(1,\)"),
    # TF raises InvalidArgumentError (not a Python built-in) for these three; the words match.
    ({"global_batch_size": -1}, ValueError, "global_batch_size must be non-negative"),
    ({"sample_weight": np.ones((4, 2), np.float32)}, ValueError, "sample_weight"),
    ({"sample_weight": np.ones(3, np.float32)}, ValueError, "sample_weight"),
])
def test_compute_average_loss_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        md.nn.compute_average_loss(L, **kwargs)


def test_compute_average_loss_bad_losses():
    with pytest.raises(ValueError, match=r"Expected a tensor with at least rank 1. Received per_example_loss=3.0 "
                                         "with rank 0"):
        md.nn.compute_average_loss(np.float32(3.0))
    with pytest.raises(ValueError, match="sample_weight"):  # rank-1 weight of rank-2 losses gains a trailing 1
        md.nn.compute_average_loss(L2, sample_weight=np.array([1, 2], np.float32))


@pytest.mark.parametrize("n, noargs, gbs16, weighted, reg", [
    (1, 2.5, 0.625, 1.0, 3.0), (2, 1.25, 0.625, 0.5, 1.5), (4, 0.625, 0.625, 0.25, 0.75)])
def test_inside_run_and_under_scope(n, noargs, gbs16, weighted, reg):
    strategy = _strategy(n)

    def step(gbs=None, sw=None):
        return (md.nn.compute_average_loss(L, sample_weight=sw, global_batch_size=gbs),
                md.nn.scale_regularization_loss(np.float32(3.0)))

    for kwargs, expected in (({}, noargs), ({"gbs": 16}, gbs16),
                             ({"sw": np.array([1, 0, 1, 0], np.float32)}, weighted)):
        loss, reg_loss = strategy.run(step, kwargs=kwargs)
        for value in strategy.experimental_local_results(loss):
            _check(value, expected, np.float32)
        for value in strategy.experimental_local_results(reg_loss):
            _check(value, reg, np.float32)
    with strategy.scope():
        with pytest.raises(RuntimeError, match="You are calling `compute_average_loss` in cross replica context, "
                                               "while it was expected to be called in replica context."):
            md.nn.compute_average_loss(L)
        with pytest.raises(RuntimeError, match="`scale_regularization_loss` in cross replica context"):
            md.nn.scale_regularization_loss(np.float32(3.0))
        _check(md.nn.compute_average_loss(L, global_batch_size=8), 1.25, np.float32)


# --- tf.train.Checkpoint / CheckpointManager / latest_checkpoint ----------------------------------

def test_checkpoint_save_naming_state_file_and_write(tmp_path):
    v = md.Variable(np.float32(1.0))
    ckpt = md.train.Checkpoint(v=v)
    assert int(ckpt.save_counter.numpy()) == 0
    assert ckpt.save(str(tmp_path / "a" / "ckpt")) == str(tmp_path / "a" / "ckpt-1")
    assert ckpt.save(str(tmp_path / "a" / "ckpt")) == str(tmp_path / "a" / "ckpt-2")
    assert ckpt.save_counter.numpy() == 2 and np.dtype(ckpt.save_counter.dtype) == np.int64
    # Checkpoint.save records the latest only, without timestamps.
    assert (tmp_path / "a" / "checkpoint").read_text() == \
        'model_checkpoint_path: "ckpt-2"\nall_model_checkpoint_paths: "ckpt-2"\n'
    assert md.train.latest_checkpoint(str(tmp_path / "a")) == str(tmp_path / "a" / "ckpt-2")
    assert ckpt.write(str(tmp_path / "b" / "w")) == str(tmp_path / "b" / "w")
    assert md.train.latest_checkpoint(str(tmp_path / "b")) is None  # write() records nothing
    assert md.train.latest_checkpoint(str(tmp_path / "zzz")) is None
    assert ckpt.save_counter.numpy() == 2


def test_checkpoint_restore_status_methods(tmp_path):
    v = md.Variable(np.float32(1.0))
    ckpt = md.train.Checkpoint(v=v)
    path = ckpt.save(str(tmp_path / "ckpt"))
    status = ckpt.restore(path)
    assert type(status).__name__ == "CheckpointLoadStatus"
    public = sorted(m for m in dir(status) if not m.startswith("_"))
    assert public == ["assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match",
                      "expect_partial", "initialize_or_restore", "run_restore_ops"]
    for method in ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match",
                   "expect_partial"):
        assert getattr(status, method)() is status
    assert type(ckpt.read(ckpt.write(str(tmp_path / "w"))).assert_consumed()).__name__ == "CheckpointLoadStatus"
    none = ckpt.restore(None)
    assert type(none).__name__ == "InitializationOnlyStatus"
    with pytest.raises(AssertionError, match=r"No checkpoint specified \(save_path=None\); nothing is being "
                                             "restored."):
        none.assert_consumed()
    assert type(none.expect_partial()).__name__ == "InitializationOnlyStatus"


def test_checkpoint_partial_restores_both_ways(tmp_path):
    v, w = md.Variable(np.float32(1.0)), md.Variable(np.float32(2.0))
    both = md.train.Checkpoint(v=v, w=w).save(str(tmp_path / "c" / "ckpt"))
    only_v = md.train.Checkpoint(v=v).save(str(tmp_path / "a" / "ckpt"))
    # File has more than the objects: restored; assert_consumed names the leftover.
    v2 = md.Variable(np.float32(0.0))
    status = md.train.Checkpoint(v=v2).restore(both)
    assert float(v2.numpy()) == 1.0
    with pytest.raises(AssertionError, match="Unresolved object in checkpoint"):
        status.assert_consumed()
    assert type(status.assert_existing_objects_matched()).__name__ == "CheckpointLoadStatus"
    # Objects have more than the file: TF restores what it has; both assertions raise.
    v3, z = md.Variable(np.float32(0.0)), md.Variable(np.float32(5.0))
    status = md.train.Checkpoint(v=v3, z=z).restore(only_v)
    assert float(v3.numpy()) == 1.0 and float(z.numpy()) == 5.0
    for method in (status.assert_consumed, status.assert_existing_objects_matched):
        with pytest.raises(AssertionError, match="Found 1 Python objects that were not bound to checkpointed "
                                                 "values"):
            method()
    status.assert_nontrivial_match()
    with pytest.raises(ValueError):  # a shape mismatch is a ValueError in TF too
        md.train.Checkpoint(v=md.Variable(np.zeros(3, np.float32))).restore(only_v)


def test_checkpoint_errors_and_late_tracking(tmp_path):
    ckpt = md.train.Checkpoint(v=md.Variable(np.float32(1.0)))
    missing = str(tmp_path / "nope" / "ckpt-1")
    # TF: tf.errors.NotFoundError "... Failed to find any matching files for <path>".
    for call in (ckpt.restore, ckpt.read):
        with pytest.raises(FileNotFoundError, match="Failed to find any matching files for") as info:
            call(missing)
        assert type(info.value) is md.train.NotFoundError and type(info.value).__name__ == "NotFoundError"
    with pytest.raises(ValueError, match="was expecting step to be a trackable object"):
        md.train.Checkpoint(step=0)
    # An empty Checkpoint is valid in TF; objects assigned as attributes are tracked.
    late = md.train.Checkpoint()
    late.v = md.Variable(np.float32(3.0))
    path = late.save(str(tmp_path / "late" / "ckpt"))
    assert md.train.list_variables(path) == [("save_counter/.ATTRIBUTES/VARIABLE_VALUE", []),
                                             ("v/.ATTRIBUTES/VARIABLE_VALUE", [])]
    assert float(late.v.numpy()) == 3.0
    # TF 2.21 keeps a plain value set as an attribute without saving it (tests/data/tf_checkpoint_api_reference.json).
    late.step = 0
    assert late.step == 0
    path = late.save(str(tmp_path / "late" / "ckpt"))
    assert [name for name, _ in md.train.list_variables(path)] == ["save_counter/.ATTRIBUTES/VARIABLE_VALUE",
                                                                  "v/.ATTRIBUTES/VARIABLE_VALUE"]


def test_manager_numbering_deletion_order_and_pickup(tmp_path):
    d = tmp_path / "m"
    ckpt = md.train.Checkpoint(v=md.Variable(np.float32(1.0)))
    m = md.train.CheckpointManager(ckpt, str(d), max_to_keep=3)
    assert m.latest_checkpoint is None and m.checkpoints == [] and m.directory == str(d)

    def names(paths):
        return [os.path.basename(p) for p in paths]

    listing = []
    for _ in range(5):
        listing.append((os.path.basename(m.save()), names(m.checkpoints)))
    assert listing == [("ckpt-1", ["ckpt-1"]), ("ckpt-2", ["ckpt-1", "ckpt-2"]),
                       ("ckpt-3", ["ckpt-1", "ckpt-2", "ckpt-3"]), ("ckpt-4", ["ckpt-2", "ckpt-3", "ckpt-4"]),
                       ("ckpt-5", ["ckpt-3", "ckpt-4", "ckpt-5"])]
    assert ckpt.save_counter.numpy() == 5
    assert sorted(os.listdir(d)) == ["checkpoint", "ckpt-3", "ckpt-4", "ckpt-5"]
    text = (d / "checkpoint").read_text().splitlines()
    assert text[:4] == ['model_checkpoint_path: "ckpt-5"', 'all_model_checkpoint_paths: "ckpt-3"',
                        'all_model_checkpoint_paths: "ckpt-4"', 'all_model_checkpoint_paths: "ckpt-5"']
    assert [line.split(":")[0] for line in text[4:]] == ["all_model_checkpoint_timestamps"] * 3 + \
        ["last_preserved_timestamp"]
    assert m.latest_checkpoint == md.train.latest_checkpoint(str(d)) == str(d / "ckpt-5")
    assert m.save(checkpoint_number=100) == str(d / "ckpt-100")
    assert ckpt.save_counter.numpy() == 6  # incremented even with an explicit number
    assert m.save(checkpoint_number=np.int64(7)) == str(d / "ckpt-7")
    assert m.save(checkpoint_number=md.Variable(np.int64(9))) == str(d / "ckpt-9")
    assert names(m.checkpoints) == ["ckpt-100", "ckpt-7", "ckpt-9"]
    assert m.save() == str(d / "ckpt-9")
    assert names(m.checkpoints) == ["ckpt-100", "ckpt-7", "ckpt-9"]
    assert m.save(checkpoint_number=100) == str(d / "ckpt-100")
    assert names(m.checkpoints) == ["ckpt-7", "ckpt-9", "ckpt-100"]
    assert sorted(os.listdir(d)) == ["checkpoint", "ckpt-100", "ckpt-7", "ckpt-9"]
    m2 = md.train.CheckpointManager(md.train.Checkpoint(v=md.Variable(np.float32(1.0))), str(d), max_to_keep=3)
    assert m2.latest_checkpoint == str(d / "ckpt-100")
    assert names(m2.checkpoints) == ["ckpt-7", "ckpt-9", "ckpt-100"]
    assert m2.save() == str(d / "ckpt-1")  # the new Checkpoint's own counter
    assert names(m2.checkpoints) == ["ckpt-9", "ckpt-100", "ckpt-1"]
    named = md.train.CheckpointManager(ckpt, str(tmp_path / "n"), max_to_keep=None, checkpoint_name="model")
    assert named.save() == str(tmp_path / "n" / "model-11")
    assert m.restore_or_initialize() == str(d / "ckpt-100")
    assert md.train.CheckpointManager(ckpt, str(tmp_path / "p"), 2).restore_or_initialize() is None
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"Expected a positive integer or `None` for `max_to_keep`, got {bad}."):
            md.train.CheckpointManager(ckpt, str(tmp_path / "o"), max_to_keep=bad)
    with pytest.raises(ValueError, match="`step_counter` should be passed if `checkpoint_interval` is not None."):
        md.train.CheckpointManager(ckpt, str(tmp_path / "o"), max_to_keep=1, checkpoint_interval=2)


# --- Keras optimizers under MirroredStrategy: loss / global batch, gradients summed ------------------
# TF: w, b = tf.Variable(W0), tf.Variable(0s) in scope; per-example loss sum((x@w+b-y)^2, axis=1);
# tf.nn.compute_average_loss(per, global_batch_size=8); tape.gradient; keras.optimizers.X.apply_gradients;
# 3 steps over the same global batch of 8 rows, distributed with experimental_distribute_dataset.
# Recorded at 1 replica (2 and 4 agree with it to 3e-7).

_KERAS = {
    "SGD": (lambda: md.optimizers.SGD(0.1),
            [0.07681988924741745, -0.9965141415596008, 0.0732739120721817], 0.7514422535896301,
            [9.996041297912598, 3.819643259048462, 2.090210437774658]),
    "SGD momentum": (lambda: md.optimizers.SGD(0.1, momentum=0.9),
                     [1.0261108875274658, -0.054843902587890625, 0.46170300245285034], 1.4902445077896118,
                     [9.996041297912598, 3.819643259048462, 1.6759198904037476]),
    "SGD nesterov": (lambda: md.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                     [0.5783582329750061, -0.18362587690353394, 0.6516637802124023], 1.137350082397461,
                     [9.996041297912598, 1.6278904676437378, 2.315692663192749]),
    "Adam": (lambda: md.optimizers.Adam(0.01),
             [-0.8577958941459656, -1.9508050680160522, -0.3179267346858978], 0.029989853501319885,
             [9.996041297912598, 9.827939987182617, 9.661535263061523]),
}


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(_KERAS))
def test_keras_style_loop_gives_tf_weights_at_any_replica_count(name, n):
    make_opt, tf_w, tf_b, tf_losses = _KERAS[name]
    rng = np.random.RandomState(0)
    x_all, y_all = rng.randn(8, 3).astype(np.float32), rng.randn(8, 1).astype(np.float32)
    w0 = rng.randn(3, 1).astype(np.float32)
    strategy = _strategy(n)
    with strategy.scope():
        w, b = md.Variable(w0), md.Variable(np.zeros(1, np.float32))
        opt = make_opt()

    def step(x, y):
        pred = x @ w.numpy() + b.numpy()
        loss = md.nn.compute_average_loss(((pred - y) ** 2).sum(axis=1), global_batch_size=8)
        d = 2 * (pred - y) / 8
        opt.apply_gradients(zip([(x.T @ d).astype(np.float32), d.sum(axis=0).astype(np.float32)], [w, b]))
        return loss

    losses = [float(strategy.reduce("SUM", strategy.run(step, args=batch), axis=None))
              for batch in strategy.experimental_distribute_dataset([(x_all, y_all)] * 3)]
    np.testing.assert_allclose(w.numpy().ravel(), tf_w, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), [tf_b], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(losses, tf_losses, rtol=2e-6)
    assert int(opt.iterations.numpy()) == 3 and np.dtype(opt.iterations.dtype) == np.int64


# --- datasets ------------------------------------------------------------------------------------
# TF: strategy.experimental_distribute_dataset(tf.data.Dataset.range(k).batch(b)); each batch is cut into
# pieces of ceil(b / replicas) rows, the last replicas getting fewer or none.

@pytest.mark.parametrize("n, k, b, expected", [
    (2, 6, 6, [[[0, 1, 2], [3, 4, 5]]]),
    (4, 6, 6, [[[0, 1], [2, 3], [4, 5], []]]),
    (2, 10, 6, [[[0, 1, 2], [3, 4, 5]], [[6, 7], [8, 9]]]),
    (4, 10, 6, [[[0, 1], [2, 3], [4, 5], []], [[6], [7], [8], [9]]]),
    (2, 7, 4, [[[0, 1], [2, 3]], [[4, 5], [6]]]),
    (4, 7, 4, [[[0], [1], [2], [3]], [[4], [5], [6], []]]),
    (4, 5, 5, [[[0, 1], [2, 3], [4], []]]),
    (2, 3, 3, [[[0, 1], [2]]]),
    (4, 3, 3, [[[0], [1], [2], []]]),
    (2, 1, 1, [[[0], []]]),
    (4, 1, 1, [[[0], [], [], []]]),
])
def test_partial_batches_split_as_tf(n, k, b, expected):
    strategy = _strategy(n)
    rows = np.arange(k)
    batches = [rows[i:i + b] for i in range(0, k, b)]
    got = [[np.asarray(t).tolist() for t in strategy.experimental_local_results(batch)]
           for batch in strategy.experimental_distribute_dataset(batches)]
    assert got == expected


def test_compat_v1_make_numpy_dataset_as_tf():
    # tf.compat.v1.distribute.MirroredStrategy(...).experimental_make_numpy_dataset
    v1 = md.compat.v1.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert isinstance(v1, md.compat.v1.MirroredStrategy)
    rows = list(v1.experimental_make_numpy_dataset([np.ones(3), np.zeros(3)]))
    assert [r.tolist() for r in rows] == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    pairs = list(v1.experimental_make_numpy_dataset((np.arange(3), np.arange(3) * 2)))
    assert [tuple(np.asarray(t).tolist() for t in p) for p in pairs] == [(0, 0), (1, 2), (2, 4)]
    assert all(np.asarray(r).dtype == np.float64 and np.shape(r) == ()
               for r in v1.experimental_make_numpy_dataset(np.arange(3.0)))


def test_experimental_names_and_enum_values():
    E = md.experimental
    for name in ("CollectiveCommunication", "CommunicationImplementation", "CommunicationOptions",
                 "MultiWorkerMirroredStrategy", "ValueContext"):
        assert hasattr(E, name), name
    assert [(m.name, m.value) for m in E.CommunicationImplementation] == \
        [("AUTO", "AUTO"), ("RING", "RING"), ("NCCL", "NCCL")]
    assert E.CollectiveCommunication is E.CommunicationImplementation
    o = E.CommunicationOptions()
    assert (o.bytes_per_pack, o.timeout_seconds, o.implementation) == (0, None, E.CommunicationImplementation.AUTO)
    o = E.CommunicationOptions(bytes_per_pack=1024, timeout_seconds=5.0,
                               implementation=E.CommunicationImplementation.RING)
    assert (o.bytes_per_pack, o.timeout_seconds, o.implementation) == (1024, 5.0, E.CommunicationImplementation.RING)
    assert E.CommunicationOptions(1024).bytes_per_pack == 1024
    assert E.CommunicationOptions(implementation="RING").implementation is E.CommunicationImplementation.RING
    assert E.CommunicationOptions(timeout_seconds=0).timeout_seconds == 0  # TF: zero disables the timeout
    with pytest.raises(ValueError, match="Argument `bytes_per_pack` must be >=0, Received -1"):
        E.CommunicationOptions(bytes_per_pack=-1)
    assert [(m.name, m.value) for m in md.data.experimental.AutoShardPolicy] == \
        [("OFF", -1), ("AUTO", 0), ("FILE", 1), ("DATA", 2), ("HINT", 3)]
    assert md.data.Options().experimental_distribute.auto_shard_policy == 0
    assert [(m.name, m.value) for m in md.VariableAggregation] == \
        [("NONE", 0), ("SUM", 1), ("MEAN", 2), ("ONLY_FIRST_REPLICA", 3)]
    assert [(m.name, m.value) for m in md.VariableSynchronization] == \
        [("AUTO", 0), ("NONE", 1), ("ON_WRITE", 2), ("ON_READ", 3)]
    assert [(m.name, m.value) for m in md.InputReplicationMode] == \
        [("PER_WORKER", "PER_WORKER"), ("PER_REPLICA", "PER_REPLICA")]
    ctx = E.ValueContext()
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (0, 1)


def test_manager_checkpoint_interval_and_directories_written_by_save(tmp_path):
    step = md.Variable(np.int64(0))
    ckpt = md.train.Checkpoint(v=md.Variable(np.float32(1.0)), step=step)
    m = md.train.CheckpointManager(ckpt, str(tmp_path / "i"), max_to_keep=2, step_counter=step,
                                   checkpoint_interval=3)
    saved = []
    for i in range(8):
        step.assign(np.int64(i))
        path = m.save()
        saved.append(None if path is None else os.path.basename(path))
    assert saved == ["ckpt-1", None, None, "ckpt-2", None, None, "ckpt-3", None]
    assert os.path.basename(m.save(check_interval=False)) == "ckpt-4"
    assert m.save(check_interval=False) is None  # the same step again
    assert [os.path.basename(p) for p in m.checkpoints] == ["ckpt-3", "ckpt-4"]
    # A manager on a directory Checkpoint.save wrote (no timestamps): latest known, none managed.
    mix = tmp_path / "mix"
    plain = md.train.Checkpoint(v=md.Variable(np.float32(1.0)))
    plain.save(str(mix / "ckpt"))
    plain.save(str(mix / "ckpt"))
    m2 = md.train.CheckpointManager(plain, str(mix), max_to_keep=1)
    assert m2.latest_checkpoint == str(mix / "ckpt-2") and m2.checkpoints == []
    assert m2.save() == str(mix / "ckpt-3")
    assert sorted(os.listdir(mix)) == ["checkpoint", "ckpt-1", "ckpt-2", "ckpt-3"]
    # save_counter is restored with the rest: the next save continues from it.
    assert plain.save(str(tmp_path / "r" / "ckpt")) == str(tmp_path / "r" / "ckpt-4")
    plain.restore(str(mix / "ckpt-1"))
    assert int(plain.save_counter.numpy()) == 1
    assert plain.save(str(tmp_path / "r" / "ckpt")) == str(tmp_path / "r" / "ckpt-2")
    assert md.train.latest_checkpoint(str(tmp_path / "r")) == str(tmp_path / "r" / "ckpt-2")
    assert md.train.latest_checkpoint(str(tmp_path / "r"), latest_filename="other") is None


@pytest.mark.parametrize("n, default_local, default_sum", [
    (2, ([0.5, 2.0], [3.25, 4.25]), (2.5, 7.5)),
    (4, ([0.125, 0.625, 1.125, 0.0], [1.5, 1.75, 2.0, 2.25]), (1.875, 7.5)),
])
def test_reduce_and_loss_scaling_over_partial_batches(n, default_local, default_sum):
    # TF: Dataset.from_tensor_slices(arange(10, float32)).batch(6), distributed; reduce(axis=0) and
    # compute_average_loss (default divisor: this replica's rows x replicas; or global_batch_size=6).
    strategy = _strategy(n)
    rows = np.arange(10, dtype=np.float32)
    for i, x in enumerate(strategy.experimental_distribute_dataset([rows[:6], rows[6:]])):
        _check(strategy.reduce("SUM", x, axis=0), (15.0, 30.0)[i], np.float32)
        _check(strategy.reduce("MEAN", x, axis=0), (2.5, 7.5)[i], np.float32)
        loss = strategy.run(lambda v: md.nn.compute_average_loss(v * 1.0), args=(x,))
        assert [float(t) for t in strategy.experimental_local_results(loss)] == default_local[i]
        _check(strategy.reduce("SUM", loss, axis=None), default_sum[i], np.float32)
        loss = strategy.run(lambda v: md.nn.compute_average_loss(v * 1.0, global_batch_size=6), args=(x,))
        _check(strategy.reduce("SUM", loss, axis=None), (2.5, 5.0)[i], np.float32)
