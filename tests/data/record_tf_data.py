"""Record tf.data's outputs for the pipelines of CASES (tests/test_data_tf_parity.py replays them on md.data).

    /work/venvs/tf/bin/python tests/data/record_tf_data.py   # writes tests/data/tf_data_reference.json

Each case is an expression over ``D`` (the Dataset class), ``np``, ``AUTOTUNE``, ``TensorSpec``,
``TextLineDataset`` and ``FILES`` (text files written by ``write_files``);
the recording keeps every element, the element_spec and the cardinality.
"""

import json
import os
import sys

import numpy as np

CASES = [
    "D.range(10)", "D.range(2, 10, 3)", "D.range(10, 0, -2)", "D.range(0)",
    "D.range(10).batch(3)", "D.range(10).batch(3, drop_remainder=True)", "D.range(9).batch(3, True)",
    "D.from_tensor_slices(np.arange(12).reshape(6, 2)).batch(4)",
    "D.from_tensor_slices((np.arange(5), np.arange(5) * 10)).batch(2)",
    "D.from_tensor_slices((np.arange(5), np.arange(5) * 10)).batch(2).unbatch()",
    "D.from_tensor_slices({'a': np.arange(4), 'b': np.ones((4, 2), np.float32)}).batch(3)",
    "D.from_tensor_slices({'a': np.arange(4), 'b': np.ones((4, 2), np.float32)}).batch(3).unbatch()",
    "D.from_tensor_slices([[1, 2], [3, 4]])", "D.from_tensor_slices([1.5, 2.5])",
    "D.from_tensor_slices(['a', 'bc'])", "D.from_tensor_slices(['a', 'bc', 'd']).batch(2)",
    "D.from_tensors(np.arange(3)).repeat(3)", "D.from_tensors((np.int32(1), np.float64(2.0)))",
    "D.range(10).filter(lambda x: x % 3 == 0)",
    "D.range(10).map(lambda x: (x, x * 2))", "D.range(10).map(lambda x: [x, x + 1])",
    "D.range(10).map(lambda x: {'double': x * 2})",
    "D.range(20).map(lambda x: x * 2, num_parallel_calls=AUTOTUNE)",
    "D.range(20).map(lambda x: x * 2, num_parallel_calls=3, deterministic=True)",
    "D.from_tensor_slices((np.arange(4), np.arange(4) * 2)).map(lambda a, b: a + b)",
    "D.range(7).take(3)", "D.range(7).skip(3)", "D.range(7).take(-1)", "D.range(7).skip(-1)",
    "D.range(7).take(10)", "D.range(7).skip(10)", "D.range(5).repeat().take(12)",
    "D.range(10).shard(3, 1)", "D.range(10).shard(4, 3)", "D.range(10).shard(1, 0)",
    "D.range(3).concatenate(D.range(5, 8))", "D.range(4).enumerate(start=5)", "D.range(4).enumerate()",
    "D.zip(D.range(3), D.range(10, 20))", "D.zip((D.range(3), D.range(5)))",
    "D.zip({'a': D.range(3), 'b': D.range(4)})", "D.zip(D.range(2), D.zip(D.range(3), D.range(3)))",
    "D.range(3).repeat(2).batch(4)", "D.range(3).repeat(0)", "D.range(10).batch(4).unbatch().batch(3)",
    "D.range(8).interleave(lambda x: D.from_tensors(x).repeat(3), cycle_length=3, block_length=2)",
    "D.range(5).interleave(lambda x: D.range(x), cycle_length=2)",
    "D.range(4).flat_map(lambda x: D.range(x))",
    "D.range(10).shuffle(1)", "D.range(5).cache().repeat(2)", "D.range(5).prefetch(2)",
    "D.range(5).prefetch(AUTOTUNE)", "D.range(5).batch(2).map(lambda x: x * 2)",
    "D.range(6).batch(2).batch(2)", "D.range(6).filter(lambda x: x > 100)",
    "D.range(12).batch(5).repeat(2)", "D.range(7).batch(7)",
    "D.from_generator(lambda: (np.arange(i) for i in range(1, 6)), "
    "output_signature=TensorSpec((None,), np.int64)).padded_batch(2)",
    "D.from_generator(lambda: (np.arange(i) for i in range(1, 6)), "
    "output_signature=TensorSpec((None,), np.int64)).padded_batch(2, padded_shapes=(6,), padding_values=np.int64(-1))",
    "D.from_generator(lambda: (np.arange(i) for i in range(1, 6)), "
    "output_signature=TensorSpec((None,), np.int64)).padded_batch(3, drop_remainder=True)",
    "D.from_generator(lambda: ((np.ones((i, 2), np.float32), i) for i in range(1, 4)), output_signature=("
    "TensorSpec((None, 2), np.float32), TensorSpec((), np.int64))).padded_batch(2)",
    "D.from_tensor_slices(['a', 'bc', 'def']).padded_batch(2)",
    "TextLineDataset(FILES)", "TextLineDataset(FILES).batch(2)", "TextLineDataset(FILES[1])",
    "D.from_tensor_slices(FILES).interleave(TextLineDataset, cycle_length=2)",
]


def write_files(directory):
    """Text files whose lines test the line-ending rules; the same bytes for TF and md."""
    contents = [b"alpha\nbeta\n\ngamma", b"one\r\ntwo\r\n", b"x\ny\nz\n"]
    paths = []
    for i, data in enumerate(contents):
        path = os.path.join(directory, f"lines{i}.txt")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


def canonical(value):
    """A JSON form of one element (NumPy values as produced by as_numpy_iterator)."""
    if isinstance(value, dict):
        return {"dict": {str(k): canonical(v) for k, v in sorted(value.items())}}
    if isinstance(value, tuple):
        return {"tuple": [canonical(v) for v in value]}
    arr = np.asarray(value)
    dtype = "string" if arr.dtype.kind in "SO" else arr.dtype.name
    items = arr.tolist()
    return {"dtype": dtype, "shape": list(arr.shape), "value": _strings(items)}


def _strings(x):
    if isinstance(x, list):
        return [_strings(v) for v in x]
    return x.decode("latin-1") if isinstance(x, bytes) else x


def canonical_spec(spec, shape_of, dtype_of):
    if isinstance(spec, dict):
        return {"dict": {str(k): canonical_spec(v, shape_of, dtype_of) for k, v in sorted(spec.items())}}
    if isinstance(spec, tuple):
        return {"tuple": [canonical_spec(v, shape_of, dtype_of) for v in spec]}
    return [shape_of(spec), dtype_of(spec)]


def run(D, env, as_numpy):
    out = {}
    for case in CASES:
        ds = eval(case, env)
        out[case] = {"elements": [canonical(e) for e in as_numpy(ds)], "cardinality": int(ds.cardinality()),
                     "spec": canonical_spec(ds.element_spec, env["shape_of"], env["dtype_of"])}
    return out


def main():
    import tempfile

    import tensorflow as tf

    with tempfile.TemporaryDirectory() as tmp:
        env = {"D": tf.data.Dataset, "np": np, "AUTOTUNE": tf.data.AUTOTUNE, "TensorSpec": tf.TensorSpec,
               "TextLineDataset": tf.data.TextLineDataset, "FILES": write_files(tmp),
               "shape_of": lambda s: s.shape.as_list(), "dtype_of": lambda s: s.dtype.name}
        out = run(tf.data.Dataset, env, lambda ds: list(ds.as_numpy_iterator()))
    out["_tf_version"] = tf.__version__
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_data_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"wrote {path} ({len(CASES)} cases, TensorFlow {tf.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
