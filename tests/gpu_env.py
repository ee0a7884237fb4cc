"""Where the ``gpu``-marked tests run: on the machine's GPUs through CuPy when
it has any, else on the simulated CUDA machine (``mirrored._cuda_sim``) with
the CuPy stand-in of ``fake_cupy.py``. Either way the same tests and the
same GPU code path of mirrored run; only the runtime underneath differs.

The simulated machine: SIM_DEVICES GPUs with peer access between all of
them, kernels run at synchronisation in an order drawn from each test's
seed. conftest.py's autouse fixture switches it on around every gpu test
(mirrored's engine and ``import cupy`` both point at it), and off after.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import numpy as np
import pytest

import mirrored
from collective_reference import BFLOAT16, batch_reference
from mirrored import collectives
from mirrored.collective import cuda as cuda_collectives
from mirrored.device import config, device_util, dtypes as _dtypes, engine

SIM_DEVICES = 2
SIM_PEERS = [(a, b) for a in range(SIM_DEVICES) for b in range(SIM_DEVICES) if a != b]


def _real_gpu_cupy():
    if os.environ.get(engine.ENV) == "sim":
        return None
    try:
        import cupy
        from mirrored import _cuda  # type: ignore[attr-defined]
    except ImportError:
        return None
    return cupy if _cuda.device_count() > 0 else None


cupy = _real_gpu_cupy()
SIMULATED = cupy is None
if SIMULATED:
    try:
        import fake_cupy as cupy
    except ImportError:  # built without the CUDA toolkit's headers: no simulator either
        cupy = None
NGPU = 0 if cupy is None else SIM_DEVICES if SIMULATED else engine.extension().device_count()
SKIP_REASON = "no GPU, and this build has no simulated CUDA engine (mirrored._cuda_sim needs the CUDA headers)"


def _too_few(count: int) -> str:
    return f"needs {count} GPUs, this machine has {NGPU}"


def needs_gpus(count: int):
    """A mark for a test that needs ``count`` GPUs of its own: the simulated machine has SIM_DEVICES, a real
    machine may have fewer (the test then skips; logical GPUs are gpu_pair's)."""
    return pytest.mark.skipif(NGPU < count, reason=_too_few(count))


def skip_unless_gpus(count: int) -> None:
    """needs_gpus inside a test (or a fixture) that has just found out how many GPUs it needs."""
    if NGPU < count:
        pytest.skip(_too_few(count))


@contextlib.contextmanager
def machine(seed: int):
    """The GPU machine for one test: the simulated one (seeded) unless real GPUs are at hand."""
    if not SIMULATED:
        yield
        return
    saved = sys.modules.get("cupy")
    install(seed)
    try:
        yield
        cupy.sim.drain()  # a kernel that fails at the end still fails its test
    finally:
        engine.select(None)
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved


def install(seed: int):
    """Points mirrored's engine and ``import cupy`` at the simulated machine, for good."""
    cupy.configure(SIM_DEVICES, SIM_PEERS, seed)
    engine.select("sim")
    sys.modules["cupy"] = cupy


@contextlib.contextmanager
def gpu_pair(kind: str = "logical"):
    """Two GPU devices, /gpu:0 and /gpu:1, for a block: two ``"logical"`` GPUs on GPU 0, or two ``"physical"``
    GPUs (the test skips with fewer). Yields each one's physical ordinal."""
    if kind == "physical":
        skip_unless_gpus(2)
        yield [0, 1]
        return
    config.set_logical_device_configuration("GPU", 0, count=2)
    try:
        yield [0, 0]
    finally:
        config.set_logical_device_configuration("GPU:0", None)


@contextlib.contextmanager
def physical_gpus(count: int, seed: int = 0):
    """``count`` physical GPUs (peer access between all) for a block: the simulated machine remade with
    that many, and SIM_DEVICES again after; on real GPUs the machine's own (the test skips with fewer)."""
    if not SIMULATED:
        skip_unless_gpus(count)
        yield
        return
    cupy.configure(count, [(a, b) for a in range(count) for b in range(count) if a != b], seed)
    config.set_logical_device_configuration("GPU:0", None)  # (also drops the device tables of the last machine)
    try:
        yield
    finally:
        cupy.configure(SIM_DEVICES, SIM_PEERS, seed)
        config.set_logical_device_configuration("GPU:0", None)


@contextlib.contextmanager
def mirrored_strategy(replicas: int, one_gpu: bool = True):
    """A MirroredStrategy over ``replicas`` logical GPUs on GPU 0 (the native engine), or one replica per GPU
    (NCCL), for a block; GPU 0's logical split is undone after it."""
    if one_gpu:
        config.set_logical_device_configuration("GPU", 0, count=replicas)
    try:
        yield mirrored.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
    finally:
        config.set_logical_device_configuration("GPU:0", None)


# The strategy layouts tests of cross-replica ordering run on: logical GPUs of GPU 0, and GPUs of their own.
LAYOUTS = ("logical-2", "logical-3", "logical-4", "physical-2")


@contextlib.contextmanager
def layout_strategy(layout: str):
    """A MirroredStrategy for ``layout`` (one of LAYOUTS: "logical-N" or "physical-N"), for a block; the test
    is skipped where the machine has too few GPUs."""
    kind, n = layout.split("-")
    n = int(n)
    if kind == "physical":
        skip_unless_gpus(n)
    with mirrored_strategy(n, one_gpu=kind == "logical") as strategy:
        yield strategy


def hand_off_step(x):
    """A replica step whose merge_fn hands replica 0's array to every replica; the others read it two
    collectives later, after replica 0 dropped it, and replica 0 then allocates an array of its size
    (from its stream's blocks). Returns (replica 0's array + x, x * 3, the double all-reduce of x)."""
    ctx = mirrored.get_replica_context()
    mine = x * np.float32(2)
    first = ctx.merge_call(lambda s, v: s.experimental_local_results(v)[0], args=(mine,))
    del mine
    if ctx.replica_id_in_sync_group == 0:
        seen = first + x
        del first
    total = ctx.all_reduce(mirrored.ReduceOp.SUM, ctx.all_reduce(mirrored.ReduceOp.SUM, x))
    if ctx.replica_id_in_sync_group != 0:
        seen = first + x
        del first
    later = x * np.float32(3)
    return seen, later, total


def check_hand_off(strategy, hosts, out):
    """``out``: hand_off_step's results for the replicas' inputs ``hosts`` (NumPy)."""
    n = len(hosts)
    for r, (a, c, t) in enumerate(zip(*map(strategy.experimental_local_results, out))):
        np.testing.assert_array_equal(cupy.asnumpy(a), hosts[0] * np.float32(2) + hosts[r])
        np.testing.assert_array_equal(cupy.asnumpy(c), hosts[r] * np.float32(3))
        np.testing.assert_allclose(cupy.asnumpy(t), np.sum(hosts, axis=0) * n, rtol=1e-5)


def nccl_strategy(gpus: int):
    """A MirroredStrategy over GPUs 0 .. gpus-1 with NCCL's cross-device ops; the test is skipped without
    NCCL: the native engine orders GPUs with events, which md.function's per-GPU graphs cannot hold
    (docs/function.md)."""
    strategy = mirrored.MirroredStrategy([f"/gpu:{i}" for i in range(gpus)])
    if not isinstance(strategy.extended._cross_device_ops, mirrored.NcclAllReduce):
        pytest.skip("NCCL is not installed: without it the GPUs are ordered with events, which per-GPU graphs "
                    "cannot hold (docs/function.md)")
    return strategy


def replica_batches(strategy, step: int, *data):
    """Step ``step``'s batch of each array in ``data`` (shaped step, global batch, ...): per array, a
    PerReplica of each replica's slice of that batch, on its GPU."""
    devices = strategy.extended.worker_devices
    per = data[0].shape[1] // len(devices)
    return tuple(mirrored.PerReplica([device_util.place(d[step, r * per:(r + 1) * per], device)
                                      for r, device in enumerate(devices)], devices)
                 for d in data)


def check_batch(out, host, op, devices):
    """``out`` (out[replica][tensor], CuPy arrays) is batch_reference(host, op) on each replica's device."""
    want = batch_reference(host, op)
    assert len(out) == len(devices)
    for row, device in zip(out, devices):
        assert len(row) == len(want)
        for got, w in zip(row, want):
            assert got.dtype == w.dtype and got.shape == w.shape and got.data.device_id == device
            np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64), w.astype(np.float64), rtol=2e-3)


