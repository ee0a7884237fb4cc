"""``python -m mirrored.bench``: collective benchmarks in nccl-tests' format.

    python -m mirrored.bench all_reduce -b 8 -e 128M -f 2 -g 4 -A auto,ring

Columns and bandwidth formulas are nccl-tests': algbw = size / time and
busbw = algbw * factor, with factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, 1 for broadcast and reduce (GB = 1e9 bytes; n counts every
replica of the job). Every size is checked (``#wrong``: elements that differ
from the exact expected result), out-of-place and in-place; ``-c N`` checks
N times, ``-c 0`` not at all. Flags and type and operation names are
nccl-tests' too (``-b -e -f -i -n -w -c -d -o -r -a``, ``-d float``,
``-o avg``, ``all``); the algorithm, which nccl-tests leaves to NCCL_ALGO,
is ``-A``/``--algo``. Two columns follow nccl-tests' thirteen: the fastest
and the slowest rank's time (of the in-place run where there is one).
``--csv`` and ``--json`` print the same results for scripts.

Started as every task of a multi-worker job (``TF_CONFIG`` naming several
tasks, as ``mirrored-run -np N`` sets it), the benchmark runs across the job:
``--replicas`` replicas per worker, the time reported as ``-a`` says
(nccl-tests': 0 rank 0's, 1 the average over ranks, 2 the minimum, 3 the
maximum; a rank is a worker process), ``#wrong`` summed, one table printed
by task 0.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import socket
import sys
import time

import numpy as np

from ..collective import api as collectives

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "batch_all_reduce")
REDUCING = ("all_reduce", "reduce", "batch_all_reduce")
# NumPy dtype name -> nccl-tests' type name (what the table prints).
TYPE_NAMES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "int64": "int64", "float16": "half",
              "float32": "float", "float64": "double", "bfloat16": "bfloat16"}
# Our op name -> nccl-tests' name; `avg` is NCCL's name for the mean.
OP_NAMES = {"sum": "sum", "prod": "prod", "max": "max", "min": "min", "mean": "avg"}
CPU_ALGORITHMS = ("auto", "ring", "direct", "tree")
GPU_ALGORITHMS = ("auto", "ring", "tree", "nccl")
RECORD_BYTES = 96  # one replica's "host pid device" line in the devices block, exchanged in multi-worker runs
# nccl-tests' -a: which rank's time the table reports.
AVERAGES = {0: "rank 0", 1: "average", 2: "minimum", 3: "maximum"}
# Sizes per table at most: more rows than any sweep needs (8 B .. 128 MiB by 2 is 25), fewer than a typo makes.
MAX_ROWS = 1000


def parse_size(text: str) -> int:
    """'8', '64K', '128M', '1G' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    try:
        value = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except (ValueError, OverflowError):  # OverflowError: "infK"
        raise argparse.ArgumentTypeError(f"size {text!r}: expected bytes like 8, 64K, 128M or 1G") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size {text!r} is negative")
    return value


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def skipped_dtypes() -> dict[str, str]:
    """The types ``-d all`` leaves out here, each with why (nccl-tests' name -> reason)."""
    if _bfloat16() is None:
        return {"bfloat16": "ml_dtypes is not installed (pip install ml_dtypes)"}
    return {}


def parse_dtypes(text: str) -> list[str]:
    """nccl-tests' or NumPy's type names (comma-separated, or ``all``) -> NumPy names; ValueError if unknown."""
    by_name = {**{v: k for k, v in TYPE_NAMES.items()}, **{k: k for k in TYPE_NAMES}}
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return [d for d in TYPE_NAMES if TYPE_NAMES[d] not in skipped_dtypes()]
    out = []
    for name in names:
        if name not in by_name:
            raise ValueError(f"--dtype {name}: use nccl-tests' names ({', '.join(dict.fromkeys(TYPE_NAMES.values()))}),"
                             f" NumPy's ({', '.join(TYPE_NAMES)}) or all")
        if by_name[name] == "bfloat16" and _bfloat16() is None:
            raise ValueError("--dtype bfloat16 needs ml_dtypes: pip install ml_dtypes")
        out.append(by_name[name])
    if not out:
        raise ValueError("--dtype is empty")
    return out


