"""Collectives over GPU buffers: :mod:`mirrored.collectives`' functions, with
the same signatures, for CuPy arrays or anything exposing
``__cuda_array_interface__`` or ``__dlpack__`` on a GPU.

``algorithm`` is ``"auto"`` (the engine's measured choice, see
``csrc/cuda/cuda_ring.cc``), ``"direct"`` (one kernel per GPU reads every
replica's input and writes every output in one pass: replicas on one GPU,
or GPUs with peer access), ``"ring"``, ``"tree"`` (also ``"hierarchical"``)
or ``"nccl"``. The native engine accepts several buffers on one GPU
(logical GPUs); NCCL needs a GPU per replica.

Calls are asynchronous like any CuPy operation: ordered after the work
already queued on each buffer's device (see ``_gpu.collective_stream``),
results visible to work queued there afterwards. Results are CuPy arrays on
each replica's own device; dtype and MEAN rules are those of
:mod:`mirrored.collectives`.
"""

from __future__ import annotations

import atexit

from ..device import gpu as _gpu
from ..timeline import span
from ..device.dtypes import dtype_code, op_code
from .rules import (check_batch, check_packing, gather_layout, gpu_inputs as _inputs, gpu_outputs as _outputs,
                    root_index)

__all__ = ["all_reduce", "broadcast", "reduce", "all_gather", "batch_all_reduce", "ALGORITHMS"]

# Algorithm names -> codes of csrc/core/communicator.h; "nccl" picks the NCCL engine.
ALGORITHMS = {"auto": 0, "ring": 1, "direct": 2, "tree": 3, "hierarchical": 3, "nccl": 0}

# The ring moves this many bytes per rank and step; 2 slices in flight per rank.
CHUNK_BYTES = 1 << 20
CHANNELS = 2

_engines: dict = {}
# Communicators go while CUDA (and NCCL) are still up, not in the interpreter's teardown.
atexit.register(_engines.clear)


def all_reduce(buffers, op="sum", *, out=None, algorithm="auto", chunk_bytes=0):
    """``out[i] = op(buffers[0], ..., buffers[n-1])`` for every replica ``i``, on replica ``i``'s GPU.

    ``chunk_bytes``: the least a rank moves per ring step (0: CHUNK_BYTES).
    """
    arrays, code, devices = _inputs(buffers, "buffers")
    opc = op_code(op)
    _, _, chunk = check_packing(0, None, chunk_bytes)
    engine, algo = _engine(devices, algorithm, chunk)
    outs, finish = _outputs(out, arrays, devices, "out")
    with span("all_reduce", arrays[0].nbytes, algorithm, len(arrays)):
        engine.all_reduce(_ptrs(arrays), _ptrs(outs), arrays[0].size, code, opc, algo, _streams(devices))
    return finish()


def broadcast(buffers, root=0, *, out=None):
    """``out[i] = buffers[root]`` for every replica ``i``."""
    arrays, code, devices = _inputs(buffers, "buffers")
    root = root_index(root, len(arrays))
    engine, _ = _engine(devices, "auto")
    outs, finish = _outputs(out, arrays, devices, "out")
    with span("broadcast", arrays[0].nbytes, "direct", len(arrays)):
        engine.broadcast(_ptrs(arrays), _ptrs(outs), arrays[0].size, code, root, _streams(devices))
    return finish()


def call_plan(kind: str, buffers, op, root, algorithm, chunk_bytes) -> "CallPlan":
    """The plan of an all_reduce or broadcast of these buffers, validated (errors name the argument)."""
    arrays, code, devices = _inputs(buffers, "buffers")
    first = arrays[0]
    if kind == "broadcast":
        engine, algo = _engine(devices, "auto")
        return CallPlan(False, engine, algo, code, 0, root_index(root, len(arrays)), devices, first)
    _, _, chunk = check_packing(0, None, chunk_bytes)
    engine, algo = _engine(devices, algorithm, chunk)
    return CallPlan(True, engine, algo, code, op_code(op), 0, devices, first)


