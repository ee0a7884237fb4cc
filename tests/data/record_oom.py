"""Records TF 2.21's error for an allocation the allocator cannot satisfy (tests/data/tf_oom_reference.json).

TF's CPU build is enough: its message for a tensor too large for host memory has the words its GPU allocator
uses ("OOM when allocating tensor with shape[...] and type ... on <device> by allocator <name>"), which
test_gpu_out_of_memory.py checks mirrored's GPU messages against. Run with /work/venvs/tf/bin/python.
"""

import json
import pathlib

import tensorflow as tf

try:
    tf.zeros([4, 1 << 40], tf.int32)
    raise SystemExit("TF allocated 16 TiB: no out-of-memory error to record")
except tf.errors.ResourceExhaustedError as error:
    record = {"type": type(error).__name__, "error_code": error.error_code, "message": error.message,
              "tf_version": tf.__version__}
(pathlib.Path(__file__).parent / "tf_oom_reference.json").write_text(json.dumps(record, indent=1) + "\n")
print(record["message"])
