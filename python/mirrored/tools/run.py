"""``mirrored-run``: start every task of a multi-worker job, watch it, and restart it when a task dies.

    mirrored-run -np 4 python train.py                       # 4 workers on this machine
    mirrored-run -np 4 -H nodea:2,nodeb:2 python train.py    # 2 on each host, started over ssh
    mirrored-run -np 2 --max-restarts 3 python train.py      # survive up to 3 task failures
    mirrored-run --nnodes 2 --node-rank $I --master-addr n0 -np 4 python train.py   # per node (Slurm, k8s)

Each task gets its ``TF_CONFIG`` (``worker`` tasks, or a ``chief`` and
workers with ``--chief``), torchrun's ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, its GPUs in ``CUDA_VISIBLE_DEVICES``
(``--gpus-per-task K``; one GPU per local task by default when this machine
has GPUs) and the job's fresh ``MIRRORED_JOB_TOKEN``, so the rendezvous store
admits this job only. Every output line is prefixed with its task
(``[worker:1] ...``); ``--log-dir`` also writes one file per task. The first
task to fail ends the job: the others get SIGTERM, then SIGKILL after a
grace period, and the launcher exits with the failing task's code (128 + N
for a task killed by signal N). Ctrl-C is forwarded to every task.
``--max-restarts K`` restarts the whole job, with new ports and a new token,
up to K times; the script resumes from its last checkpoint
(``md.train.CheckpointManager``). A task that exits with
``RESTART_EXIT_CODE`` (42, ``PreemptionCheckpointHandler`` after a SIGTERM)
asks for a restart: the others get time to save and exit too, and the job
starts again without using up a ``--max-restarts`` restart.

Tasks die with the launcher, however they are wrapped (``bash -c``,
``env``, scripts): each runs in a session of its own, a reaper process ends
every task's group when the launcher's end of its pipe closes (the launcher
died, even by SIGKILL), and ``import mirrored`` in a task watches the
launcher's pipe too (``MIRRORED_LAUNCHER_FD``). ``python -m mirrored.run``
is the same program.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import math
import os
import re
import resource
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ..distribute.cluster_resolver import local_gpu_ids
from ..distribute.launcher_lifeline import LAUNCHER_FD_VARIABLE, launcher_fd_value
from ..distribute.preemption import RESTART_EXIT_CODE
from .node_rendezvous import RendezvousError, rendezvous

__all__ = ["main", "Task", "plan_job", "plan_node_job", "parse_hosts", "parse_hostfile", "assign_gpus"]

# Seconds between SIGTERM and SIGKILL when the job ends early.
GRACE_SECONDS = 5.0
# Seconds the other tasks get to save and exit after one exits with RESTART_EXIT_CODE (they agreed on a step).
PREEMPTION_GRACE_SECONDS = 60.0
# First port of a job with hosts whose free ports this machine cannot see (-H without --port).
DEFAULT_PORT = 12345
# torchrun's default --master-port.
DEFAULT_MASTER_PORT = 29500
# Default --start-timeout: ssh's connection set-up, and the per-node launchers' rendezvous.
DEFAULT_START_TIMEOUT = 120.0
# Variables that describe this shell or this login, not the job: not sent to remote hosts.
_NOT_FORWARDED = re.compile(r"^(HOSTNAME|PWD|OLDPWD|SHLVL|_|DISPLAY|XAUTHORITY|SSH_.*|BASH_FUNC_.*|LS_COLORS)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_POLL_SECONDS = 0.05
# Descriptors the launcher holds besides its tasks' (Python, the reaper, a Popen in progress, ...).
_SPARE_FDS = 64


@dataclass
class Task:
    """One process of the job: its TF_CONFIG identity, where it runs and its address."""

    task_type: str
    index: int
    host: str | None  # None: started on this machine; else the ssh destination
    address: str
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    elsewhere: bool = False  # started by another node's launcher (per-node mode): in the cluster only
    gpus: str | None = None  # its CUDA_VISIBLE_DEVICES (None: left as the launcher's)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    pumps: list = field(default_factory=list, repr=False)
    log: object = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"


def _slots(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and int(text) >= 1 else None


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` (or ``"a,b"``: one slot each) -> ``[("a", 2), ("b", 2)]``."""
    hosts = []
    for part in spec.split(","):
        part = part.strip()
        name, _, slots = part.rpartition(":") if ":" in part else (part, "", "1")
        if not name or _slots(slots) is None:
            raise ValueError(f"-H {spec!r}: {part!r} is not 'host' or 'host:slots' with slots >= 1; "
                             "write e.g. -H nodea:2,nodeb:2")
        hosts.append((name, _slots(slots)))
    return hosts


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """A horovodrun/mpirun host file: ``host slots=N`` or ``host:N`` or ``host`` per line, ``#`` comments."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--hostfile {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        words = text.split()
        m = re.fullmatch(r"([^\s:=]+)(?::(\S+))?", words[0])
        slots = _slots(m.group(2)) if m and m.group(2) is not None else 1
        options = {}
        for word in words[1:]:
            key, eq, value = word.partition("=")
            options[key.replace("-", "_")] = value if eq else None
        if "slots" in options:
            slots = _slots(options["slots"] or "") if m and m.group(2) is None else None
        if m is None or slots is None or not set(options) <= {"slots", "max_slots"}:
            raise ValueError(f"--hostfile {path}, line {number}: {line.strip()!r} is not 'host slots=N', "
                             "'host:N' or 'host' (slots >= 1)")
        hosts.append((m.group(1), slots))
    if not hosts:
        raise ValueError(f"--hostfile {path}: no hosts in it; write one 'host slots=N' per line")
    return hosts


def _local_names() -> set[str]:
    """Host names that mean this machine: tasks there start directly, not over ssh."""
    names = {"localhost", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


def _is_local(host: str, names: set[str]) -> bool:
    if host in names:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback  # 127.0.0.1, 127.0.1.1, ::1
    except ValueError:
        return False


def _reachable(local_host: str) -> str:
    """How the other hosts reach a task of this machine: its name, where it was given as localhost or loopback."""
    if local_host == "localhost" or _is_local(local_host, set()):
        return socket.gethostname()
    return local_host


def free_ports(k: int) -> list[int]:
    """k loopback ports that were free a moment ago (held open together so they differ)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _kinds(num_tasks: int, chief: bool) -> list[tuple[str, int]]:
    return [("chief", 0)] * bool(chief) + [("worker", i) for i in range(num_tasks - bool(chief))]


