"""Bad input across the public API: every case ends in a correct result (checked against NumPy) or in the
exception TensorFlow raises for the same thing, whose message names the argument; never a crash, a hang, a raw
internal error (AttributeError, pybind11's "incompatible function arguments", ...) or a silently wrong answer.

The native code runs in child processes, so a crash fails the test that caused it instead of the whole run: the
table below runs in one child, and each property-based fuzzer (hypothesis, derandomized) in its own.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import mirrored

HERE = os.path.dirname(os.path.abspath(__file__))
# The children import the mirrored this process imports: the source tree in development, the installed
# package in a clean clone (whose python/ holds no built extensions).
PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(mirrored.__file__)), HERE,
                              os.environ.get("PYTHONPATH", "")])

# (code, expected): the code leaves its answer in `result`. expected is ("raises", exception class name, words
# the message must hold) or ("ok", an expression of `result` that must be true). Names in scope: np, md, s (a
# MirroredStrategy over two CPU replicas), PR (a PerReplica of two float64 arrays [1, 1]), A (float32 ones(4)),
# rid() (the replica id inside run), tmp (an empty folder).
CASES = {
    # --- strategies ---
    "devices not iterable": ("result = md.MirroredStrategy(3)", ("raises", "TypeError", "devices=3")),
    "devices generator": ("result = md.MirroredStrategy(d for d in ['/cpu:0', '/cpu:1']).num_replicas_in_sync",
                          ("ok", "result == 2")),
    "devices None inside list": ("result = md.MirroredStrategy([None])", ("raises", "ValueError", "devices=None")),
    "devices bytes": ("result = md.MirroredStrategy([b'/cpu:0'])", ("raises", "ValueError", "devices=b'/cpu:0'")),
    "device type unknown": ("result = md.MirroredStrategy(['/tpu:0'])", ("raises", "ValueError", "tpu:0")),
    "cross_device_ops a class": ("result = md.MirroredStrategy(['/cpu:0'], cross_device_ops=md.RingAllReduce)",
                                 ("raises", "ValueError", "cross_device_ops=")),
    "one device strategy list": ("result = md.OneDeviceStrategy(['/cpu:0'])", ("raises", "ValueError", "device=")),
    "reduce axis str": ("result = s.reduce('sum', PR, axis='0')", ("raises", "TypeError", "axis='0'")),
    "reduce axis float": ("result = s.reduce('sum', PR, axis=1.0)", ("raises", "TypeError", "axis=1.0")),
    "reduce axis bool": ("result = s.reduce('sum', PR, axis=True)", ("raises", "TypeError", "axis=True")),
    "reduce axis out of range": ("result = s.reduce('sum', PR, axis=-2)", ("raises", "ValueError", "axis=-2")),
    "reduce axis -1": ("result = s.reduce('mean', md.PerReplica([np.arange(3.), np.arange(3.) + 3]), axis=-1)",
                       ("ok", "result == 2.5")),
    "reduce op enum of another kind": ("result = s.reduce(md.VariableAggregation.SUM, PR, axis=None)",
                                       ("raises", "ValueError", "reduce_op=")),
    "reduce op bytes": ("result = s.reduce(b'sum', PR, axis=None)", ("raises", "ValueError", "reduce_op=b'sum'")),
    "reduce uint16": ("result = s.reduce('sum', md.PerReplica([np.ones(2, np.uint16)] * 2), axis=None)",
                      ("raises", "TypeError", "uint16")),
    "reduce datetime": ("result = s.reduce('sum', md.PerReplica([np.ones(2, 'M8[s]')] * 2), axis=None)",
                        ("raises", "TypeError", "datetime64")),
    "reduce structured dtype": ("result = s.reduce('sum', md.PerReplica([np.zeros(2, 'i4,f4')] * 2), axis=None)",
                                ("raises", "TypeError", "not supported")),
    "reduce ragged nested list": ("result = s.reduce('sum', md.PerReplica([[1, [2]], [1, [2]]]), axis=None)",
                                  ("raises", "ValueError", "nest every element alike")),
    "reduce big-endian": ("result = s.reduce('sum', md.PerReplica([np.arange(3, dtype='>f4')] * 2), axis=None)",
                          ("ok", "result.tolist() == [0, 2, 4]")),
    "reduce zero-stride": ("a = np.broadcast_to(np.arange(3.0), (2, 3))\n"
                           "result = s.reduce('sum', md.PerReplica([a, a]), axis=None)",
                           ("ok", "result.tolist() == [[0, 2, 4]] * 2")),
    "reduce fortran order": ("a = np.asfortranarray(np.arange(6.0).reshape(2, 3))\n"
                             "result = s.reduce('max', md.PerReplica([a, a + 1]), axis=None)",
                             ("ok", "result.tolist() == (np.arange(6.0).reshape(2, 3) + 1).tolist()")),
    "reduce reversed strides": ("a = np.arange(4.0)[::-1]\nresult = s.reduce('sum', md.PerReplica([a, a]), axis=None)",
                                ("ok", "result.tolist() == [6, 4, 2, 0]")),
    "reduce mean of zero rows": ("result = s.reduce('mean', md.PerReplica([np.ones((0, 3))] * 2), axis=0)",
                                 ("ok", "result.shape == (3,) and np.isnan(result).all()")),
    "gather axis None": ("result = s.gather(PR, axis=None)", ("raises", "ValueError", "axis=None")),
    "gather axis str": ("result = s.gather(PR, axis='0')", ("raises", "TypeError", "axis='0'")),
    "gather axis -1": ("result = s.gather(md.PerReplica([np.zeros((2, 1)), np.ones((2, 2))]), axis=-1)",
                       ("ok", "result.tolist() == [[0, 1, 1], [0, 1, 1]]")),
    "all_gather axis None": ("result = s.run(lambda: md.get_replica_context().all_gather(np.ones(2), axis=None))",
                             ("raises", "ValueError", "axis=None")),
    "run fn None": ("result = s.run(None)", ("raises", "TypeError", "fn=None")),
    "run kwargs a list": ("result = s.run(lambda: 1, kwargs=[1])", ("raises", "TypeError", "kwargs=[1]")),
    "run args a dict": ("result = s.run(lambda x: x, args={'x': 1})", ("raises", "ValueError", "args=")),
    "call_for_each_replica fn int": ("result = s.extended.call_for_each_replica(3)", ("raises", "TypeError", "fn=3")),
    "merge_call merge_fn None": ("result = s.run(lambda: md.get_replica_context().merge_call(None))",
                                 ("raises", "TypeError", "merge_fn=None")),
    "merge_call args int": ("result = s.run(lambda: md.get_replica_context().merge_call(lambda st, x: 1, args=5))",
                            ("raises", "TypeError", "args=5")),
    "all_reduce dict keys differ": ("result = s.run(lambda: md.get_replica_context().all_reduce("
                                    "'sum', {('a', 'b')[rid()]: 1.0}))", ("raises", "ValueError", "structure")),
    "all_reduce on one replica only": ("def f():\n    if rid() == 0:\n"
                                       "        return md.get_replica_context().all_reduce('sum', 1.0)\n    return 0\n"
                                       "result = s.run(f)", ("raises", "RuntimeError", "same collective calls")),
    "values_from_function None": ("result = s.experimental_distribute_values_from_function(None)",
                                  ("raises", "TypeError", "value_fn=None")),
    "update fn None": ("with s.scope():\n    v = md.Variable(1.0)\nresult = s.extended.update(v, None)",
                       ("raises", "TypeError", "fn=None")),
    "update args int": ("with s.scope():\n    v = md.Variable(1.0)\n"
                        "result = s.extended.update(v, lambda v, x: v.assign(x), args=5)",
                        ("raises", "TypeError", "args=5")),
    "batch_reduce_to generator": ("result = s.extended.batch_reduce_to('sum', ((PR, '/cpu:0') for _ in [0]))",
                                  ("raises", "ValueError", "value_destination_pairs=")),
    "destinations int": ("result = s.extended.reduce_to('sum', PR, destinations=3)",
                         ("raises", "ValueError", "destinations=3")),
    # --- cross-device ops ---
    "batch_reduce pairs an int": ("result = md.RingAllReduce().batch_reduce('sum', 5)",
                                  ("raises", "ValueError", "value_destination_pairs=5")),
    "batch_reduce pairs of three": ("result = md.RingAllReduce().batch_reduce('sum', [(PR, '/cpu:0', 1)])",
                                    ("raises", "ValueError", "value_destination_pairs=")),
    "accumulation_fn not callable": ("result = md.ReductionToOneDevice(accumulation_fn=5)",
                                     ("raises", "TypeError", "accumulation_fn=5")),
    "num_packs float": ("result = md.NcclAllReduce(num_packs=1.5)", ("raises", "ValueError", "num_packs=1.5")),
    "chunk_bytes huge": ("s2 = md.MirroredStrategy(['/cpu:0', '/cpu:1'], cross_device_ops=md.RingAllReduce("
                         "chunk_bytes=2**70))\nresult = s2.reduce('sum', md.PerReplica([A, 2 * A]), axis=None)",
                         ("ok", "result.tolist() == [3] * 4")),
    "bytes_per_pack huge in run": ("opts = md.CommunicationOptions(bytes_per_pack=2**70)\n"
                                   "result = s.run(lambda: md.get_replica_context().all_reduce("
                                   "'sum', [np.ones(2), np.ones(3)], options=opts))",
                                   ("ok", "[r.values[1].tolist() for r in result] == [[2, 2], [2, 2, 2]]")),
    # --- collectives ---
    "batch_all_reduce bytes_per_pack huge": ("result = md.collectives.batch_all_reduce([[A, 2 * A], [A, A]], "
                                             "bytes_per_pack=2**70)",
                                             ("ok", "[t.tolist() for t in result[1]] == [[2] * 4, [3] * 4]")),
    "batch_all_reduce num_packs huge": ("result = md.collectives.batch_all_reduce([[A], [A]], num_packs=2**40)",
                                        ("ok", "result[0][0].tolist() == [2] * 4")),
    "all_reduce algorithm upper case": ("result = md.collectives.all_reduce([A, A], algorithm='RING')",
                                        ("ok", "result[1].tolist() == [2] * 4")),
    "all_reduce algorithm int": ("result = md.collectives.all_reduce([A, A], algorithm=5)",
                                 ("raises", "ValueError", "algorithm=5")),
    "out overlapping views": ("o = np.zeros(5, np.float32)\nresult = md.collectives.all_reduce([A, A], "
                              "out=[o[:4], o[1:]])", ("raises", "ValueError", "share memory")),
    "broadcast root float": ("result = md.collectives.broadcast([A, A], root=1.0)",
                             ("raises", "ValueError", "root=1.0")),
    "broadcast root numpy int": ("result = md.collectives.broadcast([A, 2 * A], root=np.int64(1))",
                                 ("ok", "result[0].tolist() == [2] * 4")),
    # --- variables ---
    "variable name int": ("result = md.Variable(1.0, name=5)", ("raises", "ValueError", "name=5")),
    "variable hash": ("result = hash(md.Variable(np.ones(2)))", ("raises", "TypeError", "ref()")),
    "mirrored variable hash": ("with s.scope():\n    v = md.Variable(np.ones(2))\nresult = hash(v)",
                               ("raises", "TypeError", "ref()")),
    "variable ref as key": ("v = md.Variable(1.0)\nresult = {v.ref(): 1}[v.ref()]", ("ok", "result == 1")),
    "variable dtype unknown": ("result = md.Variable(1.0, dtype='floaty')", ("raises", "TypeError", "dtype")),
    "variable aggregation int": ("result = md.Variable(1.0, aggregation=7)", ("raises", "ValueError", "aggregation")),
    "variable constraint int": ("result = md.Variable(1.0, constraint=5)", ("raises", "ValueError", "constraint=5")),
    "assign complex to float": ("v = md.Variable(np.ones(2))\nresult = v.assign(np.ones(2) * 1j)",
                                ("raises", "TypeError", "astype")),
    "assign int overflow wraps": ("v = md.Variable(np.array([2**31 - 1], np.int32))\nv.assign_add([1])\n"
                                  "result = v.numpy()", ("ok", "result.tolist() == [-2**31]")),
    "assign per-replica in cross-replica": ("with s.scope():\n    v = md.Variable(np.ones(2))\n"
                                            "result = v.assign(md.PerReplica([np.ones(2), np.zeros(2)]))",
                                            ("raises", "ValueError", "reduce it first")),
    "readonly initial value": ("a = np.ones(2)\na.flags.writeable = False\nv = md.Variable(a)\n"
                               "v.assign_add(np.ones(2))\nresult = (v.numpy(), a)",
                               ("ok", "result[0].tolist() == [2, 2] and result[1].tolist() == [1, 1]")),
    # --- md.data ---
    "shuffle seed negative": ("order = lambda: [int(x) for x in md.data.Dataset.range(6).shuffle(4, seed=-1)]\n"
                              "result = (order(), order())",
                              ("ok", "sorted(result[0]) == list(range(6)) and result[0] == result[1]")),
    "shuffle seed str": ("result = md.data.Dataset.range(3).shuffle(3, seed='x')",
                         ("raises", "TypeError", "seed='x'")),
    "enumerate start str": ("result = md.data.Dataset.range(3).enumerate('a')", ("raises", "TypeError", "start='a'")),
    "concatenate incompatible": ("result = md.data.Dataset.range(2).concatenate("
                                 "md.data.Dataset.from_tensor_slices(np.ones((2, 3))))",
                                 ("raises", "TypeError", "Incompatible dataset elements")),
    "concatenate shapes differ": ("ds = md.data.Dataset.from_tensor_slices(np.ones((1, 3))).concatenate("
                                  "md.data.Dataset.from_tensor_slices(np.zeros((1, 4))))\n"
                                  "result = [x.tolist() for x in ds]", ("ok", "result == [[1] * 3, [0] * 4]")),
    "cache into a missing folder": ("pulled = []\nds = md.data.Dataset.range(3).map(lambda x: pulled.append(1) or x)"
                                    "\ntry:\n    next(iter(ds.cache(tmp + '/missing/c')))\nexcept OSError as e:\n"
                                    "    result = (type(e).__name__, isinstance(e, FileNotFoundError), len(pulled))",
                                    ("ok", "result == ('NotFoundError', True, 0)")),
    "text lines of None": ("result = md.data.TextLineDataset(None)", ("raises", "TypeError", "filenames=None")),
    "text lines of an int": ("result = md.data.TextLineDataset(5)", ("raises", "TypeError", "filenames=5")),
    "batch size nan": ("result = md.data.Dataset.range(3).batch(float('nan'))",
                       ("raises", "TypeError", "batch_size=nan")),
    "take negative is all": ("result = [int(x) for x in md.data.Dataset.range(3).take(-5)]",
                             ("ok", "result == [0, 1, 2]")),
    "shard index out of range": ("result = md.data.Dataset.range(3).shard(2, 2)", ("raises", "ValueError", "index=2")),
    "from_generator a list": ("result = md.data.Dataset.from_generator([1, 2], output_types=np.int64)",
                              ("raises", "TypeError", "generator=")),
    "distribute exhausted generator again": ("d = s.experimental_distribute_dataset(np.ones((2, 2)) for _ in [0])\n"
                                             "list(d)\nresult = list(d)", ("raises", "ValueError", "one-shot")),
    "dict keys that do not sort": ("result = list(s.experimental_distribute_dataset("
                                   "[{1: np.ones(2), 'a': np.ones(2)}]))", ("raises", "TypeError", "sortable keys")),
    "per-replica batch size str": ("result = md.InputContext(1, 0, 2).get_per_replica_batch_size('4')",
                                   ("raises", "TypeError", "global_batch_size='4'")),
    # --- optimizers ---
    "apply_gradients None": ("result = md.optimizers.SGD().apply_gradients(None)",
                             ("raises", "TypeError", "grads_and_vars=None")),
    "build None": ("result = md.optimizers.Adam().build(None)", ("raises", "TypeError", "var_list=None")),
    "variable from outside the scope": ("v = md.Variable(np.ones(2))\nopt = md.optimizers.SGD(1.0)\n"
                                        "result = s.run(lambda: opt.apply_gradients([(np.ones(2), v)]))",
                                        ("raises", "ValueError", "strategy.scope()")),
    "variables of two scopes": ("with s.scope():\n    v = md.Variable(np.ones(2))\n    opt = md.optimizers.SGD()\n"
                                "w = md.Variable(np.ones(2))\n"
                                "result = s.run(lambda: opt.apply_gradients([(np.ones(2), v), (np.ones(2), w)]))",
                                ("raises", "ValueError", "strategy.scope()")),
    "apply_gradients generator": ("v = md.Variable(np.ones(2))\n"
                                  "md.optimizers.SGD(0.5).apply_gradients((g, v) for g in [np.ones(2)])\n"
                                  "result = v.numpy()", ("ok", "result.tolist() == [0.5, 0.5]")),
    "learning rate nan": ("result = md.optimizers.SGD(learning_rate=float('nan'))",
                          ("raises", "ValueError", "learning_rate=nan")),
    # --- checkpoints ---
    "manager directory None": ("result = md.train.CheckpointManager(md.train.Checkpoint(), None)",
                               ("raises", "TypeError", "directory=None")),
    "latest_checkpoint None": ("result = md.train.latest_checkpoint(None)", ("raises", "TypeError", "checkpoint_dir")),
    "list_variables None": ("result = md.train.list_variables(None)", ("raises", "TypeError", "ckpt_dir_or_file")),
    "checkpoint of an int": ("result = md.train.Checkpoint(x=5)", ("raises", "ValueError", "x")),
    "restore a directory": ("result = md.train.Checkpoint(v=md.Variable(1.0)).restore(tmp)",
                            ("raises", "IsADirectoryError", "save_path=")),
    "manager max_to_keep str": ("result = md.train.CheckpointManager(md.train.Checkpoint(), tmp, max_to_keep='3')",
                                ("raises", "ValueError", "max_to_keep")),
    # --- cluster resolvers, config, compat ---
    "num_accelerators an int": ("result = md.cluster_resolver.SimpleClusterResolver(md.train.ClusterSpec("
                                "{'worker': ['a:1']}), num_accelerators=5)",
                                ("raises", "TypeError", "num_accelerators=5")),
    "cluster addresses an int": ("result = md.train.ClusterSpec({'worker': 5})", ("raises", "ValueError", "worker")),
    "communication option timeout nan": ("result = md.CommunicationOptions(timeout_seconds=float('nan'))",
                                         ("raises", "ValueError", "timeout_seconds=nan")),
    "logical device count str": ("result = md.config.set_logical_device_configuration("
                                 "md.config.list_physical_devices('CPU')[0], count='2')",
                                 ("raises", "ValueError", "count='2'")),
    "contrib num_gpus negative": ("result = md.compat.contrib.MirroredStrategy(num_gpus=-1)",
                                  ("raises", "ValueError", "num_gpus=-1")),
    "contrib num_gpus str": ("result = md.compat.contrib.MirroredStrategy(num_gpus='2')",
                             ("raises", "ValueError", "num_gpus='2'")),
}

CHILD = """
import json, sys, tempfile, traceback
import numpy as np
import mirrored as md

