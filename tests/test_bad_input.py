"""Bad input never crashes, hangs or goes silently wrong: each case runs in a subprocess with a timeout
and must raise the named exception with a message that names the argument or the fix."""

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import numpy as np
import mirrored as md
rid = lambda: md.get_replica_context().replica_id_in_sync_group
s = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
"""

CASES = {
    "mismatched shapes": ("ValueError", "same shape",
                          "s.run(lambda: md.get_replica_context().all_reduce('sum', np.ones(rid() + 1)))"),
    "mismatched dtypes": ("ValueError", "dtype",
                          "s.reduce('sum', md.PerReplica([np.ones(2, np.float32), np.ones(2, np.int32)]), axis=None)"),
    "unsupported dtype": ("TypeError", "not supported",
                          "s.reduce('sum', md.PerReplica([np.ones(2, bool), np.ones(2, bool)]), axis=None)"),
    "wrong number of components": ("ValueError", "one component per replica",
                                   "s.run(lambda x: x, args=(md.PerReplica([1, 2, 3]),))"),
    "run args not a tuple": ("ValueError", "args=(x,)", "s.run(lambda x: x, args=np.ones(2))"),
    "per-replica from one array": ("ValueError", "one component per replica", "md.PerReplica(np.ones(3))"),
    "unknown reduce op": ("ValueError", "ReduceOp", "s.reduce('avg', md.PerReplica([1, 2]), axis=None)"),
    "bad device string": ("ValueError", "devices", "md.MirroredStrategy(['/cpu:0', '/gpuu:1'])"),
    "missing gpu": ("ValueError", "not available", "md.MirroredStrategy(['/gpu:7'])"),
    "duplicate devices": ("ValueError", "duplicates", "md.MirroredStrategy(['/cpu:0', 'CPU:0'])"),
    "empty device iterator": ("ValueError", "no device given", "md.MirroredStrategy(iter([]))"),
    "nccl on cpu": ("ValueError", "RingAllReduce",
                    "md.MirroredStrategy(['/cpu:0', '/cpu:1'], cross_device_ops=md.NcclAllReduce())"
                    ".reduce('sum', md.PerReplica([np.ones(1), np.ones(1)]), axis=None)"),
    "collective outside run": ("AttributeError", "all_reduce",
                               "with s.scope(): md.get_replica_context().all_reduce('sum', 1.0)"),
    "stale replica context": ("RuntimeError", "inside the replica function",
                              "ctx = s.run(lambda: md.get_replica_context()).values[1]\n"
                              "ctx.all_reduce('sum', 1.0)"),
    "run inside merge_fn": ("RuntimeError", "inside one of its own replicas",
                            "s.run(lambda: md.get_replica_context().merge_call(lambda st: st.run(lambda: 1)))"),
    "reduce inside run": ("RuntimeError", "cross-replica", "s.run(lambda: s.reduce('sum', 1.0, axis=None))"),
    "gather bad axis": ("ValueError", "axis", "s.gather(md.PerReplica([np.ones(2), np.ones(2)]), axis=3)"),
    "assign wrong shape": ("ValueError", "shape", "with s.scope(): v = md.Variable(np.ones(2))\nv.assign(np.ones(3))"),
    "assign float to int": ("TypeError", "astype", "with s.scope(): v = md.Variable(np.ones(2, np.int32))\n"
                                                   "v.assign(np.ones(2) * 1.5)"),
    "non-array value": ("TypeError", "cannot be converted", "s.reduce('sum', md.PerReplica([object(), object()]), "
                                                           "axis=None)"),
    "ragged batch": ("ValueError", "leading", "list(s.experimental_distribute_dataset([(np.ones(3), np.ones(2))]))"),
    "run fn raises in one replica": ("KeyError", "boom",
                                     "def f():\n    if rid() == 1: raise KeyError('boom')\n"
                                     "    return md.get_replica_context().all_reduce('sum', 1.0)\ns.run(f)"),
}

# Valid edge cases: must succeed, with the printed result checked.
OK_CASES = {
    "zero-size arrays": ("s.reduce('sum', md.PerReplica([np.ones((0, 3)), np.ones((0, 3))]), axis=None).shape",
                         "(0, 3)"),
    "nan propagates": ("s.reduce('max', md.PerReplica([np.array([np.nan]), np.array([1.0])]), axis=None)",
                       "[nan]"),
    "inf propagates": ("s.reduce('sum', md.PerReplica([np.array([np.inf]), np.array([-np.inf])]), axis=None)",
                       "[nan]"),
    "non-contiguous input": ("s.reduce('sum', md.PerReplica([np.arange(6.0)[::2], np.arange(6.0)[::2]]), "
                             "axis=None)", "[0. 4. 8.]"),
    "dlpack and buffer protocol": ("s.reduce('sum', md.PerReplica([memoryview(np.ones(2)), "
                                   "np.from_dlpack(np.ones(2))]), axis=None)", "[2. 2.]"),
}


def _run(body: str, timeout: float = 60):
    code = PRELUDE + textwrap.dedent(body) + "\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_clearly(name):
    exc, words, body = CASES[name]
    try:
        proc = _run(body)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: hung")
    assert proc.returncode == 1, f"{name}: expected a Python exception, got rc={proc.returncode}\n{proc.stderr}"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(exc), last
    assert words.lower() in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize("name", sorted(OK_CASES))
def test_edge_cases_work(name):
    expr, expected = OK_CASES[name]
    proc = _run(f"print({expr})")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
