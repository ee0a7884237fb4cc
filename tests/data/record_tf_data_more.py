"""Record tf.data's answers for a wide audit of pipelines (tests/test_data_tf_parity_more.py replays them on md.data).

    /work/venvs/tf/bin/python tests/data/record_tf_data_more.py   # writes tests/data/tf_data_reference_more.json

Each case is an expression over ``D`` (the Dataset class), ``np``, ``AUTOTUNE``, ``TensorSpec``, ``P`` (a
namedtuple class), ``collections``, ``LEN`` (a sequence's length: ``tf.shape(x)[0]`` in TF), ``O`` (options
with deterministic / auto_shard_policy set) and ``OPTS`` (the options a dataset carries). A case that gives a dataset records its elements (values, dtypes,
shapes, the Python type of each leaf as ``as_numpy_iterator`` yields it, tuple/dict/namedtuple structure),
its element_spec, cardinality and ``len``; a case that gives anything else records that value; a case
that raises records the exception's class and message (construction and iteration alike).
"""

import collections
import itertools
import json
import os
import sys

import numpy as np

P = collections.namedtuple("P", ["x", "y"])
MAX_ELEMENTS = 30

GEN = "lambda: (np.arange(i) for i in range(1, 6))"
SIG = "output_signature=TensorSpec((None,), np.int64)"
RAGGED = f"D.from_generator({GEN}, {SIG})"
SEQS = ("D.from_generator(lambda: (np.arange(n) + 1 for n in [1, 5, 2, 7, 3, 3, 8, 1, 6, 2]), "
        "output_signature=TensorSpec((None,), np.int64))")
PAIRS = "D.from_tensor_slices((np.arange(6), np.arange(6) * 10))"
DICTS = "D.from_tensor_slices({'a': np.arange(5), 'b': np.arange(10.0).reshape(5, 2)})"

