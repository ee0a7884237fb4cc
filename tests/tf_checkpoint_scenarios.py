"""Scenarios of tf.train.Checkpoint / CheckpointManager semantics, written once over a small adapter ``X`` so that
the same code runs in TensorFlow (tests/data/record_tf_checkpoint_api.py records it) and in mirrored
(tests/test_checkpoint_tf_parity.py compares). This module imports neither TensorFlow nor mirrored.

The adapter offers: ``X.strategy(n)`` (MirroredStrategy over n CPU replicas), ``X.Variable``, ``X.Module``,
``X.Checkpoint``, ``X.CheckpointManager``, ``X.train`` (``tf.train`` / ``md.train``: ``latest_checkpoint``,
``get_checkpoint_state``, ``checkpoints_iterator``, ``list_variables``, ``load_variable``), ``X.SGD`` / ``X.Adam``
(Keras 3's optimizers / ``md.optimizers``), ``X.Dataset`` and ``X.const(value, dtype)``.

Each scenario ``fn(X, n, tmp)`` runs in a fresh directory ``tmp`` and returns plain data: paths relative to
``tmp``, arrays as {dtype, shape, values}; an exception becomes ``{"raises": [class names of its MRO], "msg"}``.
``words`` are the key words both libraries' messages must contain.
"""

import json
import os
import re

import numpy as np

SCENARIOS = {}  # name -> (fn, replica counts, words)
BOTH = (1, 2)
ONE = (1,)


def scenario(ns=BOTH, words=()):
    def register(fn):
        SCENARIOS[fn.__name__] = (fn, tuple(ns), tuple(words))
        return fn
    return register


OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"  # TF's serialized object graph: not a variable (docs/tf_semantics.md)


def arr(x):
    a = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    values = np.stack([a.real, a.imag], -1) if a.dtype.kind == "c" else a  # JSON has no complex numbers
    return {"dtype": a.dtype.name, "shape": list(a.shape), "v": values.tolist()}


def replicas(v):
    """Every replica's copy of a (distributed or plain) variable."""
    return [arr(c) for c in getattr(v, "values", (v,))]


def rel(tmp, path):
    return None if path is None else os.path.relpath(os.fspath(path), tmp)


def files(tmp):
    """The checkpoints and other files under ``tmp``: TF's ``p.index`` + ``p.data-*`` count as one checkpoint ``p``
    (mirrored writes one file per checkpoint); hidden files (temporaries) are left out."""
    out = []
    for root, dirs, names in os.walk(tmp):
        for name in names:
            if name.startswith(".") or re.search(r"\.data-\d{5}-of-\d{5}$", name):
                continue
            out.append(rel(tmp, os.path.join(root, name[:-len(".index")] if name.endswith(".index") else name)))
    return sorted(out)


def state_lines(directory, name="checkpoint"):
    """The state file's lines, numbers of seconds replaced by ``T``."""
    with open(os.path.join(directory, name), encoding="utf-8") as f:
        return [re.sub(r":\s*[0-9.e+]+$", ": T", line) for line in f.read().splitlines() if line.strip()]


def names(X, path):
    return [(k, list(s)) for k, s in X.train.list_variables(path) if k != OBJECT_GRAPH]


def outcome(call):
    """What ``call()`` gives: the returned object's type name, or the exception."""
    try:
        return {"returns": type(call()).__name__}
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": [c.__name__ for c in type(e).__mro__], "msg": str(e)}


def statuses(status):
    return {name: outcome(getattr(status, name)) for name in
            ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match")}


def run_scenario(X, fn, n, tmp):
    try:
        # An object that is not plain data (a status, a manager) stands as its type's name.
        return json.loads(json.dumps(fn(X, n, tmp), default=lambda o: {"object": type(o).__name__}))
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": [c.__name__ for c in type(e).__mro__], "msg": str(e)}


def var(X, n, value, dtype="float32"):
    with X.strategy(n).scope():
        return X.Variable(X.const(value, dtype))


# --- Checkpoint(**objects): what is tracked, under which names ----------------------------------------------

@scenario()
def ck_variable_names(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, [1.0, 2.0]), w=var(X, n, [[3.0]]))
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    return names(X, path)


@scenario(ONE)
def ck_dict_and_list(X, n, tmp):
    v, w = var(X, n, 1.0), var(X, n, [2.0, 3.0])
    path = X.Checkpoint(d={"b": v, "a": w}, l=[w, v]).write(os.path.join(tmp, "w"))
    return names(X, path)


