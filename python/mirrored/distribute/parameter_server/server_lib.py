"""``md.distribute.Server``: a task of a ParameterServerStrategy job, serving requests on its cluster address.

Every server answers both kinds of request, as TF's servers do: a ps task's (create, read and update variables;
apply an optimizer's update to them) and a worker's (run a scheduled function; make a per-worker resource such
as a dataset iterator). Requests arrive over TCP (``rpc``), only from the job's tasks (the job token).
"""

from __future__ import annotations

import socket
import threading

import numpy as np

from ...errors import OutOfRangeError
from ..cluster_resolver import ClusterSpec
from ..collective_all_reduce import job_token
from ..distribute_lib import HOST
from ..._nest import map_structure
from ...device import device_util
from ...device.indexed_slices import IndexedSlices, map_arrays
from ..values import _ND_SCATTERS, _SCATTERS, DeviceVariable, DistributedValues
from . import rpc
from .strategy import ParameterServerStrategy
from .optimizer_state import attach, home_handle, iterations_id, slot_id
from .values import serving

__all__ = ["Server"]


def _cluster_spec(server_or_cluster_def) -> ClusterSpec:
    if isinstance(server_or_cluster_def, (ClusterSpec, dict)):
        return ClusterSpec(server_or_cluster_def)
    raise TypeError(f"server_or_cluster_def={server_or_cluster_def!r}: Could not convert `server_or_cluster_def` "
                    "to a cluster spec; pass an md.train.ClusterSpec or a dict such as {'ps': ['host0:2222'], "
                    "'worker': ['host1:2222']} (TF's ServerDef protocol buffers are not taken)")


def _task(spec: ClusterSpec, job_name, task_index) -> tuple:
    """``(job_name, task_index)`` as TF resolves them: each may be left out when the cluster leaves no choice."""
    if job_name is None:
        if len(spec.jobs) != 1:
            raise ValueError(f"Must specify an explicit `job_name`: the cluster has jobs {spec.jobs}, e.g. "
                             "md.distribute.Server(cluster, job_name='worker', task_index=0)")
        job_name = spec.jobs[0]
    if job_name not in spec.jobs:
        raise ValueError(f"job_name={job_name!r} is not in the cluster; its jobs are {spec.jobs}")
    if task_index is None:
        if spec.num_tasks(job_name) != 1:
            raise ValueError(f"Must specify an explicit `task_index`: job {job_name!r} has tasks "
                             f"{spec.task_indices(job_name)}")
        task_index = spec.task_indices(job_name)[0]
    if isinstance(task_index, bool) or not isinstance(task_index, int) or \
            task_index not in spec.task_indices(job_name):
        raise ValueError(f"task_index={task_index!r}: job {job_name!r} has tasks {spec.task_indices(job_name)}")
    return job_name, task_index


# What a variable's "update" and "gather" requests may call on it
_UPDATES = frozenset({"assign", "assign_add", "assign_sub", "batch_scatter_update"} | set(_SCATTERS)
                     | set(_ND_SCATTERS))
_GATHERS = frozenset({"sparse_read", "gather_nd"})


def _canonical(x):
    """An unpickled array viewed with NumPy's own instance of its dtype (pickle makes a new, equal one, which
    native code that compares dtypes by identity refuses); IndexedSlices' arrays likewise."""
    if type(x) is IndexedSlices:
        return map_arrays(_canonical, x)
    if isinstance(x, np.ndarray):
        dtype = np.dtype(x.dtype.type)
        if x.dtype is not dtype and x.dtype == dtype:
            return x.view(dtype)
    return x


def _on_host(result):
    """A scheduled function's result as it travels back: GPU arrays copied to the host, the replicas' values of
    a ``PerReplica``/``Mirrored`` each (the coordinator gets the same kind, of host values)."""
    def leaf(x):
        if isinstance(x, DistributedValues):
            return type(x)([_on_host(v) for v in x.values])
        if type(x) is IndexedSlices:
            return map_arrays(device_util.to_host, x)
        return device_util.to_host(x) if device_util.on_gpu(x) else x
    return map_structure(leaf, result)


