"""Record tf.data's answers for the rest of its public surface (tests/test_data_tf_parity_29.py replays them).

    /work/venvs/tf/bin/python tests/data/record_tf_data_29.py   # writes tests/data/tf_data_reference_29.json

Same case language as record_tf_data_more.py (``D``, ``np``, ``TensorSpec``, ``AUTOTUNE``, ``P``, ``O``,
``OPTS``), plus ``E`` (``tf.data.experimental``), ``DATA`` (``tf.data``), ``F(name)`` (a file of
tests/data/tf_data_29/, written here with TensorFlow's writers), ``TMP(name)`` (a fresh path in a temporary
directory), ``SL(ds, save_kwargs, load_kwargs)`` (save then load), ``SET(obj, name, value)`` (an attribute
set, the object returned), ``OPT(ds, 'a.b')`` (an option of ``ds.options()``) and ``SHAPE(spec)`` (what
TensorShape's methods say of a spec's shape).
"""

import collections
import gzip
import importlib.util
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = os.path.join(HERE, "tf_data_29")
_spec = importlib.util.spec_from_file_location("record_tf_data_more", os.path.join(HERE, "record_tf_data_more.py"))
more = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(more)

INT_GEN = "D.from_generator(lambda: iter([np.arange(2), np.arange(3)]), output_signature=TensorSpec([None], np.int64))"

