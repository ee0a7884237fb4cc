"""``md.distribute.coordinator``: the ClusterCoordinator, which schedules functions on the workers of a
ParameterServerStrategy (``tf.distribute.coordinator`` / ``tf.distribute.experimental.coordinator``).

``schedule(fn, args, kwargs)`` queues a closure and returns a :class:`RemoteValue` at once. One thread per
worker takes the next closure from the queue when its worker is free and runs it there (one request: the
function, by reference, and its arguments, with that worker's part of each :class:`PerWorkerValues`); the
result comes back into the RemoteValue. As TF's: the first error of a scheduled function is raised by the next
``schedule``, ``join`` or ``done``, and the closures still queued then are cancelled (their values raise
``md.errors.CancelledError``). When a worker becomes unreachable, its closure goes back to the queue for another
worker, and the worker's per-worker resources are made again when it comes back (TF's fault tolerance). A ps
task that becomes unreachable (a function's request to it fails, or it misses the heartbeat) fails the job for
good, as TF's: its variables are gone, so every ``schedule``/``join``/``done`` from then on and the values of the
functions in flight raise :class:`PSUnavailableError` (TF's ``UnavailableError``), which says to restart the tasks
and restore a checkpoint; the queued functions are cancelled.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
import weakref

from ..._nest import flatten, map_structure
from ...errors import CancelledError, UnavailableError
from . import rpc
from .strategy import ParameterServerStrategy, PerWorkerInput
from .values import per_worker_here, resource_here, serving

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerValues", "PerWorkerValue",
           "experimental_get_current_worker_index", "PSUnavailableError"]

_logger = logging.getLogger("mirrored")
RECONNECT_SECONDS = 600.0  # how long a worker that became unreachable may take to come back (TF waits an hour)
# A worker that does not answer a heartbeat (a ping, on a connection of its own) within this many seconds is taken
# as hung: its closure goes to another worker. Generous, as a busy machine may be slow to answer; 0 turns the
# heartbeat off. The environment's MIRRORED_PS_HEARTBEAT_SECONDS wins; read when a ClusterCoordinator is created.
HEARTBEAT_SECONDS = 120.0


def _heartbeat_seconds() -> float:
    found = os.environ.get("MIRRORED_PS_HEARTBEAT_SECONDS")
    value = HEARTBEAT_SECONDS if found is None else found
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        where = "MIRRORED_PS_HEARTBEAT_SECONDS" if found is not None else \
            "md.distribute.coordinator.HEARTBEAT_SECONDS"
        raise ValueError(f"{where}={value!r}: expected the heartbeat's deadline in seconds, a number >= 0 (0 "
                         "turns the heartbeat off), e.g. 120")
    return seconds


class PSUnavailableError(UnavailableError):
    """A ps task is unavailable (TF's coordinator error of this name, an ``md.errors.UnavailableError``): its
    process died, its connection broke, or it missed the heartbeat. Its variables are lost, so the job cannot
    go on: restart the cluster's tasks and restore the variables from the last checkpoint."""

    def __init__(self, node_def, op, message, address: str = ""):
        super().__init__(node_def, op, message)
        self.address = address

    def __reduce__(self):
        return PSUnavailableError, (self.node_def, self.op, self.message, self.address)


def _ps_unavailable(task: int, address: str, cause) -> PSUnavailableError:
    return PSUnavailableError(
        None, None, f"/job:ps/replica:0/task:{task} (the ps task at {address}) is unavailable: {cause}. A parameter "
        "server that fails loses its variables, so this training cannot go on: restart the cluster's tasks (the ps "
        "tasks, the workers and this coordinator), restore the variables from the last checkpoint "
        "(md.train.Checkpoint(...).restore(md.train.latest_checkpoint(directory))) and schedule the steps again",
        address)


class RemoteValue:
    """The value of a scheduled function, which a worker computes (``tf.distribute.coordinator.RemoteValue``)."""

    def fetch(self):
        """Wait for the value and return it (NumPy arrays and Python values); raise the function's error."""
        raise NotImplementedError("Must be implemented in subclasses.")

    def get(self):
        """The same as ``fetch`` here: values come back to the coordinator as host arrays."""
        raise NotImplementedError("Must be implemented in subclasses.")


class _RemoteValueImpl(RemoteValue):
    def __init__(self):
        self._ready = threading.Event()
        self._values = None
        self._error = None

    # The first result stays: a value a ps failure failed while its function was in flight keeps that error.
    def _set_values(self, values) -> None:
        if not self._ready.is_set():
            self._values, self._error = values, None
            self._ready.set()

    def _set_error(self, error) -> None:
        if not self._ready.is_set():
            self._values, self._error = None, error
            self._ready.set()

    def _get_error(self):
        self._ready.wait()
        return self._error

    def fetch(self):
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._values

    get = fetch

    def __reduce__(self):
        raise ValueError("`md.distribute.coordinator.RemoteValue` used as an input to scheduled function is not "
                         "yet supported: fetch() it and pass the value")


class _PerWorkerResource(_RemoteValueImpl):
    """A worker's object made by a per-worker function (a dataset or iterator); it stays on the worker, and a
    scheduled function's argument that holds it is that object there."""

    def __init__(self, worker_index: int):
        super().__init__()
        self._id = uuid.uuid4().hex
        self._worker_index = worker_index

    def __reduce__(self):
        return resource_here, (self._id,)

    def fetch(self):
        raise ValueError("a per-worker resource (a dataset or iterator of create_per_worker_dataset) stays on its "
                         "worker; pass it to a scheduled function instead of fetching it")

    get = fetch


class PerWorkerValues:
    """One value per worker (``tf.distribute.coordinator.PerWorkerValue``): passed to ``schedule``, each
    worker's function gets its own."""

    def __init__(self, values):
        values = tuple(values)
        for v in values:
            if not isinstance(v, RemoteValue):
                raise AssertionError("`PerWorkerValues` should only take `RemoteValue`s.")
        self._values = values

    def __reduce__(self):  # (a scheduled function's argument: on each worker, its own)
        if not all(isinstance(v, _PerWorkerResource) for v in self._values):
            raise ValueError("a PerWorkerValues of scheduled functions' RemoteValues cannot be an input to a "
                             "scheduled function: fetch() them and pass the values")
        return per_worker_here, (tuple(v._id for v in self._values),)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._values)} workers)"