def cupy_has(dtype) -> bool:
    try:
        cupy.zeros(1, dtype)
        return True
    except Exception:
        return False


def upload(xs, devices):
    """Host arrays onto the replicas' GPUs (bfloat16 as its uint16 bits when CuPy lacks the dtype)."""
    out = []
    for x, d in zip(xs, devices):
        with cupy.cuda.Device(d):
            out.append(cupy.asarray(x if cupy_has(x.dtype) else x.view(np.uint16)))
    return out


def download(arrays, dtype):
    """GPU arrays back on the host once their GPUs are done; bfloat16 travels as its uint16 bits when CuPy lacks
    the dtype; every other result keeps its own dtype (the MEAN of integers is float64)."""
    cupy.cuda.Device().synchronize()
    for a in arrays:
        with a.device:
            a.device.synchronize()
    return [x.view(dtype) if dtype == BFLOAT16 and x.dtype == np.uint16 else x
            for x in (cupy.asnumpy(a) for a in arrays)]


def gpu_all_reduce(xs, devices, op, algorithm="auto", inplace=False):
    """collectives.all_reduce of GPU copies of xs: (results, inputs) back on the host."""
    dtype = xs[0].dtype
    arrays = upload(xs, devices)
    if cupy_has(dtype):
        out = collectives.all_reduce(arrays, op, out=arrays if inplace else None, algorithm=algorithm)
        assert all(isinstance(a, cupy.ndarray) for a in out) and [a.device.id for a in out] == list(devices)
    else:  # bfloat16 without CuPy support: the same engine, its dtype code given explicitly
        engine_, algo = cuda_collectives._engine(devices, algorithm)
        out = arrays if inplace else upload([np.zeros_like(x).view(np.uint16) for x in xs], devices)
        engine_.all_reduce(cuda_collectives._ptrs(arrays), cuda_collectives._ptrs(out), arrays[0].size,
                           _dtypes.CODES["bfloat16"], _dtypes.op_code(op), algo, cuda_collectives._streams(devices))
    return download(out, dtype), download(arrays, dtype)


