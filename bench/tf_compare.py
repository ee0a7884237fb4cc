"""MirroredStrategy step costs, mirrored against TensorFlow, measured in one run.

    python bench/tf_compare.py --tf-python /path/to/venv-with-tensorflow/bin/python

Both frameworks run the same three measurements in separate processes, one
after the other for each replica count (TensorFlow's own MirroredStrategy on
N logical CPU devices, its fastest form: ``tf.function``):
  run(trivial)        strategy.run(lambda: 1.0)
  run(all_reduce)     strategy.run(lambda v: ctx.all_reduce(SUM, v)) on a float32 PerReplica
  reduce              strategy.reduce(SUM, PerReplica, axis=None) in cross-replica context
Median microseconds per step; sizes are bytes per replica.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIZES = [4, 4096, 256 << 10, 4 << 20, 64 << 20]


def timed(fn, size):
    iters = 200 if size <= 4096 else 50 if size <= (256 << 10) else 20 if size <= (4 << 20) else 8
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure_tf(n):
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    s = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    out = {"trivial": timed(tf.function(lambda: s.run(lambda: tf.constant(1.0))), 4)}
    for size in SIZES:
        x = s.experimental_distribute_values_from_function(
            lambda ctx: tf.ones(size // 4, tf.float32) * float(ctx.replica_id_in_sync_group + 1))
        ar = tf.function(lambda v: s.run(lambda t: tf.distribute.get_replica_context().all_reduce("SUM", t),
                                         args=(v,)))
        out[f"all_reduce_{size}"] = timed(lambda: s.experimental_local_results(ar(x))[0].numpy(), size)
        out[f"reduce_{size}"] = timed(lambda: s.reduce("SUM", x, axis=None).numpy(), size)
        assert np.allclose(s.reduce("SUM", x, axis=None).numpy(), n * (n + 1) / 2)
    return out


def measure_mirrored(n):
    import numpy as np
    import mirrored as md

    s = md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    out = {"trivial": timed(lambda: s.run(lambda: 1.0), 4)}
    for size in SIZES:
        x = s.experimental_distribute_values_from_function(
            lambda ctx: np.full(size // 4, ctx.replica_id_in_sync_group + 1, np.float32))
        fn = lambda v: md.get_replica_context().all_reduce("SUM", v)  # noqa: E731
        out[f"all_reduce_{size}"] = timed(lambda: s.experimental_local_results(s.run(fn, args=(x,)))[0], size)
        out[f"reduce_{size}"] = timed(lambda: s.reduce("SUM", x, axis=None), size)
        assert np.allclose(s.reduce("SUM", x, axis=None), n * (n + 1) / 2)
    return out


def fmt(us):
    return f"{us:,.0f} µs" if us < 10_000 else f"{us / 1000:,.1f} ms"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tf-python", required=True, help="a Python with tensorflow-cpu installed")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    print("| replicas | measurement | TensorFlow | mirrored | TF / mirrored |\n|---|---|---|---|---|")
    for n in args.replicas:
        res = {}
        for name, python in (("tf", args.tf_python), ("mirrored", sys.executable)):
            proc = subprocess.run([python, __file__, "--worker", name, str(n)], capture_output=True, text=True,
                                  timeout=1800)
            if proc.returncode:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        for key in res["tf"]:
            tf_us, md_us = res["tf"][key], res["mirrored"][key]
            label = key.replace("_", " ", 1)
            if key != "trivial":
                op, size = key.rsplit("_", 1)
                size = int(size)
                label = f"{op} {size >> 20} MiB" if size >= 1 << 20 else f"{op} {size >> 10} KiB" if size >= 1024 \
                    else f"{op} {size} B"
            print(f"| {n} | {label} | {fmt(tf_us)} | {fmt(md_us)} | {tf_us / md_us:.1f}x |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        measure = measure_tf if sys.argv[2] == "tf" else measure_mirrored
        print(json.dumps(measure(int(sys.argv[3]))))
    else:
        main()