def parse_ops(text: str) -> list[str]:
    """sum,prod,min,max,avg (or mean), or ``all`` -> our op names; ValueError if unknown."""
    names = [o.strip().lower() for o in text.split(",") if o.strip()]
    if names == ["all"]:
        return list(OP_NAMES)
    aliases = {**{v: k for k, v in OP_NAMES.items()}, **{k: k for k in OP_NAMES}}
    bad = [o for o in names if o not in aliases]
    if bad or not names:
        raise ValueError(f"--op {','.join(bad) or repr(text)}: use sum, prod, min, max, avg (or mean), comma-separated, "
                         "or all")
    return [aliases[o] for o in names]


class Device:
    """Where this process's replicas keep their buffers: host NumPy arrays or one CuPy array per GPU replica."""

    def __init__(self, kind: str, replicas: int):
        self.kind = kind
        self.replicas = replicas
        self.names = []
        if kind == "cpu":
            self.names = [f"cpu:{r}" for r in range(replicas)]
            return
        try:
            import cupy
        except ImportError:
            raise ValueError("--device gpu needs CuPy: pip install 'mirrored[cuda]'") from None
        from ..device import config
        ngpus = len(config.list_physical_devices("GPU"))
        if ngpus == 0:
            raise ValueError("--device gpu: no GPU visible (mirrored.config.list_physical_devices('GPU') is empty)")
        self.cupy = cupy
        # Several replicas may share a GPU (logical GPUs), round-robin.
        self.ordinals = [r % ngpus for r in range(replicas)]
        for o in self.ordinals:
            props = cupy.cuda.runtime.getDeviceProperties(o)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            self.names.append(f"gpu:{o} [{props.get('pciBusID', 0):#04x}] {name}")

    @property
    def device_strings(self) -> list[str]:
        return [f"/{self.kind}:{o}" for o in (self.ordinals if self.kind == "gpu" else range(self.replicas))]

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


class Local:
    """This process's replicas only: the functions of mirrored.collectives."""

    rank, workers = 0, 1
    engine = collectives

    def barrier(self):
        pass

    def gather(self, values) -> np.ndarray:
        """Every rank's ``values``, one row per rank (here: one)."""
        return np.asarray(values, np.float64)[None]

    def records(self, mine: list[str]) -> list[str]:
        return mine

    def close(self):
        pass


class Job:
    """Every replica of every worker of the TF_CONFIG job: a CollectiveGroup runs the collectives."""

    def __init__(self, resolver, device: Device):
        from ..distribute.collective_all_reduce import CollectiveGroup

        self.group = CollectiveGroup.from_cluster_resolver(resolver, device.replicas, scope="mirrored.bench",
                                                           devices=device.device_strings)
        self.engine = self.group
        self.rank, self.workers, self.local = self.group.rank, self.group.num_workers, device.replicas

    def barrier(self):
        self.group.barrier()

    def gather(self, values) -> np.ndarray:
        """Every worker's ``values``, one row per worker in rank order."""
        mine = np.asarray(values, np.float64)[None]
        rows = self.group.all_gather([mine.copy() for _ in range(self.local)], 0)[0]
        return rows[::self.local]  # each worker's replicas all sent its row: keep the first

    def records(self, mine: list[str]) -> list[str]:
        rows = [np.frombuffer(r.encode()[:RECORD_BYTES].ljust(RECORD_BYTES), np.uint8) for r in mine]
        gathered = self.group.all_gather([r[None] for r in rows], 0)[0]
        return [bytes(r).decode(errors="replace").rstrip() for r in gathered]

    def close(self):
        self.group.close()


