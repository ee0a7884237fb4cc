"""Who is in a multi-worker job and which task this process is (``tf.distribute.cluster_resolver``).

``TFConfigClusterResolver`` reads the ``TF_CONFIG`` environment variable,
the JSON that TensorFlow's launchers set on every task::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0}}

``SimpleClusterResolver`` takes the same facts as arguments, and
``SlurmClusterResolver`` reads them from the ``SLURM_*`` variables that
``srun`` sets. Without ``TF_CONFIG`` (or Slurm) the job is a single local
worker. Malformed input raises ``ValueError`` naming the field and the fix,
when the resolver is built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

__all__ = ["ClusterSpec", "ClusterResolver", "TFConfigClusterResolver", "SimpleClusterResolver",
           "SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

# Task types TensorFlow defines. chief and worker take part in collectives;
# ps and evaluator are accepted (and ignored by collectives).
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'


def _split_address(address, where: str) -> tuple[str, int]:
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"{where}: address {address!r} is not 'host:port'")
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [ipv6]:port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{where}: address {address!r} is not 'host:port' with a port in 1..65535")
    return host, int(port)


class ClusterSpec:
    """The tasks of a job: ``{task_type: [address, ...]}`` (or ``{task_type: {index: address}}``)."""

    def __init__(self, cluster=None):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if cluster is None:
            cluster = {}
        if not isinstance(cluster, dict):
            raise ValueError(f"cluster: expected a dict of task type -> list of 'host:port', got {cluster!r}")
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise ValueError(f"cluster: task type {job!r} must be a non-empty string")
            if isinstance(tasks, (list, tuple)):
                tasks = dict(enumerate(tasks))
            if not isinstance(tasks, dict):
                raise ValueError(f"cluster[{job!r}]: expected a list of 'host:port' addresses, got {tasks!r}")
            table = {}
            for index, address in tasks.items():
                try:
                    index = int(index)
                except (TypeError, ValueError):
                    raise ValueError(f"cluster[{job!r}]: task index {index!r} is not an integer") from None
                _split_address(address, f"cluster[{job!r}][{index}]")
                table[index] = address
            self._jobs[job] = dict(sorted(table.items()))

    @property
    def jobs(self) -> list[str]:
        """The job names in the order the cluster lists them (TensorFlow's order)."""
        return list(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        return list(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        tasks = self._job(job_name)
        if task_index not in tasks:
            raise ValueError(f"task_index={task_index!r}: job {job_name!r} has tasks {list(tasks)}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list:
        """Addresses by index; a gap in a sparse job is None."""
        tasks = self._job(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def as_dict(self) -> dict:
        """Lists for dense jobs, ``{index: address}`` for sparse ones (TensorFlow's shape)."""
        return {job: (list(t.values()) if list(t) == list(range(len(t))) else dict(t))
                for job, t in self._jobs.items()}

    def _job(self, job_name: str) -> dict[int, str]:
        if job_name not in self._jobs:
            raise ValueError(f"job_name={job_name!r} is not in the cluster; its jobs are {self.jobs}")
        return self._jobs[job_name]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _validate(spec: ClusterSpec, task_type, task_id, source: str) -> None:
    """The checks a multi-worker job relies on: known types, one chief, unique addresses, a task inside the cluster."""
    for job in spec.jobs:
        if job not in TASK_TYPES:
            raise ValueError(f"{source}: unknown task type {job!r} in cluster; use {', '.join(TASK_TYPES)}")
    if spec and "chief" in spec.jobs and spec.num_tasks("chief") != 1:
        raise ValueError(f"{source}: cluster['chief'] must list exactly one task, got {spec.num_tasks('chief')}")
    seen: dict[tuple[str, int], str] = {}
    for job in spec.jobs:
        for index in spec.task_indices(job):
            address = spec.task_address(job, index)
            key = _split_address(address, f"{source}: cluster[{job!r}][{index}]")
            if key in seen:
                raise ValueError(f"{source}: {job}:{index} and {seen[key]} share the address {address!r}; "
                                 "every task needs its own host:port")
            seen[key] = f"{job}:{index}"
    if task_type is None:
        return
    if task_type not in TASK_TYPES:
        raise ValueError(f"{source}: unknown task type {task_type!r}; use {', '.join(TASK_TYPES)}")
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ValueError(f"{source}: task index {task_id!r} must be an integer")
    # An evaluator may run outside the cluster, as in TensorFlow.
    if task_type == "evaluator" and "evaluator" not in spec.jobs:
        return
    if task_type not in spec.jobs:
        raise ValueError(f"{source}: task type {task_type!r} has no tasks in cluster {spec.as_dict()}")
    if task_id not in spec.task_indices(task_type):
        raise ValueError(f"{source}: task index {task_id} is out of range for {task_type!r}, "
                         f"which has tasks {spec.task_indices(task_type)}")


def collective_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    """The tasks that take part in collectives, in rank order: the chief, then the workers by index."""
    return [(job, i) for job in ("chief", "worker") if job in spec.jobs for i in spec.task_indices(job)]


class ClusterResolver:
    """Base class: ``cluster_spec()``, ``master()``, ``num_accelerators()``, task and rpc-layer properties."""

    def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=""):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    @property
    def task_type(self):
        return self._task_type

    @task_type.setter
    def task_type(self, value):
        self._task_type = value

    @property
    def task_id(self):
        return self._task_id

    @task_id.setter
    def task_id(self, value):
        self._task_id = value

    @property
    def rpc_layer(self):
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value):
        self._rpc_layer = value

    @property
    def environment(self) -> str:
        return self._environment

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """Address of a task (this one by default), prefixed with ``rpc_layer://`` when there is one."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        spec = self.cluster_spec()
        if task_type is None or not spec:
            return ""
        address = spec.task_address(task_type, task_id)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        """Accelerators of this machine, ``{"GPU": n}`` (empty without GPUs)."""
        from ..device import config

        n = len(config.list_physical_devices("GPU"))
        return {"GPU": n} if n else {}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(cluster={self.cluster_spec().as_dict()}, task_type={self.task_type!r}, "
                f"task_id={self.task_id!r})")


class TFConfigClusterResolver(ClusterResolver):
    """The job described by the ``TF_CONFIG`` environment variable (read once, when built)."""

    def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=None):
        raw = os.environ.get("TF_CONFIG", "").strip()
        config = self._parse(raw) if raw else {}
        task = config.get("task", {})
        self._spec = ClusterSpec(config.get("cluster", {}))
        super().__init__(
            task_type=task.get("type") if task_type is None else task_type,
            task_id=task.get("index") if task_id is None else task_id,
            rpc_layer=config.get("rpc_layer") if rpc_layer is None else rpc_layer,
            environment=config.get("environment", "") if environment is None else environment,
        )
        if self._task_type is not None and self._task_id is None:
            self._task_id = 0
        _validate(self._spec, self._task_type, self._task_id, "TF_CONFIG")

    @staticmethod
    def _parse(raw: str) -> dict:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"TF_CONFIG is not valid JSON ({e}); expected e.g. {_EXAMPLE}") from None
        if not isinstance(config, dict):
            raise ValueError(f"TF_CONFIG must be a JSON object, got {type(config).__name__}; expected e.g. {_EXAMPLE}")
        if not isinstance(config.get("cluster", {}), dict):
            raise ValueError(f"TF_CONFIG['cluster'] must be an object of task type -> addresses; e.g. {_EXAMPLE}")
        task = config.get("task", {})
        if not isinstance(task, dict):
            raise ValueError('TF_CONFIG[\'task\'] must be an object like {"type": "worker", "index": 0}')
        if task and "type" not in task:
            raise ValueError("TF_CONFIG['task'] has no 'type'; set it to chief, worker, ps or evaluator")
        if "index" in task:
            index = task["index"]
            if isinstance(index, str) and index.strip().isdigit():
                index = int(index)  # TensorFlow accepts "0" too
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"TF_CONFIG['task']['index']={task['index']!r} must be a non-negative integer")
            task["index"] = index
        return config

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


class SimpleClusterResolver(ClusterResolver):
    """A job given directly: a ``ClusterSpec`` (or dict) and this task's type and index."""

    def __init__(self, cluster_spec, master="", task_type=None, task_id=None, environment="",
                 num_accelerators=None, rpc_layer=None):
        super().__init__(task_type=task_type, task_id=task_id, rpc_layer=rpc_layer, environment=environment)
        self._spec = ClusterSpec(cluster_spec)
        self._master = master
        if num_accelerators is not None and not isinstance(num_accelerators, dict):
            raise TypeError(f"num_accelerators={num_accelerators!r}: expected a dict of accelerator type -> count "
                            "per task, e.g. {'GPU': 2}, or None")
        self._num_accelerators = num_accelerators
        if task_type is not None and task_id is None:
            self._task_id = 0
        _validate(self._spec, self._task_type, self._task_id, "SimpleClusterResolver")

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        if task_type is None and task_id is None and self._master:
            return self._master
        return super().master(task_type, task_id, rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)


# --- Slurm ---------------------------------------------------------------------

# More hosts (or tasks) than any cluster has: a list that expands beyond this is a typo, refused before expanding.
MAX_HOSTS = 1 << 16


def _decimal(text: str) -> int | None:
    """``text`` as a non-negative int when it is plain ASCII digits (``int()`` also takes ``"²"``-like digits)."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def expand_hostlist(hostlist: str, source: str = "hostlist") -> list[str]:
    """A Slurm host list as host names, in order, duplicates kept.

    ``"n[1-2],m5,o[3-4,6]"`` -> ``["n1", "n2", "m5", "o3", "o4", "o6"]``;
    zero padding is kept (``"gpu[08-10]"`` -> ``gpu08, gpu09, gpu10``) and
    several ranges multiply (``"r[1-2]n[1-2]"`` -> ``r1n1, r1n2, r2n1, r2n2``).
    A list of more than MAX_HOSTS names is refused before it is expanded;
    errors name ``source`` (e.g. the variable the list came from).
    """
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise ValueError(f"{source}={hostlist!r}: expected a Slurm host list like 'node[1-3,5],other'")
    parts, depth, start = [], 0, 0
    for i, c in enumerate(hostlist + ","):
        depth += (c == "[") - (c == "]")
        if depth not in (0, 1):
            raise ValueError(f"{source}={hostlist!r}: unbalanced brackets at character {i}")
        if c == "," and depth == 0:
            parts.append(hostlist[start:i].strip())
            start = i + 1
    if depth or not all(parts):
        raise ValueError(f"{source}={hostlist!r}: expected names or name[ranges] separated by commas, e.g. "
                         "'node[1-3,5],other'")
    # Each part: text and bracketed range lists, alternating; the number of names is checked before any is made.
    plans, total = [], 0
    for part in parts:
        pieces = [(m.group(1), None if m.group(2) is None else _parse_ranges(m.group(2), hostlist, source))
                  for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", part) if m.group(0)]
        count = 1
        for _, ranges in pieces:
            count *= 1 if ranges is None else sum(last - first + 1 for first, last, _ in ranges)
        total += count
        if total > MAX_HOSTS:
            raise ValueError(f"{source}={hostlist!r} names more than {MAX_HOSTS} hosts; check the ranges")
        plans.append(pieces)
    hosts: list[str] = []
    for pieces in plans:
        names = [""]
        for text, ranges in pieces:
            names = [n + text for n in names]
            if ranges is not None:
                names = [n + str(i).zfill(width) for n in names for first, last, width in ranges
                         for i in range(first, last + 1)]
        hosts.extend(names)
    return hosts


def _parse_ranges(ranges: str, hostlist: str, source: str) -> list[tuple[int, int, int]]:
    """``"08-10,3"`` -> ``[(8, 10, 2), (3, 3, 0)]``: first, last and zero-padded width of each range."""
    out = []
    for item in ranges.split(","):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item.strip())
        if m is None:
            raise ValueError(f"{source}={hostlist!r}: {item.strip()!r} in [{ranges}] is not a number or a range "
                             "like 3-5")
        first, last = m.group(1), m.group(2) or m.group(1)
        if int(last) < int(first):
            raise ValueError(f"{source}={hostlist!r}: range {item!r} runs backwards; write {last}-{first}")
        out.append((int(first), int(last), len(first) if first.startswith("0") else 0))  # node[08-10]: padding
    return out


def expand_tasks_per_node(tasks_per_node: str, source: str = "tasks_per_node") -> list[int]:
    """Slurm's tasks-per-node list as one count per node: ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``."""
    counts: list[int] = []
    for part in str(tasks_per_node).split(","):
        m = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
        if m is None:
            raise ValueError(f"{source}={tasks_per_node!r}: {part!r} is not 'N' or 'N(xK)', as in "
                             "SLURM_STEP_TASKS_PER_NODE='2(x3),1'")
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise ValueError(f"{source}={tasks_per_node!r} describes more than {MAX_HOSTS} nodes; check the "
                             "(xK) repeats")
        counts += [int(m.group(1))] * repeat
    return counts


def _slurm_var(name: str) -> str:
    key = "SLURM_" + name
    if key not in os.environ:
        raise RuntimeError(f"{key} is not set: SlurmClusterResolver runs inside a Slurm job step (start the "
                           "tasks with srun), or pass the job layout as arguments")
    return os.environ[key]


def _slurm_count(name: str, what: str) -> int:
    """A numeric SLURM_* variable, refused by name when it is not plain digits."""
    text = _slurm_var(name)
    value = _decimal(text)
    if value is None:
        raise RuntimeError(f"SLURM_{name}={text!r} is not {what} (plain digits, e.g. 0 or 4); is this a Slurm "
                           "job step?")
    return value


def in_slurm_step() -> bool:
    """Whether this process is a task of a Slurm job step (``srun``)."""
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def local_gpu_ids() -> list[str]:
    """This machine's visible GPUs, as CUDA_VISIBLE_DEVICES entries, without initialising CUDA.

    ``CUDA_VISIBLE_DEVICES`` when set (its entries), else the driver's
    ``/proc/driver/nvidia/gpus``, else ``nvidia-smi -L``; ``[]`` without GPUs.
    CUDA stays untouched, so a launcher can still set CUDA_VISIBLE_DEVICES
    for the processes it starts.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        count = 0
    if not count and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        count = sum(line.startswith("GPU ") for line in out.splitlines())
    return [str(i) for i in range(count)]


class SlurmClusterResolver(ClusterResolver):
    """The job of a Slurm step (``tf.distribute.cluster_resolver.SlurmClusterResolver``).

    Every task of ``srun -N 2 --ntasks-per-node 2 python train.py`` builds
    the same cluster from ``SLURM_STEP_NODELIST`` (``node[1-2]``) and
    ``SLURM_STEP_TASKS_PER_NODE`` (``2(x2)``) and finds itself by
    ``SLURM_PROCID``. Tasks fill the nodes in list order (Slurm's default
    block distribution); the ``i``-th task of a node listens on
    ``port_base + i``. ``jobs`` splits the tasks into task types, in sorted
    order of their names (``{"chief": 1, "worker": 3}``: task 0 is the chief);
    default: every task a ``worker``. With GPUs, each task gets
    ``gpus_per_task`` of its node's ``gpus_per_node`` GPUs, and
    ``auto_set_gpu`` makes only those visible (``CUDA_VISIBLE_DEVICES``).
    Arguments left out are read from the environment; a missing variable or
    an impossible layout raises ``RuntimeError``, as in TensorFlow.
    """

    def __init__(self, jobs=None, port_base=8888, gpus_per_node=None, gpus_per_task=None, tasks_per_node=None,
                 auto_set_gpu=True, rpc_layer="grpc"):
        super().__init__(rpc_layer=rpc_layer)
        self._rank = _slurm_count("PROCID", "a task number")
        if jobs is None:
            jobs = {"worker": _slurm_count("STEP_NUM_TASKS", "a number of tasks")}
        if not isinstance(jobs, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in jobs.items()):
            raise ValueError(f"jobs={jobs!r}: expected a dict of task type -> number of tasks, e.g. "
                             "{'chief': 1, 'worker': 3}")
        if isinstance(port_base, bool) or not isinstance(port_base, int) or not 0 < port_base < 65536:
            raise ValueError(f"port_base={port_base!r}: expected a port number in 1..65535")
        self._jobs = dict(sorted(jobs.items()))
        self._port_base = port_base
        if tasks_per_node is None:
            hosts = expand_hostlist(_slurm_var("STEP_NODELIST"), "SLURM_STEP_NODELIST")
            counts = expand_tasks_per_node(_slurm_var("STEP_TASKS_PER_NODE"), "SLURM_STEP_TASKS_PER_NODE")
            if len(counts) != len(hosts):
                raise RuntimeError(f"SLURM_STEP_TASKS_PER_NODE gives {len(counts)} node(s) but "
                                   f"SLURM_STEP_NODELIST lists {len(hosts)}")
            self._layout = list(zip(hosts, counts))
        elif isinstance(tasks_per_node, dict):
            self._layout = [(str(h), int(n)) for h, n in tasks_per_node.items()]
        else:
            self._layout = [(h, int(tasks_per_node))
                            for h in expand_hostlist(_slurm_var("STEP_NODELIST"), "SLURM_STEP_NODELIST")]
        num_tasks = sum(n for _, n in self._layout)
        most = max((n for _, n in self._layout), default=0)
        self._gpus_per_node = len(local_gpu_ids()) if gpus_per_node is None else int(gpus_per_node)
        self._gpus_per_task = (self._gpus_per_node // most if most else 0) if gpus_per_task is None \
            else int(gpus_per_task)
        self._auto_set_gpu = auto_set_gpu
        if most * self._gpus_per_task > self._gpus_per_node:
            raise RuntimeError(f"Requested more GPUs per node than available: {most} task(s) x gpus_per_task="
                               f"{self._gpus_per_task} > gpus_per_node={self._gpus_per_node}")
        if sum(self._jobs.values()) != num_tasks:
            raise RuntimeError(f"Requested {sum(self._jobs.values())} tasks (jobs={self._jobs}) but only "
                               f"{num_tasks} were assigned by Slurm")
        if not 0 <= self._rank < num_tasks:
            raise RuntimeError(f"SLURM_PROCID={self._rank} is outside this step's {num_tasks} task(s)")
        self._spec, self._gpu_allocation = self._resolve()
        _validate(self._spec, self._task_type, self._task_id, "SlurmClusterResolver")
        if self._auto_set_gpu and self._gpus_per_task:
            os.environ["CUDA_VISIBLE_DEVICES"] = self._gpu_allocation[self._rank]

    def _resolve(self):
        """The cluster, this task's type and index, and every task's GPU list."""
        addresses, gpus = [], []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        # GPUs already limited (e.g. by Slurm's gres) are numbered within that list.
        ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
            [str(i) for i in range(self._gpus_per_node)]
        for host, count in self._layout:
            for i in range(count):
                addresses.append(f"{host}:{self._port_base + i}")
                first = i * self._gpus_per_task
                gpus.append(",".join(ids[first:first + self._gpus_per_task]))
        cluster, start = {}, 0
        for task_type, count in self._jobs.items():
            cluster[task_type] = addresses[start:start + count]
            if start <= self._rank < start + count:
                self._task_type, self._task_id = task_type, self._rank - start
            start += count
        return ClusterSpec({k: v for k, v in cluster.items() if v}), gpus

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def get_task_info(self):
        """(task_type, task_id) of this process."""
        return self._task_type, self._task_id

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        return {"GPU": self._gpus_per_task}


def default_cluster_resolver() -> ClusterResolver:
    """What ``MultiWorkerMirroredStrategy()`` uses: ``TF_CONFIG`` when set, else a Slurm step's layout."""
    if not os.environ.get("TF_CONFIG", "").strip() and in_slurm_step():
        return SlurmClusterResolver()
    return TFConfigClusterResolver()