class CallPlan:
    """A validated all_reduce or broadcast of GPU buffers: engine, algorithm, dtype code and layout.

    ``run`` checks that a call's arrays still fit (CuPy arrays of the planned
    shape and dtype, contiguous, each on its replica's GPU; outputs alike),
    makes the outputs where ``out`` is None, and enqueues the collective with
    one binding call on each GPU's current stream. Anything else returns None:
    the face validates that call afresh.
    """

    __slots__ = ("_reduce", "_engine", "_algo", "_code", "_op", "_root", "_devices", "_ordinals", "_shape",
                 "_strides", "_dtype", "_count", "_cupy")

    def __init__(self, reduce: bool, engine, algo: int, code: int, op: int, root: int, devices, first):
        self._reduce, self._engine, self._algo, self._code = reduce, engine, algo, code
        self._op, self._root, self._devices = op, root, tuple(devices)
        self._ordinals = tuple(dict.fromkeys(devices))  # each GPU once (logical GPUs share one)
        # C-contiguous strides of the planned shape: an array with them is contiguous (one that is
        # contiguous with other strides, possible along length-1 axes, takes the validating path).
        self._shape, self._strides, self._dtype, self._count = first.shape, first.strides, first.dtype, first.size
        self._cupy = _gpu.cupy_module()

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's buffer."""
        return self._count * self._dtype.itemsize

    def _pointers(self, arrays):
        """Each array's device pointer, or None when one does not fit the plan."""
        ndarray, shape, strides, dtype = self._cupy.ndarray, self._shape, self._strides, self._dtype
        if type(arrays) not in (list, tuple) or len(arrays) != len(self._devices):
            return None
        ptrs = []
        for a, device in zip(arrays, self._devices):
            if type(a) is not ndarray or a.shape != shape or a.dtype != dtype or a.strides != strides:
                return None
            data = a.data
            if data.device_id != device:
                return None
            ptrs.append(data.ptr)
        return ptrs

    def run(self, buffers, out):
        ins = self._pointers(buffers)
        if ins is None:
            return None
        if out is None:
            cupy = self._cupy
            result = []
            for device in self._devices:
                with cupy.cuda.Device(device):
                    result.append(cupy.empty(self._shape, self._dtype))
            outs = [a.data.ptr for a in result]
        else:
            outs = ins if out is buffers else self._pointers(out)  # (in place: the same arrays, checked once)
            if outs is None:
                return None
            result = list(out)
        streams = _plan_streams(self._ordinals, self._devices)
        if self._reduce:
            self._engine.all_reduce(ins, outs, self._count, self._code, self._op, self._algo, streams)
        else:
            self._engine.broadcast(ins, outs, self._count, self._code, self._root, streams)
        return result


def reduce(buffers, op="sum", root=0, *, out=None):
    """The reduction of all replicas' buffers, written to ``out[root]`` (or a new array on the root's GPU) and returned."""
    arrays, code, devices = _inputs(buffers, "buffers")
    opc = op_code(op)
    root = root_index(root, len(arrays))
    engine, _ = _engine(devices, "auto")
    if out is None:
        with _gpu.cupy_module().cuda.Device(devices[root]):
            target, finish = _gpu.cupy_module().empty_like(arrays[root]), None
    else:
        outs, finish = _outputs(out, arrays, devices, "out")
        target = outs[root]
    with span("reduce", arrays[0].nbytes, "direct", len(arrays)):
        engine.reduce(_ptrs(arrays), [target.data.ptr] * len(arrays), arrays[0].size, code, opc, root,
                      _streams(devices))
    return target if finish is None else finish()[root]


def all_gather(buffers, axis=0):
    """Every replica gets the concatenation of all buffers along ``axis`` on its own GPU; sizes may differ along ``axis`` only."""
    arrays, _, devices = _inputs(buffers, "buffers", same_shape=False)
    shape, row_bytes, outer = gather_layout(arrays, axis)
    first = arrays[0]
    cupy = _gpu.cupy_module()
    outs = []
    for d in devices:
        with cupy.cuda.Device(d):
            outs.append(cupy.empty(shape, first.dtype))
    engine, _ = _engine(devices, "auto")
    with span("all_gather", first.nbytes, "direct", len(arrays)):
        engine.all_gather(_ptrs(arrays), _ptrs(outs), row_bytes, outer, _streams(devices))
    return outs


