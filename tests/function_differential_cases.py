"""Randomised differential cases of ``md.function`` against TensorFlow 2.21's ``tf.function``: drawn from a seed,
written once over an adapter ``X`` (``X.function``, ``X.TensorSpec``, ``X.MirroredStrategy``, ``X.Variable``), so
that TensorFlow (tests/data/record_tf_function.py records them) and mirrored (tests/test_function_differential.py
replays them) run the same code. This module imports neither TensorFlow nor mirrored.

A case is plain data: its ``kind`` (retracing rules, input_signature binding, concrete functions, decorated
methods, Python side effects, steps that call ``strategy.run``, the decorator's forms and attributes) and the
calls it makes, each argument described as JSON (:func:`value` builds it). :func:`run_case` runs one and returns,
per call, the encoded result (or the exception's class and text) and what the function reports after it
(``experimental_get_tracing_count()``, the side effects so far).
"""

import copy
import random

import numpy as np

SEED = 32
NS = (1, 2, 3)  # replica counts of the strategy cases (logical CPUs)
DTYPES = ("float32", "float64", "int32", "int64")
COUNTS = {"retrace": 110, "signature": 75, "concrete": 35, "method": 25, "side_effect": 20, "strategy": 25,
          "decorator": 15}


# --- argument descriptions ---------------------------------------------------------------------------------

def _array(rng, dtypes=DTYPES, shapes=((2,), (3,), (2, 3), (3, 3), (), (1, 2))):
    return {"array": {"dtype": rng.choice(dtypes), "shape": list(rng.choice(shapes)), "seed": rng.randrange(10**6)}}


def _scalar(rng):
    form = rng.choice(("int", "int", "float", "bool", "str", "none", "npscalar"))
    if form == "int":
        return {"int": rng.choice((0, 1, 2, 3))}
    if form == "float":
        return {"float": rng.choice((0.0, 1.0, 2.5))}
    if form == "bool":
        return {"bool": rng.choice((True, False))}
    if form == "str":
        return {"str": rng.choice(("a", "b"))}
    if form == "none":
        return {"none": None}
    return {"npscalar": {"dtype": rng.choice(("float32", "int64")), "v": rng.choice((1, 2))}}


def _argument(rng, depth=0):
    """An argument: an array (of a few shapes and dtypes, so that calls repeat types), a Python or NumPy scalar,
    or a tuple, list or dict of them."""
    roll = rng.random()
    if roll < 0.45:
        return _array(rng)
    if roll < 0.8 or depth:
        return _scalar(rng)
    items = [_argument(rng, depth + 1) for _ in range(rng.randint(1, 2))]
    form = rng.choice(("tuple", "list", "dict"))
    if form == "dict":
        keys = rng.sample(("a", "b", "c"), len(items))
        return {"dict": [[k, v] for k, v in zip(keys, items)]}
    return {form: items}


def value(description):
    """The Python value an argument description stands for (NumPy arrays: both libraries take them)."""
    (form, body), = description.items()
    if form == "array":
        rng = np.random.RandomState(body["seed"])
        return (rng.randint(-4, 6, size=body["shape"]) / (2 if body["dtype"].startswith("float") else 1)).astype(
            body["dtype"])
    if form == "npscalar":
        return np.dtype(body["dtype"]).type(body["v"])
    if form in ("int", "float", "bool", "str", "none"):
        return body
    if form == "dict":
        return {k: value(v) for k, v in body}
    if form == "object":
        return _Opaque()
    items = [value(v) for v in body]
    return tuple(items) if form == "tuple" else items


class _Opaque:
    """An argument that is no tensor and converts to none."""

    def __repr__(self):
        return "<opaque>"


# --- the Python functions wrapped -------------------------------------------------------------------------

def _leafwise(x):
    """Every leaf doubled (strings kept, None as it is): arrays stay the library's tensors."""
    if isinstance(x, (tuple, list)):
        return type(x)(_leafwise(v) for v in x)
    if isinstance(x, dict):
        return {k: _leafwise(v) for k, v in x.items()}
    if x is None or isinstance(x, str):
        return x
    return x * 2


def _one(x):
    return _leafwise(x)


def _default(x, y=3):
    return _leafwise((x, y))


def _two(x, y):
    return _leafwise((x, y))


def _star(x, *rest):
    return _leafwise((x, rest))


def _keyword_only(x, *, k=2):
    return _leafwise((x, k))


def _more(x, **more):
    return _leafwise((x, more))


