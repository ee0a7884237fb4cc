"""MultiOptimizer and OptimizerMap against Keras 3.15 (tests/data/keras_multi_optimizer.npz, recorded by
tests/data/record_keras_multi_optimizer.py): a model whose variables are routed by exact key, by regular
expression and by default to Adam, SGD with momentum and RMSprop, trained under MirroredStrategy at 1, 2 and 4
replicas (also with the sub-optimizers' own clipping, weight decay and the MultiOptimizer's loss_scale_factor, and
inside a LossScaleOptimizer); the map's matching rules and errors, the sub-optimizers' order, loss_scale_factor,
get_config / from_config, the checkpoint's names and a save/restore round trip; CentralStorageStrategy; and on
two simulated GPUs the results, md.function's capture and the launches of a step of 200 variables."""

import json
import os
import re

import numpy as np
import pytest

import mirrored as md
from multiworker_marks import needs_gloo

HERE = os.path.dirname(__file__)
DATA = np.load(os.path.join(HERE, "data", "keras_multi_optimizer.npz"))
CONFIGS = json.loads(str(DATA["configs"]))
RULES = json.loads(str(DATA["rules"]))
PATHS = ["encoder/dense/kernel", "encoder/dense/bias", "decoder/kernel", "head/w"]
STEPS = DATA[f"grads|{PATHS[0]}"].shape[0]
O = md.optimizers


def make(name):
    """The recorded configuration's MultiOptimizer (and the LossScaleOptimizer around it, else the same)."""
    mapped, default, factor, scale = CONFIGS[name]
    made = {}

    def one(cls, kwargs):
        key = json.dumps([cls, kwargs], sort_keys=True)
        if key not in made:
            made[key] = getattr(O, cls)(**kwargs)
        return made[key]

    omap = O.OptimizerMap(one(*default))
    for key, (cls, kwargs) in mapped.items():
        omap[key] = one(cls, kwargs)
    multi = O.MultiOptimizer(omap, loss_scale_factor=factor)
    outer = multi if scale is None else md.mixed_precision.LossScaleOptimizer(multi, initial_scale=scale)
    return multi, outer


def model(strategy):
    with strategy.scope():
        return [md.Variable(DATA[f"init|{p}"], name=p) for p in PATHS]


def train(name, strategy, n, xp=np, divide=1.0, plain=False):
    """STEPS steps of the recorded gradients (replica r of step s: grads[s, r]) inside strategy.run; ``divide``:
    each gradient divided by it first; ``plain``: the MultiOptimizer without its LossScaleOptimizer."""
    variables = model(strategy)
    with strategy.scope():
        multi, outer = make(name)
    opt = multi if plain else outer
    for s in range(STEPS):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(xp.asarray(DATA[f"grads|{p}"][s, r] / np.float32(divide)), v)
                                 for p, v in zip(PATHS, variables)])
        strategy.run(step)
    return multi, variables


def cpus(n):
    return md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def host(value):
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def check_against_keras(name, n, multi, variables, rtol=2e-6):
    prefix = f"{name}|{n}"
    for p, var in zip(PATHS, variables):
        copies = [host(c) for c in var.values] if hasattr(var, "values") else [host(var)]
        np.testing.assert_allclose(copies[0], DATA[f"{prefix}|{p}"], rtol=rtol, atol=rtol * 0.1, err_msg=p)
        assert all(np.array_equal(c, copies[0]) for c in copies[1:])  # the copies stay bit-identical
        for opt in multi.optimizers:
            for slot in ("momentum", "velocity"):
                if f"{prefix}|{p}|{slot}" in DATA and any(v is var for v, _ in opt._slots.values()):
                    np.testing.assert_allclose(host(opt.get_slot(var, slot)), DATA[f"{prefix}|{p}|{slot}"],
                                               rtol=rtol, atol=rtol * 0.1, err_msg=f"{p} {slot}")
    assert int(multi.iterations.numpy()) == DATA[f"{prefix}|iterations"]
    for k, opt in enumerate(multi.optimizers):
        assert int(opt.iterations.numpy()) == DATA[f"{prefix}|optimizer{k}|iterations"]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("name", ["exact regex default", "clipnorm weight_decay loss_scale_factor"])
