"""Collectives that span every replica of every worker of a multi-worker job.

A call is hierarchical: this process's replicas are combined natively first,
one buffer per process crosses the network (Gloo over TCP for host buffers,
NCCL for device buffers), and the result comes back to every local replica.
Replica ``g`` of the job is local replica ``g % n`` of worker ``g // n``
(workers ordered chief first, then ``worker:0``, ``worker:1``, ...).

:class:`CollectiveGroup` has the functions of :mod:`mirrored.collectives`
with job-wide meaning (their data path is
:class:`mirrored.collective.multi_worker.WorkerCollectives`); this module
joins the job. ``CollectiveAllReduce``, the ``CrossDeviceOps`` that
``MultiWorkerMirroredStrategy`` routes every reduction through, lives in
:mod:`mirrored.distribute.cross_device_ops`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from ..collective.multi_worker import DEFAULT_RENDEZVOUS_SECONDS, WorkerCollectives
from ..device import config
from ..timeline import sync_clock
from .cross_device_ops import CollectiveAllReduce
from .options import CommunicationOptions, _check_timeout, no_timeout

__all__ = ["CollectiveGroup", "CollectiveAllReduce", "job_token", "GLOO_MISSING"]

GLOO_MISSING = config.GLOO_NOT_BUILT
# While waiting at start-up, progress is logged at INFO this often.
RENDEZVOUS_LOG_SECONDS = 5.0
_log = logging.getLogger("mirrored")
# A collective that waits longer than this for its peers logs a warning (MIRRORED_STALL_WARNING_SECONDS).
DEFAULT_STALL_WARNING_SECONDS = 60.0


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


class CollectiveGroup(WorkerCollectives):
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
        self._device_engine = self._call_engine = None  # GPU replicas' engines, made on first use
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
        sync_clock(self.store, rank, self.tasks, rendezvous, scope)  # one clock for the job's timelines

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
        self._device_engine = self._call_engine = None
        if self._gloo is not None:
            self._gloo.close()
            self._gloo = None


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