def batch_all_reduce(per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto",
                     chunk_bytes=0):
    """All-reduce many tensors per replica at once, fused into few packs (see :mod:`mirrored.collectives`).

    One native call whatever the tensor count: it uploads a (pointer, size)
    table, packs every tensor with one kernel per GPU, all-reduces each pack
    and unpacks with one more kernel. The results of a replica are views of
    one new buffer on its GPU (one allocation per replica, not per tensor).
    """
    n = check_batch(per_replica_lists)
    if not per_replica_lists[0]:
        return [[] for _ in range(n)]
    plan = batch_plan(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, chunk_bytes)
    if plan is None:  # anything but contiguous CuPy arrays: convert and check tensor by tensor
        per_replica_lists = _batch_inputs(per_replica_lists)
        plan = batch_plan(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, chunk_bytes)
    with span("batch_all_reduce", plan.nbytes, algorithm, n):
        return plan.run(per_replica_lists)


def batch_plan(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, chunk_bytes) -> "BatchPlan | None":
    """The plan of a batch all-reduce of these arrays (a non-empty batch), validated (errors name the
    argument); None unless every tensor is a contiguous CuPy array on its replica's GPU."""
    bytes_per_pack, num_packs, chunk = check_packing(bytes_per_pack, num_packs, chunk_bytes)
    opc = op_code(op)
    layout = _batch_layout(per_replica_lists)
    if layout is None:
        return None
    engine, algo = _engine(layout[0], algorithm, chunk)
    return BatchPlan(engine, algo, opc, bytes_per_pack, num_packs, layout, per_replica_lists[0])


class BatchPlan:
    """A validated batch all-reduce of GPU buffers: engine, algorithm, packing, dtype codes and the
    results' layout (one buffer per replica), kept so a repeated batch does no planning.

    ``run`` checks that each tensor still fits (a CuPy array of the planned
    shape, dtype and strides on its replica's GPU), makes each replica's result
    buffer and views, and enqueues the whole batch with one binding call.
    Anything else returns None: the face validates that call afresh.
    """

    __slots__ = ("_engine", "_algo", "_op", "_bytes_per_pack", "_num_packs", "_devices", "_ordinals", "_specs",
                 "_codes", "_counts", "_offsets", "_total", "_cupy")

    def __init__(self, engine, algo: int, op: int, bytes_per_pack: int, num_packs: int, layout, first_tensors):
        self._engine, self._algo, self._op = engine, algo, op
        self._bytes_per_pack, self._num_packs = bytes_per_pack, num_packs
        devices, shapes, dtypes, self._codes, self._counts, self._offsets, self._total = layout
        self._devices = devices
        self._ordinals = tuple(dict.fromkeys(devices))  # each GPU once (logical GPUs share one)
        # Planned strides: C-contiguous for the planned shapes (see CallPlan).
        self._specs = tuple(zip(shapes, dtypes, (a.strides for a in first_tensors)))
        self._cupy = _gpu.cupy_module()

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's results buffer."""
        return self._total

    def _pointers(self, per_replica_lists):
        """Each replica's list of device pointers, or None when a tensor does not fit the plan."""
        ndarray, specs = self._cupy.ndarray, self._specs
        if type(per_replica_lists) not in (list, tuple) or len(per_replica_lists) != len(self._devices):
            return None
        pointers = []
        for tensors, device in zip(per_replica_lists, self._devices):
            if type(tensors) not in (list, tuple) or len(tensors) != len(specs):
                return None
            ptrs = []
            for a, (shape, dtype, strides) in zip(tensors, specs):
                if type(a) is not ndarray or a.shape != shape or a.dtype != dtype or a.strides != strides:
                    return None
                data = a.data
                if data.device_id != device:
                    return None
                ptrs.append(data.ptr)
            pointers.append(ptrs)
        return pointers

    def run(self, per_replica_lists):
        ins = self._pointers(per_replica_lists)
        if ins is None:
            return None
        cupy, specs, offsets = self._cupy, self._specs, self._offsets
        ndarray = cupy.ndarray
        outputs, out_ptrs = [], []
        for d in self._devices:
            with cupy.cuda.Device(d):
                base = cupy.empty(self._total, cupy.uint8).data
            outputs.append([ndarray(shape, dtype, memptr=base + off) for (shape, dtype, _), off in zip(specs, offsets)])
            ptr = base.ptr
            out_ptrs.append([ptr + off for off in offsets])
        self._engine.batch_all_reduce(ins, out_ptrs, self._counts, self._codes, self._op, self._bytes_per_pack,
                                      self._num_packs, self._algo, _plan_streams(self._ordinals, self._devices))
        return outputs