def _pattern(count: int, replica: int, op: str, dtype) -> np.ndarray:
    """Small integers, exact in every dtype, different on every replica of the job."""
    i = np.arange(count, dtype=np.int64)
    if op == "prod":
        vals = np.where((i + replica) % 3 == 0, 2, np.where((i + replica) % 3 == 1, 1, -1))
    else:
        vals = (i * 7 + replica * 3) % 11 - 5
    if np.dtype(dtype).kind == "u":
        vals = np.abs(vals)
    return vals.astype(dtype)


def _expected(count: int, replicas: int, op: str, dtype) -> np.ndarray:
    """The reduction over every replica of the job, folded one replica at a time (memory: two buffers)."""
    fold = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    acc = _pattern(count, 0, op, dtype).astype(np.float64)
    for g in range(1, replicas):
        fold(acc, _pattern(count, g, op, dtype), out=acc)
    if op == "mean":  # integers: NumPy true division, float64
        acc /= replicas
        return acc if np.dtype(dtype).kind in "iu" else acc.astype(dtype)
    return acc.astype(dtype)


def _wrong(results, expected) -> int:
    return int(sum(np.count_nonzero(np.asarray(r).astype(np.float64) != e) for r, e in zip(results, expected)))


class Case:
    """One collective at one size: this process's inputs, how to run it, what it must produce."""

    def __init__(self, coll, dev, comm, nbytes, dtype, op, algo, root, tensor_bytes):
        self.coll, self.dev, self.comm, self.op, self.algo, self.root = coll, dev, comm, op, algo, root
        local = dev.replicas
        total = local * comm.workers
        first = comm.rank * local  # this worker's first replica in the job
        self.itemsize = np.dtype(dtype).itemsize
        # all_gather's size is the gathered output (nccl-tests' convention).
        per_replica = nbytes // total if coll == "all_gather" else nbytes
        self.count = per_replica // self.itemsize
        pattern_op = op if coll in REDUCING else "sum"
        self.host = [_pattern(self.count, first + r, pattern_op, dtype) for r in range(local)]
        self.bytes = self.count * self.itemsize * (total if coll == "all_gather" else 1)
        if coll == "all_gather":
            self.expect = [np.concatenate([_pattern(self.count, g, pattern_op, dtype) for g in range(total)])] * local
        elif coll == "broadcast":
            self.expect = [_pattern(self.count, root, pattern_op, dtype)] * local
        elif coll == "reduce":
            self.expect = [_expected(self.count, total, op, dtype)]
        else:
            self.expect = [_expected(self.count, total, op, dtype)] * local
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
        return self.coll in REDUCING and self.op == "mean" and self.host[0].dtype.kind in "iu"

    def run(self, inplace: bool):
        c, b, engine = self.coll, self.bufs, self.comm.engine
        out = b if inplace else self.outs
        if c == "all_reduce":
            return engine.all_reduce(b, self.op, out=out, algorithm=self.algo)
        if c == "broadcast":
            return engine.broadcast(b, self.root, out=out)
        if c == "reduce":
            return [engine.reduce(b, self.op, self.root, out=out)]
        if c == "all_gather":
            return engine.all_gather(b, 0)
        return engine.batch_all_reduce(self.parts, self.op, algorithm=self.algo)

    def check(self, inplace: bool) -> int:
        """Elements that differ from the expected result after one run from fresh inputs."""
        self.reset()
        res = self.run(inplace)
        self.dev.sync()
        if self.coll == "reduce" and res[0] is None:  # the root replica lives on another worker
            return 0
        if self.coll == "batch_all_reduce":  # each replica's tensors, end to end
            res = [np.concatenate([self.dev.get(t) for t in r]) if r else np.empty(0, self.host[0].dtype)
                   for r in res]
        return _wrong([self.dev.get(r) for r in res], self.expect)

    def time(self, inplace: bool, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            self.run(inplace)
        self.dev.sync()
        self.comm.barrier()  # every worker starts the timed loop together
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


def count_sizes(begin: int, end: int, factor: float, step_bytes: int | None) -> int:
    """How many sizes ``sizes`` gives, computed without making them (a typo must not loop or fill memory)."""
    if step_bytes:
        return (end - begin) // step_bytes + 1
    return math.floor(math.log(end / begin, factor) + 1e-9) + 1  # + 1e-9: 8 * 2**4 == 128 counts 128


def sizes(begin: int, end: int, factor: float, step_bytes: int | None) -> list[int]:
    """nccl-tests' sweep: from ``begin`` to ``end``, adding ``step_bytes`` or else multiplying by ``factor`` (> 1)."""
    out, s = [], begin
    while s <= end:
        out.append(int(s))
        s, before = (s + step_bytes if step_bytes else s * factor), s
        if s == before:  # -b 0 -e 0: one row (a sweep from 0 to more is refused by the CLI)
            break
    return out


def run(args, dev: Device, comm, printer=None) -> list[dict]:
    total = dev.replicas * comm.workers
    rows = []
    for algo in args.algo:
        if printer:
            printer.block(algo)
        for dtype_name in args.dtype:
            dtype = np.dtype(_bfloat16()) if dtype_name == "bfloat16" else np.dtype(dtype_name)
            for op in args.ops if args.collective in REDUCING else ["none"]:
                for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes):
                    case = Case(args.collective, dev, comm, nbytes, dtype, op, algo, args.root, args.tensor_bytes)
                    row = {"collective": args.collective, "algorithm": algo, "device": args.device,
                           "replicas": total, "workers": comm.workers, "size": case.bytes, "count": case.count,
                           "type": TYPE_NAMES[dtype_name], "redop": OP_NAMES.get(op, "none"),
                           "root": args.root if args.collective in ("broadcast", "reduce") else -1}
                    for mode in ("out_of_place", "in_place"):
                        if mode == "in_place" and not case.has_inplace:
                            continue
                        inplace = mode == "in_place"
                        wrong = sum(case.check(inplace) for _ in range(args.check))
                        ranks = comm.gather([case.time(inplace, args.iters, args.warmup), wrong])
                        times = ranks[:, 0]
                        t = {0: times[0], 1: times.mean(), 2: times.min(), 3: times.max()}[args.average]
                        algbw = case.bytes / t / 1e9 if t > 0 else 0.0
                        row[mode] = {"time_us": t * 1e6, "algbw": algbw, "busbw": algbw * bus_factor(
                            args.collective, total), "wrong": int(ranks[:, 1].sum()) if args.check else None,
                            "time_min_us": times.min() * 1e6, "time_max_us": times.max() * 1e6}
                    rows.append(row)
                    if printer:
                        printer.row(row)
    return rows


