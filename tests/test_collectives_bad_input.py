"""Bad input to mirrored.collectives: a clear exception naming the argument, never a crash."""

import subprocess
import sys

import numpy as np
import pytest

from mirrored import collectives

A = np.ones(4, np.float32)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: collectives.all_reduce([]), ValueError, "buffers"),
        (lambda: collectives.all_reduce(A), ValueError, "buffers"),
        (lambda: collectives.all_reduce([A, np.ones(5, np.float32)]), ValueError, "buffers[1] has shape"),
        (lambda: collectives.all_reduce([A, np.ones(4, np.float64)]), TypeError, "buffers[1] has dtype"),
        (lambda: collectives.all_reduce([A.astype(object)] * 2), TypeError, "not supported"),
        (lambda: collectives.all_reduce([np.array(["a", "b"])] * 2), TypeError, "not supported"),
        (lambda: collectives.all_reduce([A.astype(np.complex64)] * 2), TypeError, "float32"),
        (lambda: collectives.all_reduce([A.astype(bool)] * 2), TypeError, "astype"),
        (lambda: collectives.all_reduce([A, A], "avg"), ValueError, "op='avg'"),
        (lambda: collectives.all_reduce([A, A], None), ValueError, "op=None"),
        (lambda: collectives.all_reduce([A, A], algorithm="bogus"), ValueError, "algorithm='bogus'"),
        (lambda: collectives.all_reduce([A, A], algorithm="nccl"), ValueError, "GPU"),
        (lambda: collectives.all_reduce([A, A], out=[A]), ValueError, "out"),
        (lambda: collectives.all_reduce([A, A], out=[A, np.ones(3, np.float32)]), ValueError, "out[1]"),
        (lambda: collectives.all_reduce([A, A], out=[A, [0, 0, 0, 0]]), TypeError, "out[1]"),
        (lambda: collectives.broadcast([A, A], root=2), ValueError, "root=2"),
        (lambda: collectives.broadcast([A, A], root=-1), ValueError, "root=-1"),
        (lambda: collectives.reduce([A, A], "sum", root="0"), ValueError, "root="),
        (lambda: collectives.reduce([A, A], "sum", algorithm="nccl"), ValueError, "GPU"),
        (lambda: collectives.reduce([A, A], "sum", algorithm="bogus"), ValueError, "algorithm='bogus'"),
        (lambda: collectives.all_gather([A, A], axis=1), ValueError, "axis=1"),
        (lambda: collectives.all_gather([np.float32(1)] * 2), ValueError, "0-d"),
        (lambda: collectives.all_gather([np.ones((2, 3)), np.ones((2, 4))], 0), ValueError, "except along axis 0"),
        (lambda: collectives.batch_all_reduce([[A], [A, A]]), ValueError, "per_replica_lists[1]"),
        (lambda: collectives.batch_all_reduce([[A], A]), TypeError, "per_replica_lists[1]"),
        (lambda: collectives.batch_all_reduce([[A], [A]], bytes_per_pack=-1), ValueError, "bytes_per_pack"),
        (lambda: collectives.batch_all_reduce([[A], [A]], num_packs=0), ValueError, "num_packs"),
        (lambda: collectives.batch_all_reduce([[A], [A.astype(np.int32)]]), TypeError, "per_replica_lists[*][0]"),
    ],
)
def test_bad_input_raises_naming_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_read_only_output_is_refused():
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\[0\] is read-only"):
        collectives.all_reduce([ro, A], out=[ro, A.copy()])


def test_failed_call_leaves_the_module_usable():
    with pytest.raises(ValueError):
        collectives.all_reduce([A, np.ones(2, np.float32)])
    np.testing.assert_array_equal(collectives.all_reduce([A, A])[0], 2 * A)


def test_bad_inputs_do_not_crash_the_interpreter():
    # Run a batch of bad calls in a fresh process: any segfault or abort fails here.
    code = """
import numpy as np
from mirrored import collectives as c
bad = [
    lambda: c.all_reduce([np.ones(3), np.ones((3, 1))]),
    lambda: c.all_reduce([np.ones(3, object)] * 3),
    lambda: c.all_gather([np.ones((2, 2)), np.ones(2)]),
    lambda: c.reduce([np.ones(3)] * 2, root=99),
    lambda: c.batch_all_reduce([[np.ones(3)], [np.ones(4)]]),
    lambda: c.all_reduce([None, None]),
]
for f in bad:
    try:
        f()
    except (TypeError, ValueError):
        pass
    else:
        raise SystemExit("no exception")
print("survived")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "survived" in res.stdout, res.stderr
