"""Multi-worker collectives through the one face: planned once per signature, then run natively.

Two workers with two local replicas each. A repeated call must give the same
answers as its first (validated) call, against NumPy; arrays that do not fit
the plan go back to the validating path; batches are fused by the native
packer whatever the packing, integer MEAN stays float64; workers whose
batches differ all raise the same error, and the job goes on.
"""


import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER

LOCAL = 2
WORKERS = 2
REPLICAS = LOCAL * WORKERS
DTYPES = ["float32", "float64", "int32", "int64", "float16"]
# Shapes of a batch: scalars, empties, odd sizes, one past the inline header payload, one large.
BATCH_SHAPES = [(), (3,), (0, 2), (7, 5), (17,), (1000,), (300, 301)]
PACKINGS = [{}, {"bytes_per_pack": 256}, {"num_packs": 3}, {"bytes_per_pack": 1}]


def value(g, t, shape, dtype):
    """Replica g's tensor t (small integers: every sum is exact in every dtype)."""
    size = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(size) * 7 + g * 3 + t) % 11 - 5).astype(dtype).reshape(shape)


def plan_calls():
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.collective import plan as face
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    g = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), LOCAL, timeout=60.0)
    mine = [g.rank * LOCAL + k for k in range(LOCAL)]
    out = {}
    for dtype in DTYPES:
        for op in ["sum", "max", "mean"]:
            x = [value(r, 0, (5, 3), dtype) for r in mine]
            first = g.all_reduce(x, op)
            again = g.all_reduce(x, op)  # the plan's call
            buffers = [a.copy() for a in x]
            in_place = g.all_reduce(buffers, op, out=buffers) if op != "mean" or dtype[0] == "f" else None
            out[("all_reduce", dtype, op)] = (first, again, None if in_place is None else
                                              (all(a is b for a, b in zip(in_place, buffers)), buffers))
        x = [value(r, 1, (4,), dtype) for r in mine]
        out[("broadcast", dtype)] = [g.broadcast(x, root=3), g.broadcast(x, root=3)]
        out[("reduce", dtype)] = [g.reduce(x, "sum", root=1), g.reduce(x, "sum", root=1)]
    # A reduce writes only the root's output (replica 1, on worker 0): the strided outputs of the other
    # replicas keep their values on every worker.
    x = [value(r, 1, (4,), "float32") for r in mine]
    kept = [np.arange(8, dtype=np.float32)[::2] for _ in mine]
    outs = list(kept)
    if g.rank == 0:
        outs[1] = np.zeros(4, np.float32)
    out["reduce into strided"] = (g.reduce(x, "sum", root=1, out=outs), kept)
    # Arrays that do not fit a plan (strided, another dtype) are validated afresh and still right.
    base = [value(r, 0, (10,), "float32") for r in mine]
    out["strided"] = g.all_reduce([b[::2] for b in base], "sum")
    out["list of lists"] = g.all_reduce([b.tolist() for b in base], "sum")
    for packing in PACKINGS:
        for dtypes in [["float32"] * len(BATCH_SHAPES), DTYPES + DTYPES[:2]]:
            lists = [[value(r, t, s, d) for t, (s, d) in enumerate(zip(BATCH_SHAPES, dtypes))] for r in mine]
            for op in ["sum", "mean"]:
                first = g.batch_all_reduce(lists, op, **packing)
                again = g.batch_all_reduce(lists, op, **packing)
                out[("batch", str(packing), dtypes[-1], op)] = (first, again)
    for axis in (0, 1):
        for dtype in DTYPES:
            # Replica g's extent along the axis is g + 1: shapes differ locally and between workers.
            x = [value(r, 2, (2, r + 1) if axis else (r + 1, 2), dtype) for r in mine]
            out[("all_gather", axis, dtype)] = [g.all_gather(x, axis) for _ in range(2)]
    # Plans were kept, each naming this job's communicator.
    out["planned"] = sorted({type(p).__name__ for key, p in face._plans.items()
                             if key[1] and key[1][0] is g._gloo})
    g.close()
    return out