@scenario(ONE)
def ck_module(X, n, tmp):
    m = X.Module()
    m.w = var(X, n, [1.0, 2.0])
    m.inner = X.Module()
    m.inner.b = var(X, n, 3.0)
    path = X.Checkpoint(model=m).write(os.path.join(tmp, "w"))
    return names(X, path)


@scenario(ONE)
def ck_root_object(X, n, tmp):
    m = X.Module()
    m.w = var(X, n, [1.0, 2.0])
    path = X.Checkpoint(m, extra=var(X, n, 5.0)).write(os.path.join(tmp, "w"))
    return names(X, path)


@scenario(ONE)
def ck_nested_checkpoint(X, n, tmp):
    inner = X.Checkpoint(v=var(X, n, 1.0))
    path = X.Checkpoint(inner=inner, w=var(X, n, 2.0)).save(os.path.join(tmp, "ckpt"))
    return names(X, path)


@scenario(ONE)
def ck_attribute_after_construction(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    ckpt.w = var(X, n, 2.0)
    return names(X, ckpt.write(os.path.join(tmp, "w")))


@scenario(ONE)
def ck_shared_variable_saved_once(X, n, tmp):
    v = var(X, n, 1.0)
    return names(X, X.Checkpoint(a=v, b=v).write(os.path.join(tmp, "w")))


@scenario(ONE, words=("trackable",))
def ck_rejects_int(X, n, tmp):
    return X.Checkpoint(x=3)


@scenario(ONE, words=("trackable",))
def ck_rejects_float(X, n, tmp):
    return X.Checkpoint(x=0.5)


@scenario(ONE, words=("trackable",))
def ck_rejects_str(X, n, tmp):
    return X.Checkpoint(x="s")


@scenario(ONE, words=("trackable",))
def ck_rejects_none(X, n, tmp):
    return X.Checkpoint(x=None)


@scenario(ONE, words=("trackable",))
def ck_rejects_attribute_int(X, n, tmp):
    ckpt = X.Checkpoint()
    ckpt.x = 3
    return "accepted"


# --- save / save_counter / write -------------------------------------------------------------------------

@scenario()
def ck_save_counter_before_save(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    return arr(ckpt.save_counter)


@scenario()
def ck_save_numbering(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    paths = [rel(tmp, ckpt.save(os.path.join(tmp, "new", "dir", "ckpt"))) for _ in range(3)]
    return {"paths": paths, "counter": arr(ckpt.save_counter), "files": files(tmp),
            "state": state_lines(os.path.join(tmp, "new", "dir")),
            "latest": rel(tmp, X.train.latest_checkpoint(os.path.join(tmp, "new", "dir")))}


@scenario(ONE)
def ck_save_two_prefixes(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    paths = [rel(tmp, ckpt.save(os.path.join(tmp, p))) for p in ("a", "b", "a")]
    return {"paths": paths, "files": files(tmp), "state": state_lines(tmp)}


@scenario()
def ck_write_has_no_counter(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    path = ckpt.write(os.path.join(tmp, "sub", "model"))
    return {"path": rel(tmp, path), "files": files(tmp), "names": names(X, path),
            "latest": X.train.latest_checkpoint(os.path.join(tmp, "sub"))}


@scenario(ONE)
def ck_write_after_save(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    saved = ckpt.save(os.path.join(tmp, "ckpt"))
    written = ckpt.write(os.path.join(tmp, "w"))
    return {"saved": rel(tmp, saved), "written": rel(tmp, written), "counter": arr(ckpt.save_counter),
            "names": names(X, written), "state": state_lines(tmp)}


@scenario(ONE)
def ck_save_counter_attribute_readonly(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    ckpt.save_counter = var(X, n, 7, "int64")
    return "accepted"


# --- restore / read and their status objects --------------------------------------------------------------

@scenario()
def ck_restore_values(X, n, tmp):
    v = var(X, n, [1.0, 2.0])
    ckpt = X.Checkpoint(v=v)
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    v.assign(X.const([5.0, 6.0], "float32"))
    status = ckpt.restore(path)
    return {"status": type(status).__name__, "v": replicas(v), "checks": statuses(status)}


@scenario()
def ck_restore_save_counter(X, n, tmp):
    first = X.Checkpoint(v=var(X, n, 1.0))
    for _ in range(2):
        path = first.save(os.path.join(tmp, "ckpt"))
    second = X.Checkpoint(v=var(X, n, 0.0))
    second.restore(path).assert_consumed()
    return {"counter": arr(second.save_counter), "next": rel(tmp, second.save(os.path.join(tmp, "ckpt")))}


@scenario(ONE)
def ck_restore_none(X, n, tmp):
    v = var(X, n, 1.0)
    status = X.Checkpoint(v=v).restore(None)
    return {"status": type(status).__name__, "checks": statuses(status),
            "expect_partial": outcome(status.expect_partial), "v": arr(v)}


@scenario(ONE, words=("Failed to find any matching files", "nope"))
def ck_restore_missing(X, n, tmp):
    return X.Checkpoint(v=var(X, n, 1.0)).restore(os.path.join(tmp, "nope"))


@scenario(ONE, words=("Failed to find any matching files",))
def ck_restore_prefix_without_number(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    ckpt.save(os.path.join(tmp, "ckpt"))
    return ckpt.restore(os.path.join(tmp, "ckpt"))


@scenario(ONE, words=("Failed to find any matching files",))
def ck_read_missing(X, n, tmp):
    return X.Checkpoint(v=var(X, n, 1.0)).read(os.path.join(tmp, "nope"))


@scenario()
def ck_write_read(X, n, tmp):
    v = var(X, n, [1.0, 2.0])
    ckpt = X.Checkpoint(v=v)
    path = ckpt.write(os.path.join(tmp, "w"))
    v.assign(X.const([0.0, 0.0], "float32"))
    status = ckpt.read(path)
    return {"status": type(status).__name__, "v": replicas(v), "checks": statuses(status),
            "expect_partial": outcome(status.expect_partial)}


@scenario(ONE)
def ck_read_of_saved_file(X, n, tmp):
    v = var(X, n, 2.0)
    ckpt = X.Checkpoint(v=v)
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    v.assign(X.const(0.0, "float32"))
    other = X.Checkpoint(v=v)
    status = other.read(path)
    return {"v": arr(v), "checks": statuses(status)}


@scenario(ONE)
def ck_status_file_has_more(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0), w=var(X, n, 2.0)).save(os.path.join(tmp, "ckpt"))
    v = var(X, n, 0.0)
    status = X.Checkpoint(v=v).restore(path)
    checks = statuses(status)
    status.expect_partial()
    return {"v": arr(v), "checks": checks, "after_expect_partial": statuses(status)}


@scenario(ONE)
def ck_status_objects_have_more(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    v, w = var(X, n, 0.0), var(X, n, 9.0)
    status = X.Checkpoint(v=v, w=w).restore(path)
    return {"v": arr(v), "w": arr(w), "checks": statuses(status)}


@scenario(ONE)
def ck_status_nothing_matches(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).write(os.path.join(tmp, "w"))
    q = var(X, n, 9.0)
    status = X.Checkpoint(q=q).read(path)
    return {"q": arr(q), "checks": statuses(status)}


@scenario(ONE)
def ck_run_restore_ops(X, n, tmp):
    v = var(X, n, 1.0)
    ckpt = X.Checkpoint(v=v)
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    status = ckpt.restore(path)
    return {"run_restore_ops": outcome(status.run_restore_ops),
            "initialize_or_restore": outcome(status.initialize_or_restore)}


@scenario(ONE, words=("shape",))
def ck_restore_shape_mismatch(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, [1.0, 2.0, 3.0])).save(os.path.join(tmp, "ckpt"))
    return X.Checkpoint(v=var(X, n, [0.0, 0.0])).restore(path)


@scenario(ONE)
def ck_restore_dtype_mismatch(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, [1.0, 2.0], "float32")).save(os.path.join(tmp, "ckpt"))
    v = var(X, n, [0.0, 0.0], "float64")
    X.Checkpoint(v=v).restore(path)
    return arr(v)


@scenario()
def ck_dtypes_kept(X, n, tmp):
    values = {"f16": ([1.5, -2.0], "float16"), "f32": ([1.25], "float32"), "f64": ([[0.1, 0.2]], "float64"),
              "i32": ([1, -7], "int32"), "i64": (2 ** 40, "int64"), "b": ([True, False], "bool"),
              "c64": ([1 + 2j], "complex64")}
    variables = {k: var(X, n, v, d) for k, (v, d) in values.items()}
    path = X.Checkpoint(**variables).save(os.path.join(tmp, "ckpt"))
    loaded = {k: arr(X.train.load_variable(path, f"{k}/.ATTRIBUTES/VARIABLE_VALUE")) for k in values}
    for k, (v, d) in values.items():
        variables[k].assign(X.const(np.zeros_like(np.asarray(v, d)), d))
    X.Checkpoint(**variables).restore(path).assert_consumed()
    return {"loaded": loaded, "restored": {k: arr(v) for k, v in variables.items()}}


# --- across strategies and replica counts -----------------------------------------------------------------

@scenario((2,))
def ck_strategy_to_plain(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, [1.0, 2.0])).save(os.path.join(tmp, "ckpt"))
    plain = X.Variable(X.const([0.0, 0.0], "float32"))
    X.Checkpoint(v=plain).restore(path).assert_consumed()
    return replicas(plain)


@scenario((2,))
def ck_plain_to_strategy(X, n, tmp):
    path = X.Checkpoint(v=X.Variable(X.const([1.0, 2.0], "float32"))).save(os.path.join(tmp, "ckpt"))
    v = var(X, n, [0.0, 0.0])
    X.Checkpoint(v=v).restore(path).assert_consumed()
    return replicas(v)


@scenario((2,))
def ck_strategy_to_one_replica(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, [1.0, 2.0])).save(os.path.join(tmp, "ckpt"))
    v = var(X, 1, [0.0, 0.0])
    X.Checkpoint(v=v).restore(path).assert_consumed()
    return replicas(v)


def _train_step(X, n, model, opt, grad):
    def step():
        opt.apply_gradients([(X.const(grad, "float32"), model["w"])])
    X.strategy(n).run(step)


def _model_and_optimizer(X, n, make_opt, w):
    with X.strategy(n).scope():
        model = {"w": X.Variable(X.const(w, "float32"))}
        return model, make_opt(X)


def _sgd(X):
    return X.SGD(learning_rate=0.1, momentum=0.9)


def _adam(X):
    return X.Adam(learning_rate=0.1)


def _resume(X, n, tmp, make_opt):
    """Two steps, save, a third step; then a fresh model and optimizer restored and stepped once more: the optimizer's
    slots (created after the restore) must carry the saved state, so both third steps agree."""
    model, opt = _model_and_optimizer(X, n, make_opt, [1.0, -1.0])
    for g in ([0.5, 0.25], [1.0, -1.0]):
        _train_step(X, n, model, opt, g)
    path = X.Checkpoint(model=model, optimizer=opt).save(os.path.join(tmp, "ckpt"))
    _train_step(X, n, model, opt, [0.5, 0.5])
    model2, opt2 = _model_and_optimizer(X, n, make_opt, [0.0, 0.0])
    status = X.Checkpoint(model=model2, optimizer=opt2).restore(path)
    restored_iterations = arr(opt2.iterations)
    _train_step(X, n, model2, opt2, [0.5, 0.5])
    status.assert_consumed()
    return {"continued": replicas(model["w"]), "resumed": replicas(model2["w"]),
            "iterations_after_restore": restored_iterations, "iterations": arr(opt2.iterations)}


@scenario()
def ck_sgd_momentum_resume(X, n, tmp):
    return _resume(X, n, tmp, _sgd)


@scenario()
def ck_adam_resume(X, n, tmp):
    return _resume(X, n, tmp, _adam)


@scenario(ONE)
def ck_optimizer_names(X, n, tmp):
    model, opt = _model_and_optimizer(X, n, _sgd, [1.0, -1.0])
    _train_step(X, n, model, opt, [0.5, 0.25])
    return names(X, X.Checkpoint(model=model, optimizer=opt).write(os.path.join(tmp, "w")))


@scenario(ONE)
def ck_model_only_restore_of_full_checkpoint(X, n, tmp):
    model, opt = _model_and_optimizer(X, n, _sgd, [1.0, -1.0])
    _train_step(X, n, model, opt, [0.5, 0.25])
    path = X.Checkpoint(model=model, optimizer=opt).save(os.path.join(tmp, "ckpt"))
    w = {"w": X.Variable(X.const([0.0, 0.0], "float32"))}
    status = X.Checkpoint(model=w).restore(path)
    checks = statuses(status)
    status.expect_partial()
    return {"w": arr(w["w"]), "checks": checks}


@scenario(ONE)
def ck_iterator_position(X, n, tmp):
    it = iter(X.Dataset.range(10).batch(2))
    next(it)
    ckpt = X.Checkpoint(it=it)
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    after = [arr(next(it)) for _ in range(2)]
    ckpt.restore(path).assert_consumed()
    return {"after": after, "again": arr(next(it))}


# --- CheckpointManager --------------------------------------------------------------------------------------

@scenario()
def mgr_keeps_newest(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    manager = X.CheckpointManager(ckpt, os.path.join(tmp, "run"), max_to_keep=2)
    first = {"latest": manager.latest_checkpoint, "checkpoints": manager.checkpoints}
    paths = [rel(tmp, manager.save()) for _ in range(3)]
    return {"first": first, "paths": paths, "checkpoints": [rel(tmp, p) for p in manager.checkpoints],
            "latest": rel(tmp, manager.latest_checkpoint), "directory": rel(tmp, manager.directory),
            "interval": manager.checkpoint_interval, "files": files(tmp),
            "state": state_lines(os.path.join(tmp, "run")), "counter": arr(ckpt.save_counter)}


@scenario(ONE)
def mgr_keep_all(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=None)
    for _ in range(4):
        manager.save()
    return {"checkpoints": [rel(tmp, p) for p in manager.checkpoints], "files": files(tmp),
            "state": state_lines(tmp)}


@scenario(ONE)
def mgr_checkpoint_number(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    manager = X.CheckpointManager(ckpt, tmp, max_to_keep=3)
    step = X.Variable(X.const(20, "int64"))
    paths = [rel(tmp, manager.save(checkpoint_number=10)), rel(tmp, manager.save(checkpoint_number=step)),
             rel(tmp, manager.save()), rel(tmp, manager.save(checkpoint_number=10))]
    return {"paths": paths, "checkpoints": [rel(tmp, p) for p in manager.checkpoints],
            "counter": arr(ckpt.save_counter), "state": state_lines(tmp)}


@scenario(ONE)
def mgr_checkpoint_name(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=1, checkpoint_name="model")
    paths = [rel(tmp, manager.save()) for _ in range(2)]
    return {"paths": paths, "files": files(tmp), "state": state_lines(tmp)}


@scenario(ONE)
def mgr_interval(X, n, tmp):
    step = X.Variable(X.const(0, "int64"))
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0), step=step), tmp, max_to_keep=None,
                                  step_counter=step, checkpoint_interval=3)
    saved = []
    for i in range(8):
        step.assign(X.const(i, "int64"))
        saved.append(rel(tmp, manager.save()))
    step.assign(X.const(9, "int64"))
    forced = rel(tmp, manager.save(check_interval=False))
    again = rel(tmp, manager.save(check_interval=False))
    return {"saved": saved, "forced": forced, "same_step_again": again, "interval": manager.checkpoint_interval,
            "checkpoints": [rel(tmp, p) for p in manager.checkpoints]}


@scenario(ONE, words=("step_counter",))
def mgr_interval_without_step_counter(X, n, tmp):
    return X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=1, checkpoint_interval=2)


@scenario(ONE, words=("max_to_keep",))
def mgr_max_to_keep_zero(X, n, tmp):
    return X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=0)


@scenario(ONE, words=("max_to_keep",))
def mgr_max_to_keep_negative(X, n, tmp):
    return X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=-1)


