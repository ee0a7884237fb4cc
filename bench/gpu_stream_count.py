"""Whether the blocking streams alive on a GPU cost a launch on its legacy default stream, and so
every replica context collective on logical GPUs (real GPUs only: the simulator has no driver costs).

A replica context's collective runs on the legacy default stream (device/gpu.py MergeOrder), which
CUDA orders after every blocking stream of the device, and each GPU replica owns one such stream
(device/gpu.py replica_stream). Profiled on an H100, ``strategy.run(all_reduce 4 B)``'s native call
took ~21 µs at 2 logical GPUs and ~46 µs at 8, against ~9-12 µs for the whole all-reduce called
alone (before any replica stream existed). Host µs per call, in one process, in this order:

1. ``collectives.all_reduce`` of 4 B on ``--replicas`` buffers of GPU 0 on the legacy stream, one
   tiny CuPy kernel on the legacy stream and one on a non-blocking stream, with 0, then 2, 4, 8, 16
   blocking streams alive (``--busy``: each with a tiny kernel queued before every call; a last
   column times those alone); those streams are destroyed after it;
2. ``strategy.run(all_reduce 4 B)`` on ``--replicas`` logical GPUs, first with every replica of
   GPU 0 on one stream (the only blocking stream alive), then with a stream each (the design today).

::

    python bench/gpu_stream_count.py --replicas 8
    python bench/gpu_stream_count.py --replicas 8 --busy

If the columns grow with the stream count, the design's cost is the legacy stream's synchronisation
with every replica stream, not host work (docs/gpu_call_path.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mirrored as md
from mirrored import collectives
from mirrored.device import gpu as _gpu


def per_call_us(call, cupy, repeat: int, rounds: int = 5) -> float:
    """Median over rounds of the host µs per call, ``repeat`` calls a round (the device drained between rounds)."""
    call()
    cupy.cuda.Device(0).synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            call()
        times.append((time.perf_counter() - t0) / repeat)
        cupy.cuda.Device(0).synchronize()
    return statistics.median(times) * 1e6


def run_all_reduce_us(cupy, n: int, repeat: int, one_stream: bool) -> float:
    """µs per strategy.run(replica-context all_reduce of 4 B) on n logical GPUs of GPU 0; ``one_stream``:
    every replica on replica 0's stream (its scopes are made at the first run, under the substitution)."""
    s = md.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
    x = s.experimental_distribute_values_from_function(lambda ctx: cupy.ones(1, cupy.float32))
    step = lambda: s.run(lambda v: md.get_replica_context().all_reduce("sum", v), args=(x,))  # noqa: E731
    own = _gpu.replica_stream
    if one_stream:
        _gpu.replica_stream = lambda replica_id, ordinal: own(0, ordinal)
    try:
        step()
    finally:
        _gpu.replica_stream = own
    return per_call_us(step, cupy, repeat)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--streams", type=int, nargs="+", default=[0, 2, 4, 8, 16])
    p.add_argument("--busy", action="store_true", help="queue one tiny kernel on every extra stream before each call")
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    if _gpu.engine_name() == "sim":
        raise SystemExit("this check needs a real GPU (the simulator has no driver costs)")
    cupy = _gpu.cupy_module()
    n = args.replicas
    md.config.set_logical_device_configuration("GPU", 0, count=n)
    stream_count_table(cupy, n, args)  # (first: no replica stream alive yet; its own streams go after it)
    shared = run_all_reduce_us(cupy, n, args.repeat, one_stream=True)  # (then the only replica stream alive)
    each = run_all_reduce_us(cupy, n, args.repeat, one_stream=False)
    print(f"\n# strategy.run(all_reduce 4 B), {n} logical GPUs on GPU 0, host µs per run")
    print("| replicas on one stream | a stream each |\n|---:|---:|")
    print(f"| {shared:.1f} | {each:.1f} |")


def stream_count_table(cupy, n: int, args) -> None:
    """Part 1 of the module's docstring; the streams it makes are destroyed when it returns."""
    with cupy.cuda.Device(0):
        xs = [cupy.ones(1, cupy.float32) for _ in range(n)]
        tiny = cupy.zeros(1, cupy.float32)
        own = cupy.cuda.Stream(non_blocking=True)
        extra = []
        print(f"# {n} buffers on GPU 0; blocking streams alive on it {'busy' if args.busy else 'idle'}; "
              "host µs per call")
        busy = " | the busy streams' own launches |" if args.busy else " |"
        print("| blocking streams | all_reduce 4 B | launch (legacy) | launch (own stream)" + busy)
        print("|---:|---:|---:|---:|" + ("---:|" if args.busy else ""))
        for count in args.streams:
            while len(extra) < count:
                extra.append(cupy.cuda.Stream(non_blocking=False))

            def feed():
                if args.busy:
                    for s in extra:
                        with s:
                            cupy.add(tiny, 1, out=tiny)

            def on_own():
                with own:
                    cupy.add(tiny, 1, out=tiny)

            row = [per_call_us(lambda: (feed(), collectives.all_reduce(xs, "sum")), cupy, args.repeat),
                   per_call_us(lambda: (feed(), cupy.add(tiny, 1, out=tiny)), cupy, args.repeat),
                   per_call_us(lambda: (feed(), on_own()), cupy, args.repeat)]
            if args.busy:
                row.append(per_call_us(feed, cupy, args.repeat))
            print(f"| {count} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
        cupy.cuda.Device(0).synchronize()


if __name__ == "__main__":
    main()
