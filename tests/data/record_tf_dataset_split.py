"""Record how TF 2.21's MirroredStrategy (1 to 4 logical CPUs) splits datasets over its replicas, for
tests/test_dataset_split_parity.py, which replays every case on mirrored.

    /work/venvs/tf/bin/python tests/data/record_tf_dataset_split.py   # writes tests/data/tf_dataset_split.json

A case is a dataset expression over ``D`` (the Dataset class), ``np`` and ``O(policy)`` (a dataset's options
with that AutoShardPolicy), distributed by ``experimental_distribute_dataset`` or, where the case names
``fn``, by ``distribute_datasets_from_function`` with ``ctx`` (the InputContext) in scope, under the
``InputOptions`` the case names. Its answer: the distributed dataset's and its iterator's element_spec, every
step's per-replica arrays (values, dtype, shape), the steps a ``for`` loop takes, ``get_next_as_optional``
at the end, the dataset's cardinality; or the exception (class and message) where TF raises one.

This module imports TensorFlow only when run: the test loads it for its cases and :func:`run_case`.
"""

import json
import os
import sys

import numpy as np

POLICIES = ("AUTO", "FILE", "DATA", "OFF", "HINT")
REPLICAS = (1, 2, 3, 4)
MAX_STEPS = 16


def _cases():
    cases = {}

    def add(name, ds, ns=REPLICAS, **extra):
        cases[name] = dict(ds=ds, ns=list(ns), **extra)

    # Every policy, global batch 1..9, with and without the remainder, over lengths that leave short batches.
    for policy in POLICIES:
        for batch in range(1, 10):
            for drop in (False, True):
                for length in (7, 13) if batch in (4, 6, 8) else (13,):
                    # (a `for` loop and a fresh iterator's get_next_as_optional: once per batch size and policy)
                    add(f"range{length}.batch{batch}.drop{int(drop)}.{policy}",
                        f"D.range({length}).batch({batch}, drop_remainder={drop}).with_options(O('{policy}'))",
                        loop=length == 13 and not drop)
        add(f"unbatched.{policy}", f"D.range(5).with_options(O('{policy}'))")
        add(f"unbatched_rows.{policy}", f"D.from_tensor_slices(np.arange(12.0).reshape(6, 2)).with_options(O('{policy}'))")
        # Pipelines of other shapes: every batch size under AUTO and OFF (the two splits), one under the rest.
        for batch in (3, 4, 6) if policy in ("AUTO", "OFF") else (6,):
            add(f"nested_tuple.batch{batch}.{policy}",
                f"D.from_tensor_slices((np.arange(11), np.arange(22.0).reshape(11, 2).astype(np.float32)))"
                f".batch({batch}).with_options(O('{policy}'))", loop=batch == 6)
            add(f"nested_dict.batch{batch}.drop1.{policy}",
                f"D.from_tensor_slices({{'a': np.arange(10, dtype=np.int32), 'b': (np.arange(10) % 2 == 0)}})"
                f".batch({batch}, drop_remainder=True).with_options(O('{policy}'))", loop=batch == 6)
            add(f"filtered.batch{batch}.{policy}",
                f"D.range(20).filter(lambda x: x % 3 != 0).batch({batch}).with_options(O('{policy}'))", loop=batch == 6)
            add(f"filter_after_batch.batch{batch}.{policy}",
                f"D.range(20).batch({batch}).filter(lambda x: x[0] != {batch}).with_options(O('{policy}'))", loop=batch == 6)
            add(f"rebatch.batch{batch}.{policy}",
                f"D.range(14).batch(7).rebatch({batch}).with_options(O('{policy}'))", loop=batch == 6)
            add(f"rebatch_list.batch{batch}.{policy}",
                f"D.range(14).batch(7).rebatch([{batch}, 2]).with_options(O('{policy}'))", loop=batch == 6)
            add(f"unbatch.batch{batch}.{policy}",
                f"D.range(12).batch(5).unbatch().batch({batch}).with_options(O('{policy}'))", loop=batch == 6)
            add(f"map_after_batch.batch{batch}.{policy}",
                f"D.range(11).batch({batch}).map(lambda x: x * 2).with_options(O('{policy}'))", loop=batch == 6)
        add(f"batched_then_unbatched.{policy}", f"D.range(12).batch(5).unbatch().with_options(O('{policy}'))")
        add(f"from_batched_slices.{policy}",
            f"D.from_tensor_slices(np.arange(24).reshape(4, 6)).with_options(O('{policy}'))")
        add(f"repeat_take.{policy}", f"D.range(5).batch(4).repeat(3).take(5).with_options(O('{policy}'))")
        add(f"empty.{policy}", f"D.range(0).batch(4).with_options(O('{policy}'))")
    # Where the batch size hides from the strategy or shows through other transformations.
    for policy in ("AUTO", "OFF"):
        more = {"parallel_batch": "D.range(13).batch(6, num_parallel_calls=2)",
                "rebatch_prefetch": "D.range(14).batch(7).rebatch(3).prefetch(2)",
                "zip_pair": "D.zip((D.range(13).batch(6), D.range(13).map(lambda x: x * 2).batch(6)))",
                "concatenate": "D.range(7).batch(6).concatenate(D.range(20, 26).batch(6))",
                "skip_take": "D.range(19).batch(6).skip(1).take(3)",
                "padded": "D.range(9).map(lambda x: x % 3).padded_batch(6)"}
        for label, expr in more.items():
            add(f"{label}.{policy}", f"{expr}.with_options(O('{policy}'))")
    # Text files (AUTO finds files to shard: on one worker that keeps the even-size cut).
    for policy in POLICIES:
        add(f"text_lines.{policy}", f"T(FILES).batch(6).with_options(O('{policy}'))")
        add(f"text_lines_listed.{policy}",
            f"D.list_files(FILES, shuffle=False).interleave(T, cycle_length=1).batch(4).with_options(O('{policy}'))")
    # The default options (AUTO, unset).
    for batch in (1, 4, 5, 6, 8):
        add(f"default_options.batch{batch}", f"D.range(13).batch({batch})")
    # InputOptions with experimental_distribute_dataset.
    base = "D.range(10).batch(6).with_options(O('{}'))"
    for policy in ("AUTO", "OFF"):
        for label, opts in (("no_fetch", dict(experimental_fetch_to_device=False)),
                            ("buffer0", dict(experimental_per_replica_buffer_size=0)),
                            ("buffer3", dict(experimental_per_replica_buffer_size=3)),
                            ("per_replica", dict(experimental_replication_mode="PER_REPLICA")),
                            ("per_replica_no_fetch", dict(experimental_replication_mode="PER_REPLICA",
                                                          experimental_fetch_to_device=False)),
                            ("place_on_device", dict(experimental_place_dataset_on_device=True)),
                            ("place_on_device_no_fetch", dict(experimental_place_dataset_on_device=True,
                                                              experimental_fetch_to_device=False))):
            add(f"input_options.{label}.{policy}", base.format(policy), input_options=opts)
    # distribute_datasets_from_function, with the per-replica batch from the InputContext.
    fns = {
        "per_replica_batch": "D.range(13).batch(ctx.get_per_replica_batch_size({g}))",
        "per_replica_batch_drop": "D.range(13).batch(ctx.get_per_replica_batch_size({g}), drop_remainder=True)",
        "sharded": "D.range(13).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)"
                   ".batch(ctx.get_per_replica_batch_size({g}))",
        "context": "D.from_tensors(np.array([ctx.num_input_pipelines, ctx.input_pipeline_id, "
                   "ctx.num_replicas_in_sync])).repeat(2)",
        "unbatched": "D.range(5).map(lambda x: x + {g})",
        "off_policy": "D.range(13).batch({g}).with_options(O('OFF'))",
    }
    for label, expr in fns.items():
        for g in (4, 6, 12):
            add(f"fn.{label}.global{g}", expr.format(g=g), fn=True)
            if label in ("per_replica_batch", "context"):
                for mode in ("PER_WORKER", "PER_REPLICA"):
                    for fetch in (True, False):
                        add(f"fn.{label}.global{g}.{mode}.fetch{int(fetch)}", expr.format(g=g), fn=True,
                            input_options=dict(experimental_replication_mode=mode,
                                               experimental_fetch_to_device=fetch))
    add("fn.place_on_device", fns["per_replica_batch"].format(g=4), fn=True,
        input_options=dict(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False,
                           experimental_replication_mode="PER_REPLICA"))
    add("fn.place_on_device_per_worker", fns["per_replica_batch"].format(g=4), fn=True,
        input_options=dict(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False))
    return cases


