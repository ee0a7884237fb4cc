"""The one collective face: every collective of the package is validated and planned here.

A call's signature is (kind, its parameters — op, root, packing, algorithm,
chunk size —, the number of replicas, and the type, shape and dtype of the
first buffer). The first call of a signature is validated by
:mod:`mirrored.collective.rules` and leaves a plan: for host buffers a native
``_core.CallPlan`` / ``_core.BatchPlan`` holding dtype codes, layout and
engine parameters; for GPU buffers a ``cuda.CallPlan`` holding the engine
(CUDA ring kernels or NCCL), algorithm, dtype code and devices; for the
collectives of a multi-worker job (mirrored.collective.multi_worker, whose
signatures name the job's communicator) a native ``_net.WorkerPlan`` /
``_net.WorkerBatchPlan`` over the Gloo engine. A repeated
call finds the plan by its signature and runs it: the plan checks that every
array still fits (host buffers in C++: exact NumPy arrays of the planned
dtype and shape, contiguous, outputs writeable), extracts the pointers and
runs the engine with the GIL released. An array that does not fit sends the
call back here, to be validated (and reported) afresh.

Fusion (``bytes_per_pack``, ``num_packs``) is decided by the engines'
one packer (csrc/core/packer.cc) for host, CUDA, NCCL and Gloo batches alike.
"""

from __future__ import annotations

from .._core import (BatchPlan as _BatchPlan, CallPlan as _CallPlan, all_gather as _host_all_gather,
                     all_reduce as _host_all_reduce, batch_all_reduce as _host_batch_all_reduce,
                     broadcast as _host_broadcast, reduce as _host_reduce)
from ..device.dtypes import op_code
from ..timeline import span
from .rules import (MEAN, algorithm_code, any_integer_mean, check_batch, check_chunk_bytes, check_packing,
                    gather_layout, inputs as _inputs, integer_mean, means_of_sums, on_gpu, outputs as _outputs,
                    recycler, result, result_like, root_index, true_divide)

__all__ = ["lookup", "all_reduce_plan", "lookup_batch", "remember", "remember_batch", "clear", "all_reduce",
           "broadcast", "reduce", "all_gather", "batch_all_reduce", "MAX_PLANS"]

# Plans kept; the cache starts over when full (a program has a handful of signatures).
MAX_PLANS = 4096
_plans: dict = {}


def lookup(kind: str, params: tuple, buffers):
    """The plan of this call's signature, or None (first call, or not a list of arrays)."""
    try:
        first = buffers[0]
        return _plans.get((kind, params, len(buffers), type(first), first.shape, first.dtype))
    except Exception:  # not a list of arrays: the validating path reports it
        return None


def all_reduce_plan(buffers, op, algorithm, chunk_bytes):
    """The plan of ``collectives.all_reduce(buffers, op, algorithm=, chunk_bytes=)``'s signature, or None;
    ``plan.run(buffers, out)`` makes such a call again (None, with nothing done, when an array does not fit)."""
    return lookup("all_reduce", (op, algorithm, chunk_bytes), buffers)


def lookup_batch(params: tuple, per_replica_lists):
    """The plan of a batch all-reduce: the signature names the first tensor; the plan checks the rest."""
    try:
        return _plans.get(_batch_key(params, per_replica_lists))
    except Exception:
        return None


def _batch_key(params: tuple, per_replica_lists) -> tuple:
    tensors = per_replica_lists[0]
    first = tensors[0]
    return "batch_all_reduce", params, len(per_replica_lists), len(tensors), type(first), first.shape, first.dtype


def clear() -> None:
    """Forgets every plan. (Not needed when the machine's GPUs change: a GPU plan runs only arrays on the
    GPUs it was made for, checked before it looks up a stream; any other call is planned afresh.)"""
    _plans.clear()


def _remember(key: tuple, plan) -> None:
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


