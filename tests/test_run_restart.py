"""``mirrored-run --max-restarts``: a job whose task crashes resumes from its last checkpoint and ends as if uninterrupted."""

import numpy as np
import pytest
from multiworker_launch import run_restartable_job

pytestmark = pytest.mark.multiworker
pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")

STEPS = 10
CRASH_AT = 5

TRAIN = f"""
import json, os, sys
import numpy as np
import mirrored as md

directory, marker, out = sys.argv[1:4]
strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=60))
me = strategy.cluster_resolver.task_id
rng = np.random.default_rng(0)
x_all = rng.normal(size=({STEPS} * 8, 4)).astype(np.float32)
y_all = x_all @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)

with strategy.scope():
    w = md.Variable(np.zeros((4, 1), np.float32), name="w")
    optimizer = md.optimizers.SGD(learning_rate=0.05, momentum=0.9)
checkpoint = md.train.Checkpoint(w=w, optimizer=optimizer)
manager = md.train.CheckpointManager(checkpoint, directory, max_to_keep=3)
if manager.latest_checkpoint:
    checkpoint.restore(manager.latest_checkpoint)
print("resumed at step", int(optimizer.iterations.numpy()), flush=True)


def train_step(x, y):
    # This worker's half of a global batch of 8: the replicas' gradients sum to the batch mean.
    grad = 2.0 * x.T @ (x @ w.read_value() - y) / 8
    optimizer.apply_gradients([(grad, w)])


while (step := int(optimizer.iterations.numpy())) < {STEPS}:
    if me == 1 and step == {CRASH_AT} and not os.path.exists(marker):
        open(marker, "w").close()
        print("crashing", flush=True)
        os._exit(3)
    rows = slice(step * 8 + me * 4, step * 8 + me * 4 + 4)
    strategy.run(train_step, args=(x_all[rows], y_all[rows]))
    manager.save()

with open(f"{{out}}.{{me}}", "w") as f:
    json.dump({{"w": w.numpy().tolist(), "step": int(optimizer.iterations.numpy())}}, f)
"""


def test_a_crashed_task_restarts_the_job_from_its_checkpoint_and_ends_like_an_uninterrupted_run(tmp_path):
    clean, expected = run_restartable_job(tmp_path, TRAIN, "clean", crash=False)
    crashed, got = run_restartable_job(tmp_path, TRAIN, "crashed", crash=True)

    assert b"restarting" not in clean.stderr
    assert clean.stdout.count(b"resumed at step 0") == 2
    # The crash happened once, ended the job, and the whole job was restarted once.
    assert crashed.stdout.count(b"[worker:1] crashing") == 1
    assert b"[mirrored-run] worker:1 exited with code 3" in crashed.stderr
    assert crashed.stderr.count(b"[mirrored-run] restarting the job (1 of 2 restarts)") == 1
    resumed = [int(line.rsplit(b" ", 1)[1]) for line in crashed.stdout.splitlines() if b"resumed at step" in line]
    assert resumed[:2] == [0, 0] and len(resumed) == 4
    # Both tasks of the second run resumed from the same checkpoint, written after step 4 or 5.
    assert resumed[2] == resumed[3] and CRASH_AT - 1 <= resumed[2] <= CRASH_AT

    for me in range(2):
        assert got[me]["step"] == expected[me]["step"] == STEPS
        np.testing.assert_array_equal(np.array(got[me]["w"], np.float32), np.array(expected[me]["w"], np.float32))
    np.testing.assert_array_equal(got[0]["w"], got[1]["w"])
    # And training did train: the weights moved towards the true ones.
    assert np.abs(np.array(expected[0]["w"]).ravel() - [1.0, -2.0, 0.5, 3.0]).max() < 2.0
