"""Launch a multi-worker job on 127.0.0.1 and collect what each task returns.

``launch(fn, num_workers)`` starts one Python process per task with its own
``TF_CONFIG`` (free loopback ports, chief optional), runs the module-level
function ``fn(**kwargs)`` in each, and returns one :class:`TaskResult` per
task in rank order (chief first). A task that raises reports the exception's
type and message; a task that dies (e.g. SIGKILL) reports its exit code.
Run as a script, this file is the task side.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mirrored.tools.run import free_ports



def package_root() -> str:
    """Where this process imports mirrored from (the source tree or site-packages): tasks import the same."""
    import mirrored

    return os.path.dirname(os.path.dirname(os.path.abspath(mirrored.__file__)))


@dataclass
class TaskResult:
    task: str                 # "chief:0", "worker:1", ...
    returncode: int | None    # None: killed by launch() at its timeout
    value: object = None      # what fn returned
    error: str | None = None  # exception type name, when fn raised
    message: str = ""         # exception message
    raised_at: float | None = None  # time.time() when fn raised
    called_at: float | None = None  # time.time() when fn was called (after the task's start-up and imports)
    stderr: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None




def cluster(num_workers: int, chief: bool = False) -> dict:
    ports = free_ports(num_workers + chief)
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports[chief:]]}
    if chief:
        spec["chief"] = [f"127.0.0.1:{ports[0]}"]
    return spec


def tasks_of(spec: dict) -> list[tuple[str, int]]:
    return [("chief", 0)] * len(spec.get("chief", [])) + [("worker", i) for i in range(len(spec["worker"]))]


def launch(fn, num_workers: int, *, chief: bool = False, kwargs=None, per_task_kwargs=None, timeout: float = 60,
           env=None, spec=None, only=None) -> list[TaskResult]:
    """Run ``fn`` as every task of a fresh job; ``only`` limits which task indices (rank order) are started."""
    spec = spec or cluster(num_workers, chief)
    tasks = tasks_of(spec)
    module = sys.modules[fn.__module__].__file__
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rank, (task_type, index) in enumerate(tasks):
            if only is not None and rank not in only:
                continue
            args = dict(kwargs or {})
            args.update((per_task_kwargs or {}).get(rank, {}))
            out = os.path.join(tmp, f"{rank}.pickle")
            task_env = dict(os.environ, **(env or {}))
            task_env["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}})
            task_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root(), task_env.get("PYTHONPATH")) if p)
            cmd = [sys.executable, __file__, module, fn.__name__, out, json.dumps(args)]
            # stderr goes to a file: a pipe nobody reads yet could fill up and stall the task.
            log = open(out + ".log", "w+")
            procs.append((f"{task_type}:{index}", subprocess.Popen(cmd, env=task_env, stderr=log), out, log))
        results = []
        deadline = time.monotonic() + timeout
        for name, p, out, log in procs:
            try:
                code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                code = None
            log.seek(0)
            result = TaskResult(name, code, stderr=log.read())
            log.close()
            if os.path.exists(out):
                with open(out, "rb") as f:
                    for key, value in pickle.load(f).items():
                        setattr(result, key, value)
            results.append(result)
    return results


def run_restartable_job(tmp_path, script: str, name: str, crash: bool, timeout: float = 300):
    """Run ``script`` as a two-task ``mirrored-run --max-restarts 2`` job in ``tmp_path``.

    The script gets three arguments: its checkpoint directory, a crash marker (a task crashes once while it
    is missing; ``crash=False`` creates it first, so the job goes straight through) and an output prefix
    (task ``me`` writes its JSON result to ``{prefix}.{me}``). Returns the finished launcher process and the
    tasks' results in task order.
    """
    path = tmp_path / "train.py"
    path.write_text(script)
    marker = tmp_path / f"{name}.crashed"
    if not crash:
        marker.touch()
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "mirrored.run", "-np", "2", "--max-restarts", "2", sys.executable,
                           str(path), str(tmp_path / name), str(marker), str(out)],
                          capture_output=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    return done, [json.loads((tmp_path / f"{name}.json.{me}").read_text()) for me in range(2)]


def _task_main(module_path: str, fn_name: str, out: str, kwargs: str) -> int:
    spec = importlib.util.spec_from_file_location("_multiworker_task", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    called_at = time.time()
    try:
        report = {"value": getattr(module, fn_name)(**json.loads(kwargs)), "called_at": called_at}
        code = 0
    except Exception as e:  # reported to the launcher, which asserts on it
        report = {"error": type(e).__name__, "message": str(e), "raised_at": time.time(), "called_at": called_at}
        code = 1
    with open(out + ".tmp", "wb") as f:
        pickle.dump(report, f)
    os.replace(out + ".tmp", out)
    return code


def kill_self() -> None:
    """Die the way a crashed or OOM-killed task dies: no cleanup, sockets closed by the kernel."""
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(_task_main(*sys.argv[1:5]))
