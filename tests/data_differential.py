"""Seeded random md.data / tf.data pipelines for the differential suite (tests/test_data_differential.py, recorded
by tests/data/record_tf_data_differential.py).

``pipelines(seed, count)`` draws ``count`` pipelines. Each is one Python expression over ``D`` (the Dataset class),
``np``, ``TensorSpec``, ``AUTOTUNE`` and ``F`` (the element functions below), so TensorFlow and md.data build the
same pipeline from the same text: a source (``from_tensor_slices`` of nested tuples and dicts of several dtypes
and shapes, ``range`` with negative steps, ``from_tensors``, ``from_generator`` of varying lengths, ``zip``,
``concatenate``), then 1-5 transformations chosen among those valid for the element structure the generator
tracks. ``order`` says how to compare the elements: ``"exact"``, or ``"multiset"`` after a final ``shuffle``
(its order is each library's RNG), ``"multiset-twice"`` when a ``shuffle(reshuffle_each_iteration=False)``
is repeated twice (both passes must then be in the same order).

``tf_functions(tf)`` and ``numpy_functions(np)`` are the element functions ``F`` of each side, written with the
same NumPy-like operations. Nothing here imports TensorFlow or mirrored.
"""

import random
from dataclasses import dataclass, field

MAX_ELEMENTS = 40  # the elements compared of a pipeline in order
MAX_SHUFFLED = 1000  # of one that ends in a shuffle (all of them: the generated pipelines are shorter)


# --- the element functions of each side ------------------------------------------------------------------------

def tf_functions(tf):
    class F:
        cast = staticmethod(lambda x, dtype: tf.cast(x, dtype))
        iota = staticmethod(lambda n: tf.range(n))  # 0..n-1, n's dtype
        total = staticmethod(lambda x: tf.reduce_sum(tf.cast(x, tf.float64)))
        key = staticmethod(lambda x: tf.cast(x, tf.int64) % 3)
        length = staticmethod(lambda x: tf.shape(x)[0])  # int32, as bucket_by_sequence_length wants

        @staticmethod
        def checked(x):  # 1 / (x - 3) as float32, an error where it is not finite
            return tf.debugging.check_numerics(1.0 / (tf.cast(x, tf.float32) - 3.0), "x == 3")
    return F


def numpy_functions(np):
    class F:
        cast = staticmethod(lambda x, dtype: np.asarray(x).astype(dtype)[()])
        iota = staticmethod(lambda n: np.arange(n, dtype=np.asarray(n).dtype))
        total = staticmethod(lambda x: np.sum(np.asarray(x, np.float64)))
        key = staticmethod(lambda x: np.int64(x) % 3)
        length = staticmethod(lambda x: np.int32(len(x)))

        @staticmethod
        def checked(x):
            with np.errstate(divide="ignore"):
                y = np.float32(1.0) / (np.float32(x) - np.float32(3.0))
            if not np.isfinite(y):
                raise ValueError("x == 3: Tensor had Inf values")
            return y
    return F


# --- what the generator knows of an element ---------------------------------------------------------------------

NUMERIC = ("int32", "int64", "float32", "float64", "uint8", "float16")
INTEGER = ("int32", "int64", "uint8")


@dataclass
class Leaf:
    dtype: str
    shape: tuple  # ints, None where unknown

    def numeric(self):
        return self.dtype in NUMERIC


@dataclass
class Node:
    kind: str  # "tuple" or "dict"
    items: dict = field(default_factory=dict)  # tuple: {0: ..., 1: ...}


def leaves(s, path=()):
    if isinstance(s, Leaf):
        yield path, s
    else:
        for k, v in s.items.items():
            yield from leaves(v, path + (k,))


def map_leaves(s, fn):
    return fn(s) if isinstance(s, Leaf) else Node(s.kind, {k: map_leaves(v, fn) for k, v in s.items.items()})


