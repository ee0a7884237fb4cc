"""md.Checkpoint: round trip, other replica counts, atomic saves, damaged files."""

import os
import pathlib

import numpy as np
import pytest

import mirrored as md
from mirrored import checkpoint as ckpt_mod


def _strategy(n):
    return md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(n)])


def _setup(n, seed):
    """A strategy, a two-variable model and an Adam optimizer, values from ``seed``."""
    rng = np.random.default_rng(seed)
    strategy = _strategy(n)
    with strategy.scope():
        model = {"w": md.Variable(rng.normal(size=(3, 2)).astype(np.float32), name="w"),
                 "b": md.Variable(rng.normal(size=2).astype(np.float32), name="b")}
        opt = md.optimizers.Adam(0.05)
    return strategy, model, opt


def _train(strategy, model, opt, steps, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in model.items()}
        # Each replica's share of the gradient (as from a loss divided by the global batch): summed
        # across replicas, it is g whatever the replica count.
        share = np.float32(1.0 / strategy.num_replicas_in_sync)
        strategy.run(lambda: opt.apply_gradients([(g[k] * share, model[k]) for k in sorted(model)]))


def _state(model, opt):
    out = {k: v.numpy().copy() for k, v in model.items()}
    out.update({f"{k}/{s}": opt.get_slot(v, s).numpy().copy() for k, v in model.items() for s in ("m", "v")})
    out["iterations"] = int(opt.iterations.numpy())
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("n_save,n_restore", [(2, 2), (4, 1), (1, 3)])
def test_round_trip_into_any_replica_count(tmp_path, n_save, n_restore):
    strategy, model, opt = _setup(n_save, seed=0)
    _train(strategy, model, opt, steps=3)
    path = md.Checkpoint(model=model, optimizer=opt).save(tmp_path / "a.ckpt")
    saved = _state(model, opt)

    strategy2, model2, opt2 = _setup(n_restore, seed=99)  # other values, fresh optimizer
    md.Checkpoint(model=model2, optimizer=opt2).restore(path)
    opt2.build([model2[k] for k in sorted(model2)])  # as Keras 3: the restored slots are filled at the build
    _assert_same(_state(model2, opt2), saved)
    for v in (*model2.values(), opt2.get_slot(model2["w"], "m"), opt2.iterations):
        assert len(v.values) == n_restore
        assert all(np.array_equal(np.asarray(c), np.asarray(v.values[0])) for c in v.values)

    # Training goes on exactly as it would have without the save/restore.
    _train(strategy, model, opt, steps=2, seed=5)
    _train(strategy2, model2, opt2, steps=2, seed=5)
    for k in model:
        np.testing.assert_allclose(model2[k].numpy(), model[k].numpy(), rtol=1e-6)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    strategy, model, opt = _setup(2, seed=0)
    _train(strategy, model, opt, steps=1)
    ckpt = md.Checkpoint(model=model, optimizer=opt)
    path = ckpt.write(tmp_path / "a.ckpt")
    before = pathlib.Path(path).read_bytes()
    _train(strategy, model, opt, steps=1)

    def crash(*_):
        raise KeyboardInterrupt  # as if the job were stopped after writing the data, before the rename

    monkeypatch.setattr(ckpt_mod.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write(path)
    monkeypatch.undo()
    assert pathlib.Path(path).read_bytes() == before
    assert os.listdir(tmp_path) == ["a.ckpt"]  # no temporary file left behind
    ckpt.restore(path)
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:10], "not a mirrored checkpoint|truncated"),
    (lambda b: b[:-40] + bytes([b[-40] ^ 1]) + b[-39:], "corrupted"),
    (lambda b: b"PK\x03\x04" + b[4:], "not a mirrored checkpoint"),
    (lambda b: b"", "not a mirrored checkpoint"),
])
def test_damaged_file_raises_and_restores_nothing(tmp_path, damage, message):
    strategy, model, opt = _setup(2, seed=0)
    _train(strategy, model, opt, steps=2)
    path = md.Checkpoint(model=model, optimizer=opt).save(tmp_path / "a.ckpt")
    with open(path, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(damage(blob))

    _, model2, opt2 = _setup(2, seed=99)
    before = {k: v.numpy().copy() for k, v in model2.items()}
    with pytest.raises(md.checkpoint.CheckpointError, match=message):
        md.Checkpoint(model=model2, optimizer=opt2).restore(path)
    for k in model2:
        np.testing.assert_array_equal(model2[k].numpy(), before[k])
    assert opt2._iterations is None  # the fresh optimizer was not touched


def test_shape_mismatch_restores_nothing(tmp_path):
    _, model, opt = _setup(2, seed=0)
    path = md.Checkpoint(model=model).save(tmp_path / "a.ckpt")
    strategy = _strategy(2)
    with strategy.scope():
        other = {"w": md.Variable(np.zeros((3, 5), np.float32)), "b": md.Variable(np.zeros(2, np.float32))}
    with pytest.raises(md.checkpoint.CheckpointError, match=r"model/w.*\[3, 2\].*\[3, 5\]"):
        md.Checkpoint(model=other).restore(path)
    np.testing.assert_array_equal(other["b"].numpy(), np.zeros(2))


def test_objects_attributes_lists_and_model_only_restore(tmp_path):
    class Net:
        def __init__(self, value):
            self.layers = [{"w": md.Variable(np.full(2, value))}, {"w": md.Variable(np.full(3, value))}]
            self.step = md.Variable(np.int64(value))
            self._cache = np.zeros(1)  # not a variable, not saved

    strategy = _strategy(2)
    with strategy.scope():
        net, opt = Net(1.0), md.optimizers.SGD(0.1, momentum=0.9)
    strategy.run(lambda: opt.apply_gradients([(np.ones(2), net.layers[0]["w"])]))
    path = md.Checkpoint(net=net, optimizer=opt).write(tmp_path / "n.ckpt")
    # Keras 3's names; as in TF, the optimizer's _trainable_variables/0 reaches layers[0]["w"] first (depth 3,
    # against net/layers/0/w's 4), so that names it, and net/layers/0/w finds it at a restore.
    assert sorted(md.checkpoint.load_checkpoint(path)) == [
        "net/layers/1/w", "net/step", "optimizer/_iterations", "optimizer/_learning_rate",
        "optimizer/_trainable_variables/0", "optimizer/_variables/2"]
    with strategy.scope():
        net2 = Net(0.0)
    md.Checkpoint(net=net2).restore(path)  # optimizer entries in the file are simply not claimed
    np.testing.assert_allclose(net2.layers[0]["w"].numpy(), [0.8, 0.8])  # 1 - 0.1 * (1 + 1): summed over 2 replicas
    assert int(net2.step.numpy()) == 1


def test_only_the_chief_writes(tmp_path, monkeypatch):
    strategy, model, _ = _setup(2, seed=0)
    monkeypatch.setattr(type(strategy.extended), "should_checkpoint", property(lambda self: False))
    path = md.Checkpoint(model=model).save(tmp_path / "a.ckpt")
    assert path == str(tmp_path / "a.ckpt-1")
    assert os.listdir(tmp_path) == []  # neither the file nor the state file


def test_optimizer_saved_without_its_model(tmp_path):
    # As Keras 3: the slots are numbered by build order, so an optimizer is saved and restored on its own.
    strategy, model, opt = _setup(2, seed=0)
    _train(strategy, model, opt, steps=1)
    path = md.Checkpoint(optimizer=opt).save(tmp_path / "a.ckpt")
    # As Keras 3 in TF: the optimizer tracks the variables it was built for, so they are saved with it.
    assert sorted(md.checkpoint.load_checkpoint(path)) == [
        "optimizer/_iterations", "optimizer/_learning_rate", "optimizer/_trainable_variables/0",
        "optimizer/_trainable_variables/1", *(f"optimizer/_variables/{i}" for i in range(2, 6)), "save_counter"]
    _, model2, opt2 = _setup(2, seed=3)
    before = {k: v.numpy() for k, v in model2.items()}
    status = md.Checkpoint(optimizer=opt2).restore(path)
    opt2.build([model2[k] for k in sorted(model2)])
    # As TF 2.21: the build does not restore the model's variables from that list; they keep their values and
    # the file's entries stay unclaimed.
    with pytest.raises(AssertionError, match="optimizer/_trainable_variables/0"):
        status.assert_consumed()
    for k in model2:
        np.testing.assert_array_equal(model2[k].numpy(), before[k])
    for k in model:
        for s in ("m", "v"):
            np.testing.assert_array_equal(opt2.get_slot(model2[k], s).numpy(), opt.get_slot(model[k], s).numpy())


def test_save_inside_run_is_refused(tmp_path):
    strategy, model, _ = _setup(2, seed=0)
    ckpt = md.Checkpoint(model=model)
    with pytest.raises(RuntimeError, match="outside run"):
        strategy.run(lambda: ckpt.save(tmp_path / "a.ckpt"))


# --- multi-worker: every worker saves; a shared path is the chief's alone; TF's per-worker directories ---

def _multiworker_task(directory):
    import shutil

    from mirrored.distribute.multi_worker_strategy import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=30), devices=["/cpu:0"])
    with strategy.scope():
        model = {"w": md.Variable(np.zeros(3, np.float32), name="w")}
        opt = md.optimizers.SGD(0.1, momentum=0.9)
    # Worker k's gradient is k+1 everywhere: the fused all-reduce spans the workers.
    grad = lambda: np.full(3, md.get_replica_context().replica_id_in_sync_group + 1.0, np.float32)  # noqa: E731
    for _ in range(2):
        strategy.run(lambda: opt.apply_gradients([(grad(), model["w"])]))
    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type}-{resolver.task_id}"
    ckpt = md.Checkpoint(model=model, optimizer=opt)
    ckpt.write(os.path.join(directory, "shared.ckpt"))  # the same path on every worker: the chief writes it
    ckpt.write(os.path.join(directory, f"{task}.ckpt"))  # a path of each worker's own: each writes its own

    # TensorFlow's documented pattern: the chief saves to the real directory, the others to a temporary one.
    chief = strategy.extended.should_checkpoint
    write_dir = os.path.join(directory, "run") if chief else os.path.join(directory, f"workertemp_{resolver.task_id}")
    manager = md.train.CheckpointManager(ckpt, write_dir, max_to_keep=1)
    saved = [manager.save(), manager.save()]
    mine = sorted(os.listdir(write_dir))
    with strategy.scope():
        fresh = {"w": md.Variable(np.ones(3, np.float32), name="w")}
        fresh_opt = md.optimizers.SGD(0.1, momentum=0.9)
    status = md.Checkpoint(model=fresh, optimizer=fresh_opt).restore(saved[-1])  # every path save() returned
    fresh_opt.build([fresh["w"]])  # the restored slots are filled at the build (Keras 3)
    status.assert_consumed()
    if not chief:
        shutil.rmtree(write_dir)
    strategy.reduce("SUM", strategy.run(lambda: np.ones(1)), axis=None)  # a barrier: every file is written
    with strategy.scope():
        other = {"w": md.Variable(np.ones(3, np.float32), name="w")}
    md.Checkpoint(model=other).restore(os.path.join(directory, "chief-0.ckpt")).expect_partial()
    return fresh["w"].numpy(), int(fresh_opt.iterations.numpy()), other["w"].numpy(), mine