PerWorkerValue = PerWorkerValues  # (tf.distribute.coordinator's name)


class PerWorkerDistributedIterator(PerWorkerValues):
    """The iterators of a per-worker dataset, one on each worker; a scheduled function calls ``next`` on its
    worker's."""

    def __next__(self):
        return self.get_next()

    def get_next(self, name=None):
        raise NotImplementedError("Iterating over an `AsyncDistributedIterator` is not supported right now: pass "
                                  "it to a scheduled function, which calls next() on its worker's iterator")


class PerWorkerDataset:
    """``ClusterCoordinator.create_per_worker_dataset``'s value: a dataset made on every worker."""

    def __init__(self, source, coordinator):
        self._source = source
        self._coordinator = coordinator

    def __iter__(self) -> PerWorkerDistributedIterator:
        return PerWorkerDistributedIterator(
            self._coordinator._create_per_worker_resources(_make_iterator, (self._source,))._values)

    def build(self) -> PerWorkerValues:
        return self._coordinator._create_per_worker_resources(_make_dataset, (self._source,))


def _make_dataset(source):
    """On a worker: the dataset of ``create_per_worker_dataset``'s argument."""
    return source.build() if isinstance(source, PerWorkerInput) else source()


def _make_iterator(source):
    return iter(_make_dataset(source))


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the calling function (a scheduled function, or a ``dataset_fn`` of
    ``create_per_worker_dataset``); e.g. to shard the input by worker."""
    if not getattr(serving, "dispatching", False):
        raise RuntimeError("Cannot retrieve the worker index. `get_worker_idx_and_num_workers` should be called "
                           "from within a tf.function being executed on a worker. This method should only be "
                           "called from either a dataset_fn that is passed into "
                           "`ClusterCoordinator.create_per_worker_dataset`, or a tf.function that is passed into "
                           "`ClusterCoordinator.schedule`.")
    return serving.server.task_index


def _worker_error(error: BaseException, where: str) -> BaseException:
    """``error`` of a function run on ``where``, its message naming the worker (same type, same traceback)."""
    if len(error.args) == 1 and isinstance(error.args[0], str) and where not in error.args[0]:
        error.args = (f"{error.args[0]} (in the function scheduled on {where})",)
    else:
        error.add_note(f"(in the function scheduled on {where})")
    return error


class _Closure:
    """A function to run on a worker, its arguments (pickled once, here: what cannot be sent raises in
    ``schedule``), and the value that receives its result."""

    def __init__(self, fn, args, kwargs, output: _RemoteValueImpl, method: str = "run"):
        self.output, self._method = output, method
        leaves = flatten((args, kwargs))
        for leaf in leaves:
            _refuse_remote_value(leaf)
        # what lives on the workers: this worker's must have been made (its errors are the function's)
        self._per_worker = [x for x in leaves if isinstance(x, PerWorkerValues)]
        self._resources = [x for x in leaves if isinstance(x, _PerWorkerResource)]
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            self.payload = rpc.Pickled((fn, args, kwargs) if method == "run" else (fn, args),
                                       f"the arguments of {name}")
        except rpc.Unpicklable:
            rpc.dumps(fn, f"fn={name}")  # (the function itself, when it is what cannot be sent)
            raise

    def run_on(self, worker: "_Worker"):
        for value in self._resources + [v._values[worker.index] for v in self._per_worker]:
            error = value._get_error()  # (made on this worker before: its tagged closures go first)
            if error is not None:
                raise error
        if self._method == "run":
            return worker.call("run", self.payload)
        return worker.call("make_resource", self.output._id, self.payload)

    def cancel(self) -> None:
        self.output._set_error(CancelledError(None, None, "The corresponding function is cancelled (another "
                                              "scheduled function failed first). Please reschedule the function."))


class _ClosureQueue:
    """The closures waiting for a worker, and the first error of those that ran (TF's semantics)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._tagged: dict = collections.defaultdict(collections.deque)  # worker index -> its own closures
        self._inflight = 0
        self._error = None
        self._lost = None  # a ps task's failure: raised by every schedule, join and done from then on
        self._stopped = False

    def put(self, closure: _Closure, tag=None) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the ClusterCoordinator was stopped: it schedules nothing more; create the "
                                   "strategy and its coordinator again")
            if self._lost is not None:
                self._raise_if_error()
            (self._queue if tag is None else self._tagged[tag]).append(closure)
            self._changed.notify_all()
            if tag is None:
                self._raise_if_error()

    def get(self, tag):
        """The next closure for worker ``tag`` (its own first); None once stopped."""
        with self._lock:
            # After an error the queued closures wait to be cancelled (when it is raised): none starts.
            while not self._stopped and not self._tagged[tag] and (not self._queue or self._error is not None):
                self._changed.wait()
            if self._stopped:
                return None
            closure = self._tagged[tag].popleft() if self._tagged[tag] else self._queue.popleft()
            self._inflight += 1
            return closure

    def finished(self, error=None) -> None:
        with self._lock:
            self._inflight -= 1
            if error is not None and self._error is None:
                self._error = error
            self._changed.notify_all()

    def put_back(self, closure: _Closure) -> None:
        """A closure whose worker became unavailable: for another worker (or cancelled after an error)."""
        with self._lock:
            self._inflight -= 1
            if self._error is not None:
                closure.cancel()
            else:
                self._queue.appendleft(closure)
            self._changed.notify_all()

    def fail(self, error) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            self._changed.notify_all()

    def lose(self, error) -> None:
        """A ps task failed: nothing more runs, and every call raises ``error`` (the job must restart)."""
        with self._lock:
            if self._lost is None:
                self._lost = self._error = error
            self._changed.notify_all()

    def _raise_if_error(self) -> None:
        if self._lost is not None:  # (the in-flight closures are not waited for: they may hang on that task)
            for closure in self._queue:  # (TF's: cancelled, as after any error)
                closure.cancel()
            self._queue.clear()
            raise self._lost
        if self._error is None:
            return
        while self._inflight > 0:  # TF's: the in-flight closures finish, the queued ones are cancelled
            self._changed.wait()
        for closure in self._queue:
            closure.cancel()
        self._queue.clear()
        error, self._error = self._error, None
        raise error

    def wait(self) -> None:
        with self._lock:
            while self._error is None and (self._queue or self._inflight):
                self._changed.wait()
            self._raise_if_error()

    def done(self) -> bool:
        with self._lock:
            self._raise_if_error()
            return not self._queue and not self._inflight

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for closure in list(self._queue) + [c for q in self._tagged.values() for c in q]:
                closure.cancel()
            self._queue.clear()
            self._tagged.clear()
            self._changed.notify_all()