def expected(fn, t, shape, dtype):
    stack = np.stack([value(g, t, shape, dtype) for g in range(REPLICAS)])
    return fn(stack)


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_repeated_calls_run_their_plan_and_match_numpy(shm):
    results = launch(plan_calls, WORKERS, env={"MIRRORED_SHM": shm}, timeout=240)
    for res in results:
        assert res.ok, (res.task, res.message, res.stderr[-3000:])
    reducers = {"sum": lambda s: s.sum(0, dtype=s.dtype), "max": lambda s: s.max(0),
                "mean": lambda s: s.mean(0, dtype=np.float64 if s.dtype.kind in "iu" else s.dtype)}
    for rank, res in enumerate(results):
        got = res.value
        assert got["planned"] == ["WorkerBatchPlan", "WorkerGatherPlan", "WorkerPlan"]
        for axis in (0, 1):
            for dtype in DTYPES:
                want = np.concatenate([value(r, 2, (2, r + 1) if axis else (r + 1, 2), dtype)
                                       for r in range(REPLICAS)], axis)
                for results_ in got[("all_gather", axis, dtype)]:
                    assert len(results_) == LOCAL
                    for a in results_:
                        assert a.dtype == want.dtype and a.shape == want.shape
                        np.testing.assert_array_equal(a, want)
        for dtype in DTYPES:
            for op in ["sum", "max", "mean"]:
                want = expected(reducers[op], 0, (5, 3), dtype)
                first, again, in_place = got[("all_reduce", dtype, op)]
                for results_ in (first, again) + (() if in_place is None else (in_place[1],)):
                    assert len(results_) == LOCAL
                    for a in results_:
                        assert a.dtype == want.dtype and a.shape == want.shape, (dtype, op)
                        np.testing.assert_allclose(a, want, rtol=1e-3, err_msg=f"{dtype} {op}")
                if in_place is not None:
                    assert in_place[0], "out=buffers returns the buffers themselves"
            root = value(3, 1, (4,), dtype)
            for b in got[("broadcast", dtype)]:
                for a in b:
                    np.testing.assert_array_equal(a, root)
            for r in got[("reduce", dtype)]:
                if rank == 0:  # replica 1 is local replica 1 of worker 0
                    np.testing.assert_array_equal(r, expected(reducers["sum"], 1, (4,), dtype))
                else:
                    assert r is None
        target, kept = got["reduce into strided"]
        if rank == 0:
            np.testing.assert_array_equal(target, expected(reducers["sum"], 1, (4,), "float32"))
        else:
            assert target is None
        for i, a in enumerate(kept):
            if not (rank == 0 and i == 1):
                np.testing.assert_array_equal(a, np.arange(8, dtype=np.float32)[::2])
        base_sum = sum(value(g, 0, (10,), "float32") for g in range(REPLICAS))
        for a in got["strided"]:
            np.testing.assert_array_equal(a, base_sum[::2])
        for a in got["list of lists"]:
            np.testing.assert_array_equal(a, base_sum)
        for packing in PACKINGS:
            for dtypes in [["float32"] * len(BATCH_SHAPES), DTYPES + DTYPES[:2]]:
                for op in ["sum", "mean"]:
                    for rows in got[("batch", str(packing), dtypes[-1], op)]:
                        assert len(rows) == LOCAL
                        for row in rows:
                            for t, (shape, dtype) in enumerate(zip(BATCH_SHAPES, dtypes)):
                                want = expected(reducers[op], t, shape, dtype)
                                assert row[t].dtype == want.dtype and row[t].shape == want.shape, (t, dtype, op)
                                np.testing.assert_allclose(row[t], want, rtol=1e-3,
                                                           err_msg=f"tensor {t} {dtype} {op} {packing}")


def batch_disagree(variant):
    """Worker 0 and worker 1 pass batches that differ; then both run a matched batch."""
    import mirrored as md
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    g = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=20.0)
    r = g.rank
    same_total = [np.ones(3 if r == 0 else 5, np.float32), np.ones(5 if r == 0 else 3, np.float32)]
    calls = {
        # The one pack has 8 elements on both workers: only the layout tells them apart.
        "split": lambda: g.batch_all_reduce([same_total]),
        "packing": lambda: g.batch_all_reduce([[np.ones(3, np.float32)] * 2], num_packs=1 if r == 0 else 2),
        "op": lambda: g.batch_all_reduce([[np.ones(3, np.float32)]], "sum" if r == 0 else "max"),
        "plain": lambda: (g.batch_all_reduce([[np.ones(3, np.float32)]]) if r == 0
                          else g.all_reduce([np.ones(3, np.float32)])),
    }
    report = {}
    for attempt in range(2):  # the first call validates and plans, the second runs the plan
        try:
            calls[variant]()
            report[attempt] = None
        except md.errors.CollectiveMismatchError as e:
            report[attempt] = str(e)
    report["after"] = g.batch_all_reduce([[np.full(4, 1.0 + r, np.float32), np.arange(3, dtype=np.int64)]])
    g.close()
    return report


BATCH_MISMATCH = {
    "split": r"batch_all_reduce #\d+: worker:0 and worker:1 pass batches that differ in their tensors' sizes or "
             r"dtypes, or in bytes_per_pack / num_packs",
    "packing": r"batch_all_reduce #\d+: worker:0 and worker:1 pass batches that differ",
    "op": r"batch_all_reduce #\d+: worker:0 passes 3 float32 elements \(sum\), worker:1 passes 3 float32 elements "
          r"\(max\)",
    "plain": r"collective #\d+: worker:0 calls batch_all_reduce, worker:1 calls all_reduce",
}


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
@pytest.mark.parametrize("variant", sorted(BATCH_MISMATCH))
def test_batches_that_differ_raise_on_every_worker_and_the_job_goes_on(variant, shm):
    import re

    results = launch(batch_disagree, WORKERS, kwargs={"variant": variant}, env={"MIRRORED_SHM": shm}, timeout=90)
    for res in results:
        assert res.ok, (res.task, res.message, res.stderr[-3000:])
    for attempt in (0, 1):  # validated, then planned: the same error on every worker each time
        messages = {res.value[attempt] for res in results}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert message is not None and re.search(BATCH_MISMATCH[variant], message), message
        assert f"#{attempt + 1}:" in message and "no data was exchanged" in message
    for res in results:
        floats, ints = res.value["after"][0]
        np.testing.assert_array_equal(floats, np.full(4, 3.0, np.float32))
        np.testing.assert_array_equal(ints, np.arange(3, dtype=np.int64) * 2)