FUNCTIONS = {"one": _one, "default": _default, "two": _two, "star": _star, "keyword_only": _keyword_only,
             "more": _more}
PARAMETERS = {"one": ("x",), "default": ("x", "y"), "two": ("x", "y"), "star": ("x",), "keyword_only": ("x",),
              "more": ("x",)}


# --- drawing -------------------------------------------------------------------------------------------------

def _call(rng, fn_name, pool):
    """A call of ``fn_name``: arguments from ``pool`` (earlier arguments come back, so that traces are reused),
    each given positionally or by keyword; now and then one argument too many or too few, or an unknown keyword."""
    params = PARAMETERS[fn_name]
    pick = lambda: rng.choice(pool) if pool and rng.random() < 0.55 else _argument(rng)  # noqa: E731
    args, kwargs = [], {}
    count = len(params)
    if fn_name == "default":
        count = rng.choice((1, 2))
    roll = rng.random()
    if roll < 0.05:
        count += 1
    elif roll < 0.08:
        count -= 1
    for i in range(count):
        a = pick()
        pool.append(a)
        if i < len(params) and rng.random() < 0.3:
            kwargs[params[i]] = a
        elif kwargs:
            kwargs[f"p{i}"] = a  # (after a keyword, an unknown keyword: TF's binding refuses it)
        else:
            args.append(a)
    if fn_name == "default" and count == 2 and "y" not in kwargs and len(args) == 2 and rng.random() < 0.3:
        args[1] = {"int": 3}  # the default given explicitly
    if fn_name == "star" and rng.random() < 0.4:
        args.extend(pick() for _ in range(rng.randint(1, 2)))
    if fn_name == "keyword_only" and rng.random() < 0.4:
        kwargs["k"] = rng.choice(({"int": 2}, {"int": 5}, _array(rng)))
    return {"args": args, "kwargs": [[k, v] for k, v in kwargs.items()]}


def _spec(rng, tuple_ok=True):
    if tuple_ok and rng.random() < 0.15:
        return {"tuple": [_spec(rng, False), _spec(rng, False)]}
    roll = rng.random()
    if roll < 0.1:
        shape = None
    else:
        shape = [rng.choice((None, None, 2, 3)) for _ in range(rng.choice((0, 1, 1, 2)))]
    return {"spec": shape, "dtype": rng.choice(DTYPES)}


def _fitting(rng, spec):
    """An argument for ``spec``: usually one that fits (its shape, another dtype now and then, a list), else one
    of another shape, a string, None or an object no library converts."""
    if "tuple" in spec:
        if rng.random() < 0.15:
            return _fitting(rng, spec["tuple"][0])
        return {rng.choice(("tuple", "tuple", "list")): [_fitting(rng, s) for s in spec["tuple"]]}
    roll = rng.random()
    shape = None if spec["spec"] is None else [d if d is not None else rng.choice((1, 2, 4)) for d in spec["spec"]]
    if shape is None:
        shape = list(rng.choice(((), (2,), (2, 2))))
    if roll < 0.55:
        dtype = spec["dtype"] if rng.random() < 0.75 else rng.choice(DTYPES)
        return {"array": {"dtype": dtype, "shape": shape, "seed": rng.randrange(10**6)}}
    if roll < 0.68:
        flat = [int(v) for v in np.arange(int(np.prod(shape))) % 3]
        nested = np.reshape(np.array(flat, dtype=object), shape).tolist() if shape else flat[0]
        return {"pylist": nested if shape else nested, "float": rng.random() < 0.5}
    if roll < 0.8:
        return _array(rng)  # (any shape and dtype)
    return rng.choice(({"str": "abc"}, {"none": None}, {"object": None}, {"float": 3.5}, {"int": 2}))


def _signature_case(rng, case):
    n_params = rng.choice((1, 1, 2))
    case["fn"] = "one" if n_params == 1 else "two"
    case["signature"] = [_spec(rng) for _ in range(n_params)]
    case["reduce_retracing"] = rng.random() < 0.3
    calls = []
    for _ in range(rng.randint(2, 4)):
        args = [_fitting(rng, s) for s in case["signature"]]
        kwargs = []
        roll = rng.random()
        if roll < 0.06:
            args.append({"int": 1})  # one too many
        elif roll < 0.1:
            args.pop()
        elif roll < 0.25:
            kwargs = [[PARAMETERS[case["fn"]][len(args) - 1], args.pop()]]
        calls.append({"args": args, "kwargs": kwargs})
    case["calls"] = calls