COLUMNS = (
    "#                                                              out-of-place                       in-place"
    "          over ranks\n"
    "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
    "      min      max\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
    "             (us)     (us)"
)


class TablePrinter:
    """nccl-tests' text output: parameter header, devices block, then a titled block per algorithm."""

    def __init__(self, args, meta: dict, devices: list[str]):
        step = f"{args.stepbytes}(bytes)" if args.stepbytes else f"{args.stepfactor:g}(factor)"
        print(f"# nThread 1 nReplicas {meta['replicas']} nWorkers {meta['workers']} minBytes {args.minbytes} "
              f"maxBytes {args.maxbytes} step: {step} warmup iters: {args.warmup} iters: {args.iters} "
              f"validation: {args.check}")
        print(f"# mirrored {meta['version']} {args.collective} on {args.device}: host kernels {meta['isa']}, "
              f"{meta['threads']} pool threads; time: {AVERAGES[args.average]} over ranks (-a {args.average})")
        for line in type_notes(args):
            print(f"# {line}")
        print("#\n# Using devices")
        for rank, line in enumerate(devices):
            print(f"#  Rank {rank:2d} Group  0 {line}")
        print("#", flush=True)

    def block(self, algo: str):
        print(f"#\n# Algorithm: {algo}\n{COLUMNS}", flush=True)

    def row(self, row: dict):
        def cols(m):
            if m is None:
                return f"{'n/a':>8s} {'n/a':>7s} {'n/a':>7s} {'n/a':>6s}"
            wrong = f"{m['wrong']:6d}" if m["wrong"] is not None else f"{'N/A':>6s}"
            return f"{m['time_us']:8.1f} {m['algbw']:7.2f} {m['busbw']:7.2f} {wrong}"
        spread = row.get("in_place", row["out_of_place"])
        print(f"{row['size']:12d} {row['count']:13d} {row['type']:>9s} {row['redop']:>7s} {row['root']:7d} "
              f"{cols(row.get('out_of_place'))} {cols(row.get('in_place'))} "
              f"{spread['time_min_us']:8.1f} {spread['time_max_us']:8.1f}", flush=True)

    @staticmethod
    def summary(rows: list[dict], wrong: int, check: bool):
        def avg(rs):
            bws = [r.get("in_place", r["out_of_place"])["busbw"] for r in rs]
            return sum(bws) / max(len(bws), 1)
        print(f"# Out of bounds values : {wrong if check else 'N/A'} {'OK' if wrong == 0 else 'FAILED'}")
        print(f"# Avg bus bandwidth    : {avg(rows):.4f}")
        algos = list(dict.fromkeys(r["algorithm"] for r in rows))
        if len(algos) > 1:
            for a in algos:
                print(f"#   {a:<12s}: {avg([r for r in rows if r['algorithm'] == a]):.4f}")
        print("#")


