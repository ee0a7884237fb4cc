"""``mirrored-run`` with torchrun's and horovodrun's habits, on loopback.

RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE, GPU pinning (with a fake GPU
list in CUDA_VISIBLE_DEVICES), host files, ssh options, per-task logs, the
per-node mode (two launchers as two "nodes"), tasks that die with a
SIGKILLed launcher however they are wrapped, preemption restarts, and the
bad-input rules. Every launcher is a real subprocess with a timeout.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mirrored.distribute import launcher_lifeline
from mirrored.tools import run as mrun
from test_run_launcher import _alive, by_task, fake_ssh, launch, script  # noqa: F401  (fake_ssh: a fixture)

pytestmark = pytest.mark.multiworker

ENV_REPORT = """
    import json, os
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "MIRRORED_JOB_TOKEN")
    config = json.loads(os.environ["TF_CONFIG"])
    print(json.dumps({"task": config["task"], "cluster": config["cluster"], **{n: os.environ.get(n) for n in names}}))
"""


def env_reports(stdout: bytes) -> dict:
    return {task: json.loads(lines[-1]) for task, lines in by_task(stdout).items()}


def test_every_task_gets_torchruns_variables_beside_tf_config(tmp_path):
    task = script(tmp_path, ENV_REPORT)
    done = launch(["-np", "3", "--chief", sys.executable, task], env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr.decode()
    got = env_reports(done.stdout)
    assert sorted(got) == ["chief:0", "worker:0", "worker:1"]
    for rank, name in enumerate(["chief:0", "worker:0", "worker:1"]):
        r = got[name]
        assert (r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "3", "3")
        assert r["CUDA_VISIBLE_DEVICES"] == ""  # no GPUs: left as it was


@pytest.mark.parametrize("args, visible, expected", [
    ([], "3,5,6,7", ["3", "5", "6"]),               # one GPU per local task by default
    ([], "0,1", ["0", "1", "0"]),                   # more tasks than GPUs: shared round-robin
    (["--gpus-per-task", "2"], "0,1,2,3,4,5", ["0,1", "2,3", "4,5"]),
    (["--gpus-per-task", "0"], "0,1", ["0,1", "0,1", "0,1"]),  # 0: CUDA_VISIBLE_DEVICES untouched
])
def test_gpus_are_pinned_by_local_rank(tmp_path, args, visible, expected):
    task = script(tmp_path, ENV_REPORT)
    done = launch(["-np", "3", *args, sys.executable, task], env={"CUDA_VISIBLE_DEVICES": visible})
    assert done.returncode == 0, done.stderr.decode()
    got = env_reports(done.stdout)
    assert [got[f"worker:{i}"]["CUDA_VISIBLE_DEVICES"] for i in range(3)] == expected


def test_gpu_assignment_counts_local_ranks_per_host():
    tasks = mrun.plan_job(3, [("localhost", 1), ("nodeb", 2)], port=2000)
    assert [(t.rank, t.local_rank, t.local_world_size) for t in tasks] == [(0, 0, 1), (1, 0, 2), (2, 1, 2)]
    mrun.assign_gpus(tasks, None, ["4", "5"])
    assert [t.gpus for t in tasks] == ["4", None, None]  # another host's GPUs are not known here
    mrun.assign_gpus(tasks, 2, ["4", "5"])
    assert [t.gpus for t in tasks] == ["4,5", "0,1", "2,3"]  # an explicit count numbers a remote host from 0
    with pytest.raises(ValueError, match=r"--gpus-per-task 3: 1 task\(s\) on this machine need 3 GPU\(s\) but it "
                                         r"has 2 \(4,5\)"):
        mrun.assign_gpus(tasks, 3, ["4", "5"])


def test_too_few_gpus_for_gpus_per_task_is_named():
    done = launch(["-np", "2", "--gpus-per-task", "2", "true"], env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert done.returncode == 2
    assert b"--gpus-per-task 2: 2 task(s) on this machine need 4 GPU(s) but it has 3 (0,1,2)" in done.stderr


@pytest.mark.parametrize("text, hosts", [
    ("nodea slots=2\nnodeb slots=4\n", [("nodea", 2), ("nodeb", 4)]),
    ("# the cluster\nnodea:2   # two\n\n  nodeb\n", [("nodea", 2), ("nodeb", 1)]),
    ("nodea slots=2 max_slots=8\nnodeb max-slots=4\n", [("nodea", 2), ("nodeb", 1)]),
    ("10.0.0.1 slots=3\n", [("10.0.0.1", 3)]),
])
def test_hostfile_formats(tmp_path, text, hosts):
    path = tmp_path / "hosts"
    path.write_text(text)
    assert mrun.parse_hostfile(str(path)) == hosts


@pytest.mark.parametrize("text, line", [
    ("nodea slots=2\nnodeb slots=x\n", 2),
    ("nodea slots=0\n", 1),
    ("# c\nnodea:2 slots=2\n", 2),
    ("nodea:²\n", 1),
    ("nodea cpus=2\n", 1),
    ("nodea:\n", 1),
])
def test_a_hostfile_line_that_does_not_parse_is_named_with_its_file_and_line(tmp_path, text, line):
    path = tmp_path / "hosts"
    path.write_text(text)
    bad = text.splitlines()[line - 1]
    done = launch(["-np", "1", "--hostfile", str(path), "true"])
    assert done.returncode == 2
    assert f"--hostfile {path}, line {line}: {bad!r} is not 'host slots=N'".encode() in done.stderr


def test_hostfile_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for path, words in ((tmp_path / "missing", "cannot read it"), (empty, "no hosts in it")):
        done = launch(["-np", "1", "--hostfile", str(path), "true"])
        assert done.returncode == 2 and f"--hostfile {path}: {words}".encode() in done.stderr
    one = tmp_path / "one"
    one.write_text("localhost slots=1\n")
    done = launch(["-np", "2", "--hostfile", str(one), "true"])
    assert done.returncode == 2 and f"-np 2: --hostfile {one} gives 1 slot(s)".encode() in done.stderr


def test_a_hostfile_of_this_machine_runs_locally(tmp_path, fake_ssh):
    env, log = fake_ssh
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    task = script(tmp_path, ENV_REPORT)
    done = launch(["-np", "2", "--hostfile", str(hosts), sys.executable, task], env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert not log.exists()  # neither name went through ssh
    got = env_reports(done.stdout)
    assert [got[f"worker:{i}"]["LOCAL_RANK"] for i in range(2)] == ["0", "1"]  # one machine: local ranks 0, 1
    assert all(a.startswith("127.0.0.1:") for a in got["worker:0"]["cluster"]["worker"])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_addresses_run_without_ssh(host):
    tasks = mrun.plan_job(2, mrun.parse_hosts(f"{host}:2"))
    assert [t.host for t in tasks] == [None, None]


def test_ssh_port_identity_and_connect_timeout_reach_ssh(tmp_path, fake_ssh):
    env, log = fake_ssh
    key = tmp_path / "id_test"
    key.write_text("not a real key: the stand-in ssh only records it")
    done = launch(["-np", "1", "-H", "nodeb", "--ssh-port", "2222", "--ssh-identity-file", str(key),
                   "--start-timeout", "7.5", sys.executable, "-c", "print('remote')"], env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert by_task(done.stdout) == {"worker:0": ["remote"]}
    options = (tmp_path / "ssh.log.options").read_text().split()
    assert options == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=8", "-p", "2222", "-i", str(key)]


def test_log_dir_holds_one_file_per_task_besides_the_console(tmp_path):
    task = script(tmp_path, """
        import json, os, sys
        me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print(f"out {me}", flush=True)
        print(f"err {me}", file=sys.stderr, flush=True)
    """)
    logs = tmp_path / "logs" / "run1"
    done = launch(["-np", "2", "--log-dir", str(logs), sys.executable, task])
    assert done.returncode == 0, done.stderr.decode()
    assert by_task(done.stdout) == {"worker:0": ["out 0"], "worker:1": ["out 1"]}
    assert sorted(p.name for p in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    for me in range(2):
        assert sorted((logs / f"worker-{me}.log").read_text().splitlines()) == [f"err {me}", f"out {me}"]


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2", "--node-rank", "2"], b"--node-rank 2: --nnodes 2 numbers the nodes 0..1"),
    (["--nnodes", "2", "--node-rank", "-1"], b"--node-rank -1: --nnodes 2 numbers the nodes 0..1"),
    (["--nnodes", "2"], b"--nnodes 2 needs --node-rank"),
    (["--nnodes", "0"], b"--nnodes 0: a job needs at least 1 node"),
    (["--node-rank", "1"], b"--node-rank need --nnodes"),
    (["--nnodes", "2", "--node-rank", "0", "-H", "a:2"], b"-H/--hostfile start tasks over ssh"),
    (["--nnodes", "2", "--node-rank", "0", "--max-restarts", "1"], b"--max-restarts with --nnodes"),
    (["--nnodes", "2", "--node-rank", "0", "--master-port", "70000"], b"--master-port 70000"),
    (["-H", "localhost:\u00b2"], "'localhost:\u00b2' is not 'host' or 'host:slots'".encode()),
    (["--gpus-per-task", "-1"], b"--gpus-per-task -1"),
    (["--start-timeout", "0"], b"--start-timeout 0"),
    (["--start-timeout", "nan"], b"--start-timeout nan"),
    (["--ssh-port", "0"], b"--ssh-port 0"),
    (["--ssh-identity-file", "/nonexistent/key"], b"--ssh-identity-file /nonexistent/key: no such file"),
    (["--hostfile", "h", "-H", "a"], b"not allowed with argument"),
])
def test_bad_launcher_arguments_are_named(args, message):
    done = launch(["-np", "1", *args, "true"])
    assert done.returncode == 2
    assert message in done.stderr


def test_a_log_dir_that_cannot_be_created_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = launch(["-np", "1", "--log-dir", str(blocker / "logs"), "true"])
    assert done.returncode == 2
    assert f"--log-dir {blocker / 'logs'}: cannot create it".encode() in done.stderr


NODE_TASK = """
    import json, os
    import numpy as np
    import mirrored as md
    strategy = md.MultiWorkerMirroredStrategy(communication_options=md.CommunicationOptions(timeout_seconds=60))
    me = int(os.environ["RANK"])
    total = strategy.reduce("sum", strategy.run(lambda: np.float64(me + 1)), axis=None)
    config = json.loads(os.environ["TF_CONFIG"])
    print(json.dumps({"rank": me, "local": [os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]],
                      "world": os.environ["WORLD_SIZE"], "task": config["task"], "cluster": config["cluster"],
                      "replicas": strategy.num_replicas_in_sync, "total": float(total)}), flush=True)
