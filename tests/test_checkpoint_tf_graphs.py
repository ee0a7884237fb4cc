"""150 seeded random checkpoint object graphs (tests/tf_checkpoint_graphs.py), both directions against TensorFlow
2.21 + Keras 3.15 as tests/data/record_tf_checkpoint_graphs.py recorded them (the suite never imports TF):

* TF wrote, mirrored reads: ``list_variables`` / ``load_variable`` of TF's file (tests/data/tf_checkpoint_graphs/)
  give TF's names, shapes, dtypes and values; restoring it into mirrored's equivalent objects gives every replica
  the values TF's own restore gave, with the same status outcomes, whole, with a top-level object left out, with a
  variable more, and with the variables created after the restore; and what mirrored then saves is TF's file again.
* mirrored writes: the same graph built, trained and saved by mirrored holds TF's names, shapes, dtypes and values
  (mirrored writes its own format, not a TensorBundle, so TF's side is its file of the same graph).
* 30 random CheckpointManager sequences (saves with and without numbers, reopening with another max_to_keep,
  keep_checkpoint_every_n_hours, checkpoint_name, restore_or_initialize, a Checkpoint.save in the same
  directory): after each step the manager's checkpoints and latest, latest_checkpoint, the files, the state
  file, list_variables / load_variable of the latest and save_counter are TF's.

String variables exist in TF only: mirrored reads them (``load_variable``) and its restore leaves them unclaimed.
"""

import json
import os

import ml_dtypes  # noqa: F401  registers bfloat16 with NumPy
import numpy as np
import pytest

import mirrored as md
import tf_checkpoint_graphs as graphs
from scenario_adapter import ScenarioAdapter

DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "tf_checkpoint_graphs.json")) as _f:
    REFERENCE = json.load(_f)
CASES = graphs.cases()


class Mirrored(ScenarioAdapter):
    MirroredStrategy = md.MirroredStrategy
    Variable = md.Variable
    Module = md.Module
    Checkpoint = md.train.Checkpoint
    CheckpointManager = md.train.CheckpointManager
    train = md.train
    VariableSynchronization = md.VariableSynchronization
    VariableAggregation = md.VariableAggregation
    strings = False

    @staticmethod
    def optimizer(kind, **config):
        return getattr(md.optimizers, kind)(**config)

    @staticmethod
    def const(value, dtype):
        return np.asarray(value, dtype)


_X = Mirrored()


def _has_strings(case) -> bool:
    return any(v["dtype"] == "string" for v in graphs.variables(case["tree"]))


def _string_ids(case) -> set:
    return {str(v["id"]) for v in graphs.variables(case["tree"]) if v["dtype"] == "string"}


def assert_arrays(got, want, where, rtol=0.0):
    assert got["dtype"] == want["dtype"] and got["shape"] == want["shape"], (where, got, want)
    if "sha256" in want:
        assert got.get("sha256") == want["sha256"], where
    elif rtol:
        np.testing.assert_allclose(got["v"], want["v"], rtol=rtol, atol=1e-7, err_msg=where)
    else:
        assert got["v"] == want["v"], (where, got["v"], want["v"])