def _number_locally(tasks: list[Task], machine_of: list) -> list[Task]:
    """Ranks in order, and each task's rank among the tasks of its machine (torchrun's LOCAL_RANK)."""
    seen: dict = {}
    for rank, (t, machine) in enumerate(zip(tasks, machine_of)):
        t.rank, t.local_rank = rank, seen.get(machine, 0)
        seen[machine] = t.local_rank + 1
    for t, machine in zip(tasks, machine_of):
        t.local_world_size = seen[machine]
    return tasks


def plan_job(num_tasks: int, hosts=None, chief: bool = False, port=None, source: str = "-H") -> list[Task]:
    """The tasks of one run of the job, in rank order (the chief first).

    Without ``hosts`` every task runs here on 127.0.0.1, on free ports (or
    ``port``, ``port + 1``, ...). With ``hosts`` the tasks fill each host's
    slots in order; task ``r`` listens on ``port + r`` (default
    DEFAULT_PORT), since free ports of other machines cannot be seen from here.
    Names and addresses of this machine (``localhost``, its host name, a
    loopback address) run here, without ssh.
    """
    if hosts:
        slots = sum(n for _, n in hosts)
        if num_tasks > slots:
            raise ValueError(f"-np {num_tasks}: {source} gives {slots} slot(s); list more hosts or slots, or lower "
                             "-np")
        local = _local_names()
        placed = [name for name, n in hosts for _ in range(n)][:num_tasks]
        here = [_is_local(h, local) for h in placed]
        # Loopback when the whole job is here; else each task at its host's name as given (a local name: this
        # machine's name, which the other hosts must be able to resolve).
        addresses = ["127.0.0.1" if all(here) else _reachable(h) if is_here else h for h, is_here in zip(placed, here)]
        runs_on = [None if is_here else h for h, is_here in zip(placed, here)]
        if all(here) and port is None:
            ports = free_ports(num_tasks)
        else:
            ports = [(DEFAULT_PORT if port is None else port) + r for r in range(num_tasks)]
        machine_of = [None if is_here else h for h, is_here in zip(placed, here)]
    else:
        addresses, runs_on = ["127.0.0.1"] * num_tasks, [None] * num_tasks
        ports = free_ports(num_tasks) if port is None else [port + r for r in range(num_tasks)]
        machine_of = [None] * num_tasks
    tasks = [Task(t, i, h, f"{a}:{p}") for (t, i), h, a, p in zip(_kinds(num_tasks, chief), runs_on, addresses, ports)]
    return _number_locally(tasks, machine_of)


