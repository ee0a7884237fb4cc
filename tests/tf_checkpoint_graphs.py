"""Seeded random checkpoint object graphs, built alike in TensorFlow and in mirrored through a small adapter ``X``
(tests/data/record_tf_checkpoint_graphs.py builds them in TF 2.21 + Keras 3.15, saves each with
tf.train.Checkpoint and records what TF reads back; tests/test_checkpoint_tf_graphs.py builds them in mirrored).
This module imports neither TensorFlow nor mirrored.

A case is plain data (``cases()``): a replica count and a tree whose nodes are ``module`` / ``dict`` / ``list`` /
``checkpoint`` containers, variables (``var``: dtype, shape, ON_WRITE or ON_READ with SUM/MEAN, trainable) and
``ref``s to a variable seen before (one variable tracked under two paths), plus an optional optimizer (each of
Keras 3's kinds, with its slot-changing options) trained a step or two over the tree's float32 trainable
variables. Values come from a formula exact in every dtype (so no random-number stream has to agree across
NumPy versions); the structure from ``random.Random(seed)``, which Python keeps stable.

The adapter offers, beyond tests/scenario_adapter.py's ``strategy(n)``: ``Variable``, ``Module``, ``Checkpoint``,
``VariableSynchronization``, ``VariableAggregation``, ``optimizer(kind, **config)``, ``const(value, dtype)``
and ``strings`` (whether the library has string variables: TensorFlow has, mirrored has not).
"""

import hashlib
import os
import random

import numpy as np

SEED = 32
COUNT = 150

