"""tf.train.Checkpoint / CheckpointManager semantics as real TensorFlow 2.21 shows them
(tests/data/tf_checkpoint_api_reference.json, recorded by tests/data/record_tf_checkpoint_api.py from the
scenarios of tests/tf_checkpoint_scenarios.py over MirroredStrategy with 1 and 2 CPU replicas and Keras 3's
optimizers), asserted against mirrored: the same scenario code, run over mirrored's names in a fresh temporary
directory, must give the same returned paths (relative to that directory), files, state-file lines, tracked names,
values, dtypes, status outcomes and exception classes (with the scenario's key words). The suite never imports
TensorFlow; where mirrored differs on purpose (docs/tf_semantics.md) the table ``DELIBERATE`` checks mirrored's
result and TF's. The last part tests what the audit added against NumPy."""

import json
import os

import ml_dtypes  # noqa: F401  registers "bfloat16" with NumPy, for the scenarios' dtype names
import numpy as np
import pytest

import mirrored as md
import test_tf_semantics_parity as semantics_parity
import tf_checkpoint_scenarios as scenarios
from scenario_adapter import ScenarioAdapter

with open(os.path.join(os.path.dirname(__file__), "data", "tf_checkpoint_api_reference.json")) as _f:
    REFERENCE = json.load(_f)["scenarios"]

# TensorFlow's own exception classes and the built-in ones mirrored raises in their place.
_TF_ERRORS = {"InvalidArgumentError": "ValueError"}


class Mirrored(ScenarioAdapter):
    """The scenarios' adapter over mirrored."""

    MirroredStrategy = md.MirroredStrategy
    Variable = md.Variable
    Module = md.Module
    Checkpoint = md.train.Checkpoint
    CheckpointManager = md.train.CheckpointManager
    train = md.train
    SGD = md.optimizers.SGD
    Adam = md.optimizers.Adam
    Dataset = md.data.Dataset

    @staticmethod
    def const(value, dtype):
        return np.asarray(value, dtype)


_ADAPTER = Mirrored()


def _refused_at_construction(got, want):
    # TF accepts anything and fails at the first save(); mirrored refuses at once, naming the argument.
    assert want == {"object": "CheckpointManager"}
    assert "TypeError" in got["raises"], got
    assert_words(got, ("checkpoint=", "md.train.Checkpoint"))


def _every_replica_resumes(got, want):
    # TF 2.21 + Keras 3 restore an optimizer's slots, created after the restore under MirroredStrategy, into the
    # first replica only: the other replicas' next step differs from the uninterrupted run. mirrored's every
    # replica continues exactly as the uninterrupted run (TF's own first replica).
    assert want["resumed"][1] != want["continued"][1] and want["resumed"][0] == want["continued"][0]
    assert_same({**got, "resumed": None}, {**want, "resumed": None})
    assert_same(got["resumed"], want["continued"], "result.resumed")


def _directory_named(got, want):
    # TF tries to open the directory as a TensorBundle table (DataLossError); mirrored says what to pass.
    assert want["raises"][0] == "DataLossError"
    assert "IsADirectoryError" in got["raises"], got
    assert_words(got, ("is a directory", "latest_checkpoint"))


def _prefix_must_be_a_path(got, want):
    # TF converts the int 123 to the string "123" and saves "123-1" in the working directory.
    assert want == "123-1"
    assert "TypeError" in got["raises"], got
    assert_words(got, ("file_prefix=123", "path"))


def _not_a_checkpoint(got, want):
    # TF: DataLossError ("not an sstable"); mirrored's DataLossError is also its CheckpointError and says which
    # formats it reads.
    assert want["raises"][0] == "DataLossError"
    assert "CheckpointError" in got["raises"] and "DataLossError" in got["raises"], got
    assert_words(got, ("not a mirrored checkpoint",))


def _iterators_are_checkpointable(got, want):
    # TF 2.21 refuses a DistributedIterator in a Checkpoint (not trackable); SPEC §7 makes mirrored's
    # checkpointable, restoring the exact position.
    assert want["raises"][0] == "ValueError" and "trackable" in want["msg"]
    assert got["after"] == got["again"]
    assert [x for part in got["again"] for x in part["v"]] == [4, 5, 6, 7]  # the batch after the saved one


# (scenario, replicas) -> a check of mirrored's result where it differs from TensorFlow's on purpose
# (docs/tf_semantics.md says why); each also asserts what TF recorded, so a change on either side is noticed.
DELIBERATE = {
    ("mgr_needs_checkpoint", 1): _refused_at_construction,
    ("ck_sgd_momentum_resume", 2): _every_replica_resumes,
    ("ck_adam_resume", 2): _every_replica_resumes,
    ("ck_restore_directory", 1): _directory_named,
    ("ck_save_bad_prefix_type", 1): _prefix_must_be_a_path,
    ("fn_list_variables_garbage_file", 1): _not_a_checkpoint,
    ("ck_distributed_iterator", 1): _iterators_are_checkpointable,
    ("ck_distributed_iterator", 2): _iterators_are_checkpointable,
}


