"""IndexedSlices across two workers (MultiWorkerMirroredStrategy on 127.0.0.1): every replica's rows of every
worker, concatenated in replica order (workers of other row counts too), and an optimizer fed them
giving the one-process result of two replicas as TensorFlow / Keras recorded it."""

import numpy as np

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER


# --- task function (runs inside the launched processes) ---------------------------------------


def sparse_job():
    import mirrored as md
    from test_indexed_slices import _check_optimizer, _recorded_slices, _sparse_inputs, INPUTS

    strategy = md.MultiWorkerMirroredStrategy(communication_options=md.CommunicationOptions(timeout_seconds=60))
    rank = strategy.cluster_resolver.task_id
    s = _sparse_inputs(rank, "float32", "int32")  # worker r passes r + 2 rows
    out = {}
    for op in ("sum", "mean"):
        reduced = strategy.run(lambda op=op: md.get_replica_context().all_reduce(op, s))
        out[op] = (np.asarray(reduced.values), np.asarray(reduced.indices))
    with strategy.scope():
        e = md.Variable(np.array(INPUTS["embedding0"], np.float32))
        w = md.Variable(np.array(INPUTS["w0"], np.float32))
        opt = md.optimizers.Adam(learning_rate=0.01)
    grads_w = np.array(INPUTS["grads_w"], np.float32)
    for step in range(4):
        strategy.run(lambda step=step: opt.apply_gradients([(_recorded_slices(step, rank), e),
                                                            (grads_w[step, rank], w)]))
    _check_optimizer("Adam", 2, opt, e, w)
    out["embedding"] = np.asarray(e.numpy())
    return out


# --- tests -----------------------------------------------------------------------------------


def test_slices_gather_across_workers_and_train_as_keras():
    from test_indexed_slices import _sparse_inputs

    results = launch(sparse_job, 2, timeout=180)
    for r in results:
        assert r.ok, (r.task, r.returncode, r.error, r.message, r.stderr[-3000:])
    parts = [_sparse_inputs(r, "float32", "int32") for r in range(2)]
    values = np.concatenate([p.values for p in parts])
    indices = np.concatenate([p.indices for p in parts])
    for r in results:
        np.testing.assert_array_equal(r.value["sum"][0], values)
        np.testing.assert_array_equal(r.value["sum"][1], indices)
        np.testing.assert_array_equal(r.value["mean"][0], values / np.float32(2))
    np.testing.assert_array_equal(results[0].value["embedding"], results[1].value["embedding"])