def launches_and_ops(call):
    """(kernel launches per GPU, stream operations per GPU) of ``call`` on the simulated machine.
    Earlier tests' garbage is collected first: its device memory, freed in stream order, would
    count as the call's stream operations when a collection ran inside the call."""
    gc.collect()
    counted = sim_counters(call)
    return counted["launches"], counted["stream_ops"]


def sim_counters(call) -> dict:
    """The simulated runtime's counters for ``call()`` (launches per GPU, stream operations, and every runtime
    entry point's calls by name), its queued kernels drained before and after."""
    cupy.sim.drain()
    cupy.sim.reset_counters()
    call()
    counted = cupy.sim.counters()
    cupy.sim.drain()
    return counted


def python_calls(call, repeat: int = 100) -> dict:
    """Python-level function calls of one ``call()`` (the median of ``repeat`` calls, after warm-up ones),
    counted with ``sys.setprofile``: each ``'call'`` (a Python function starts) and ``'c_call'`` (Python
    code calls a builtin) event, by the file of the code that runs or makes the call. On a slow host each
    costs ~0.2-0.3 us, so the count is the host cost, free of a loaded machine's noise.

    ``mirrored``: the events in mirrored's own files: their functions, and the builtins they call (CuPy's
    too on a GPU, whose functions are Cython's), and mirrored's builtins other code calls
    (md.get_replica_context, ReplicaContext.all_reduce); ``cupy_by_mirrored``: the stand-in's functions mirrored's
    code calls, from Python or natively (Python here; CuPy charges each such call too; under a builtin of
    mirrored's, a stand-in call whose Python caller is other code counts: the builtin made it); ``stand_in``: every event in the stand-in's
    files (its own calls, which CuPy makes in Cython); ``total``: every event. Each call's queued kernels
    are drained after it, outside the count. Only this thread's calls count (a step long enough to go to
    the replica threads is an outlier the median leaves out)."""
    package = os.path.dirname(os.path.abspath(mirrored.__file__)) + os.sep
    stand_in = os.path.abspath(os.path.join(os.path.dirname(__file__), "fake_cupy.py"))
    files = {}  # co_filename -> "mirrored", "stand_in" or None
    counts = {}

    def where(code):
        name = code.co_filename
        kind = files.get(name, False)
        if kind is False:
            path = os.path.abspath(name)
            kind = files[name] = "mirrored" if path.startswith(package) else "stand_in" if path == stand_in else None
        return kind

    inside = [0]  # builtins of mirrored's under way that code outside mirrored called

    def ours(builtin) -> bool:  # a builtin of mirrored's (md.get_replica_context, ReplicaContext.all_reduce, ...)
        module = getattr(builtin, "__module__", None) or type(getattr(builtin, "__self__", None)).__module__
        return (module or "").startswith("mirrored")

    def profile(frame, event, arg):
        if event == "call" or event == "c_call":
            counts["total"] += 1
            kind = where(frame.f_code)
            if event == "c_call" and kind is None and ours(arg):
                # (a builtin of mirrored's called from other code: mirrored's call, and so are the CuPy calls it
                # makes, whose Python caller is that code's frame)
                kind = "mirrored"
                inside[0] += 1
            if kind is not None:
                counts[kind] += 1
            # (A call with no Python caller comes from native code: mirrored's rendezvous, which runs GPU
            # replicas as greenlets whose stack starts in C, enters and leaves their streams.)
            caller = None if frame.f_back is None else where(frame.f_back.f_code)
            if event == "call" and kind == "stand_in" and (frame.f_back is None or caller == "mirrored" or
                                                           (inside[0] and caller is None)):
                counts["cupy_by_mirrored"] += 1
        elif event in ("c_return", "c_exception") and inside[0] and where(frame.f_code) is None and ours(arg):
            inside[0] -= 1

    for _ in range(3):  # planned, and every cache filled
        call()
    if SIMULATED:
        cupy.sim.drain()
    per_call = []
    for _ in range(repeat):
        counts = {"mirrored": 0, "cupy_by_mirrored": 0, "stand_in": 0, "total": 0}
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
        per_call.append(counts)
        if SIMULATED:
            cupy.sim.drain()
    return {key: float(np.median([c[key] for c in per_call])) for key in per_call[0]}


# A command that runs a script on the simulated machine (sys.argv[1] is the script).
RUN_SIMULATED = ("import runpy, sys, gpu_env; gpu_env.install(0); sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")