def assert_same(got, want, path="result"):
    semantics_parity.assert_same(got, want, path, _TF_ERRORS, key_order=False)  # (recorded with sorted keys)


def assert_words(got, words):
    for word in words:
        assert word.lower() in got["msg"].lower(), (word, got["msg"])


CASES = [(name, int(n)) for name, by_n in REFERENCE.items() for n in by_n]


def test_every_scenario_is_recorded():
    assert sorted(REFERENCE) == sorted(scenarios.SCENARIOS)
    assert len(CASES) >= 70


@pytest.mark.parametrize("name, n", CASES, ids=[f"{name}-{n}" for name, n in CASES])
def test_matches_tensorflow(name, n, tmp_path):
    fn, _, words = scenarios.SCENARIOS[name]
    want = REFERENCE[name][str(n)]
    got = scenarios.run_scenario(_ADAPTER, fn, n, str(tmp_path))
    if (name, n) in DELIBERATE:
        DELIBERATE[name, n](got, want)
        return
    assert_same(got, want)
    if isinstance(want, dict) and "raises" in want:
        assert_words(got, words)


# --- what the audit added, against NumPy ----------------------------------------------------------------------

_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def _two_replicas():
    return md.MirroredStrategy(["/cpu:0", "/cpu:1"])


def test_files_of_earlier_versions_still_restore(tmp_path):
    # Before the audit, tensors were named by their object path alone and the optimizer's counter "iterations".
    momentum = np.array([0.5, -0.25], np.float32)
    path = str(tmp_path / "old-3")
    md.checkpoint._write_atomic(path, {"model/w": np.array([3.0, 4.0], np.float32),
                                       "optimizer/iterations": np.int64(7),
                                       "optimizer/slots/model/w/momentum": momentum, "save_counter": np.int64(3)})
    strategy = _two_replicas()
    with strategy.scope():
        model = {"w": md.Variable(np.zeros(2, np.float32))}
        opt = md.optimizers.SGD(0.1, momentum=0.9)
    ckpt = md.train.Checkpoint(model=model, optimizer=opt)
    ckpt.restore(path).assert_consumed()
    assert int(opt.iterations.numpy()) == 7 and int(ckpt.save_counter.numpy()) == 3
    np.testing.assert_array_equal(opt.get_slot(model["w"], "momentum").numpy(), momentum)
    grad = np.array([1.0, 2.0], np.float32)
    strategy.run(lambda: opt.apply_gradients([(grad, model["w"])]))
    velocity = 0.9 * momentum - 0.1 * (2 * grad)  # Keras' SGD momentum; the 2 replicas' gradients summed
    for copy in model["w"].values:
        np.testing.assert_allclose(copy.numpy(), np.array([3.0, 4.0]) + velocity, rtol=1e-6)
    assert [name for name, _ in md.train.list_variables(ckpt.save(str(tmp_path / "new")))] == [
        "model/w" + _VALUE, "optimizer/_iterations" + _VALUE, "optimizer/_learning_rate" + _VALUE,
        "optimizer/_variables/2" + _VALUE, "save_counter" + _VALUE]  # saved again under Keras 3's names


def test_load_variable_names_as_tensorflow(tmp_path):
    values = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.float16(1.5)}
    path = md.train.Checkpoint(**{k: md.Variable(v) for k, v in values.items()}).write(str(tmp_path / "w"))
    assert md.train.list_variables(path) == [("a" + _VALUE, [2, 3]), ("b" + _VALUE, [])]
    for key, value in values.items():
        for name in (key + _VALUE, key + _VALUE + ":0"):
            got = md.train.load_variable(path, name)
            assert got.dtype == np.asarray(value).dtype
            np.testing.assert_array_equal(got, value)
    with pytest.raises(md.train.NotFoundError, match="Key a not found in checkpoint.*did you mean 'a/.ATTRIBUTES") \
            as info:
        md.train.load_variable(path, "a")
    assert isinstance(info.value, KeyError)  # what mirrored raised before, still caught by `except KeyError`
    assert md.checkpoint.load_checkpoint(path).keys() == {"a", "b"}  # mirrored's own: by object path


