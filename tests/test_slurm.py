"""``md.cluster_resolver.SlurmClusterResolver``: the job of an ``srun`` step, from a faked Slurm environment."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import mirrored as md
from mirrored.cluster_resolver import (SlurmClusterResolver, TFConfigClusterResolver, expand_hostlist,
                                       expand_tasks_per_node)

SLURM_VARS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


@pytest.fixture
def slurm(monkeypatch):
    """Sets a Slurm step's variables: slurm(procid, ntasks, nodelist, tasks_per_node)."""
    for name in SLURM_VARS + ("TF_CONFIG", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def set_step(procid, ntasks, nodelist, tasks_per_node):
        for name, value in zip(SLURM_VARS, (procid, ntasks, nodelist, tasks_per_node)):
            monkeypatch.setenv(name, str(value))

    return set_step


@pytest.mark.parametrize("hostlist, hosts", [
    ("node1", ["node1"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("r[1-2]n[1-2]-ib", ["r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"]),
    ("b,a,b", ["b", "a", "b"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["", "n[1-2", "n]1", "a,,b", "n[x]", "n[3-1]", "n[[1]]", "node[]", "n[1,]",
                                      "n[²]", "n[1-٣]"])
def test_expand_hostlist_rejects_malformed_lists(hostlist):
    with pytest.raises(ValueError, match="hostlist="):
        expand_hostlist(hostlist)


def test_a_huge_hostlist_is_refused_before_it_is_expanded():
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST='n\[0-50000000\]' names more than 65536 hosts"):
        expand_hostlist("n[0-50000000]", "SLURM_STEP_NODELIST")
    with pytest.raises(ValueError, match="more than 65536 hosts"):
        expand_hostlist("r[1-300]n[1-300]")  # each range is small, their product is not
    with pytest.raises(ValueError, match="more than 65536 nodes"):
        expand_tasks_per_node("1(x50000000)")
    assert time.monotonic() - started < 10  # was 27 s: nothing is expanded before the count is checked
    assert len(expand_hostlist("n[1-65536]")) == 65536


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match=r"N\(xK\)"):
        expand_tasks_per_node("2(3)")
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='²'"):
        expand_tasks_per_node("²", "SLURM_STEP_TASKS_PER_NODE")


@pytest.mark.parametrize("variable, value, words", [
    ("SLURM_PROCID", "²", "is not a task number"),
    ("SLURM_PROCID", "-1", "is not a task number"),
    ("SLURM_STEP_NUM_TASKS", "abc", "is not a number of tasks"),
    ("SLURM_STEP_NUM_TASKS", "٣", "is not a number of tasks"),
])
def test_a_malformed_slurm_number_is_named(slurm, monkeypatch, variable, value, words):
    slurm(0, 2, "n1", "2")
    monkeypatch.setenv(variable, value)
    with pytest.raises(RuntimeError, match=f"{variable}={value!r} {words}"):
        SlurmClusterResolver(gpus_per_node=0)


def test_a_malformed_slurm_nodelist_is_named(slurm):
    slurm(0, 2, "node[]", "2")
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST='node\[\]'"):
        SlurmClusterResolver(gpus_per_node=0)
    slurm(0, 2, "n[0-50000000]", "2")
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST='n\[0-50000000\]' names more than"):
        SlurmClusterResolver(gpus_per_node=0)


def test_cluster_from_the_step(slurm):
    slurm(3, 4, "node[1-2]", "2(x2)")
    r = SlurmClusterResolver(gpus_per_node=0)
    assert r.cluster_spec().as_dict() == {"worker": ["node1:8888", "node1:8889", "node2:8888", "node2:8889"]}
    assert (r.task_type, r.task_id) == ("worker", 3) == r.get_task_info()
    assert r.master() == "grpc://node2:8889"
    assert r.master("worker", 0) == "grpc://node1:8888"
    assert r.environment == ""
    assert r.num_accelerators() == {"GPU": 0}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_nodes_keep_slurm_order_and_uneven_task_counts(slurm):
    # Block distribution numbers tasks in node-list order: node10 after node9, not before node2.
    slurm(4, 5, "node[9-10]", "3,2")
    r = SlurmClusterResolver(port_base=2000, gpus_per_node=0)
    assert r.cluster_spec().as_dict() == {"worker": ["node9:2000", "node9:2001", "node9:2002",
                                                     "node10:2000", "node10:2001"]}
    assert r.task_id == 4


def test_jobs_split_tasks_in_sorted_type_order(slurm):
    slurm(0, 4, "a,b", "2(x2)")
    chief = SlurmClusterResolver(jobs={"worker": 3, "chief": 1}, gpus_per_node=0)
    assert chief.cluster_spec().as_dict() == {"chief": ["a:8888"], "worker": ["a:8889", "b:8888", "b:8889"]}
    assert (chief.task_type, chief.task_id) == ("chief", 0)
    slurm(2, 4, "a,b", "2(x2)")
    assert SlurmClusterResolver(jobs={"worker": 3, "chief": 1}, gpus_per_node=0).get_task_info() == ("worker", 1)


def test_tasks_per_node_argument(slurm):
    slurm(1, 2, "x,y", "9")  # tasks_per_node given: SLURM_STEP_TASKS_PER_NODE is not read
    r = SlurmClusterResolver(tasks_per_node=1, gpus_per_node=0)
    assert r.cluster_spec().as_dict() == {"worker": ["x:8888", "y:8888"]}
    r = SlurmClusterResolver(tasks_per_node={"h1": 1, "h2": 1}, gpus_per_node=0)
    assert r.cluster_spec().as_dict() == {"worker": ["h1:8888", "h2:8888"]}


def test_gpus_are_shared_out_per_task(slurm):
    slurm(1, 4, "n[1-2]", "2(x2)")
    r = SlurmClusterResolver(gpus_per_node=4)
    assert r.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_gpus_already_limited_by_slurm_are_numbered_within_that_list(slurm, monkeypatch):
    slurm(2, 4, "n[1-2]", "2(x2)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    r = SlurmClusterResolver()  # gpus_per_node from CUDA_VISIBLE_DEVICES: 4
    assert r.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_auto_set_gpu_false_leaves_cuda_visible_devices(slurm, monkeypatch):
    slurm(1, 2, "n1", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    SlurmClusterResolver(auto_set_gpu=False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_impossible_layouts_raise(slurm):
    slurm(0, 4, "n[1-2]", "2(x2)")
    with pytest.raises(RuntimeError, match="more GPUs per node than available"):
        SlurmClusterResolver(gpus_per_node=2, gpus_per_task=2)
    with pytest.raises(RuntimeError, match="Requested 3 tasks"):
        SlurmClusterResolver(jobs={"worker": 3}, gpus_per_node=0)
    with pytest.raises(ValueError, match="jobs="):
        SlurmClusterResolver(jobs={"worker": "4"}, gpus_per_node=0)
    with pytest.raises(ValueError, match="port_base="):
        SlurmClusterResolver(port_base=70000, gpus_per_node=0)
    with pytest.raises(ValueError, match="cluster\\['chief'\\] must list exactly one task"):
        SlurmClusterResolver(jobs={"chief": 2, "worker": 2}, gpus_per_node=0)
    slurm(0, 4, "n[1-3]", "2(x2)")
    with pytest.raises(RuntimeError, match="SLURM_STEP_TASKS_PER_NODE gives 2 node"):
        SlurmClusterResolver(gpus_per_node=0)
    slurm(7, 4, "n[1-2]", "2(x2)")
    with pytest.raises(RuntimeError, match="SLURM_PROCID=7"):
        SlurmClusterResolver(gpus_per_node=0)


def test_outside_slurm_the_missing_variable_is_named(slurm):
    with pytest.raises(RuntimeError, match="SLURM_PROCID is not set"):
        SlurmClusterResolver()


def test_strategy_picks_slurm_without_tf_config(slurm, monkeypatch):
    slurm(0, 1, "127.0.0.1", "1")
    strategy = md.MultiWorkerMirroredStrategy()
    assert isinstance(strategy.cluster_resolver, SlurmClusterResolver)
    assert strategy.cluster_resolver.cluster_spec().as_dict() == {"worker": ["127.0.0.1:8888"]}
    assert strategy.num_replicas_in_sync == 1
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:2222"]},
                                                "task": {"type": "worker", "index": 0}}))
    assert isinstance(md.MultiWorkerMirroredStrategy().cluster_resolver, TFConfigClusterResolver)


def test_a_batch_script_without_an_srun_step_is_not_a_slurm_job(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")  # set in an sbatch script too; the step variables come from srun
    assert isinstance(md.MultiWorkerMirroredStrategy().cluster_resolver, TFConfigClusterResolver)


def test_no_slurm_no_tf_config_is_one_local_worker(slurm):
    strategy = md.MultiWorkerMirroredStrategy()
    assert isinstance(strategy.cluster_resolver, TFConfigClusterResolver)
    assert strategy.num_replicas_in_sync == 1


@pytest.mark.multiworker
def test_an_srun_step_forms_a_job_on_loopback(tmp_path):
    pytest.importorskip("mirrored._net", reason="Gloo not built (apt-get install libgloo-dev)")
    from multiworker_launch import free_ports

    port = free_ports(1)[0]
    task = tmp_path / "task.py"
    task.write_text(textwrap.dedent(f"""
        import numpy as np
        import mirrored as md
        resolver = md.cluster_resolver.SlurmClusterResolver(port_base={port})
        strategy = md.MultiWorkerMirroredStrategy(resolver, md.CommunicationOptions(timeout_seconds=30))
        me = resolver.task_id
        total = strategy.reduce("sum", strategy.run(lambda: np.float64(me + 1)), axis=None)
        print(resolver.task_type, me, strategy.num_replicas_in_sync, float(total))
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="127.0.0.1", SLURM_STEP_TASKS_PER_NODE="2")
    procs = [subprocess.Popen([sys.executable, str(task)], env=dict(env, SLURM_PROCID=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        finally:
            p.kill()
        assert p.returncode == 0, err.decode()
        outs.append(out.decode().split())
    assert outs == [["worker", "0", "2", "3.0"], ["worker", "1", "2", "3.0"]]
