"""``mirrored-run``: TF_CONFIG per task, prefixed output, failure, Ctrl-C, restarts and ssh hosts, on loopback.

Every test starts the real launcher (``python -m mirrored.run``) as a
subprocess with a timeout and asserts what a user relies on: exit codes,
line prefixes, the environment each task sees, and restarts.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mirrored.tools import run as mrun

pytestmark = pytest.mark.multiworker

PREFIX = re.compile(rb"^\[((?:chief|worker):\d+)\] (.*)$")


def launch(args, *, timeout=60, env=None, cwd=None):
    """Runs mirrored-run with ``args``; returns the CompletedProcess (bytes output)."""
    base = {k: v for k, v in os.environ.items() if k != "MIRRORED_LOG_LEVEL"}  # the default level unless given
    return subprocess.run([sys.executable, "-m", "mirrored.run", *args], capture_output=True, timeout=timeout,
                          env=dict(base, **(env or {})), cwd=cwd)


def script(tmp_path, body, name="task.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def pid_recording_task(tmp_path, body):
    """A task script that records its pid in a folder (for :func:`_assert_all_gone`), then runs ``body`` with
    json, os, signal, sys and time imported and ``me``, its task index; returns (script, folder)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    return script(tmp_path, "import json, os, signal, sys, time\n"
                            "me = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                            f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
                            + textwrap.dedent(body)), pids


def by_task(stream: bytes) -> dict:
    """Output lines grouped by their task prefix; every line must carry one."""
    lines: dict = {}
    for line in stream.splitlines():
        m = PREFIX.match(line)
        assert m, f"line without a task prefix: {line!r}"
        lines.setdefault(m.group(1).decode(), []).append(m.group(2).decode())
    return lines


REPORT = """
    import json, os, sys
    config = json.loads(os.environ["TF_CONFIG"])
    print(json.dumps({"task": config["task"], "cluster": config["cluster"],
                      "token": os.environ["MIRRORED_JOB_TOKEN"], "restart": os.environ["MIRRORED_RESTART_COUNT"],
                      "timeline": os.environ.get("MIRRORED_TIMELINE"), "cwd": os.getcwd(),
                      "marker": os.environ.get("LAUNCHER_TEST_MARKER")}))
    print("to stderr", file=sys.stderr)
"""


def reports(stdout: bytes) -> dict:
    return {task: json.loads(lines[0]) for task, lines in by_task(stdout).items()}


def test_every_task_gets_its_tf_config_one_token_and_prefixed_output(tmp_path):
    task = script(tmp_path, REPORT)
    done = launch(["-np", "3", "--", sys.executable, task])
    assert done.returncode == 0, done.stderr.decode()
    got = reports(done.stdout)
    assert sorted(got) == ["worker:0", "worker:1", "worker:2"]
    cluster = got["worker:0"]["cluster"]
    assert list(cluster) == ["worker"] and len(set(cluster["worker"])) == 3
    assert all(a.startswith("127.0.0.1:") for a in cluster["worker"])
    for name, r in got.items():
        assert r["task"] == {"type": "worker", "index": int(name.split(":")[1])}
        assert r["cluster"] == cluster
        assert r["restart"] == "0"
        assert r["timeline"] is None
    tokens = {r["token"] for r in got.values()}
    assert len(tokens) == 1 and len(tokens.pop()) >= 32
    assert by_task(done.stderr) == {f"worker:{i}": ["to stderr"] for i in range(3)}