def test_training_matches_keras(name, n):
    multi, variables = train(name, cpus(n), n)
    check_against_keras(name, n, multi, variables)
    # Routed as Keras routes them: the kernel by its exact key, the others by a pattern or the default.
    adam, sgd, rms = multi.optimizers
    assert [type(o).__name__ for o in multi.optimizers] == ["Adam", "SGD", "RMSprop"]
    routed = {var.name: type(opt).__name__ for opt in multi.optimizers for var, _ in opt._slots.values()}
    assert routed == {"encoder/dense/kernel:0": "Adam", "encoder/dense/bias:0": "SGD", "decoder/kernel:0": "SGD",
                      "head/w:0": "RMSprop"}
    assert len(multi._routes) == 1  # the split is computed once for the variable list


@pytest.mark.parametrize("n", [1, 2, 4])
def test_inside_a_loss_scale_optimizer(n):
    """Keras 3.15 records one replica (its LossScaleOptimizer fails around a MultiOptimizer under more); at 2 and
    4 the scaled step equals the plain MultiOptimizer's on the gradients divided by the (power of two) scale."""
    name = "loss scale optimizer"
    multi, variables = train(name, cpus(n), n)
    if n == 1:
        check_against_keras(name, 1, multi, variables)
    plain, reference = train(name, cpus(n), n, divide=CONFIGS[name][3], plain=True)
    for var, ref in zip(variables, reference):
        np.testing.assert_allclose(host(var.values[0]), host(ref.values[0]), rtol=1e-6, atol=1e-7)
    assert int(multi.iterations.numpy()) == int(plain.iterations.numpy()) == STEPS


@pytest.mark.parametrize("n", [2, 4])
def test_a_loss_scale_optimizer_leaves_the_clipping_sub_optimizers_their_own_reduction(n):
    """Around sub-optimizers that clip, the LossScaleOptimizer does not sum the gradients first: each replica's
    are unscaled, then clipped by their sub-optimizer, then summed (Keras' order). A scale of 4 unscales as the
    recorded MultiOptimizer's loss_scale_factor of 4 does (which the LossScaleOptimizer turns off)."""
    name = "clipnorm weight_decay loss_scale_factor"
    strategy = cpus(n)
    variables = model(strategy)
    with strategy.scope():
        multi, _ = make(name)
        outer = md.mixed_precision.LossScaleOptimizer(multi, initial_scale=CONFIGS[name][2])
    assert multi.loss_scale_factor is None and all(o.loss_scale_factor is None for o in multi.optimizers)
    for s in range(STEPS):
        def step(s=s):
            r = md.get_replica_context().replica_id_in_sync_group
            outer.apply_gradients([(DATA[f"grads|{p}"][s, r], v) for p, v in zip(PATHS, variables)])
        strategy.run(step)
    check_against_keras(name, n, multi, variables)


def test_cross_replica_apply_with_per_replica_gradients_is_the_same_step():
    name, strategy = "clipnorm weight_decay loss_scale_factor", cpus(2)
    variables = model(strategy)
    with strategy.scope():
        multi, _ = make(name)
    for s in range(STEPS):
        grads = [strategy.experimental_distribute_values_from_function(
            lambda ctx, p=p: DATA[f"grads|{p}"][s, ctx.replica_id_in_sync_group]) for p in PATHS]
        with strategy.scope():
            multi.apply_gradients(zip(grads, variables))
    check_against_keras(name, 2, multi, variables)


def test_central_storage_strategy_matches_keras():
    strategy = md.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    multi, variables = train("exact regex default", strategy, 2)
    check_against_keras("exact regex default", 2, multi, variables)


