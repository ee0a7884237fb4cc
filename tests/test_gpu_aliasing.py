"""GPU outputs that alias inputs (marker ``gpu``; on the simulated GPUs without a GPU, see gpu_env.py).

The host rules of tests/test_local_values.py on device buffers: ``out[i]`` may be
its own input (in place); an output that overlaps another replica's input, or
only part of its own, is computed aside and copied in, so the answer is
NumPy's; outputs that overlap each other are refused. Each call is made twice,
so that the second runs the plan the first left (collective/plan.py), which
must send such outputs back to be staged or refused as well.
"""

import numpy as np
import pytest

from gpu_env import NGPU, SKIP_REASON, cupy

pytestmark = pytest.mark.gpu
if cupy is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from mirrored import collectives  # noqa: E402

ALGORITHMS = ("auto", "ring", "direct", "tree")


def placements(n):
    out = [(0,) * n]
    if NGPU > 1:
        out.append(tuple(i % NGPU for i in range(n)))
    return out


def on(device, host):
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def settle():
    for d in range(NGPU):
        cupy.cuda.Device(d).synchronize()


def bases(devices, length, seed):
    """One base array per replica's GPU (replicas that share a GPU share its base), as (host, device)."""
    host, device = {}, {}
    for i, d in enumerate(dict.fromkeys(devices)):
        host[d] = np.random.default_rng(seed + i).integers(-9, 9, length).astype(np.float32)
        device[d] = on(d, host[d])
    return host, device


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shift", [1, 7, -3])
@pytest.mark.parametrize("n", [2, 3])
def test_outputs_overlapping_their_own_input_shifted_are_right(algorithm, shift, n):
    for devices in placements(n):
        for call in range(2):  # the second call runs the plan
            host, base = bases(devices, 3 * 5000, seed=call)
            starts = [100 + 5000 * i for i in range(n)]
            xs = [base[d][s:s + 4000] for d, s in zip(devices, starts)]
            want = sum(host[d][s:s + 4000] for d, s in zip(devices, starts))
            out = [base[d][s + shift:s + shift + 4000] for d, s in zip(devices, starts)]
            collectives.all_reduce(xs, "sum", out=out, algorithm=algorithm)
            settle()
            for o in out:
                np.testing.assert_array_equal(cupy.asnumpy(o), want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_rotated_outputs_on_one_gpu_are_right(algorithm, n):
    for call in range(2):
        host = [np.random.default_rng(10 * call + i).integers(-9, 9, 4096).astype(np.float32) for i in range(n)]
        xs = [on(0, h) for h in host]
        out = xs[1:] + xs[:1]  # out[i] is another replica's input
        collectives.all_reduce(xs, "sum", out=out, algorithm=algorithm)
        settle()
        for o in out:
            np.testing.assert_array_equal(cupy.asnumpy(o), sum(host))


def test_an_output_straddling_two_inputs_is_right():
    for call in range(2):
        host = np.arange(64, dtype=np.float32) + call
        base = on(0, host)
        x0, x1 = base[0:32], base[32:64]
        out = [base[16:48], on(0, np.zeros(32, np.float32))]
        collectives.all_reduce([x0, x1], "sum", out=out)
        settle()
        want = host[0:32] + host[32:64]
        np.testing.assert_array_equal(cupy.asnumpy(base[16:48]), want)
        np.testing.assert_array_equal(cupy.asnumpy(out[1]), want)


def test_broadcast_and_reduce_with_aliased_outputs():
    for call in range(2):
        xs = [on(0, np.full(1000, float(i + call), np.float32)) for i in range(3)]
        out = xs[1:] + xs[:1]
        collectives.broadcast(xs, root=1, out=out)
        settle()
        for o in out:
            np.testing.assert_array_equal(cupy.asnumpy(o), 1.0 + call)
        host = np.arange(40, dtype=np.float32) + call
        base = on(0, host)
        target = base[8:24]  # the root's output straddles both inputs
        collectives.reduce([base[0:16], base[16:32]], "sum", root=0, out=[target, on(0, np.zeros(16, np.float32))])
        settle()
        np.testing.assert_array_equal(cupy.asnumpy(target), host[0:16] + host[16:32])
        base = on(0, host)
        out = [base[4:20], on(0, np.zeros(16, np.float32))]  # into a shifted view of the root's own input
        collectives.broadcast([base[0:16], on(0, np.zeros(16, np.float32))], root=0, out=out)
        settle()
        for o in out:
            np.testing.assert_array_equal(cupy.asnumpy(o), host[0:16])


def test_reduce_leaves_the_other_replicas_outputs_alone():
    # Only the root's output is written: a non-root output (contiguous or not) keeps its values.
    for call in range(2):
        xs = [on(0, np.full(6, float(i + 1), np.float32)) for i in range(2)]
        other = on(0, np.arange(12, dtype=np.float32))[::2]  # not contiguous
        target = collectives.reduce(xs, "sum", root=0, out=[on(0, np.zeros(6, np.float32)), other])
        settle()
        np.testing.assert_array_equal(cupy.asnumpy(target), 3.0)
        np.testing.assert_array_equal(cupy.asnumpy(other), np.arange(12, dtype=np.float32)[::2])


def test_outputs_sharing_memory_are_refused():
    a, b = on(0, np.ones(8, np.float32)), on(0, np.ones(8, np.float32))
    collectives.all_reduce([a, b], "sum", out=[on(0, np.zeros(8, np.float32)), on(0, np.zeros(8, np.float32))])
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        collectives.all_reduce([a, b], "sum", out=[a, a])
    base = on(0, np.zeros(20, np.float32))
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        collectives.all_reduce([a, b], "sum", out=[base[0:8], base[4:12]])
    with pytest.raises(ValueError, match=r"share memory"):
        collectives.broadcast([a, b], out=[base[0:8], base[4:12]])


def test_in_place_stays_in_place():
    for call in range(2):
        xs = [on(0, np.full(1 << 12, float(i), np.float32)) for i in range(4)]
        pointers = [x.data.ptr for x in xs]
        result = collectives.all_reduce(xs, "sum", out=xs)
        settle()
        assert [r.data.ptr for r in result] == pointers
        for r in result:
            np.testing.assert_array_equal(cupy.asnumpy(r), 6.0)
