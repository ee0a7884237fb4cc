"""Record TensorFlow's names of a ParameterServerStrategy's ShardedVariable and of its shards (named, unnamed,
under a name scope; a scalar, and one row, which stay whole): tests/data/tf_sharded_names_reference.json, read by
tests/test_parameter_server_strategy.py.

Run with the TensorFlow side venv (never imported by the package or its tests); it starts an in-process cluster
(one worker, two ps tasks) on free loopback ports:
    /work/venvs/tf/bin/python tests/data/record_tf_sharded_names.py
"""

import json
import pathlib
import socket

import tensorflow as tf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    cluster = {"worker": [f"localhost:{free_port()}"], "ps": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    spec = tf.train.ClusterSpec(cluster)
    servers = [tf.distribute.Server(spec, job_name=job, task_index=i, protocol="grpc", start=True)
               for job in cluster for i in range(len(cluster[job]))]
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc"),
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(3))
    cases = {}
    with strategy.scope():
        made = {"named": tf.Variable(tf.zeros([7, 2]), name="emb"),
                "unnamed": tf.Variable(tf.zeros([5])),
                "nested_name": tf.Variable(tf.zeros([2, 2]), name="outer/inner"),
                "scalar": tf.Variable(1.0, name="scalar"),
                "one_row": tf.Variable(tf.zeros([1, 3]), name="row")}
        with tf.name_scope("scope"):
            made["in_name_scope"] = tf.Variable(tf.zeros([4]), name="table")
            made["unnamed_in_name_scope"] = tf.Variable(tf.zeros([4]))
    for case, v in made.items():
        shards = getattr(v, "variables", None)
        cases[case] = {"sharded": shards is not None, "name": v.name,
                       "shards": None if shards is None else [s.name for s in shards],
                       "shapes": None if shards is None else [s.shape.as_list() for s in shards]}
    out = pathlib.Path(__file__).with_name("tf_sharded_names_reference.json")
    out.write_text(json.dumps({"tf_version": tf.__version__, "cases": cases}, indent=1) + "\n")
    print(json.dumps(cases, indent=1))
    del servers


if __name__ == "__main__":
    main()