def plan_node_job(hosts: list[str], tasks_per_node: list[int], node_rank: int, chief: bool,
                  master_port: int) -> list[Task]:
    """Every task of a per-node job; this node's start here, the others' are ``elsewhere``.

    Nodes' tasks follow each other in node order; task ``r`` listens on
    ``master_port + 1 + r`` at its node's host (distinct even when every
    "node" is this machine, as in tests).
    """
    node_of = [n for n, count in enumerate(tasks_per_node) for _ in range(count)]
    tasks = [Task(t, i, None, f"{hosts[n]}:{master_port + 1 + r}", elsewhere=n != node_rank)
             for r, ((t, i), n) in enumerate(zip(_kinds(len(node_of), chief), node_of))]
    return _number_locally(tasks, node_of)


def assign_gpus(tasks: list[Task], gpus_per_task: int | None, gpu_ids: list[str]) -> None:
    """Sets each task's CUDA_VISIBLE_DEVICES: ``gpus_per_task`` GPUs of its machine, by local rank.

    ``gpu_ids``: this machine's GPUs (its CUDA_VISIBLE_DEVICES entries, or
    0..n-1). By default (None) each local task gets one GPU when there are
    GPUs (shared round-robin when there are more tasks than GPUs), and none
    is set without GPUs; 0 leaves CUDA_VISIBLE_DEVICES alone. Hosts reached
    over ssh are numbered from GPU 0 and only with an explicit count.
    """
    for t in tasks:
        if t.elsewhere or gpus_per_task == 0:
            continue
        if t.host is not None:
            if gpus_per_task:
                first = t.local_rank * gpus_per_task
                t.gpus = ",".join(str(g) for g in range(first, first + gpus_per_task))
            continue
        if gpus_per_task is None:
            t.gpus = gpu_ids[t.local_rank % len(gpu_ids)] if gpu_ids else None
            continue
        if t.local_world_size * gpus_per_task > len(gpu_ids):
            raise ValueError(f"--gpus-per-task {gpus_per_task}: {t.local_world_size} task(s) on this machine need "
                             f"{t.local_world_size * gpus_per_task} GPU(s) but it has {len(gpu_ids)}"
                             f"{' (' + ','.join(gpu_ids) + ')' if gpu_ids else ''}; lower --gpus-per-task or -np")
        first = t.local_rank * gpus_per_task
        t.gpus = ",".join(gpu_ids[first:first + gpus_per_task])


def cluster_of(tasks: list[Task]) -> dict:
    cluster: dict = {}
    for t in tasks:
        cluster.setdefault(t.task_type, []).append(t.address)
    return cluster


class _Output:
    """Copies each task's output to ours, a whole line at a time, prefixed with the task's name (and to its log)."""

    def __init__(self):
        self._lock = threading.Lock()

    def pump(self, stream, target, prefix: bytes, log=None) -> threading.Thread:
        def copy():
            with stream:
                for line in iter(stream.readline, b""):
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    with self._lock:  # one lock for stdout, stderr and logs: lines never mix
                        for out, text in ((target, prefix + line), (log, line)):
                            if out is None:
                                continue
                            try:
                                out.write(text)
                                out.flush()
                            except (OSError, ValueError):
                                pass  # that output is gone (e.g. `| head`): keep draining, or the task blocks

        thread = threading.Thread(target=copy, daemon=True)
        thread.start()
        return thread


