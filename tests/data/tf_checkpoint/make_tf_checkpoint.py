"""Writes the TensorFlow checkpoints the tests read (run with TensorFlow 2.21; the files are committed).

    /work/venvs/tf/bin/python tests/data/tf_checkpoint/make_tf_checkpoint.py tests/data/tf_checkpoint

- ``managed/ckpt-2``, ``managed/ckpt-3`` (+ ``checkpoint``): a tf.train.Checkpoint of a tf.Module with variables of several
  dtypes and shapes (a scalar, a bfloat16 matrix, an empty tensor, an int8 vector), a nested module and a
  list, written by ``tf.train.CheckpointManager`` (max_to_keep=2, saved three times: ckpt-2, ckpt-3 kept).
- ``expected.npz``: every variable's value, by TF's checkpoint key, for the tests to compare against.
"""

import os
import sys

import numpy as np
import tensorflow as tf

out = sys.argv[1]


class Dense(tf.Module):
    def __init__(self, rng, n_in, n_out):
        super().__init__()
        self.w = tf.Variable(rng.normal(size=(n_in, n_out)).astype(np.float32), name="w")
        self.b = tf.Variable(np.arange(n_out, dtype=np.float64) / 3, name="b")


class Model(tf.Module):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(7)
        self.dense = Dense(rng, 3, 2)
        self.layers = [Dense(rng, 2, 4), Dense(rng, 4, 1)]
        self.scale = tf.Variable(tf.constant([[1.5, -2.25], [0.125, 3.0]], dtype=tf.bfloat16), name="scale")
        self.codes = tf.Variable(np.array([-128, -1, 0, 7, 127], np.int8), name="codes")
        self.count = tf.Variable(np.int64(41), name="count")
        self.empty = tf.Variable(np.zeros((0, 3), np.float32), name="empty")
        self.flag = tf.Variable(True, name="flag")
        self.half = tf.Variable(np.array([0.5, -1.0, 65504.0], np.float16), name="half")


model = Model()
step = tf.Variable(np.int64(0), name="step")
ckpt = tf.train.Checkpoint(model=model, step=step)
manager = tf.train.CheckpointManager(ckpt, os.path.join(out, "managed"), max_to_keep=2)
for _ in range(3):
    step.assign_add(1)
    model.count.assign_add(1)
    manager.save()

reader = tf.train.load_checkpoint(manager.latest_checkpoint)
expected = {}
for name, _ in tf.train.list_variables(manager.latest_checkpoint):
    value = reader.get_tensor(name)
    if isinstance(value, bytes):
        value = np.frombuffer(value, np.uint8)
    expected[name] = np.asarray(value).astype(np.float64) if np.asarray(value).dtype.name == "bfloat16" else value
np.savez(os.path.join(out, "expected.npz"), **{k.replace("/", "|"): v for k, v in expected.items()})
print(manager.latest_checkpoint, sorted(expected))
