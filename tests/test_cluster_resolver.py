"""TF_CONFIG parsing and validation: what a launcher writes, and the ways it goes wrong."""

import json

import pytest

from mirrored import cluster_resolver as cr

CLUSTER = {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]}


def tf_config(monkeypatch, config):
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


def test_tf_config_cluster_and_task(monkeypatch):
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"})
    r = cr.TFConfigClusterResolver()
    spec = r.cluster_spec()
    assert spec.as_dict() == CLUSTER
    assert spec.jobs == ["chief", "worker", "ps"]  # the cluster's order, as TensorFlow lists them
    assert spec.num_tasks("worker") == 2 and spec.task_address("worker", 1) == "host2:2222"
    assert (r.task_type, r.task_id, r.rpc_layer) == ("worker", 1, "grpc")
    assert r.master() == "grpc://host2:2222"
    assert r.master("chief", 0, rpc_layer="") == "grpc://host0:2222"
    assert cr.collective_tasks(spec) == [("chief", 0), ("worker", 0), ("worker", 1)]
    assert isinstance(r.num_accelerators(), dict)


def test_no_tf_config_is_a_single_local_worker(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = cr.TFConfigClusterResolver()
    assert not r.cluster_spec() and r.cluster_spec().as_dict() == {}
    assert r.task_type is None and r.task_id is None
    assert r.master() == ""


def test_arguments_override_tf_config(monkeypatch):
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 1}})
    r = cr.TFConfigClusterResolver(task_type="chief", task_id=0)
    assert (r.task_type, r.task_id) == ("chief", 0)


def test_string_index_and_sparse_jobs(monkeypatch):
    tf_config(monkeypatch, {"cluster": {"worker": {"0": "a:1", "3": "b:2"}}, "task": {"type": "worker", "index": "3"}})
    r = cr.TFConfigClusterResolver()
    assert r.task_id == 3
    assert r.cluster_spec().task_indices("worker") == [0, 3]
    assert r.cluster_spec().job_tasks("worker") == ["a:1", None, None, "b:2"]


def test_evaluator_may_run_outside_the_cluster(monkeypatch):
    tf_config(monkeypatch, {"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": 0}})
    assert cr.TFConfigClusterResolver().task_type == "evaluator"


@pytest.mark.parametrize("config, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"cluster": ["a:1"]}, "TF_CONFIG['cluster'] must be an object"),
    ({"cluster": {"trainer": ["a:1"]}, "task": {"type": "trainer", "index": 0}}, "unknown task type 'trainer'"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}}, "unknown task type 'master'"),
    ({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}, "out of range"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}, "non-negative integer"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}, "has no tasks in cluster"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}, "has no 'type'"),
    ({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}, "share the address 'a:1'"),
    ({"cluster": {"chief": ["a:1"], "worker": ["a:1"]}}, "chief:0 share the address"),
    ({"cluster": {"chief": ["a:1", "b:1"]}}, "exactly one task"),
    ({"cluster": {"worker": ["a"]}}, "not 'host:port'"),
    ({"cluster": {"worker": ["a:99999"]}}, "port in 1..65535"),
    ({"cluster": {"worker": "a:1"}}, "expected a list"),
])
def test_malformed_tf_config_raises_naming_the_problem(monkeypatch, config, message):
    tf_config(monkeypatch, config)
    with pytest.raises(ValueError, match="TF_CONFIG|cluster") as info:
        cr.TFConfigClusterResolver()
    assert message in str(info.value)


def test_simple_cluster_resolver():
    r = cr.SimpleClusterResolver(cr.ClusterSpec({"worker": ["a:1", "b:2"]}), task_type="worker", task_id=1,
                                 num_accelerators={"GPU": 2}, rpc_layer="grpc")
    assert r.cluster_spec() == cr.ClusterSpec({"worker": ["a:1", "b:2"]})
    assert r.master() == "grpc://b:2"
    assert r.num_accelerators() == {"GPU": 2}
    assert cr.SimpleClusterResolver({"worker": ["a:1"]}, master="grpc://x:1").master() == "grpc://x:1"
    r.task_id = 0
    assert r.task_id == 0
    with pytest.raises(ValueError, match="out of range"):
        cr.SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=5)
    with pytest.raises(ValueError, match="job_name='ps' is not in the cluster"):
        r.cluster_spec().num_tasks("ps")
