"""Randomised differential cases of the Keras optimizers on the strategies: drawn from a seed and run through an
adapter ``X`` (TensorFlow + Keras 3 in tests/data/record_optimizer_differential.py, mirrored in
tests/test_optimizer_differential.py), so both run the same training loop. This module imports neither
TensorFlow nor mirrored.

A case is plain data: the strategy (MirroredStrategy at 1, 2 or 4 replicas, CentralStorageStrategy,
OneDeviceStrategy), the optimizer and its arguments (clipping, weight decay, moving averages, gradient
accumulation, a learning-rate schedule), an optional LossScaleOptimizer around it (with a step whose gradients
are not finite), the variables' dtypes and shapes, the number of steps, eager or inside a function, and a
``seed`` from which :func:`gradients` draws every replica's gradient of every step. :func:`run_case` trains and
returns the encoded result: the variables, the optimizer's variables (each copy), ``iterations``, the learning
rate and the loss scale, or the exception raised.
"""

import math
import random

import numpy as np

SEED = 32
COUNT = 420
# Replicas of MirroredStrategy; CentralStorageStrategy computes on 1 or 2 logical CPUs, its variables on /cpu:0.
NS = (1, 2, 4)
CENTRAL_NS = (1, 2)

OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Adamax", "Adadelta", "Lion", "Ftrl")
SCHEDULES = ("ExponentialDecay", "PiecewiseConstantDecay", "PolynomialDecay", "InverseTimeDecay", "CosineDecay",
             "CosineDecayRestarts")
SHAPES = ([], [3], [2, 3], [2, 1, 2], [5])
# Bad inputs drawn now and then: both sides must refuse them (exception type and key words).
BAD = ("two_clips", "accumulation_one", "ema_momentum", "gradient_shape")


def _lr(rng):
    return rng.choice((0.001, 0.01, 0.05, 0.1))


def _hyper(name, rng):
    """The optimizer's own arguments: defaults now and then, else drawn."""
    if rng.random() < 0.15:
        return {}
    k = {"learning_rate": _lr(rng)}
    if name == "SGD":
        k["momentum"] = rng.choice((0.0, 0.5, 0.9))
        if k["momentum"] and rng.random() < 0.5:
            k["nesterov"] = True
    elif name in ("Adam", "AdamW", "Nadam", "Adamax"):
        if rng.random() < 0.5:
            k.update(beta_1=rng.choice((0.5, 0.8, 0.9)), beta_2=rng.choice((0.9, 0.99, 0.999)),
                     epsilon=rng.choice((1e-7, 1e-5, 1e-3)))
        if name in ("Adam", "AdamW") and rng.random() < 0.35:
            k["amsgrad"] = True
    elif name == "RMSprop":
        k.update(rho=rng.choice((0.5, 0.9)), momentum=rng.choice((0.0, 0.0, 0.5)))
        if rng.random() < 0.4:
            k["centered"] = True
        if rng.random() < 0.3:
            k["epsilon"] = 1e-4
    elif name == "Adagrad":
        k.update(initial_accumulator_value=rng.choice((0.1, 0.5)), epsilon=rng.choice((1e-7, 1e-4)))
    elif name == "Adadelta":
        k.update(learning_rate=rng.choice((0.5, 1.0)), rho=rng.choice((0.9, 0.95)), epsilon=rng.choice((1e-7, 1e-5)))
    elif name == "Lion":
        k.update(beta_1=rng.choice((0.5, 0.9)), beta_2=rng.choice((0.9, 0.99)))
    elif name == "Ftrl":
        k.update(learning_rate_power=rng.choice((-0.5, -0.3, 0.0)),
                 initial_accumulator_value=rng.choice((0.1, 0.5)),
                 l1_regularization_strength=rng.choice((0.0, 0.01, 0.5)),
                 l2_regularization_strength=rng.choice((0.0, 0.02)),
                 l2_shrinkage_regularization_strength=rng.choice((0.0, 0.03)), beta=rng.choice((0.0, 0.5)))
    return k


