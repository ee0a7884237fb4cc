"""CollectiveGroup.all_reduce(b, op, out=b), the in-place call checked natively: the same answers and errors."""


import numpy as np
import pytest

from multiworker_launch import launch
from multiworker_marks import MULTIWORKER

pytestmark = MULTIWORKER


def in_place_calls():
    from mirrored.cluster_resolver import TFConfigClusterResolver
    from mirrored.distribute.collective_all_reduce import CollectiveGroup

    g = CollectiveGroup.from_cluster_resolver(TFConfigClusterResolver(), 1, timeout=20.0)
    r = g.rank
    out = {}
    for name, x, op in [("f32 sum", np.arange(5, dtype=np.float32) + r, "sum"),
                        ("f32 max", np.arange(5, dtype=np.float32) * (r + 1), "max"),
                        ("f64 mean", np.full(40, r + 1.0), "mean"),  # past the 64 inline bytes
                        ("i64 sum", np.arange(3, dtype=np.int64) * 10 ** 12 + r, "sum"),
                        ("f16 sum", np.full(3, 0.5 + r, np.float16), "sum"),
                        ("u8 min", np.array([7, 200], np.uint8) - r, "min"),
                        ("0-d", np.array(2.0 + r, np.float32), "prod"),
                        ("empty", np.zeros((0, 3), np.float32), "sum"),
                        ("big", np.full(300_001, r + 1, np.float32), "sum")]:
        b = [x]
        got = g.all_reduce(b, op, out=b)
        out[name] = (got[0] is x, x.copy())
    strided = np.arange(10, dtype=np.float32)
    view = [strided[::2]]  # not contiguous: the general path, written back into the view
    g.all_reduce(view, "sum", out=view)
    out["strided"] = strided
    frozen = np.ones(3, np.float32)
    frozen.flags.writeable = False
    try:
        g.all_reduce([frozen], "sum", out=[frozen])
    except ValueError as e:
        out["read-only"] = str(e)
    g.close()
    return out


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_in_place_all_reduce_matches_numpy(shm):
    results = launch(in_place_calls, 2, env={"MIRRORED_SHM": shm}, timeout=60)
    for res in results:
        assert res.ok, (res.task, res.message, res.stderr[-2000:])
    want = {"f32 sum": np.arange(5, dtype=np.float32) * 2 + 1,
            "f32 max": np.arange(5, dtype=np.float32) * 2,
            "f64 mean": np.full(40, 1.5),
            "i64 sum": np.arange(3, dtype=np.int64) * 2 * 10 ** 12 + 1,
            "f16 sum": np.full(3, 2.0, np.float16),
            "u8 min": np.array([6, 199], np.uint8),
            "0-d": np.array(6.0, np.float32),
            "empty": np.zeros((0, 3), np.float32),
            "big": np.full(300_001, 3, np.float32)}
    for res in results:
        for name, expected in want.items():
            same_object, got = res.value[name]
            assert same_object, name
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            np.testing.assert_array_equal(got, expected, err_msg=name)
        strided = np.arange(10, dtype=np.float32)
        strided[::2] *= 2
        np.testing.assert_array_equal(res.value["strided"], strided)
        assert "read-only" in res.value["read-only"]