class _Worker:
    """The coordinator's side of one worker: a thread that runs closures there, one at a time."""

    def __init__(self, cluster: "_Cluster", index: int, address: str, token: str):
        self.index, self.address, self._token = index, address, token
        self.where = f"/job:worker/replica:0/task:{index}"
        self._cluster = cluster
        self._connection = None
        self._reached = False  # whether it answered once
        self.running = None  # the closure it runs now (a ps failure fails its value at once)
        self._resources: dict = {}  # resource id -> its (fn, args), pickled: made again when the worker comes back
        self.drops: collections.deque = collections.deque()  # ids of resources the coordinator let go of
        self._thread = threading.Thread(target=self._process, name=f"mirrored-coordinator-worker{index}",
                                        daemon=True)
        self._thread.start()
        if cluster.heartbeat_seconds:
            threading.Thread(target=self._watch, name=f"mirrored-coordinator-heartbeat{index}", daemon=True).start()

    def _watch(self) -> None:
        """The heartbeat: ping the worker (every quarter of the deadline, on a connection of its own, served on
        its own thread there) while a connection to it is open. A worker that does not answer within the
        deadline is hung (alive, its connections open, answering nothing): its connection is closed, which
        fails the closure it holds, rescheduled as when a worker's connection breaks."""
        deadline, stopping = self._cluster.heartbeat_seconds, self._cluster.stopping
        connection = None
        while not stopping.wait(deadline / 4):
            watched = self._connection
            if watched is None:
                continue
            try:
                if connection is None:
                    connection = rpc.Connection(self.address, self._token, timeout=0, cancel=stopping)
                connection.call("ping", timeout=deadline)
            except rpc.ReplyTimeout:
                connection = None  # (closed by the call)
                _logger.warning("worker %s did not answer a heartbeat within %g s: taken as hung", self.where,
                                deadline)
                watched.close()
            except rpc.TaskUnavailable:
                connection = None  # (gone: the closure's own request notices)
        if connection is not None:
            connection.close()

    def _connect(self) -> rpc.Connection:
        """A connection to the worker once it answers (restarted, or no longer hung: a hung worker accepts
        connections but answers nothing), trying for up to RECONNECT_SECONDS."""
        stopping = self._cluster.stopping
        give_up = time.monotonic() + RECONNECT_SECONDS
        while True:
            connection = rpc.Connection(self.address, self._token, timeout=max(give_up - time.monotonic(), 0.0),
                                        cancel=stopping)
            try:
                connection.call("ping", timeout=self._cluster.heartbeat_seconds or None)
                return connection
            except (rpc.ReplyTimeout, rpc.TaskUnavailable):  # (hung, or a dying process that still accepted)
                if stopping.wait(0.1) or time.monotonic() > give_up:
                    raise

    def call(self, method: str, *args):
        if self._connection is None:  # one attempt: a worker not there yet leaves its closure to the others
            self._connection = rpc.Connection(self.address, self._token, timeout=0, cancel=self._cluster.stopping)
            self._reached = True
        return self._connection.call(method, *args)

    def _process(self) -> None:
        queue = self._cluster.queue
        while True:
            closure = queue.get(self.index)
            if closure is None:
                return
            self._drop_released()
            if closure._method == "make_resource":
                self._resources[closure.output._id] = closure.payload
            self.running = closure
            try:
                closure.output._set_values(closure.run_on(self))
            except rpc.TaskUnavailable as e:
                if e.address in self._cluster.ps_addresses:  # (the function's request to a ps task failed)
                    self._failed(closure, self._cluster.lost_ps(e.address, e))
                elif e.address != self.address or self._cluster.stopping.is_set():
                    self._failed(closure, _worker_error(e, self.where))
                elif not self._recovered(closure, e):
                    return
            except BaseException as e:  # the function's error: for its value, and for join()
                self._failed(closure, _worker_error(e, self.where))
            else:
                queue.finished()
            self.running = closure = None  # (its arguments, e.g. an iterator of a past epoch, may go now)

    def _drop_released(self) -> None:
        """Tell the worker to let go of the resources (iterators of past epochs) nobody here holds any more."""
        while self.drops:
            resource_id = self.drops.popleft()
            if self._resources.pop(resource_id, None) is not None and self._connection is not None:
                try:
                    self._connection.call("drop_resource", resource_id)
                except rpc.TaskUnavailable:
                    pass  # (gone with the worker anyway)

    def _failed(self, closure: _Closure, error) -> None:
        closure.output._set_error(error)
        # A per-worker resource's error reaches the closures that use it (and join through them).
        self._cluster.queue.finished(None if closure._method == "make_resource" else error)

    def _recovered(self, closure: _Closure, error) -> bool:
        """The worker is unreachable: its closure goes to another worker, and this one waits for it to come
        back, then makes its per-worker resources again (a restarted worker has none). False: it did not."""
        if self._reached:  # (not a worker that has not started yet)
            _logger.warning("worker %s is unavailable (%s); its function is rescheduled", self.where, error)
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        making = closure._method == "make_resource"  # (this worker's own: it waits for the worker, in flight)
        if not making:
            self._cluster.queue.put_back(closure)
        try:
            self._connection = self._connect()
            self._reached = True
            for resource_id, payload in self._resources.items():  # (the one being made among them)
                self.call("make_resource", resource_id, payload)
        except BaseException as e:  # (gone for good, or its resources cannot be made again)
            _logger.error("worker %s did not come back: %s", self.where, e)
            if making:
                self._failed(closure, _worker_error(e, self.where))
            self._cluster.lost_worker(self, e)
            return False
        if making:
            closure.output._set_values(None)
            self._cluster.queue.finished()
        return True


