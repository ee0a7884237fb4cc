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

import numpy as np

from . import rules
from .. import timeline
from ..device import config, device_util, gpu as _gpu
from ..device.dtypes import CODES, OPS, op_code

__all__ = ["WorkerCollectives", "DEFAULT_RENDEZVOUS_SECONDS"]

# How long workers wait for each other at start-up when CommunicationOptions sets no timeout.
DEFAULT_RENDEZVOUS_SECONDS = 300.0
# all_gather exchanges shapes as fixed-length records: ndim, dtype, then the padded shape.
_MAX_DIMS = 32


class WorkerCollectives:
    """The collectives of a joined job; the subclass that joins it sets ``tasks``, ``rank``,
    ``num_workers``, ``local_replicas``, ``num_replicas``, ``devices``, ``store``, ``_gloo``,
    ``_timeout``, ``_scope``, ``_implementation`` and ``_device_engine``."""

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto", _agreed=None):
        # _agreed: the op the workers compare, when it differs from `op` (an
        # integer MEAN runs as a SUM here, but another worker's SUM is still a mismatch).
        # In place on one array: checked natively, microseconds matter for small messages.
        if (out is buffers and type(buffers) is list and type(op) is str and type(algorithm) is str
                and _agreed is None and timeline._trace is None and self._gloo is not None):
            code, algo = OPS.get(op), rules.ALGORITHMS.get(algorithm)
            if code is not None and algo is not None and self._gloo.all_reduce_in_place(buffers, code, algo):
                return list(buffers)
        if rules.integer_mean(buffers, op):  # float64, as in one process (see mirrored.collectives)
            return rules.true_divide(self.all_reduce(buffers, "sum", algorithm=algorithm, _agreed=op),
                                           self.num_replicas, out)
        if rules.on_gpu(buffers):
            return self._device().all_reduce(buffers, op, out=out)
        arrays, code = rules.inputs(buffers, "buffers")
        opc, algo = op_code(op), rules.algorithm_code(algorithm)
        outs, finish = rules.outputs(out, arrays, "out")
        with timeline.span("all_reduce[workers]", arrays[0].nbytes, algorithm, len(arrays), self.num_replicas):
            self._comm().all_reduce(arrays, outs, arrays[0].size, code, opc, algo,
                                    -1 if _agreed is None else op_code(_agreed))
        return finish()

    def broadcast(self, buffers, root=0, *, out=None):
        if rules.on_gpu(buffers):
            return self._device().broadcast(buffers, root, out=out)
        arrays, code = rules.inputs(buffers, "buffers")
        root = rules.root_index(root, self.num_replicas)
        outs, finish = rules.outputs(out, arrays, "out")
        with timeline.span("broadcast[workers]", arrays[0].nbytes, "gloo", len(arrays), self.num_replicas):
            self._comm().broadcast(arrays, outs, arrays[0].size, code, root)
        return finish()

    def reduce(self, buffers, op="sum", root=0, *, out=None, _agreed=None):
        """The job-wide reduction, returned on the worker that holds replica ``root`` (None elsewhere)."""
        if rules.integer_mean(buffers, op):
            total = self.reduce(buffers, "sum", root, _agreed=op)
            if total is None:
                return None
            local_root = rules.root_index(root, self.num_replicas) % self.local_replicas
            return rules.true_divide([total], self.num_replicas,
                                           None if out is None else [out[local_root]])[0]
        if rules.on_gpu(buffers):
            return self._device().reduce(buffers, op, root, out=out)
        arrays, code = rules.inputs(buffers, "buffers")
        opc = op_code(op)
        root = rules.root_index(root, self.num_replicas)
        local_root = root % self.local_replicas
        if out is None:
            target, finish = np.empty_like(arrays[local_root]), None
            targets = [target] * len(arrays)
        else:
            targets, finish = rules.outputs(out, arrays, "out")
            target = targets[local_root]
        with timeline.span("reduce[workers]", arrays[0].nbytes, "gloo", len(arrays), self.num_replicas):
            self._comm().reduce(arrays, targets, arrays[0].size, code, opc, root,
                                -1 if _agreed is None else op_code(_agreed))
        if root // self.local_replicas != self.rank:
            return None
        return target if finish is None else finish()[local_root]

    def all_gather(self, buffers, axis=0):
        """Every local replica gets the concatenation along ``axis`` of all replicas of the job."""
        if rules.on_gpu(buffers):
            return self._device().all_gather(buffers, axis)
        arrays, code = rules.inputs(buffers, "buffers", same_shape=False)
        first = arrays[0]
        if first.ndim == 0 or first.ndim > _MAX_DIMS:
            raise ValueError(f"all_gather: buffers are {first.ndim}-d; gather needs 1..{_MAX_DIMS} dimensions "
                             "(use x[None] for a scalar)")
        if not isinstance(axis, (int, np.integer)) or not -first.ndim <= axis < first.ndim:
            raise ValueError(f"axis={axis!r} is out of range for {first.ndim}-d buffers; use 0..{first.ndim - 1}")
        axis = int(axis) % first.ndim
        # Shapes may differ between workers along `axis` only. The table of
        # every replica's shape opens the collective: every worker checks the
        # same table, so every worker raises the same error.
        mine = [first.ndim, code, axis]
        for a in arrays:
            mine += list(a.shape) + [0] * (_MAX_DIMS - a.ndim)
        comm = self._comm()
        table = np.asarray(comm.exchange(mine, "all_gather"), dtype=np.int64).reshape(self.num_workers, -1)
        shapes = [[tuple(int(d) for d in row[3 + j * _MAX_DIMS: 3 + j * _MAX_DIMS + row[0]])
                   for j in range(self.local_replicas)] for row in table]
        head, off = tuple(table[0][:3]), shapes[0][0][:axis] + shapes[0][0][axis + 1:]
        for w, row in enumerate(table):
            if tuple(row[:3]) != head or any(s[:axis] + s[axis + 1:] != off for s in shapes[w]):
                from ..errors import CollectiveMismatchError

                raise CollectiveMismatchError(
                    f"all_gather #{comm.collectives}: {self.tasks[0]} passes {_gather_call(table[0], shapes[0])}, "
                    f"{self.tasks[w]} passes {_gather_call(row, shapes[w])}; every worker must pass the same dtype, "
                    "number of dimensions and axis, and shapes may differ along the gather axis only (no data was "
                    "exchanged)")
        shapes = [s for per_worker in shapes for s in per_worker]
        outer = int(np.prod(first.shape[:axis], dtype=np.int64))
        inner = int(np.prod(first.shape[axis + 1:], dtype=np.int64)) * first.itemsize
        total = first.shape[:axis] + (sum(s[axis] for s in shapes),) + first.shape[axis + 1:]
        outs = [np.empty(total, first.dtype) for _ in arrays]
        # Every replica's row size: the data stage of the collective the table opened.
        row_bytes = [s[axis] * inner for s in shapes] if self.num_workers > 1 else \
            [a.shape[axis] * inner for a in arrays]
        with timeline.span("all_gather[workers]", first.nbytes, "gloo", len(arrays), self.num_replicas):
            comm.all_gather(arrays, outs, row_bytes, outer)
        return outs

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None,
                         algorithm="auto", _agreed=None):
        """All-reduce many tensors per replica, fused: one network all-reduce per pack.

        Tensors of one dtype are packed into flat buffers of at most
        ``bytes_per_pack`` bytes (or into ``num_packs`` packs; neither: one
        pack per dtype), so a step's gradients cross the network in a few
        large messages instead of many small ones.
        """
        n = len(per_replica_lists)
        tensors0 = per_replica_lists[0] if n else []
        if not tensors0:
            return [[] for _ in range(n)]
        if rules.any_integer_mean(tensors0, op):
            return rules.means_of_sums(
                self.batch_all_reduce(per_replica_lists, "sum", bytes_per_pack=bytes_per_pack, num_packs=num_packs,
                                      algorithm=algorithm, _agreed=op), self.num_replicas)
        if rules.on_gpu([tensors0[0]]):
            return self._device().batch_all_reduce(per_replica_lists, op, bytes_per_pack=bytes_per_pack,
                                                   num_packs=num_packs)
        if any(len(lst) != len(tensors0) for lst in per_replica_lists):
            raise ValueError("per_replica_lists: every replica must pass the same number of tensors")
        columns = [rules.inputs([lst[t] for lst in per_replica_lists], f"per_replica_lists[*][{t}]")[0]
                   for t in range(len(tensors0))]
        results = [[None] * len(columns) for _ in range(n)]
        for pack in _packs(columns, bytes_per_pack, num_packs):
            flat = [np.concatenate([columns[t][r].reshape(-1) for t in pack]) for r in range(n)]
            self.all_reduce(flat, op, out=flat, algorithm=algorithm, _agreed=_agreed)
            for r in range(n):
                at = 0
                for t in pack:
                    size = columns[t][r].size
                    results[r][t] = flat[r][at:at + size].reshape(columns[t][r].shape)
                    at += size
        return results

    def barrier(self) -> None:
        self._comm().barrier()

    # -- engines --------------------------------------------------------------

    def _comm(self):
        if self._gloo is None:
            raise RuntimeError("this multi-worker group was closed; create a new strategy")
        return self._gloo

    def _device(self):
        """The engine for GPU replicas: NCCL across the job, or Gloo through host memory."""
        if self._device_engine is None:
            use_nccl = self._implementation != "RING" and (self._implementation == "NCCL" or _gpu.nccl_available())
            self._device_engine = _NcclJob(self) if use_nccl else _HostStaged(self)
            why = "implementation=RING" if self._implementation == "RING" else f"NCCL not installed: {_gpu.NCCL_FIX}"
            logging.getLogger("mirrored").info("GPU replicas across workers: %s",
                                               "NCCL" if use_nccl else f"host memory and Gloo ({why})")
        return self._device_engine


