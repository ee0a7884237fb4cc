"""The job loop the multi-worker benchmarks share: one process per task of a job on 127.0.0.1.

    from loopback_job import run_workers  # bench/ is on sys.path when a bench script runs
    per_task = run_workers(2, lambda rank, ports: [sys.executable, "-c", TASK], pythonpath=package)

Each task gets TF_CONFIG for a fresh job on free loopback ports and prints
its result as JSON on its last line of stdout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_workers(world: int, command, *, pythonpath: str | None = None, env: dict | None = None,
            timeout: float = 1800, what: str = "worker") -> list:
    """Start ``world`` tasks (``command(rank, ports)`` is a task's argv; ``pythonpath`` goes first on its
    PYTHONPATH, ``env`` on top of ours), wait for all and return each one's last stdout line as JSON, in
    rank order. A task that fails ends the benchmark."""
    ports = free_ports(world)
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for rank in range(world):
        task_env = dict(os.environ, **(env or {}))
        task_env["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": "worker", "index": rank}})
        if pythonpath:
            task_env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, task_env.get("PYTHONPATH")) if p)
        procs.append(subprocess.Popen(command(rank, ports), env=task_env, stdout=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise SystemExit(f"a {what} task failed with exit code {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