def remember(kind: str, params: tuple, buffers, plan) -> None:
    """Keeps ``plan`` for the signature of this call (an engine outside this module planned it)."""
    _remember(_key(kind, params, buffers), plan)


def remember_batch(params: tuple, per_replica_lists, plan) -> None:
    _remember(_batch_key(params, per_replica_lists), plan)


def _key(kind: str, params: tuple, buffers) -> tuple:
    first = buffers[0]
    return kind, params, len(buffers), type(first), first.shape, first.dtype


# --- the validating path: first calls of a signature, and anything unusual ------------------

def _gpu_call(kind, buffers, out, op, root, algorithm, chunk_bytes):
    """An all_reduce / broadcast of GPU buffers: planned (and the plan kept) when the buffers are
    contiguous CuPy arrays, else converted by the CUDA engine's validating path."""
    from .cuda import all_reduce as gpu_all_reduce, broadcast as gpu_broadcast, call_plan

    plan = call_plan(kind, buffers, op, root, algorithm, chunk_bytes)
    with span(kind, plan.nbytes, algorithm, len(buffers)):
        done = plan.run(buffers, out)
    if done is None:
        if kind == "broadcast":
            return gpu_broadcast(buffers, root, out=out, algorithm=algorithm)
        return gpu_all_reduce(buffers, op, out=out, algorithm=algorithm, chunk_bytes=chunk_bytes)
    params = (root, algorithm) if kind == "broadcast" else (op, algorithm, chunk_bytes)
    _remember(_key(kind, params, buffers), plan)
    return done


def all_reduce(buffers, op, out, algorithm, chunk_bytes):
    opc = op_code(op)
    if opc == MEAN and integer_mean(buffers, op):
        sums = all_reduce(buffers, "sum", None, algorithm, chunk_bytes)
        return true_divide(sums, len(sums), out)
    if on_gpu(buffers):
        return _gpu_call("all_reduce", buffers, out, op, 0, algorithm, chunk_bytes)
    chunk = check_chunk_bytes(chunk_bytes)
    arrays, code = _inputs(buffers, "buffers")
    algo = algorithm_code(algorithm)
    outs, finish = _outputs(out, arrays, "out")
    first = arrays[0]
    plan = _CallPlan("all_reduce", len(arrays), first.dtype, first.shape, code, opc, algo, chunk, 0,
                     recycler.empty)
    with span("all_reduce", first.nbytes, algorithm, len(arrays)):
        done = plan.run(buffers, out)
        if done is None:  # converted inputs or outputs: this call runs on them
            _host_all_reduce(arrays, outs, first.size, code, opc, algo, chunk)
    if done is None:
        return finish()
    _remember(_key("all_reduce", (op, algorithm, chunk_bytes), buffers), plan)
    return done


def broadcast(buffers, root, out, algorithm="auto"):
    if on_gpu(buffers):
        return _gpu_call("broadcast", buffers, out, "sum", root, algorithm, 0)
    algorithm_code(algorithm)  # (named, so 'nccl' on host buffers says why; the host broadcast is one direct pass)
    arrays, code = _inputs(buffers, "buffers")
    root = root_index(root, len(arrays))
    outs, finish = _outputs(out, arrays, "out")
    first = arrays[0]
    plan = _CallPlan("broadcast", len(arrays), first.dtype, first.shape, code, 0, 0, 0, root,
                     recycler.empty)
    with span("broadcast", first.nbytes, "direct", len(arrays)):
        done = plan.run(buffers, out)
        if done is None:
            _host_broadcast(arrays, outs, first.size, code, root)
    if done is None:
        return finish()
    _remember(_key("broadcast", (root, algorithm), buffers), plan)
    return done


