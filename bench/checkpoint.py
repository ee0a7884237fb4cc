"""What checkpoints cost: restore memory, TensorBundle checking speed, and the preemption handler's per-step price.

    python bench/checkpoint.py --mib 96 --variables 6 --replicas 2 --steps 400

Three same-run comparisons on the CPU:

1. ``restore`` peak memory (tracemalloc, in a fresh process per case) of a
   checkpoint of ``--variables`` float32 variables totalling ``--mib`` MiB,
   against ``load_checkpoint`` (the whole file as arrays) followed by the
   same assignments: the streaming restore needs one variable beyond the
   model, loading first needs the whole file again.
2. CRC32C throughput (TensorBundle's per-tensor check) in NumPy lanes
   against the byte-at-a-time loop, MB/s.
3. ``PreemptionCheckpointHandler.run(step)`` against calling ``step``
   directly, microseconds per step (median of interleaved rounds), with
   ``--replicas`` CPU replicas of one worker (which reads no store) and a
   step that applies one small gradient.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import mirrored as md
from mirrored.train import tensorbundle

_PEAK = """
import sys, tracemalloc, numpy as np, mirrored as md
path, mode, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
strategy = md.MirroredStrategy(devices=["/cpu:0"])
with strategy.scope():
    model = [md.Variable(np.full(size, i, np.float32)) for i in range(n)]
if mode == "write":
    md.train.Checkpoint(model=model).write(path)
    sys.exit(0)
tracemalloc.start()
if mode == "restore":
    md.train.Checkpoint(model=model).restore(path)
else:
    arrays = md.train.load_checkpoint(path)
    for i, v in enumerate(model):
        v.assign(arrays[f"model/{i}"])
print(tracemalloc.get_traced_memory()[1])
"""


def restore_memory(mib: int, variables: int) -> None:
    size = mib * (1 << 20) // 4 // variables
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")

        def run(mode):
            out = subprocess.run([sys.executable, "-c", _PEAK, path, mode, str(variables), str(size)],
                                 capture_output=True, text=True, check=True).stdout
            return int(out) if out.strip() else 0

        run("write")
        streamed, loaded = run("restore"), run("load")
    model = variables * size * 4
    print(f"restore memory, {variables} x {size * 4 / 2**20:.0f} MiB variables (allocated during the call, "
          "the new values included)")
    print(f"  restore (streaming)          {streamed / 2**20:8.1f} MiB  = {streamed / model:.2f} x the model")
    print(f"  load_checkpoint + assign     {loaded / 2**20:8.1f} MiB  = {loaded / model:.2f} x the model")


def crc_speed(mib: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8).tobytes()
    small = data[:max(1, mib // 16) << 20]
    t0 = time.perf_counter()
    tensorbundle.crc32c(data)
    t1 = time.perf_counter()
    tensorbundle._crc32c_bytes(small, 0)
    t2 = time.perf_counter()
    fast, slow = len(data) / (t1 - t0) / 1e6, len(small) / (t2 - t1) / 1e6
    print(f"CRC32C over {mib} MiB: NumPy lanes {fast:6.1f} MB/s, byte loop {slow:6.1f} MB/s "
          f"(x{fast / slow:.1f})")


def handler_overhead(replicas: int, steps: int, rounds: int = 7) -> None:
    strategy = md.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        w = md.Variable(np.zeros((64, 10), np.float32))
        opt = md.optimizers.SGD(0.01)
    grad = np.full((64, 10), 1e-3, np.float32)

    def step():
        strategy.run(lambda: opt.apply_gradients([(grad, w)]))

    with tempfile.TemporaryDirectory() as tmp:
        handler = md.distribute.experimental.PreemptionCheckpointHandler(
            None, md.train.Checkpoint(w=w, optimizer=opt), checkpoint_dir=tmp)
        cases = [step, lambda: handler.run(step)]
        samples = [[] for _ in cases]
        per_round = max(1, steps // rounds)
        for _ in range(rounds):
            for fn, out in zip(cases, samples):
                t0 = time.perf_counter()
                for _ in range(per_round):
                    fn()
                out.append((time.perf_counter() - t0) / per_round)
    direct, handled = (statistics.median(s) * 1e6 for s in samples)
    print(f"per step, {replicas} CPU replicas: step() {direct:8.1f} us, handler.run(step) {handled:8.1f} us "
          f"(x{handled / direct:.2f}, {handled - direct:+.1f} us)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=96, help="checkpoint size in MiB (default 96)")
    parser.add_argument("--variables", type=int, default=6, help="variables it holds (default 6)")
    parser.add_argument("--crc-mib", type=int, default=32, help="bytes to checksum, MiB (default 32)")
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas for the handler (default 2)")
    parser.add_argument("--steps", type=int, default=400, help="steps timed per case (default 400)")
    args = parser.parse_args(argv)
    for name in ("mib", "variables", "crc_mib", "replicas", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    restore_memory(args.mib, args.variables)
    crc_speed(args.crc_mib)
    handler_overhead(args.replicas, args.steps)


if __name__ == "__main__":
    main()
