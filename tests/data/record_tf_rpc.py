"""Record TensorFlow 2.21's tf.distribute.experimental.rpc on localhost: values, the per-method attributes of a
client, and the error codes, types and words of each failure: tests/data/tf_rpc_reference.json, read by
tests/test_rpc.py.

Run with the TensorFlow side venv (never imported by the package or its tests):
    /work/venvs/tf/bin/python tests/data/record_tf_rpc.py
"""

import json
import os
import pathlib
import re
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # (the tests folder)
from recorded_results import PYTHON_ERRORS, nest  # noqa: E402

rpc = tf.distribute.experimental.rpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attempt(fn):
    try:
        return {"value": nest(fn())}
    except Exception as e:  # TF's refusal: type and words
        message = getattr(e, "message", None) or e.args[0] if e.args else ""
        # (TF's blocking wrapper builds its error with the message as bytes: str(e) itself fails then)
        return {"raises": type(e).__name__, "msg": message.decode() if isinstance(message, bytes) else str(message)}


def status(result):
    """is_ok, the error code and message, and what get_value does, of one StatusOrResult."""
    code, message = result.get_error()
    return {"is_ok": bool(result.is_ok().numpy()), "code": int(code.numpy()), "message": message.numpy().decode(),
            "get_value": attempt(result.get_value)}


@tf.function(input_signature=[tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32)])
def addition(a, b):
    return a + b


@tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
def nested(x):
    return {"sum": tf.reduce_sum(x), "pair": (x * 2.0, tf.cast(tf.size(x), tf.int64))}


@tf.function(input_signature=[])
def constant():
    return tf.constant([1.5, 2.5], tf.float64)


@tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
def check_positive(x):
    tf.debugging.assert_positive(x, message="x must be positive")
    return x


@tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
def slow(seconds):
    return tf.numpy_function(lambda s: (time.sleep(float(s)), s)[1], [seconds], tf.float32)


@tf.function(input_signature=[])
def returns_nothing():
    return None


def raiser(error):
    def fail(x):
        raise error

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
    def method(x):
        return tf.numpy_function(fail, [x], tf.float32)
    return method


def main():
    out = {"tensorflow": tf.__version__}
    address = f"localhost:{free_port()}"
    out["bad_rpc_layer_server"] = attempt(lambda: rpc.Server.create("tcp", address))
    out["bad_rpc_layer_client"] = attempt(lambda: rpc.Client.create("tcp", address))
    server = rpc.Server.create("grpc", address)
    for name, fn in [("addition", addition), ("nested", nested), ("constant", constant),
                     ("check_positive", check_positive), ("slow", slow), ("returns_nothing", returns_nothing)]:
        server.register(name, fn)
    for name, error in PYTHON_ERRORS.items():
        server.register("raise_" + name, raiser(error))
    out["register_plain_callable"] = attempt(lambda: server.register("plain", lambda a: a))
    out["register_without_signature"] = attempt(lambda: server.register("nosig", tf.function(lambda a: a)))
    server.start()

    client = rpc.Client.create("grpc", address, name="recorder")
    out["client_attributes"] = sorted(a for a in dir(client) if not a.startswith("_"))
    a, b = tf.constant(2, tf.int32), tf.constant(3, tf.int32)
    out["call_with_specs"] = status(client.call("addition", [a, b], output_specs=tf.TensorSpec((), tf.int32)))
    out["call_without_specs"] = status(client.call("addition", [a, b]))
    out["method_attribute"] = status(client.addition(a, b))
    out["method_blocking"] = attempt(lambda: client.addition_blocking(a, b))
    x = tf.constant([1.0, 2.0, 4.0])
    out["nested_attribute"] = status(client.nested(x))
    out["nested_call_specs"] = status(client.call(
        "nested", [x], output_specs={"sum": tf.TensorSpec([], tf.float32),
                                     "pair": (tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64))}))
    out["no_args"] = status(client.constant())
    out["returns_nothing"] = status(client.returns_nothing())
    out["unknown_method"] = status(client.call("no_such_method", [a], output_specs=tf.TensorSpec((), tf.int32)))
    out["method_raises"] = status(client.check_positive(tf.constant(-1.0)))
    out["method_raises_blocking"] = attempt(lambda: client.check_positive_blocking(tf.constant(-1.0)))
    out["wrong_arg_structure"] = attempt(lambda: client.addition(a))
    out["wrong_arg_dtype"] = status(client.call("addition", [tf.constant(2.0), tf.constant(3.0)],
                                                output_specs=tf.TensorSpec((), tf.int32)))
    out["wrong_arg_count"] = status(client.call("addition", [a], output_specs=tf.TensorSpec((), tf.int32)))
    out["timeout"] = status(client.slow(tf.constant(3.0), timeout_in_ms=200))
    out["timeout_blocking"] = attempt(lambda: client.slow_blocking(tf.constant(3.0), timeout_in_ms=200))
    out["within_timeout"] = status(client.slow(tf.constant(0.01), timeout_in_ms=60000))
    other = rpc.Client.create("grpc", address, name="other")
    out["second_client_same_server"] = attempt(lambda: other.addition_blocking(a, b))
    for name in PYTHON_ERRORS:
        out["python_" + name] = status(getattr(client, "raise_" + name)(tf.constant(1.0)))
        out["python_" + name + "_blocking"] = attempt(lambda: getattr(client, "raise_" + name + "_blocking")(
            tf.constant(1.0)))
    down = f"localhost:{free_port()}"
    out["server_down_create"] = attempt(lambda: rpc.Client.create("grpc", down, timeout_in_ms=500))
    from tensorflow.python.distribute.experimental.rpc import rpc_ops
    out["server_down_call"] = attempt(lambda: status(
        rpc_ops.GrpcClient(down, list_registered_methods=False, timeout_in_ms=500).call(
            "addition", [a, b], output_specs=tf.TensorSpec((), tf.int32))))
    path = pathlib.Path(__file__).with_name("tf_rpc_reference.json")
    text = json.dumps(out, indent=1, sort_keys=True)
    # TF's tracebacks inside its messages name this machine's files: keep only their base names.
    text = re.sub(r"/(?:[\w.+-]+/)+([\w.+-]+\.py)", r"\1", text)
    path.write_text(text + "\n")


if __name__ == "__main__":
    main()