def signature(s):
    """(the parameters of a function taking the element, how its body names the whole element, the accessor of
    a path): TF passes a tuple's components as separate arguments."""
    if isinstance(s, Leaf):
        return "x", "x", lambda path: "x"
    if s.kind == "tuple":
        return "*t", "t", lambda path: "t" + "".join(f"[{p!r}]" for p in path)
    return "d", "d", lambda path: "d" + "".join(f"[{p!r}]" for p in path)


def numeric_leaf(s, rng, scalar=False):
    """(accessor path, leaf) of a random numeric leaf (a scalar one with ``scalar``), or None."""
    found = [(p, leaf) for p, leaf in leaves(s) if leaf.numeric() and (not scalar or leaf.shape == ())]
    return rng.choice(found) if found else None


# --- sources -----------------------------------------------------------------------------------------------------

DTYPES = NUMERIC + ("bool", "string")


def array_code(dtype, shape, offset):
    size = 1
    for d in shape:
        size *= d
    reshape = f".reshape({tuple(shape)!r})"
    if dtype == "string":
        words = [f"w{(i + offset) % 5}".encode() * (1 + (i + offset) % 3) for i in range(size)]
        return f"np.array({words!r}){reshape}"
    if dtype == "bool":
        return f"(np.arange({size}) % 3 == {offset % 3}){reshape}"
    if dtype == "uint8":
        return f"((np.arange({size}) * 37 + {offset}) % 256).astype('uint8'){reshape}"
    if dtype.startswith("float"):
        return f"(np.arange({size}) * 0.5 - {offset % 4}).astype('{dtype}'){reshape}"
    return f"(np.arange({size}) % 7 - {offset % 3}).astype('{dtype}'){reshape}"


def random_structure(rng, depth=0):
    roll = rng.random()
    if depth < 2 and roll < 0.2:
        return Node("tuple", {i: random_structure(rng, depth + 1) for i in range(rng.choice([2, 3]))})
    if depth < 2 and roll < 0.35:
        keys = rng.sample(["a", "b", "c", "len", "z"], rng.choice([1, 2, 3]))
        return Node("dict", {k: random_structure(rng, depth + 1) for k in sorted(keys)})
    return Leaf(rng.choice(DTYPES), rng.choice([(), (), (2,), (2, 3), (1,)]))


def structure_code(s, make):
    if isinstance(s, Leaf):
        return make(s)
    if s.kind == "tuple":
        return "(" + "".join(structure_code(v, make) + ", " for v in s.items.values()) + ")"
    return "{" + ", ".join(f"{k!r}: {structure_code(v, make)}" for k, v in s.items.items()) + "}"


def slices_source(rng, s=None, rows=None):
    s = s or random_structure(rng)
    rows = rows if rows is not None else rng.randint(0, 8)
    offset = rng.randint(0, 9)
    code = structure_code(s, lambda leaf: array_code(leaf.dtype, (rows,) + leaf.shape, offset))
    return f"D.from_tensor_slices({code})", s


def range_source(rng):
    start, stop = rng.randint(-6, 10), rng.randint(-6, 12)
    step = rng.choice([1, 2, 3, -1, -2, -3])
    dtype = rng.choice(["int64", "int64", "int32"])
    out = f", output_type=np.{dtype}" if dtype != "int64" else ""
    args = f"{stop}" if (start == 0 and step == 1 and rng.random() < 0.5) else f"{start}, {stop}, {step}"
    return f"D.range({args}{out})", Leaf(dtype, ())


def tensors_source(rng):
    s = random_structure(rng)
    offset = rng.randint(0, 9)
    return f"D.from_tensors({structure_code(s, lambda leaf: array_code(leaf.dtype, leaf.shape, offset))})", s


def generator_source(rng):
    lengths = [rng.randint(0, 6) for _ in range(rng.randint(1, 7))]
    dtype = rng.choice(["int64", "float32", "int32"])
    return (f"D.from_generator(lambda: (np.arange(n, dtype='{dtype}') for n in {lengths}), "
            f"output_signature=TensorSpec((None,), np.{dtype}))"), Leaf(dtype, (None,))


