"""``mirrored-run --max-restarts`` with an md.data input pipeline: a job killed mid-epoch resumes on the same
next batch (the iterator is in the checkpoint) and ends with weights bit-identical to an uninterrupted run."""

import json
import re

import numpy as np
import pytest
from multiworker_launch import run_restartable_job

pytestmark = pytest.mark.multiworker
pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")

ROWS, EPOCHS, GLOBAL_BATCH = 40, 3, 8
STEPS = ROWS * EPOCHS // GLOBAL_BATCH  # 15: 5 per epoch
CRASH_AT = 7  # in the middle of the second epoch

TRAIN = f"""
import json, os, sys
import numpy as np
import mirrored as md

directory, marker, out = sys.argv[1:4]
strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=60))
me = strategy.cluster_resolver.task_id
rng = np.random.default_rng(0)
x = rng.normal(size=({ROWS}, 4)).astype(np.float32)
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)

dataset = (md.data.Dataset.from_tensor_slices({{"id": np.arange({ROWS}), "x": x, "y": y}})
           .shuffle({ROWS}, seed=5).repeat({EPOCHS}).batch({GLOBAL_BATCH})
           .map(lambda b: (b["id"], b["x"], b["y"]), num_parallel_calls=2).prefetch(2))
iterator = iter(strategy.experimental_distribute_dataset(dataset))

with strategy.scope():
    w = md.Variable(np.zeros((4, 1), np.float32), name="w")
    optimizer = md.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    optimizer.build([w])  # as a Keras program: the slots exist, so restore fills them at once
checkpoint = md.train.Checkpoint(w=w, optimizer=optimizer, iterator=iterator)
manager = md.train.CheckpointManager(checkpoint, directory, max_to_keep=3)
if manager.latest_checkpoint:
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
print("resumed at step", int(optimizer.iterations.numpy()), flush=True)


def train_step(x, y):
    grad = 2.0 * x.T @ (x @ w.read_value() - y) / {GLOBAL_BATCH}
    optimizer.apply_gradients([(grad, w)])


for ids, xb, yb in iterator:
    step = int(optimizer.iterations.numpy())
    if me == 1 and step == {CRASH_AT} and not os.path.exists(marker):
        open(marker, "w").close()
        print("crashing", flush=True)
        os._exit(3)
    # (a step is a PerReplica across workers, as TF's, even with one local replica)
    ids = np.concatenate([np.asarray(part) for part in strategy.experimental_local_results(ids)])
    print("step", step, "ids", ids.tolist(), flush=True)
    strategy.run(train_step, args=(xb, yb))
    manager.save()

with open(f"{{out}}.{{me}}", "w") as f:
    json.dump({{"w": w.numpy().tolist(), "step": int(optimizer.iterations.numpy())}}, f)
"""


def batches(stdout: bytes) -> list:
    """(worker, step, ids) of every step the job ran, in order."""
    found = re.findall(rb"\[worker:(\d)\] step (\d+) ids (\[[^\]]*\])", stdout)
    return [(int(w), int(s), json.loads(ids)) for w, s, ids in found]


def test_a_job_killed_mid_epoch_resumes_on_the_same_next_batch_with_bit_identical_weights(tmp_path):
    clean, expected = run_restartable_job(tmp_path, TRAIN, "clean", crash=False)
    crashed, got = run_restartable_job(tmp_path, TRAIN, "crashed", crash=True)

    assert crashed.stdout.count(b"[worker:1] crashing") == 1
    assert crashed.stderr.count(b"[mirrored-run] restarting the job (1 of 2 restarts)") == 1
    resumed = [int(line.rsplit(b" ", 1)[1]) for line in crashed.stdout.splitlines() if b"resumed at step" in line]
    assert len(resumed) == 4 and resumed[2] == resumed[3] and 0 < resumed[2] <= CRASH_AT

    reference = {(w, s): ids for w, s, ids in batches(clean.stdout)}
    assert len(reference) == 2 * STEPS
    # Every batch of the crashed job (before and after the restart) is the one the clean job had at that step.
    ran = batches(crashed.stdout)
    assert {(w, s) for w, s, _ in ran} == set(reference)
    assert all(ids == reference[(w, s)] for w, s, ids in ran)
    # Each epoch is a permutation of the rows, each global batch split 4 + 4 over the workers.
    for epoch in range(EPOCHS):
        rows = [i for s in range(epoch * 5, epoch * 5 + 5) for w in range(2) for i in reference[(w, s)]]
        assert sorted(rows) == list(range(ROWS))

    for me in range(2):
        assert got[me]["step"] == expected[me]["step"] == STEPS
        np.testing.assert_array_equal(np.array(got[me]["w"], np.float32), np.array(expected[me]["w"], np.float32))