def _find_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    except (OSError, AttributeError):
        return None  # not Linux: tasks still end through the launcher's signals


_prctl = _find_prctl()


# The reaper: a process of its own that outlives a killed launcher. It reads
# "+PGID" / "-PGID" lines (a task's group started / ended) until the
# launcher's end of the pipe closes, then ends every group still listed:
# SIGTERM, then SIGKILL after the grace period.
_REAPER = """
import os, signal, sys, time
groups = set()
for line in sys.stdin:
    (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
def alive(group):
    try:
        os.killpg(group, 0)
        return True
    except OSError:
        return False
for sig in (signal.SIGTERM, signal.SIGKILL):
    for group in groups:
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    deadline = time.monotonic() + float(sys.argv[1])
    while sig == signal.SIGTERM and any(map(alive, groups)) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


class _Lifeline:
    """What ends the tasks when the launcher dies: the reaper, and the pipe each task can watch."""

    def __init__(self):
        self.read_fd, self._write_fd = os.pipe()  # the launcher alone holds the write end
        self.value = launcher_fd_value(self.read_fd)
        self._reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(GRACE_SECONDS)],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)  # Ctrl-C on the terminal does not reach it

    def _tell(self, line: str) -> None:
        try:
            self._reaper.stdin.write(line.encode())
            self._reaper.stdin.flush()
        except (OSError, ValueError):
            pass

    def in_new_task(self) -> None:
        """Run by a new task between fork and exec, in its own session (pid == pgid): SIGKILL when the launcher
        dies, even by SIGKILL (the direct child), and its group listed with the reaper (the rest). The task
        lists itself before it can start anything: had the launcher listed it after Popen returned, a launcher
        killed in between (a busy machine can stall it that long) left the task's children to nobody."""
        if _prctl is not None:
            _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # One write of a few bytes to a pipe is atomic: it never splits a line of the launcher's, whose
        # buffered writer is flushed after each line (empty at the fork).
        os.write(self._reaper.stdin.fileno(), b"+%d\n" % os.getpid())

    def release(self, pid: int) -> None:
        self._tell(f"-{pid}\n")

    def close(self) -> None:
        try:
            self._reaper.stdin.close()
        except OSError:
            pass
        self._reaper.wait()
        os.close(self.read_fd)
        os.close(self._write_fd)


def _say(message: str) -> None:
    sys.stderr.write(f"[mirrored-run] {message}\n")
    sys.stderr.flush()


def _exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def _remote_command(cwd: str, env: dict, command: list[str]) -> str:
    """The shell script that runs ``command`` on a remote host, ended by the launcher through ssh's stdin.

    The launcher writes a signal name per line (INT, TERM, KILL); a watcher
    sends it to the remote process group (the task and its children; ssh
    starts each session in a group of its own). End of input (the launcher
    or its connection died) ends the task: SIGTERM, then SIGKILL after the
    grace period, so no task outlives its launcher. The task runs in the
    foreground: a background job would start with SIGINT ignored.
    """
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    task = " ".join(shlex.quote(a) for a in command)
    script = (
        f"cd {shlex.quote(cwd)} || exit 1\n"
        # Caught, not ignored: the shell outlives the signals it forwards, the task gets the default action.
        "trap : INT TERM HUP\n"
        "exec 3<&0\n"
        "( trap '' INT TERM HUP\n"
        "  while read -r sig; do kill -s \"$sig\" 0; done\n"
        f"  kill -s TERM 0; sleep {GRACE_SECONDS:g}; kill -s KILL 0 ) <&3 >/dev/null 2>&1 &\n"
        "watcher=$!\n"
        f"env -- {assignments} {task} </dev/null 3<&-\n"
        "code=$?\n"
        "kill \"$watcher\" 2>/dev/null\n"
        "exit \"$code\"\n")
    return f"sh -c {shlex.quote(script)}"