def zip_source(rng):
    (a, sa), (b, sb) = simple_source(rng), simple_source(rng)
    if rng.random() < 0.5:
        return f"D.zip({a}, {b})", Node("tuple", {0: sa, 1: sb})
    return f"D.zip({{'p': {a}, 'q': {b}}})", Node("dict", {"p": sa, "q": sb})


def concatenate_source(rng):
    """Two sources of the same structure and dtypes (trailing shapes may differ: the spec's dimension is None)."""
    if rng.random() < 0.4:
        (a, s), (b, t) = range_source(rng), range_source(rng)
        return f"{a}.concatenate({b if t.dtype == s.dtype else f'D.range(3, output_type=np.{s.dtype})'})", s
    a, s = slices_source(rng)
    other = map_leaves(s, lambda leaf: Leaf(leaf.dtype, rng.choice([leaf.shape, leaf.shape, (3,) + leaf.shape[1:]])
                                            if leaf.shape else ()))
    b, _ = slices_source(rng, other)
    return f"{a}.concatenate({b})", joined(s, other)


def joined(s, other):
    """The structure of ``s`` and ``other`` concatenated: a dimension that differs is unknown."""
    if isinstance(s, Leaf):
        return Leaf(s.dtype, tuple(x if x == y else None for x, y in zip(s.shape, other.shape)))
    return Node(s.kind, {k: joined(v, other.items[k]) for k, v in s.items.items()})


def simple_source(rng):
    return rng.choice([slices_source, slices_source, range_source, tensors_source, generator_source])(rng)


def source(rng):
    return rng.choice([slices_source, slices_source, slices_source, range_source, range_source, tensors_source,
                       generator_source, zip_source, concatenate_source])(rng)


# --- transformations: each returns (code, structure) or None when it does not apply ---------------------------

def typed_scalar(dtype, value):
    return f"b'{value}'" if dtype == "string" else f"np.{'bool_' if dtype == 'bool' else dtype}({value})"


def t_map(rng, s):
    params, whole, at = signature(s)
    choices = []
    if isinstance(s, Leaf):
        choices += [("(x, x)", Node("tuple", {0: s, 1: s})), ("{'v': x}", Node("dict", {"v": s}))]
        if s.numeric():
            choices += [("x * 2", s), ("x + 1", s), (f"F.cast(x, '{'float32' if s.dtype != 'float32' else 'int32'}')",
                                                    Leaf("float32" if s.dtype != "float32" else "int32", s.shape)),
                        ("x > 2", Leaf("bool", s.shape)),
                        ("{'v': x, 'w': F.cast(x, 'int64')}", Node("dict", {"v": s, "w": Leaf("int64", s.shape)}))]
            if not s.dtype.startswith("uint"):
                choices.append(("-x", s))
        if s.dtype in ("int32", "int64") and s.shape == ():
            choices.append(("F.iota(x % 4)", Leaf(s.dtype, (None,))))
    else:
        keys = list(s.items)
        k = rng.choice(keys)
        choices.append((at((k,)), s.items[k]))
        if s.kind == "tuple":
            choices.append(("t[::-1]", Node("tuple", dict(enumerate(reversed(list(s.items.values())))))))
            choices.append(("{'first': t[0], 'last': t[-1]}", Node("dict", {"first": s.items[keys[0]],
                                                                            "last": s.items[keys[-1]]})))
        else:
            choices.append((f"(d[{keys[-1]!r}], d[{keys[0]!r}])", Node("tuple", {0: s.items[keys[-1]],
                                                                                1: s.items[keys[0]]})))
        found = numeric_leaf(s, rng)
        if found:
            path, leaf = found
            choices.append((f"({whole}, F.total({at(path)}))", Node("tuple", {0: s, 1: Leaf("float64", ())})))
    body, out = rng.choice(choices)
    parallel = rng.choice(["", "", ", num_parallel_calls=2", ", num_parallel_calls=AUTOTUNE, deterministic=True"])
    return f".map(lambda {params}: {body}{parallel})", out