CASES = [
    # --- TensorSpec.shape is a TensorShape; cardinality is an int64 scalar -------------------------------
    "SHAPE(D.range(3).element_spec)", "SHAPE(D.range(3).batch(2).element_spec)",
    "SHAPE(D.range(4).batch(2, drop_remainder=True).element_spec)",
    "SHAPE(D.from_tensor_slices(np.zeros((4, 2, 3))).element_spec)",
    "SHAPE(D.from_generator(lambda: iter([1]), output_signature=TensorSpec(None, np.int64)).element_spec)",
    f"SHAPE({INT_GEN}.element_spec)",
    "SHAPE(TensorSpec([2, None], np.float32))", "SHAPE(TensorSpec(None, np.float32))", "SHAPE(TensorSpec([]))",
    "TensorSpec([2, None], np.float32).shape == (2, None)", "TensorSpec([2, 3]).shape == [2, 3]",
    "TensorSpec([2, None]).is_compatible_with(TensorSpec([2, 5]))",
    "TensorSpec([2, None]).is_compatible_with(TensorSpec([3, 5]))",
    "TensorSpec(None).is_compatible_with(TensorSpec([3, 5]))",
    "TensorSpec([2, 3]).is_compatible_with(np.zeros((2, 3), np.float32))",
    "TensorSpec([2, 3], np.int64).is_compatible_with(np.zeros((2, 3), np.float32))",
    "TensorSpec([2, 5]).is_subtype_of(TensorSpec([2, None]))",
    "TensorSpec([2, None]).is_subtype_of(TensorSpec([2, 5]))",
    "TensorSpec([2, 5]).is_subtype_of(TensorSpec(None))",
    "SHAPE(TensorSpec([2, 5]).most_specific_common_supertype([TensorSpec([3, 5])]))",
    "SHAPE(TensorSpec([2, 5]).most_specific_common_supertype([TensorSpec([3, 5, 1])]))",
    "TensorSpec([2, 5]).most_specific_common_supertype([TensorSpec([3, 5], np.int32)])",
    "SHAPE(TensorSpec.from_tensor(np.zeros((2, 3), np.int32)))", "TensorSpec.from_tensor(np.zeros(2)).dtype.name",
    "SHAPE(TensorSpec.from_spec(TensorSpec([1, None])))",
    "D.range(3).cardinality()", "D.range(3).repeat().cardinality()", "D.range(3).filter(lambda x: True).cardinality()",
    "E.cardinality(D.range(7).batch(2))", "D.range(3).cardinality() == E.INFINITE_CARDINALITY",
    "[E.INFINITE_CARDINALITY, E.UNKNOWN_CARDINALITY, DATA.INFINITE_CARDINALITY, DATA.UNKNOWN_CARDINALITY]",
    # --- interleave: parallel reads keep TF's order ------------------------------------------------------
    "D.range(5).interleave(lambda x: D.range(x * 10, x * 10 + 4), cycle_length=3, block_length=2, "
    "num_parallel_calls=2)",
    "D.range(5).interleave(lambda x: D.range(x * 10, x * 10 + x), cycle_length=2, num_parallel_calls=AUTOTUNE, "
    "deterministic=True)",
    "D.range(4).interleave(lambda x: D.from_tensors(x).repeat(x), cycle_length=4, block_length=3, "
    "num_parallel_calls=4)",
    "D.range(3).interleave(lambda x: D.range(2), cycle_length=2, num_parallel_calls=0)",
    "D.range(3).interleave(lambda x: D.range(2), cycle_length=2, num_parallel_calls=-5)",
    "D.range(3).interleave(lambda x: D.range(2), cycle_length=2, num_parallel_calls=1.5)",
    "D.range(3).interleave(lambda x: D.range(x), cycle_length=2, num_parallel_calls=2).cardinality()",
    "D.range(4).interleave(lambda x: D.range(x).map(lambda y: (y, x)), cycle_length=2, num_parallel_calls=2)",
    "E.parallel_interleave(lambda x: D.range(x), cycle_length=2)(D.range(4))",
    "D.range(4).apply(E.parallel_interleave(lambda x: D.range(x), cycle_length=2, block_length=2))",
    # --- batch with num_parallel_calls -------------------------------------------------------------------
    "D.range(7).batch(3, num_parallel_calls=2, deterministic=True)",
    "D.range(7).batch(3, num_parallel_calls=AUTOTUNE, drop_remainder=True)",
    # (TF 2.21 hangs on batch(num_parallel_calls=0 or < -1): md.data's ValueError is tested in test_data_29.py)
    # --- options ----------------------------------------------------------------------------------------
    "OPT(D.range(2), 'deterministic')", "OPT(D.range(2), 'experimental_deterministic')",
    "OPT(D.range(2).with_options(SET(DATA.Options(), 'experimental_deterministic', False)), 'deterministic')",
    "OPT(D.range(2).with_options(SET(DATA.Options(), 'deterministic', False)), 'experimental_deterministic')",
    "OPT(D.range(2), 'threading.private_threadpool_size')",
    "OPT(D.range(2).with_options(SET(SET(DATA.Options(), 'deterministic', True), 'dataset_name', 'n')), "
    "'dataset_name')",
    "SET(DATA.Options(), 'deterministic', 1)", "SET(DATA.Options(), 'no_such_option', 1)",
    "SET(DATA.Options(), 'dataset_name', 5)", "SET(DATA.Options(), 'experimental_slack', True).experimental_slack",
    "SET(DATA.Options().threading, 'private_threadpool_size', 2.5)",
    "SET(DATA.Options().threading, 'private_threadpool_size', 4).private_threadpool_size",
    "SET(DATA.Options().autotune, 'enabled', False).enabled", "SET(DATA.Options().autotune, 'ram_budget', 'x')",
    "SET(DATA.Options().experimental_optimization, 'map_fusion', True).map_fusion",
    "SET(DATA.Options().experimental_optimization, 'map_fusion', 1)",
    "SET(DATA.Options(), 'experimental_external_state_policy', E.ExternalStatePolicy.IGNORE)"
    ".experimental_external_state_policy.name",
    "SET(DATA.Options().autotune, 'autotune_algorithm', E.AutotuneAlgorithm.HILL_CLIMB).autotune_algorithm.value",
    "[p.name for p in E.ExternalStatePolicy]", "[(p.name, p.value) for p in E.AutotuneAlgorithm]",
    "DATA.Options() == DATA.Options()", "SET(DATA.Options(), 'deterministic', False) == DATA.Options()",
    "SET(DATA.Options(), 'deterministic', False).merge(SET(DATA.Options(), 'experimental_slack', True)).deterministic",
    "SET(DATA.Options(), 'deterministic', False).merge(SET(DATA.Options(), 'deterministic', True)).deterministic",
    "SET(DATA.Options(), 'deterministic', False).merge(DATA.Options()).deterministic",
    "SET(SET(DATA.Options(), 'framework_type', ['a']).merge(SET(DATA.Options(), 'framework_type', ['b'])), "
    "'dataset_name', 'x').framework_type",
    "SET(D.range(2).options(), 'deterministic', True)",
    "D.range(6).map(lambda x: x * 2, num_parallel_calls=3).with_options(SET(DATA.Options(), 'threading', "
    "SET(DATA.ThreadingOptions(), 'private_threadpool_size', 1)))",
    "D.range(2).with_options(O(False)).options() == D.range(2).with_options(O(False)).options()",
    # --- experimental functions -------------------------------------------------------------------------
    "D.range(3).apply(E.assert_cardinality(3))", "D.range(3).filter(lambda x: True).apply(E.assert_cardinality(3))",
    "D.range(3).apply(E.assert_cardinality(5))", "D.range(6).apply(E.assert_cardinality(5))",
    "D.range(6).apply(E.assert_cardinality(1))", "D.range(1).apply(E.assert_cardinality(2))",
    "D.range(6).apply(E.assert_cardinality(E.INFINITE_CARDINALITY))",
    "D.range(6).apply(E.assert_cardinality(E.INFINITE_CARDINALITY)).take(3)",
    "D.range(3).repeat().apply(E.assert_cardinality(E.INFINITE_CARDINALITY)).take(4)",
    "D.range(3).apply(E.assert_cardinality(3)).batch(2)",
    "E.at(D.range(5), 2)", "E.at(D.range(5).map(lambda x: x * 2), 4)", "E.at(D.range(5), 7)", "E.at(D.range(5), -1)",
    "E.at(D.from_tensor_slices({'a': np.arange(3), 'b': np.arange(3.0)}), 1)",
    "E.from_list([1, 2, 3])", "E.from_list([(1, 'a'), (2, 'b')])", "E.from_list([])",
    "E.from_list([np.arange(2), np.arange(3)])", "E.from_list([{'a': 1.5}, {'a': 2.5}])",
    "E.from_list([[1, 2], [3, 4]])", "E.from_list([np.int64(1), np.int64(2)]).batch(2)",
    "D.range(3).map(lambda x: {'a': x}).apply(E.pad_to_cardinality(5))",
    "D.range(2).map(lambda x: {'a': x, 'b': (np.float32(1.5), 'w')}).apply(E.pad_to_cardinality(3, mask_key='m'))",
    "D.range(3).map(lambda x: {'a': x}).apply(E.pad_to_cardinality(3))",
    "D.range(3).apply(E.pad_to_cardinality(5))", "D.range(3).map(lambda x: {'a': x}).apply(E.pad_to_cardinality(2))",
    "E.get_structure(D.range(3)) == TensorSpec([], np.int64)",
    "E.get_structure(iter(D.range(3))) == TensorSpec([], np.int64)",
    "E.get_structure(5)", "E.get_single_element(D.range(1))", "E.get_next_as_optional(iter(D.range(2))).get_value()",
    "E.get_next_as_optional(iter(D.range(0))).has_value()",
    "D.from_tensor_slices(np.array([5, 1, 5, 2, 1, 7], np.int64)).apply(E.group_by_reducer(lambda x: x % 3, "
    "E.Reducer(lambda k: np.int64(0), lambda s, x: s + x, lambda s: s)))",
    "D.range(7).apply(E.group_by_reducer(lambda x: x % 3, E.Reducer(lambda k: (k, np.int64(0)), "
    "lambda s, x: (s[0], s[1] + x), lambda k, s: {'k': k, 's': s})))",
    "D.range(7).apply(E.group_by_reducer(lambda x: I32(x % 3), E.Reducer(lambda k: np.int64(0), "
    "lambda s, x: s + x, lambda s: s)))",
    "D.range(7).apply(E.map_and_batch(lambda x: x * 2, 3))",
    "D.range(7).apply(E.map_and_batch(lambda x: x * 2, 3, drop_remainder=True))",
    "D.range(7).apply(E.map_and_batch(lambda x: x * 2, 3, num_parallel_batches=2))",
    "D.range(3).apply(E.shuffle_and_repeat(1, 2))", "D.range(3).apply(E.enumerate_dataset(5))",
    "D.range(3).apply(E.copy_to_device('/cpu:0'))", "D.range(3).apply(E.prefetch_to_device('/cpu:0'))",
    "D.range(6).apply(E.unique())", "D.range(6).batch(2).apply(E.unbatch())",
    "D.range(6).apply(E.take_while(lambda x: x < 3))",
    "D.range(4).apply(E.scan(np.int64(0), lambda s, x: (s + x, s)))",
    "D.range(4).apply(E.ignore_errors())",
    "D.range(8).apply(E.group_by_window(lambda x: x % 2, lambda k, w: w.batch(2), window_size=2))",
    "E.Counter(2, 3).take(3)", "E.choose_from_datasets([D.range(2), D.range(10, 13)], D.from_tensor_slices("
    "np.array([0, 1, 0, 0, 1], np.int64)))",
    "E.sample_from_datasets([D.range(3)], seed=1)", "E.SHARD_HINT",
    # --- rejection_resample: structure, spec and cardinality (the draws are NumPy's) --------------------
    "D.range(8).rejection_resample(lambda x: I32(x % 2), [0.5, 0.5], initial_dist=[0.5, 0.5], seed=1)",
    "D.range(8).map(lambda x: (x, x * 2)).rejection_resample(lambda a, b: I32(a % 2), [0.5, 0.5], "
    "initial_dist=[0.5, 0.5])",
    "D.range(8).rejection_resample(lambda x: I32(x % 2), [1.0, 0.0], initial_dist=[0.5, 0.5]).element_spec"
    " == (TensorSpec([], np.int32), TensorSpec([], np.int64))",
    "D.range(8).rejection_resample(lambda x: I32(x % 2), [0.9, 0.1]).cardinality()",
    # --- save / load / snapshot -------------------------------------------------------------------------
    "SL(D.range(5))", "SL(D.range(5), {'shard_func': lambda x: x % 2})",
    "SL(D.range(40).map(lambda x: P(x, {'s': 'ab', 'v': [x, x + 1]})))",
    f"SL({INT_GEN})", "SL(D.range(0))", "SL(D.range(3).repeat().take(2))",
    "SL(D.from_tensor_slices(['a', 'bb', 'ccc']).batch(2))",
    "SL(D.range(6), {'compression': 'GZIP'}, {'compression': 'GZIP'})",
    "SL(D.range(5), {'shard_func': lambda x: x % 2}, {'reader_func': lambda ds: ds.flat_map(lambda d: d)})",
    "SL(D.range(5), {'shard_func': lambda x: -1})", "SL(D.range(5), {'shard_func': lambda x: 1.5})",
    "D.range(3).save(5)", "D.load(TMP('never_written'))",
    "SL(D.range(3), {}, {'element_spec': TensorSpec([], np.int64)})",
    "D.range(6).snapshot(TMP('snap'))", "D.range(6).map(lambda x: x * 3).snapshot(TMP('snap'))",
    "D.range(6).snapshot(TMP('snap')).cardinality()", "D.range(4).apply(E.snapshot(TMP('snap2')))",
    "D.range(5).map(lambda x: x + 1).apply(lambda d: (E.save(d, TMP('es')), E.load(TMP('es')))[1])",
    # --- file readers ----------------------------------------------------------------------------------
    "DATA.TFRecordDataset(F('r1.tfrecord'))", "DATA.TFRecordDataset([F('r1.tfrecord'), F('r4.tfrecord')])",
    "DATA.TFRecordDataset([F('r1.tfrecord'), F('r4.tfrecord')], num_parallel_reads=2)",
    "DATA.TFRecordDataset([F('r1.tfrecord'), F('r4.tfrecord'), F('r1.tfrecord')], num_parallel_reads=AUTOTUNE)",
    "DATA.TFRecordDataset(F('r2.tfrecord'), 'GZIP')", "DATA.TFRecordDataset(F('r3.tfrecord'), compression_type='ZLIB')",
    "DATA.TFRecordDataset(F('r2.tfrecord'))", "DATA.TFRecordDataset(F('bad.tfrecord'))",
    "DATA.TFRecordDataset(F('trunc.tfrecord'))", "DATA.TFRecordDataset(F('nothere.tfrecord'))",
    "DATA.TFRecordDataset(D.from_tensor_slices([F('r4.tfrecord'), F('r1.tfrecord')])).map(lambda r: (r, 1))",
    "DATA.TFRecordDataset(F('empty.tfrecord'))", "DATA.TFRecordDataset(F('big.tfrecord')).map(LEN)",
    "DATA.FixedLengthRecordDataset(F('a.bin'), 4, header_bytes=2, footer_bytes=1)",
    "DATA.FixedLengthRecordDataset([F('a.bin'), F('b.bin')], 4, header_bytes=2, footer_bytes=1)",
    "DATA.FixedLengthRecordDataset([F('a.bin'), F('b.bin')], 3)",
    "DATA.FixedLengthRecordDataset([F('a.bin'), F('b.bin')], 5, num_parallel_reads=2)",
    "DATA.FixedLengthRecordDataset(F('a.bin'), 4, compression_type='GZIP')",
    "DATA.FixedLengthRecordDataset(F('a.gz'), 4, header_bytes=2, footer_bytes=1, compression_type='GZIP')",
    "DATA.FixedLengthRecordDataset(F('nothere.bin'), 4)",
    "DATA.TextLineDataset([F('x.txt'), F('y.txt')], num_parallel_reads=2)",
    "DATA.TextLineDataset([F('x.txt'), F('y.txt')])",
    "DATA.TextLineDataset(D.from_tensor_slices([F('y.txt'), F('x.txt')]), num_parallel_reads=2)",
    "WRITE(D.from_tensor_slices([b'a', b'bc', b'']), 'w1.tfrecord')",
    "WRITE(D.from_tensor_slices([b'g', b'zz']), 'w2.tfrecord', 'GZIP')",
    "WRITE(D.range(3), 'w3.tfrecord')",
    # --- CSV ---------------------------------------------------------------------------------------------
    "E.CsvDataset(F('c1.csv'), [0, 0.0, 'd'], header=True)",
    "E.CsvDataset(F('c1.csv'), [np.array([], np.int32), 0.0, 'd'], header=True)",
    "E.CsvDataset(F('c1.csv'), [0, 0.0, ''], header=True, na_value='3')",
    "E.CsvDataset(F('c1.csv'), [0, 0.0, ''], header=True, use_quote_delim=False)",
    "E.CsvDataset(F('c1.csv'), [np.int64(0), np.array([], np.float64), ''], header=True, select_cols=[0, 1, 2])",
    "E.CsvDataset(F('c2.csv'), [0, 0.0, ''])", "E.CsvDataset(F('c2.csv'), [0], select_cols=[0])",
    "E.CsvDataset(F('c2.csv'), [0.0, ''], select_cols=[1, 2])",
    "E.CsvDataset(F('c2.csv'), [0, 0.0, ''], select_cols=[2, 0])",
    "E.CsvDataset(F('c2.csv'), [0, 0.0, ''], field_delim=',,')", "E.CsvDataset(F('c3.csv'), [0, 0])",
    "E.CsvDataset(F('c4.csv'), [0, 0.0, ''])", "E.CsvDataset(F('c4.csv'), [0, 0, ''])",
    "E.CsvDataset(F('c5.csv'), [np.array([], np.int64), 0.0, 'n/a'], na_value='NA')",
    "E.CsvDataset([F('c5.csv'), F('c5.csv')], ['', '', ''], field_delim=',').batch(2)",
    "E.CsvDataset(F('c6.csv'), [0, ''], field_delim='|')",
    "E.CsvDataset(F('c5.csv'), [0, 0.0, ''], compression_type='ZLIB')",
    "E.CsvDataset(F('c5.csv.gz'), [0, 0.0, ''], compression_type='GZIP').cardinality()",
    "E.CsvDataset(F('c5.csv.gz'), [0, 0.0, ''], compression_type='GZIP')",
    "E.make_csv_dataset(F('c1.csv'), 2, shuffle=False, num_epochs=1)",
    "E.make_csv_dataset(F('c1.csv'), 3, shuffle=False, num_epochs=2, label_name='a')",
    "E.make_csv_dataset(F('c1.csv'), 2, shuffle=False, num_epochs=1, select_columns=['c', 'a'])",
    "E.make_csv_dataset(F('c1.csv'), 2, shuffle=False, num_epochs=1, select_columns=[1])",
    "E.make_csv_dataset(F('c1.csv'), 2, shuffle=False, num_epochs=1, column_defaults=[0, 0.0, ''])",
    "E.make_csv_dataset(F('c1.csv'), 2, shuffle=False).take(3)",
    "E.make_csv_dataset([F('c7.csv'), F('c8.csv')], 4, shuffle=False, num_epochs=1, num_parallel_reads=2)",
    "E.make_csv_dataset([F('c7.csv'), F('c8.csv')], 4, shuffle=False, num_epochs=1, na_value='?')",
    "E.make_csv_dataset([F('c7.csv'), F('c8.csv')], 3, shuffle=False, num_epochs=1, num_rows_for_inference=1)",
    "E.make_csv_dataset(F('c1.csv'), 2, label_name='zz')", "E.make_csv_dataset(F('c2.csv'), 2, header=False)",
    "E.make_csv_dataset(F('c1.csv'), 2, select_columns=['a', 'q'])",
    "E.make_csv_dataset(F('c1.csv'), 2, column_names=['x', 'x', 'y'], header=False)",
    "E.make_csv_dataset(F('c1.csv'), 2, select_columns=[0, 1], column_defaults=[0])",
    # --- iterators ---------------------------------------------------------------------------------------
    "[str(t) for t in iter(D.range(3).map(lambda x: (x, {'a': np.float32(1)}))).output_shapes[:1]]",
    "SHAPE(iter(D.from_tensor_slices(np.zeros((3, 2)))).output_shapes)",
    "DATA.IteratorSpec(D.range(3).element_spec) == DATA.IteratorSpec(D.range(5).element_spec)",
    "type(D.range(3).as_numpy_iterator()).__name__", "next(D.range(3).as_numpy_iterator())",
    "D.range(3).as_numpy_iterator().next()",
    "D.range(3).window(2).as_numpy_iterator()",
]