def _draw(kind, rng):
    case = {"kind": kind}
    if kind == "retrace":
        case["fn"] = rng.choice(("one", "one", "default", "two", "star", "keyword_only", "more"))
        case["reduce_retracing"] = rng.random() < 0.3
        pool = []
        case["calls"] = [_call(rng, case["fn"], pool) for _ in range(rng.randint(3, 6))]
    elif kind == "signature":
        _signature_case(rng, case)
    elif kind == "concrete":
        case["fn"] = rng.choice(("one", "one", "default", "two"))
        case["with_signature"] = rng.random() < 0.4
        n = len(PARAMETERS[case["fn"]]) if case["fn"] != "default" else 1
        specs = [_spec(rng, tuple_ok=False) for _ in range(n)]
        if case["with_signature"]:
            case["signature"] = specs
            case["example"] = []
        else:  # example arguments: specs, or arrays whose shapes and dtypes the concrete function takes
            case["example"] = [s if rng.random() < 0.5 else _fitting(rng, dict(s, spec=s["spec"] or [2]))
                               for s in specs]
        case["calls"] = []
        for _ in range(rng.randint(2, 4)):
            target = rng.choice(("concrete", "concrete", "function"))
            args = [_fitting(rng, s) for s in specs]
            if rng.random() < 0.1:
                args.append({"int": 1})
            case["calls"].append({"target": target, "args": args, "kwargs": []})
    elif kind == "method":
        case["signature"] = [_spec(rng, tuple_ok=False)] if rng.random() < 0.3 else None
        case["calls"] = []
        for _ in range(rng.randint(3, 6)):
            arg = _fitting(rng, case["signature"][0]) if case["signature"] else (
                rng.choice(({"int": 1}, {"int": 2})) if rng.random() < 0.4 else _array(rng, shapes=((2,), (3,))))
            case["calls"].append({"instance": rng.choice((0, 1)), "args": [arg], "kwargs": []})
    elif kind == "side_effect":
        case["signature"] = [_spec(rng, tuple_ok=False)] if rng.random() < 0.3 else None
        case["reduce_retracing"] = rng.random() < 0.3
        case["calls"] = [{"args": [_fitting(rng, case["signature"][0]) if case["signature"] else
                                   rng.choice((_array(rng, shapes=((2,), (3,))), {"int": rng.choice((1, 2))}))],
                          "kwargs": []} for _ in range(rng.randint(2, 5))]
    elif kind == "strategy":
        case["n"] = rng.choice(NS)
        case["form"] = rng.choice(("outer", "outer", "inner", "variable"))
        case["op"] = rng.choice(("SUM", "MEAN"))
        case["per_replica"] = rng.random() < 0.5 and case["form"] != "inner"
        dtype = rng.choice(("float32", "float64"))
        # (a variable's step keeps its shape: a mismatched assign is an eager error of its own, not md.function's)
        shapes = ((2,),) if case["form"] == "variable" else ((2,), (2,), (3,))
        case["calls"] = [{"args": [_array(rng, dtypes=(dtype,), shapes=shapes)], "kwargs": []}
                         for _ in range(rng.randint(2, 4))]
    elif kind == "decorator":
        case["form"] = rng.choice(("plain", "decorator_args", "call_args"))
        case["options"] = rng.choice(({}, {"jit_compile": True}, {"autograph": False}, {"reduce_retracing": True},
                                      {"experimental_relax_shapes": True}, {"experimental_compile": False},
                                      {"experimental_follow_type_hints": True},
                                      {"experimental_implements": None, "experimental_attributes": None}))
        case["calls"] = [{"args": [_array(rng, shapes=((2,), (3,)))], "kwargs": []} for _ in range(2)]
    return case


def generate(seed=SEED):
    """The cases of ``seed``: COUNTS of each kind, each named ``kind-index``."""
    rng = random.Random(seed)
    return {f"{kind}-{i:03d}": _draw(kind, rng) for kind, count in COUNTS.items() for i in range(count)}


# --- running ---------------------------------------------------------------------------------------------------

def _arguments(call):
    return [value(a) for a in call["args"]], {k: value(v) for k, v in call["kwargs"]}


def spec_of(X, description):
    if "tuple" in description:
        return tuple(spec_of(X, s) for s in description["tuple"])
    return X.TensorSpec(description["spec"], description["dtype"])


def _pylist(description):
    return np.asarray(description["pylist"], dtype=float if description["float"] else int).tolist()


def _fit_arguments(call):
    return [_fit_value(a) for a in call["args"]], {k: _fit_value(v) for k, v in call["kwargs"]}