CASES = _cases()


def _encode_spec(lib, spec, n):
    """Per leaf: each replica's [shape (None where unknown), dtype name]."""
    out = []
    for leaf in lib.flatten(spec):
        specs = lib.per_replica_specs(leaf) if n > 1 else [leaf]
        out.append([[lib.spec_shape(s), lib.dtype_name(s.dtype)] for s in specs])
    return out


def _encode_step(lib, strategy, element):
    """Per leaf: each replica's [values, dtype, shape] (strings as text, of dtype "string")."""
    out = []
    for leaf in lib.flatten(element):
        arrays = [lib.numpy(v) for v in strategy.experimental_local_results(leaf)]
        out.append([[_text(a.tolist()), "string", list(a.shape)] if a.dtype.kind in "OSU" else
                    [a.tolist(), a.dtype.name, list(a.shape)] for a in arrays])
    return out


def _text(values):
    if isinstance(values, list):
        return [_text(v) for v in values]
    return values.decode() if isinstance(values, bytes) else values


def _text_files():
    """Three small text files (the same lines in every process), for the reader cases."""
    import atexit
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="dataset_split_")
    atexit.register(shutil.rmtree, directory, True)
    paths = []
    for i in range(3):
        paths.append(os.path.join(directory, f"part{i}.txt"))
        with open(paths[-1], "w") as f:
            f.write("".join(f"{10 * i + j}\n" for j in range(5)))
    return paths