@pytest.mark.multiworker
def test_multiworker_checkpoints_every_saved_path_restores(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import launch

    results = launch(_multiworker_task, 1, chief=True, kwargs={"directory": str(tmp_path)}, timeout=120)
    for r in results:
        assert r.ok, (r.task, r.error, r.message, r.stderr[-2000:])
    # The temporary directory is gone; nothing else (no temporaries) is left.
    assert sorted(os.listdir(tmp_path)) == ["chief-0.ckpt", "run", "shared.ckpt", "worker-0.ckpt"]
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint", "ckpt-2"]
    # SGD with momentum 0.9, lr 0.1 on the summed gradient 1 + 2 = 3: v = -0.3, then -0.57; w = -0.87.
    for r in results:
        w, iterations, chiefs, listing = r.value
        np.testing.assert_allclose(w, np.full(3, -0.87), rtol=1e-6)
        np.testing.assert_allclose(chiefs, np.full(3, -0.87), rtol=1e-6)
        assert iterations == 2
        assert listing == ["checkpoint", "ckpt-2"]  # each worker's manager keeps its own directory


def test_sync_on_read_sum_keeps_its_total_across_replica_counts(tmp_path):
    def counter(n):
        strategy = _strategy(n)
        with strategy.scope():
            return strategy, md.Variable(np.zeros(2), trainable=False, aggregation=md.VariableAggregation.SUM,
                                         synchronization=md.VariableSynchronization.ON_READ)

    strategy, seen = counter(2)
    strategy.run(lambda: seen.assign_add(np.full(2, md.get_replica_context().replica_id_in_sync_group + 1.0)))
    path = md.Checkpoint(metrics={"seen": seen}).save(tmp_path / "m.ckpt")
    _, seen4 = counter(4)
    md.Checkpoint(metrics={"seen": seen4}).restore(path)
    np.testing.assert_allclose(seen4.numpy(), [3.0, 3.0])  # 1 + 2, now spread over 4 copies


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int8", "uint8", "int32"])
def test_every_supported_dtype_round_trips(tmp_path, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    value = (np.arange(6).reshape(2, 3) - 2).astype(dtype)
    strategy = _strategy(2)
    with strategy.scope():
        v = md.Variable(value)
    path = md.Checkpoint(v=v).save(tmp_path / "d.ckpt")
    with strategy.scope():
        w = md.Variable(np.zeros_like(value))
    md.Checkpoint(v=w).restore(path)
    assert w.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(w.numpy().astype(np.float64), value.astype(np.float64))


_SAVE_FOREVER = """
import sys, numpy as np, mirrored as md
w = md.Variable(np.zeros(4_000_000, np.float32))  # 16 MB: a save takes long enough to be cut short
ckpt = md.Checkpoint(w=w)
for i in range(1, 10**6):
    w.assign(np.full(w.shape, i, np.float32))
    ckpt.write(sys.argv[1])
    print(i, flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_a_complete_checkpoint(tmp_path):
    import signal
    import subprocess
    import sys

    path = tmp_path / "w.ckpt"
    # The child imports mirrored exactly as this process does (same interpreter, same environment).
    proc = subprocess.Popen([sys.executable, "-c", _SAVE_FOREVER, str(path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline()  # the first save is complete
        proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)  # most likely in the middle of writing the next one
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    w = md.checkpoint.load_checkpoint(path)["w"]
    assert w.min() == w.max() >= 1  # one whole save, never a mix of two