def test_the_generator_is_what_was_recorded():
    assert REFERENCE["seed"] == graphs.SEED and sorted(REFERENCE["cases"]) == [c["name"] for c in CASES]
    kinds = {v["dtype"] for c in CASES for v in graphs.variables(c["tree"])}
    assert kinds >= set(graphs.DTYPES) | {"string"}
    assert {c["optimizer"]["kind"] for c in CASES if c["optimizer"]} == {k for k, _ in graphs.OPTIMIZERS}
    assert {c["replicas"] for c in CASES} == {1, 2, 3}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_tensorflow_file_reads_and_restores_as_in_tensorflow(case):
    want = REFERENCE["cases"][case["name"]]
    path = os.path.join(DATA, "tf_checkpoint_graphs", want["path"])
    assert [[k, s] for k, s in md.train.list_variables(path)] == want["names"]
    for key, value in want["values"].items():
        assert_arrays(graphs.arr(md.train.load_variable(path, key)), value, key)
    reader = md.train.load_checkpoint(path)  # tf.train.load_checkpoint's reader methods, TF's tensor names
    assert sorted([k, s] for k, s in reader.get_variable_to_shape_map().items()) == want["names"]
    for key, value in want["values"].items():
        assert_arrays(graphs.arr(reader.get_tensor(key)), value, key)
    strings = _has_strings(case)
    for how, kwargs in (("full", {}), ("partial", {"drop": case["drop"]}), ("extra", {"extra": True}),
                        ("deferred", {"deferred": True})):
        ckpt, made, optimizer, attach = graphs.build(_X, case, zero=True, **kwargs)
        status = ckpt.restore(path)
        got = {"before": graphs.statuses(status)}
        if kwargs.get("deferred"):
            attach()
        var_list = [made[i] for i in case["optimizer"]["vars"] if i in made] if optimizer is not None else []
        if var_list and len(var_list) < len(case["optimizer"]["vars"]) and any(o is optimizer for o in ckpt._objects.values()):
            # Deliberate (docs/checkpoints.md): the file's slots are numbered for more variables than this build's,
            # so they would land on the wrong variables; TF 2.21 assigns them by number, mirrored refuses.
            with pytest.raises(md.train.CheckpointError, match="another optimizer kind or configuration"):
                optimizer.build(var_list)
            continue
        if var_list:
            optimizer.build(var_list)
        got["after"] = graphs.statuses(status)
        assert status.expect_partial() is status and graphs.statuses(status) == got["after"]  # silences only
        expected = want[how]
        for when in ("before", "after"):
            checks = dict(expected[when])
            if strings and checks["assert_consumed"] == "ok":
                checks["assert_consumed"] = "AssertionError"  # TF's string variables: nothing here claims them
            assert got[when] == checks, (how, when)
        wanted_vars = {k: v for k, v in expected["vars"].items() if k not in _string_ids(case)}
        assert sorted(str(i) for i in made) == sorted(wanted_vars), how
        for vid, copies in wanted_vars.items():
            got_copies = graphs.replicas(made[int(vid)])
            assert len(got_copies) == len(copies), (how, vid)
            for r, (g, w) in enumerate(zip(got_copies, copies)):
                assert_arrays(g, w, f"{how}: variable {vid} replica {r}")
        if how == "full":
            _saves_tensorflow_file_again(ckpt, want, case)