@scenario(ONE)
def mgr_reopened(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    first = X.CheckpointManager(ckpt, tmp, max_to_keep=3)
    for _ in range(4):
        first.save()
    second = X.CheckpointManager(ckpt, tmp, max_to_keep=3)
    before = [rel(tmp, p) for p in second.checkpoints]
    second.save()
    return {"before": before, "latest_before": rel(tmp, first.latest_checkpoint),
            "after": [rel(tmp, p) for p in second.checkpoints], "files": files(tmp)}


@scenario(ONE)
def mgr_reopened_smaller(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    first = X.CheckpointManager(ckpt, tmp, max_to_keep=4)
    for _ in range(4):
        first.save()
    second = X.CheckpointManager(ckpt, tmp, max_to_keep=2)
    before = [rel(tmp, p) for p in second.checkpoints]
    second.save()
    return {"before": before, "after": [rel(tmp, p) for p in second.checkpoints], "files": files(tmp)}


@scenario()
def mgr_restore_or_initialize(X, n, tmp):
    calls = []
    v = var(X, n, [1.0, 2.0])
    ckpt = X.Checkpoint(v=v)
    manager = X.CheckpointManager(ckpt, tmp, max_to_keep=2, init_fn=lambda: calls.append("init"))
    empty = manager.restore_or_initialize()
    manager.save()
    v.assign(X.const([0.0, 0.0], "float32"))
    again = X.CheckpointManager(ckpt, tmp, max_to_keep=2, init_fn=lambda: calls.append("init2"))
    restored = again.restore_or_initialize()
    return {"empty": empty, "restored": rel(tmp, restored), "calls": calls, "v": replicas(v)}


@scenario(ONE)
def mgr_restore_or_initialize_without_init_fn(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=2)
    return {"result": manager.restore_or_initialize(), "files": files(tmp)}


@scenario(ONE, words=("Checkpoint",))
def mgr_needs_checkpoint(X, n, tmp):
    return X.CheckpointManager(var(X, n, 1.0), tmp, max_to_keep=1)


@scenario(ONE)
def mgr_state_timestamps(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=2)
    for _ in range(3):
        manager.save()
    state = X.train.get_checkpoint_state(tmp)
    stamps = list(state.all_model_checkpoint_timestamps)
    return {"type": type(state).__name__, "latest": rel(tmp, state.model_checkpoint_path),
            "all": [rel(tmp, p) for p in state.all_model_checkpoint_paths], "stamps": len(stamps),
            "ordered": stamps == sorted(stamps), "preserved_before": state.last_preserved_timestamp <= stamps[0]}


# --- tf.train's module functions -----------------------------------------------------------------------------

@scenario(ONE)
def fn_latest_checkpoint_empty(X, n, tmp):
    return {"empty": X.train.latest_checkpoint(tmp),
            "missing_dir": X.train.latest_checkpoint(os.path.join(tmp, "nothing")),
            "state": X.train.get_checkpoint_state(tmp)}


@scenario(ONE)
def fn_latest_checkpoint_other_filename(X, n, tmp):
    X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    return {"default": rel(tmp, X.train.latest_checkpoint(tmp)),
            "other": X.train.latest_checkpoint(tmp, latest_filename="other")}


@scenario(ONE)
def fn_get_checkpoint_state_after_save(X, n, tmp):
    X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    state = X.train.get_checkpoint_state(tmp)
    return {"latest": rel(tmp, state.model_checkpoint_path),
            "all": [rel(tmp, p) for p in state.all_model_checkpoint_paths],
            "stamps": len(state.all_model_checkpoint_timestamps)}


@scenario(ONE)
def fn_latest_checkpoint_deleted_file(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    for name in os.listdir(tmp):
        if name.startswith("ckpt-1"):
            os.remove(os.path.join(tmp, name))
    return X.train.latest_checkpoint(tmp)


@scenario(ONE)
def fn_checkpoints_iterator(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=3)
    manager.save()
    manager.save()
    return {"seen": [rel(tmp, p) for p in X.train.checkpoints_iterator(tmp, timeout=0.2)],
            "empty": list(X.train.checkpoints_iterator(os.path.join(tmp, "none"), timeout=0.2))}


@scenario(ONE)
def fn_checkpoints_iterator_timeout_fn(X, n, tmp):
    calls = []

    def timeout_fn():
        calls.append(1)
        return len(calls) >= 2
    return {"seen": list(X.train.checkpoints_iterator(tmp, timeout=0.1, timeout_fn=timeout_fn)),
            "calls": len(calls)}


@scenario()
def fn_list_and_load(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, [1.0, 2.0]), k=var(X, n, 7, "int32")).save(os.path.join(tmp, "ckpt"))
    return {"names": names(X, path), "dir": names(X, tmp),
            "v": arr(X.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE")),
            "k": arr(X.train.load_variable(tmp, "k/.ATTRIBUTES/VARIABLE_VALUE")),
            "counter": arr(X.train.load_variable(path, "save_counter/.ATTRIBUTES/VARIABLE_VALUE"))}


@scenario(ONE, words=("nope",))
def fn_load_variable_unknown_name(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    return X.train.load_variable(path, "nope")


@scenario(ONE)
def fn_load_variable_trailing_colon(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    return arr(X.train.load_variable(path, "v/.ATTRIBUTES/VARIABLE_VALUE:0"))


@scenario(ONE)
def fn_list_variables_missing(X, n, tmp):
    return X.train.list_variables(os.path.join(tmp, "nope"))


# --- more of the contract: relative directories, deferred restoration, kept-for-good checkpoints ---------------

class _InDirectory:
    """Run with ``tmp`` as the working directory, so relative paths are what a user passes."""

    def __init__(self, tmp):
        self._tmp, self._old = tmp, None

    def __enter__(self):
        self._old = os.getcwd()
        os.chdir(self._tmp)

    def __exit__(self, *exc):
        os.chdir(self._old)


@scenario(ONE)
def rel_manager_paths(X, n, tmp):
    with _InDirectory(tmp):
        manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), "run", max_to_keep=2)
        paths = [manager.save() for _ in range(3)]
        return {"paths": paths, "directory": manager.directory, "checkpoints": list(manager.checkpoints),
                "latest": manager.latest_checkpoint, "tf_latest": X.train.latest_checkpoint("run"),
                "state": X.train.get_checkpoint_state("run").model_checkpoint_path,
                "reopened": list(X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), "run", 2).checkpoints)}


@scenario(ONE)
def rel_checkpoint_paths(X, n, tmp):
    with _InDirectory(tmp):
        ckpt = X.Checkpoint(v=var(X, n, 1.0))
        return {"save": ckpt.save("out/ckpt"), "write": ckpt.write("out/w"),
                "latest": X.train.latest_checkpoint("out"), "dot": ckpt.save("ckpt")}


@scenario(ONE)
def ck_restore_write_file_with_restore(X, n, tmp):
    v = var(X, n, 2.0)
    path = X.Checkpoint(v=v).write(os.path.join(tmp, "w"))
    other = X.Checkpoint(v=var(X, n, 0.0))
    status = other.restore(path)
    return {"checks": statuses(status), "counter": arr(other.save_counter)}


@scenario(ONE, words=())
def ck_restore_directory(X, n, tmp):
    ckpt = X.Checkpoint(v=var(X, n, 1.0))
    ckpt.save(os.path.join(tmp, "ckpt"))
    return ckpt.restore(tmp)


@scenario(ONE)
def ck_deferred_module_attribute(X, n, tmp):
    m = X.Module()
    m.w = var(X, n, [1.0, 2.0])
    path = X.Checkpoint(model=m).save(os.path.join(tmp, "ckpt"))
    fresh = X.Module()
    status = X.Checkpoint(model=fresh).restore(path)
    before = statuses(status)
    fresh.w = var(X, n, [0.0, 0.0])  # created after the restore
    return {"before": before, "w": arr(fresh.w), "after": statuses(status)}


@scenario(ONE)
def ck_deferred_checkpoint_attribute(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, [1.0, 2.0])).save(os.path.join(tmp, "ckpt"))
    ckpt = X.Checkpoint()
    status = ckpt.restore(path)
    ckpt.v = var(X, n, [0.0, 0.0])
    return {"v": arr(ckpt.v), "after": statuses(status)}