# -- OptimizerMap's rules --
def test_lookup_is_exact_key_then_one_full_match_then_the_default():
    adam, sgd, rms = O.Adam(), O.SGD(), O.RMSprop()
    omap = O.OptimizerMap(default_optimizer=rms)
    omap["encoder/layer_0/dense"] = adam
    omap["encoder/.*"] = sgd
    omap["decoder"] = adam
    omap["dec.*/w|head"] = sgd
    names = {id(adam): "adam", id(sgd): "sgd", id(rms): "rms"}
    assert {q: names[id(omap[q])] for q in RULES["lookup"]} == RULES["lookup"]
    assert omap.default_optimizer is rms
    omap["enc.*"] = sgd
    kind, message = RULES["lookup_error"]
    with pytest.raises(ValueError) as error:
        omap["encoder/w"]
    assert kind == "ValueError" and str(error.value).startswith(message)
    assert [len(omap), list(omap)] == RULES["len_iter"]
    del omap["enc.*"]
    assert omap["encoder/w"] is sgd and len(omap) == 4
    # (Mapping's `in` and `get` look up as [] does, which falls back to the default: every path is "in" the map.)
    assert "anything" in omap and omap.get("anything") is rms
    # A variable is looked up by its path: its name without ":0".
    assert omap(md.Variable(np.ones(2, np.float32), name="encoder/w2")) is sgd
    assert omap(md.Variable(np.ones(2, np.float32), name="decoder")) is adam


def _keras_prefix(message: str) -> str:
    """A recorded Keras message up to its first repr of an object (which differs from ours)."""
    return re.split(r"Received: [<\[]|<", message)[0]


def _errors():
    omap = O.OptimizerMap(O.RMSprop(), {"decoder": O.Adam()})
    multi = O.MultiOptimizer(O.OptimizerMap(O.SGD()))
    v = md.Variable(np.ones(2, np.float32), name="v")
    u = md.Variable(np.ones(3, np.float32), name="u")
    built = O.MultiOptimizer(O.OptimizerMap(O.SGD()))
    built.build([v, u])
    selector = {"a LossScaleOptimizer": lambda: md.mixed_precision.LossScaleOptimizer(O.SGD()),
                "a MultiOptimizer": lambda: O.MultiOptimizer(O.OptimizerMap(O.SGD())),
                "not an optimizer": lambda: "sgd"}
    cases = {
        "default not an optimizer": lambda: O.OptimizerMap("adam"),
        "map not a dict": lambda: O.OptimizerMap(O.SGD(), [("a", O.Adam())]),
        "duplicate key": lambda: omap.__setitem__("decoder", O.SGD()),
        "duplicate key, not an optimizer": lambda: omap.__setitem__("decoder", 3),
        "key not a string": lambda: omap.__setitem__(3, O.SGD()),
        "value not an optimizer": lambda: omap.__setitem__("x", "sgd"),
        "value a LossScaleOptimizer": lambda: omap.__setitem__("x", md.mixed_precision.LossScaleOptimizer(O.SGD())),
        "value a MultiOptimizer": lambda: omap.__setitem__("x", O.MultiOptimizer(O.OptimizerMap(O.SGD()))),
        "learning_rate get": lambda: multi.learning_rate,
        "learning_rate set": lambda: setattr(multi, "learning_rate", 0.1),
        "apply without variables, not built": lambda: multi.apply([np.ones(2, np.float32)]),
        "set_weights, not built": lambda: multi.set_weights([]),
        "apply, fewer gradients": lambda: built.apply([np.ones(2, np.float32)], [v]),
    }
    for label, returned in selector.items():
        cases[f"callable returns {label}"] = lambda r=returned: O.MultiOptimizer(lambda var: r()).build([v])
    return cases


@pytest.mark.parametrize("case", sorted(RULES["errors"]))
def test_errors_are_keras_errors(case):
    kind, message = RULES["errors"][case]
    with pytest.raises(Exception) as error:
        _errors()[case]()
    assert type(error.value).__name__ == kind
    assert str(error.value).startswith(_keras_prefix(message)), (str(error.value), message)