def _fit_value(description):
    if "pylist" in description:
        return _pylist(description)
    (form, body), = description.items()
    if form in ("tuple", "list"):
        items = [_fit_value(v) for v in body]
        return tuple(items) if form == "tuple" else items
    return value(description)


def encode(X, x):
    """A result as plain data: containers kept, each leaf its dtype, shape and values (or a string, None)."""
    if isinstance(x, (tuple, list)):
        return {type(x).__name__: [encode(X, v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[k, encode(X, x[k])] for k in sorted(x)]}
    if x is None:
        return None
    if isinstance(x, (str, bytes)):
        return {"str": x.decode() if isinstance(x, bytes) else x}
    a = X.to_numpy(x)
    if a.dtype == object or a.dtype.kind in "SU":
        return {"str": a.item().decode() if isinstance(a.item(), bytes) else str(a.item())}
    return {"dtype": a.dtype.name, "shape": list(a.shape), "v": a.tolist(),
            "python": isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)}


def attempt(X, fn):
    try:
        return encode(X, fn())
    except Exception as e:  # noqa: BLE001  (the exception is the result)
        return {"raises": type(e).__name__, "msg": str(e)}


def _traced_calls(X, f, calls, make=_arguments, log=None):
    out = []
    for call in calls:
        args, kwargs = make(call)
        result = attempt(X, lambda: f(*args, **kwargs))
        row = {"result": result, "count": f.experimental_get_tracing_count()}
        if log is not None:
            row["effects"] = len(log)
        out.append(row)
    return out


def _run_retrace(X, case):
    f = X.function(FUNCTIONS[case["fn"]], reduce_retracing=case["reduce_retracing"])
    return {"calls": _traced_calls(X, f, case["calls"])}


def _run_signature(X, case):
    try:
        f = X.function(FUNCTIONS[case["fn"]], input_signature=[spec_of(X, s) for s in case["signature"]],
                       reduce_retracing=case["reduce_retracing"])
    except Exception as e:  # noqa: BLE001
        return {"wrap": {"raises": type(e).__name__, "msg": str(e)}}
    return {"calls": _traced_calls(X, f, case["calls"], _fit_arguments)}


def _run_concrete(X, case):
    fn = FUNCTIONS[case["fn"]]
    if case["with_signature"]:
        f = X.function(fn, input_signature=[spec_of(X, s) for s in case["signature"]])
        example = []
    else:
        f = X.function(fn)
        example = [spec_of(X, e) if "spec" in e else _fit_value(e) for e in case["example"]]
    out = {}
    try:
        concrete = f.get_concrete_function(*example)
    except Exception as e:  # noqa: BLE001
        return {"concrete": {"raises": type(e).__name__, "msg": str(e)}, "count": f.experimental_get_tracing_count()}
    args, kwargs = concrete.structured_input_signature
    out["inputs"] = [encode_spec(X, s) for s in args]
    out["count"] = f.experimental_get_tracing_count()
    out["calls"] = []
    for call in case["calls"]:
        target = concrete if call["target"] == "concrete" else f
        a, k = _fit_arguments(call)
        out["calls"].append({"result": attempt(X, lambda: target(*a, **k)),
                             "count": f.experimental_get_tracing_count()})
    return out


def encode_spec(X, s):
    """A TensorSpec (its shape, dtype and name), or any other input of a concrete signature as it is."""
    if hasattr(s, "shape") and hasattr(s, "dtype"):
        shape = None if X.rank(s) is None else [None if d is None else int(d) for d in s.shape]
        return {"spec": shape, "dtype": X.dtype_name(s.dtype), "name": s.name}
    return {"literal": s if isinstance(s, (int, float, str, bool)) or s is None else repr(s)}


def _run_method(X, case):
    signature = None if case["signature"] is None else [spec_of(X, s) for s in case["signature"]]

    class Model:
        def __init__(self, k):
            self.k = k

        def scaled(self, x):
            return _leafwise(x) if self.k == 1 else _leafwise(_leafwise(x))

    Model.scaled = X.function(Model.scaled, input_signature=signature)
    models = [Model(1), Model(2)]
    out = {"calls": [], "same_bound": models[0].scaled is models[0].scaled,
           "name": models[0].scaled.__name__}
    for call in case["calls"]:
        model = models[call["instance"]]
        a, k = _fit_arguments(call)
        out["calls"].append({"result": attempt(X, lambda: model.scaled(*a, **k)),
                             "counts": [m.scaled.experimental_get_tracing_count() for m in models]})
    return out


