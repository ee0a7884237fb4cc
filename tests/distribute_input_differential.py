"""Seeded random distributed inputs on one worker, for tests/test_distribute_input_differential.py (recorded on
TF 2.21 by tests/data/record_tf_distribute_input_differential.py).

``cases(seed, count)`` draws ``count`` cases. A case names a strategy (MirroredStrategy over 1-4 logical CPUs,
OneDeviceStrategy, CentralStorageStrategy over 2-3 compute CPUs), how the input is distributed
(``experimental_distribute_dataset`` of a globally batched pipeline under some ``InputOptions``,
``distribute_datasets_from_function`` of a per-replica pipeline built from the ``InputContext``, or
``experimental_distribute_values_from_function``) and how it is consumed (a ``for`` loop, ``next`` until
``StopIteration``, ``get_next`` until ``OutOfRangeError``, ``get_next_as_optional`` until it is empty, a
``function`` step per element, a ``function`` step that takes ``next`` of an iterator argument, or a ``for`` loop
inside a ``function``). A pipeline is one Python expression
over ``D`` (the Dataset class), ``np``, ``P`` (a namedtuple), ``F`` (the element functions of each side) and,
for ``distribute_datasets_from_function``, ``ctx``, so TF and mirrored build the same pipeline from the same
text.

:func:`run_case` answers a case on either library through an adapter (``lib``): the element specs, the
cardinality, per step every leaf's per-replica arrays, ``strategy.run``'s per-replica sizes, their
``experimental_local_results`` and ``reduce`` (SUM and MEAN), ``reduce`` along axis 0 of the first leaf, the
end of the iteration, a second pass; or the exception (class and first line) wherever one is raised. Nothing
here imports TensorFlow or mirrored.
"""

import collections
import random

import numpy as np

P = collections.namedtuple("P", "x y")

STRATEGIES = ("mirrored1", "mirrored2", "mirrored3", "mirrored4", "one_device", "central2", "central3")
MAX_STEPS = 10  # the steps looked at of one pass
DTYPES = ("int32", "int64", "float32", "float64", "bool")


# --- the generator -----------------------------------------------------------------------------------------------

def _leaf(rng, rows):
    dtype = rng.choice(DTYPES)
    if dtype == "bool":
        return f"(np.arange({rows}) % 3 == 0)"
    start = rng.randrange(-5, 20)
    if rng.random() < 0.35:
        width = rng.randrange(1, 4)
        return f"np.arange({start}, {start + rows * width}).reshape({rows}, {width}).astype('{dtype}')"
    return f"np.arange({start}, {start + rows}).astype('{dtype}')"


def _source(rng):
    kind = rng.choice(("range", "range", "single", "tuple", "dict", "namedtuple", "nested"))
    if kind == "range":
        start, stop = rng.randrange(-3, 4), rng.choice((0, 1, 5, 9, 13, 17, 24))
        step = rng.choice((1, 1, 1, 2, 3))
        return f"D.range({start}, {start + stop}, {step})" if step > 1 else f"D.range({start}, {start + stop})"
    rows = rng.choice((0, 1, 3, 6, 7, 10, 13, 16))
    a, b = (_leaf(rng, rows) for _ in range(2))
    structure = {"single": a, "tuple": f"({a}, {b})", "dict": f"{{'a': {a}, 'b': {b}}}",
                 "namedtuple": f"P(x={a}, y={b})", "nested": f"{{'p': ({a}, {b}), 'q': {b}}}"}[kind]
    return f"D.from_tensor_slices({structure})"


def _element_ops(rng):
    ops = []
    for _ in range(rng.choice((0, 0, 1, 2))):
        ops.append(rng.choice((".filter(F.keep)", f".take({rng.randrange(0, 12)})", f".repeat({rng.randrange(1, 3)})",
                               f".shard({rng.randrange(1, 3)}, 0)", ".prefetch(2)", f".skip({rng.randrange(0, 3)})")))
    return "".join(ops)


def _batched_ops(rng, batch):
    ops = []
    for _ in range(rng.choice((0, 0, 1, 2))):
        ops.append(rng.choice((f".rebatch({rng.randrange(1, 6)})", f".unbatch().batch({batch})", ".repeat(2)",
                               f".take({rng.randrange(0, 5)})", ".prefetch(1)", ".filter(F.keep)",
                               f".shard(2, {rng.randrange(0, 2)})")))
    return "".join(ops)


def _batch(rng, size):
    drop = rng.random() < 0.3
    if rng.random() < 0.2:
        return f".padded_batch({size}, drop_remainder={drop})"
    return f".batch({size}, drop_remainder={drop})"


def _pipeline(rng, batch_expr):
    expr = _source(rng) + _element_ops(rng)
    if rng.random() < 0.08:  # unbatched: rank-0 elements reach the strategy
        return expr
    return expr + _batch(rng, batch_expr) + _batched_ops(rng, batch_expr)


