"""``mirrored-run``: start every task of a multi-worker job, watch it, and restart it when a task dies.

    mirrored-run -np 4 python train.py                       # 4 workers on this machine
    mirrored-run -np 4 -H nodea:2,nodeb:2 python train.py    # 2 on each host, started over ssh
    mirrored-run -np 2 --max-restarts 3 python train.py      # survive up to 3 task failures

Each task gets its ``TF_CONFIG`` (``worker`` tasks, or a ``chief`` and
workers with ``--chief``) and the job's fresh ``MIRRORED_JOB_TOKEN``, so the
rendezvous store admits this job only. Every output line is prefixed with its
task (``[worker:1] ...``). The first task to fail ends the job: the others get
SIGTERM, then SIGKILL after a grace period, and the launcher exits with the
failing task's code (128 + N for a task killed by signal N). Ctrl-C is
forwarded to every task. ``--max-restarts K`` restarts the whole job, with
new ports and a new token, up to K times; the script resumes from its last
checkpoint (``md.train.CheckpointManager``). ``python -m mirrored.run`` is
the same program.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

__all__ = ["main", "Task", "plan_job", "parse_hosts"]

# Seconds between SIGTERM and SIGKILL when the job ends early.
GRACE_SECONDS = 5.0
# First port of a job with hosts whose free ports this machine cannot see (-H without --port).
DEFAULT_PORT = 12345
# Variables that describe this shell or this login, not the job: not sent to remote hosts.
_NOT_FORWARDED = re.compile(r"^(HOSTNAME|PWD|OLDPWD|SHLVL|_|DISPLAY|XAUTHORITY|SSH_.*|BASH_FUNC_.*|LS_COLORS)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_POLL_SECONDS = 0.05


@dataclass
class Task:
    """One process of the job: its TF_CONFIG identity, where it runs and its address."""

    task_type: str
    index: int
    host: str | None  # None: started on this machine; else the ssh destination
    address: str
    proc: subprocess.Popen | None = field(default=None, repr=False)
    pumps: list = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` (or ``"a,b"``: one slot each) -> ``[("a", 2), ("b", 2)]``."""
    hosts = []
    for part in spec.split(","):
        part = part.strip()
        name, _, slots = part.rpartition(":") if ":" in part else (part, "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H {spec!r}: {part!r} is not 'host' or 'host:slots' with slots >= 1; "
                             "write e.g. -H nodea:2,nodeb:2")
        hosts.append((name, int(slots)))
    return hosts


