"""md.train: Checkpoint.save/write/read/restore and CheckpointManager with tf.train's semantics."""

import os
import stat

import numpy as np
import pytest

import mirrored as md


def _model(n=2, value=0.0):
    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])
    with strategy.scope():
        model = {"w": md.Variable(np.full(3, value, np.float32), name="w")}
        opt = md.optimizers.SGD(0.1, momentum=0.9)
    return strategy, model, opt


def test_checkpoint_is_an_alias_and_train_exports_tf_names():
    assert md.Checkpoint is md.train.Checkpoint
    for name in ("CheckpointManager", "latest_checkpoint", "get_checkpoint_state", "list_variables",
                 "load_variable"):
        assert hasattr(md.train, name), name


def test_save_numbers_files_creates_directories_and_records_the_latest(tmp_path):
    _, model, _ = _model()
    ckpt = md.train.Checkpoint(model=model)
    prefix = tmp_path / "new" / "deeper" / "ckpt"  # directories that do not exist yet
    assert md.train.latest_checkpoint(tmp_path / "new" / "deeper") is None
    first = ckpt.save(prefix)
    assert first == f"{prefix}-1" and os.path.isfile(first)
    model["w"].assign(np.ones(3, np.float32))
    second = ckpt.save(prefix)
    assert second == f"{prefix}-2"
    assert int(ckpt.save_counter.numpy()) == 2
    assert md.train.latest_checkpoint(tmp_path / "new" / "deeper") == second
    assert sorted(os.listdir(tmp_path / "new" / "deeper")) == ["checkpoint", "ckpt-1", "ckpt-2"]
    # The state file is TensorFlow's text form, paths relative to the directory.
    text = (tmp_path / "new" / "deeper" / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-2"' in text

    model["w"].assign(np.zeros(3, np.float32))
    status = ckpt.restore(first)
    np.testing.assert_array_equal(model["w"].numpy(), np.zeros(3))
    status.assert_consumed().assert_existing_objects_matched().assert_nontrivial_match()
    assert int(ckpt.save_counter.numpy()) == 1  # restored with the rest, as TF does
    assert ckpt.save(prefix) == f"{prefix}-2"


def test_write_and_read_use_exactly_the_path(tmp_path):
    _, model, _ = _model(value=4.0)
    ckpt = md.train.Checkpoint(model=model)
    path = ckpt.write(tmp_path / "sub" / "exact.bin")
    assert path == str(tmp_path / "sub" / "exact.bin")
    assert os.listdir(tmp_path / "sub") == ["exact.bin"]  # no counter, no state file
    assert md.train.list_variables(path) == [("model/w/.ATTRIBUTES/VARIABLE_VALUE", [3])]  # TF's names
    np.testing.assert_array_equal(md.train.load_variable(path, "model/w/.ATTRIBUTES/VARIABLE_VALUE"), np.full(3, 4.0))
    model["w"].assign(np.zeros(3, np.float32))
    ckpt.read(path).assert_consumed()
    np.testing.assert_array_equal(model["w"].numpy(), np.full(3, 4.0))


def test_unwritable_directory_is_named_not_a_temp_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    _, model, _ = _model()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(PermissionError, match=r"directory '.*locked' is not writable") as info:
            md.train.Checkpoint(model=model).write(locked / "a.ckpt")
        assert ".tmp-" not in str(info.value)
        with pytest.raises(PermissionError, match=r"cannot create directory '.*locked/sub'"):
            md.train.Checkpoint(model=model).save(locked / "sub" / "ckpt")
    finally:
        locked.chmod(stat.S_IRWXU)


def test_a_file_in_the_way_of_the_directory_is_named(tmp_path):
    _, model, _ = _model()
    (tmp_path / "blocker").write_text("not a directory")
    with pytest.raises(OSError, match=r"cannot create directory '.*blocker/sub'") as info:
        md.train.Checkpoint(model=model).save(tmp_path / "blocker" / "sub" / "ckpt")
    assert ".tmp-" not in str(info.value)


@pytest.mark.parametrize("value", [0, 1.5, True, "x", None, np.zeros(2)])
def test_python_numbers_are_refused_not_dropped(value):
    with pytest.raises(ValueError, match=r"Checkpoint\(step=.*cannot be tracked.*md.Variable"):
        md.train.Checkpoint(step=value)


def test_status_reports_unclaimed_entries_until_expect_partial(tmp_path):
    strategy, model, opt = _model()
    strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), model["w"])]))
    path = md.train.Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt")
    _, model2, _ = _model(value=7.0)
    status = md.train.Checkpoint(model=model2).restore(path)
    np.testing.assert_allclose(model2["w"].numpy(), np.full(3, -0.2), rtol=1e-6)  # 2 replicas' gradients summed
    with pytest.raises(AssertionError, match="optimizer/_iterations"):
        status.assert_consumed()
    assert status.expect_partial() is status
    status.assert_existing_objects_matched()
    none = md.train.Checkpoint(model=model2).restore(None)  # a manager's latest before any save
    with pytest.raises(AssertionError, match="No checkpoint specified"):
        none.assert_consumed()
    none.expect_partial()


def test_restore_of_a_directory_says_what_to_pass(tmp_path):
    _, model, _ = _model()
    with pytest.raises(IsADirectoryError, match="latest_checkpoint"):
        md.train.Checkpoint(model=model).restore(tmp_path)