cases = json.loads(sys.stdin.read())
out = {}
for name, code in cases.items():
    print(name, file=sys.stderr, flush=True)  # the last name printed is the case that crashed
    s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    env = dict(np=np, md=md, s=s, PR=md.PerReplica([np.ones(2), np.ones(2)]), A=np.ones(4, np.float32),
               rid=lambda: md.get_replica_context().replica_id_in_sync_group, tmp=tempfile.mkdtemp())
    try:
        exec(code, env)
        out[name] = ["ok", None, None]
        check = CHECKS[name]
        out[name][1] = bool(eval(check, env)) if check else None
    except Exception as e:
        out[name] = ["raises", [c.__name__ for c in type(e).__mro__], str(e)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcomes():
    checks = {name: (exp[1] if exp[0] == "ok" else None) for name, (_, exp) in CASES.items()}
    script = f"CHECKS = {checks!r}\n" + CHILD
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps({n: c for n, (c, _) in CASES.items()}),
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    last = proc.stderr.strip().splitlines()[-1:] or ["(none)"]
    assert proc.returncode == 0, f"the child died (rc={proc.returncode}) in case {last[0]!r}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_ends_well(outcomes, name):
    expected = CASES[name][1]
    kind, detail, message = outcomes[name]
    if expected[0] == "ok":
        assert kind == "ok", f"{name}: expected a result, got {detail[0]}: {message}"
        assert detail is True, f"{name}: wrong result (check {expected[1]!r} failed)"
        return
    _, exc, words = expected
    assert kind == "raises", f"{name}: expected {exc}, got a result"
    assert exc in detail, f"{name}: expected {exc}, got {detail[0]}: {message}"
    assert words in message, f"{name}: the message does not say {words!r}: {message}"


def _fuzz(body: str, examples: int) -> str:
    """Runs a hypothesis property in a child process; returns its stdout (the last line: the examples run)."""
    script = textwrap.dedent("""
        import numpy as np
        import mirrored as md
        from hypothesis import HealthCheck, given, settings, strategies as st

        RUN = [0]
        SETTINGS = settings(max_examples={examples}, derandomize=True, deadline=None, database=None,
                            suppress_health_check=list(HealthCheck))
    """).format(examples=examples) + textwrap.dedent(body) + "\nprint('examples', RUN[0])\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    ran = int(proc.stdout.strip().splitlines()[-1].split()[1])
    assert ran >= examples // 2, proc.stdout
    return proc.stdout


COLLECTIVES_FUZZ = """
from mirrored import collectives as c

GOOD = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
BAD = ["bool", "complex64", "uint16", "int16", "object", "U2", "M8[s]"]


def make(rng, shape, dtype, layout):
    base = rng.integers(-3, 4, size=shape)
    if layout == "strided":  # every other element of a twice-as-long last axis
        wide = np.repeat(base, 2, axis=-1) if base.ndim else base
        a = (wide[..., ::2] if base.ndim else wide).astype(dtype)
    elif layout == "zero-stride" and base.ndim:
        a = np.broadcast_to(base[..., :1].astype(dtype), shape)
    else:
        a = base.astype(dtype)
    if layout == "fortran":
        a = np.asfortranarray(a)
    if layout == "readonly":
        a = np.array(a)
        a.flags.writeable = False
    return a


@st.composite
def calls(draw):
    return dict(kind=draw(st.sampled_from(["all_reduce", "broadcast", "reduce", "all_gather"])),
                n=draw(st.integers(1, 4)), shape=tuple(draw(st.lists(st.integers(0, 4), max_size=3))),
                dtype=draw(st.sampled_from(GOOD + BAD)),
                op=draw(st.sampled_from(["sum", "prod", "min", "max", "mean", "MAX", "avg", None, 3])),
                root=draw(st.sampled_from([0, 1, 3, -1, 4, "0", 1.0, None, True])),
                axis=draw(st.sampled_from([0, 1, 2, -1, -3, 3, None, "0", 0.0])),
                layout=draw(st.sampled_from(["c", "fortran", "strided", "zero-stride", "readonly"])),
                mismatch=draw(st.sampled_from([None, None, "shape", "dtype", "rank"])),
                seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(calls())
def check(k):
    RUN[0] += 1
    rng = np.random.default_rng(k["seed"])
    n, shape, kind = k["n"], k["shape"], k["kind"]
    bufs = [make(rng, shape, k["dtype"], k["layout"]) for _ in range(n)]
    # What is wrong with the call; an error must name one of these.
    wrong = {}
    if k["dtype"] in BAD:
        wrong["dtype"] = (TypeError, "is not supported")
    if n > 1 and k["mismatch"] and k["dtype"] in GOOD:
        last = bufs[-1]
        if k["mismatch"] == "dtype":
            bufs[-1] = last.astype(np.float64 if last.dtype != np.float64 else np.float32)
            wrong["mismatch"] = (TypeError, f"buffers[{n - 1}]")
        elif k["mismatch"] == "rank":
            bufs[-1] = last[None]
            wrong["mismatch"] = (ValueError, f"buffers[{n - 1}]")
        elif kind != "all_gather" and last.ndim:
            bufs[-1] = np.concatenate([last, last[..., :1]], axis=-1)
            wrong["mismatch"] = (ValueError, f"buffers[{n - 1}]")
        elif kind == "all_gather" and last.ndim and isinstance(k["axis"], int) and -last.ndim <= k["axis"] < last.ndim:
            bufs[-1] = np.concatenate([last, last], axis=k["axis"])  # allowed: sizes differ along axis only
    if kind in ("all_reduce", "reduce") and (k["op"] is None or str(k["op"]).lower() not in
                                             ("sum", "prod", "min", "max", "mean")):
        wrong["op"] = (ValueError, f"op={k['op']!r}")
    root = k["root"]
    if kind in ("broadcast", "reduce") and (isinstance(root, bool) or not isinstance(root, int)
                                             or not 0 <= root < n):
        wrong["root"] = (ValueError, f"root={root!r}")
    axis = k["axis"]
    if kind == "all_gather":
        ndim = bufs[0].ndim
        if ndim == 0:
            wrong["axis"] = (ValueError, "0-d")
        elif isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
            wrong["axis"] = (ValueError, f"axis={axis!r}")
    copies = [np.array(b) for b in bufs]
    try:
        if kind == "all_reduce":
            got = c.all_reduce(bufs, k["op"])
        elif kind == "broadcast":
            got = c.broadcast(bufs, root=root)
        elif kind == "reduce":
            got = [c.reduce(bufs, k["op"], root=root)]
        else:
            got = c.all_gather(bufs, axis=axis)
    except (TypeError, ValueError) as e:
        assert wrong, f"{k}: refused a valid call: {e!r}"
        assert any(isinstance(e, t) and w in str(e) for t, w in wrong.values()), f"{k}: {e!r} names none of {wrong}"
        return
    assert not wrong, f"{k}: accepted a call that is wrong in {sorted(wrong)}"
    if kind == "broadcast":
        want = bufs[root]
    elif kind == "all_gather":
        want = np.concatenate(bufs, axis=axis)
    else:
        stack = np.stack([np.asarray(b) for b in bufs])
        op = k["op"].lower()
        want = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](stack, axis=0).astype(
            stack.dtype) if op != "mean" else np.mean(stack, axis=0).astype(
            stack.dtype if stack.dtype.kind == "f" else np.float64)
    for g in got:
        assert g.shape == want.shape and g.dtype == want.dtype, (k, g.shape, g.dtype, want.shape, want.dtype)
        np.testing.assert_allclose(g.astype(np.float64), want.astype(np.float64), rtol=2e-3, err_msg=str(k))
    for b, before in zip(bufs, copies):  # the inputs are never written
        np.testing.assert_array_equal(b, before, err_msg=str(k))


check()


@SETTINGS
@given(st.integers(1, 3), st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=2),
                                             st.sampled_from(GOOD + ["bool"])), min_size=0, max_size=4),
       st.sampled_from(["sum", "max", "mean"]), st.sampled_from([0, 1, 7, 64, 2**70, -1, 1.5, None]),
       st.sampled_from([None, 1, 2, 5, 2**40, 0, "2"]), st.integers(0, 2**32 - 1))
def check_batch(n, tensors, op, bytes_per_pack, num_packs, seed):
    RUN[0] += 1
    rng = np.random.default_rng(seed)
    lists = [[rng.integers(-3, 4, size=shape).astype(dtype) for shape, dtype in tensors] for _ in range(n)]
    wrong = []
    if any(dtype == "bool" for _, dtype in tensors):
        wrong.append((TypeError, "bool"))
    if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
        wrong.append((ValueError, f"bytes_per_pack={bytes_per_pack!r}"))
    if num_packs is not None and (not isinstance(num_packs, int) or num_packs < 1):
        wrong.append((ValueError, f"num_packs={num_packs!r}"))
    try:
        got = c.batch_all_reduce(lists, op, bytes_per_pack=bytes_per_pack, num_packs=num_packs)
    except (TypeError, ValueError) as e:
        assert wrong, f"refused a valid call: {e!r}"
        assert any(isinstance(e, t) and w in str(e) for t, w in wrong), f"{e!r} names none of {wrong}"
        return
    assert not wrong, f"accepted a wrong call: {wrong}"
    for t in range(len(tensors)):
        stack = np.stack([lst[t] for lst in lists])
        want = np.mean(stack, axis=0) if op == "mean" else getattr(np, op)(stack, axis=0).astype(stack.dtype)
        for r in range(n):
            np.testing.assert_allclose(np.asarray(got[r][t], np.float64), np.asarray(want, np.float64), rtol=2e-3)


check_batch()
"""


def test_fuzz_collectives():
    """Every collective over random dtypes (supported or not), shapes (zero-size and 0-d included), layouts
    (Fortran, strided, zero-stride, read-only), ops, roots, axes and mismatches between replicas; and
    batch_all_reduce over random tensor lists with any bytes_per_pack / num_packs (huge ones included)."""
    _fuzz(COLLECTIVES_FUZZ, 400)


STRATEGY_FUZZ = """
s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])


@SETTINGS
@given(st.sampled_from(["sum", "mean", "min", "max", "SUM", "avg", None, 1]),
       st.sampled_from([None, 0, 1, -1, 2, -3, "0", 1.5, True]),
       st.lists(st.integers(0, 3), min_size=0, max_size=3), st.sampled_from(["float32", "float64", "int32", "bool"]),
       st.booleans(), st.integers(0, 2**32 - 1))
def check(op, axis, shape, dtype, gather, seed):
    RUN[0] += 1
    rng = np.random.default_rng(seed)
    parts = [rng.integers(-3, 4, size=shape).astype(dtype) for _ in range(2)]
    value = md.PerReplica(parts)
    ndim = len(shape)
    wrong = []
    if dtype == "bool":
        wrong.append((TypeError, "bool"))
    if not gather and (op is None or str(op).lower() not in ("sum", "mean", "min", "max")):
        wrong.append((ValueError, "reduce_op="))
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
        wrong.append((TypeError, f"axis={axis!r}"))
    elif gather and axis is None:
        wrong.append((ValueError, "axis=None"))
    elif axis is not None and (ndim == 0 or not -ndim <= axis < ndim):
        wrong.append((ValueError, f"axis={axis!r}" if ndim else "axis="))
    try:
        got = s.gather(value, axis=axis) if gather else s.reduce(op, value, axis=axis)
    except (TypeError, ValueError) as e:
        assert wrong, f"refused a valid call: {e!r}"
        assert any(isinstance(e, t) and w in str(e) for t, w in wrong), f"{e!r} names none of {wrong}"
        return
    assert not wrong, f"accepted a wrong call: {wrong}"
    if gather:
        want = np.concatenate(parts, axis=axis)
    else:
        stack = np.stack(parts)
        op = op.lower()
        # TF's reductions of nothing: the op's identity (min: the dtype's largest value), the mean NaN
        big = np.inf if stack.dtype.kind == "f" else np.iinfo(stack.dtype).max
        fn = {"sum": np.sum, "mean": np.mean, "min": lambda x, axis: np.min(x, axis=axis, initial=big),
              "max": lambda x, axis: np.max(x, axis=axis, initial=-big - (stack.dtype.kind != "f"))}[op]
        want = fn(stack, axis=0) if axis is None else fn(np.concatenate(parts, axis=axis), axis=axis)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-6)


check()
"""


def test_fuzz_strategy_reduce_and_gather():
    """strategy.reduce / gather over random ops, axes (out of range, str, float, bool), ranks and dtypes."""
    _fuzz(STRATEGY_FUZZ, 300)


DATA_FUZZ = """
D = md.data.Dataset
ARGS = st.one_of(st.integers(-3, 7), st.sampled_from([None, 1.5, float("nan"), "2", True, 2**62]))


def reference(n, op, a, b):
    x = list(range(n))
    if op == "batch":
        return [x[i:i + a] for i in range(0, n, a) if not b or len(x[i:i + a]) == a]
    if op == "take":
        return x if a < 0 else x[:a]
    if op == "skip":
        return [] if a < 0 else x[a:]
    if op == "repeat":  # (followed by take(3 * n): a negative count repeats forever)
        return (x * (3 if a < 0 else min(a, 3)))[:3 * n]
    if op == "shard":
        return x[b::a]
    if op == "prefetch":
        return x
    raise AssertionError(op)


@SETTINGS
@given(st.integers(0, 9), st.sampled_from(["batch", "take", "skip", "repeat", "shard", "prefetch"]), ARGS,
       st.one_of(st.booleans(), st.integers(-2, 4)))
def check(n, op, a, b):
    RUN[0] += 1
    given = a
    if op == "repeat" and a is None:  # (tf.data's default count: forever)
        a = -1
    is_int = isinstance(a, int) and not isinstance(a, bool)
    valid = is_int and {"batch": a > 0, "take": True, "skip": True, "repeat": True,
                        "shard": a > 0 and isinstance(b, int) and not isinstance(b, bool) and 0 <= b < a,
                        "prefetch": a > 0 or a in (-1, 0)}[op]
    if op == "batch":
        b = bool(b)
    try:
        ds = D.range(n)
        ds = {"batch": lambda: ds.batch(a, drop_remainder=b), "take": lambda: ds.take(a),
              "skip": lambda: ds.skip(a), "repeat": lambda: ds.repeat(given).take(3 * n),
              "shard": lambda: ds.shard(a, b), "prefetch": lambda: ds.prefetch(a)}[op]()
        got = [np.asarray(e).tolist() for e in ds]
    except (TypeError, ValueError) as e:
        assert not valid, f"{op}({a!r}, {b!r}) refused: {e!r}"
        named = "batch_size" if op == "batch" else "num_shards" if op == "shard" and not (
            is_int and a > 0) else "index" if op == "shard" else "buffer_size" if op == "prefetch" else "count"
        assert f"{named}=" in str(e), f"{op}({a!r}, {b!r}): {e!r} does not name {named}"
        assert isinstance(e, TypeError) == (not is_int or (op == "shard" and is_int and a > 0 and not (
            isinstance(b, int) and not isinstance(b, bool)))), f"{op}({a!r}, {b!r}): {e!r}"
        return
    assert valid, f"{op}({a!r}, {b!r}) accepted"
    assert got == reference(n, op, a, b), (op, a, b, got)


check()
"""


def test_fuzz_dataset_counts():
    """batch / take / skip / repeat / shard / prefetch with negative, zero, huge, float, NaN, bool, str and None
    counts: tf.data's result (a list model of it) or the TypeError / ValueError naming the argument."""
    _fuzz(DATA_FUZZ, 300)


@pytest.mark.skipif(__import__("importlib").util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_gpu_destination_without_cupy_names_the_device():
    code = ("import numpy as np, mirrored as md\ns = md.MirroredStrategy(['/cpu:0', '/cpu:1'])\n"
            "s.extended.reduce_to('sum', md.PerReplica([np.ones(2), np.ones(2)]), destinations='/gpu:0')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError") and "GPU:0" in last and "CuPy" in last, proc.stderr[-2000:]


def test_bench_plot_into_a_missing_folder_fails_before_the_sweep(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mirrored.bench", "all_reduce", "-b", "8", "-e", "8", "-g", "2",
                           "--plot", str(tmp_path / "missing" / "x.png")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--plot" in proc.stderr and "missing" in proc.stderr
    assert "size" not in proc.stdout  # no table: it stopped before measuring anything