def test_our_extra_errors_name_the_fix():
    with pytest.raises(TypeError, match="optimizer_map=.*OptimizerMap or a callable"):
        O.MultiOptimizer({"a": O.Adam()})
    with pytest.raises(ValueError, match="loss_scale_factor"):
        O.MultiOptimizer(O.OptimizerMap(O.SGD()), loss_scale_factor=0.0)
    v, u = md.Variable(np.ones(2, np.float32), name="v"), md.Variable(np.ones(2, np.float32), name="u")
    multi = O.MultiOptimizer(O.OptimizerMap(O.SGD()))
    multi.build([v])
    with pytest.raises(KeyError, match="'u:0' is not one of the variables"):
        multi.apply([np.ones(2, np.float32)], [u])
    with pytest.raises(TypeError, match="callable, which get_config cannot serialize"):
        O.MultiOptimizer(lambda var: O.SGD()).get_config()
    with pytest.raises(ValueError, match=r"weights: 1 arrays for the 2 variables"):
        multi.set_weights([np.int64(3)])


def _base_name(name: str) -> str:
    return re.sub(r"_\d+$", "", name)  # Keras numbers the second optimizer of a class: "sgd_9"


def test_sub_optimizers_order_and_loss_scale_factor():
    a, s, r = O.Adam(loss_scale_factor=3.0), O.SGD(loss_scale_factor=3.0), O.RMSprop(loss_scale_factor=3.0)
    ordered = O.MultiOptimizer(O.OptimizerMap(r, {"x": s, "y": a, "z": s}))
    assert [o.name for o in ordered.optimizers] == [_base_name(n) for n in RULES["order"]]
    assert [o.loss_scale_factor for o in ordered.optimizers] == RULES["loss_scale_factor None"]
    ordered.loss_scale_factor = 2.0
    assert [ordered.loss_scale_factor] + [o.loss_scale_factor for o in ordered.optimizers] == \
        RULES["loss_scale_factor set"]
    scaled = O.MultiOptimizer(O.OptimizerMap(O.SGD(), {"x": O.Adam()}), loss_scale_factor=5.0, name="mo")
    assert [scaled.loss_scale_factor] + [o.loss_scale_factor for o in scaled.optimizers] == \
        RULES["loss_scale_factor init"]
    assert [O.MultiOptimizer(O.OptimizerMap(O.SGD())).name, scaled.name] == [_base_name(n) for n in RULES["names"]]
    assert scaled.scale_loss(np.float32(2.0)) == 10.0
    assert not hasattr(scaled, "learning_rate")  # (Keras: an AttributeError, so hasattr is False)
    # A callable's optimizers join `optimizers` at build, in the order it returns them.
    made = {}
    selector = O.MultiOptimizer(lambda var: made.setdefault(var.name, O.Adam(name=f"adam_{var.name[:-2]}")))
    selector.build([md.Variable(np.ones(2, np.float32), name="v"), md.Variable(np.ones(3, np.float32), name="u")])
    assert [o.name for o in selector.optimizers] == RULES["callable optimizers"]


def _normalized(config):
    """A serialized config with Keras' numbered optimizer names made plain ("sgd_12" -> "sgd")."""
    if isinstance(config, dict):
        return {k: _base_name(v) if k == "name" and isinstance(v, str) else _normalized(v) for k, v in config.items()}
    return config


def test_config_is_keras_and_round_trips():
    multi = O.MultiOptimizer(
        O.OptimizerMap(O.RMSprop(0.01), {"encoder/.*": O.Adam(0.05), "head": O.SGD(0.1, momentum=0.9)}),
        loss_scale_factor=2.0, name="multi")
    assert O.serialize(multi) == _normalized(RULES["config"])
    again = O.deserialize(RULES["config"])
    assert isinstance(again, O.MultiOptimizer) and again.name == "multi" and again.loss_scale_factor == 2.0
    assert [type(o).__name__ for o in again.optimizers] == ["Adam", "SGD", "RMSprop"]
    assert _normalized(O.serialize(again)) == _normalized(RULES["config"])
    assert O.get(RULES["config"]).optimizers[1].momentum == 0.9
    omap = O.OptimizerMap(O.SGD(0.5), {"a": O.Adam(0.25)})
    assert omap.get_config() == _normalized(RULES["map config"])
    assert list(O.OptimizerMap.from_config(omap.get_config())) == ["a"]


