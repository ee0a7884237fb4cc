"""Records TensorFlow 2.21's per-call ``options=`` (tf.distribute.experimental.CommunicationOptions) for
tests/test_communication_options.py (never imported by the tests): ``CommunicationOptions.merge`` over a grid of
fields, which entry points take ``options`` (their signatures), what each returns with options or raises with
options of a wrong type, under MirroredStrategy and a one-worker MultiWorkerMirroredStrategy with 1 and 2 logical
CPUs, and what a per-call timeout raises in a two-worker job whose other worker never arrives.

    /work/venvs/tf/bin/python tests/data/record_tf_communication_options.py
        (writes tests/data/tf_communication_options_reference.json)
"""

import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time


from recording import logical_cpus, record_by_replicas, tf, write_reference  # (this folder: the script's own)
from recorded_results import replica_values  # (the tests folder: recording puts it on the path)

CO = tf.distribute.experimental.CommunicationOptions
IMPL = tf.distribute.experimental.CommunicationImplementation
SUM = tf.distribute.ReduceOp.SUM

# The grid of fields: every combination of these, as the strategy's and as the call's options.
BYTES = [0, 1024]
TIMEOUTS = [None, 0, 5.0]
IMPLEMENTATIONS = ["AUTO", "RING", "NCCL"]

# The options each call is tried with (name -> a thunk making them; a thunk so a bad one raises in its scenario).
CALL_OPTIONS = {
    "none": lambda: None,
    "packed_ring": lambda: CO(bytes_per_pack=8, timeout_seconds=30.0, implementation=IMPL.RING),
    "timeout_only": lambda: CO(timeout_seconds=30.0),
    "no_timeout": lambda: CO(timeout_seconds=0),
    "nccl": lambda: CO(implementation=IMPL.NCCL),
    "wrong_str": lambda: "RING",
    "wrong_int": lambda: 5,
    "wrong_dict": lambda: {"timeout_seconds": 1.0},
}


def fields(o) -> dict:
    return {"bytes_per_pack": o.bytes_per_pack, "timeout_seconds": o.timeout_seconds,
            "implementation": o.implementation.name}


def merge_grid() -> list:
    combos = [(b, t, i) for b in BYTES for t in TIMEOUTS for i in IMPLEMENTATIONS]
    out = []
    for base in combos:
        for call in combos + [None]:
            merged = CO(*base[:2], implementation=IMPL[base[2]]).merge(
                None if call is None else CO(*call[:2], implementation=IMPL[call[2]]))
            out.append({"base": list(base), "call": None if call is None else list(call), "merged": fields(merged)})
    return out