FILES = []


def _raised(e):
    return {"raises": type(e).__name__, "msg": str(e).split("\n")[0][:300]}


def run_case(lib, n, case):
    """``case``'s answer on ``lib`` (the adapter of TF or mirrored) over ``n`` replicas."""
    D = lib.Dataset

    if not FILES and "FILES" in case["ds"]:
        FILES.extend(_text_files())

    def O(policy):  # noqa: N802  (a short name for the case expressions)
        options = lib.Options()
        options.experimental_distribute.auto_shard_policy = getattr(lib.AutoShardPolicy, policy)
        return options

    # (A fresh strategy where options are given: TF's MirroredStrategy keeps PER_REPLICA's input workers for the
    # datasets it distributes later.)
    strategy = lib.strategy(n, fresh=case.get("fn", False) or "input_options" in case)
    try:
        options = None
        if "input_options" in case:
            given = dict(case["input_options"])
            if "experimental_replication_mode" in given:
                given["experimental_replication_mode"] = getattr(lib.InputReplicationMode,
                                                                 given["experimental_replication_mode"])
            options = lib.InputOptions(**given)
        if case.get("fn"):
            def dataset_fn(ctx):
                return eval(case["ds"], {"D": D, "np": np, "O": O, "ctx": ctx})  # noqa: S307  (the cases above)
            dist = strategy.distribute_datasets_from_function(dataset_fn, options)
        else:
            dataset = eval(case["ds"], {"D": D, "np": np, "O": O, "T": lib.TextLineDataset,  # noqa: S307
                                        "FILES": FILES})
            dist = strategy.experimental_distribute_dataset(dataset, options)
    except Exception as e:  # noqa: BLE001  (TF's refusal is the answer)
        return {"build": _raised(e)}
    result = {}
    try:
        result["cardinality"] = int(dist.cardinality)
    except Exception as e:  # noqa: BLE001
        result["cardinality"] = _raised(e)
    try:
        result["spec"] = _encode_spec(lib, dist.element_spec, n)
    except Exception as e:  # noqa: BLE001
        result["spec"] = _raised(e)
    steps = []
    try:
        it = iter(dist)
        result["iterator_spec"] = _encode_spec(lib, it.element_spec, n)
        for _ in range(MAX_STEPS):
            try:
                element = next(it)
            except StopIteration:
                break
            steps.append(_encode_step(lib, strategy, element))
        else:
            result["truncated"] = True
        if not result.get("truncated"):
            result["optional_at_end"] = bool(it.get_next_as_optional().has_value())
    except Exception as e:  # noqa: BLE001
        result["iterate"] = _raised(e)
    result["steps"] = steps
    if case.get("loop", True) and "iterate" not in result and not result.get("truncated"):
        try:
            count = 0
            for _ in dist:
                count += 1
            result["for_steps"] = count
            first = iter(dist).get_next_as_optional()
            result["optional_first"] = bool(first.has_value())
            if result["optional_first"]:
                result["optional_first_value"] = _encode_step(lib, strategy, first.get_value())
        except Exception as e:  # noqa: BLE001
            result["for"] = _raised(e)
    return result


