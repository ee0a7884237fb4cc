"""Records tf.linalg.matmul's outputs for tests/data/linalg_matmul_tf.npz (run with a TensorFlow venv,
from the repository root): each case's inputs, keyword arguments (JSON) and TF's result."""
import json

import numpy as np
import tensorflow as tf

rng = np.random.default_rng(21)
def complex_of(shape, dtype):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
specs = [
    ("adjoint_complex_broadcast", complex_of((2, 1, 4, 3), np.complex64), complex_of((3, 5, 4), np.complex64),
     dict(adjoint_a=True, adjoint_b=True)),
    ("transpose_a_adjoint_b_complex128", complex_of((4, 3), np.complex128), complex_of((5, 4), np.complex128),
     dict(transpose_a=True, adjoint_b=True)),
    ("float16_transpose_b", rng.standard_normal((3, 4, 8)).astype(np.float16), rng.standard_normal((6, 8)).astype(np.float16),
     dict(transpose_b=True)),
    ("float64_batch", rng.standard_normal((2, 3, 5, 7)), rng.standard_normal((2, 3, 7, 2)), {}),
    ("int8_uint8_into_int32", rng.integers(-128, 127, (4, 6)).astype(np.int8), rng.integers(0, 255, (6, 3)).astype(np.uint8),
     dict(output_type="int32")),
    ("int32_wraps", rng.integers(-2**31, 2**31 - 1, (3, 4)).astype(np.int32), rng.integers(-2**31, 2**31 - 1, (4, 2)).astype(np.int32), {}),
    ("float32_k1", rng.standard_normal((5, 1)).astype(np.float32), rng.standard_normal((1, 4)).astype(np.float32), {}),
]
out = {}
for name, a, b, kw in specs:
    r = tf.linalg.matmul(tf.constant(a), tf.constant(b), **kw).numpy()
    out[f"{name}/a"], out[f"{name}/b"], out[f"{name}/out"] = a, b, r
    out[f"{name}/kwargs"] = np.array(json.dumps(kw))
    print(name, r.dtype, r.shape)
np.savez("tests/data/linalg_matmul_tf.npz", **out)