CASES = [
    # --- batch -------------------------------------------------------------------------------------
    "D.range(10).batch(1)", "D.range(10).batch(10)", "D.range(10).batch(11)", "D.range(10).batch(11, True)",
    "D.range(10).batch(4, drop_remainder=True).batch(2)", "D.range(10).batch(2).batch(2, True)",
    "D.range(0).batch(3)", "D.range(5).batch(np.int64(2))", "D.range(5).batch(2, num_parallel_calls=2)",
    f"{PAIRS}.batch(4)", f"{PAIRS}.batch(4, True)", f"{DICTS}.batch(2)", f"{DICTS}.batch(2, True)",
    "D.from_tensor_slices(P(np.arange(4), np.arange(4.0))).batch(3)",
    "D.from_tensor_slices(P(np.arange(4), np.arange(4.0)))",
    "D.from_tensor_slices(['a', 'bb', 'ccc']).batch(2)",
    "D.from_tensor_slices(np.zeros((5, 2, 3), np.float16)).batch(2)",
    "D.from_tensor_slices(np.array([True, False, True])).batch(2)",
    "D.range(5).repeat().batch(2)", "D.range(5).repeat().batch(2, True)",
    "D.range(10).filter(lambda x: x > 3).batch(2)", "D.range(10).filter(lambda x: x > 3).batch(2, True)",
    f"{RAGGED}.batch(2)", "D.range(3).batch(0)", "D.range(3).batch(-1)", "D.range(3).batch(2.0)",
    "D.from_tensors(np.arange(3)).batch(1)", "D.range(6).batch(3).unbatch()",
    "D.range(6).map(lambda x: (x, {'s': x * 2})).batch(4)",
    # --- padded_batch ------------------------------------------------------------------------------
    f"{RAGGED}.padded_batch(2, padded_shapes=[None])", f"{RAGGED}.padded_batch(2, padded_shapes=[-1])",
    f"{RAGGED}.padded_batch(2, padded_shapes=(7,), padding_values=np.int64(9), drop_remainder=True)",
    f"{RAGGED}.padded_batch(5)", f"{RAGGED}.padded_batch(2, padded_shapes=(3,))",
    f"{RAGGED}.padded_batch(2, padding_values=7)",
    f"D.zip({RAGGED}, {RAGGED}.map(lambda x: x * 2)).padded_batch(2, padding_values=(np.int64(-1), np.int64(5)))",
    f"D.zip({RAGGED}, {RAGGED}.map(lambda x: x * 2)).padded_batch(2, padded_shapes=([None], [6]))",
    f"D.zip({{'i': {RAGGED}, 'n': D.range(5, output_type=np.int32)}}).padded_batch(3)",
    f"D.zip({{'i': {RAGGED}, 'n': D.range(5, output_type=np.int32)}}).padded_batch(3, padding_values={{'i': np.int64(-5), 'n': np.int32(0)}})",
    f"D.zip({RAGGED}, {RAGGED}).padded_batch(2, padding_values=np.int64(3))",
    "D.range(5).padded_batch(2)", "D.range(5).padded_batch(2, padded_shapes=[])",
    "D.from_tensor_slices(['a', 'bb', 'ccc']).padded_batch(2, padding_values='?')",
    "D.from_tensor_slices(np.arange(12).reshape(6, 2)).padded_batch(4, padded_shapes=[5])",
    "D.from_generator(lambda: (np.ones((i, 4 - i), np.float32) for i in range(1, 4)), "
    "output_signature=TensorSpec((None, None), np.float32)).padded_batch(3)",
    f"{RAGGED}.padded_batch(2, padded_shapes=(2,))", f"{RAGGED}.padded_batch(0)",
    f"{RAGGED}.padded_batch(2, padded_shapes=(None, None))",
    f"{RAGGED}.padded_batch(2).padded_batch(2)",
    # --- map ---------------------------------------------------------------------------------------
    "D.range(4).map(lambda x: 1)", "D.range(4).map(lambda x: 1.5)", "D.range(4).map(lambda x: True)",
    "D.range(4).map(lambda x: 'str')", "D.range(4).map(lambda x: b'bytes')", "D.range(4).map(lambda x: 2**40)",
    "D.range(4).map(lambda x: [1, 2])", "D.range(4).map(lambda x: [x, 1.5])", "D.range(4).map(lambda x: (1, 2.5))",
    "D.range(4).map(lambda x: {'a': 1, 'b': [x, x]})", "D.range(4).map(lambda x: None)",
    "D.range(4).map(lambda x: (x,))", "D.range(4).map(lambda x: ((x, x), x))",
    "D.range(4).map(lambda x: P(x, x * 2))", "D.range(4).map(lambda x: P(x, x * 2)).map(lambda a, b: a + b)",
    "D.range(4).map(lambda x: P(x, x * 2)).batch(2)",
    f"{PAIRS}.map(lambda a, b: (b, a))", f"{PAIRS}.map(lambda *t: len(t))", f"{PAIRS}.map(lambda t: t)",
    f"{DICTS}.map(lambda d: d['a'] + 1)", f"{DICTS}.map(lambda d: sorted(d))",
    "D.from_tensor_slices([[1, 2], [3, 4]]).map(lambda row: row)",
    "D.from_tensor_slices(([1, 2], [3, 4])).map(lambda a, b: a * b)",
    "D.range(4).map(lambda x: x / 2)", "D.range(4).map(lambda x: x // 2)", "D.range(4).map(lambda x: -x)",
    "D.range(4).map(lambda x: np.arange(3) + x)", "D.range(4).map(lambda x: np.zeros((0, 2)))",
    "D.range(4).map(lambda x: x > 1)",
    "D.range(6).map(lambda x: x * 3, num_parallel_calls=2)",
    "D.range(6).map(lambda x: x * 3, num_parallel_calls=AUTOTUNE, deterministic=True)",
    "D.range(6).map(lambda x: x * 3, num_parallel_calls=0)", "D.range(6).map(lambda x: x * 3, num_parallel_calls=-2)",
    "D.range(4).map(lambda x: (x, x)).map(lambda a, b: a * b)",
    "D.range(4).map(lambda x, y: x)", "D.range(4).map(42)",
    "D.range(4).map(lambda x: {'a': x}).map(lambda d: (d['a'], d))",
    # --- filter ------------------------------------------------------------------------------------
    "D.range(8).filter(lambda x: x % 2 == 0)",
    "D.range(8).filter(lambda x: True)", "D.range(8).filter(lambda x: False)",
    "D.range(8).filter(lambda x: np.array([True, False]))", "D.range(8).filter(lambda x: 1)",
    f"{PAIRS}.filter(lambda a, b: b > 20)", f"{DICTS}.filter(lambda d: d['a'] % 2 == 1)",
    "int(D.range(8).filter(lambda x: x > 2).cardinality())", "D.range(8).filter(lambda x: 'yes')",
    # --- repeat / take / skip ----------------------------------------------------------------------
    "D.range(3).repeat(-1).take(7)", "D.range(3).repeat(-5).take(7)", "D.range(3).repeat(1)",
    "D.range(3).take(0)", "D.range(3).skip(0)", "D.range(3).skip(-3)",
    "D.range(3).repeat().skip(2).take(4)", "D.range(3).repeat().skip(-1)",
    "int(D.range(3).repeat().take(-1).cardinality())", "D.range(0).repeat()", "D.range(3).repeat(2).repeat(2)",
    "D.range(5).filter(lambda x: x < 3).take(2)", "D.range(5).filter(lambda x: x < 3).skip(1)",
    "D.range(5).filter(lambda x: x < 3).repeat(2)", "D.range(5).filter(lambda x: x < 3).repeat(0)",
    "D.range(5).filter(lambda x: x < 3).take(0)", "D.range(5).repeat().filter(lambda x: x < 3).take(4)",
    "D.range(5).take(2.0)", "D.range(5).repeat(2.0)", "D.range(5).take(np.int64(2))",
    # --- shard -------------------------------------------------------------------------------------
    "D.range(10).shard(3, 3)", "D.range(10).shard(3, -1)", "D.range(10).shard(0, 0)", "D.range(2).shard(5, 3)",
    "D.range(10).repeat().shard(3, 1).take(4)", "D.range(10).filter(lambda x: x > 0).shard(2, 0)",
    # --- concatenate / zip -------------------------------------------------------------------------
    "D.range(3).concatenate(D.range(3).map(lambda x: (x, x)))",
    "D.range(3).concatenate(D.range(3, output_type=np.float32))",
    "D.range(3).concatenate(D.range(3, output_type=np.int32))",
    "D.from_tensor_slices(np.zeros((2, 3))).concatenate(D.from_tensor_slices(np.ones((2, 4))))",
    "D.from_tensor_slices(np.zeros((2, 3))).concatenate(D.from_tensor_slices(np.ones((2, 3, 1))))",
    "D.range(3).map(lambda x: {'a': x}).concatenate(D.range(2).map(lambda x: {'a': x}))",
    "D.range(3).map(lambda x: {'a': x}).concatenate(D.range(2).map(lambda x: {'b': x}))",
    "D.range(3).repeat().concatenate(D.range(2)).take(4)", "D.range(3).concatenate(D.range(2).repeat()).take(6)",
    "D.range(2).concatenate(D.range(2).filter(lambda x: True))",
    "D.zip(D.range(3), D.range(5).repeat())", "D.zip(D.range(3).repeat(), D.range(5).repeat()).take(2)",
    "D.zip((D.range(3),))", "D.zip(D.range(3))", "D.zip(datasets=(D.range(2), D.range(3)))",
    "D.zip(D.range(4), D.range(4).filter(lambda x: x > 1))",
    "D.zip(P(D.range(3), D.range(3)))", "D.zip((D.range(3), [1, 2]))", "D.zip()",
    "D.zip((D.range(2), (D.range(2), {'k': D.range(2)})))",
    # --- enumerate / range -------------------------------------------------------------------------
    "D.range(3).enumerate(-2)", "D.range(3).enumerate(np.int64(3))", "D.range(3).repeat().enumerate().take(2)",
    f"{PAIRS}.enumerate()", "D.range(5, output_type=np.int32)", "D.range(5, output_type=np.float32)",
    "D.range(1, 5, 2, output_type=np.int32).batch(2)", "D.range(-3)", "D.range(3, 1)", "D.range(5, 1, -1)",
    "D.range(1, 2, 0)", "D.range(1.0)", "D.range()", "D.range(1, 2, 3, 4)", "D.range(np.int32(4))",
    "D.range(2**40, 2**40 + 2)",
    # --- from_tensor_slices ------------------------------------------------------------------------
    "D.from_tensor_slices([1, 2, 3])", "D.from_tensor_slices([1.0, 2.0])", "D.from_tensor_slices([True, False])",
    "D.from_tensor_slices([b'x', b'y'])", "D.from_tensor_slices([[1.5], [2.5]])", "D.from_tensor_slices([1, 2.5])",
    "D.from_tensor_slices([2**40, 1])", "D.from_tensor_slices(np.arange(3, dtype=np.uint8))",
    "D.from_tensor_slices(np.array(['a', 'bc']))", "D.from_tensor_slices(np.array([b'a', b'bc']))",
    "D.from_tensor_slices([[1, 2], [3]])", "D.from_tensor_slices(5)", "D.from_tensor_slices(np.float32(5))",
    "D.from_tensor_slices((np.arange(3), np.arange(4)))", "D.from_tensor_slices({'a': [1, 2], 'b': [1, 2, 3]})",
    "D.from_tensor_slices(([1, 2], 3))", "D.from_tensor_slices(np.zeros((0, 3)))", "D.from_tensor_slices([])",
    "D.from_tensor_slices(([1, 2], ([3, 4], {'z': ['a', 'b']})))", "D.from_tensor_slices({'b': [1], 'a': [2.0]})",
    "D.from_tensor_slices(collections.OrderedDict([('b', [1]), ('a', [2.0])]))",
    "D.from_tensor_slices(np.arange(6).reshape(3, 2).T)", "D.from_tensor_slices(np.float64([1, 2]))",
    "D.from_tensor_slices(None)", "D.from_tensor_slices(np.complex64([1 + 2j]))",
    # --- from_tensors ------------------------------------------------------------------------------
    "D.from_tensors(5)", "D.from_tensors(5.0)", "D.from_tensors('s')", "D.from_tensors(b's')",
    "D.from_tensors([1, 2])", "D.from_tensors([[1.0], [2.0]])", "D.from_tensors(True)",
    "D.from_tensors((1, 'a', {'k': [1.5, 2.5]}))", "D.from_tensors(P(1, 2.0))", "D.from_tensors({'z': 1, 'a': 2})",
    "D.from_tensors(np.zeros((2, 0)))", "D.from_tensors(np.int8(3)).repeat(2)", "D.from_tensors(5).repeat().take(3)",
    "D.from_tensors([[1, 2], [3]])", "D.from_tensors(None)", "D.from_tensors(())",
    # --- from_generator ----------------------------------------------------------------------------
    "D.from_generator(lambda: iter([1, 2, 3]), output_types=np.int64)",
    "D.from_generator(lambda: iter([1, 2, 3]), output_types=np.int32, output_shapes=())",
    "D.from_generator(lambda: iter([[1, 2], [3, 4]]), output_types=np.float32, output_shapes=(2,))",
    "D.from_generator(lambda: iter([(1, 'a'), (2, 'b')]), output_types=(np.int64, np.str_))",
    "D.from_generator(lambda: iter([(1, 'a'), (2, 'b')]), output_signature=(TensorSpec((), np.int64), TensorSpec((), np.bytes_)))",
    "D.from_generator(lambda: iter([{'a': 1}, {'a': 2}]), output_signature={'a': TensorSpec((), np.int32)})",
    "D.from_generator(lambda n: iter(range(n)), output_signature=TensorSpec((), np.int64), args=(4,))",
    "D.from_generator(lambda n, m: iter(range(n, m)), output_signature=TensorSpec((), np.int64), args=(2, 5))",
    "D.from_generator(lambda: iter([1, 2]), output_signature=TensorSpec((), np.float32))",
    "D.from_generator(lambda: iter([1.5]), output_signature=TensorSpec((), np.int64))",
    "D.from_generator(lambda: iter([[1, 2]]), output_signature=TensorSpec((3,), np.int64))",
    "D.from_generator(lambda: iter([[1, 2]]), output_signature=TensorSpec((), np.int64))",
    "D.from_generator(lambda: iter([(1, 2)]), output_signature=TensorSpec((), np.int64))",
    "D.from_generator(lambda: iter([1]), output_signature=(TensorSpec((), np.int64), TensorSpec((), np.int64)))",
    "D.from_generator(lambda: iter([1, 2, 3]), output_signature=TensorSpec((), np.int64)).batch(2)",
    "D.from_generator(lambda: iter([1, 2, 3]), output_signature=TensorSpec((), np.int64)).repeat(2)",
    "D.from_generator(lambda: iter([]), output_signature=TensorSpec((), np.int64))",
    "D.from_generator(lambda: iter([np.arange(2), np.arange(2)]), output_types=np.int64).batch(2)",
    "D.from_generator(lambda: iter([1, 2]), output_types=np.int64, output_signature=TensorSpec((), np.int64))",
    "D.from_generator(lambda: iter([1]))", "D.from_generator(iter([1, 2]), output_types=np.int64)",
    "D.from_generator(lambda: iter([P(1, 2)]), output_signature=P(TensorSpec((), np.int64), TensorSpec((), np.int64)))",
    "D.from_generator(lambda: iter([[1, 2]]), output_signature=(TensorSpec((), np.int64), TensorSpec((), np.int64)))",
    # --- unbatch -----------------------------------------------------------------------------------
    "D.range(3).unbatch()", f"{PAIRS}.unbatch()", "D.from_tensors(np.arange(6).reshape(2, 3)).unbatch()",
    "D.from_tensors((np.arange(2), np.arange(3))).unbatch()", f"{RAGGED}.unbatch()",
    "int(D.range(7).batch(3).unbatch().cardinality())", "D.from_tensors(np.zeros((0, 2))).unbatch()",
    # --- cache / prefetch / interleave / flat_map --------------------------------------------------
    "D.range(4).cache().cache()", "D.range(4).map(lambda x: x + 1).cache().repeat(3)", "D.range(4).prefetch(0)",
    "D.range(4).prefetch(-2)", "D.range(4).prefetch(1).prefetch(1)", "D.range(4).repeat().prefetch(2).take(6)",
    "D.range(4).interleave(lambda x: D.range(x), cycle_length=1)",
    "D.range(4).interleave(lambda x: D.range(x), cycle_length=4, block_length=3)",
    "D.range(1, 4).interleave(lambda x: D.from_tensors(x).repeat(x), cycle_length=2, block_length=1)",
    "D.range(6).interleave(lambda x: D.range(x, x + 2), cycle_length=2, num_parallel_calls=2)",
    "D.range(4).interleave(lambda x: D.range(2).map(lambda y: (x, y)), cycle_length=2)",
    f"{PAIRS}.interleave(lambda a, b: D.from_tensors(a + b), cycle_length=2)",
    "D.range(4).interleave(lambda x: x, cycle_length=2)", "D.range(4).interleave(lambda x: D.range(x), cycle_length=0)",
    "D.range(4).interleave(lambda x: D.range(x), cycle_length=2, block_length=0)",
    "D.range(3).flat_map(lambda x: D.from_tensor_slices([x, x * 10]))",
    "D.range(3).flat_map(lambda x: D.range(0))", f"{PAIRS}.flat_map(lambda a, b: D.from_tensors((b, a)))",
    "D.range(3).flat_map(lambda x: x)",
    "D.range(3).flat_map(lambda x: D.from_tensors({'v': x}).repeat(2))",
    # --- reduce ------------------------------------------------------------------------------------
    "D.range(5).reduce(np.int64(0), lambda s, x: s + x)", "D.range(5).reduce(0, lambda s, x: s + x)",
    "D.range(0).reduce(np.int64(7), lambda s, x: s + x)",
    "D.range(5).reduce((np.int64(0), np.int64(1)), lambda s, x: (s[0] + x, s[1] * (x + 1)))",
    f"{PAIRS}.reduce(np.int64(0), lambda s, e: s + e[0] * e[1])",
    "D.range(4).reduce({'n': np.int64(0)}, lambda s, x: {'n': s['n'] + 1})",
    "D.range(4).batch(2).reduce(np.zeros(2, np.int64), lambda s, x: s + x)",
    # --- len / cardinality / options ---------------------------------------------------------------
    "len(D.range(7))", "len(D.range(7).repeat())", "len(D.range(7).filter(lambda x: True))",
    "len(D.range(7).batch(2))", "int(D.range(7).repeat().cardinality())",
    "int(D.range(7).filter(lambda x: True).repeat().cardinality())", "int(D.range(7).repeat().filter(lambda x: True).cardinality())",
    "int(D.range(7).repeat().batch(2).cardinality())", "int(D.range(7).repeat().take(3).repeat(2).cardinality())",
    "int(D.range(7).filter(lambda x: True).take(0).cardinality())", "int(D.range(0).repeat().cardinality())",
    "int(D.range(7).repeat().skip(3).cardinality())", "int(D.range(7).filter(lambda x: True).skip(-1).cardinality())",
    "int(D.range(7).repeat().shard(2, 0).cardinality())",
    "int(D.range(7).repeat().map(lambda x: x).prefetch(1).cache().cardinality())",
    "int(D.range(7).interleave(lambda x: D.range(2), cycle_length=2).cardinality())",
    "int(D.range(7).flat_map(lambda x: D.range(2)).cardinality())",
    "D.range(4).apply(lambda ds: ds.map(lambda x: x * 2))",
    "type(D.range(3).as_numpy_iterator()).__name__ != 'list'",
    "list(D.from_tensor_slices(['a', 'b']).as_numpy_iterator())",
    "[type(x).__name__ for x in D.from_tensor_slices(['a', 'b']).as_numpy_iterator()]",
    "[type(x).__name__ for x in D.range(2).as_numpy_iterator()]",
    "[type(x).__name__ for x in D.from_tensors(np.arange(2)).as_numpy_iterator()]",
    # --- methods md.data may add -------------------------------------------------------------------
    "D.range(10).take_while(lambda x: x < 4)", "D.range(10).take_while(lambda x: x > 4)",
    f"{PAIRS}.take_while(lambda a, b: b < 35)", "D.range(10).repeat().take_while(lambda x: x < 3)",
    "D.range(3).take_while(lambda x: np.array([True]))",
    "D.from_tensors(3).get_single_element()", "D.from_tensors((1, 'a')).get_single_element()",
    "D.range(2).get_single_element()", "D.range(0).get_single_element()",
    "D.range(5).get_single_element()",
    "D.counter().take(3)", "D.counter(5, 2).take(3)", "D.counter(10, -3, dtype=np.int32).take(3)",
    "int(D.counter().cardinality())",
    "D.from_tensor_slices([1, 2, 1, 3, 2, 2]).unique()", "D.from_tensor_slices(['a', 'b', 'a']).unique()",
    "D.range(3).repeat(2).unique()", "D.from_tensor_slices([1.0, 2.0]).unique()",
    "D.from_tensor_slices(([1, 2], [3, 4])).unique()",
    "D.range(5).scan(np.int64(0), lambda s, x: (s + x, s * 10 + x))",
    "D.range(5).scan((np.int64(0), np.int64(1)), lambda s, x: ((s[0] + x, s[1]), {'sum': s[0] + x}))",
    "D.range(4).scan(np.int64(0), lambda s, x: (s + 1, (x, s)))",
    "D.range(5).repeat().scan(np.int64(0), lambda s, x: (s + x, s)).take(4)",
    "D.range(4).scan(0, lambda s, x: (s + 1, s))",
    "D.sample_from_datasets([D.range(3), D.range(10, 13)], weights=[1.0, 0.0], seed=1)",
    "D.sample_from_datasets([D.range(3), D.range(10, 13)], weights=[0.0, 1.0], seed=1)",
    "D.sample_from_datasets([D.range(3), D.range(10, 13)], weights=[0.0, 1.0], stop_on_empty_dataset=True, seed=1)",
    "D.sample_from_datasets([D.range(3), D.range(3, output_type=np.float32)])",
    "D.choose_from_datasets([D.range(3), D.range(10, 13)], D.from_tensor_slices(np.int64([0, 1, 1, 0, 0])))",
    "D.choose_from_datasets([D.range(3), D.range(10, 13)], D.from_tensor_slices(np.int64([0, 0, 0, 0, 1])))",
    "D.choose_from_datasets([D.range(3), D.range(10, 13)], D.from_tensor_slices(np.int64([0, 0, 0, 0, 1])), "
    "stop_on_empty_dataset=False)",
    "D.choose_from_datasets([D.range(3), D.range(10, 13)], D.from_tensor_slices(np.int32([0, 1])))",
    "D.choose_from_datasets([D.range(3), D.range(10, 13)], D.from_tensor_slices(np.int64([0, 2])))",
    "int(D.choose_from_datasets([D.range(3), D.range(10, 13)], D.range(2).repeat()).cardinality())",
    "D.choose_from_datasets([], D.range(2))",
    "D.range(6).rebatch(4)", "D.range(10).batch(4).rebatch(3)", "D.range(10).batch(4).rebatch(3, drop_remainder=True)",
    "D.range(10).batch(4, True).rebatch(2)", "D.range(10).batch(4).rebatch([1, 2])",
    "int(D.sample_from_datasets([D.range(3), D.range(10, 14)], seed=3).cardinality())",
    "int(D.sample_from_datasets([D.range(3), D.range(10, 14)], stop_on_empty_dataset=True).cardinality())",
    "int(D.sample_from_datasets([D.range(3), D.range(10, 14).repeat()]).cardinality())",
    "sorted(int(x) for x in D.sample_from_datasets([D.range(3), D.range(10, 14)], [0.3, 0.7], seed=3).as_numpy_iterator())",
    "D.sample_from_datasets([D.range(3), D.range(3)], weights=[0.5])",
    "D.sample_from_datasets([D.range(3).map(lambda x: {'a': x}), D.range(3)])",
    "D.sample_from_datasets([])",
    "D.sample_from_datasets([D.from_tensors(np.zeros(2)), D.from_tensors(np.zeros(3))], weights=[1.0, 0.0])",
    "int(D.range(3).ignore_errors().cardinality())", "D.range(3).ignore_errors()",
    "int(D.range(3).repeat().ignore_errors().cardinality())",
    "int(D.range(3).batch(2).repeat().rebatch(2).cardinality())",
    "int(D.range(3).repeat().unique().cardinality())", "int(D.range(3).repeat().take_while(lambda x: True).cardinality())",
    "D.range(3).take_while(lambda x: 1)", "D.range(3).map(lambda x: {'k': x}).take_while(lambda d: d['k'] < 2)",
    "D.from_tensors({'a': [1, 2]}).get_single_element()",
    "D.counter(dtype=np.int32).take(2)", "D.counter(start=-1, step=0).take(2)",
    "D.range(4).scan(np.int64(0), lambda s, x: s)", "D.range(4).scan(np.int64(0), lambda s, x: (1.5, x))",
    f"{PAIRS}.scan(np.int64(0), lambda s, e: (s + e[1], e[0] - s))",
    # window: the spec and cardinality of the windows, and their contents through flat_map
    "D.range(7).window(3)", "D.range(7).window(3, 2)", "D.range(7).window(3, 2, drop_remainder=True)",
    "D.range(7).window(2, 1, 2)", "D.range(7).window(3, 5)", "D.range(7).window(2, 1, 3, True)",
    "int(D.range(7).filter(lambda x: True).window(3).cardinality())", "int(D.range(7).repeat().window(3).cardinality())",
    "int(D.range(7).repeat().window(3, drop_remainder=True).cardinality())", "D.range(0).window(2)",
    "D.range(7).window(3).flat_map(lambda w: w.batch(3))",
    "D.range(7).window(3, 1, drop_remainder=True).flat_map(lambda w: w.batch(3))",
    "D.range(10).window(4, 3, 2).flat_map(lambda w: w.batch(4))", "D.range(10).window(2, 5).flat_map(lambda w: w)",
    "D.range(5).repeat().window(3, 2).take(3).flat_map(lambda w: w.batch(3))",
    f"{PAIRS}.window(4, 2).flat_map(lambda a, b: D.zip(a.batch(4), b.batch(4)))",
    f"{DICTS}.window(2).flat_map(lambda d: D.zip(d['a'].batch(2), d['b'].batch(2)))",
    "D.range(7).window(0)", "D.range(7).window(2, 0)", "D.range(7).window(2, 1, 0)", "D.range(7).window(2.0)",
    # more of what tutorials do daily
    "D.from_tensor_slices({'x': np.arange(6.0).reshape(3, 2), 'y': ['a', 'b', 'c']}).map(lambda d: (d['x'], d['y']))",
    "D.from_tensor_slices({'x': np.arange(6.0).reshape(3, 2), 'y': ['a', 'b', 'c']}).batch(2)",
    "int(D.from_tensor_slices((np.arange(6.0, dtype=np.float32).reshape(3, 2), np.int64([0, 1, 0]))).shuffle(3, seed=1).batch(2).map(lambda x, y: (x * 2, y)).cardinality())",
    "D.from_tensor_slices([np.arange(2), np.arange(2) + 5])", "D.from_tensor_slices([np.float32(1), np.float32(2)])",
    "D.from_tensors(np.str_('s'))", "D.from_tensors(['a', 'bc'])",
    "D.from_tensor_slices([['a', 'b'], ['c', 'd']])", "D.from_tensor_slices(np.array([1.5, 2.5], np.float16))",
    "D.range(4).map(lambda x: (x, [x, x]))", "D.range(4).map(lambda x: [[x, x], [x, x]])",
    "D.range(4).map(lambda x: {'a': [1.5, 2.5]})", "D.range(4).map(lambda x: [])",
    "D.range(4).map(lambda x: 'a').batch(2)", "D.range(4).map(lambda x: (x, 'a')).padded_batch(3)",
    "D.range(3).map(lambda x: {'b': x, 'a': x * 2}).batch(2).unbatch()",
    "D.range(6).batch(2).map(lambda x: x[::-1])", "D.range(6).batch(3, drop_remainder=True).map(lambda x: x + 1)",
    "int(D.range(6).map(lambda x: x * 2, num_parallel_calls=AUTOTUNE, deterministic=False).cardinality())",
    "D.range(8).interleave(lambda x: D.range(x, x + 2), cycle_length=3, block_length=2, num_parallel_calls=AUTOTUNE, deterministic=True)",
    "D.range(3).interleave(lambda x: D.range(2).map(lambda y: {'x': x, 'y': y}), cycle_length=2)",
    "int(D.range(4).shuffle(4, seed=2, reshuffle_each_iteration=False).cardinality())",
    "D.range(4).cache('').take(2)",
    "D.range(10).shard(3, 0).batch(2)", "D.range(10).batch(3).shard(2, 1)",
    "D.range(5).enumerate().filter(lambda i, x: i % 2 == 0)", "D.range(5).enumerate().map(lambda i, x: i + x)",
    "D.zip(D.range(3), D.from_tensor_slices(['a', 'b', 'c'])).batch(2)",
    "D.zip(D.range(4).batch(2), D.range(4).batch(2, True))", "D.zip({'a': D.range(3), 'b': (D.range(3), D.range(3))}).batch(3)",
    "D.range(6).repeat(2).batch(5).unbatch().take(7)", "D.range(3).concatenate(D.range(3)).concatenate(D.range(1))",
    "D.range(3).skip(1).take(1).repeat(3)", "D.range(5).take(3).skip(1)", "D.range(5).skip(2).enumerate()",
    "D.range(3).batch(2).padded_batch(2)", "D.from_tensor_slices(np.zeros((4, 0))).batch(2)",
    "D.range(4).map(lambda x: np.zeros((2, 3), np.float32)).batch(2).unbatch().unbatch()",
    "D.range(6).filter(lambda x: x % 2 == 0).map(lambda x: x // 2).reduce(np.int64(0), lambda s, x: s + x)",
    "D.range(4).reduce(np.float64(0), lambda s, x: s + x / 2)", "D.range(4).reduce((), lambda s, x: s)",
    "D.range(3).map(lambda x: (x, x)).reduce(np.int64(0), lambda s, e: s + e[0])",
    "D.from_tensors(1).concatenate(D.from_tensors(2.0))", "D.from_tensors(np.int64(1)).concatenate(D.from_tensors(2))",
    "D.from_tensors(np.zeros((2, 3))).concatenate(D.from_tensors(np.zeros((2, 4))))",
    "D.range(10).group_by_window(lambda x: x % 3, lambda k, w: w.batch(2), window_size=2)",
    "D.range(10).group_by_window(lambda x: x % 3, lambda k, w: w.batch(4), window_size=4)",
    "D.range(20).group_by_window(lambda x: (x * 7) % 5, lambda k, w: w.batch(10), window_size=10)",
    "D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.map(lambda v: (k, v)), window_size=3)",
    "D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.batch(5), window_size_func=lambda k: k + 2)",
    "D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.batch(2))",
    "D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.batch(2), window_size=2, window_size_func=lambda k: k)",
    "D.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.batch(2), window_size=0)",
    "D.range(10).group_by_window(lambda x: x % 2, lambda k, w: k, window_size=2)",
    f"{PAIRS}.group_by_window(lambda a, b: a % 2, lambda k, w: w.batch(3), window_size=3)",
    "D.range(10).group_by_window(lambda x: 9 - x, lambda k, w: w, window_size=5)",
    "D.range(12).repeat().group_by_window(lambda x: x % 3, lambda k, w: w.batch(4), window_size=4).take(5)",
    f"{SEQS}.bucket_by_sequence_length(LEN, [3, 6], [2, 2, 2])",
    f"{SEQS}.bucket_by_sequence_length(LEN, [3, 6], [2, 2, 2], pad_to_bucket_boundary=True)",
    f"{SEQS}.bucket_by_sequence_length(LEN, [3, 6, 10], [2, 2, 2, 2], pad_to_bucket_boundary=True)",
    f"{SEQS}.bucket_by_sequence_length(LEN, [4], [3, 2], drop_remainder=True)",
    f"{SEQS}.bucket_by_sequence_length(LEN, [4], [3, 2], padding_values=np.int64(-1))",
    f"{SEQS}.bucket_by_sequence_length(LEN, [4], [3])",
    f"{SEQS}.bucket_by_sequence_length(LEN, [4], [3, 2], padded_shapes=[9])",
    f"D.zip({SEQS}, D.range(10)).bucket_by_sequence_length(lambda x, i: LEN(x), [4], [3, 2])",
    f"{SEQS}.map(lambda x: x[:1]).bucket_by_sequence_length(lambda x: np.int64(1), [4], [3, 2], no_padding=True)",
    "int(D.random(seed=1).cardinality())", "D.random(seed=1).take(0)", "D.random(seed=1.5)",
    "OPTS(D.range(3).with_options(O(False)).map(lambda x: x).with_options(O(None, 'DATA')))",
    "OPTS(D.range(3).with_options(O(False)).with_options(O(True)))",
    "OPTS(D.range(3).with_options(O(False, 'FILE')).with_options(O(None, 'OFF')).batch(2))",
    "OPTS(D.zip(D.range(2).with_options(O(False)), D.range(2).with_options(O(None, 'DATA'))))",
    "OPTS(D.range(2).with_options(O(True)).concatenate(D.range(2).with_options(O(False))))",
    "OPTS(D.range(2))", "OPTS(D.range(2).with_options(O(False)).take(1).repeat(2).shuffle(2).prefetch(1))",
    "D.range(3).options().deterministic", "int(D.range(3).apply(lambda ds: ds.batch(2)).cardinality())",
]