def test_manager_keeps_max_to_keep_and_a_new_manager_picks_them_up(tmp_path):
    strategy, model, opt = _model()
    ckpt = md.train.Checkpoint(model=model, optimizer=opt)
    manager = md.train.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert manager.directory == str(tmp_path / "run")
    assert manager.restore_or_initialize() is None
    paths = []
    for _ in range(4):
        strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), model["w"])]))
        paths.append(manager.save())
    assert paths == [str(tmp_path / "run" / f"ckpt-{i}") for i in range(1, 5)]
    assert manager.checkpoints == paths[2:]
    assert manager.latest_checkpoint == paths[-1]
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint", "ckpt-3", "ckpt-4"]
    assert md.train.latest_checkpoint(tmp_path / "run") == paths[-1]
    saved = model["w"].numpy().copy()

    # A restarted job: fresh objects, a new manager on the same directory.
    strategy2, model2, opt2 = _model(n=4, value=9.0)
    ckpt2 = md.train.Checkpoint(model=model2, optimizer=opt2)
    manager2 = md.train.CheckpointManager(ckpt2, tmp_path / "run", max_to_keep=2)
    assert manager2.checkpoints == paths[2:]
    assert manager2.restore_or_initialize() == paths[-1]
    np.testing.assert_array_equal(model2["w"].numpy(), saved)
    assert int(opt2.iterations.numpy()) == 4
    assert manager2.save() == str(tmp_path / "run" / "ckpt-5")  # save_counter came back too
    assert manager2.checkpoints == [paths[3], str(tmp_path / "run" / "ckpt-5")]
    assert not os.path.exists(paths[2])


def test_manager_numbers_interval_init_fn_and_bad_arguments(tmp_path):
    strategy, model, _ = _model()
    with strategy.scope():
        step = md.Variable(np.int64(0), trainable=False)
    ckpt = md.train.Checkpoint(model=model, step=step)
    called = []
    manager = md.train.CheckpointManager(ckpt, tmp_path, max_to_keep=None, checkpoint_name="model",
                                         step_counter=step, checkpoint_interval=10,
                                         init_fn=lambda: called.append(1))
    assert manager.restore_or_initialize() is None and called == [1]
    assert manager.save() == str(tmp_path / "model-1")
    step.assign(np.int64(5))
    assert manager.save() is None  # fewer than checkpoint_interval steps since the last save
    step.assign(np.int64(10))
    assert manager.save(checkpoint_number=step) == str(tmp_path / "model-10")
    assert manager.save(checkpoint_number=77, check_interval=False) is None  # same step as the last save
    assert len(manager.checkpoints) == 2  # max_to_keep=None keeps everything

    with pytest.raises(ValueError, match="positive integer or `None` for `max_to_keep`"):
        md.train.CheckpointManager(ckpt, tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="step_counter"):
        md.train.CheckpointManager(ckpt, tmp_path, checkpoint_interval=5)
    with pytest.raises(TypeError, match="md.train.Checkpoint"):
        md.train.CheckpointManager({"w": model["w"]}, tmp_path)


def test_keep_checkpoint_every_n_hours_keeps_old_ones_on_disk(tmp_path, monkeypatch):
    from mirrored.train import checkpoint_management as train_mod

    clock = [1_000_000.0]
    monkeypatch.setattr(train_mod.time, "time", lambda: clock[0])
    _, model, _ = _model()
    manager = md.train.CheckpointManager(md.train.Checkpoint(model=model), tmp_path, max_to_keep=1,
                                         keep_checkpoint_every_n_hours=1)
    first = manager.save()
    clock[0] += 3600.0  # an hour later
    second = manager.save()
    clock[0] += 60.0
    third = manager.save()
    # first was swept 1 s after the manager's start (< 1 h): deleted; second is 1 h newer: kept on disk.
    assert not os.path.exists(first)
    assert os.path.exists(second) and os.path.exists(third)
    assert manager.checkpoints == [third]


def _manager_task(directory):
    from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=30), devices=["/cpu:0"])
    with strategy.scope():
        w = md.Variable(np.zeros(2, np.float32), name="w")
    manager = md.train.CheckpointManager(md.train.Checkpoint(w=w), directory, max_to_keep=2)
    paths = []
    for i in range(3):
        w.assign(np.full(2, i, np.float32))
        paths.append(manager.save())
    strategy.reduce("SUM", strategy.run(lambda: np.ones(1)), axis=None)  # a barrier: the chief has written
    with strategy.scope():
        fresh = md.Variable(np.ones(2, np.float32), name="w")
    restored = md.train.CheckpointManager(md.train.Checkpoint(w=fresh), directory).restore_or_initialize()
    return paths, manager.checkpoints, restored, fresh.numpy().tolist()


@pytest.mark.multiworker
def test_multiworker_manager_only_the_chief_writes_and_all_keep_the_same_list(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    results = launch(_manager_task, 2, kwargs={"directory": str(tmp_path)}, timeout=120)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
    expected = [str(tmp_path / f"ckpt-{i}") for i in (1, 2, 3)]
    for r in results:
        paths, kept, restored, value = r.value
        assert paths == expected and kept == expected[1:] and restored == expected[-1]
        assert value == [2.0, 2.0]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2", "ckpt-3"]