CSV_FIELDS = ("collective", "algorithm", "device", "workers", "replicas", "size", "count", "type", "redop", "root")
CSV_MODE_FIELDS = ("time_us", "algbw", "busbw", "wrong", "time_min_us", "time_max_us")


def write_csv(rows: list[dict], out) -> None:
    """One line per row: the row's fields, then each mode's (``oop_``/``ip_``), empty where a mode has none."""
    modes = (("oop", "out_of_place"), ("ip", "in_place"))
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*CSV_FIELDS, *(f"{short}_{f}" for short, _ in modes for f in CSV_MODE_FIELDS)])
    for r in rows:
        cells = [r[f] for f in CSV_FIELDS]
        for _, mode in modes:
            m = r.get(mode)
            cells += ["" if m is None or m[f] is None else m[f] for f in CSV_MODE_FIELDS]
        writer.writerow(cells)


def type_notes(args) -> list[str]:
    """What ``-d all`` ran and what it skipped, and why (nothing when the types were named)."""
    if not args.all_dtypes:
        return []
    skipped = skipped_dtypes()
    ran = " ".join(TYPE_NAMES[d] for d in args.dtype)
    if not skipped:
        return [f"-d all: {ran} (none skipped)"]
    return [f"-d all: {ran}"] + [f"-d all skips {name}: {why}" for name, why in skipped.items()]


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


def parser() -> argparse.ArgumentParser:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = argparse.ArgumentParser(prog="python -m mirrored.bench", description=__doc__.split("\n\n", 1)[1],
                                formatter_class=Formatter)
    p.add_argument("collective", choices=COLLECTIVES, help="the collective to time")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (8, 64K, 128M, 1G)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=128 << 20, help="largest size")
    p.add_argument("-f", "--stepfactor", type=_positive(float), default=2.0,
                   help="multiply the size by this between rows (> 1)")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=None,
                   help="add this many bytes between rows instead of multiplying (> 0)")
    p.add_argument("-n", "--iters", type=_positive(int), default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=_non_negative_int, default=5, help="untimed iterations before timing")
    p.add_argument("-c", "--check", type=_non_negative_int, default=1, metavar="N",
                   help="validate results N times per size (#wrong, summed); 0: no validation")
    p.add_argument("-a", "--average", type=int, choices=sorted(AVERAGES), default=1,
                   help="the time reported across ranks: " + ", ".join(f"{k} {v}" for k, v in AVERAGES.items()))
    p.add_argument("-g", "--replicas", type=_positive(int), default=4, help="replicas (per worker in a job)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where the replicas' buffers live")
    p.add_argument("-o", "--op", "--ops", dest="ops", default="sum",
                   help="comma-separated: sum,prod,min,max,avg (mean), or all")
    p.add_argument("-d", "--dtype", "--datatype", dest="dtype", default="float",
                   help="comma-separated nccl-tests types (int8,uint8,int32,int64,half,float,double,bfloat16) "
                        "or NumPy names (float32, ...), or all")
    p.add_argument("-A", "--algo", "--algorithm", dest="algo", default="auto",
                   help=f"comma-separated: {','.join(CPU_ALGORITHMS)} (cpu); {','.join(GPU_ALGORITHMS)} (gpu)")
    p.add_argument("-r", "--root", type=_non_negative_int, default=0,
                   help="broadcast/reduce root replica (of the whole job)")
    p.add_argument("--tensor-bytes", type=_positive(parse_size), default=4096,
                   help="batch_all_reduce: bytes of each tensor the size is split into")
    formats = p.add_mutually_exclusive_group()
    formats.add_argument("--json", action="store_true", help="print the results as JSON (metadata + results)")
    formats.add_argument("--csv", action="store_true", help="print the results as CSV, one line per size")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size, one line per algorithm "
                                                      "(needs matplotlib)")
    return p