@scenario(ONE)
def mgr_keep_every_n_hours(X, n, tmp):
    # A tiny number of hours: every checkpoint pushed out of max_to_keep is kept on disk for good.
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=2,
                                  keep_checkpoint_every_n_hours=1e-9)
    for _ in range(4):
        manager.save()
    return {"checkpoints": [rel(tmp, p) for p in manager.checkpoints], "files": files(tmp),
            "state": state_lines(tmp)}


@scenario(ONE)
def mgr_restore_or_initialize_sets_interval_step(X, n, tmp):
    step = X.Variable(X.const(4, "int64"))
    ckpt = X.Checkpoint(step=step)
    first = X.CheckpointManager(ckpt, tmp, max_to_keep=None, step_counter=step, checkpoint_interval=3)
    first.save()
    second = X.CheckpointManager(ckpt, tmp, max_to_keep=None, step_counter=step, checkpoint_interval=3)
    second.restore_or_initialize()
    out = []
    for i in (5, 6, 7):
        step.assign(X.const(i, "int64"))
        out.append(rel(tmp, second.save()))
    return out


@scenario(ONE)
def fn_get_checkpoint_state_other_filename(X, n, tmp):
    X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    os.rename(os.path.join(tmp, "checkpoint"), os.path.join(tmp, "state"))
    state = X.train.get_checkpoint_state(tmp, latest_filename="state")
    return {"latest": rel(tmp, state.model_checkpoint_path), "default": X.train.get_checkpoint_state(tmp),
            "tf_latest": rel(tmp, X.train.latest_checkpoint(tmp, "state"))}