def _saves_tensorflow_file_again(ckpt, want, case):
    """What mirrored saves from the restored objects is what TF saves from its own (an integer ON_READ SUM
    variable, restored as its sum divided among the replicas, may lose the remainder in both)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = ckpt.write(os.path.join(tmp, "again"))
        _assert_tensorflow_names_and_values(path, want["full"]["resaved"], case, rtol=0.0)


def _assert_tensorflow_names_and_values(path, values, case, rtol):
    """mirrored's file at ``path`` holds TF's tensors (``values``: name -> array) but the string ones."""
    want_names = sorted([k, v["shape"]] for k, v in values.items() if v["dtype"] != "string")
    got_names = [[k, s] for k, s in md.train.list_variables(path)]
    assert got_names == want_names
    trained = case["optimizer"] is not None and case["optimizer"]["steps"] > 0
    for key, _ in got_names:
        assert_arrays(graphs.arr(md.train.load_variable(path, key)), values[key], key,
                      rtol=rtol if trained else 0.0)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_mirrored_writes_tensorflows_names_and_values(case, tmp_path):
    want = REFERENCE["cases"][case["name"]]
    ckpt, made, optimizer, _ = graphs.build(_X, case)
    graphs.set_on_read_copies(_X, case, made)
    graphs.train(_X, case, made, optimizer)
    for vid, copies in want["saved"].items():
        if vid in _string_ids(case):
            continue
        for r, (g, w) in enumerate(zip(graphs.replicas(made[int(vid)]), copies)):
            assert_arrays(g, w, f"variable {vid} replica {r}", rtol=1e-5)
    path = ckpt.save(str(tmp_path / case["name"]))
    assert os.path.basename(path) == want["path"]
    _assert_tensorflow_names_and_values(path, want["values"], case, rtol=1e-5)


MANAGERS = graphs.manager_cases()


def test_manager_cases_are_what_was_recorded():
    assert sorted(REFERENCE["managers"]) == [c["name"] for c in MANAGERS]
    ops = {op for c in MANAGERS for op, _ in c["ops"]}
    assert ops == {"save", "reopen", "restore_or_initialize", "save_checkpoint"}
    assert {c["hours"] for c in MANAGERS} == {None, 1e-9, 1000.0}


@pytest.mark.parametrize("case", MANAGERS, ids=[c["name"] for c in MANAGERS])
def test_checkpoint_manager_sequences_as_in_tensorflow(case, tmp_path):
    import tf_checkpoint_scenarios as scenarios

    got = graphs.run_manager_case(_X, case, str(tmp_path), scenarios.files, scenarios.state_lines, scenarios.rel)
    want = REFERENCE["managers"][case["name"]]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, (k, case["ops"][k])


# --- the mismatches the graphs found, each alone (TF 2.21's results, recorded with its list_variables) ----------

_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def _names(ckpt, tmp_path):
    return [k[:-len(_VALUE)] for k, _ in md.train.list_variables(ckpt.write(str(tmp_path / "w")))]


def test_a_shared_variable_is_named_by_its_shortest_then_first_attached_path(tmp_path):
    v = md.Variable(np.float32(1.0))
    m = md.Module()
    m.x, m.b = v, v
    assert _names(md.train.Checkpoint(m=m), tmp_path) == ["m/x"]  # attachment order, not sorted
    assert _names(md.train.Checkpoint(d={"z": {"q": v}, "a": {"q": v}}), tmp_path) == ["d/z/q"]  # insertion
    deep = md.Module()
    deep.z = md.Module()
    deep.z.q = v
    deep.a = v
    assert _names(md.train.Checkpoint(m=deep), tmp_path) == ["m/a"]  # breadth first: the shorter path
    assert _names(md.train.Checkpoint(z=v, a=v), tmp_path) == ["a"]  # keyword arguments by name
    ckpt = md.train.Checkpoint()
    ckpt.z, ckpt.a = v, v
    assert _names(ckpt, tmp_path) == ["z"]  # attributes in the order set


def test_a_model_variable_reached_first_through_the_optimizer_is_named_there(tmp_path):
    layer = md.Module()
    layer.emb = md.Variable(np.float32([1.0, 2.0]))
    opt = md.optimizers.SGD(0.1)
    opt.build([layer.emb])
    # "optimizer" < "v": the optimizer's _trainable_variables/0 (depth 3) is reached before v/0/emb (depth 3).
    assert _names(md.train.Checkpoint(v=[layer], optimizer=opt), tmp_path) == [
        "optimizer/_iterations", "optimizer/_learning_rate", "optimizer/_trainable_variables/0"]
    assert "a/emb" in _names(md.train.Checkpoint(a=layer, optimizer=opt), tmp_path)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_shared_variable_restores_through_its_other_path(tmp_path, deferred):
    # As TF matches along every edge of its object graph (g006, g098 of the graphs): the file names v a/x, and
    # b/x reaches it too.
    v = md.Variable(np.float32([3.0, 4.0]))
    first, second = md.Module(), md.Module()
    first.x, second.x = v, v
    path = md.train.Checkpoint(a=first, b=second).save(str(tmp_path / "ckpt"))
    assert [k for k, _ in md.train.list_variables(path)] == ["a/x" + _VALUE, "save_counter" + _VALUE]
    holder = md.Module()
    if not deferred:
        holder.x = md.Variable(np.zeros(2, np.float32))
    status = md.train.Checkpoint(b=holder).restore(path)
    if deferred:
        holder.x = md.Variable(np.zeros(2, np.float32))  # created after the restore
    np.testing.assert_array_equal(holder.x.numpy(), [3.0, 4.0])
    status.assert_consumed()