def _schedule(rng):
    kind = rng.choice(SCHEDULES)
    lr = _lr(rng)
    config = {
        "ExponentialDecay": {"initial_learning_rate": lr, "decay_steps": rng.choice((1, 2, 3)),
                             "decay_rate": rng.choice((0.5, 0.9)), "staircase": rng.random() < 0.5},
        "PiecewiseConstantDecay": {"boundaries": [1, 3], "values": [lr, lr / 2, lr / 5]},
        "PolynomialDecay": {"initial_learning_rate": lr, "decay_steps": rng.choice((2, 4)),
                            "end_learning_rate": lr / 10, "power": rng.choice((1.0, 2.0)), "cycle": rng.random() < 0.5},
        "InverseTimeDecay": {"initial_learning_rate": lr, "decay_steps": 2, "decay_rate": 0.5,
                             "staircase": rng.random() < 0.5},
        "CosineDecay": {"initial_learning_rate": rng.choice((0.0, lr)), "decay_steps": 4,
                        "warmup_target": rng.choice((None, lr)), "warmup_steps": rng.choice((0, 2))},
        "CosineDecayRestarts": {"initial_learning_rate": lr, "first_decay_steps": 2, "t_mul": 1.5, "m_mul": 0.7,
                                "alpha": 0.1},
    }[kind]
    if kind == "CosineDecay" and config["warmup_target"] is None:
        config.pop("warmup_target")
        config["warmup_steps"] = 0
    return {"class_name": kind, "config": config}


def _draw(rng, index):
    roll = rng.random()
    if roll < 0.78:
        strategy, n = "mirrored", rng.choice(NS)
    elif roll < 0.9:
        strategy, n = "central", rng.choice(CENTRAL_NS)
    else:
        strategy, n = "one_device", 1
    name = rng.choice(OPTIMIZERS)
    kwargs = _hyper(name, rng)
    clip = rng.random()
    if clip < 0.15:
        kwargs["clipnorm"] = rng.choice((0.5, 1.0, 2.0))
    elif clip < 0.3:
        kwargs["clipvalue"] = rng.choice((0.2, 0.5, 1.0))
    elif clip < 0.45:
        kwargs["global_clipnorm"] = rng.choice((0.5, 1.5, 3.0))
    if rng.random() < 0.3:
        kwargs["weight_decay"] = rng.choice((0.01, 0.1, 0.2))
    if rng.random() < 0.25:
        kwargs["use_ema"] = True
        if rng.random() < 0.7:
            kwargs["ema_momentum"] = rng.choice((0.5, 0.9))
        if rng.random() < 0.6:
            kwargs["ema_overwrite_frequency"] = rng.choice((1, 2, 3))
    if rng.random() < 0.3:
        kwargs["gradient_accumulation_steps"] = rng.choice((2, 3))
    if rng.random() < 0.25:
        kwargs["learning_rate"] = _schedule(rng)
    if rng.random() < 0.08:
        kwargs["loss_scale_factor"] = rng.choice((0.5, 4.0))
    dtypes = ("float32",) * 7 + ("float64",) * 2 + ("float16",)
    variables = [{"dtype": rng.choice(dtypes), "shape": list(rng.choice(SHAPES))}
                 for _ in range(rng.randint(1, 3))]
    rng.random()  # (once an empty variable: TF 2.21's MirroredStrategy crashes on one)
    case = {"id": index, "seed": rng.randrange(10**6), "strategy": strategy, "n": n, "optimizer": name,
            "kwargs": kwargs, "variables": variables, "steps": rng.randint(1, 5),
            "mode": rng.choice(("eager", "function")), "build": rng.random() < 0.5,
            "scale": rng.choice((0.3, 1.0, 3.0))}
    if rng.random() < 0.22:
        dynamic = rng.random() < 0.75
        case["loss_scale"] = {"dynamic": dynamic, "initial_scale": rng.choice((1.0, 4.0, 64.0)),
                              "dynamic_growth_steps": rng.choice((1, 2, 3))}
        if dynamic and rng.random() < 0.6:
            # A step whose gradients hold an inf or a NaN on the first replica (Keras 3 checks that one), now and
            # then on every replica: skipped, the scale halved.
            case["nonfinite"] = {"step": rng.randrange(case["steps"]), "variable": rng.randrange(len(variables)),
                                 "value": rng.choice(("inf", "nan")), "every_replica": rng.random() < 0.5}
    if rng.random() < 0.05:
        case["bad"] = rng.choice(BAD)
        _make_bad(case)
    return case