def shape_facts(spec_or_shape):
    """What a TensorShape says of itself: rank, as_list (or the error), is_fully_defined, num_elements, type."""
    shape = getattr(spec_or_shape, "shape", spec_or_shape)
    try:
        as_list = shape.as_list()
    except ValueError as e:
        as_list = ["ValueError", str(e)]
    return [type(shape).__name__, shape.rank, as_list, shape.is_fully_defined(), shape.num_elements(), str(shape)]


def set_attr(obj, name, value):
    setattr(obj, name, value)
    return obj


def option(dataset, path):
    value = dataset.options()
    for name in path.split("."):
        value = getattr(value, name)
    return value


class TempPaths:
    """``TMP(name)``: a path in a temporary directory, the same one for the same name within a case."""

    def __init__(self):
        self._root = tempfile.mkdtemp(prefix="tf_data_29_")

    def __call__(self, name):
        return os.path.join(self._root, name)


def make_env(data, experimental, dataset_class, tensor_spec):
    tmp = TempPaths()

    def save_load(ds, save_kwargs=None, load_kwargs=None):
        path = tmp(f"saved{len(os.listdir(tmp._root))}")
        ds.save(path, **(save_kwargs or {}))
        return dataset_class.load(path, **(load_kwargs or {}))

    def write(ds, name, compression=None):
        path = tmp(name)
        experimental.TFRecordWriter(path, compression).write(ds)
        # What TF's writer wrote, byte for byte (GZIP: once decompressed, the gzip headers carry a time)
        contents = []
        for p in (path, os.path.join(FILES, name)):
            with (gzip.open if compression == "GZIP" else open)(p, "rb") as f:
                contents.append(f.read())
        return contents[0] == contents[1]

    return {"D": dataset_class, "E": experimental, "DATA": data, "np": np, "AUTOTUNE": data.AUTOTUNE,
            "TensorSpec": tensor_spec, "P": more.P, "collections": collections, "OPTS": more.options_seen,
            "O": more.options_maker(data.Options, experimental.AutoShardPolicy),
            "F": lambda name: os.path.join(FILES, name), "TMP": tmp, "SL": save_load, "SET": set_attr,
            "OPT": option, "SHAPE": shape_facts, "WRITE": write}