DTYPES = ["float32", "float32", "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "bool", "complex64", "complex128"]
SHAPES = [[], [], [3], [2, 3], [0], [4, 0], [1, 1, 2], [5], [2, 2, 2]]
LARGE = [257, 129]  # one case holds a variable of this shape
OPTIMIZERS = [("SGD", {}), ("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.5, "nesterov": True}),
              ("Adam", {}), ("Adam", {"amsgrad": True}), ("AdamW", {"weight_decay": 0.01}),
              ("RMSprop", {}), ("RMSprop", {"centered": True, "momentum": 0.5}), ("Adagrad", {}),
              ("Nadam", {}), ("Adamax", {}), ("Adadelta", {}), ("Lion", {}), ("Ftrl", {})]
NAMES = ["w", "b", "kernel", "bias", "dense", "layers", "x", "alpha", "zeta", "m", "v", "a", "table", "emb"]


def values(seed: int, dtype: str, shape):
    """The value of variable ``seed``: small multiples of 1/8 (exact in bfloat16 and float16), as nested lists."""
    size = int(np.prod(shape, dtype=np.int64))
    k = (np.arange(size, dtype=np.int64) * 7919 + seed * 104729) % 251
    if dtype == "bool":
        return (k % 2 == 1).reshape(shape).tolist()
    if dtype.startswith("uint"):
        return (k % (100 if dtype == "uint8" else 60000)).reshape(shape).tolist()
    if dtype.startswith("int"):
        return (k - 125).reshape(shape).tolist()
    real = ((k - 125) / 8.0).reshape(shape)
    if dtype.startswith("complex"):
        return np.stack([real, -real / 2], -1).tolist()  # (re, im) pairs: JSON has no complex numbers
    return real.tolist()


def as_array(value, dtype, shape):
    a = np.asarray(value, "float64" if dtype in ("bfloat16", "float16") or dtype.startswith("complex") else dtype)
    if dtype.startswith("complex"):
        a = a.reshape(list(shape) + [2])
        a = a[..., 0] + 1j * a[..., 1]
    return a.reshape(shape).astype(dtype)


def gradient(seed: int, step: int, shape):
    size = int(np.prod(shape, dtype=np.int64))
    k = (np.arange(size, dtype=np.int64) * 31 + seed * 17 + step * 5) % 13
    return ((k - 6) / 16.0).astype(np.float32).reshape(shape)


state_of_kinds = {"next": 0}


def _case(rng: random.Random, index: int) -> dict:
    state = {"next": 0, "vars": [], "large": index == 7}
    replicas = rng.choice([1, 1, 2, 2, 3])

    def variable(in_list):
        vid = state["next"]
        state["next"] += 1
        # (mirrored has no string variables: one in a list would move its neighbours' indices there)
        dtype = "string" if rng.random() < 0.03 and not in_list else rng.choice(DTYPES)
        shape = list(rng.choice(SHAPES))
        if state["large"]:
            dtype, shape, state["large"] = "float32", list(LARGE), False
        sync = "on_write"
        if dtype in ("float32", "float64") and rng.random() < 0.25:
            sync = rng.choice(["on_read_sum", "on_read_mean"])
        elif dtype in ("int32", "int64") and rng.random() < 0.2:
            sync = "on_read_sum"
        node = {"kind": "var", "id": vid, "dtype": dtype, "shape": shape, "sync": sync,
                "trainable": sync == "on_write" and dtype != "string" and rng.random() < 0.85}
        state["vars"].append(node)
        return node

    def children(depth, kind):
        count = rng.randint(1, 3 if depth < 2 else 2)
        out = []
        names = rng.sample(NAMES, count) if kind != "list" else [str(i) for i in range(count)]
        for name in names:
            roll = rng.random()
            if state["vars"] and roll < 0.08:
                child = {"kind": "ref", "id": rng.choice(state["vars"])["id"]}
            elif depth < 3 and roll < 0.45:
                sub = rng.choice(["module", "module", "dict", "list", "checkpoint"] if kind != "list"
                                 else ["module", "dict"])
                child = {"kind": sub, "children": children(depth + 1, sub)}
            else:
                child = variable(kind == "list")
            out.append([name, child])
        return out

    tree = {"kind": "checkpoint", "children": children(0, "checkpoint")}
    optimizer = None
    trained = [v["id"] for v in state["vars"]
               if v["dtype"] == "float32" and v["sync"] == "on_write" and v["trainable"] and 0 not in v["shape"]
               and v["shape"] != LARGE]
    if trained and rng.random() < 0.5:
        kind, config = OPTIMIZERS[state_of_kinds["next"] % len(OPTIMIZERS)]  # each kind in turn
        state_of_kinds["next"] += 1
        optimizer = {"kind": kind, "config": dict(config, learning_rate=0.1), "steps": rng.randint(0, 2),
                     "vars": trained}
        tree["children"].append(["optimizer", {"kind": "optimizer"}])
    return {"name": f"g{index:03d}", "replicas": replicas, "tree": tree, "optimizer": optimizer,
            "drop": rng.randrange(len(tree["children"])), "extra_at": rng.random()}


def cases() -> list:
    rng = random.Random(SEED)
    state_of_kinds["next"] = 0
    return [_case(rng, i) for i in range(COUNT)]


def variables(tree) -> list:
    """The ``var`` nodes of a tree, in order."""
    out = []

    def visit(node):
        if node["kind"] == "var":
            out.append(node)
        for _, child in node.get("children", ()):
            visit(child)
    visit(tree)
    return out


# --- building a case in a library -------------------------------------------------------------------------------

def _sync(X, node):
    if node["sync"] == "on_write":
        return {}
    aggregation = X.VariableAggregation.SUM if node["sync"] == "on_read_sum" else X.VariableAggregation.MEAN
    return {"synchronization": X.VariableSynchronization.ON_READ, "aggregation": aggregation}


def make_variable(X, strategy, node, zero=False):
    dtype = node["dtype"]
    if dtype == "string":
        value = np.full(node["shape"], "" if zero else f"s{node['id']}", dtype=object).tolist()
    else:
        value = as_array(values(node["id"], dtype, node["shape"]), dtype, node["shape"])
        if zero:
            value = np.zeros_like(value)
    with strategy.scope():
        return X.Variable(X.const(value, dtype), trainable=node["trainable"], **_sync(X, node))


def per_replica_values(node, replicas: int):
    """What each replica's copy of an ON_READ variable holds before the save: the value scaled by (replica + 1)."""
    base = as_array(values(node["id"], node["dtype"], node["shape"]), node["dtype"], node["shape"])
    return [base * (r + 1) for r in range(replicas)]


def build(X, case, zero=False, deferred=False, drop=None, extra=False):
    """The case's ``Checkpoint`` over fresh objects: ``(checkpoint, {var id: variable}, optimizer, attach)``.

    ``zero``: variables hold zeros (a restore's target). ``deferred``: variables that are attributes of a module
    or of a checkpoint are created by ``attach()``, after the restore. ``drop``: the index of a top-level child
    left out. ``extra``: one more variable, in the first module found (else at the top).
    """
    strategy = X.strategy(case["replicas"])
    made, later = {}, []
    by_id = {node["id"]: node for node in variables(case["tree"])}
    optimizer = None
    if case["optimizer"] is not None:
        spec = case["optimizer"]
        with strategy.scope():
            optimizer = X.optimizer(spec["kind"], **spec["config"])

    def value_of(node):
        if node["kind"] in ("var", "ref"):  # a ref may come first when its variable's creation is deferred
            if node["id"] not in made:
                made[node["id"]] = make_variable(X, strategy, by_id[node["id"]], zero)
            return made[node["id"]]
        if node["kind"] == "optimizer":
            return optimizer
        return container(node)

    def container(node):
        kind = node["kind"]
        items = [(name, child) for name, child in node["children"] if X.strings or not _is_string(child, by_id)]
        if kind == "list":
            return [value_of(child) for _, child in items]
        if kind == "dict":
            return {name: value_of(child) for name, child in items}
        obj = X.Module() if kind == "module" else X.Checkpoint()
        for name, child in items:
            if deferred and child["kind"] in ("var", "ref"):
                later.append((obj, name, child))
            else:
                setattr(obj, name, value_of(child))
        return obj

    top = [(name, child) for i, (name, child) in enumerate(case["tree"]["children"])
           if i != drop and (X.strings or not _is_string(child, by_id))]
    objects, top_later = {}, []
    for name, child in top:
        if deferred and child["kind"] in ("var", "ref"):
            top_later.append((name, child))
        else:
            objects[name] = value_of(child)
    ckpt = X.Checkpoint(**objects)
    if extra:
        holder = next((o for o in objects.values() if isinstance(o, X.Module)), None)
        extra_var = make_variable(X, strategy, {"id": 999, "dtype": "float32", "shape": [2], "sync": "on_write",
                                                "trainable": True}, zero)
        setattr(holder if holder is not None else ckpt, "extra_variable", extra_var)

    def attach():
        for obj, name, child in later:
            setattr(obj, name, value_of(child))
        for name, child in top_later:
            setattr(ckpt, name, value_of(child))

    if not deferred:
        attach()
    return ckpt, made, optimizer, attach


def _is_string(node, by_id) -> bool:
    return node["kind"] in ("var", "ref") and by_id[node["id"]]["dtype"] == "string"


def set_on_read_copies(X, case, made):
    """Give every ON_READ variable's replicas different values (``per_replica_values``), so a save aggregates."""
    strategy = X.strategy(case["replicas"])
    for node in variables(case["tree"]):
        if node["sync"] == "on_write" or node["id"] not in made:
            continue
        copies = per_replica_values(node, case["replicas"])
        value = strategy.experimental_distribute_values_from_function(
            lambda ctx, copies=copies, dtype=node["dtype"]: X.const(copies[ctx.replica_id_in_sync_group], dtype))
        strategy.run(lambda v, var=made[node["id"]]: var.assign(v), args=(value,))


def train(X, case, made, optimizer):
    """The case's optimizer steps over its variables, each step's gradients the same on every replica."""
    spec = case["optimizer"]
    if spec is None:
        return
    strategy = X.strategy(case["replicas"])
    var_list = [made[i] for i in spec["vars"]]
    with strategy.scope():
        optimizer.build(var_list)
    for step in range(spec["steps"]):
        # Each replica makes its gradients: TF's all-reduce of one tensor object passed by every replica returns
        # it unsummed, where mirrored sums.
        strategy.run(lambda step=step: optimizer.apply_gradients(
            [(X.const(gradient(i, step, node_shape(case, i)), "float32"), v) for i, v in zip(spec["vars"], var_list)]))


def node_shape(case, vid):
    return next(v["shape"] for v in variables(case["tree"]) if v["id"] == vid)


def arr(x):
    """An array as plain data: dtype, shape, and the values (small ones) or their SHA-256 (large ones)."""
    a = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    if a.dtype == object or a.dtype.kind in "SU":
        flat = [s.decode() if isinstance(s, bytes) else str(s) for s in a.reshape(-1)]
        return {"dtype": "string", "shape": list(a.shape), "v": flat}
    out = {"dtype": a.dtype.name, "shape": list(a.shape)}
    if a.size > 256:
        out["sha256"] = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
        return out
    values = np.stack([a.real, a.imag], -1) if a.dtype.kind == "c" else a
    out["v"] = values.astype("float64" if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else values.dtype
                              ).reshape(-1).tolist()
    return out


def replicas(v):
    return [arr(c) for c in getattr(v, "values", (v,))]


def outcome(call):
    try:
        call()
        return "ok"
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return type(e).__name__


def statuses(status):
    return {name: outcome(getattr(status, name)) for name in
            ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match")}


# --- CheckpointManager: random sequences of saves, reopenings and restores ----------------------------------------

MANAGER_COUNT = 30


def manager_cases() -> list:
    rng = random.Random(SEED + 1)
    out = []
    for i in range(MANAGER_COUNT):
        ops = []
        for _ in range(rng.randint(2, 7)):
            roll = rng.random()
            if roll < 0.6:
                ops.append(["save", rng.choice([None, None, None, rng.randint(0, 40)])])
            elif roll < 0.75:
                ops.append(["reopen", rng.choice([None, 1, 2, 3])])
            elif roll < 0.9:
                ops.append(["restore_or_initialize", None])
            else:
                ops.append(["save_checkpoint", None])  # Checkpoint.save beside the manager, same directory
        out.append({"name": f"m{i:03d}", "max_to_keep": rng.choice([None, 1, 2, 3, 5]),
                    "hours": rng.choice([None, None, 1e-9, 1000.0]),
                    "checkpoint_name": rng.choice(["ckpt", "ckpt", "model", "a.b"]), "ops": ops})
    return out


def run_manager_case(X, case, tmp, files, state_lines, rel):
    """The case's operations over a manager of ``tmp/run``; after each, what TF exposes. ``files``, ``state_lines``
    and ``rel`` are tests/tf_checkpoint_scenarios.py's."""
    directory = os.path.join(tmp, "run")
    v = X.Variable(X.const(0.0, "float32"))
    ckpt = X.Checkpoint(v=v)

    def manager(max_to_keep):
        return X.CheckpointManager(ckpt, directory, max_to_keep=max_to_keep,
                                   keep_checkpoint_every_n_hours=case["hours"],
                                   checkpoint_name=case["checkpoint_name"])

    current, steps = manager(case["max_to_keep"]), []
    for k, (op, arg) in enumerate(case["ops"]):
        v.assign(X.const(float(k + 1), "float32"))
        if op == "save":
            result = rel(tmp, current.save(checkpoint_number=arg))
        elif op == "reopen":
            current = manager(arg)
            result = None
        elif op == "restore_or_initialize":
            fresh = X.Variable(X.const(-1.0, "float32"))
            other = X.CheckpointManager(X.Checkpoint(v=fresh), directory, max_to_keep=case["max_to_keep"],
                                        checkpoint_name=case["checkpoint_name"])
            result = [rel(tmp, other.restore_or_initialize()), float(np.asarray(fresh.numpy()))]
        else:
            result = rel(tmp, ckpt.save(os.path.join(directory, "other")))
        latest = X.train.latest_checkpoint(directory)
        steps.append({"op": op, "result": result, "checkpoints": [rel(tmp, p) for p in current.checkpoints],
                      "latest": rel(tmp, current.latest_checkpoint), "tf_latest": rel(tmp, latest),
                      "files": files(tmp), "state": state_lines(directory) if os.path.exists(directory) else None,
                      "names": None if latest is None else sorted(k for k, _ in X.train.list_variables(latest)
                                                                  if k != "_CHECKPOINTABLE_OBJECT_GRAPH"),
                      "v": None if latest is None else
                      float(np.asarray(X.train.load_variable(latest, "v/.ATTRIBUTES/VARIABLE_VALUE"))),
                      "counter": int(np.asarray(ckpt.save_counter.numpy()))})
    return steps