def t_filter(rng, s):
    found = numeric_leaf(s, rng)
    if not found:
        return None
    params, _, at = signature(s)
    path, leaf = found
    test = (f"{at(path)} % 2 == 0" if leaf.shape == () and leaf.dtype in INTEGER
            else f"{at(path)} > 1" if leaf.shape == () else f"F.total({at(path)}) > 3")
    return f".filter(lambda {params}: {test})", s


def batched(s, size, drop):
    return map_leaves(s, lambda leaf: Leaf(leaf.dtype, (size if drop else None,) + leaf.shape))


def t_batch(rng, s):
    size, drop = rng.randint(1, 4), rng.random() < 0.4
    parallel = rng.choice(["", "", ", num_parallel_calls=2"])
    return f".batch({size}{', drop_remainder=True' if drop else ''}{parallel})", batched(s, size, drop)


def t_padded_batch(rng, s):
    size, drop = rng.randint(1, 4), rng.random() < 0.4
    args = [str(size)]
    out = map_leaves(s, lambda leaf: Leaf(leaf.dtype, (size if drop else None,) + leaf.shape))
    if isinstance(s, Leaf) and len(s.shape) == 1 and rng.random() < 0.6:
        width = rng.choice([None, 8])
        args.append(f"padded_shapes=[{width}]")
        out = Leaf(s.dtype, (size if drop else None, width))
    if isinstance(s, Leaf) and rng.random() < 0.5:
        args.append(f"padding_values={typed_scalar(s.dtype, 'x' if s.dtype == 'string' else 1)}")
    if drop:
        args.append("drop_remainder=True")
    return f".padded_batch({', '.join(args)})", out


def t_unbatch(rng, s):
    if not all(leaf.shape for _, leaf in leaves(s)):
        return None
    return ".unbatch()", map_leaves(s, lambda leaf: Leaf(leaf.dtype, leaf.shape[1:]))


def t_rebatch(rng, s):
    if not all(leaf.shape for _, leaf in leaves(s)):
        return None
    size, drop = rng.randint(1, 4), rng.random() < 0.4
    return (f".rebatch({size}{', drop_remainder=True' if drop else ''})",
            map_leaves(s, lambda leaf: Leaf(leaf.dtype, (size if drop else None,) + leaf.shape[1:])))


def t_counts(rng, s):
    return rng.choice([f".repeat({rng.randint(0, 3)})", f".take({rng.randint(-1, 7)})", f".skip({rng.randint(-1, 5)})",
                       f".shard({rng.randint(1, 3)}, 0)", ".shard(3, 2)", f".repeat().take({rng.randint(0, 12)})",
                       ".cache()", ".prefetch(1)", ".prefetch(AUTOTUNE)"]), s


def t_window(rng, s):
    size, shift, stride = rng.randint(1, 4), rng.choice([None, 1, 2, 3]), rng.choice([1, 1, 2])
    drop = rng.random() < 0.4
    params = "*w" if isinstance(s, Node) and s.kind == "tuple" else "w"
    zipped = "w" if isinstance(s, Leaf) else "D.zip(w)"
    return (f".window({size}, shift={shift}, stride={stride}, drop_remainder={drop})"
            f".flat_map(lambda {params}: {zipped}.batch({size}))", batched(s, size, False))


def t_enumerate(rng, s):
    start = rng.choice([0, 0, 5, -2])
    return (".enumerate()" if start == 0 else f".enumerate({start})"), Node("tuple", {0: Leaf("int64", ()), 1: s})


def t_scan(rng, s):
    if not (isinstance(s, Leaf) and s.numeric() and s.shape == ()):
        return None
    return (f".scan({typed_scalar(s.dtype, 0)}, lambda state, x: (state + x, (state, x)))",
            Node("tuple", {0: s, 1: s}))


def t_group_by_window(rng, s):
    found = numeric_leaf(s, rng, scalar=True)
    if not found:
        return None
    params, _, at = signature(s)
    size = rng.randint(1, 3)
    return (f".group_by_window(lambda {params}: F.key({at(found[0])}), lambda key, w: w.batch({size}), {size})",
            batched(s, size, False))


