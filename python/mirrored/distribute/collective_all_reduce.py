"""Collectives that span every replica of every worker of a multi-worker job.

A call is hierarchical: this process's replicas are combined natively first,
one buffer per process crosses the network (Gloo over TCP for host buffers,
NCCL for device buffers), and the result comes back to every local replica.
Replica ``g`` of the job is local replica ``g % n`` of worker ``g // n``
(workers ordered chief first, then ``worker:0``, ``worker:1``, ...).

:class:`CollectiveGroup` has the functions of :mod:`mirrored.collectives`
with job-wide meaning; :class:`CollectiveAllReduce` is the ``CrossDeviceOps``
that ``MultiWorkerMirroredStrategy`` routes every reduction through.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import numpy as np

from ..collective import api as collectives
from ..device import config
from .. import timeline
from ..device.dtypes import CODES, OPS, op_code
from .cross_device_ops import _NativeAllReduce, _buffers, get_devices_from
from .options import CommunicationOptions, _check_timeout, no_timeout

__all__ = ["CollectiveGroup", "CollectiveAllReduce", "job_token", "GLOO_MISSING"]

GLOO_MISSING = config.GLOO_NOT_BUILT
# How long workers wait for each other at start-up when CommunicationOptions sets no timeout.
DEFAULT_RENDEZVOUS_SECONDS = 300.0
# While waiting at start-up, progress is logged at INFO this often.
RENDEZVOUS_LOG_SECONDS = 5.0
_log = logging.getLogger("mirrored")
# A collective that waits longer than this for its peers logs a warning (MIRRORED_STALL_WARNING_SECONDS).
DEFAULT_STALL_WARNING_SECONDS = 60.0
# all_gather exchanges shapes as fixed-length records: ndim, dtype, then the padded shape.
_MAX_DIMS = 32


def net():
    """The ``_net`` extension, or a RuntimeError naming what is missing (see config.net_module)."""
    return config.net_module()


def job_token(cluster: dict) -> str:
    """The secret the store admits: ``MIRRORED_JOB_TOKEN`` if set, else a digest of the cluster.

    The digest keeps out tasks of other jobs and stray connections; set
    ``MIRRORED_JOB_TOKEN`` (the same on every task) to keep out anyone who
    could read the cluster's addresses.
    """
    token = os.environ.get("MIRRORED_JOB_TOKEN")
    if token:
        return token
    canonical = json.dumps(cluster, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class CollectiveGroup:
    """The processes of one job, joined: a store (served by task 0), a Gloo mesh, NCCL on demand.

    ``tasks`` names the participants in rank order (``"chief:0"``,
    ``"worker:0"``, ...) and ``addresses`` their ``host:port``; this process
    is ``rank``. Every participant must build its group at the same point of
    its program, with the same ``scope`` and the same number of
    ``local_replicas``. ``timeout`` (seconds or None) bounds every
    collective; start-up waits for ``timeout`` or DEFAULT_RENDEZVOUS_SECONDS.
    """

    def __init__(self, tasks, addresses, rank, local_replicas, *, token, timeout=None, scope="mirrored",
                 devices=None, implementation="AUTO"):
        _net = net()
        self.tasks = list(tasks)
        self.rank = rank
        self.num_workers = len(self.tasks)
        self.local_replicas = local_replicas
        self.num_replicas = local_replicas * self.num_workers
        self.devices = devices
        _check_timeout(timeout, CommunicationOptions.MAX_TIMEOUT_SECONDS)
        timeout = None if no_timeout(timeout) else float(timeout)
        self._timeout = timeout
        self._scope = scope
        self._device_engine = None
        self._implementation = getattr(implementation, "value", implementation)
        store_host, store_port = _host_port(addresses[0])
        my_host, _ = _host_port(addresses[rank])
        rendezvous = timeout if timeout is not None else DEFAULT_RENDEZVOUS_SECONDS
        self.store = _shared_store(store_host, store_port, token, rank, self.tasks, rendezvous, addresses[0])
        self._arrive(addresses, rendezvous)
        stall = stall_warning_seconds()
        self._gloo = _net.GlooCommunicator(self.store, self.tasks, local_replicas, my_host,
                                           0.0 if timeout is None else timeout, scope)
        self._gloo.set_stall_warning(stall)
        timeline.sync_clock(self.store, rank, self.tasks, rendezvous, scope)  # one clock for the job's timelines

    @classmethod
    def from_cluster_resolver(cls, resolver, local_replicas, *, timeout=None, scope="mirrored", devices=None,
                              implementation="AUTO"):
        """The group of the job ``resolver`` describes, joined from this task."""
        from .cluster_resolver import collective_tasks

        spec = resolver.cluster_spec()
        tasks = collective_tasks(spec)
        me = (resolver.task_type, resolver.task_id)
        if me[0] is None:
            raise ValueError(f"the cluster has {len(tasks)} chief/worker tasks but this process has no task: set "
                             "TF_CONFIG's \"task\" to {\"type\": ..., \"index\": ...} (or the resolver's task_type "
                             "and task_id)")
        if me not in tasks:
            raise ValueError(f"task {me[0]}:{me[1]} does not take part in collectives; MultiWorkerMirroredStrategy "
                             "runs on the chief and worker tasks (ps and evaluator tasks do not join)")
        collective = {job: spec.job_tasks(job) for job in ("chief", "worker") if job in spec.jobs}
        return cls([f"{t}:{i}" for t, i in tasks], [spec.task_address(t, i) for t, i in tasks], tasks.index(me),
                   local_replicas, token=job_token(collective), timeout=timeout, scope=scope, devices=devices,
                   implementation=implementation)

    def _arrive(self, addresses, total):
        """Waits (up to ``total`` s) until every task of the job has built this group, logging who is missing.

        In slices of a second: Ctrl-C lands, and progress is logged at INFO every RENDEZVOUS_LOG_SECONDS.
        """
        keys = [f"{self._scope}/arrived/{r}" for r in range(self.num_workers)]
        self.store.set(keys[self.rank], b"1")
        started = last_log = time.monotonic()
        while True:
            left = total - (time.monotonic() - started)
            missing = self.store.wait(keys, max(0.0, min(1.0, left)))
            waited = time.monotonic() - started
            if not missing:
                if waited >= RENDEZVOUS_LOG_SECONDS:
                    _log.info("rendezvous: all %d tasks arrived after %.0f s", self.num_workers, waited)
                return
            ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
            if waited >= total:
                raise net().PeerTimeoutError(
                    f"rendezvous: task(s) {', '.join(self.tasks[r] for r in ranks)} did not join within {total:.1f} s; "
                    "start every task of TF_CONFIG's cluster with MultiWorkerMirroredStrategy, or raise "
                    "CommunicationOptions.timeout_seconds")
            if time.monotonic() - last_log >= RENDEZVOUS_LOG_SECONDS:
                last_log = time.monotonic()
                _log.info("waiting for %s (%.0f s of %g s)",
                          ", ".join(f"{self.tasks[r]} at {addresses[r]}" for r in ranks), waited, total)

    def close(self) -> None:
        """Tears down NCCL and the Gloo mesh; the process's store connection stays for later groups."""
        self._device_engine = None
        if self._gloo is not None:
            self._gloo.close()
            self._gloo = None

    # -- the functions of mirrored.collectives, across the job ----------------

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto", _agreed=None):
        # _agreed: the op the workers compare, when it differs from `op` (an
        # integer MEAN runs as a SUM here, but another worker's SUM is still a mismatch).
        # In place on one array: checked natively, microseconds matter for small messages.
        if (out is buffers and type(buffers) is list and type(op) is str and type(algorithm) is str
                and _agreed is None and timeline._trace is None and self._gloo is not None):
            code, algo = OPS.get(op), collectives.ALGORITHMS.get(algorithm)
            if code is not None and algo is not None and self._gloo.all_reduce_in_place(buffers, code, algo):
                return list(buffers)
        if collectives.integer_mean(buffers, op):  # float64, as in one process (see mirrored.collectives)
            return collectives.true_divide(self.all_reduce(buffers, "sum", algorithm=algorithm, _agreed=op),
                                           self.num_replicas, out)
        if collectives._on_gpu(buffers):
            return self._device().all_reduce(buffers, op, out=out)
        arrays, code = collectives._inputs(buffers, "buffers")
        opc, algo = op_code(op), collectives._algorithm(algorithm)
        outs, finish = collectives._outputs(out, arrays, "out")
        with timeline.span("all_reduce[workers]", arrays[0].nbytes, algorithm, len(arrays), self.num_replicas):
            self._comm().all_reduce(arrays, outs, arrays[0].size, code, opc, algo,
                                    -1 if _agreed is None else op_code(_agreed))
        return finish()

    def broadcast(self, buffers, root=0, *, out=None):
        if collectives._on_gpu(buffers):
            return self._device().broadcast(buffers, root, out=out)
        arrays, code = collectives._inputs(buffers, "buffers")
        root = collectives._root(root, self.num_replicas)
        outs, finish = collectives._outputs(out, arrays, "out")
        with timeline.span("broadcast[workers]", arrays[0].nbytes, "gloo", len(arrays), self.num_replicas):
            self._comm().broadcast(arrays, outs, arrays[0].size, code, root)
        return finish()

    def reduce(self, buffers, op="sum", root=0, *, out=None, _agreed=None):
        """The job-wide reduction, returned on the worker that holds replica ``root`` (None elsewhere)."""
        if collectives.integer_mean(buffers, op):
            total = self.reduce(buffers, "sum", root, _agreed=op)
            if total is None:
                return None
            local_root = collectives._root(root, self.num_replicas) % self.local_replicas
            return collectives.true_divide([total], self.num_replicas,
                                           None if out is None else [out[local_root]])[0]
        if collectives._on_gpu(buffers):
            return self._device().reduce(buffers, op, root, out=out)
        arrays, code = collectives._inputs(buffers, "buffers")
        opc = op_code(op)
        root = collectives._root(root, self.num_replicas)
        local_root = root % self.local_replicas
        if out is None:
            target, finish = np.empty_like(arrays[local_root]), None
            targets = [target] * len(arrays)
        else:
            targets, finish = collectives._outputs(out, arrays, "out")
            target = targets[local_root]
        with timeline.span("reduce[workers]", arrays[0].nbytes, "gloo", len(arrays), self.num_replicas):
            self._comm().reduce(arrays, targets, arrays[0].size, code, opc, root,
                                -1 if _agreed is None else op_code(_agreed))
        if root // self.local_replicas != self.rank:
            return None
        return target if finish is None else finish()[local_root]

    def all_gather(self, buffers, axis=0):
        """Every local replica gets the concatenation along ``axis`` of all replicas of the job."""
        if collectives._on_gpu(buffers):
            return self._device().all_gather(buffers, axis)
        arrays, code = collectives._inputs(buffers, "buffers", same_shape=False)
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
        if collectives.any_integer_mean(tensors0, op):
            return collectives.means_of_sums(
                self.batch_all_reduce(per_replica_lists, "sum", bytes_per_pack=bytes_per_pack, num_packs=num_packs,
                                      algorithm=algorithm, _agreed=op), self.num_replicas)
        if collectives._on_gpu([tensors0[0]]):
            return self._device().batch_all_reduce(per_replica_lists, op, bytes_per_pack=bytes_per_pack,
                                                   num_packs=num_packs)
        if any(len(lst) != len(tensors0) for lst in per_replica_lists):
            raise ValueError("per_replica_lists: every replica must pass the same number of tensors")
        columns = [collectives._inputs([lst[t] for lst in per_replica_lists], f"per_replica_lists[*][{t}]")[0]
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
            from ..device import gpu as _gpu

            use_nccl = self._implementation != "RING" and (self._implementation == "NCCL" or _gpu.nccl_available())
            self._device_engine = _NcclJob(self) if use_nccl else _HostStaged(self)
            why = "implementation=RING" if self._implementation == "RING" else f"NCCL not installed: {_gpu.NCCL_FIX}"
            logging.getLogger("mirrored").info("GPU replicas across workers: %s",
                                               "NCCL" if use_nccl else f"host memory and Gloo ({why})")
        return self._device_engine


class CollectiveAllReduce(_NativeAllReduce):
    """All-reduce across every replica of every worker (``tf.distribute``'s collective ops).

    ``group``: the job's :class:`CollectiveGroup`; ``None`` reduces this
    process's replicas only (a one-worker job). ``num_packs`` /
    ``bytes_per_pack`` fuse a batch of tensors into few network messages.
    Every reduction returns on every worker, as in TensorFlow.
    """

    def __init__(self, group=None, num_packs: int = 1, bytes_per_pack: int = 0):
        super().__init__(num_packs, bytes_per_pack)
        if group is not None:
            self._collectives = group
            self._sees_all_replicas = group.num_workers == 1
        self.group = group

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        devices = get_devices_from(per_replica_value)
        if get_devices_from(destinations) == devices:
            return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]
        # An all-reduce, not a reduce to one root: every worker needs the value.
        reduced = self._collectives.all_reduce(_buffers(per_replica_value), reduce_op.value)[0]
        return self.broadcast(reduced, destinations)