@scenario(ONE)
def fn_list_variables_manager_dir(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0), w=var(X, n, [1, 2], "int64")), tmp, 2)
    manager.save()
    return names(X, tmp)


@scenario(ONE)
def ck_save_bad_prefix_type(X, n, tmp):
    with _InDirectory(tmp):  # TF writes there
        return X.Checkpoint(v=var(X, n, 1.0)).save(123)


# --- bad input and numbering after a restore ---------------------------------------------------------------

@scenario(ONE)
def mgr_checkpoint_interval_zero(X, n, tmp):
    step = X.Variable(X.const(0, "int64"))
    return X.CheckpointManager(X.Checkpoint(step=step), tmp, 1, step_counter=step, checkpoint_interval=0)


@scenario(ONE)
def mgr_numbering_continues_after_restore(X, n, tmp):
    first = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=2)
    for _ in range(3):
        first.save()
    ckpt = X.Checkpoint(v=var(X, n, 0.0))
    second = X.CheckpointManager(ckpt, tmp, max_to_keep=2)
    restored = rel(tmp, second.restore_or_initialize())
    return {"restored": restored, "counter": arr(ckpt.save_counter), "next": rel(tmp, second.save()),
            "checkpoints": [rel(tmp, p) for p in second.checkpoints]}


@scenario(ONE)
def mgr_checkpoint_number_numpy(X, n, tmp):
    manager = X.CheckpointManager(X.Checkpoint(v=var(X, n, 1.0)), tmp, max_to_keep=2)
    return rel(tmp, manager.save(checkpoint_number=np.int64(5)))