def t_bucket(rng, s):
    if not (isinstance(s, Leaf) and len(s.shape) == 1):
        return None
    pad = rng.random() < 0.3
    drop = rng.random() < 0.3
    return (f".bucket_by_sequence_length(F.length, [2, 4], [2, 1, 3], pad_to_bucket_boundary={pad}, "
            f"drop_remainder={drop})", Leaf(s.dtype, (None, None)))


def t_interleave(rng, s):
    params, whole, at = signature(s)
    cycle, block = rng.randint(1, 3), rng.randint(1, 2)
    # (num_parallel_calls above cycle_length is an error, which the draw keeps now and then)
    parallel = rng.choice(["", f", num_parallel_calls={cycle}", f", num_parallel_calls={cycle}, deterministic=True",
                           ", num_parallel_calls=2"])
    found = numeric_leaf(s, rng, scalar=True)
    if found and rng.random() < 0.5:
        body, out = f"D.range(F.key({at(found[0])}) + 1)", Leaf("int64", ())
    else:
        body, out = f"D.from_tensors({whole}).repeat(2)", s
    return f".interleave(lambda {params}: {body}, cycle_length={cycle}, block_length={block}{parallel})", out


def t_flat_map(rng, s):
    if not (isinstance(s, Leaf) and s.shape):
        return None
    return ".flat_map(lambda x: D.from_tensor_slices(x))", Leaf(s.dtype, s.shape[1:])


def t_unique(rng, s):
    if not (isinstance(s, Leaf) and s.shape == () and s.dtype in ("int32", "int64", "string")):
        return None
    return ".unique()", s


def t_checked(rng, s):
    """A map that raises on some elements, then (mostly) ignore_errors."""
    if not (isinstance(s, Leaf) and s.numeric() and s.shape == ()):
        return None
    ignore = rng.choice([".ignore_errors()", ".ignore_errors()", ""])
    return f".map(F.checked){ignore}", Leaf("float32", ())


def t_take_while(rng, s):
    found = numeric_leaf(s, rng)
    if not found:
        return None
    params, _, at = signature(s)
    return f".take_while(lambda {params}: F.total({at(found[0])}) < {rng.randint(0, 8)})", s


def t_apply(rng, s):
    if rng.random() < 0.5:
        return f".apply(lambda ds: ds.concatenate(ds.take({rng.randint(0, 3)})))", s
    return ".apply(lambda ds: D.zip(ds, ds.skip(1)))", Node("tuple", {0: s, 1: s})


TRANSFORMATIONS = [t_map, t_map, t_filter, t_batch, t_batch, t_padded_batch, t_unbatch, t_rebatch, t_counts,
                   t_counts, t_window, t_enumerate, t_scan, t_group_by_window, t_bucket, t_interleave, t_flat_map,
                   t_unique, t_checked, t_take_while, t_apply]


def shuffle_tail(rng):
    """A final shuffle (its order is each library's RNG): (code, order)."""
    seed, buffer = rng.randint(0, 99), rng.choice([1, 2, 5, 100])
    if rng.random() < 0.4:
        return f".shuffle({buffer}, seed={seed}, reshuffle_each_iteration=False).repeat(2)", "multiset-twice"
    return f".shuffle({buffer}, seed={seed})", "multiset"


def pipeline(rng):
    code, s = source(rng)
    for _ in range(rng.randint(1, 5)):
        for _attempt in range(10):
            step = rng.choice(TRANSFORMATIONS)(rng, s)
            if step is not None:
                break
        part, s = step
        code += part
    if rng.random() < 0.15:
        tail, order = shuffle_tail(rng)
        return {"expr": code + tail, "order": order}
    return {"expr": code, "order": "exact"}


def pipelines(seed, count):
    """``count`` distinct pipelines drawn from ``seed``, in the order drawn."""
    rng = random.Random(seed)
    out = {}
    while len(out) < count:
        case = pipeline(rng)
        out.setdefault(case["expr"], case)
    return list(out.values())