def leaf(value):
    kind = ("ndarray" if isinstance(value, np.ndarray) else "bytes" if isinstance(value, bytes)
            else "generic" if isinstance(value, np.generic) else type(value).__name__)
    arr = np.asarray(value)
    dtype = "string" if arr.dtype.kind in "SO" else arr.dtype.name
    return {"kind": kind, "dtype": dtype, "shape": list(arr.shape), "value": _plain(arr.tolist())}


def _plain(x):
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, bytes):
        return x.decode("latin-1")
    if isinstance(x, float) and x != x:
        return "nan"
    if isinstance(x, complex):
        return [x.real, x.imag]
    return x


def canonical(value):
    """A JSON form of one element: structure kinds kept (tuple, namedtuple with its fields, dict)."""
    if isinstance(value, dict):
        return {"dict": [[str(k), canonical(v)] for k, v in sorted(value.items())]}
    if isinstance(value, tuple):
        items = [canonical(v) for v in value]
        return {"namedtuple": [list(value._fields), items]} if hasattr(value, "_fields") else {"tuple": items}
    if isinstance(value, list):
        return {"list": [canonical(v) for v in value]}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return {"python": [type(value).__name__, _plain(value)]}
    return leaf(value)


def canonical_spec(spec, shape_of, dtype_of):
    if hasattr(spec, "element_spec"):  # a dataset component (window)
        return {"dataset": canonical_spec(spec.element_spec, shape_of, dtype_of)}
    if isinstance(spec, dict):
        return {"dict": [[str(k), canonical_spec(v, shape_of, dtype_of)] for k, v in sorted(spec.items())]}
    if isinstance(spec, tuple):
        items = [canonical_spec(v, shape_of, dtype_of) for v in spec]
        return {"namedtuple": [list(spec._fields), items]} if hasattr(spec, "_fields") else {"tuple": items}
    return [shape_of(spec), dtype_of(spec)]