class _NcclJob:
    """One NCCL communicator over every GPU of the job; local GPU ``i`` of worker ``w`` is rank ``w * n + i``.

    Task 0 draws NCCL's unique id and publishes it through the store. all_gather
    (sizes may differ per replica) and reduce go through host memory and Gloo.
    """

    def __init__(self, group):
        from ..collective import cuda as cc
        from ..device import gpu as _gpu

        key = f"{group._scope}/nccl-unique-id"
        if group.rank == 0:
            group.store.set(key, _gpu.nccl_unique_id())
        else:
            _gpu.load_nccl()
        wait = group._timeout if group._timeout is not None else DEFAULT_RENDEZVOUS_SECONDS
        if group.store.wait([key], wait):
            raise net().PeerTimeoutError(f"task {group.tasks[0]} did not publish NCCL's unique id within {wait} s")
        ordinals = [_gpu_ordinal(d) for d in group.devices]
        self._cc = cc
        self._staged = _HostStaged(group)
        self._engine = _gpu.cuda_module().nccl_rank(group.store.get(key), group.rank * group.local_replicas,
                                                    group.num_replicas, ordinals)
        self._replicas = group.num_replicas

    def all_reduce(self, buffers, op="sum", *, out=None, algorithm="auto"):
        cc = self._cc
        arrays, code, devices = cc._inputs(buffers, "buffers")
        outs, finish = cc._outputs(out, arrays, devices, "out")
        self._engine.all_reduce(cc._ptrs(arrays), cc._ptrs(outs), arrays[0].size, code, op_code(op), 0,
                                cc._streams(devices))
        return finish()

    def broadcast(self, buffers, root=0, *, out=None):
        cc = self._cc
        arrays, code, devices = cc._inputs(buffers, "buffers")
        root = collectives._root(root, self._replicas)
        outs, finish = cc._outputs(out, arrays, devices, "out")
        self._engine.broadcast(cc._ptrs(arrays), cc._ptrs(outs), arrays[0].size, code, root, cc._streams(devices))
        return finish()

    def batch_all_reduce(self, per_replica_lists, op="sum", *, bytes_per_pack=0, num_packs=None, algorithm="auto"):
        cc = self._cc
        columns = [cc._inputs([lst[t] for lst in per_replica_lists], f"per_replica_lists[*][{t}]")
                   for t in range(len(per_replica_lists[0]))]
        devices = columns[0][2]
        cupy = cc._cupy()
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
        from ..device import device_util

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
        from ..device import device_util

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
        from ..device import device_util

        host = [[device_util.to_host(t) for t in lst] for lst in per_replica_lists]
        reduced = self._group.batch_all_reduce(host, op, bytes_per_pack=bytes_per_pack, num_packs=num_packs)
        return [[device_util.place(r, d) for r in rs] for rs, d in zip(reduced, self._group.devices)]