def _run_side_effect(X, case):
    log = []

    def step(x):
        log.append("traced")
        return _leafwise(x)

    signature = None if case["signature"] is None else [spec_of(X, s) for s in case["signature"]]
    f = X.function(step, input_signature=signature, reduce_retracing=case["reduce_retracing"])
    return {"calls": _traced_calls(X, f, case["calls"], _fit_arguments, log=log)}


def _run_strategy(X, case, strategy):
    """A step that calls ``strategy.run`` and reduces (``outer``; ``variable``: and adds the result to a mirrored
    variable), or ``strategy.run`` of a wrapped replica function (``inner``); each call's result beside the
    eager step's."""
    n, op = case["n"], case["op"]

    def replica_fn(x):
        return x * 2 + 1

    def distributed(x):
        if not case["per_replica"]:
            return x
        return strategy.experimental_distribute_values_from_function(lambda ctx: x + ctx.replica_id_in_sync_group)

    variable = None
    if case["form"] == "variable":
        with strategy.scope():
            variable = X.Variable(np.zeros(case["calls"][0]["args"][0]["array"]["shape"],
                                           case["calls"][0]["args"][0]["array"]["dtype"]))

    def outer(x):
        reduced = strategy.reduce(op, strategy.run(replica_fn, args=(x,)), axis=None)
        if variable is None:
            return reduced
        variable.assign_add(reduced)
        return variable.read_value()

    out = {"calls": [], "n": n}
    if case["form"] == "inner":
        inner = X.function(replica_fn)
        for call in case["calls"]:
            x = value(call["args"][0])
            got = attempt(X, lambda: strategy.reduce(op, strategy.run(inner, args=(x,)), axis=None))
            want = attempt(X, lambda: strategy.reduce(op, strategy.run(replica_fn, args=(x,)), axis=None))
            out["calls"].append({"result": got, "eager": want, "count": inner.experimental_get_tracing_count()})
        return out
    f = X.function(outer)
    for call in case["calls"]:
        x = distributed(value(call["args"][0]))
        got = attempt(X, lambda: f(x))
        out["calls"].append({"result": got, "count": f.experimental_get_tracing_count()})
    if variable is not None:  # the same calls eagerly, from zero
        variable.assign(np.zeros_like(X.to_numpy(variable.read_value())))
    for row, call in zip(out["calls"], case["calls"]):
        x = distributed(value(call["args"][0]))
        row["eager"] = attempt(X, lambda: outer(x))
    return out


def _run_decorator(X, case):
    options = case["options"]

    def documented(x):
        """Doubles x."""
        return x * 2

    if case["form"] == "plain":
        f = X.function(documented)
    elif case["form"] == "decorator_args":
        f = X.function(**options)(documented)
    else:
        f = X.function(documented, **options)
    out = {"name": f.__name__, "doc": f.__doc__, "qualname_tail": f.__qualname__.rsplit(".", 1)[-1],
           "module_is_cases": f.__module__ == __name__, "python_function": f.python_function is documented,
           "wrapped": getattr(f, "__wrapped__", None) is documented,
           "calls": _traced_calls(X, f, case["calls"])}
    duplicate = copy.copy(f)  # (shares the traces)
    out["copy"] = {"count": duplicate.experimental_get_tracing_count(),
                   "result": attempt(X, lambda: duplicate(value(case["calls"][0]["args"][0]) + 1)),
                   "counts_after": [f.experimental_get_tracing_count(), duplicate.experimental_get_tracing_count()]}
    duplicate(np.ones(4))
    out["copy"]["counts_after_new_type"] = [f.experimental_get_tracing_count(),
                                            duplicate.experimental_get_tracing_count()]
    fresh = copy.deepcopy(X.function(documented, **options))
    out["deepcopy"] = {"result": attempt(X, lambda: fresh(value(case["calls"][0]["args"][0]))),
                       "count": fresh.experimental_get_tracing_count()}
    out["refusals"] = [attempt(X, lambda: X.function(3)),
                       attempt(X, lambda: X.function(documented, no_such_option=True))]
    return out


RUNNERS = {"retrace": _run_retrace, "signature": _run_signature, "concrete": _run_concrete, "method": _run_method,
           "side_effect": _run_side_effect, "decorator": _run_decorator}


def run_case(X, case, strategy=None):
    """The case's encoded observations (``strategy``: the case's strategy, for a strategy case)."""
    if case["kind"] == "strategy":
        return _run_strategy(X, case, strategy)
    return RUNNERS[case["kind"]](X, case)