def options_maker(options_class, policy_class):
    """``O(deterministic, policy_name)``: an Options object with those set (None: left unset)."""
    def make(deterministic=None, policy=None):
        options = options_class()
        if deterministic is not None:
            options.deterministic = deterministic
        if policy is not None:
            options.experimental_distribute.auto_shard_policy = getattr(policy_class, policy)
        return options
    return make


def options_seen(dataset):
    """``OPTS(ds)``: the options a pipeline carries, as (deterministic, auto_shard_policy name)."""
    options = dataset.options()
    return (options.deterministic, options.experimental_distribute.auto_shard_policy.name)


def _numpy(value):
    """TF's eager tensors (of reduce, get_single_element) as as_numpy_iterator gives them."""
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [_numpy(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value.numpy() if hasattr(value, "numpy") else value


def record(case, env, dataset_type):
    try:
        result = eval(case, env)
        if not isinstance(result, dataset_type):
            return {"value": canonical(_numpy(result))}
        out = {"spec": canonical_spec(result.element_spec, env["shape_of"], env["dtype_of"]),
               "cardinality": int(result.cardinality())}
        try:
            elements = itertools.islice(result.as_numpy_iterator(), MAX_ELEMENTS)  # some cases are infinite
            out["elements"] = [canonical(e) for e in elements]
        except TypeError as e:  # as_numpy_iterator of datasets of datasets (window) is refused
            if "as_numpy_iterator()` is not supported" not in str(e):
                raise
            out["elements"] = ["TypeError", "as_numpy_iterator() is not supported"]
        try:
            out["len"] = len(result)
        except (TypeError, ValueError) as e:
            out["len"] = [type(e).__name__, str(e)]
        return out
    except Exception as e:  # noqa: BLE001  (the error is the recorded answer)
        return {"error": [type(e).__name__, str(e)[:400]]}


def main():
    import tensorflow as tf

    env = {"D": tf.data.Dataset, "LEN": lambda x: tf.shape(x)[0], "OPTS": options_seen,
           "O": options_maker(tf.data.Options, tf.data.experimental.AutoShardPolicy), "np": np, "AUTOTUNE": tf.data.AUTOTUNE, "TensorSpec": tf.TensorSpec, "P": P,
           "collections": collections, "shape_of": lambda s: s.shape.as_list() if s.shape.rank is not None else None,
           "dtype_of": lambda s: s.dtype.name}
    out = {case: record(case, dict(env), tf.data.Dataset) for case in CASES}
    out["_tf_version"] = tf.__version__
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_data_reference_more.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"wrote {path} ({len(CASES)} cases, TensorFlow {tf.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