def _tensorflow():
    from recording import logical_cpus, tf  # (this folder; imports TensorFlow)

    logical_cpus(4)
    strategies = {}

    class TensorFlow:
        Dataset = tf.data.Dataset
        Options = tf.data.Options
        AutoShardPolicy = tf.data.experimental.AutoShardPolicy
        InputOptions = tf.distribute.InputOptions
        InputReplicationMode = tf.distribute.InputReplicationMode
        TextLineDataset = tf.data.TextLineDataset
        flatten = staticmethod(tf.nest.flatten)

        @staticmethod
        def strategy(n, fresh):
            if fresh or n not in strategies:  # (else one per replica count: TF's strategies are slow to make)
                strategies[n] = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
            return strategies[n]

        @staticmethod
        def per_replica_specs(spec):
            return list(spec._value_specs)

        @staticmethod
        def spec_shape(spec):
            return None if spec.shape.rank is None else list(spec.shape.as_list())

        @staticmethod
        def dtype_name(dtype):
            return dtype.name

        @staticmethod
        def numpy(value):
            return np.asarray(value.numpy())

    return TensorFlow


def _current(entry) -> bool:
    """Whether a recorded ``entry`` answers a case as the cases now stand (a file resumed after the cases changed
    keeps the old lines)."""
    case = CASES.get(entry["name"])
    return case is not None and (case.get("loop", True) or "for_steps" not in entry["result"])


def _record(n, path):
    """Appends ``n`` replicas' answers to ``path``, a JSON line per case, skipping the cases already there
    (a recording that was cut short resumes)."""
    done = set()
    if os.path.exists(path):
        with open(path) as f:
            done = {entry["name"] for entry in map(json.loads, f) if _current(entry)}
    adapter = _tensorflow()
    with open(path, "a") as f:
        for name, case in CASES.items():
            if n in case["ns"] and name not in done:
                f.write(json.dumps({"name": name, "result": run_case(adapter, n, case)}) + "\n")
                f.flush()


def main():
    """Each replica count in a process of its own (in parallel), then the reference written."""
    import subprocess

    from recording import tf, write_reference

    paths = {n: f"/tmp/record_tf_dataset_split.{n}.jsonl" for n in REPLICAS}
    for process in [subprocess.Popen([sys.executable, __file__, str(n), paths[n]]) for n in REPLICAS]:
        if process.wait():
            raise SystemExit(f"recording failed: {process.args}")
    cases = {}
    for n, path in paths.items():
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                if _current(entry):
                    cases.setdefault(entry["name"], {})[str(n)] = entry["result"]
    write_reference("tf_dataset_split.json", {"_tf_version": tf.__version__, "cases": cases},
                    separators=(",", ":"))
    print(f"{len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _record(int(sys.argv[1]), sys.argv[2])
    else:
        main()