class _Cluster:
    """The workers of a strategy's cluster and the queue they take closures from."""

    def __init__(self, strategy: ParameterServerStrategy):
        spec = strategy.extended._spec
        self.queue = _ClosureQueue()
        self.stopping = threading.Event()
        self.heartbeat_seconds = _heartbeat_seconds()
        self.ps_addresses = list(strategy.extended._ps_addresses)
        self._token = strategy.extended._token
        self.workers = [_Worker(self, i, spec.task_address("worker", i), self._token)
                        for i in spec.task_indices("worker")]
        if self.heartbeat_seconds:
            threading.Thread(target=self._watch_ps, name="mirrored-coordinator-ps-heartbeat", daemon=True).start()

    def _watch_ps(self) -> None:
        """The ps tasks' heartbeat: each ps task this process has reached (it holds variables) is pinged every
        quarter of the deadline, on a connection of its own; one that refuses, breaks the connection or does not
        answer within the deadline (a hung process) has failed (``lost_ps``). A dead task's connection breaks
        at once, and a function's request to it fails at once: the heartbeat is for the task that hangs."""
        deadline = self.heartbeat_seconds
        connections: dict = {}
        while not self.stopping.wait(deadline / 4) and self.queue._lost is None:
            for task, address in enumerate(self.ps_addresses):
                if not rpc.pool(address, self._token).reached:
                    continue  # (no variable there yet: the task may not have started)
                try:
                    if address not in connections:
                        connections[address] = rpc.Connection(address, self._token, timeout=0, cancel=self.stopping)
                    connections[address].call("ping", timeout=deadline)
                except rpc.ReplyTimeout:
                    connections.pop(address, None)
                    self.lost_ps(address, f"it did not answer a heartbeat within {deadline:g} s")
                except rpc.TaskUnavailable as e:
                    connections.pop(address, None)
                    if not self.stopping.is_set():
                        self.lost_ps(address, e)
        for connection in connections.values():
            connection.close()

    def lost_ps(self, address: str, cause) -> PSUnavailableError:
        """A ps task failed: the job fails for good (TF's), with the values of the functions still running."""
        error = _ps_unavailable(self.ps_addresses.index(address), address, cause)
        _logger.error("%s", error)
        self.queue.lose(error)
        for worker in self.workers:
            running = worker.running
            if running is not None:
                running.output._set_error(self.queue._lost)
        return self.queue._lost

    def lost_worker(self, worker: _Worker, error) -> None:
        """A worker that did not come back: join() and the next schedule raise it."""
        self.queue.fail(_worker_error(error, worker.where))

    def stop(self) -> None:
        self.stopping.set()
        self.queue.stop()
        for worker in self.workers:
            if worker._connection is not None:
                worker._connection.close()


