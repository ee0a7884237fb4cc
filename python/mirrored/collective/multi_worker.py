"""The data path of collectives that span every replica of every worker of a job.

A call is hierarchical: this process's replicas are combined natively first,
one buffer per process crosses the network (Gloo over TCP for host buffers,
NCCL for device buffers), and the result comes back to every local replica.
Replica ``g`` of the job is local replica ``g % n`` of worker ``g // n``.

:class:`WorkerCollectives` holds the functions of :mod:`mirrored.collectives`
with job-wide meaning; the job's set-up (store, rendezvous, Gloo mesh) is
``mirrored.distribute.collective_all_reduce.CollectiveGroup``, its subclass.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ..timeline import enabled as tracing, span
from ..device import config, device_util, gpu as _gpu
from ..device.dtypes import CODES, op_code
from .plan import lookup, lookup_batch, remember, remember_batch
from .rules import (algorithm_code, any_integer_mean, check_batch, check_packing, gpu_inputs, gpu_outputs,
                    inputs as _inputs, integer_mean, means_of_sums, on_gpu, outputs as _outputs, recycler,
                    result_like, root_index, true_divide)

__all__ = ["WorkerCollectives", "DEFAULT_RENDEZVOUS_SECONDS"]

# How long workers wait for each other at start-up when CommunicationOptions sets no timeout.
DEFAULT_RENDEZVOUS_SECONDS = 300.0
# all_gather exchanges shapes as fixed-length records of this many dimensions (GlooCommunicator::agree_gather).
_MAX_DIMS = 32


class WorkerCollectives:
    """The collectives of a joined job; the subclass that joins it sets ``tasks``, ``rank``,
    ``num_workers``, ``local_replicas``, ``num_replicas``, ``devices``, ``store``, ``_gloo``,
    ``_timeout``, ``_scope``, ``_implementation``, ``_device_engine`` and ``_call_engine``."""

    # Every call goes through the one collective face (mirrored.collective.plan):
    # its first call of a signature (which names this job's communicator) is
    # validated here and leaves a native plan over the Gloo engine; a repeated
    # call finds the plan and runs it (pointer extraction and one native call
    # with the GIL released). The workers agree on every call natively: each
    # collective's header carries its signature (see GlooCommunicator).
    #
    # Every collective takes a call's own CommunicationOptions fields (None:
    # the strategy's, as CommunicationOptions.merge has it): ``timeout``
    # (seconds; 0 or inf: none) bounds that call alone, natively
    # (GlooCommunicator::CallTimeout); ``implementation`` ("RING", "NCCL")
    # picks the engine of GPU replicas for that call. Both are part of the
    # plan's signature.

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto", timeout=None, implementation=None,
                   _agreed=None):
        # _agreed: the op the workers compare, when it differs from `op` (an
        # integer MEAN runs as a SUM here, but another worker's SUM is still a mismatch).
        plan = lookup("all_reduce[workers]", (self._gloo, op, algorithm, _agreed, timeout, implementation), buffers)
        if plan is not None and not tracing():
            done = plan.run(buffers, out)
            if done is not None:
                return done
        return self._all_reduce(buffers, op, out, algorithm, _agreed, timeout, implementation)

    def broadcast(self, buffers, root=0, *, out=None, timeout=None, implementation=None):
        plan = lookup("broadcast[workers]", (self._gloo, root, timeout, implementation), buffers)
        if plan is not None and not tracing():
            done = plan.run(buffers, out)
            if done is not None:
                return done
        return self._broadcast(buffers, root, out, timeout, implementation)

    def reduce(self, buffers, op="sum", root=0, *, out=None, timeout=None, implementation=None, _agreed=None):
        """The job-wide reduction, returned on the worker that holds replica ``root`` (None elsewhere)."""
        plan = lookup("reduce[workers]", (self._gloo, op, root, _agreed, timeout, implementation), buffers)
        if plan is not None and not tracing():
            done = plan.run(buffers, out)
            if done is not None:
                return done[0]
        return self._reduce(buffers, op, root, out, _agreed, timeout, implementation)

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None,
                         algorithm="auto", timeout=None, implementation=None, _agreed=None):
        """All-reduce many tensors per replica, fused: one network all-reduce per pack.

        Tensors of one dtype are packed (by the engines' one packer,
        csrc/core/packer.cc) into flat buffers of at most ``bytes_per_pack``
        bytes (or into ``num_packs`` packs; neither: one pack per dtype), so a
        step's gradients cross the network in a few large messages instead of
        many small ones.
        """
        params = (self._gloo, op, bytes_per_pack, num_packs, algorithm, _agreed, timeout, implementation)
        plan = lookup_batch(params, per_replica_lists)
        if plan is not None and not tracing():
            done = plan.run(per_replica_lists)
            if done is not None:
                return done
        return self._batch_all_reduce(per_replica_lists, op, bytes_per_pack, num_packs, algorithm, _agreed, timeout,
                                      implementation)

    # -- the validating path: first calls of a signature, and anything unusual --

    def _all_reduce(self, buffers, op, out, algorithm, agreed, timeout, implementation):
        if integer_mean(buffers, op):  # float64, as in one process (see mirrored.collectives)
            return true_divide(self.all_reduce(buffers, "sum", algorithm=algorithm, timeout=timeout,
                                               implementation=implementation, _agreed=op), self.num_replicas, out)
        if on_gpu(buffers):
            return self._device(implementation).all_reduce(buffers, op, out=out, timeout=timeout)
        comm = self._host_comm(implementation)
        seconds = native_timeout(timeout)
        arrays, code = _inputs(buffers, "buffers")
        opc, algo = op_code(op), algorithm_code(algorithm)
        agreed_code = -1 if agreed is None else op_code(agreed)
        outs, finish = _outputs(out, arrays, "out")
        first = arrays[0]
        plan = self._plan("all_reduce", arrays, code, opc, algo, 0, agreed_code, seconds)
        with span("all_reduce[workers]", first.nbytes, algorithm, len(arrays), self.num_replicas):
            done = plan.run(buffers, out) if plan is not None else None
            if done is None:  # converted inputs or outputs (or a wrong replica count): this call alone
                comm.all_reduce(arrays, outs, first.size, code, opc, algo, agreed_code, seconds)
        if done is None:
            return finish()
        remember("all_reduce[workers]", (comm, op, algorithm, agreed, timeout, implementation), buffers, plan)
        return done

    def _broadcast(self, buffers, root, out, timeout, implementation):
        if on_gpu(buffers):
            return self._device(implementation).broadcast(buffers, root, out=out, timeout=timeout)
        comm = self._host_comm(implementation)
        seconds = native_timeout(timeout)
        arrays, code = _inputs(buffers, "buffers")
        index = root_index(root, self.num_replicas)
        outs, finish = _outputs(out, arrays, "out")
        first = arrays[0]
        plan = self._plan("broadcast", arrays, code, 0, 0, index, -1, seconds)
        with span("broadcast[workers]", first.nbytes, "gloo", len(arrays), self.num_replicas):
            done = plan.run(buffers, out) if plan is not None else None
            if done is None:
                comm.broadcast(arrays, outs, first.size, code, index, seconds)
        if done is None:
            return finish()
        remember("broadcast[workers]", (comm, root, timeout, implementation), buffers, plan)
        return done

    def _reduce(self, buffers, op, root, out, agreed, timeout, implementation):
        if integer_mean(buffers, op):
            total = self.reduce(buffers, "sum", root, timeout=timeout, implementation=implementation, _agreed=op)
            if total is None:
                return None
            local_root = root_index(root, self.num_replicas) % self.local_replicas
            return true_divide([total], self.num_replicas, None if out is None else [out[local_root]])[0]
        if on_gpu(buffers):
            return self._device(implementation).reduce(buffers, op, root, out=out, timeout=timeout)
        comm = self._host_comm(implementation)
        seconds = native_timeout(timeout)
        arrays, code = _inputs(buffers, "buffers")
        opc = op_code(op)
        agreed_code = -1 if agreed is None else op_code(agreed)
        index = root_index(root, self.num_replicas)
        local_root = index % self.local_replicas
        if out is None:
            target, finish = result_like(arrays[local_root]), None
            targets = [target] * len(arrays)
        else:
            # Only the root's output is written (on the root's worker; none elsewhere): the others are
            # neither staged nor copied back, so a strided one keeps its values.
            holds_root = index // self.local_replicas == self.rank
            targets, finish = _outputs(out, arrays, "out", written=local_root if holds_root else -1)
            target = targets[local_root]
        plan = self._plan("reduce", arrays, code, opc, 0, index, agreed_code, seconds)
        with span("reduce[workers]", arrays[0].nbytes, "gloo", len(arrays), self.num_replicas):
            done = plan.run(buffers, out) if plan is not None else None
            if done is None:
                comm.reduce(arrays, targets, arrays[0].size, code, opc, index, agreed_code, seconds)
        if done is not None:
            remember("reduce[workers]", (comm, op, root, agreed, timeout, implementation), buffers, plan)
            return done[0]
        if index // self.local_replicas != self.rank:
            return None
        return target if finish is None else finish()[local_root]

    def _batch_all_reduce(self, per_replica_lists, op, bytes_per_pack, num_packs, algorithm, agreed, timeout,
                          implementation):
        n = check_batch(per_replica_lists)
        tensors0 = per_replica_lists[0]
        if not tensors0:
            return [[] for _ in range(n)]
        if any_integer_mean(tensors0, op):
            return means_of_sums(
                self.batch_all_reduce(per_replica_lists, "sum", bytes_per_pack=bytes_per_pack, num_packs=num_packs,
                                      algorithm=algorithm, timeout=timeout, implementation=implementation,
                                      _agreed=op), self.num_replicas)
        if on_gpu([tensors0[0]]):
            return self._device(implementation).batch_all_reduce(per_replica_lists, op, bytes_per_pack=bytes_per_pack,
                                                                 num_packs=num_packs, timeout=timeout)
        comm = self._host_comm(implementation)
        seconds = native_timeout(timeout)
        packing = check_packing(bytes_per_pack, num_packs)
        opc, algo = op_code(op), algorithm_code(algorithm)
        agreed_code = -1 if agreed is None else op_code(agreed)
        # Tensor t across replicas, checked with messages naming it; converted where needed.
        columns = [_inputs([tensors[t] for tensors in per_replica_lists], f"per_replica_lists[*][{t}]")
                   for t in range(len(tensors0))]
        firsts = [column[0] for column, _ in columns]
        codes = [code for _, code in columns]
        plan = None
        if n == self.local_replicas:
            plan = config.net_module().WorkerBatchPlan(
                comm, n, [a.dtype for a in firsts], [a.shape for a in firsts], codes, opc, packing[0], packing[1],
                algo, agreed_code, recycler.empty, seconds)
        with span("batch_all_reduce[workers]", sum(a.nbytes for a in firsts), algorithm, n,
                  self.num_replicas):
            done = plan.run(per_replica_lists) if plan is not None else None
            if done is None:  # converted inputs: arranged replica-major for the generic call
                inputs = [column[r] for r in range(n) for column, _ in columns]
                outputs = [result_like(a) for a in inputs]
                comm.batch_all_reduce(n, inputs, outputs, [a.size for a in firsts], codes, opc, packing[0],
                                      packing[1], algo, agreed_code, seconds)
                T = len(columns)
                return [outputs[r * T:(r + 1) * T] for r in range(n)]
        remember_batch((comm, op, bytes_per_pack, num_packs, algorithm, agreed, timeout, implementation),
                       per_replica_lists, plan)
        return done

    def _all_gather(self, buffers, axis, timeout, implementation):
        if on_gpu(buffers):
            return self._device(implementation).all_gather(buffers, axis, timeout=timeout)
        comm = self._host_comm(implementation)
        arrays, code = _inputs(buffers, "buffers", same_shape=False)
        first = arrays[0]
        if first.ndim == 0 or first.ndim > _MAX_DIMS:
            raise ValueError(f"all_gather: buffers are {first.ndim}-d; gather needs 1..{_MAX_DIMS} dimensions "
                             "(use x[None] for a scalar)")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -first.ndim <= axis < first.ndim:
            raise ValueError(f"axis={axis!r} is out of range for {first.ndim}-d buffers; use 0..{first.ndim - 1}")
        if len(arrays) != self.local_replicas:
            raise ValueError(f"all_gather: got {len(arrays)} local buffers, but this worker joined the job with "
                             f"{self.local_replicas} replicas")
        # Shapes may differ along `axis` only: the plan opens every call with
        # the table of every replica's shape, this worker's replicas
        # included, which every worker checks alike (so every worker raises
        # the same error).
        plan = config.net_module().WorkerGatherPlan(comm, first.dtype, code, [a.shape for a in arrays],
                                                    int(axis) % first.ndim, recycler.empty, native_timeout(timeout))
        with span("all_gather[workers]", first.nbytes, "gloo", len(arrays), self.num_replicas):
            done = plan.run(buffers)
            if done is not None:
                remember("all_gather[workers]", (comm, axis, timeout, implementation), buffers, plan)
                return done
            done = plan.run(arrays)  # converted inputs: this call alone
        if done is None:
            raise TypeError(f"all_gather: buffers of dtype {first.dtype!r} cannot be gathered; pass arrays of a "
                            f"plain NumPy dtype ({', '.join(CODES)})")
        return done

    def _plan(self, kind, arrays, code, opc, algo, root, agreed_code, seconds):
        """A native plan of this call; None where the replica count is wrong (the engine's error explains)."""
        if len(arrays) != self.local_replicas:
            return None
        first = arrays[0]
        return config.net_module().WorkerPlan(self._gloo, kind, len(arrays), first.dtype, first.shape, code, opc,
                                              algo, root, agreed_code, recycler.empty, seconds)

    def all_gather(self, buffers, axis=0, *, timeout=None, implementation=None):
        """Every local replica gets the concatenation along ``axis`` of all replicas of the job."""
        plan = lookup("all_gather[workers]", (self._gloo, axis, timeout, implementation), buffers)
        if plan is not None and not tracing():
            done = plan.run(buffers)
            if done is not None:
                return done
        return self._all_gather(buffers, axis, timeout, implementation)

    def barrier(self) -> None:
        self._comm().barrier()

    # -- engines --------------------------------------------------------------

    def _comm(self):
        if self._gloo is None:
            raise RuntimeError("this multi-worker group was closed; create a new strategy")
        return self._gloo

    def _host_comm(self, implementation):
        """The Gloo communicator for host buffers; a call's implementation NCCL is refused (NCCL needs GPU
        replicas), as the strategy's is."""
        if implementation == "NCCL":
            raise ValueError(f"options: implementation NCCL needs GPU replicas but this worker has "
                             f"{list(self.devices or ['/cpu:0'])}; use CommunicationImplementation.AUTO or RING for "
                             "CPU replicas")
        return self._comm()

    def _device(self, implementation=None):
        """The engine for GPU replicas: NCCL across the job, or Gloo through host memory; a call's own
        ``implementation`` ("RING", "NCCL") over the strategy's. Each engine is made on its first call (on
        every worker alike: they run the same calls), so at most one NCCL communicator per group."""
        if self._device_engine is None:
            use_nccl = self._implementation != "RING" and (self._implementation == "NCCL" or _gpu.nccl_available())
            if implementation is not None and (implementation == "NCCL") != use_nccl:
                return self._call_device(implementation)  # (the strategy's engine is not needed yet)
            self._device_engine = _NcclJob(self) if use_nccl else _HostStaged(self)
            why = "implementation=RING" if self._implementation == "RING" else f"NCCL not installed: {_gpu.NCCL_FIX}"
            logging.getLogger("mirrored").info("GPU replicas across workers: %s",
                                               "NCCL" if use_nccl else f"host memory and Gloo ({why})")
        if implementation is None or (implementation == "NCCL") == isinstance(self._device_engine, _NcclJob):
            return self._device_engine
        return self._call_device(implementation)

    def _call_device(self, implementation):
        """The engine of calls whose implementation is not the strategy's (the other kind)."""
        if self._call_engine is None:
            self._call_engine = _NcclJob(self) if implementation == "NCCL" else _HostStaged(self)
        return self._call_engine


class _NcclJob:
    """One NCCL communicator over every GPU of the job; local GPU ``i`` of worker ``w`` is rank ``w * n + i``.

    Task 0 draws NCCL's unique id and publishes it through the store. all_gather
    (sizes may differ per replica) and reduce go through host memory and Gloo.
    A call's ``timeout`` bounds those; NCCL's own calls have none (as the
    strategy's timeout: a dead peer is found by the Gloo mesh).
    """

    def __init__(self, group):
        from .cuda import _ptrs, _streams

        key = f"{group._scope}/nccl-unique-id"
        if group.rank == 0:
            group.store.set(key, _gpu.nccl_unique_id())
        else:
            _gpu.load_nccl()
        wait = group._timeout if group._timeout is not None else DEFAULT_RENDEZVOUS_SECONDS
        if group.store.wait([key], wait):
            raise config.net_module().PeerTimeoutError(
                f"task {group.tasks[0]} did not publish NCCL's unique id within {wait} s")
        ordinals = [device_util.physical_ordinal(d) for d in group.devices]
        self._ptrs, self._streams = _ptrs, _streams  # the CUDA engine's pointer and stream lists
        self._staged = _HostStaged(group)
        self._engine = _gpu.cuda_module().nccl_rank(group.store.get(key), group.rank * group.local_replicas,
                                                    group.num_replicas, ordinals)
        self._replicas = group.num_replicas

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto", timeout=None):
        arrays, code, devices = gpu_inputs(buffers, "buffers")
        outs, finish = gpu_outputs(out, arrays, devices, "out")
        self._engine.all_reduce(self._ptrs(arrays), self._ptrs(outs), arrays[0].size, code, op_code(op), 0,
                                self._streams(devices))
        return finish()

    def broadcast(self, buffers, root=0, *, out=None, timeout=None):
        arrays, code, devices = gpu_inputs(buffers, "buffers")
        root = root_index(root, self._replicas)
        outs, finish = gpu_outputs(out, arrays, devices, "out")
        self._engine.broadcast(self._ptrs(arrays), self._ptrs(outs), arrays[0].size, code, root,
                               self._streams(devices))
        return finish()

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto",
                         timeout=None):
        columns = [gpu_inputs([lst[t] for lst in per_replica_lists], f"per_replica_lists[*][{t}]")
                   for t in range(len(per_replica_lists[0]))]
        devices = columns[0][2]
        cupy = _gpu.cupy_module()
        outputs = []
        for r, d in enumerate(devices):
            with cupy.cuda.Device(d):
                outputs.append([cupy.empty_like(c[0][r]) for c in columns])
        self._engine.batch_all_reduce([[c[0][r].data.ptr for c in columns] for r in range(len(devices))],
                                      [[o.data.ptr for o in outs] for outs in outputs],
                                      [c[0][0].size for c in columns], [c[1] for c in columns], op_code(op),
                                      *check_packing(bytes_per_pack, num_packs)[:2], 0, self._streams(devices))
        return outputs

    def reduce(self, buffers, op="sum", root=0, *, out=None, timeout=None):
        return self._staged.reduce(buffers, op, root, out=out, timeout=timeout)

    def all_gather(self, buffers, axis=0, *, timeout=None):
        return self._staged.all_gather(buffers, axis, timeout=timeout)


