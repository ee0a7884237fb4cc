"""rules.variable_sum: the order in which Lamb's and Adafactor's kernels add up a whole variable
(csrc/core/variable_sums.h), against the same order written element by element."""

import numpy as np
import pytest

from mirrored.train.optimizers.rules import SUM_GROUP, SUM_LANES, variable_sum


def _one_by_one(x):
    t = x.dtype.type
    lanes = min(x.size, SUM_LANES)
    lane = [x[p] for p in range(lanes)]
    for i in range(lanes, x.size):
        lane[i % lanes] = t(lane[i % lanes] + x[i])
    groups = []
    for first in range(0, lanes, SUM_GROUP):
        s = lane[first]
        for p in range(first + 1, min(first + SUM_GROUP, lanes)):
            s = t(s + lane[p])
        groups.append(s)
    total = groups[0]
    for s in groups[1:]:
        total = t(total + s)
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, SUM_GROUP - 1, SUM_GROUP, SUM_GROUP + 1, SUM_LANES - 1, SUM_LANES,
                               SUM_LANES + 1, 3 * SUM_LANES + 5])
def test_variable_sum_adds_in_the_kernels_order(n, dtype):
    rng = np.random.default_rng(n)
    # Terms over 12 binades, so that another order rounds differently.
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-6, 6, n)).astype(dtype) ** 2
    got = variable_sum(x.reshape(-1, 1) if n % 2 else x)
    assert got.dtype == dtype and got.shape == ()
    assert got.tobytes() == np.asarray(_one_by_one(x), dtype).tobytes()


def test_variable_sum_of_nothing_is_zero_and_nan_propagates():
    assert variable_sum(np.zeros((0, 3), np.float32)) == 0
    x = np.ones(SUM_LANES * 2, np.float64)
    x[SUM_LANES + 7] = np.nan
    assert np.isnan(variable_sum(x))
    x[SUM_LANES + 7] = np.inf
    assert variable_sum(x) == np.inf