def _plan_streams(ordinals: tuple, devices: tuple) -> list:
    """Each replica's stream for a planned call: one lookup per GPU (``ordinals``: each GPU once)."""
    if len(ordinals) == 1:  # (every replica on one GPU: logical GPUs)
        return [_gpu.collective_stream(ordinals[0])] * len(devices)
    stream = {d: _gpu.collective_stream(d) for d in ordinals}
    return [stream[d] for d in devices]


_BATCH_ALIGN = 256  # results start where CuPy's own allocations would (vector loads need 16)


def _batch_layout(per_replica_lists):
    """(devices, shapes, dtypes, dtype codes, counts, result offsets, result bytes) of a batch of
    contiguous CuPy arrays, each replica's on one GPU; None when it is anything else."""
    ndarray = _gpu.cupy_module().ndarray
    first = per_replica_lists[0]
    shapes = [a.shape for a in first]
    dtypes = [a.dtype for a in first]
    devices = []
    for tensors in per_replica_lists:
        if not all(type(a) is ndarray for a in tensors):
            return None
        device = tensors[0].data.device_id
        if not all(a.shape == s and a.dtype == dt and a.flags.c_contiguous and a.data.device_id == device
                   for a, s, dt in zip(tensors, shapes, dtypes)):
            return None
        devices.append(device)
    codes, counts, offsets, total = [], [], [], 0
    for a in first:
        code = _CODES.get(a.dtype)
        if code is None:
            code = _CODES.setdefault(a.dtype, dtype_code(a.dtype, "per_replica_lists[0]"))
        codes.append(code)
        counts.append(a.size)
        offsets.append(total if a.nbytes else 0)  # (an empty result points at the buffer's start)
        total += -(-a.nbytes // _BATCH_ALIGN) * _BATCH_ALIGN
    return tuple(devices), shapes, dtypes, codes, counts, offsets, max(total, 1)


def _batch_inputs(per_replica_lists):
    """The batch as contiguous CuPy arrays, checked tensor by tensor with messages naming the tensor."""
    columns, devices = [], None
    for t in range(len(per_replica_lists[0])):
        column, _, devs = _inputs([tensors[t] for tensors in per_replica_lists], f"per_replica_lists[*][{t}]")
        if devices is not None and devs != devices:
            raise ValueError(f"per_replica_lists[*][{t}] lies on GPUs {devs} but tensor 0 on {devices}; "
                             "each replica's tensors must all be on that replica's GPU")
        devices = devs
        columns.append(column)
    return [[c[r] for c in columns] for r in range(len(per_replica_lists))]


_CODES: dict = {}


# --- engines -----------------------------------------------------------------

def _engine(devices, algorithm, chunk_bytes=0):
    """The engine for these GPUs (and ring chunk size; 0: CHUNK_BYTES) and the algorithm code to pass it."""
    name = algorithm.lower() if isinstance(algorithm, str) else algorithm
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not a GPU algorithm; use one of "
                         f"{', '.join(repr(a) for a in ALGORITHMS)}")
    kind = "nccl" if name == "nccl" else "ring"
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    key = (kind, tuple(devices), chunk_bytes if kind == "ring" else 0)
    engine = _engines.get(key)
    if engine is None:
        cuda = _gpu.cuda_module()
        if kind == "nccl":
            if len(set(devices)) != len(devices):
                raise ValueError(f"algorithm='nccl': replicas share a GPU (devices {list(devices)}); NCCL needs one "
                                 "GPU per replica, use algorithm='ring' for logical GPUs")
            _gpu.load_nccl()
            engine = cuda.nccl(list(devices))
        else:
            engine = cuda.ring(list(devices), chunk_bytes, CHANNELS)
        engine = _engines.setdefault(key, engine)
    return engine, ALGORITHMS[name]


def _ptrs(arrays):
    return [a.data.ptr for a in arrays]


def _streams(devices):
    return [_gpu.collective_stream(d) for d in devices]