@scenario(ONE)
def ck_restore_twice(X, n, tmp):
    v = var(X, n, 1.0)
    ckpt = X.Checkpoint(v=v)
    first = ckpt.save(os.path.join(tmp, "ckpt"))
    v.assign(X.const(2.0, "float32"))
    ckpt.save(os.path.join(tmp, "ckpt"))
    ckpt.restore(first)
    at_first = arr(v)
    status = ckpt.restore(X.train.latest_checkpoint(tmp))
    return {"at_first": at_first, "at_latest": arr(v), "counter": arr(ckpt.save_counter), "checks": statuses(status)}


@scenario(ONE, words=())
def fn_list_variables_garbage_file(X, n, tmp):
    path = os.path.join(tmp, "garbage")
    with open(path, "wb") as f:
        f.write(b"not a checkpoint at all" * 10)
    return X.train.list_variables(path)


@scenario((2,))
def ck_save_then_restore_under_other_strategy_size(X, n, tmp):
    model, opt = _model_and_optimizer(X, 1, _sgd, [1.0, -1.0])
    _train_step(X, 1, model, opt, [0.5, 0.25])
    path = X.Checkpoint(model=model, optimizer=opt).save(os.path.join(tmp, "ckpt"))
    model2, opt2 = _model_and_optimizer(X, 2, _sgd, [0.0, 0.0])
    status = X.Checkpoint(model=model2, optimizer=opt2).restore(path)
    before_first_step = statuses(status)
    _train_step(X, 2, model2, opt2, [0.5, 0.5])
    return {"w": replicas(model2["w"])[0], "iterations": arr(opt2.iterations), "before": before_first_step,
            "after": statuses(status)}


