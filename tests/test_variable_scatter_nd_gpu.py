"""The variable scatter/gather surface on GPU copies (marker ``gpu``: on the simulated GPUs without a GPU, see
gpu_env.py): TensorFlow 2.21's recorded results (tests/test_variable_scatter_nd.py's cases), computed on the
copies' GPUs; indices out of range raise there too, before anything is written."""

import numpy as np
import pytest

from gpu_env import SKIP_REASON, cupy, gpu_pair, mirrored_strategy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import mirrored as md  # noqa: E402
from test_variable_scatter_nd import BATCH, CASES, READERS, _array, _assert_equal, _slices  # noqa: E402

# Every dtype CuPy has (no bfloat16), rank-2+ indices (rank 1 is refused before any device work)
GPU_CASES = [i for i, c in enumerate(CASES) if c["var"]["dtype"] != "bfloat16" and len(c["indices"]["shape"]) > 1]


def _copies(v):
    return [cupy.asnumpy(c.read_value()) for c in v.values]


@pytest.mark.parametrize("i", GPU_CASES[::4] + [i for i in GPU_CASES if i >= len(CASES) - 5])
def test_scatter_nd_on_gpu_copies_matches_tf(i):
    case = CASES[i]
    with gpu_pair(), mirrored_strategy(2) as strategy:
        with strategy.scope():
            v = md.Variable(_array(case["var"]))
        indices, updates = _array(case["indices"]), _array(case["updates"])
        if i % 2:  # indices and updates on the GPU already
            indices, updates = cupy.asarray(indices), cupy.asarray(updates)
        strategy.extended.update(v, lambda copy: getattr(copy, case["method"])(indices, updates))
        for copy in v.values:
            assert isinstance(copy.read_value(), cupy.ndarray)
        for copy in _copies(v):
            _assert_equal(copy, case["result"])


def test_mirrored_scatter_nd_max_and_min_update_every_gpu_copy():
    with gpu_pair(), mirrored_strategy(2) as strategy:
        with strategy.scope():
            v = md.Variable(np.array([1.0, np.nan, 2.0, 3.0], np.float32))
        v.scatter_nd_max([[0], [1], [2], [3]], np.array([np.nan, 5.0, 9.0, 1.0], np.float32))
        v.scatter_nd_min(cupy.asarray(np.array([[3]], np.int64)), cupy.asarray(np.array([-4.0], np.float32)))
        for copy in _copies(v):
            np.testing.assert_array_equal(copy, [1.0, np.nan, 9.0, -4.0])


def test_out_of_range_on_gpu_raises_and_writes_nothing():
    with gpu_pair(), mirrored_strategy(2) as strategy:
        with strategy.scope():
            v = md.Variable(np.zeros((4, 3), np.float32))
        with pytest.raises(IndexError, match=r"indices\[1\] = \[4, 0\] does not index into shape \[4, 3\]"):
            v.scatter_nd_max(cupy.asarray(np.array([[1, 0], [4, 0]], np.int32)), np.ones(2, np.float32))
        with pytest.raises(IndexError, match=r"sparse_delta: indices\[0\] = 7 is not in \[0, 4\)"):
            v.scatter_max(md.IndexedSlices(cupy.asarray(np.ones((1, 3), np.float32)), cupy.asarray(np.array([7]))))
        for copy in _copies(v):
            np.testing.assert_array_equal(copy, np.zeros((4, 3)))


def test_batch_scatter_update_and_readers_on_a_gpu_copy():
    with gpu_pair(), mirrored_strategy(2) as strategy:
        with strategy.scope():
            v = md.Variable(_array(READERS["base"]))
        copy = v.values[1]
        for name in ("sparse_read_1d", "gather_nd_elements", "gather_nd_rows", "gather_nd_depth0"):
            case = READERS[name]
            got = getattr(copy, case["method"])(case["indices"] if not isinstance(case["indices"], dict)
                                                else _array(case["indices"]))
            assert isinstance(got, cupy.ndarray)
            _assert_equal(cupy.asnumpy(got), case["result"])
        with pytest.raises(IndexError, match=r"indices\[0\] = \[0, 3\] does not index into shape"):
            copy.gather_nd(cupy.asarray(np.array([[0, 3]], np.int32)))
        case = BATCH["2d_indices_rank2_var"]
        with strategy.scope():
            b = md.Variable(_array(case["var"]))
        strategy.extended.update(b, lambda c: c.batch_scatter_update(_slices(_array(case["values"]),
                                                                           _array(case["indices"]))))
        for copy in _copies(b):
            _assert_equal(copy, case["result"])