class _HostStaged:
    """GPU replicas over Gloo: copy to host, run the host collective, copy back to each replica's GPU."""

    def __init__(self, group):
        self._group = group

    def _run(self, name, buffers, *args, **kwargs):
        devices = self._group.devices
        result = getattr(self._group, name)([device_util.to_host(b) for b in buffers], *args, **kwargs)
        if result is None or not isinstance(result, list):
            return None if result is None else device_util.place(result, devices[0])
        return [device_util.place(r, d) for r, d in zip(result, devices)]

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto", timeout=None):
        return _into(out, self._run("all_reduce", buffers, op, timeout=timeout))

    def broadcast(self, buffers, root=0, *, out=None, timeout=None):
        return _into(out, self._run("broadcast", buffers, root, timeout=timeout))

    def reduce(self, buffers, op="sum", root=0, *, out=None, timeout=None):
        result = self._group.reduce([device_util.to_host(b) for b in buffers], op, root, timeout=timeout)
        if result is None:
            return None
        local = root % self._group.local_replicas
        placed = device_util.place(result, self._group.devices[local])
        if out is not None:
            out[local][...] = placed
            return out[local]
        return placed

    def all_gather(self, buffers, axis=0, *, timeout=None):
        return self._run("all_gather", buffers, axis, timeout=timeout)

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto",
                         timeout=None):
        host = [[device_util.to_host(t) for t in lst] for lst in per_replica_lists]
        reduced = self._group.batch_all_reduce(host, op, bytes_per_pack=bytes_per_pack, num_packs=num_packs,
                                               timeout=timeout)
        return [[device_util.place(r, d) for r in rs] for rs, d in zip(reduced, self._group.devices)]


def native_timeout(timeout) -> float:
    """A call's ``timeout_seconds`` as the native plans take it: -1 for None (the strategy's timeout), 0 for
    none (0 or inf), else the seconds (validated by CommunicationOptions)."""
    if timeout is None:
        return -1.0
    return 0.0 if timeout == 0 or math.isinf(timeout) else float(timeout)


def _into(out, results):
    if out is None:
        return results
    for o, r in zip(out, results):
        o[...] = r
    return list(out)