def write_files(tf):
    """The input files of the reader cases, written with TensorFlow (kept in git; rewritten only if missing)."""
    os.makedirs(FILES, exist_ok=True)

    def path(name):
        return os.path.join(FILES, name)

    csvs = {"c1.csv": 'a,b,c\n1,2.5,x\n3,,"y,z"\n,4.5,\n"5",6,"he said ""hi"""\n', "c2.csv": "7,8.5,w\n\n9,1,v",
            "c3.csv": "1,2\n3\n", "c4.csv": "1,abc,x\n", "c5.csv": '10,NA,"two\nlines"\r\n11,1e3,NA\n-3,-0.5,\n',
            "c6.csv": "1|a b\n2|c\n", "c7.csv": "n,big,f,s\n1,5000000000,1.5,x\n2,3,2,?\n",
            "c8.csv": "n,big,f,s\n3,4,1e40,y\n?,5,?,z\n"}
    for name, text in csvs.items():
        if not os.path.exists(path(name)):
            with open(path(name), "w", newline="") as f:
                f.write(text)
    if not os.path.exists(path("c5.csv.gz")):
        with gzip.open(path("c5.csv.gz"), "wt", newline="") as f:
            f.write(csvs["c5.csv"])
    if os.path.exists(path("r1.tfrecord")):
        return
    for name, compression, records in [("r1.tfrecord", None, [b"rec0", b"rec1", b"rec2"]),
                                       ("r4.tfrecord", None, [b"four", b"", b"x" * 300]),
                                       ("r2.tfrecord", "GZIP", [b"g0", b"g1"]), ("r3.tfrecord", "ZLIB", [b"z0", b"z1"]),
                                       ("empty.tfrecord", None, []),
                                       ("big.tfrecord", None, [bytes(range(256)) * 1024, b"y" * 70000]),
                                       ("w1.tfrecord", None, [b"a", b"bc", b""]),
                                       ("w2.tfrecord", "GZIP", [b"g", b"zz"])]:
        with tf.io.TFRecordWriter(path(name), compression) as w:
            for r in records:
                w.write(r)
    with open(path("r1.tfrecord"), "rb") as f:
        good = bytearray(f.read())
    with open(path("trunc.tfrecord"), "wb") as f:
        f.write(bytes(good[:-3]))
    good[14] ^= 1  # a bit of the first record's data
    with open(path("bad.tfrecord"), "wb") as f:
        f.write(bytes(good))
    with open(path("a.bin"), "wb") as f:
        f.write(b"HH" + bytes(range(12)) + b"F")
    with open(path("b.bin"), "wb") as f:
        f.write(b"HH" + bytes(range(10)) + b"F")
    with gzip.open(path("a.gz"), "wb") as f:
        f.write(b"HH" + bytes(range(12)) + b"F")
    with open(path("x.txt"), "w") as f:
        f.write("1\n2\n3\n")
    with open(path("y.txt"), "w") as f:
        f.write("a\nb\n")


def main():
    import tensorflow as tf

    write_files(tf)
    env = make_env(tf.data, tf.data.experimental, tf.data.Dataset, tf.TensorSpec)
    env.update({"LEN": lambda x: tf.strings.length(x), "I32": lambda x: tf.cast(x, tf.int32),
                "shape_of": lambda s: s.shape.as_list() if s.shape.rank is not None else None,
                "dtype_of": lambda s: s.dtype.name})
    out = {}
    for case in CASES:
        out[case] = more.record(case, dict(env), tf.data.Dataset)
    out["_tf_version"] = tf.__version__
    path = os.path.join(HERE, "tf_data_reference_29.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"wrote {path} ({len(CASES)} cases, TensorFlow {tf.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
