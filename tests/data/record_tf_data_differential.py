"""Record tf.data's answers for the generated pipelines of tests/data_differential.py (tests/test_data_differential.py
replays them on md.data).

    /work/venvs/tf/bin/python tests/data/record_tf_data_differential.py   # writes tests/data/tf_data_differential.json

For each pipeline: its element_spec, cardinality and elements (values, dtypes, shapes, leaf types and structure,
at most data_differential.MAX_ELEMENTS of them; all, sorted, when the pipeline ends in a shuffle, whose order is
the RNG's, with whether a pass repeated after ``reshuffle_each_iteration=False`` kept its order), or the exception's
class and message, whether construction or iteration raised it.
"""

import itertools
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import data_differential  # noqa: E402
from record_tf_data_more import canonical, canonical_spec  # noqa: E402

SEED, COUNT = 31, 400
REFERENCE = "tf_data_differential.json"


def cases():
    return data_differential.pipelines(SEED, COUNT)


def record(case, env, dataset_type):
    try:
        ds = eval(case["expr"], env)
        out = {"spec": canonical_spec(ds.element_spec, env["shape_of"], env["dtype_of"]),
               "cardinality": int(ds.cardinality())}
        # A shuffled pipeline is read whole (its first elements are the RNG's choice); the others' first elements.
        limit = data_differential.MAX_ELEMENTS if case["order"] == "exact" else data_differential.MAX_SHUFFLED
        elements = [canonical(e) for e in itertools.islice(ds.as_numpy_iterator(), limit)]
        if case["order"] != "exact":
            if case["order"] == "multiset-twice":
                half = len(elements) // 2
                out["passes_agree"] = elements[:half] == elements[half:]
            elements.sort(key=lambda e: json.dumps(e, sort_keys=True))
        out["elements"] = elements
        return out
    except Exception as e:  # noqa: BLE001  (the error is the recorded answer)
        return {"error": [type(e).__name__, str(e)[:300]]}


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")

    env = {"D": tf.data.Dataset, "np": np, "AUTOTUNE": tf.data.AUTOTUNE, "TensorSpec": tf.TensorSpec,
           "F": data_differential.tf_functions(tf),
           "shape_of": lambda s: s.shape.as_list() if s.shape.rank is not None else None,
           "dtype_of": lambda s: s.dtype.name}
    out = {}
    for case in cases():
        if os.environ.get("RECORD_VERBOSE"):
            print(case["expr"], file=sys.stderr, flush=True)
        out[case["expr"]] = record(case, dict(env), tf.data.Dataset)
    out["_tf_version"] = tf.__version__
    with open(os.path.join(HERE, REFERENCE), "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
        f.write("\n")
    errors = sum("error" in v for k, v in out.items() if k != "_tf_version")
    print(f"wrote {REFERENCE}: {len(out) - 1} pipelines ({errors} raise), TensorFlow {tf.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
