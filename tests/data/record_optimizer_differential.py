"""Records TensorFlow 2.21 + Keras 3's results of the optimizer differential cases (tests/optimizer_differential.py)
for tests/test_optimizer_differential.py (which never imports TensorFlow).

    /work/venvs/tf/bin/python tests/data/record_optimizer_differential.py
        (writes tests/data/optimizer_differential_reference.json)

One process per strategy and replica count: TF keys its collectives by a group number that a strategy of another
size in the same process would reuse.
"""

import json
import os
import subprocess
import sys

from recording import HERE, logical_cpus, tf, write_reference
import keras
import numpy as np

import optimizer_differential as cases


class TensorFlow:
    """The cases' adapter over TensorFlow and Keras 3."""

    optimizers = keras.optimizers
    constant = staticmethod(tf.constant)
    function = staticmethod(tf.function)
    Variable = staticmethod(tf.Variable)

    def __init__(self):
        self._strategies = {}

    def strategy(self, kind, n):
        """One strategy per process, made once: a second one would reuse the first one's collective keys."""
        key = (kind, n)
        if key not in self._strategies:
            self._strategies[key] = self._make_strategy(kind, n)
        return self._strategies[key]

    @staticmethod
    def _make_strategy(kind, n):
        devices = [f"/cpu:{i}" for i in range(n)]
        if kind == "mirrored":
            return tf.distribute.MirroredStrategy(devices)
        if kind == "central":
            return tf.distribute.experimental.CentralStorageStrategy(devices, "/cpu:0")
        return tf.distribute.OneDeviceStrategy("/cpu:0")

    @staticmethod
    def loss_scale_optimizer(inner, dynamic, initial_scale, dynamic_growth_steps):
        # Keras 3 has no fixed scale: a scale that never grows (and no step that is not finite) is one.
        return keras.mixed_precision.LossScaleOptimizer(
            inner, initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps if dynamic else 10**9)

    @staticmethod
    def inner(opt):
        return opt.inner_optimizer

    @staticmethod
    def numpy(x):
        return np.asarray(x.numpy())

    @staticmethod
    def copies(v):
        value = getattr(v, "value", v)
        if hasattr(value, "values"):
            return [np.asarray(c.numpy()) for c in value.values]
        return [np.asarray(v.numpy())]

    @staticmethod
    def optimizer_variables(opt):
        """Keras' ``variables`` without the learning rate and Nadam's ``_u_product`` (variables there, numbers in
        mirrored: compared on their own)."""
        scalars = (opt._learning_rate, getattr(opt, "_u_product", None))
        return [v for v in opt.variables if not any(v is s for s in scalars)]

    @staticmethod
    def u_product(opt):
        return opt._u_product.numpy()

    @staticmethod
    def learning_rate(opt):
        return np.asarray(opt.learning_rate).item() if not hasattr(opt.learning_rate, "numpy") \
            else opt.learning_rate.numpy().item()


def record(kind, n):
    logical_cpus(4)
    X = TensorFlow()
    out = {}
    for case in cases.generate():
        if case["strategy"] == kind and case["n"] == n:
            if os.environ.get("RECORD_VERBOSE"):
                print(case["id"], file=sys.stderr, flush=True)
            result = cases.run_case(X, case)
            if case["mode"] == "function" and "raises" in result and "bad" not in case:
                # TF cannot trace this step (Keras' gradient accumulation under MirroredStrategy calls merge_call
                # inside a cond; the all-reduce of mixed dtypes concatenates them): the eager step is the
                # reference, which a function must not change.
                result = dict(cases.run_case(X, dict(case, mode="eager")), function_refused=result)
            out[str(case["id"])] = result
    json.dump(out, sys.stdout)


def main():
    groups = sorted({(c["strategy"], c["n"]) for c in cases.generate()})
    procs = [(g, subprocess.Popen([sys.executable, __file__, g[0], str(g[1])], stdout=subprocess.PIPE, text=True))
             for g in groups]
    results = {}
    for g, p in procs:
        text, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"{g}: exit {p.returncode}")
        results.update(json.loads(text))
    out = {"tensorflow": tf.__version__, "keras": keras.__version__, "seed": cases.SEED, "count": cases.COUNT,
           "cases": {k: results[k] for k in sorted(results, key=int)}}
    write_reference("optimizer_differential_reference.json", out, separators=(",", ":"))
    print(f"{len(results)} cases", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        record(sys.argv[1], int(sys.argv[2]))
    else:
        main()