def _make_bad(case):
    k = case["kwargs"]
    if case["bad"] == "two_clips":
        k.pop("clipvalue", None), k.pop("global_clipnorm", None)
        k["clipnorm"], k["clipvalue"] = 1.0, 0.5
    elif case["bad"] == "accumulation_one":
        k["gradient_accumulation_steps"] = 1
    elif case["bad"] == "ema_momentum":
        k.update(use_ema=True, ema_momentum=1.5)


def generate(seed=SEED, count=COUNT):
    rng = random.Random(seed)
    return [_draw(rng, i) for i in range(count)]


def gradients(case):
    """``grads[step][replica][variable]``: float arrays in the variable's dtype, drawn from the case's seed.
    ``summed_replicas=k``: one replica's, the sum of the gradients that ``k`` replicas of the case would take."""
    if case.get("summed_replicas"):
        drawn = gradients(dict(case, n=case["summed_replicas"], summed_replicas=None))
        return [[[sum(grads[1:], grads[0]) for grads in zip(*step)]] for step in drawn]
    rng = np.random.RandomState(case["seed"])
    out = []
    for step in range(case["steps"]):
        per_replica = []
        for replica in range(case["n"]):
            grads = []
            for v, spec in enumerate(case["variables"]):
                shape = list(spec["shape"])
                if case.get("bad") == "gradient_shape" and v == 0:
                    shape = shape + [2]
                g = np.array(rng.standard_normal(shape) * case["scale"], dtype=spec["dtype"])  # (0-d: an array)
                bad = case.get("nonfinite")
                if bad and bad["step"] == step and bad["variable"] == v and g.size and (
                        replica == 0 or bad["every_replica"]):
                    g.reshape(-1)[0] = np.inf if bad["value"] == "inf" else np.nan
                grads.append(g)
            per_replica.append(grads)
        out.append(per_replica)
    return out


def initial_values(case):
    rng = np.random.RandomState(case["seed"] + 1)
    return [rng.standard_normal(spec["shape"]).astype(spec["dtype"]) for spec in case["variables"]]


def encode(a):
    a = np.asarray(a)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "v": [_number(x) for x in a.astype(np.float64).ravel()]}


def _number(x):
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def decode(e):
    return np.array([float(x) for x in e["v"]], dtype=np.float64).reshape(e["shape"])


def make_optimizer(X, case):
    kwargs = dict(case["kwargs"])
    if isinstance(kwargs.get("learning_rate"), dict):
        kwargs["learning_rate"] = X.optimizers.schedules.deserialize(kwargs["learning_rate"])
    opt = getattr(X.optimizers, case["optimizer"])(**kwargs)
    if "loss_scale" in case:
        opt = X.loss_scale_optimizer(opt, **case["loss_scale"])
    return opt


def run_case(X, case):
    """Trains the case over adapter ``X`` and returns its encoded result, or ``{"raises", "msg"}``."""
    try:
        return _train(X, case)
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": _message(e)}


def _train(X, case):
    strategy = X.strategy(case["strategy"], case["n"])
    with strategy.scope():
        variables = [X.Variable(v) for v in initial_values(case)]
        opt = make_optimizer(X, case)
        if case["build"] or case["mode"] == "function":
            opt.build(variables)
    grads = gradients(case)

    def replica_step(gs):
        opt.apply_gradients(zip(gs, variables))

    def step(gs):
        strategy.run(replica_step, args=(gs,))

    if case["mode"] == "function":
        step = X.function(step)
    for s in range(case["steps"]):
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: tuple(X.constant(g) for g in grads[s][ctx.replica_id_in_sync_group]))
        step(per_replica)
    inner = X.inner(opt) if "loss_scale" in case else opt
    out = {"variables": [encode(X.numpy(v)) for v in variables],
           "optimizer_variables": [[encode(c) for c in X.copies(v)] for v in X.optimizer_variables(inner)],
           "iterations": int(X.numpy(opt.iterations)),
           "learning_rate": float(X.learning_rate(inner))}
    if case["optimizer"] == "Nadam":
        out["u_product"] = float(X.u_product(inner))
    if "loss_scale" in case:
        out["dynamic_scale"] = float(X.numpy(opt.dynamic_scale))
        out["step_counter"] = int(X.numpy(opt.step_counter))
    return out


def _message(e):
    """The exception's words: the start and the end (a traced function's error puts its cause last)."""
    text = str(e)
    return text if len(text) <= 700 else text[:200] + " ... " + text[-500:]