def _draw_input_options(rng):
    options = {}
    if rng.random() < 0.3:
        options["experimental_fetch_to_device"] = rng.random() < 0.5
    if rng.random() < 0.3:
        options["experimental_per_replica_buffer_size"] = rng.randrange(0, 4)
    if rng.random() < 0.15:
        options["experimental_replication_mode"] = rng.choice(("PER_WORKER", "PER_REPLICA"))
    return options


VALUE_FNS = (
    "np.array(ctx.replica_id_in_sync_group, np.int32)",
    "np.arange(ctx.replica_id_in_sync_group + 1, dtype=np.float32)",
    "np.full((2, 3), ctx.num_replicas_in_sync, np.int64) + ctx.replica_id_in_sync_group",
    "(np.float64(ctx.replica_id_in_sync_group), np.arange(3, dtype=np.int32) * ctx.num_replicas_in_sync)",
    "{'a': np.arange(2, dtype=np.float32) + ctx.replica_id_in_sync_group, 'b': np.array([ctx.num_replicas_in_sync])}",
    "P(x=np.arange(4, dtype=np.int32)[ctx.replica_id_in_sync_group:], y=np.float32(1.5))",
)
MODES = ("for", "next", "get_next", "optional", "function", "function_loop", "function_next")


def cases(seed=32, count=400) -> dict:
    """``count`` cases by name, the same for the same ``seed``."""
    rng = random.Random(seed)
    out = {}
    for i in range(count):
        strategy = rng.choice(STRATEGIES)
        method = rng.choices(("dataset", "from_function", "values"), (65, 25, 10))[0]
        case = {"strategy": strategy, "method": method}
        if method == "values":
            case["value_fn"] = rng.choice(VALUE_FNS)
        else:
            if method == "dataset":
                case["ds"] = _pipeline(rng, str(rng.randrange(1, 10)))
            else:
                global_batch = rng.randrange(1, 13)
                batch = rng.choice((f"ctx.get_per_replica_batch_size({global_batch})", str(rng.randrange(1, 5))))
                ds = _pipeline(rng, batch)
                if rng.random() < 0.3:
                    ds = ds.replace(".batch(", ".shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(", 1)
                case["ds"] = ds
            case["options"] = _draw_input_options(rng)
            case["mode"] = rng.choice(MODES)
        out[f"c{i:03d}.{strategy}.{method}"] = case
    return out


# --- running a case ----------------------------------------------------------------------------------------------

def misspelt_option(result) -> bool:
    """Whether TF's ``result`` is its CentralStorageStrategy's misspelt read of InputOptions (an AttributeError
    for any options given)."""
    build = result.get("build", {})
    return build.get("raises") == "AttributeError" and "experimental_replication_moden" in build.get("msg", "")


def _raised(e):
    return {"raises": type(e).__name__, "msg": str(e).strip().split("\n")[0][:300]}


def _array(lib, x):
    a = lib.numpy(x)
    return [a.dtype.name, list(a.shape), a.tolist()]


def encode(lib, strategy, value):
    """``value``'s structure kept (dicts, namedtuples, tuples, lists by kind), every leaf as its local results'
    [dtype, shape, values]."""
    if isinstance(value, dict):
        return {"dict": {str(k): encode(lib, strategy, v) for k, v in sorted(value.items())}}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {type(value).__name__: [encode(lib, strategy, v) for v in value]}
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [encode(lib, strategy, v) for v in value]}
    return [_array(lib, v) for v in strategy.experimental_local_results(value)]


def encode_spec(lib, spec):
    if isinstance(spec, dict):
        return {"dict": {str(k): encode_spec(lib, v) for k, v in sorted(spec.items())}}
    if isinstance(spec, tuple):
        return {type(spec).__name__: [encode_spec(lib, v) for v in spec]}
    return lib.spec_leaf(spec)


def _attempt(result, key, fn):
    try:
        result[key] = fn()
        return True
    except Exception as e:  # noqa: BLE001  (TF's refusal is the answer)
        result[key] = _raised(e)
        return False


def _first_leaf(lib, value):
    return lib.flatten(value)[0]


def _probe(lib, strategy, element):
    """One step's answer: the element, run's per-replica sizes of its first leaf and their reductions, the first
    leaf reduced along axis 0."""
    out = {}
    _attempt(out, "element", lambda: encode(lib, strategy, element))
    sizes = {}
    if _attempt(sizes, "run", lambda: strategy.run(lib.F.size, args=(element,))):
        run = sizes["run"]
        out["sizes"] = [_array(lib, v) for v in strategy.experimental_local_results(run)]
        _attempt(out, "sum", lambda: _array(lib, strategy.reduce("SUM", run, axis=None)))
        _attempt(out, "mean", lambda: _array(lib, strategy.reduce(lib.ReduceOp.MEAN, run, axis=None)))
    else:
        out["run"] = sizes["run"]
    first = _first_leaf(lib, element)
    local = strategy.experimental_local_results(first)
    if lib.numpy(local[0]).ndim >= 1 and lib.numpy(local[0]).dtype.kind in "if":
        _attempt(out, "sum_axis0", lambda: _array(lib, strategy.reduce("SUM", first, axis=0)))
        if lib.numpy(local[0]).dtype.kind == "f":
            _attempt(out, "mean_axis0", lambda: _array(lib, strategy.reduce("MEAN", first, axis=0)))
    return out


