"""Collectives over GPU buffers: :mod:`mirrored.collectives`' functions, with
the same signatures, for CuPy arrays or anything exposing
``__cuda_array_interface__`` or ``__dlpack__`` on a GPU.

``algorithm`` is ``"auto"`` (the engine's measured choice, see
``csrc/cuda/cuda_ring.cc``), ``"direct"`` (one kernel per GPU reads every
replica's input and writes every output in one pass: replicas on one GPU,
or GPUs with peer access), ``"ring"``, ``"tree"`` (also ``"hierarchical"``,
TF's name for its reduce-to-few-devices tree) or ``"nccl"``. The native
engine accepts several buffers on one GPU (logical GPUs); NCCL takes one
rank per GPU. Replicas on several GPUs where some GPUs host several of them
(a mix, e.g. 2 GPUs x 2 logical GPUs) take the hierarchical engine with
``"nccl"``, and with ``"auto"`` when NCCL loads: one kernel per GPU folds
its replicas, NCCL combines the GPUs, one kernel per GPU writes the outputs
(docs/hierarchical.md); a CUDA graph per GPU can hold it.

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

# Replicas one kernel folds (csrc/cuda/fused.h kMaxFused): the hierarchical engine's most per GPU.
MAX_FOLD = 32

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


def broadcast(buffers, root=0, *, out=None, algorithm="auto"):
    """``out[i] = buffers[root]`` for every replica ``i`` (``algorithm="nccl"``: NCCL's, which CUDA graphs hold)."""
    arrays, code, devices = _inputs(buffers, "buffers")
    root = root_index(root, len(arrays))
    engine, _ = _engine(devices, algorithm)
    outs, finish = _outputs(out, arrays, devices, "out")
    with span("broadcast", arrays[0].nbytes, "direct", len(arrays)):
        engine.broadcast(_ptrs(arrays), _ptrs(outs), arrays[0].size, code, root, _streams(devices))
    return finish()


def call_plan(kind: str, buffers, op, root, algorithm, chunk_bytes) -> "CallPlan":
    """The plan of an all_reduce or broadcast of these buffers, validated (errors name the argument)."""
    arrays, code, devices = _inputs(buffers, "buffers")
    first = arrays[0]
    if kind == "broadcast":
        engine, algo = _engine(devices, algorithm)
        return CallPlan(False, engine, algo, code, 0, root_index(root, len(arrays)), devices, first)
    _, _, chunk = check_packing(0, None, chunk_bytes)
    engine, algo = _engine(devices, algorithm, chunk)
    return CallPlan(True, engine, algo, code, op_code(op), 0, devices, first)


def _plan_streams(plan) -> list:
    """Each replica's stream for a planned call (a CallPlan or BatchPlan, whose ``_streams`` it is: the
    binding asks once the arrays fit): one lookup per GPU."""
    if plan._one_gpu is not None:  # (every replica on one GPU: logical GPUs)
        return [_gpu.collective_stream(plan._one_gpu)] * plan._replicas
    stream = {d: _gpu.collective_stream(d) for d in plan._ordinals}
    return [stream[d] for d in plan._devices]



class CallPlan:
    """A validated all_reduce or broadcast of GPU buffers: the native ``_cuda.CallPlan`` (engine,
    algorithm, dtype code, op or root, and what the arrays must be), the devices and the outputs' layout.

    ``run`` makes one binding call, which checks in C++ that the call's arrays
    still fit (CuPy arrays of the planned type, shape, dtype and strides, each
    on its replica's GPU; outputs alike), then looks up each GPU's stream
    (only GPUs that hold the arrays: a plan whose GPUs the machine no longer
    has is a plan whose arrays cannot fit), takes
    the outputs where ``out`` is None (a kept set nobody references, else
    ``_new_outputs``; docs/collectives_results.md) and enqueues the collective
    with the GIL released. Anything else returns None: the face validates that call afresh.
    """

    __slots__ = ("_plan", "_devices", "_ordinals", "_replicas", "_one_gpu", "_shape", "_dtype", "_count", "_slots",
                 "_gpu_bytes", "_cupy")
    _streams = _plan_streams

    def __init__(self, reduce: bool, engine, algo: int, code: int, op: int, root: int, devices, first):
        _layout(self, devices)
        # The planned strides are C-contiguous (the planning call's arrays were made so): an array with them
        # is contiguous (one that is contiguous with other strides, possible along length-1 axes, takes the
        # validating path).
        self._shape, self._dtype, self._count = first.shape, first.dtype, first.size
        self._cupy = cupy = _gpu.cupy_module()
        self._plan = _gpu.cuda_module().CallPlan(engine, reduce, algo, code, op, root, first.size, cupy.ndarray,
                                                 list(devices), [(first.shape, first.strides, first.dtype, first.size)])
        # Small results of replicas that share a GPU: views of one allocation per GPU and call, replica r's
        # at (its GPU, offset) = _slots[r], each GPU's allocation _gpu_bytes[GPU] long (None: one each).
        stride = -(-first.nbytes // _BATCH_ALIGN) * _BATCH_ALIGN
        self._slots = self._gpu_bytes = None
        if len(self._ordinals) < len(self._devices) and 0 < stride * len(self._devices) <= _SHARED_BYTES:
            taken = dict.fromkeys(self._ordinals, 0)
            slots = []
            for d in self._devices:
                slots.append((d, taken[d]))
                taken[d] += stride
            self._slots, self._gpu_bytes = tuple(slots), tuple(taken.items())

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's buffer."""
        return self._count * self._dtype.itemsize

    @property
    def devices(self) -> tuple:
        """Each replica's GPU (CUDA ordinal)."""
        return self._devices

    def run(self, buffers, out):
        done = self._plan.run(buffers, out, self._streams, self._new_outputs)
        return done if done is None or out is None else list(out)

    def on_merge_streams(self) -> tuple:
        """``(run, streams, new_outputs)``: ``run(buffers, None, streams, new_outputs)`` is ``self.run(buffers,
        None)`` made where every GPU's current stream is the legacy default one (a combine of GPU replicas
        outside md.function: gpu.MergeOrder), whose handle ``collective_stream`` would answer for each
        replica. ``streams`` is a C callable (a list's ``copy``): the binding asks it without a Python frame,
        where ``_streams`` looks each GPU's current stream up."""
        legacy = _gpu.cupy_module().cuda.Stream.null.ptr
        return self._plan.run, ([legacy] * self._replicas).copy, self._new_outputs

    def _new_outputs(self) -> list:
        """A new output per replica on its GPU (TF's all-reduce returns new tensors)."""
        cupy, shape, dtype = self._cupy, self._shape, self._dtype
        if self._slots is None:
            return _on_each_gpu(cupy, self._devices, self._ordinals, lambda: cupy.empty(shape, dtype))
        bases = {}
        for ordinal, nbytes in self._gpu_bytes:
            with cupy.cuda.Device(ordinal):
                bases[ordinal] = cupy.cuda.alloc(nbytes)
        ndarray = cupy.ndarray
        return [ndarray(shape, dtype, memptr=bases[d] + offset) for d, offset in self._slots]


# Results of a call whose replicas share GPUs come from one allocation per GPU up to this many bytes
# in all (a pool allocation per replica costs more than the view; larger results keep their own memory,
# so that one kept result does not keep the others' alive).
_SHARED_BYTES = 1 << 16


def _on_each_gpu(cupy, devices: tuple, ordinals: tuple, make) -> list:
    """``[make() with replica r's GPU current for r in replicas]``: one device switch in all when they share one."""
    if len(ordinals) == 1:
        with cupy.cuda.Device(ordinals[0]):
            return [make() for _ in devices]
    made = []
    for d in devices:
        with cupy.cuda.Device(d):
            made.append(make())
    return made


def reduce(buffers, op="sum", root=0, *, out=None, algorithm="auto"):
    """The reduction of all replicas' buffers, written to ``out[root]`` (or a new array on the root's GPU) and returned.

    ``algorithm="nccl"``: NCCL's reduce (one GPU per replica), which a CUDA
    graph of each GPU can hold; on a mix of GPUs hosting several replicas,
    ``"nccl"`` or ``"auto"`` (NCCL loaded): the hierarchical reduce, which
    graphs hold too (docs/hierarchical.md); any other: the native engine's
    direct reduce.
    """
    arrays, code, devices = _inputs(buffers, "buffers")
    opc = op_code(op)
    root = root_index(root, len(arrays))
    engine, _ = _engine(devices, algorithm)
    if out is None:
        with _gpu.cupy_module().cuda.Device(devices[root]):
            target, finish = _gpu.cupy_module().empty_like(arrays[root]), None
    else:
        outs, finish = _outputs(out, arrays, devices, "out", written=root)
        target = outs[root]
    how = engine.backend if engine.backend.startswith("nccl") else "direct"
    with span("reduce", arrays[0].nbytes, how, len(arrays)):
        engine.reduce(_ptrs(arrays), [target.data.ptr] * len(arrays), arrays[0].size, code, opc, root,
                      _streams(devices))
    return target if finish is None else finish()[root]


def all_gather(buffers, axis=0):
    """Every replica gets the concatenation of all buffers along ``axis`` on its own GPU; sizes may differ along ``axis`` only."""
    arrays, _, devices = _inputs(buffers, "buffers", same_shape=False)
    shape, row_bytes, outer = gather_layout(arrays, axis)
    first = arrays[0]
    cupy = _gpu.cupy_module()
    outs = _on_each_gpu(cupy, devices, tuple(dict.fromkeys(devices)), lambda: cupy.empty(shape, first.dtype))
    engine, _ = _engine(devices, "auto")
    with span("all_gather", first.nbytes, "direct", len(arrays)):
        engine.all_gather(_ptrs(arrays), _ptrs(outs), row_bytes, outer, _streams(devices))
    return outs


def batch_all_reduce(per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto",
                     chunk_bytes=0):
    """All-reduce many tensors per replica at once, fused into few packs (see :mod:`mirrored.collectives`).

    One native call whatever the tensor count: replicas that share one GPU
    take one multi-tensor kernel per dtype from the inputs to the results;
    across GPUs it uploads a (pointer, size) table, packs every tensor with
    one kernel per GPU, all-reduces each pack and unpacks with one more
    kernel. The results of a replica are views of one buffer on its GPU (one
    allocation per replica, not per tensor), new unless the previous call's
    were dropped (docs/collectives_results.md).
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
    """A validated batch all-reduce of GPU buffers: the native ``_cuda.BatchPlan`` (engine, algorithm,
    packing, dtype codes, the results' offsets in one buffer per replica, and what each tensor must be),
    kept so a repeated batch does no planning.

    ``run`` makes one binding call, which checks in C++ that each tensor still
    fits (a CuPy array of the planned shape, dtype and strides on its
    replica's GPU), then looks up each GPU's stream, takes a kept set of results nobody
    references or has ``_new_results`` make one, and enqueues the whole batch. Anything else returns None: the face
    validates that call afresh.
    """

    __slots__ = ("_plan", "_devices", "_ordinals", "_replicas", "_one_gpu", "_views", "_total", "_cupy")
    _streams = _plan_streams

    def __init__(self, engine, algo: int, op: int, bytes_per_pack: int, num_packs: int, layout, first_tensors):
        devices, shapes, dtypes, codes, counts, offsets, self._total = layout
        _layout(self, devices)
        self._views = tuple(zip(shapes, dtypes, offsets))
        self._cupy = cupy = _gpu.cupy_module()
        # Planned strides: C-contiguous for the planned shapes (see CallPlan).
        specs = [(a.shape, a.strides, a.dtype, a.size) for a in first_tensors]
        self._plan = _gpu.cuda_module().BatchPlan(engine, algo, op, bytes_per_pack, num_packs, codes, counts, offsets,
                                                  cupy.ndarray, list(devices), specs)

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's results buffer."""
        return self._total

    def run(self, per_replica_lists):
        return self._plan.run(per_replica_lists, self._streams, self._new_results)

    def _new_results(self):
        """(each replica's results: views of one new buffer on its GPU, each buffer's address)."""
        cupy, total = self._cupy, self._total
        ndarray, views = cupy.ndarray, self._views
        bases = _on_each_gpu(cupy, self._devices, self._ordinals, lambda: cupy.cuda.alloc(total))
        results = [[ndarray(shape, dtype, memptr=base + off) for shape, dtype, off in views] for base in bases]
        return results, [base.ptr for base in bases]




def _layout(plan, devices) -> None:
    """Sets a plan's replicas' GPUs: ``_devices`` (each replica's), ``_ordinals`` (each GPU once: logical
    GPUs share one), ``_replicas`` and ``_one_gpu`` (the one GPU of every replica, else None)."""
    plan._devices = tuple(devices)
    plan._ordinals = tuple(dict.fromkeys(plan._devices))
    plan._replicas = len(plan._devices)
    plan._one_gpu = plan._ordinals[0] if len(plan._ordinals) == 1 else None


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
        device = _memory_device(tensors[0])
        if device is None or not all(a.shape == s and a.dtype == dt and a.flags.c_contiguous
                                     and _memory_device(a) == device for a, s, dt in zip(tensors, shapes, dtypes)):
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


def _memory_device(a):
    """The GPU of a CuPy array's device memory; None when it has none (the validating path says so)."""
    data = a.data
    ptr = getattr(data, "ptr", None)
    if not isinstance(ptr, int) or (ptr == 0 and a.size):
        return None
    return data.device_id


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
    kind = _engine_kind(tuple(devices), name)
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    key = (kind, tuple(devices), chunk_bytes if kind == "ring" else 0)
    engine = _engines.get(key)
    if engine is None:
        cuda = _gpu.cuda_module()
        if kind == "ring":
            engine = cuda.ring(list(devices), chunk_bytes, CHANNELS)
        else:
            _gpu.load_nccl()
            engine = (cuda.nccl if kind == "nccl" else cuda.hierarchical)(list(devices))
        engine = _engines.setdefault(key, engine)
    return engine, ALGORITHMS[name]



def _engine_kind(devices: tuple, name: str) -> str:
    """``"nccl"`` (one GPU per replica), ``"hierarchical"`` (several GPUs, some hosting several replicas:
    one kernel per GPU, NCCL across GPUs) or ``"ring"`` (the native engine) for ``algorithm=name``.

    ``"nccl"`` takes NCCL's way on either layout; ``"auto"`` takes the hierarchical engine on a mix
    when NCCL loads (per-GPU CUDA graphs can hold it, not the native engine's events between GPUs);
    every other name is the native engine's."""
    gpus = len(set(devices))
    # (One fold kernel per GPU takes at most MAX_FOLD of its replicas: beyond, only the native engine.)
    mix = 1 < gpus < len(devices) and max(devices.count(d) for d in set(devices)) <= MAX_FOLD
    if name == "nccl":
        if gpus == 1 and len(devices) > 1:
            raise ValueError(f"algorithm='nccl': every replica shares GPU {devices[0]} (logical GPUs); NCCL needs "
                             "several GPUs, use algorithm='ring' for logical GPUs (or 'auto')")
        return "hierarchical" if mix else "nccl"
    return "hierarchical" if mix and name == "auto" and _gpu.nccl_available() else "ring"


def _ptrs(arrays):
    return [a.data.ptr for a in arrays]


def _streams(devices):
    return [_gpu.collective_stream(d) for d in devices]