class _ParameterStore:
    """A ps task's variables and the optimizers that update them (one copy per coordinator optimizer)."""

    def __init__(self, where: str, address: str, token: str):
        self._where, self._address, self._token = where, address, token
        self._variables: dict = {}
        self._optimizers: dict = {}
        self._lock = threading.Lock()  # one request at a time changes the variables: updates are atomic
        self._building = threading.Lock()  # (home task) builds, restores waiting for them, layouts
        self._layouts: dict = {}  # optimizer key -> its build units, in order
        self._stashed: dict = {}  # optimizer key -> a checkpoint's restore waiting for the build

    def _variable(self, var_id: str):
        try:
            return self._variables[var_id]
        except KeyError:
            raise LookupError(f"variable {var_id} is not on {self._where} (did the task restart? its variables "
                              "are lost then; restore them from a checkpoint)") from None

    def create(self, var_id, value, name, trainable, synchronization, aggregation) -> None:
        variable = DeviceVariable(_canonical(value), name, HOST, trainable, synchronization, aggregation)
        with self._lock:
            self._variables[var_id] = variable

    def read(self, var_ids) -> list:
        # The arrays themselves: an update meanwhile writes a new buffer (copy-on-write) while these are held.
        with self._lock:
            return [self._variable(i).read_value() for i in var_ids]

    def update(self, var_id, method: str, args) -> None:
        if method not in _UPDATES:
            raise ValueError(f"{method!r} is not an update of a variable")
        with self._lock:
            getattr(self._variable(var_id), method)(*map(_canonical, args))

    def gather(self, var_id, method: str, indices):
        if method not in _GATHERS:
            raise ValueError(f"{method!r} is not a read of a variable")
        with self._lock:
            return getattr(self._variable(var_id), method)(_canonical(indices))

    # -- an optimizer's state (optimizer_state.py): its copy here, slots beside the variables, registered as
    # variables themselves so that every task reads and assigns them through handles --
    def build_local(self, key: str, rule, var_ids) -> None:
        """Optimizer ``key``'s copy here (``rule`` when there is none yet) with the slots of ``var_ids``."""
        with self._lock:
            optimizer = self._optimizers.get(key)
            if optimizer is None:
                optimizer = self._optimizers[key] = rule._without_state()  # (rule itself may go on to others)
            variables = [self._variable(i) for i in var_ids]
            optimizer.build(variables)
            self._variables[iterations_id(key)] = optimizer._iterations
            for var_id, var in zip(var_ids, variables):
                for slot, value in optimizer._slots[id(var)][1].items():
                    self._variables[slot_id(key, var_id, slot)] = value

    def build(self, key: str, rule, units, name: str) -> None:
        """On the optimizer's home task: the state of ``units`` (build order) on their ps tasks, then what a
        restore left waiting for it (``stash``). One build at a time; the store's lock is not held meanwhile,
        since the restore assigns through requests (to this task too)."""
        with self._building:
            known = self._layouts.setdefault(key, [])
            new = [unit for unit in units if unit not in known]
            by_task: dict = {self._address: []}
            for handle in (h for unit in new for h in unit):
                by_task.setdefault(handle.address, []).append(handle.var_id)
            for address, var_ids in by_task.items():
                if address == self._address:
                    self.build_local(key, rule, var_ids)
                else:
                    rpc.pool(address, self._token).call("build_local", key, rule, var_ids)
            known += new
            restore = self._stashed.pop(key, None)
            if restore is not None and new:
                view = rule._without_state()
                view.name = name
                attach(view, known, [None] * len(known), home_handle(view, self._address, self._token), None)
                restore(view)

    def stash(self, key: str, restore) -> None:
        """A checkpoint's values for optimizer ``key``'s state not built yet: assigned at its build."""
        with self._building:
            self._stashed[key] = restore

    def layout(self, key: str):
        """The build units of optimizer ``key`` (build order), or None when it has no state here."""
        with self._building:
            units = self._layouts.get(key)
            return None if units is None else list(units)

    def loss_scale(self, counter_id: str, scale_id: str, finite: bool, growth_steps) -> np.float32:
        """A LossScaleOptimizer's step of its scale: returns the scale before it; with ``growth_steps`` (dynamic)
        the counter and scale move as Keras' (halved on a step not ``finite``, doubled after that many)."""
        with self._lock:
            counter, scale = self._variable(counter_id), self._variable(scale_id)
            used = np.float32(scale.numpy())
            if growth_steps is None:
                return used
            if not finite:
                counter.assign(np.int64(0))
                scale.assign(used * np.float32(0.5))
            elif int(counter.numpy()) == growth_steps - 1:
                counter.assign(np.int64(0))
                scale.assign(used * np.float32(2.0))
            else:
                counter.assign_add(np.int64(1))
            return used

    def apply(self, key: str, step, var_ids, grads) -> int:
        """Apply ``grads`` to ``var_ids`` with optimizer ``key``'s copy; ``step``: the step count to apply at
        (the home task's, None on the home task itself, which counts it). Returns the count after it."""
        with self._lock:
            optimizer = self._optimizers.get(key)
            if optimizer is None:
                raise LookupError(f"the optimizer's state is not on {self._where} (did the task restart? its "
                                  "variables and slots are lost then; restore them from a checkpoint)")
            iterations = optimizer._iterations
            if step is not None and int(iterations.numpy()) != step:
                iterations.assign(np.int64(step))
            if not var_ids:  # (the home task holds none of this update's variables: it counts the step only)
                iterations.assign_add(np.int64(1))
                return int(iterations.numpy())
            return optimizer.apply_gradients(zip(map(_canonical, grads), [self._variable(i) for i in var_ids]))