def _into(out, results):
    if out is None:
        return results
    for o, r in zip(out, results):
        o[...] = r
    return list(out)


def _gpu_ordinal(device: str) -> int:
    from ..device import device_util

    return device_util._gpu_ordinal(device_util.parse(device))


# One store per job and process: task 0 serves it at its TF_CONFIG address (a
# second server could not bind there), and every group of the job, one per
# strategy, uses it under its own scope.
_stores: dict = {}


def _shared_store(host, port, token, rank, tasks, timeout, address):
    key = (host, port, token, rank, tuple(tasks))
    if key not in _stores:
        _net = net()
        # Binding exactly the configured address: nobody else can serve this job's store.
        server = _net.StoreServer(host, port, token, len(tasks), list(tasks)) if rank == 0 else None
        logged = [0.0]

        def on_wait(waited):  # about once a second while the store is unreachable
            if waited - logged[0] >= RENDEZVOUS_LOG_SECONDS:
                logged[0] = waited
                _log.info("waiting for %s at %s (%.0f s of %g s)", tasks[0], address, waited, timeout)

        try:
            client = _net.StoreClient(host, port, token, rank, tasks[0], timeout, on_wait)
        except BaseException:
            if server is not None:
                server.close()
            raise
        _stores[key] = (server, client)
    return _stores[key][1]


def _gather_call(row, shapes) -> str:
    """One worker's part of an all_gather, from its row of the shape table, for a mismatch error."""
    name = next((n for n, c in CODES.items() if c == row[1]), f"dtype code {row[1]}")
    listed = ", ".join(str(s) for s in shapes)
    return f"{name} buffers of shape {listed} gathered along axis {row[2]}"


def stall_warning_seconds() -> float:
    """``MIRRORED_STALL_WARNING_SECONDS`` (default 60; 0 turns stall warnings off)."""
    text = os.environ.get("MIRRORED_STALL_WARNING_SECONDS", "").strip()
    if not text:
        return DEFAULT_STALL_WARNING_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"MIRRORED_STALL_WARNING_SECONDS={text!r} must be a number of seconds >= 0 "
                         "(0 turns stall warnings off)")
    return value


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


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