class _NcclJob:
    """One NCCL communicator over every GPU of the job; local GPU ``i`` of worker ``w`` is rank ``w * n + i``.

    Task 0 draws NCCL's unique id and publishes it through the store. all_gather
    (sizes may differ per replica) and reduce go through host memory and Gloo.
    """

    def __init__(self, group):
        from . import cuda as cc

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
        self._cc = cc
        self._staged = _HostStaged(group)
        self._engine = _gpu.cuda_module().nccl_rank(group.store.get(key), group.rank * group.local_replicas,
                                                    group.num_replicas, ordinals)
        self._replicas = group.num_replicas

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto"):
        cc = self._cc
        arrays, code, devices = rules.gpu_inputs(buffers, "buffers")
        outs, finish = rules.gpu_outputs(out, arrays, devices, "out")
        self._engine.all_reduce(cc._ptrs(arrays), cc._ptrs(outs), arrays[0].size, code, op_code(op), 0,
                                cc._streams(devices))
        return finish()

    def broadcast(self, buffers, root=0, *, out=None):
        cc = self._cc
        arrays, code, devices = rules.gpu_inputs(buffers, "buffers")
        root = rules.root_index(root, self._replicas)
        outs, finish = rules.gpu_outputs(out, arrays, devices, "out")
        self._engine.broadcast(cc._ptrs(arrays), cc._ptrs(outs), arrays[0].size, code, root, cc._streams(devices))
        return finish()

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto"):
        cc = self._cc
        columns = [rules.gpu_inputs([lst[t] for lst in per_replica_lists], f"per_replica_lists[*][{t}]")
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
                                      int(bytes_per_pack), int(num_packs or 0), 0, cc._streams(devices))
        return outputs

    def reduce(self, buffers, op="sum", root=0, *, out=None):
        return self._staged.reduce(buffers, op, root, out=out)

    def all_gather(self, buffers, axis=0):
        return self._staged.all_gather(buffers, axis)


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

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto"):
        return _into(out, self._run("all_reduce", buffers, op))

    def broadcast(self, buffers, root=0, *, out=None):
        return _into(out, self._run("broadcast", buffers, root))

    def reduce(self, buffers, op="sum", root=0, *, out=None):
        result = self._group.reduce([device_util.to_host(b) for b in buffers], op, root)
        if result is None:
            return None
        local = root % self._group.local_replicas
        placed = device_util.place(result, self._group.devices[local])
        if out is not None:
            out[local][...] = placed
            return out[local]
        return placed

    def all_gather(self, buffers, axis=0):
        return self._run("all_gather", buffers, axis)

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto"):
        host = [[device_util.to_host(t) for t in lst] for lst in per_replica_lists]
        reduced = self._group.batch_all_reduce(host, op, bytes_per_pack=bytes_per_pack, num_packs=num_packs)
        return [[device_util.place(r, d) for r in rs] for rs, d in zip(reduced, self._group.devices)]