def test_chief_port_base_and_timeline(tmp_path):
    task = script(tmp_path, REPORT)
    base = mrun.free_ports(1)[0]
    done = launch(["-np", "3", "--chief", "--port", str(base), "--timeline", "trace.json", sys.executable, task],
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode()
    got = reports(done.stdout)
    assert sorted(got) == ["chief:0", "worker:0", "worker:1"]
    assert got["chief:0"]["cluster"] == {"chief": [f"127.0.0.1:{base}"],
                                         "worker": [f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}"]}
    assert got["worker:1"]["task"] == {"type": "worker", "index": 1}
    assert {r["timeline"] for r in got.values()} == {str(tmp_path / "trace.json")}


def test_lines_of_different_tasks_never_mix(tmp_path):
    task = script(tmp_path, """
        import json, os, sys
        me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        for i in range(300):
            print(f"{me}:{i}:" + str(me) * 3000, file=sys.stdout if i % 2 else sys.stderr)
        sys.stdout.write("no newline at the end")
    """)
    done = launch(["-np", "3", sys.executable, task])
    assert done.returncode == 0
    out, err = by_task(done.stdout), by_task(done.stderr)
    for me in range(3):
        lines = out[f"worker:{me}"]
        assert lines[-1] == "no newline at the end"
        assert lines[:-1] == [f"{me}:{i}:" + str(me) * 3000 for i in range(1, 300, 2)]
        assert err[f"worker:{me}"] == [f"{me}:{i}:" + str(me) * 3000 for i in range(0, 300, 2)]


def test_a_failing_task_ends_the_job_with_its_exit_code(tmp_path):
    task, pids = pid_recording_task(tmp_path, """
        if me == 1:
            time.sleep(1)
            print("failing")
            sys.exit(3)
        time.sleep(120)
    """)
    start = time.monotonic()
    done = launch(["-np", "3", sys.executable, task], timeout=60)
    assert done.returncode == 3
    assert time.monotonic() - start < mrun.GRACE_SECONDS + 20
    assert by_task(done.stdout) == {"worker:1": ["failing"]}
    assert b"[mirrored-run] worker:1 exited with code 3; ending worker:0, worker:2" in done.stderr
    _assert_all_gone(pids)


def test_a_task_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    task, pids = pid_recording_task(tmp_path, """
        if me == 0:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    """)
    start = time.monotonic()
    done = launch(["-np", "2", sys.executable, task], timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 128 + signal.SIGKILL  # the failing task's status, as a shell reports it
    assert mrun.GRACE_SECONDS <= elapsed < mrun.GRACE_SECONDS + 20
    assert b"worker:0 exited with code 137" in done.stderr
    _assert_all_gone(pids)


CTRL_C_TASK = """
    import time
    print("ready", flush=True)
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise SystemExit(5)
"""


def _interrupt_when_ready(proc, tasks):
    """Sends SIGINT to the launcher once every task printed "ready"; returns (stdout rest, stderr, seconds)."""
    try:
        ready = 0
        while ready < tasks:  # every task has installed Python's SIGINT handler
            line = proc.stdout.readline()
            assert line, "the launcher ended early"
            ready += line.endswith(b"ready\n")
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        return out, err, time.monotonic() - start
    finally:
        proc.kill()
        proc.communicate()


def test_ctrl_c_is_forwarded_to_every_task(tmp_path):
    task = script(tmp_path, CTRL_C_TASK)
    proc = subprocess.Popen([sys.executable, "-m", "mirrored.run", "-np", "3", sys.executable, task],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err, elapsed = _interrupt_when_ready(proc, 3)
    assert proc.returncode == 128 + signal.SIGINT
    assert elapsed < mrun.GRACE_SECONDS
    assert sorted(by_task(out)) == ["worker:0", "worker:1", "worker:2"]
    assert all(lines == ["interrupted"] for lines in by_task(out).values())
    assert b"[mirrored-run] SIGINT: ending 3 task(s)" in err


def test_tasks_die_with_a_killed_launcher(tmp_path):
    task, pids = pid_recording_task(tmp_path, """
        print("ready", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "mirrored.run", "-np", "2", sys.executable, task],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for _ in range(2):
            assert proc.stdout.readline().endswith(b"ready\n")
    finally:
        proc.kill()  # SIGKILL: the launcher cannot forward anything
        proc.wait()
        proc.stdout.close()
    _assert_all_gone(pids, within=10)


def test_max_restarts_restarts_the_whole_job_with_a_new_token(tmp_path):
    marker = tmp_path / "crashed-once"
    task = script(tmp_path, REPORT + f"""
    me = config["task"]["index"]
    if me == 1 and not os.path.exists({str(marker)!r}):
        open({str(marker)!r}, "w").close()
        sys.exit(7)
    """)
    done = launch(["-np", "2", "--max-restarts", "2", sys.executable, task])
    assert done.returncode == 0, done.stderr.decode()
    lines = by_task(done.stdout)
    runs = {task: [json.loads(line) for line in got] for task, got in lines.items()}
    assert [r["restart"] for r in runs["worker:1"]] == ["0", "1"]
    assert runs["worker:0"][-1]["restart"] == "1"
    # worker:0 may be ended before it prints in the first run; worker:1 always prints before failing.
    assert runs["worker:1"][0]["token"] != runs["worker:1"][1]["token"] == runs["worker:0"][-1]["token"]
    assert runs["worker:1"][0]["cluster"] != runs["worker:1"][1]["cluster"]  # new ports too
    assert b"[mirrored-run] worker:1 exited with code 7" in done.stderr
    assert done.stderr.count(b"[mirrored-run] restarting the job (1 of 2 restarts)") == 1


def test_restarts_are_limited(tmp_path):
    task = script(tmp_path, """
        import os, sys
        # One write: a task ended by the failure of the other cannot leave half a line (print writes in parts).
        sys.stdout.write("attempt " + os.environ["MIRRORED_RESTART_COUNT"] + "\\n")
        sys.exit(9)
    """)
    done = launch(["-np", "2", "--max-restarts", "2", sys.executable, task])
    assert done.returncode == 9
    assert done.stderr.count(b"restarting the job") == 2
    assert b"[mirrored-run] giving up after 2 restart(s)" in done.stderr
    attempts = [line for lines in by_task(done.stdout).values() for line in lines]
    # A failure ends the job at once, so later tasks of an attempt may not get to print.
    assert {"attempt 0", "attempt 1", "attempt 2"} >= set(attempts) and "attempt 2" in attempts


STAND_IN_SSH = """#!/bin/sh
# Stands in for ssh: logs the host, then runs the remote command here in a
# bare environment and a session of its own, as sshd starts a login.
options=""
while case "$1" in -o|-p|-i) true;; *) false;; esac; do options="$options $1 $2"; shift 2; done
host=$1; shift
echo "$host" >> "{log}"
echo "$options" >> "{log}.options"
exec setsid --wait env -i PATH=/usr/bin:/bin /bin/sh -c "$*"
"""


@pytest.fixture
def fake_ssh(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "ssh.log"
    ssh = bin_dir / "ssh"
    ssh.write_text(STAND_IN_SSH.format(log=log))
    ssh.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, log


def test_hosts_are_started_over_ssh_with_the_same_environment(tmp_path, fake_ssh):
    env, log = fake_ssh
    task = script(tmp_path, REPORT)
    work = tmp_path / "work"
    work.mkdir()
    base = mrun.free_ports(1)[0]
    done = launch(["-np", "2", "-H", "nodeb:2", "--port", str(base), sys.executable, task],
                  env=dict(env, LAUNCHER_TEST_MARKER="it's \"quoted\" $HOME"), cwd=work)
    assert done.returncode == 0, done.stderr.decode()
    assert log.read_text().split() == ["nodeb", "nodeb"]
    got = reports(done.stdout)
    assert sorted(got) == ["worker:0", "worker:1"]
    for r in got.values():
        assert r["cluster"] == {"worker": [f"nodeb:{base}", f"nodeb:{base + 1}"]}
        assert r["marker"] == "it's \"quoted\" $HOME"  # forwarded unchanged
        assert r["cwd"] == str(work)
    assert by_task(done.stderr) == {"worker:0": ["to stderr"], "worker:1": ["to stderr"]}


def test_ctrl_c_reaches_remote_tasks(tmp_path, fake_ssh):
    env, log = fake_ssh
    task = script(tmp_path, CTRL_C_TASK)
    proc = subprocess.Popen([sys.executable, "-m", "mirrored.run", "-np", "2", "-H", "nodeb:2", "--port",
                             str(mrun.free_ports(1)[0]), sys.executable, task],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, **env))
    out, err, elapsed = _interrupt_when_ready(proc, 2)
    assert log.read_text().split() == ["nodeb", "nodeb"]
    assert proc.returncode == 128 + signal.SIGINT
    assert elapsed < mrun.GRACE_SECONDS
    assert by_task(out) == {"worker:0": ["interrupted"], "worker:1": ["interrupted"]}


def test_localhost_runs_without_ssh(tmp_path, fake_ssh):
    env, log = fake_ssh
    task = script(tmp_path, REPORT)
    done = launch(["-np", "2", "-H", "localhost:2", sys.executable, task], env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert not log.exists()
    assert all(a.startswith("127.0.0.1:") for a in reports(done.stdout)["worker:0"]["cluster"]["worker"])


def test_a_failing_remote_task_ends_the_remote_others(tmp_path, fake_ssh):
    env, log = fake_ssh
    task, pids = pid_recording_task(tmp_path, """
        if me == 0:
            time.sleep(1)
            sys.exit(4)
        print("waiting", flush=True)
        time.sleep(120)
    """)
    done = launch(["-np", "2", "-H", "nodeb:1,nodec:1", "--port", str(mrun.free_ports(1)[0]),
                   sys.executable, task], env=env, timeout=60)
    assert done.returncode == 4
    assert log.read_text().split() == ["nodeb", "nodec"]
    assert b"worker:0 exited with code 4; ending worker:1" in done.stderr
    _assert_all_gone(pids)


def _assert_all_gone(pids_dir, within=15.0):
    pids = [int(p.name) for p in pids_dir.iterdir()]
    assert pids
    deadline = time.monotonic() + within
    for pid in pids:
        while _alive(pid):
            assert time.monotonic() < deadline, f"task process {pid} outlived the job"
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "true"], b"-np 0: a job needs at least 1 task"),
    (["-np", "3", "-H", "a:2", "true"], b"-np 3: -H gives 2 slot(s)"),
    (["-np", "2", "-H", "a:x", "true"], b"'a:x' is not 'host' or 'host:slots'"),
    (["-np", "2"], b"give the command every task runs"),
    (["-np", "2", "--max-restarts", "-1", "true"], b"--max-restarts -1"),
    (["-np", "2", "--port", "65535", "true"], b"--port 65535"),
])
def test_bad_arguments_are_named(args, message):
    done = launch(args)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_missing_program_exits_127():
    done = launch(["-np", "2", "/nonexistent/program"])
    assert done.returncode == 127
    assert b"cannot start '/nonexistent/program'" in done.stderr


def test_console_script_is_installed():
    exe = shutil.which("mirrored-run", path=os.path.dirname(sys.executable))
    assert exe is not None
    done = subprocess.run([exe, "-np", "2", sys.executable, "-c", "print('hi')"], capture_output=True, timeout=60)
    assert done.returncode == 0
    assert sorted(done.stdout.splitlines()) == [b"[worker:0] hi", b"[worker:1] hi"]


@pytest.mark.parametrize("shm, engine", [
    ("1", "shared memory for all-reduce (every task on this host), Gloo over TCP for the rest"),
    ("0", "Gloo over TCP (no shared memory: MIRRORED_SHM=0)"),
])
def test_a_real_job_reports_its_engine_at_info(tmp_path, shm, engine):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    task = script(tmp_path, """
        import numpy as np
        import mirrored as md
        strategy = md.MultiWorkerMirroredStrategy(md.CommunicationOptions(timeout_seconds=30))
        me = strategy.cluster_resolver.task_id
        total = strategy.reduce("sum", strategy.run(lambda: np.arange(4.0) * (me + 1)), axis=None)
        print("total", total.tolist())
    """)
    done = launch(["-np", "2", sys.executable, task], env={"MIRRORED_LOG_LEVEL": "INFO", "MIRRORED_SHM": shm})
    assert done.returncode == 0, done.stderr.decode()
    assert re.search(rb"^\[mirrored-run\] starting 2 task\(s\): worker:0 at 127\.0\.0\.1:\d+, "
                     rb"worker:1 at 127\.0\.0\.1:\d+$", done.stderr, re.M)
    assert by_task(done.stdout) == {"worker:0": ["total [0.0, 3.0, 6.0, 9.0]"],
                                    "worker:1": ["total [0.0, 3.0, 6.0, 9.0]"]}
    err = by_task(b"\n".join(line for line in done.stderr.splitlines() if not line.startswith(b"[mirrored-run]")))
    for me in range(2):
        info = [line for line in err[f"worker:{me}"] if "MultiWorkerMirroredStrategy: " in line]
        assert len(info) == 1
        assert f"task worker:{me} (rank {me} of 2, from TFConfigClusterResolver), 1 local replica(s)" in info[0]
        assert info[0].endswith(f"; across workers: {engine}")


def test_plan_of_a_job_across_hosts():
    import socket

    tasks = mrun.plan_job(5, mrun.parse_hosts("localhost:2,nodeb:2,nodec"), chief=True, port=None)
    assert [t.name for t in tasks] == ["chief:0", "worker:0", "worker:1", "worker:2", "worker:3"]
    assert [t.host for t in tasks] == [None, None, "nodeb", "nodeb", "nodec"]  # localhost starts without ssh
    me = socket.gethostname()
    assert [t.address for t in tasks] == [f"{me}:12345", f"{me}:12346", "nodeb:12347", "nodeb:12348",
                                          "nodec:12349"]
    assert mrun.cluster_of(tasks) == {"chief": [f"{me}:12345"],
                                      "worker": [f"{me}:12346", "nodeb:12347", "nodeb:12348", "nodec:12349"]}
    assert [t.address for t in mrun.plan_job(2, [("a", 4)], port=2000)] == ["a:2000", "a:2001"]
    local = mrun.plan_job(2, [(me, 2)])
    assert [t.host for t in local] == [None, None] and all(t.address.startswith("127.0.0.1:") for t in local)