def signatures() -> dict:
    """Which public entry points take ``options`` (the parameter names of each)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    ctx = tf.distribute.get_replica_context()  # the default replica context
    entries = {
        "ReplicaContext.all_reduce": tf.distribute.ReplicaContext.all_reduce,
        "ReplicaContext.all_gather": tf.distribute.ReplicaContext.all_gather,
        "ReplicaContext.batch_all_reduce": getattr(tf.distribute.ReplicaContext, "batch_all_reduce", None),
        "StrategyExtended.reduce_to": tf.distribute.StrategyExtended.reduce_to,
        "StrategyExtended.batch_reduce_to": tf.distribute.StrategyExtended.batch_reduce_to,
        "StrategyExtended.gather_to": getattr(tf.distribute.StrategyExtended, "gather_to", None),
        "Strategy.reduce": tf.distribute.Strategy.reduce,
        "Strategy.gather": tf.distribute.Strategy.gather,
        "CrossDeviceOps.reduce": tf.distribute.CrossDeviceOps.reduce,
        "CrossDeviceOps.batch_reduce": tf.distribute.CrossDeviceOps.batch_reduce,
        "CrossDeviceOps.broadcast": tf.distribute.CrossDeviceOps.broadcast,
    }
    del strategy, ctx
    return {name: None if fn is None else [p for p in inspect.signature(fn).parameters if p != "self"]
            for name, fn in entries.items()}


def outcome(thunk):
    try:
        return {"value": replica_values(thunk(), tf.distribute.DistributedValues)}
    except Exception as e:  # what TF raises is the recorded result
        return {"raises": type(e).__name__, "msg": str(e)[:400]}


def calls(strategy, options) -> dict:
    n = strategy.num_replicas_in_sync
    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([1.0 + ctx.replica_id_in_sync_group, 2.0, 3.0]))
    dest = strategy.extended.worker_devices[0]

    def replica(fn):
        return lambda: strategy.run(lambda v: fn(tf.distribute.get_replica_context(), v), args=(pr,))

    out = {
        "ctx.all_reduce": replica(lambda ctx, v: ctx.all_reduce("sum", v, options=options())),
        "ctx.all_reduce_nest": replica(lambda ctx, v: ctx.all_reduce("sum", [v, v * 2.0], options=options())),
        "ctx.all_gather": replica(lambda ctx, v: ctx.all_gather(v, axis=0, options=options())),
        "extended.reduce_to_self": lambda: strategy.extended.reduce_to(SUM, pr, pr, options=options()),
        "extended.reduce_to_device": lambda: strategy.extended.reduce_to(SUM, pr, dest, options=options()),
        "extended.batch_reduce_to": lambda: strategy.extended.batch_reduce_to(
            SUM, [(pr, pr), (pr, dest)], options=options()),
        "cdo.reduce": lambda: tf.distribute.ReductionToOneDevice().reduce(SUM, pr, dest, options=options()),
        "cdo.batch_reduce": lambda: tf.distribute.ReductionToOneDevice().batch_reduce(
            SUM, [(pr, pr)], options=options()),
        "strategy_cdo.reduce": lambda: strategy.extended._cross_device_ops.reduce(
            SUM, pr, pr, options=options()) if strategy.extended._cross_device_ops is not None else "none",
        "strategy_cdo.batch_reduce": lambda: strategy.extended._cross_device_ops.batch_reduce(
            SUM, [(pr, pr)], options=options()) if strategy.extended._cross_device_ops is not None else "none",
    }
    return {"replicas": n, "results": {name: outcome(thunk) for name, thunk in out.items()}}


def record_strategies(n: int) -> None:
    """One process per logical CPU count: the calls under both strategies, printed as JSON."""
    logical_cpus(n)
    strategies = {
        "mirrored": lambda: tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)]),
        "multi_worker": lambda: tf.distribute.MultiWorkerMirroredStrategy(),
        "multi_worker_nccl": lambda: tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=CO(implementation=IMPL.NCCL)),
    }
    out = {}
    for name, make in strategies.items():
        try:
            strategy = make()
        except Exception as e:
            out[name] = {"raises": type(e).__name__, "msg": str(e)[:400]}
            continue
        out[name] = {option: calls(strategy, thunk) for option, thunk in CALL_OPTIONS.items()}
    json.dump({"strategies": out}, sys.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeout_worker(index: int, spec: dict, folder: str) -> None:
    """Worker 0 all-reduces with options=CommunicationOptions(timeout_seconds=2) while worker 1 never arrives,
    then all-reduces with no options; worker 1 waits (on a file, not a fixed sleep) until worker 0 has done both."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": "worker", "index": index}})
    tf.get_logger().setLevel("ERROR")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    done = os.path.join(folder, "done")
    if index == 1:
        deadline = time.monotonic() + 300
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(0)
    result = {}

    def call(options):
        started = time.monotonic()
        try:
            strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
                "sum", tf.constant([1.0]), options=options))
            return {"value": "returned", "seconds": round(time.monotonic() - started, 1)}
        except Exception as e:
            return {"raises": type(e).__name__, "bases": [c.__name__ for c in type(e).__mro__[1:4]],
                    "msg": str(e)[:600], "seconds": round(time.monotonic() - started, 1)}

    result["with_timeout"] = call(CO(timeout_seconds=2))
    box = {}
    thread = threading.Thread(target=lambda: box.update(after=call(None)), daemon=True)
    thread.start()
    thread.join(30)
    result["after_without_options"] = box.get("after", {"hangs": "no result within 30 s"})
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(result, f)
    open(done, "w").close()
    os._exit(0)


def record_timeout() -> dict:
    spec = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    with tempfile.TemporaryDirectory() as folder:
        procs = [subprocess.Popen([sys.executable, __file__, "timeout", str(i), json.dumps(spec), folder])
                 for i in range(2)]
        for p in procs:
            p.wait(timeout=400)
        with open(os.path.join(folder, "result.json")) as f:
            return json.load(f)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "timeout":
        timeout_worker(int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
        return
    if len(sys.argv) > 1:
        record_strategies(int(sys.argv[1]))
        return
    out = {"tensorflow": tf.__version__, "merge": merge_grid(), "signatures": signatures(),
           "by_cpus": record_by_replicas(__file__, [1, 2]), "timeout": record_timeout()}
    write_reference("tf_communication_options_reference.json", out, indent=None, separators=(",", ":"))
    print(f"{len(out['merge'])} merges; timeout: {out['timeout']}", file=sys.stderr)


if __name__ == "__main__":
    main()