def test_checkpoints_iterator_yields_each_new_checkpoint_until_told_to_stop(tmp_path):
    import threading

    manager = md.train.CheckpointManager(md.train.Checkpoint(v=md.Variable(np.float32(1.0))), str(tmp_path), 5)
    manager.save()
    seen, wanted = [], threading.Event()
    saved_all = threading.Event()

    def saver():  # a training job saving whenever the evaluator asks
        for _ in range(2):
            wanted.wait()
            wanted.clear()
            manager.save()
        saved_all.set()

    thread = threading.Thread(target=saver)
    thread.start()
    try:
        for path in md.train.checkpoints_iterator(str(tmp_path), timeout=0.5,
                                                  timeout_fn=lambda: saved_all.is_set() and len(seen) == 3):
            seen.append(os.path.basename(path))
            wanted.set()
    finally:
        wanted.set()
        thread.join()
    assert seen == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert list(md.train.checkpoints_iterator(str(tmp_path / "none"), timeout=0)) == []
    for bad in ({"timeout": -1}, {"min_interval_secs": "1"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            next(md.train.checkpoints_iterator(str(tmp_path), **bad))


def test_variables_attached_after_restore_get_their_values(tmp_path):
    strategy = _two_replicas()
    with strategy.scope():
        model = md.Module()
        model.dense = md.Module()
        model.dense.w = md.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
        model.b = md.Variable(np.float64([1.5, -2.5]))
    path = md.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = md.Module()
    status = md.train.Checkpoint(model=fresh).restore(path)
    with pytest.raises(AssertionError, match="Unresolved object"):
        status.assert_consumed()
    with strategy.scope():
        fresh.b = md.Variable(np.zeros(2, np.float64))
        dense = md.Module()
        dense.w = md.Variable(np.zeros((2, 3), np.float32))
    fresh.dense = dense  # the value waits on `fresh` and moves to `dense`, which has w already
    for copy in fresh.dense.w.values:
        np.testing.assert_array_equal(copy.numpy(), np.arange(6).reshape(2, 3))
    for copy in fresh.b.values:
        np.testing.assert_array_equal(copy.numpy(), [1.5, -2.5])
    status.assert_consumed()

    other = md.Module()
    md.train.Checkpoint(model=other).restore(path)
    with pytest.raises(md.train.CheckpointError, match=r"model/b has float64\[2\].*float64\[3\]"):
        other.b = md.Variable(np.zeros(3, np.float64))
    later = {}
    md.train.Checkpoint(model=later).restore(path)
    later["b"] = md.Variable(np.zeros(2))  # a dict is no md.Module: nothing is told of its new keys
    np.testing.assert_array_equal(later["b"].numpy(), [0.0, 0.0])


def test_a_relative_manager_directory_stays_relative_and_deletes_only_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("run")
    with open(os.path.join("run", "notes.txt"), "w") as f:
        f.write("keep")
    manager = md.train.CheckpointManager(md.train.Checkpoint(v=md.Variable(np.float32(1.0))), "run", max_to_keep=1)
    assert [manager.save() for _ in range(3)] == [os.path.join("run", f"ckpt-{i}") for i in (1, 2, 3)]
    assert manager.directory == "run" and manager.checkpoints == [os.path.join("run", "ckpt-3")]
    assert sorted(os.listdir("run")) == ["checkpoint", "ckpt-3", "notes.txt"]
    monkeypatch.chdir(tmp_path / "run")
    assert md.train.latest_checkpoint(".") == os.path.join(".", "ckpt-3")
    # The process moved: the manager's files stay where its directory was when it was made.
    assert manager.save() == os.path.join("run", "ckpt-4")
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint", "ckpt-4", "notes.txt"]
    assert md.train.latest_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "ckpt-4")


def test_a_root_objects_children_are_saved_at_the_top(tmp_path):
    root = md.Module()
    root.w = md.Variable(np.float32([1.0, 2.0]))
    extra = md.Variable(np.int64(5))
    path = md.train.Checkpoint(root, extra=extra).save(str(tmp_path / "ckpt"))
    assert [name for name, _ in md.train.list_variables(path)] == ["extra" + _VALUE, "save_counter" + _VALUE,
                                                                   "w" + _VALUE]
    fresh = md.Module()
    fresh.w = md.Variable(np.float32([0.0, 0.0]))
    ckpt = md.train.Checkpoint(fresh, extra=md.Variable(np.int64(0)))
    ckpt.restore(path).assert_consumed()
    assert ckpt.root is fresh and int(ckpt.extra.numpy()) == 5
    np.testing.assert_array_equal(fresh.w.numpy(), [1.0, 2.0])


def test_deferred_restoration_into_an_unhashable_module_and_its_release(tmp_path):
    import gc
    import weakref

    class Layer(md.Module):
        def __eq__(self, other):  # makes the class unhashable, as dataclass-like modules are
            return isinstance(other, Layer)

    saved = Layer()
    saved.w = md.Variable(np.float32([1.0, 2.0]))
    path = md.train.Checkpoint(layer=saved).save(str(tmp_path / "ckpt"))
    fresh = Layer()
    md.train.Checkpoint(layer=fresh).restore(path)
    fresh.w = md.Variable(np.float32([0.0, 0.0]))
    np.testing.assert_array_equal(fresh.w.numpy(), [1.0, 2.0])
    waiting = Layer()
    md.train.Checkpoint(layer=waiting).restore(path)
    gone = weakref.ref(waiting)
    del waiting
    gc.collect()
    assert gone() is None  # a value left waiting does not keep its holder alive
    assert not md.checkpoint._DEFERRED.get(id(fresh))