def _input_options(lib, given):
    given = dict(given)
    if "experimental_replication_mode" in given:
        given["experimental_replication_mode"] = getattr(lib.InputReplicationMode,
                                                         given["experimental_replication_mode"])
    return lib.InputOptions(**given)


def _consume(lib, strategy, dist, mode, result):
    steps = []
    result["steps"] = steps
    if mode == "for":
        for element in dist:
            steps.append(_probe(lib, strategy, element))
            if len(steps) == MAX_STEPS:
                break
        return
    if mode == "function":
        step = lib.function(lambda x: strategy.run(lib.F.size, args=(x,)))
        for element in dist:
            sizes = step(element)
            steps.append([_array(lib, v) for v in strategy.experimental_local_results(sizes)])
            if len(steps) == MAX_STEPS:
                break
        return
    if mode == "function_next":  # TF's train_step(iterator): one next() per call, until the end raises
        step = lib.function(lambda iterator: strategy.run(lib.F.size, args=(next(iterator),)))
        it = iter(dist)
        while len(steps) < MAX_STEPS:
            try:
                sizes = step(it)
            except Exception as e:  # noqa: BLE001  (TF's OutOfRangeError at the end)
                result["end"] = _raised(e)
                break
            steps.append([_array(lib, v) for v in strategy.experimental_local_results(sizes)])
        return
    if mode == "function_loop":
        def loop(d):
            total, count = lib.zero(), lib.zero()
            for x in d:
                total += strategy.reduce("SUM", strategy.run(lib.F.size, args=(x,)), axis=None)
                count += 1
            return total, count
        total, count = lib.function(loop)(dist)
        result["loop"] = [_array(lib, total), _array(lib, count)]
        return
    it = iter(dist)
    result["iterator_spec"] = encode_spec(lib, it.element_spec)
    while len(steps) < MAX_STEPS:
        if mode == "optional":
            optional = it.get_next_as_optional()
            if not bool(optional.has_value()):
                _attempt(result, "empty_value", optional.get_value)
                break
            steps.append(_probe(lib, strategy, optional.get_value()))
            continue
        try:
            element = next(it) if mode == "next" else it.get_next()
        except StopIteration as e:
            result["end"] = _raised(e)
            break
        except Exception as e:  # noqa: BLE001  (get_next's OutOfRangeError)
            result["end"] = _raised(e)
            break
        steps.append(_probe(lib, strategy, element))
    if "end" in result and mode == "next":
        try:
            next(it)
            result["after_end"] = "value"
        except StopIteration as e:
            result["after_end"] = _raised(e)
        except Exception as e:  # noqa: BLE001
            result["after_end"] = _raised(e)


def run_case(lib, case):
    """``case``'s answer on ``lib`` (the adapter of TF or mirrored)."""
    strategy = lib.strategy(case["strategy"])
    scope = {"D": lib.Dataset, "np": np, "P": P, "F": lib.F}
    result = {"replicas": strategy.num_replicas_in_sync}
    if case["method"] == "values":
        def value_fn(ctx):
            return eval(case["value_fn"], dict(scope, ctx=ctx))  # noqa: S307  (the cases above)
        if not _attempt(result, "value", lambda: strategy.experimental_distribute_values_from_function(value_fn)):
            return result
        value = result.pop("value")
        result["values"] = encode(lib, strategy, value)
        result["probe"] = _probe(lib, strategy, value)
        return result
    try:
        options = _input_options(lib, case["options"]) if case["options"] else None
        if case["method"] == "dataset":
            dist = strategy.experimental_distribute_dataset(eval(case["ds"], scope), options)  # noqa: S307
        else:
            def dataset_fn(ctx):
                return eval(case["ds"], dict(scope, ctx=ctx))  # noqa: S307
            dist = strategy.distribute_datasets_from_function(dataset_fn, options)
    except Exception as e:  # noqa: BLE001
        result["build"] = _raised(e)
        return result
    _attempt(result, "spec", lambda: encode_spec(lib, dist.element_spec))
    _attempt(result, "cardinality", lambda: int(dist.cardinality))
    try:
        _consume(lib, strategy, dist, case["mode"], result)
    except Exception as e:  # noqa: BLE001
        result["consume"] = _raised(e)
        return result
    if case["mode"] in ("for", "next"):
        # A second pass starts again from the first element.
        def again():
            count, first = 0, None
            for element in dist:
                if first is None:
                    first = encode(lib, strategy, element)
                count += 1
                if count == MAX_STEPS:
                    break
            return [count, first]
        _attempt(result, "second_pass", again)
    return result