class ClusterCoordinator:
    """Schedules functions on the workers of a ``ParameterServerStrategy`` (``tf.distribute.coordinator.
    ClusterCoordinator``); one per strategy (creating it again returns the same).

    A scheduled function travels to the worker by reference (module and name: define it at module level of a
    module every task imports) with its arguments by value, variables as handles to the ps tasks; with
    ``cloudpickle`` installed, lambdas and closures travel too. docs/parameter_server.md.
    """

    def __new__(cls, strategy):
        if getattr(strategy, "_cluster_coordinator", None) is None:
            coordinator = super().__new__(cls)
            if isinstance(strategy, ParameterServerStrategy):
                strategy._cluster_coordinator = coordinator
            return coordinator
        return strategy._cluster_coordinator

    def __init__(self, strategy):
        if getattr(self, "_has_initialized", False):
            return
        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError(f"strategy={strategy!r}: Only `md.distribute.experimental.ParameterServerStrategy` is "
                             "supported to work with `ClusterCoordinator` currently; create "
                             "ParameterServerStrategy(cluster_resolver) and pass it")
        self._strategy = strategy
        try:
            self._cluster = _Cluster(strategy)
        except BaseException:
            strategy._cluster_coordinator = None  # (not made: a later ClusterCoordinator(strategy) tries again)
            raise
        weakref.finalize(self, self._cluster.stop)  # (TF's: the workers' threads end with the coordinator)
        self._has_initialized = True

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    def schedule(self, fn, args=None, kwargs=None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for the next free worker; returns its RemoteValue at once.

        ``PerWorkerValues`` arguments (e.g. ``iter(per_worker_dataset)``) become that worker's value. Raises the
        error of an earlier scheduled function, if one failed since the last ``join``/``done``.
        """
        if not callable(fn):
            raise TypeError(f"fn={fn!r}: `ClusterCoordinator.schedule` only accepts a callable (a function, or an "
                            "md.function)")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        closure = _Closure(fn, args, kwargs, _RemoteValueImpl())
        self._cluster.queue.put(closure)
        return closure.output

    def join(self) -> None:
        """Wait until every scheduled function has run; raise the first error among them (and cancel the
        functions still queued then)."""
        self._cluster.queue.wait()

    def done(self) -> bool:
        """Whether every scheduled function has run (raises the first error, as ``join``)."""
        return self._cluster.queue.done()

    def fetch(self, val):
        """``val`` with every RemoteValue in it replaced by its fetched value (any nest)."""
        return map_structure(lambda x: x.fetch() if isinstance(x, RemoteValue) else x, val)

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """A dataset made on every worker by ``dataset_fn()`` (or a dataset of ``strategy.
        experimental_distribute_dataset`` / ``distribute_datasets_from_function``); ``iter()`` of it gives the
        per-worker iterators to pass to ``schedule``."""
        if not isinstance(dataset_fn, PerWorkerInput) and not callable(dataset_fn):
            raise ValueError(f"dataset_fn={dataset_fn!r}: expected a function that returns a dataset (called on "
                             "each worker), or strategy.experimental_distribute_dataset(dataset)")
        rpc.dumps(dataset_fn, "dataset_fn")
        return PerWorkerDataset(dataset_fn, self)

    def _create_per_worker_resources(self, fn, args=None, kwargs=None) -> PerWorkerValues:
        """``fn(*args)`` on every worker, kept there; its PerWorkerValues of handles."""
        values = []
        for worker in self._cluster.workers:
            resource = _PerWorkerResource(worker.index)
            # (a finalizer may run on any thread, inside any lock: it only appends, the worker's thread drops)
            weakref.finalize(resource, worker.drops.append, resource._id)
            self._cluster.queue.put(_Closure(fn, tuple(args or ()), {}, resource, method="make_resource"),
                                    tag=worker.index)
            values.append(resource)
        return PerWorkerValues(values)


def _refuse_remote_value(x) -> None:
    if isinstance(x, RemoteValue) and not isinstance(x, _PerWorkerResource):
        raise ValueError("`md.distribute.coordinator.RemoteValue` used as an input to scheduled function is not "
                         "yet supported: fetch() it first and pass the value")