"""


def _start_node(node_rank, nnodes, port, task, extra=(), env=None):
    base = {k: v for k, v in os.environ.items() if k not in ("MIRRORED_LOG_LEVEL", "MIRRORED_JOB_TOKEN")}
    return subprocess.Popen([sys.executable, "-m", "mirrored.run", "--nnodes", str(nnodes), "--node-rank",
                             str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *extra,
                             sys.executable, task], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(base, **(env or {})))


def _finish(procs, timeout=180):
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    return results


def test_two_nodes_on_loopback_form_one_job(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    task = script(tmp_path, NODE_TASK)
    port = mrun.free_ports(1)[0]
    # Node 1 first: it retries until node 0's launcher listens.
    procs = [_start_node(1, 2, port, task, ["-np", "1"]), _start_node(0, 2, port, task, ["-np", "2"])]
    (code1, out1, err1), (code0, out0, err0) = _finish(procs)
    assert code0 == 0 and code1 == 0, (err0 + err1).decode()
    got = {**env_reports(out0), **env_reports(out1)}
    assert sorted(got) == ["worker:0", "worker:1", "worker:2"]
    assert sorted(env_reports(out0)) == ["worker:0", "worker:1"]  # each node prints its own tasks
    cluster = got["worker:0"]["cluster"]
    assert cluster == {"worker": [f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}", f"127.0.0.1:{port + 3}"]}
    for name, r in got.items():
        assert r["cluster"] == cluster and r["world"] == "3" and r["replicas"] == 3
        assert r["total"] == 6.0  # 1 + 2 + 3: every task of both nodes took part
        assert r["task"] == {"type": "worker", "index": r["rank"]}
    assert [got[f"worker:{i}"]["local"] for i in range(3)] == [["0", "2"], ["1", "2"], ["0", "1"]]


def test_a_node_of_another_job_is_refused_by_name(tmp_path):
    port = mrun.free_ports(1)[0]
    task = script(tmp_path, "print('ran')")
    token = {"MIRRORED_JOB_TOKEN": "job-a-secret"}
    node0 = _start_node(0, 2, port, task, ["-np", "1", "--start-timeout", "120"], env=token)
    stranger = _start_node(1, 3, port, task, ["-np", "1", "--start-timeout", "60"], env=token)
    wrong_token = _start_node(1, 2, port, task, ["-np", "1", "--start-timeout", "60"],
                              env={"MIRRORED_JOB_TOKEN": "job-b-secret"})
    (code_s, _, err_s), (code_w, _, err_w) = _finish([stranger, wrong_token])
    assert code_s == 1 and b"--nnodes 3 differs from node 0's --nnodes 2" in err_s
    assert code_w == 1 and b"MIRRORED_JOB_TOKEN differs from node 0's" in err_w
    member = _start_node(1, 2, port, task, ["-np", "1"], env=token)  # the real node 1 still gets in
    (code0, out0, err0), (code1, out1, err1) = _finish([node0, member])
    assert code0 == code1 == 0, (err0 + err1).decode()
    assert by_task(out0) == {"worker:0": ["ran"]} and by_task(out1) == {"worker:1": ["ran"]}


def test_strangers_at_node_0s_port_do_not_hold_up_the_job(tmp_path):
    import socket

    port = mrun.free_ports(1)[0]
    task = script(tmp_path, "print('ran')")
    node0 = _start_node(0, 2, port, task, ["-np", "1"])
    strangers = []
    try:
        deadline = time.monotonic() + 120
        while not strangers:  # node 0 listens once its launcher has started
            try:
                strangers.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                assert time.monotonic() < deadline and node0.poll() is None, "node 0 never listened"
                time.sleep(0.05)
        strangers.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        strangers[1].sendall(b"\x00" * 64 + b"\n")  # garbage: dropped at once
        # The first stranger stays silent for the whole job: node 0 reads every connection at once, so node 1
        # joins well within its --start-timeout, which is shorter than the time a silent line is waited for.
        node1 = _start_node(1, 2, port, task, ["-np", "1", "--start-timeout", "8"])
        (code0, out0, err0), (code1, out1, err1) = _finish([node0, node1])
    finally:
        for s in strangers:
            s.close()
    assert code0 == code1 == 0, (err0 + err1).decode()
    assert by_task(out0) == {"worker:0": ["ran"]} and by_task(out1) == {"worker:1": ["ran"]}


def test_a_node_that_finds_no_node_0_names_start_timeout(tmp_path):
    port = mrun.free_ports(1)[0]
    done = launch(["--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--start-timeout", "1",
                   "-np", "1", "true"])
    assert done.returncode == 1
    assert f"--start-timeout 1: node 1 could not join node 0 at --master-addr 127.0.0.1 --master-port {port}".encode() \
        in done.stderr


def test_one_node_alone_needs_no_rendezvous(tmp_path):
    task = script(tmp_path, ENV_REPORT)
    port = mrun.free_ports(1)[0]
    done = launch(["--nnodes", "1", "--master-port", str(port), "-np", "2", sys.executable, task])
    assert done.returncode == 0, done.stderr.decode()
    got = env_reports(done.stdout)
    assert got["worker:1"]["cluster"] == {"worker": [f"127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}"]}


# --- tasks die with the launcher, whatever wraps them -------------------------

def _wait_for_pids(pids_dir, count, proc, timeout=120):
    """The pid files the tasks wrote once they are all running (waits on the files, bounded)."""
    deadline = time.monotonic() + timeout
    while len(list(pids_dir.iterdir())) < count:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the tasks did not start"
        time.sleep(0.05)
    return [int(p.read_text()) for p in pids_dir.iterdir()]


def _assert_gone(pids, within=60.0):
    deadline = time.monotonic() + within
    for pid in pids:
        while _alive(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived its SIGKILLed launcher"
            time.sleep(0.05)


SLEEPER = """
    import os, sys, time
    with open(os.path.join(sys.argv[1], f"py-{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))
    {imports}
    time.sleep(300)
"""


def _killed_launcher(tmp_path, wrapper, imports, count):
    pids = tmp_path / "pids"
    pids.mkdir()
    task = script(tmp_path, SLEEPER.replace("{imports}", imports))
    command = wrapper.format(python=sys.executable, task=task, pids=pids)
    proc = subprocess.Popen([sys.executable, "-m", "mirrored.run", "-np", "2", "bash", "-c", command],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        started = _wait_for_pids(pids, count, proc)
    finally:
        proc.kill()  # SIGKILL: the launcher cannot forward anything
        proc.wait()
        proc.stderr.close()
    _assert_gone(started)


def test_a_shell_wrapped_job_dies_with_its_sigkilled_launcher(tmp_path):
    # bash is the direct child; python and sleep are grandchildren, which the death signal never reached.
    _killed_launcher(tmp_path, "echo $$ > {pids}/bash-$$; sleep 300 & echo $! > {pids}/sleep-$$; "
                               "{python} {task} {pids}; wait", "", 6)


def test_a_task_is_listed_with_the_reaper_before_its_launcher_learns_its_pid():
    # A launcher killed right after a task's Popen returned (a busy machine can stall it there) has told the
    # reaper nothing: the task listed its own group, between fork and exec, so the reaper still ends it.
    lifeline = mrun._Lifeline()
    task = subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=lifeline.in_new_task)
    try:
        lifeline.close()  # the launcher's end of the reaper's pipe closes: the reaper ends the groups it knows
        assert task.wait(timeout=120) in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        task.kill()
        task.wait()


def test_a_task_that_leaves_the_launchers_session_ends_through_the_pipe(tmp_path):
    # setsid: a session (and group) the reaper does not know; the task's `import mirrored` watches the pipe.
    _killed_launcher(tmp_path, "setsid {python} {task} {pids}; sleep 300", "import mirrored", 2)


def test_the_pipe_counts_only_when_it_was_inherited(monkeypatch, tmp_path):
    read_fd, write_fd = os.pipe()
    try:
        monkeypatch.setenv("MIRRORED_LAUNCHER_FD", launcher_lifeline.launcher_fd_value(read_fd))
        assert launcher_lifeline._inherited_pipe() == read_fd
        with open(tmp_path / "f", "w") as f:  # the number, but another file: a subprocess started with close_fds
            monkeypatch.setenv("MIRRORED_LAUNCHER_FD", f"{f.fileno()}:{os.fstat(read_fd).st_ino}")
            assert launcher_lifeline._inherited_pipe() is None
        for value in ("", "x", "7", f"{read_fd}:1", "²:1", "999999:1"):
            monkeypatch.setenv("MIRRORED_LAUNCHER_FD", value)
            assert launcher_lifeline._inherited_pipe() is None
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_finished_job_leaves_its_background_children_alone(tmp_path):
    # The reaper ends the groups of a killed launcher only: a job that ended by itself keeps its daemons.
    marker = tmp_path / "daemon"
    done = launch(["-np", "1", "bash", "-c", f"(sleep 300 & echo $! > {marker}) </dev/null >/dev/null 2>&1"])
    assert done.returncode == 0
    pid = int(marker.read_text())
    try:
        assert _alive(pid)  # the launcher waited for its reaper before exiting: a wrong kill would have landed
    finally:
        os.kill(pid, signal.SIGKILL)


# --- preemption, open files ---------------------------------------------------

def test_exit_42_restarts_the_job_after_the_others_saved(tmp_path):
    task = script(tmp_path, f"""
        import json, os, sys, time
        me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        attempt = os.environ["MIRRORED_RESTART_COUNT"]
        if attempt == "0":
            if me == 1:
                open({str(tmp_path / "preempted")!r}, "w").close()
                sys.exit(42)
            while not os.path.exists({str(tmp_path / "preempted")!r}):  # (worker:1 goes first, however slow to start)
                time.sleep(0.05)
            time.sleep(2)  # a slower save: the launcher must not cut it short
            sys.stdout.write("saved\\n")
            sys.exit(42)
        sys.stdout.write("resumed " + attempt + "\\n")
    """)
    done = launch(["-np", "2", sys.executable, task])  # no --max-restarts: preemption is not a failure
    assert done.returncode == 0, done.stderr.decode()
    assert by_task(done.stdout) == {"worker:0": ["saved", "resumed 1"], "worker:1": ["resumed 1"]}
    assert b"worker:1 exited with code 42 (restart); waiting up to 60 s for worker:0" in done.stderr
    assert b"restarting the job (preempted; worker:1 exited with 42)" in done.stderr


def test_a_low_open_file_limit_is_raised_when_it_can_be(tmp_path):
    done = subprocess.run(["sh", "-c", f"ulimit -Sn 64 && exec {sys.executable} -m mirrored.run -np 40 true"],
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()


def test_an_open_file_limit_too_low_for_the_job_is_named(tmp_path):
    done = subprocess.run(["sh", "-c", f"ulimit -n 256 && exec {sys.executable} -m mirrored.run -np 300 true"],
                          capture_output=True, timeout=120)
    assert done.returncode == 2
    assert b"-np 300: the launcher needs about 1264 open files for 300 local task(s), and the limit is 256 " \
           b"(ulimit -n)" in done.stderr
    assert b"Traceback" not in done.stderr
