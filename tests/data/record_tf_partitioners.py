"""Record TensorFlow's partitioners (tf.distribute.experimental.partitioners) over many shapes, dtypes and
arguments: tests/data/tf_partitioners_reference.json, read by tests/test_parameter_server_partitioners.py.

Run with the TensorFlow side venv (never imported by the package or its tests):
    /work/venvs/tf/bin/python tests/data/record_tf_partitioners.py
"""

import itertools
import json
import pathlib

import tensorflow as tf

P = tf.distribute.experimental.partitioners
SHAPES = [[1], [5], [6, 1], [10, 3], [13, 4], [100], [1024, 1024], [7, 3, 5], [64, 256], [3, 0], [257, 1023]]
DTYPES = ["float32", "float16", "bfloat16", "float64", "int8", "int64", "string"]
AXES = [0, 1, -1]


def attempt(fn):
    try:
        return {"value": [int(x) for x in fn()]}
    except Exception as e:  # TF's refusal: recorded by type
        return {"raises": type(e).__name__}


def main():
    cases = []
    partitioners = (
        [("FixedShardsPartitioner", {"num_shards": n}) for n in (1, 2, 3, 5, 16)]
        + [("MinSizePartitioner", {"min_shard_bytes": b, "max_shards": m, "bytes_per_string": s})
           for b, m, s in itertools.product((1, 1000, 256 << 10), (1, 2, 64), (16, 3))]
        + [("MaxSizePartitioner", {"max_shard_bytes": b, "max_shards": m, "bytes_per_string": s})
           for b, m, s in itertools.product((1, 100, 1 << 20), (None, 0, 7), (16, 5))])
    for (cls, kwargs), shape, dtype, axis in itertools.product(partitioners, SHAPES, DTYPES, AXES):
        if axis >= len(shape) or -axis > len(shape) or (axis == -1 and len(shape) == 1):
            continue
        if kwargs.get("bytes_per_string", 16) != 16 and dtype != "string":
            continue  # (it counts for strings only)
        partitioner = getattr(P, cls)(**kwargs)
        got = attempt(lambda: partitioner(tf.TensorShape(shape), tf.as_dtype(dtype), axis=axis))
        cases.append([cls, kwargs, shape, dtype, axis, got.get("value", got.get("raises"))])
    refused = []
    for cls, kwargs in [("MinSizePartitioner", {"min_shard_bytes": 0}), ("MinSizePartitioner", {"max_shards": 0}),
                        ("MinSizePartitioner", {"bytes_per_string": 0}), ("MaxSizePartitioner", {"max_shard_bytes": 0}),
                        ("MaxSizePartitioner", {"max_shard_bytes": 4, "max_shards": -1}),
                        ("MaxSizePartitioner", {"max_shard_bytes": 4, "bytes_per_string": 0})]:
        try:
            getattr(P, cls)(**kwargs)
            refused.append({"cls": cls, "kwargs": kwargs, "raises": None})
        except Exception as e:
            refused.append({"cls": cls, "kwargs": kwargs, "raises": type(e).__name__, "msg": str(e)})
    out = pathlib.Path(__file__).with_name("tf_partitioners_reference.json")
    out.write_text(json.dumps({"tf_version": tf.__version__, "cases": cases, "refused": refused}, separators=(",", ":")).replace("],[", "],\n[") + "\n")
    print(len(cases), "cases", sum(isinstance(c[-1], str) for c in cases), "refused")


if __name__ == "__main__":
    main()