def _job_resolver(p):
    """The TF_CONFIG resolver when TF_CONFIG names a job of several tasks, else None."""
    if not os.environ.get("TF_CONFIG"):
        return None
    from ..distribute.cluster_resolver import TFConfigClusterResolver, collective_tasks

    try:
        resolver = TFConfigClusterResolver()
        tasks = collective_tasks(resolver.cluster_spec())
    except ValueError as e:
        p.error(f"TF_CONFIG: {e}")
    if len(tasks) <= 1:
        return None
    if (resolver.task_type, resolver.task_id) not in tasks:
        p.error(f"TF_CONFIG names {len(tasks)} chief/worker tasks but this task is "
                f"{resolver.task_type}:{resolver.task_id}; start the benchmark on the chief and worker tasks")
    return resolver, len(tasks)


def _available_memory() -> int | None:
    """Bytes this machine can still give (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_sweep(p, args) -> None:
    """Refuses sizes, steps and replica counts that cannot progress or cannot fit, naming the flag."""
    if args.minbytes > args.maxbytes:
        p.error(f"-b {args.minbytes} exceeds -e {args.maxbytes}")
    if args.stepbytes is not None and args.stepbytes == 0:
        p.error("-i 0: the size would never grow; give a step of 1 byte or more, or leave -i out for -f")
    if args.stepbytes is None:
        if args.minbytes == 0 and args.maxbytes > 0:
            p.error(f"-b 0: multiplying 0 by -f {args.stepfactor:g} never reaches -e {args.maxbytes}; start at "
                    "-b 1 or more (nccl-tests' default is 8), or step in bytes with -i")
        if args.stepfactor <= 1 and args.maxbytes > args.minbytes:
            p.error(f"-f {args.stepfactor:g}: the size must grow; use a factor > 1 (e.g. -f 2), or step in bytes "
                    "with -i")
    rows = 1 if args.maxbytes == args.minbytes else count_sizes(args.minbytes, args.maxbytes, args.stepfactor,
                                                                 args.stepbytes)
    if rows > MAX_ROWS:
        flag = f"-i {args.stepbytes}" if args.stepbytes else f"-f {args.stepfactor:g}"
        p.error(f"{flag}: -b {args.minbytes} to -e {args.maxbytes} makes {rows} sizes (at most {MAX_ROWS}); "
                "take a larger step")
    # Each replica holds its input, output and expected result, and the host keeps a pattern: about 4 buffers.
    need, available = 4 * args.replicas * args.maxbytes, _available_memory()
    if args.device == "cpu" and available is not None and need > available:
        p.error(f"-g {args.replicas} -e {args.maxbytes}: the buffers need about {need / 2**30:.1f} GiB, more than the "
                f"{available / 2**30:.1f} GiB this machine has free; lower -g or -e")


def parse_args(argv=None):
    """(args, device, job resolver or None): every argument error is an argparse error, raised before any run."""
    p = parser()
    args = p.parse_args(argv)
    try:
        args.ops = parse_ops(args.ops)
        args.all_dtypes = args.dtype.strip().lower() == "all"
        args.dtype = parse_dtypes(args.dtype)
    except ValueError as e:
        p.error(str(e))
    _check_sweep(p, args)
    args.algo = [a.strip().lower() for a in args.algo.split(",") if a.strip()]
    allowed = CPU_ALGORITHMS if args.device == "cpu" else GPU_ALGORITHMS
    bad = [a for a in args.algo if a not in allowed]
    if bad or not args.algo:
        p.error(f"--algo {','.join(bad) or '(empty)'}: {args.device} replicas take {', '.join(allowed)}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'mirrored[plot]'")
        # Checked now: a folder that is not there would otherwise fail only after the whole sweep has run.
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--plot {args.plot}: cannot write into {folder}; create the folder or pick another path")
    job = _job_resolver(p)
    workers = job[1] if job else 1
    total = args.replicas * workers
    if args.collective in ("broadcast", "reduce") and args.root >= total:
        p.error(f"--root {args.root}: the job has {total} replicas ({args.replicas} per worker x {workers} "
                f"worker(s)); use 0..{total - 1}")
    try:
        device = Device(args.device, args.replicas)
    except ValueError as e:
        p.error(str(e))
    if "nccl" in args.algo and len(set(device.ordinals)) == 1 < len(device.ordinals):
        p.error(f"--algo nccl needs several GPUs (several replicas per GPU take the hierarchical engine); "
                f"{args.replicas} replicas share one GPU (use --algo ring)")
    return args, device, job[0] if job else None


def metadata(args, comm, device: Device) -> dict:
    from .. import __version__
    from .._core import isa, num_threads

    return {"version": __version__, "isa": isa(), "threads": int(num_threads()),
            "collective": args.collective, "device": args.device, "device_names": device.names,
            "replicas": args.replicas * comm.workers, "replicas_per_worker": args.replicas,
            "workers": comm.workers, "iters": args.iters, "warmup": args.warmup, "validation": bool(args.check),
            "check_iters": args.check, "average": args.average, "average_name": AVERAGES[args.average],
            "skipped_types": skipped_dtypes() if args.all_dtypes else {},
            "min_bytes": args.minbytes, "max_bytes": args.maxbytes,
            "step": {"bytes": args.stepbytes} if args.stepbytes else {"factor": args.stepfactor},
            "algorithms": args.algo, "types": [TYPE_NAMES[d] for d in args.dtype],
            "ops": [OP_NAMES[o] for o in args.ops] if args.collective in REDUCING else ["none"],
            "host": socket.gethostname(), "python": platform.python_version(), "numpy": np.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    args, device, resolver = parse_args(argv)
    comm = Job(resolver, device) if resolver is not None else Local()
    try:
        meta = metadata(args, comm, device)
        host, pid = socket.gethostname(), os.getpid()
        devices = comm.records([f"Pid {pid:6d} on {host:>10s} device {name}" for name in device.names])
        leader = comm.rank == 0
        printer = TablePrinter(args, meta, devices) if leader and not (args.json or args.csv) else None
        rows = run(args, device, comm, printer)
    finally:
        comm.close()
    wrong = sum(m["wrong"] or 0 for r in rows for m in (r.get("out_of_place"), r.get("in_place")) if m)
    if leader:
        if args.json or args.csv:
            for line in type_notes(args):
                print(f"# {line}", file=sys.stderr)
        if args.json:
            json.dump({"metadata": {**meta, "devices": devices}, "results": rows}, sys.stdout, indent=1)
            print()
        elif args.csv:
            write_csv(rows, sys.stdout)
        else:
            TablePrinter.summary(rows, wrong, args.check)
        if args.plot:
            where = f"{meta['workers']} worker(s), " if meta["workers"] > 1 else ""
            plot(rows, args.plot, f"{args.collective}, {where}{meta['replicas']} replicas ({args.device})")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