@scenario(ONE)
def ck_status_only_save_counter_matches(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    q = var(X, n, 9.0)
    ckpt = X.Checkpoint(q=q)
    status = ckpt.restore(path)
    return {"q": arr(q), "counter": arr(ckpt.save_counter), "checks": statuses(status)}


@scenario(ONE)
def ck_status_empty_checkpoint(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    ckpt = X.Checkpoint()
    status = ckpt.restore(path)
    return {"counter": arr(ckpt.save_counter), "checks": statuses(status)}


@scenario(ONE)
def ck_iterator_missing_in_file(X, n, tmp):
    path = X.Checkpoint(v=var(X, n, 1.0)).save(os.path.join(tmp, "ckpt"))
    it = iter(X.Dataset.range(4))
    status = X.Checkpoint(v=var(X, n, 0.0), it=it).restore(path)
    return {"checks": statuses(status), "next": arr(next(it))}


@scenario(ONE)
def ck_dtypes_more(X, n, tmp):
    values = {"bf16": ([1.5, -2.0], "bfloat16"), "i8": ([-3, 4], "int8"), "u8": ([200], "uint8"),
              "i16": ([-300], "int16"), "u16": ([60000], "uint16")}
    variables = {k: var(X, n, v, d) for k, (v, d) in values.items()}
    path = X.Checkpoint(**variables).save(os.path.join(tmp, "ckpt"))
    listed = names(X, path)
    loaded = {k: arr(X.train.load_variable(path, f"{k}/.ATTRIBUTES/VARIABLE_VALUE")) for k in values}
    return {"names": listed, "loaded": loaded}


@scenario()
def ck_distributed_iterator(X, n, tmp):
    s = X.strategy(n)
    dist = iter(s.experimental_distribute_dataset(X.Dataset.range(16).batch(4)))
    next(dist)
    ckpt = X.Checkpoint(it=dist)
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    first_after = next(dist)
    after = [arr(v) for v in getattr(first_after, "values", (first_after,))]
    ckpt.restore(path)
    again = next(dist)
    return {"after": after, "again": [arr(v) for v in getattr(again, "values", (again,))]}