def _local_names() -> set[str]:
    """Host names that mean this machine: tasks there start directly, not over ssh."""
    names = {"localhost", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


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


def plan_job(num_tasks: int, hosts=None, chief: bool = False, port=None) -> list[Task]:
    """The tasks of one run of the job, in rank order (the chief first).

    Without ``hosts`` every task runs here on 127.0.0.1, on free ports (or
    ``port``, ``port + 1``, ...). With ``hosts`` the tasks fill each host's
    slots in order; task ``r`` listens on ``port + r`` (default
    DEFAULT_PORT), since free ports of other machines cannot be seen from here.
    """
    if hosts:
        slots = sum(n for _, n in hosts)
        if num_tasks > slots:
            raise ValueError(f"-np {num_tasks}: -H gives {slots} slot(s); list more hosts or slots "
                             "(-H host:slots,...), or lower -np")
        local = _local_names()
        placed = [name for name, n in hosts for _ in range(n)][:num_tasks]
        everywhere_local = all(h in local for h in placed)
        # Loopback when the whole job is here; else each task at its host's name as given (localhost:
        # this machine's name, which the other hosts must be able to resolve).
        addresses = ["127.0.0.1" if everywhere_local else socket.gethostname() if h == "localhost" else h
                     for h in placed]
        runs_on = [None if h in local else h for h in placed]
        if everywhere_local and port is None:
            ports = free_ports(num_tasks)
        else:
            ports = [(DEFAULT_PORT if port is None else port) + r for r in range(num_tasks)]
    else:
        addresses, runs_on = ["127.0.0.1"] * num_tasks, [None] * num_tasks
        ports = free_ports(num_tasks) if port is None else [port + r for r in range(num_tasks)]
    kinds = [("chief", 0)] * bool(chief) + [("worker", i) for i in range(num_tasks - bool(chief))]
    return [Task(t, i, h, f"{a}:{p}") for (t, i), h, a, p in zip(kinds, runs_on, addresses, ports)]


def cluster_of(tasks: list[Task]) -> dict:
    cluster: dict = {}
    for t in tasks:
        cluster.setdefault(t.task_type, []).append(t.address)
    return cluster


class _Output:
    """Copies each task's output to ours, a whole line at a time, prefixed with the task's name."""

    def __init__(self):
        self._lock = threading.Lock()

    def pump(self, stream, target, prefix: bytes) -> threading.Thread:
        def copy():
            with stream:
                for line in iter(stream.readline, b""):
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    with self._lock:  # one lock for stdout and stderr: lines never mix on a terminal
                        try:
                            target.write(prefix + line)
                            target.flush()
                        except OSError:
                            pass  # our output is gone (e.g. `| head`): keep draining, or the task blocks

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


def _die_with_launcher() -> None:
    """In a new task: SIGKILL when the launcher dies, even by SIGKILL, so no task is orphaned."""
    if _prctl is not None:
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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


class _Job:
    """One run of the job: starts the tasks, copies their output, ends them all when one fails."""

    def __init__(self, tasks: list[Task], command: list[str], env: dict, output: _Output):
        self.tasks = tasks
        self.command = command
        self.env = env
        self.output = output

    def start(self) -> None:
        cluster = cluster_of(self.tasks)
        cwd = os.getcwd()
        for t in self.tasks:
            env = dict(self.env)
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": t.task_type, "index": t.index}})
            if t.host is None:
                t.proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          preexec_fn=_die_with_launcher)
            else:
                forwarded = {k: v for k, v in env.items() if _ENV_NAME.match(k) and not _NOT_FORWARDED.match(k)}
                t.proc = subprocess.Popen(["ssh", "-o", "BatchMode=yes", t.host,
                                           _remote_command(cwd, forwarded, self.command)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, preexec_fn=_die_with_launcher)
            prefix = f"[{t.name}] ".encode()
            t.pumps = [self.output.pump(t.proc.stdout, sys.stdout.buffer, prefix),
                       self.output.pump(t.proc.stderr, sys.stderr.buffer, prefix)]

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

    def stop(self, signum: int = signal.SIGTERM, urgent=lambda: False) -> None:
        """Sends ``signum`` to every running task, then SIGKILL to those left after the grace period."""
        self.send(signum)
        deadline = time.monotonic() + GRACE_SECONDS
        while self.running() and time.monotonic() < deadline and not urgent():
            time.sleep(_POLL_SECONDS)
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


def _run_once(tasks, command, env, output, signals) -> tuple[int, Task | None]:
    """Runs the job until every task ended or one failed; returns (exit code, the failed task or None)."""
    job = _Job(tasks, command, env, output)
    if logging.getLogger("mirrored").isEnabledFor(logging.INFO):  # MIRRORED_LOG_LEVEL=INFO
        _say(f"starting {len(tasks)} task(s): " +
             ", ".join(f"{t.name} at {t.address}" + (f" (ssh {t.host})" if t.host else "") for t in tasks))
    try:
        try:
            job.start()
        except OSError as e:
            job.stop()
            _say(f"cannot start {e.filename or command[0]!r}: {e.strerror or e}")  # the command, or ssh
            return 127, None
        while True:
            if signals.received:
                signum = signals.received[0]
                _say(f"{signal.Signals(signum).name}: ending {len(job.running())} task(s)")
                job.stop(signum, urgent=lambda: len(signals.received) > 1)  # a second Ctrl-C: SIGKILL now
                return 128 + signum, None
            failed = next((t for t in tasks if t.proc.poll() not in (None, 0)), None)
            if failed is not None:
                code = _exit_code(failed.proc.returncode)
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
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
                   help="number of tasks (processes) in the job")
    p.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                   help="hosts and their task slots, e.g. nodea:2,nodeb:2; tasks on hosts other than this "
                        "machine are started over ssh (default: every task on this machine)")
    p.add_argument("--chief", action="store_true", help="make task 0 a 'chief' task and the rest workers")
    p.add_argument("--port", type=int, default=None, metavar="BASE",
                   help=f"task r listens on BASE + r (default: free ports here; {DEFAULT_PORT} with -H)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the whole job up to K times when a task fails (default 0)")
    p.add_argument("--timeline", default=None, metavar="FILE",
                   help="record every task's timeline (sets MIRRORED_TIMELINE=FILE for each task)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program every task runs, e.g. python train.py")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command every task runs, e.g. mirrored-run -np 2 python train.py")
    if args.np < 1:
        parser.error(f"-np {args.np}: a job needs at least 1 task")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: use 0 (no restarts) or more")
    if args.port is not None and not 0 < args.port <= 65536 - args.np:
        parser.error(f"--port {args.port}: tasks listen on BASE..BASE+{args.np - 1}; pick BASE in "
                     f"1..{65536 - args.np}")
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else None
        plan_job(args.np, hosts, args.chief, args.port)  # checks -np against -H before anything starts
    except ValueError as e:
        parser.error(str(e))
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # each print reaches the launcher (and the prefix) at once
    if args.timeline:
        env["MIRRORED_TIMELINE"] = os.path.abspath(args.timeline)
    output = _Output()
    with _Signals() as signals:
        for attempt in range(args.max_restarts + 1):
            env["MIRRORED_JOB_TOKEN"] = secrets.token_hex(16)  # a new job: stale tasks cannot join it
            env["MIRRORED_RESTART_COUNT"] = str(attempt)
            tasks = plan_job(args.np, hosts, args.chief, args.port)
            code, failed = _run_once(tasks, command, env, output, signals)
            if failed is None or signals.received:
                return code
            if attempt < args.max_restarts:
                _say(f"restarting the job ({attempt + 1} of {args.max_restarts} restarts)")
            elif args.max_restarts:
                _say(f"giving up after {args.max_restarts} restart(s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