def _into(out, results):
    if out is None:
        return results
    for o, r in zip(out, results):
        o[...] = r
    return list(out)


def _gather_call(row, shapes) -> str:
    """One worker's part of an all_gather, from its row of the shape table, for a mismatch error."""
    name = next((n for n, c in CODES.items() if c == row[1]), f"dtype code {row[1]}")
    listed = ", ".join(str(s) for s in shapes)
    return f"{name} buffers of shape {listed} gathered along axis {row[2]}"


def _packs(columns, bytes_per_pack, num_packs):
    """Lists of tensor indices to fuse: same dtype, in order, split by size or count."""
    by_dtype: dict = {}
    for t, column in enumerate(columns):
        by_dtype.setdefault(column[0].dtype, []).append(t)
    for tensors in by_dtype.values():
        if num_packs:
            k = max(1, min(int(num_packs), len(tensors)))
            bounds = np.linspace(0, len(tensors), k + 1).astype(int)
            yield from (tensors[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
        elif bytes_per_pack:
            pack, size = [], 0
            for t in tensors:
                nbytes = columns[t][0].nbytes
                if pack and size + nbytes > bytes_per_pack:
                    yield pack
                    pack, size = [], 0
                pack.append(t)
                size += nbytes
            yield pack
        else:
            yield tensors