class Server:
    """A task of a cluster (``tf.distribute.Server``): listens on its address in the cluster spec.

    ``server_or_cluster_def``: an ``md.train.ClusterSpec`` or a dict of job name -> addresses;
    ``job_name`` / ``task_index`` may be left out when the cluster has one job / the job one task.
    ``protocol``: ``'grpc'`` (TF's name; the transport here is TCP, docs/parameter_server.md) or None.
    ``config`` is accepted and has no effect. A ps or worker task runs ``server.join()``.
    """

    def __init__(self, server_or_cluster_def, job_name=None, task_index=None, protocol=None, config=None,
                 start=True):
        if protocol not in (None, "grpc"):
            raise ValueError(f"protocol={protocol!r}: only 'grpc' (the default) is served; the transport is TCP")
        self._spec = _cluster_spec(server_or_cluster_def)
        self.job_name, self.task_index = _task(self._spec, job_name, task_index)
        self._address = self._spec.task_address(self.job_name, self.task_index)
        self._token = job_token(self._spec.as_dict())
        self._where = f"/job:{self.job_name}/replica:0/task:{self.task_index}"
        self._store = _ParameterStore(self._where, self._address, self._token)
        self._resources: dict = {}
        self._resources_lock = threading.Lock()
        self._strategy = None
        self._strategy_lock = threading.Lock()
        self._listener = None
        self._port = None
        self._stopped = threading.Event()
        if start:
            self.start()

    @staticmethod
    def create_local_server(config=None, start=True) -> "Server":
        """A one-task server on a free port of this machine (TF's ``Server.create_local_server``)."""
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        return Server({"localhost": [f"localhost:{port}"]}, protocol="grpc", config=config, start=start)

    @property
    def target(self) -> str:
        """``grpc://localhost:<port>`` (TF's spelling of this server's address)."""
        port = self._port if self._port is not None else self._address.rpartition(":")[2]
        return f"grpc://localhost:{port}"

    @property
    def server_def(self):
        """The cluster, job and task this server serves (a dict in place of TF's ServerDef)."""
        return {"cluster": self._spec.as_dict(), "job_name": self.job_name, "task_index": self.task_index,
                "protocol": "grpc"}

    def start(self) -> None:
        """Listen on the task's address (once; later calls do nothing)."""
        if self._listener is not None:
            return
        if self._stopped.is_set():
            raise RuntimeError(f"the server of {self._where} was stopped; create a new md.distribute.Server")
        host, _, port = self._address.rpartition(":")
        try:
            self._listener = rpc.Listener(host, int(port), self._token, self._handle, self._where,
                                          on_thread=self._serve_here)
        except OSError as e:
            raise OSError(e.errno, f"{self._where} cannot listen on {self._address}: {e.strerror}; another "
                                   "process may hold the port (pick a free one in the cluster spec)") from e
        self._port = self._listener.port

    def join(self) -> None:
        """Serve until this process ends (a ps or worker task's last call), as TF's ``join``."""
        if self._listener is None:
            self.start()
        while not self._stopped.wait(1.0):  # (a timed wait, so Ctrl-C interrupts it)
            pass

    def _stop(self) -> None:
        """Stop listening and drop the connections (in-process clusters of tests; TF's servers never stop)."""
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()

    # -- requests --
    def _serve_here(self) -> None:
        serving.server = self
        serving.dispatching = False

    def _worker_strategy(self) -> ParameterServerStrategy:
        with self._strategy_lock:
            if self._strategy is None:
                self._strategy = ParameterServerStrategy._on_worker(self._spec, self.task_index)
            return self._strategy

    def _resource(self, resource_id: str):
        with self._resources_lock:
            if resource_id not in self._resources:
                raise LookupError(f"{self._where} has no per-worker resource {resource_id} (the task restarted?); "
                                  "create it again with ClusterCoordinator.create_per_worker_dataset")
            return self._resources[resource_id]

    def _run(self, fn, args, kwargs):
        """A scheduled function, on this worker, in its strategy's scope (an md.function runs its Python)."""
        if self.job_name != "worker":
            raise RuntimeError(f"{self._where} is not a worker task; functions are scheduled on workers")
        fn = getattr(fn, "python_function", fn)
        serving.dispatching = True
        try:
            with self._worker_strategy().scope():
                return _on_host(fn(*args, **kwargs))
        except StopIteration as e:  # an iterator ran out: TF's OutOfRangeError, which join() re-raises
            raise OutOfRangeError(None, None, f"End of sequence{f': {e}' if str(e) else ''}") from None
        finally:
            serving.dispatching = False

    def _handle(self, method: str, args):
        if method == "read":
            return self._store.read(*args)
        if method == "update":
            return self._store.update(*args)
        if method == "gather":
            return self._store.gather(*args)
        if method in ("apply", "build", "build_local", "stash", "layout", "loss_scale"):
            return getattr(self._store, method)(*args)
        if method == "run":  # (fn, args, kwargs), sent pickled once by the coordinator
            return self._run(*args[0])
        if method == "make_resource":
            resource_id, (fn, fn_args) = args
            value = self._run(fn, fn_args, {})
            with self._resources_lock:
                self._resources[resource_id] = value
            return None
        if method == "drop_resource":
            with self._resources_lock:
                self._resources.pop(args[0], None)
            return None
        if method == "create":
            return self._store.create(*args)
        if method == "ping":
            return self._where
        if method == "num_gpus":  # (a worker's replicas: the coordinator's num_replicas_in_sync)
            return self._worker_strategy().extended._gpus
        if method == "stats":  # (what this task served: bench/parameter_server.py counts bytes per step)
            listener = self._listener
            return {"requests": listener.requests, "bytes_received": listener.bytes_received,
                    "bytes_sent": listener.bytes_sent}
        raise ValueError(f"{self._where} has no request {method!r}")