@dataclass
class _Settings:
    """How tasks start: the command, the environment shared by all, ssh options, logs, the lifeline."""

    command: list[str]
    env: dict
    ssh_options: list[str]
    log_dir: str | None
    lifeline: _Lifeline


def _task_env(settings: _Settings, tasks: list[Task], t: Task) -> dict:
    env = dict(settings.env)
    env["TF_CONFIG"] = json.dumps({"cluster": cluster_of(tasks), "task": {"type": t.task_type, "index": t.index}})
    env.update(RANK=str(t.rank), LOCAL_RANK=str(t.local_rank), WORLD_SIZE=str(len(tasks)),
               LOCAL_WORLD_SIZE=str(t.local_world_size))
    if t.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = t.gpus
    return env


class _Job:
    """One run of the job: starts the tasks, copies their output, ends them all when one fails."""

    def __init__(self, tasks: list[Task], settings: _Settings, output: _Output, attempt: int):
        self.cluster = tasks
        self.tasks = [t for t in tasks if not t.elsewhere]
        self.settings = settings
        self.output = output
        self.attempt = attempt

    def start(self) -> None:
        s = self.settings
        cwd = os.getcwd()
        for t in self.tasks:
            env = _task_env(s, self.cluster, t)
            if s.log_dir is not None:
                t.log = open(os.path.join(s.log_dir, f"{t.task_type}-{t.index}.log"), "ab")
                if self.attempt:
                    t.log.write(f"[mirrored-run] restart {self.attempt}\n".encode())
            if t.host is None:
                env[LAUNCHER_FD_VARIABLE] = s.lifeline.value
                t.proc = subprocess.Popen(s.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          pass_fds=(s.lifeline.read_fd,), preexec_fn=s.lifeline.in_new_task)
            else:
                forwarded = {k: v for k, v in env.items() if _ENV_NAME.match(k) and not _NOT_FORWARDED.match(k)}
                t.proc = subprocess.Popen(["ssh", *s.ssh_options, t.host, _remote_command(cwd, forwarded, s.command)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, preexec_fn=s.lifeline.in_new_task)
            prefix = f"[{t.name}] ".encode()
            t.pumps = [self.output.pump(t.proc.stdout, sys.stdout.buffer, prefix, t.log),
                       self.output.pump(t.proc.stderr, sys.stderr.buffer, prefix, t.log)]

    def running(self) -> list[Task]:
        return [t for t in self.tasks if t.proc is not None and t.proc.poll() is None]

    def send(self, signum: int, tasks=None) -> None:
        for t in tasks if tasks is not None else self.running():
            try:
                if t.host is None:
                    os.killpg(t.proc.pid, signum)  # the task's own children too
                else:
                    t.proc.stdin.write(f"{signal.Signals(signum).name[3:]}\n".encode())
                    t.proc.stdin.flush()
            except (ProcessLookupError, BrokenPipeError, OSError):
                pass  # it is exiting already

    def wait(self, seconds: float, urgent=lambda: False) -> None:
        """Until every task ended, ``seconds`` passed or ``urgent()``."""
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline and not urgent():
            time.sleep(_POLL_SECONDS)

    def stop(self, signum: int = signal.SIGTERM, urgent=lambda: False) -> None:
        """Sends ``signum`` to every running task, then SIGKILL to those left after the grace period."""
        self.send(signum)
        self.wait(GRACE_SECONDS, urgent)
        for t in self.running():
            if t.host is not None:
                self.send(signal.SIGKILL, [t])
            try:
                os.killpg(t.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for t in self.tasks:
            if t.proc is not None:
                t.proc.wait()

    def finish(self) -> None:
        """Waits (briefly) for the last output: a task's leftover child may hold its pipes open."""
        deadline = time.monotonic() + 2.0
        for t in self.tasks:
            if t.proc is not None and t.proc.stdin is not None:
                try:
                    t.proc.stdin.close()
                except OSError:
                    pass
            for pump in t.pumps:
                pump.join(max(0.0, deadline - time.monotonic()))
            if t.proc is not None and t.proc.poll() is not None:
                self.settings.lifeline.release(t.proc.pid)
            if t.log is not None:
                with self.output._lock:
                    t.log.close()


class _Signals:
    """SIGINT / SIGTERM / SIGHUP to the launcher, recorded for the main loop to forward."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: list[int] = []
        self._previous = {}

    def __enter__(self):
        for s in self.HANDLED:
            self._previous[s] = signal.signal(s, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _too_many_files(num_tasks: int) -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"-np {num_tasks}: the launcher needs about {_fds_needed(num_tasks)} open files for {num_tasks} "
            f"local task(s), and the limit is {soft} (ulimit -n); raise it (e.g. ulimit -n "
            f"{_fds_needed(num_tasks) * 2}) or start fewer tasks per launcher (--nnodes, -H)")


def _fds_needed(num_tasks: int) -> int:
    return 4 * num_tasks + _SPARE_FDS  # per task: its stdout and stderr pipes, its log file, ssh's stdin


def _enough_files(num_tasks: int) -> bool:
    """Raises the soft open-file limit toward the hard one when the job needs it; False if it cannot."""
    need = _fds_needed(num_tasks)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return True
    if hard != resource.RLIM_INFINITY and hard < need:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (ValueError, OSError):
        return False
    return True


def _run_once(tasks, settings, output, signals, attempt) -> tuple[int, Task | None]:
    """Runs the job until every task ended or one failed; returns (exit code, the failed task or None)."""
    job = _Job(tasks, settings, output, attempt)
    if logging.getLogger("mirrored").isEnabledFor(logging.INFO):  # MIRRORED_LOG_LEVEL=INFO
        _say(f"starting {len(job.tasks)} task(s): " +
             ", ".join(f"{t.name} at {t.address}" + (f" (ssh {t.host})" if t.host else "") for t in job.tasks))
    try:
        try:
            job.start()
        except OSError as e:
            job.stop()
            if e.errno in (errno.EMFILE, errno.ENFILE):
                _say(_too_many_files(len(job.tasks)))
            else:
                _say(f"cannot start {e.filename or settings.command[0]!r}: {e.strerror or e}")  # the command, or ssh
            return 127, None
        while True:
            if signals.received:
                signum = signals.received[0]
                _say(f"{signal.Signals(signum).name}: ending {len(job.running())} task(s)")
                job.stop(signum, urgent=lambda: len(signals.received) > 1)  # a second Ctrl-C: SIGKILL now
                return 128 + signum, None
            failed = next((t for t in job.tasks if t.proc.poll() not in (None, 0)), None)
            if failed is not None:
                code = _exit_code(failed.proc.returncode)
                others = job.running()
                if code == RESTART_EXIT_CODE and others:
                    # Preempted: the others saved at the same step and are exiting too; cutting them short
                    # could lose that checkpoint.
                    _say(f"{failed.name} exited with code {code} (restart); waiting up to "
                         f"{PREEMPTION_GRACE_SECONDS:g} s for {', '.join(t.name for t in others)}")
                    job.wait(PREEMPTION_GRACE_SECONDS, urgent=lambda: bool(signals.received))
                    others = job.running()
                _say(f"{failed.name} exited with code {code}" +
                     (f"; ending {', '.join(t.name for t in others)}" if others else ""))
                job.stop()
                return code, failed
            if not job.running():
                return 0, None
            time.sleep(_POLL_SECONDS)
    finally:
        job.finish()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mirrored-run",
        description="Start a multi-worker job: one process per task, each with its TF_CONFIG.",
        epilog="Example: mirrored-run -np 2 python train.py")
    p.add_argument("-np", "--num-proc", "--nproc-per-node", dest="np", type=int, required=True, metavar="N",
                   help="number of tasks (processes) in the job; with --nnodes, on this node")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                       help="hosts and their task slots, e.g. nodea:2,nodeb:2; tasks on hosts other than this "
                            "machine are started over ssh (default: every task on this machine)")
    where.add_argument("--hostfile", default=None, metavar="FILE",
                       help="hosts and slots, one per line: 'host slots=N' or 'host:N' (# comments)")
    p.add_argument("--chief", action="store_true", help="make task 0 a 'chief' task and the rest workers")
    p.add_argument("--port", type=int, default=None, metavar="BASE",
                   help=f"task r listens on BASE + r (default: free ports here; {DEFAULT_PORT} with -H)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the whole job up to K times when a task fails (default 0)")
    p.add_argument("--timeline", default=None, metavar="FILE",
                   help="record every task's timeline (sets MIRRORED_TIMELINE=FILE for each task)")
    p.add_argument("--gpus-per-task", type=int, default=None, metavar="K",
                   help="GPUs each task sees (CUDA_VISIBLE_DEVICES, by local rank); default: one per local task "
                        "when this machine has GPUs; 0: leave CUDA_VISIBLE_DEVICES alone")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="also write each task's output to DIR/<task>-<index>.log")
    p.add_argument("--ssh-port", type=int, default=None, metavar="PORT", help="ssh port of the hosts")
    p.add_argument("--ssh-identity-file", default=None, metavar="FILE", help="ssh private key for the hosts")
    p.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT, metavar="SECONDS",
                   help=f"time to reach every host over ssh, or for every node to join (--nnodes); default "
                        f"{DEFAULT_START_TIMEOUT:g}")
    node = p.add_argument_group("per-node mode (torchrun's; one launcher per node, e.g. under Slurm or Kubernetes)")
    node.add_argument("--nnodes", type=int, default=None, metavar="N", help="number of nodes, each running a launcher")
    node.add_argument("--node-rank", type=int, default=None, metavar="I", help="this node's index, 0..N-1")
    node.add_argument("--master-addr", default=None, metavar="HOST",
                      help="node 0's address, reachable from every node (default 127.0.0.1)")
    node.add_argument("--master-port", type=int, default=None, metavar="PORT",
                      help=f"node 0's port for the launchers' rendezvous; task r listens on PORT + 1 + r "
                           f"(default {DEFAULT_MASTER_PORT})")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program every task runs, e.g. python train.py")
    return p


def _check(parser, args) -> None:
    """Every argument error, before anything starts."""
    if args.np < 1:
        parser.error(f"-np {args.np}: a job needs at least 1 task")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: use 0 (no restarts) or more")
    if args.port is not None and not 0 < args.port <= 65536 - args.np:
        parser.error(f"--port {args.port}: tasks listen on BASE..BASE+{args.np - 1}; pick BASE in "
                     f"1..{65536 - args.np}")
    if args.gpus_per_task is not None and args.gpus_per_task < 0:
        parser.error(f"--gpus-per-task {args.gpus_per_task}: use 0 (leave CUDA_VISIBLE_DEVICES alone) or more")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port {args.ssh_port}: use a port in 1..65535")
    if args.ssh_identity_file is not None and not os.path.isfile(args.ssh_identity_file):
        parser.error(f"--ssh-identity-file {args.ssh_identity_file}: no such file")
    if not (args.start_timeout > 0 and math.isfinite(args.start_timeout)):
        parser.error(f"--start-timeout {args.start_timeout:g}: use a number of seconds > 0")
    if args.log_dir is not None:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as e:
            parser.error(f"--log-dir {args.log_dir}: cannot create it ({e.strerror or e})")
        if not os.access(args.log_dir, os.W_OK | os.X_OK):
            parser.error(f"--log-dir {args.log_dir}: not writable")
    per_node = [f"--{n.replace('_', '-')}" for n in ("node_rank", "master_addr", "master_port")
                if getattr(args, n) is not None]
    if args.nnodes is None:
        if per_node:
            parser.error(f"{', '.join(per_node)} need --nnodes (per-node mode): e.g. --nnodes 2 --node-rank 0 "
                         "--master-addr HOST")
        return
    if args.nnodes < 1:
        parser.error(f"--nnodes {args.nnodes}: a job needs at least 1 node")
    if args.node_rank is None and args.nnodes > 1:
        parser.error(f"--nnodes {args.nnodes} needs --node-rank (this node's index, 0..{args.nnodes - 1})")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank}: --nnodes {args.nnodes} numbers the nodes 0..{args.nnodes - 1}")
    if args.master_port is not None and not 0 < args.master_port < 65535:
        parser.error(f"--master-port {args.master_port}: use a port in 1..65534")
    if args.hosts or args.hostfile:
        parser.error("--nnodes starts this node's tasks only; -H/--hostfile start tasks over ssh: use one or the other")
    if args.port is not None:
        parser.error("--port: with --nnodes, task r listens on --master-port + 1 + r")
    if args.max_restarts:
        parser.error("--max-restarts with --nnodes: a restart needs every node; let the scheduler restart the job "
                     "(the launcher exits with the failed task's code, 42 for a preempted one)")


def _ssh_options(args) -> list[str]:
    options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={math.ceil(args.start_timeout)}"]
    if args.ssh_port is not None:
        options += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file is not None:
        options += ["-i", os.path.abspath(args.ssh_identity_file)]
    return options


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command every task runs, e.g. mirrored-run -np 2 python train.py")
    _check(parser, args)
    if not _enough_files(args.np):  # before the free ports are found: that holds one socket per task
        parser.error(_too_many_files(args.np))
    gpu_ids = local_gpu_ids()
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile) if args.hostfile else None
        # Checks -np against the hosts and the GPUs against --gpus-per-task before anything starts.
        source = "-H" if args.hosts else f"--hostfile {args.hostfile}"
        first = plan_job(args.np, hosts, args.chief, args.port, source)
        assign_gpus(first, args.gpus_per_task, gpu_ids)
    except ValueError as e:
        parser.error(str(e))
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # each print reaches the launcher (and the prefix) at once
    if args.timeline:
        env["MIRRORED_TIMELINE"] = os.path.abspath(args.timeline)
    layout = None
    if args.nnodes is not None:
        master_addr = args.master_addr or "127.0.0.1"
        master_port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
        try:
            layout = rendezvous(args.nnodes, args.node_rank or 0, master_addr, master_port, args.np,
                                os.environ.get("MIRRORED_JOB_TOKEN") or None, args.start_timeout)
        except RendezvousError as e:
            _say(str(e))
            return 1
        except KeyboardInterrupt:
            _say("SIGINT: stopped waiting for the other nodes")
            return 128 + signal.SIGINT
        if sum(layout.tasks) + master_port >= 65536:
            _say(f"--master-port {master_port}: tasks listen on PORT + 1 .. PORT + {sum(layout.tasks)}; pick a "
                 "lower port")
            return 2
    output = _Output()
    lifeline = _Lifeline()
    settings = _Settings(command, env, _ssh_options(args), args.log_dir, lifeline)
    try:
        with _Signals() as signals:
            attempt = restarts = 0
            while True:
                if layout is not None:
                    env["MIRRORED_JOB_TOKEN"] = layout.token  # the same on every node
                    tasks = plan_node_job(layout.hosts, layout.tasks, args.node_rank or 0, args.chief, master_port)
                else:
                    env["MIRRORED_JOB_TOKEN"] = secrets.token_hex(16)  # a new job: stale tasks cannot join it
                    tasks = plan_job(args.np, hosts, args.chief, args.port)
                env["MIRRORED_RESTART_COUNT"] = str(attempt)
                assign_gpus(tasks, args.gpus_per_task, gpu_ids)
                code, failed = _run_once(tasks, settings, output, signals, attempt)
                if failed is None or signals.received or layout is not None:
                    return code
                attempt += 1
                if code == RESTART_EXIT_CODE:
                    _say(f"restarting the job (preempted; {failed.name} exited with {RESTART_EXIT_CODE})")
                    continue
                if restarts == args.max_restarts:
                    if args.max_restarts:
                        _say(f"giving up after {args.max_restarts} restart(s)")
                    return code
                restarts += 1
                _say(f"restarting the job ({restarts} of {args.max_restarts} restarts)")
    finally:
        lifeline.close()


if __name__ == "__main__":
    sys.exit(main())