def reduce(buffers, op, root, out, algorithm):
    if integer_mean(buffers, op):
        total = reduce(buffers, "sum", root, None, algorithm)
        return true_divide([total], len(buffers), None if out is None else [out[root]])[0]
    if on_gpu(buffers):
        from .cuda import reduce as gpu_reduce

        return gpu_reduce(buffers, op, root, out=out, algorithm=algorithm)
    algorithm_code(algorithm)  # (named, so 'nccl' on host buffers says why; the host reduce is one direct pass)
    arrays, code = _inputs(buffers, "buffers")
    opc = op_code(op)
    root = root_index(root, len(arrays))
    if out is None:
        target, finish = result_like(arrays[root]), None
    else:
        outs, finish = _outputs(out, arrays, "out", written=root)
        target = outs[root]
    with span("reduce", arrays[0].nbytes, "direct", len(arrays)):
        _host_reduce(arrays, [target] * len(arrays), arrays[0].size, code, opc, root)
    return target if finish is None else finish()[root]


def all_gather(buffers, axis):
    if on_gpu(buffers):
        from .cuda import all_gather as gpu_all_gather

        return gpu_all_gather(buffers, axis)
    arrays, _ = _inputs(buffers, "buffers", same_shape=False)
    shape, row_bytes, outer = gather_layout(arrays, axis)
    outs = [result(shape, arrays[0].dtype) for _ in arrays]
    with span("all_gather", arrays[0].nbytes, "direct", len(arrays)):
        _host_all_gather(arrays, outs, row_bytes, outer)
    return outs


def batch_all_reduce(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, chunk_bytes):
    n = check_batch(per_replica_lists)
    if not per_replica_lists[0]:  # nothing to reduce; the arguments are still checked, as for any batch
        check_packing(bytes_per_pack, num_packs, chunk_bytes)
        op_code(op)
        algorithm_code(algorithm)
        return [[] for _ in range(n)]
    if any_integer_mean(per_replica_lists[0], op):
        sums = batch_all_reduce(per_replica_lists, "sum", bytes_per_pack, num_packs, algorithm, chunk_bytes)
        return means_of_sums(sums, n)
    params = (op, bytes_per_pack, num_packs, algorithm, chunk_bytes)
    if on_gpu([per_replica_lists[0][0]]):
        from .cuda import batch_all_reduce as gpu_batch_all_reduce, batch_plan

        plan = batch_plan(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, chunk_bytes)
        if plan is None:  # converted inputs: this call alone
            return gpu_batch_all_reduce(per_replica_lists, op, bytes_per_pack=bytes_per_pack, num_packs=num_packs,
                                        algorithm=algorithm, chunk_bytes=chunk_bytes)
        with span("batch_all_reduce", plan.nbytes, algorithm, n):
            done = plan.run(per_replica_lists)
        _remember(_batch_key(params, per_replica_lists), plan)
        return done
    packing = check_packing(bytes_per_pack, num_packs, chunk_bytes)
    opc = op_code(op)
    algo = algorithm_code(algorithm)
    # Tensor t across replicas, checked with messages naming it; converted where needed.
    columns = [_inputs([tensors[t] for tensors in per_replica_lists], f"per_replica_lists[*][{t}]")
               for t in range(len(per_replica_lists[0]))]
    firsts = [column[0] for column, _ in columns]
    codes = [code for _, code in columns]
    plan = _BatchPlan(n, [a.dtype for a in firsts], [a.shape for a in firsts], codes, opc, packing[0],
                      packing[1], algo, packing[2], recycler.empty)
    with span("batch_all_reduce", sum(a.nbytes for a in firsts), algorithm, n):
        done = plan.run(per_replica_lists)
        if done is None:  # converted inputs: arranged replica-major for the generic call
            inputs = [column[r] for r in range(n) for column, _ in columns]
            outputs = [result_like(a) for a in inputs]
            _host_batch_all_reduce(n, inputs, outputs, [a.size for a in firsts], codes, opc, packing[0],
                                   packing[1], algo, packing[2])
            T = len(columns)
            return [outputs[r * T:(r + 1) * T] for r in range(n)]
    _remember(_batch_key(params, per_replica_lists), plan)
    return done
