"""``python -m mirrored.bench``: collective benchmarks in nccl-tests' format.

    python -m mirrored.bench all_reduce -b 8 -e 128M -f 2 --replicas 4 --algo auto

Columns and bandwidth formulas are nccl-tests': algbw = size / time and
busbw = algbw * factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, 1 for broadcast and reduce (GB = 1e9 bytes). Every size is
checked (``#wrong``: elements that differ from the exact expected result),
out-of-place and in-place.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from . import collectives

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "batch_all_reduce")
# nccl-tests' type names
TYPE_NAMES = {"float16": "half", "bfloat16": "bfloat16", "float32": "float", "float64": "double",
              "int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64"}


def parse_size(text: str) -> int:
    """'8', '64K', '128M', '1G' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected bytes like 8, 64K, 128M or 1G") from None


def _dtype(name: str):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise SystemExit("--dtype bfloat16 needs ml_dtypes: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Device:
    """Where the replicas' buffers live: host NumPy arrays or one CuPy array per GPU replica."""

    def __init__(self, kind: str, replicas: int):
        self.kind = kind
        self.replicas = replicas
        if kind == "gpu":
            try:
                import cupy
            except ImportError:
                raise SystemExit("--device gpu needs CuPy: pip install 'mirrored[cuda]'") from None
            from . import config
            ngpus = len(config.list_physical_devices("GPU"))
            if ngpus == 0:
                raise SystemExit("--device gpu: no GPU visible (mirrored.config.list_physical_devices('GPU') is empty)")
            self.cupy = cupy
            # Several replicas may share a GPU (logical GPUs), round-robin.
            self.ordinals = [r % ngpus for r in range(replicas)]

    def put(self, host: np.ndarray, replica: int):
        if self.kind == "cpu":
            return host
        with self.cupy.cuda.Device(self.ordinals[replica]):
            return self.cupy.asarray(host)

    def get(self, array) -> np.ndarray:
        return array if self.kind == "cpu" else self.cupy.asnumpy(array)

    def sync(self):
        if self.kind == "gpu":
            for d in sorted(set(self.ordinals)):
                self.cupy.cuda.Device(d).synchronize()


def _pattern(count: int, replica: int, op: str, dtype) -> np.ndarray:
    """Small integers, exact in every dtype, different on every replica."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":
        vals = np.where((i + replica) % 3 == 0, 2, np.where((i + replica) % 3 == 1, 1, -1))
    else:
        vals = (i * 7 + replica * 3) % 11 - 5
    if np.dtype(dtype).kind == "u":
        vals = np.abs(vals)
    return vals.astype(dtype)


def _expected(inputs, op: str, dtype) -> np.ndarray:
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if op == "mean":  # integers: NumPy true division, float64
        s = stack.sum(0) / len(inputs)
        return s if np.dtype(dtype).kind in "iu" else s.astype(dtype)
    ref = {"sum": stack.sum(0), "prod": stack.prod(0), "min": stack.min(0), "max": stack.max(0)}[op]
    return ref.astype(dtype)


def _wrong(results, expected) -> int:
    return int(sum(np.count_nonzero(np.asarray(r).astype(np.float64) != e) for r, e in zip(results, expected)))


class Case:
    """One collective at one size: inputs, how to run it, what it must produce."""

    def __init__(self, coll, dev, nbytes, dtype, op, algo, root, tensor_bytes):
        self.coll, self.dev, self.op, self.algo, self.root = coll, dev, op, algo, root
        n = dev.replicas
        self.itemsize = np.dtype(dtype).itemsize
        # all_gather's size is the gathered output (nccl-tests' convention).
        per_replica = nbytes // n if coll == "all_gather" else nbytes
        self.count = per_replica // self.itemsize
        self.host = [_pattern(self.count, r, op, dtype) for r in range(n)]
        self.bytes = self.count * self.itemsize * (n if coll == "all_gather" else 1)
        if coll == "all_gather":
            self.expect = [np.concatenate(self.host)] * n
        elif coll == "broadcast":
            self.expect = [self.host[root]] * n
        elif coll == "reduce":
            self.expect = [_expected(self.host, op, dtype)]
        else:
            self.expect = [_expected(self.host, op, dtype)] * n
        if coll == "batch_all_reduce":
            per = max(1, tensor_bytes // self.itemsize)
            self.splits = list(range(per, self.count, per))
        self.reset()

    def reset(self):
        self.bufs = [self.dev.put(h.copy(), r) for r, h in enumerate(self.host)]
        # Out-of-place results go to buffers allocated once, as nccl-tests does.
        out_dtype = np.float64 if self.integer_mean else self.host[0].dtype
        self.outs = [self.dev.put(np.zeros(h.shape, out_dtype), r) for r, h in enumerate(self.host)]
        if self.coll == "batch_all_reduce":  # the tensors of the batch: views, split once (not timed)
            xp = np if self.dev.kind == "cpu" else self.dev.cupy
            self.parts = [xp.split(x, self.splits) for x in self.bufs]

    @property
    def has_inplace(self):
        # The (float64) mean of integer buffers cannot be written into them.
        return self.coll in ("all_reduce", "broadcast", "reduce") and not self.integer_mean

    @property
    def integer_mean(self):
        reducing = self.coll in ("all_reduce", "reduce", "batch_all_reduce")
        return reducing and self.op == "mean" and self.host[0].dtype.kind in "iu"

    def run(self, inplace: bool):
        c, b = self.coll, self.bufs
        out = b if inplace else self.outs
        if c == "all_reduce":
            return collectives.all_reduce(b, self.op, out=out, algorithm=self.algo)
        if c == "broadcast":
            return collectives.broadcast(b, self.root, out=out)
        if c == "reduce":
            return [collectives.reduce(b, self.op, self.root, out=out)]
        if c == "all_gather":
            return collectives.all_gather(b, 0)
        return collectives.batch_all_reduce(self.parts, self.op, algorithm=self.algo)

    def check(self, inplace: bool) -> int:
        self.reset()
        res = self.run(inplace)
        self.dev.sync()
        if self.coll == "batch_all_reduce":  # each replica's tensors, end to end
            res = [np.concatenate([self.dev.get(t) for t in r]) if r else np.empty(0, self.host[0].dtype)
                   for r in res]
        return _wrong([self.dev.get(r) for r in res], self.expect)

    def time(self, inplace: bool, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            self.run(inplace)
        self.dev.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.run(inplace)
        self.dev.sync()
        return (time.perf_counter() - t0) / iters


def bus_factor(coll: str, n: int) -> float:
    if coll in ("all_reduce", "batch_all_reduce"):
        return 2 * (n - 1) / n
    if coll == "all_gather":
        return (n - 1) / n
    return 1.0


def iterations(nbytes: int, iters: int) -> int:
    # Keep each size near a fraction of a second on small machines.
    return max(3, min(iters, int(2e8 // max(nbytes, 1))))


def sizes(begin: int, end: int, factor: float) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(int(s))
        s = s * factor if factor > 1 else s + begin
    return out


def run(args) -> list[dict]:
    dev = Device(args.device, args.replicas)
    rows = []
    for algo in args.algo:
        for dtype_name in args.dtype:
            dtype = _dtype(dtype_name)
            for op in args.ops:
                for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
                    case = Case(args.collective, dev, nbytes, dtype, op, algo, args.root, args.tensor_bytes)
                    row = {"collective": args.collective, "algorithm": algo, "device": args.device,
                           "replicas": args.replicas, "size": case.bytes, "count": case.count,
                           "type": TYPE_NAMES[dtype_name], "redop": op,
                           "root": args.root if args.collective in ("broadcast", "reduce") else -1}
                    n_iter = iterations(case.bytes * args.replicas, args.iters)
                    for mode in ("out_of_place", "in_place"):
                        if mode == "in_place" and not case.has_inplace:
                            continue
                        inplace = mode == "in_place"
                        wrong = case.check(inplace)
                        t = case.time(inplace, n_iter, args.warmup)
                        algbw = case.bytes / t / 1e9 if t > 0 else 0.0
                        row[mode] = {"time_us": t * 1e6, "algbw": algbw,
                                     "busbw": algbw * bus_factor(args.collective, args.replicas), "wrong": wrong}
                    rows.append(row)
                    if not args.json:
                        print_row(row)
    return rows


HEADER = (
    "#                                                              out-of-place                       in-place\n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
)


def print_row(row: dict):
    def cols(m):
        if m is None:
            return f"{'n/a':>8s} {'n/a':>7s} {'n/a':>7s} {'n/a':>6s}"
        return f"{m['time_us']:8.1f} {m['algbw']:7.2f} {m['busbw']:7.2f} {m['wrong']:6d}"
    print(f"{row['size']:12d} {row['count']:13d} {row['type']:>9s} {row['redop']:>7s} {row['root']:7d} "
          f"{cols(row.get('out_of_place'))} {cols(row.get('in_place'))}", flush=True)


def plot(rows: list[dict], path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r.get("label", r["algorithm"]) for r in rows):
        pts = [r for r in rows if r.get("label", r["algorithm"]) == label]
        mode = "in_place" if "in_place" in pts[0] else "out_of_place"
        ax.plot([r["size"] for r in pts], [r[mode]["busbw"] for r in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mirrored.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("collective", choices=COLLECTIVES)
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("128M"))
    p.add_argument("-f", "--stepfactor", type=float, default=2.0)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--ops", default="sum", help="comma-separated: sum,prod,min,max,mean")
    p.add_argument("--dtype", default="float32", help="comma-separated dtypes")
    p.add_argument("--algo", default="auto", help="comma-separated: auto,ring,direct,tree (cpu); ring,tree,nccl (gpu)")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--tensor-bytes", type=parse_size, default=4096,
                   help="batch_all_reduce: bytes of each tensor the size is split into")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size, one line per algorithm")
    args = p.parse_args(argv)
    args.ops = [o.strip().lower() for o in args.ops.split(",")]
    args.dtype = [d.strip() for d in args.dtype.split(",")]
    args.algo = [a.strip().lower() for a in args.algo.split(",")]
    for d in args.dtype:
        if d not in TYPE_NAMES:
            p.error(f"--dtype {d}: use one of {', '.join(TYPE_NAMES)}")
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    if args.minbytes > args.maxbytes:
        p.error("-b must not exceed -e")

    if not args.json:
        from . import _core
        print(f"# mirrored.bench {args.collective}: {args.replicas} replicas on {args.device}, "
              f"algorithms {','.join(args.algo)}, host kernels {_core.isa()}, {_core.num_threads()} threads")
        print(HEADER)
    rows = run(args)
    wrong = sum(m["wrong"] for r in rows for m in (r.get("out_of_place"), r.get("in_place")) if m)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        bws = [r.get("in_place", r["out_of_place"])["busbw"] for r in rows]
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        print(f"# Avg bus bandwidth    : {sum(bws) / max(len(bws), 1):.4f}")
    if args.plot:
        plot(rows, args.plot, f"{args.collective}, {args.replicas} replicas ({args.device})")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