# -- checkpoints --
def _built(strategy, name="exact regex default"):
    variables = model(strategy)
    with strategy.scope():
        multi, _ = make(name)
    return multi, variables


def test_checkpoint_names_are_keras():
    strategy = cpus(2)
    multi, variables = _built(strategy)
    with strategy.scope():
        multi.apply([np.ones(v.shape, np.float32) for v in variables], variables)
    assert [int(multi.iterations.numpy())] + [int(o.iterations.numpy()) for o in multi.optimizers] == \
        RULES["checkpoint iterations"]
    path = md.train.Checkpoint(optimizer=multi, model=variables).write(os.path.join(HERE, ".multi_ckpt_names"))
    try:
        assert [[k, list(s)] for k, s in md.train.list_variables(path)] == \
            [entry for entry in RULES["checkpoint"] if entry[0] != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    finally:
        for f in os.listdir(HERE):
            if f.startswith(".multi_ckpt_names"):
                os.remove(os.path.join(HERE, f))
    # Keras' `variables` order: own iterations, then each sub-optimizer's (Keras' also lists each learning rate).
    keras = [_base_name(p.split("/")[-1]) for p in RULES["variables"] if not p.endswith("learning_rate")]
    ours = [n[:-2].split("/")[-1] if n.endswith("iterations:0") else n[:-2].replace("/", "_")
            for n in (v.name for v in multi.variables)]
    assert ours == [k.replace("iteration", "iterations") if k == "iteration" else k for k in keras]


def test_a_keras_written_checkpoint_restores():
    """TF 2.21 + Keras 3.15's file of a MultiOptimizer (one step of gradients of ones on a model of ones): its
    counter and the model come back, every value of the file is consumed, the sub-optimizers start afresh."""
    strategy = cpus(2)
    with strategy.scope():
        variables = [md.Variable(np.zeros(DATA[f"init|{p}"].shape, np.float32), name=p) for p in PATHS]
        multi, _ = make("exact regex default")
    status = md.train.Checkpoint(optimizer=multi, model=variables).read(
        os.path.join(HERE, "data", "keras_multi_optimizer_checkpoint", "ckpt"))
    status.assert_consumed()
    assert int(multi.iterations.numpy()) == 1 and all(int(o.iterations.numpy()) == 0 for o in multi.optimizers)
    # The model as Keras left it: the same step from ones here gives the same values.
    with strategy.scope():
        ours = [md.Variable(np.ones(v.shape, np.float32), name=p) for p, v in zip(PATHS, variables)]
        again, _ = make("exact regex default")
        again.apply([np.ones(v.shape, np.float32) for v in ours], ours)
    for var, mine in zip(variables, ours):
        np.testing.assert_allclose(host(var.values[1]), host(mine.values[0]), rtol=1e-6)


def test_checkpoint_round_trip_with_the_sub_optimizers_tracked(tmp_path):
    """Keras tracks only the MultiOptimizer's own counter: tracked beside it, the sub-optimizers restore too, and
    the restored run continues as the uninterrupted one."""
    strategy = cpus(2)

    def steps(multi, variables, first, count):
        for s in range(first, first + count):
            def step(s=s):
                r = md.get_replica_context().replica_id_in_sync_group
                multi.apply_gradients([(DATA[f"grads|{p}"][s, r], v) for p, v in zip(PATHS, variables)])
            strategy.run(step)

    def checkpoint(multi, variables):
        return md.train.Checkpoint(optimizer=multi, model=variables,
                                   **{f"sub{k}": o for k, o in enumerate(multi.optimizers)})

    multi, variables = _built(strategy)
    steps(multi, variables, 0, 3)
    path = checkpoint(multi, variables).write(str(tmp_path / "ckpt"))
    steps(multi, variables, 3, 3)
    fresh, fresh_variables = _built(strategy)
    checkpoint(fresh, fresh_variables).read(path)
    assert int(fresh.iterations.numpy()) == 3
    steps(fresh, fresh_variables, 3, 3)
    for var, other in zip(variables, fresh_variables):
        np.testing.assert_array_equal(host(other.values[0]), host(var.values[0]))
    check_against_keras("exact regex default", 2, fresh, fresh_variables)
    # Only the MultiOptimizer (Keras' layout): its counter comes back, the sub-optimizers start afresh.
    alone, alone_variables = _built(strategy)
    md.train.Checkpoint(optimizer=alone, model=alone_variables).read(path)
    assert int(alone.iterations.numpy()) == 3 and all(int(o.iterations.numpy()) == 0 for o in alone.optimizers)


def test_set_weights_finalize_and_apply_without_variables():
    strategy = cpus(2)
    multi, variables = _built(strategy)
    trained, trained_variables = _built(strategy)
    with strategy.scope():
        trained.apply([np.ones(v.shape, np.float32) for v in trained_variables], trained_variables)
        multi.build(variables)
        multi.set_weights([host(v.values[0]) for v in trained.variables])
    assert [host(v.values[0]).tolist() for v in multi.variables] == \
        [host(v.values[0]).tolist() for v in trained.variables]
    # apply(grads) without variables: the built ones; a None gradient leaves its variable alone.
    before = host(variables[1].values[0]).copy()
    grads = [np.ones(v.shape, np.float32) for v in variables]
    with strategy.scope():
        multi.apply(grads[:1] + [None] + grads[2:])
    np.testing.assert_array_equal(host(variables[1].values[0]), before)
    assert int(multi.iterations.numpy()) == 2
    # (a sub-optimizer given no gradient at all raises, as Keras' "No gradients provided for any variable.")
    with strategy.scope(), pytest.raises(ValueError, match="no gradient was given"):
        multi.apply(grads[:3] + [None])
    # finalize_variable_values routes to each sub-optimizer's (moving averages).
    ema_var = md.Variable(np.ones(2, np.float32), name="e")
    ema = O.MultiOptimizer(O.OptimizerMap(O.SGD(0.5, use_ema=True, ema_momentum=0.5)))
    ema.apply([np.ones(2, np.float32)], [ema_var])
    ema.apply([np.ones(2, np.float32)], [ema_var])
    ema.finalize_variable_values([ema_var])
    np.testing.assert_allclose(host(ema_var), host(ema.optimizers[0].get_slot(ema_var, "average")))


# -- on (simulated) GPUs --
@pytest.mark.gpu
def test_gpu_replicas_match_keras_and_md_function_captures_the_step():
    from gpu_env import cupy, gpu_pair

    name = "clipnorm weight_decay loss_scale_factor"
    with gpu_pair():
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        multi, variables = train(name, strategy, 2, cupy)
        check_against_keras(name, 2, multi, variables, rtol=1e-5)
        # md.function: the captured step gives the eager step's bits and counts as it does.
        results = []
        for captured in (False, True):
            multi, variables = _built(strategy, name)

            def step(g):
                multi.apply_gradients([(g[:int(np.prod(v.shape))].reshape(v.shape), v) for v in variables])
                return g.sum()

            run = md.function(step) if captured else step
            for s in range(4):
                grads = strategy.experimental_distribute_values_from_function(
                    lambda ctx, s=s: cupy.asarray(np.concatenate([np.resize(DATA[f"grads|{p}"][s, ctx.replica_id_in_sync_group], 12) for p in PATHS])))
                strategy.run(run, args=(grads,))
            results.append([host(c) for v in variables + multi.variables for c in v.values])
        for got, want in zip(*results):
            np.testing.assert_array_equal(got, want)
        assert int(results[1][len(variables) * 2]) == 4  # the MultiOptimizer's iterations, counted by the replays


@pytest.mark.gpu
def test_a_step_of_200_variables_costs_the_parts_launches_per_gpu(monkeypatch):
    """200 variables split over Adam and SGD: per GPU each part's pack, all-reduce and fused update, whatever the
    number of variables, and no CuPy kernel per variable (the routing is a table made once)."""
    from gpu_env import SIMULATED, cupy, gpu_pair
    from test_optimizer_gpu import _count_launches

    if not SIMULATED:
        pytest.skip("counts the simulated runtime's launches")
    shapes = [(16, 8) if k % 2 else (8,) for k in range(200)]
    with gpu_pair():
        strategy = md.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with strategy.scope():
            variables = [md.Variable(np.full(shape, 0.5, np.float32), name=f"{'enc' if k < 100 else 'dec'}/v{k}")
                         for k, shape in enumerate(shapes)]
            multi = O.MultiOptimizer(O.OptimizerMap(O.SGD(0.1, momentum=0.9), {"enc/.*": O.Adam(0.01)}))

        def step():
            r = md.get_replica_context().replica_id_in_sync_group
            multi.apply_gradients(zip([cupy.full(s, 0.25 * (r + 1), np.float32) for s in shapes], variables))

        for _ in range(2):  # the plans, slots and tables are made outside the count
            strategy.run(step)
        size = sum(int(np.prod(s)) for s in shapes[:100])
        packed = [cupy.asarray(np.zeros(size, np.float32)) for _ in range(2)]
        with cupy.cuda.Device(1):
            packed[1] = cupy.asarray(np.zeros(size, np.float32))
        all_reduce, _ = _count_launches(monkeypatch, lambda: strategy.extended.batch_reduce_to(
            md.ReduceOp.SUM, [(md.PerReplica(packed, strategy.extended.worker_devices), variables[0])]))
        engine, stand_in = _count_launches(monkeypatch, lambda: strategy.run(step))
        # (two logical GPUs on GPU 0: it runs both replicas' kernels)
        replicas = 2
        # Per sub-optimizer: each replica's pack and fused update, and one all-reduce; whatever the 100 variables.
        assert engine[0] == 2 * (replicas * 2 + all_reduce[0]), (engine[0], all_reduce[0])
        # The stand-in's kernels besides the 200 gradients of each replica: per replica, each sub-optimizer's step
        # count and the MultiOptimizer's.
        assert stand_in[0] - 200 * replicas == 3 * replicas, stand_in[0]
        assert int(multi.iterations.numpy()) == 3
        assert all(int(o.iterations.numpy()) == 3 for o in multi.optimizers)


# -- across workers --
def _two_workers_job():
    strategy = md.MultiWorkerMirroredStrategy(communication_options=md.CommunicationOptions(timeout_seconds=60))
    rank = strategy.cluster_resolver.task_id
    name = "clipnorm weight_decay loss_scale_factor"
    variables = model(strategy)
    with strategy.scope():
        multi, _ = make(name)
    for s in range(STEPS):
        strategy.run(lambda s=s: multi.apply_gradients([(DATA[f"grads|{p}"][s, rank], v)
                                                        for p, v in zip(PATHS, variables)]))
    check_against_keras(name, 2, multi, variables)
    return [host(v.values[0]) for v in variables]


@pytest.mark.multiworker
@needs_gloo
def test_two_workers_of_one_replica_match_keras_at_two_replicas():
    from multiworker_launch import launch

    results = launch(_two_workers_job, 2, timeout=300)
    for r in results:
        assert r.ok, (r.task, r.returncode, r.error, r.message, r.stderr[-3000:])
    for a, b in zip(results[0].value, results[1].value):
        np.testing.assert_array_equal(a, b)
