"""md.distribute.experimental.rpc: TF 2.21's Server/Client on loopback, against TF's recorded behaviour
(tests/data/tf_rpc_reference.json, by tests/data/record_tf_rpc.py) and NumPy; a server in another process
(``multiworker``); the failures by TF's codes and types; clean shutdown."""

import gc
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import mirrored as md
from mirrored import errors
from mirrored.tools.run import free_ports
from recorded_results import PYTHON_ERRORS, nest

rpc = md.distribute.experimental.rpc
TensorSpec = md.data.TensorSpec
REFERENCE = json.loads(pathlib.Path(__file__).with_name("data").joinpath("tf_rpc_reference.json").read_text())
DEADLINE = 120.0  # seconds: generous, for a busy machine (only a failing test waits this long)


def with_signature(*specs):
    def attach(fn):
        fn.input_signature = list(specs)
        return fn
    return attach


@with_signature(TensorSpec([], np.int32), TensorSpec([], np.int32))
def addition(a, b):
    return a + b


@with_signature(TensorSpec([None], np.float32))
def nested(x):
    return {"sum": x.sum(dtype=np.float32), "pair": (x * np.float32(2), np.int64(x.size))}


@with_signature()
def constant():
    return np.array([1.5, 2.5])


@with_signature()
def returns_nothing():
    return None


@with_signature(TensorSpec([], np.float32))
def check_positive(x):
    if not x > 0:
        raise errors.InvalidArgumentError(None, None, "assertion failed: [x must be positive.  ]")
    return x


def raiser(error):
    @with_signature(TensorSpec([], np.float32))
    def method(x):
        raise error
    return method


class Served:
    """A started server with the recorder's methods, one client, and what the test hands in (``release``)."""

    def __init__(self, timeout_in_ms=0):
        self.release = threading.Event()
        self.server = rpc.Server.create("grpc", "localhost:0")
        for name, fn in [("addition", addition), ("nested", nested), ("constant", constant),
                         ("check_positive", check_positive), ("returns_nothing", returns_nothing)]:
            self.server.register(name, fn)
        for name, error in PYTHON_ERRORS.items():
            self.server.register("raise_" + name, raiser(error))
        self.server.register("wait", self._wait)
        self.server.start()
        self.address = f"localhost:{self.server.port}"
        self.client = rpc.Client.create("grpc", self.address, name="test", timeout_in_ms=timeout_in_ms)

    @with_signature(TensorSpec([], np.float32))
    def _wait(self, x):
        assert self.release.wait(DEADLINE)
        return x

    def close(self):
        self.release.set()
        self.client.close()
        self.server.stop()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def status(result) -> dict:
    code, message = result.get_error()
    return {"is_ok": bool(result.is_ok()), "code": int(code), "message": message.item().decode()}


def threads_named(prefix: str) -> list:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while gc.collect() >= 0 and not condition():  # (a client an error left behind ends when collected)
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# --- values, against TF's recording -------------------------------------------------------------------------

def test_reference_is_tf_2_21():
    assert REFERENCE["tensorflow"] == "2.21.0"


def test_values_as_tf_returns_them(served):
    a, b = np.int32(2), np.int32(3)
    x = np.array([1.0, 2.0, 4.0], np.float32)
    client = served.client
    got = {
        "call_with_specs": client.call("addition", [a, b], output_specs=TensorSpec((), np.int32)),
        "method_attribute": client.addition(a, b),
        "nested_attribute": client.nested(x),
        "nested_call_specs": client.call("nested", [x], output_specs={
            "sum": TensorSpec([], np.float32), "pair": (TensorSpec([None], np.float32), TensorSpec([], np.int64))}),
        "no_args": client.constant(),
        "returns_nothing": client.returns_nothing(),
        "within_timeout": client.wait(np.float32(0.01), timeout_in_ms=600_000),
    }
    served.release.set()
    for name, result in got.items():
        want = REFERENCE[name]
        assert status(result) == {k: want[k] for k in ("is_ok", "code", "message")}, name
        assert nest(result.get_value()) == want["get_value"]["value"], name
    assert nest(client.addition_blocking(a, b)) == REFERENCE["method_blocking"]["value"]


def test_client_has_an_attribute_and_a_blocking_one_per_registered_method(served):
    tf_names = set(REFERENCE["client_attributes"]) - {"slow", "slow_blocking"}  # (our slow method is "wait")
    ours = {name for name in dir(served.client) if not name.startswith("_")}
    python_errors = {f"raise_{n}{suffix}" for n in PYTHON_ERRORS for suffix in ("", "_blocking")}
    assert ours == tf_names | python_errors | {"wait", "wait_blocking", "close"}
    assert served.client.addition.__doc__ == f"RPC Call for addition method to server {served.address}"


def test_call_without_output_specs_as_tf(served):
    result = served.client.call("addition", [np.int32(2), np.int32(3)])
    want = REFERENCE["call_without_specs"]
    assert status(result) == {k: want[k] for k in ("is_ok", "code", "message")}
    with pytest.raises(errors.InvalidArgumentError, match="output_specs=None expects none: pass output_specs"):
        result.get_value()
    assert served.client.call("returns_nothing").get_value() is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(["float32", "float64", "float16", "int8", "int32", "int64", "uint8", "bool",
                              "complex64"]),
       shape=st.lists(st.integers(0, 5), max_size=3), nest=st.sampled_from(["flat", "tuple", "dict"]))
def test_results_match_numpy_over_dtypes_shapes_and_nests(served_module, dtype, shape, nest):
    rng = np.random.default_rng(len(shape) * 7 + sum(shape))
    x, y = ((np.abs(rng.standard_normal(shape)) * 10 % 50).astype(dtype) for _ in range(2))  # (sums fit int8)
    args = {"flat": [x, y], "tuple": [(x, y)], "dict": [{"x": x, "y": y}]}[nest]
    got = served_module.client.call("combine", args, output_specs={
        "sum": TensorSpec(shape, dtype), "first": TensorSpec(shape, dtype), "count": TensorSpec([], np.int64)})
    value = got.get_value()
    np.testing.assert_array_equal(value["sum"], x + y)  # (flat args, in TF's order: dict keys sorted)
    assert value["sum"].dtype == np.dtype(dtype) and value["sum"].shape == tuple(shape)
    np.testing.assert_array_equal(value["first"], x)
    assert value["count"] == x.size
    np.testing.assert_array_equal(served_module.client.echo_blocking(x), x)


def combine(x, y):
    return {"sum": x + y, "first": x, "count": np.int64(x.size)}


@pytest.fixture
def served_module():
    s = Served()
    s.server.register("combine", combine)
    s.server.register("echo", lambda x: x)
    s.client = rpc.Client.create("grpc", s.address)  # (lists "combine" and "echo" too)
    yield s
    s.close()


def test_input_signature_nests_the_flat_arguments(served):
    @with_signature((TensorSpec([2], np.float64), TensorSpec([], np.int32)), TensorSpec([None, 2], np.float64))
    def scaled(pair, matrix):
        vector, k = pair
        return matrix @ vector * k

    served.server.register("scaled", scaled)
    client = rpc.Client.create("grpc", served.address)
    vector, matrix = np.array([1.0, 2.0]), np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(client.scaled_blocking((vector, np.int32(3)), matrix), matrix @ vector * 3)
    bad = client.call("scaled", [vector, np.int32(3), np.ones((3, 3))])
    with pytest.raises(errors.InvalidArgumentError, match=r"Expects arg\[2\] to be float64\[None, 2\] but "
                                                          r"float64\[3, 3\] is provided"):
        bad.get_value()
    client.close()


def test_md_function_registers_and_a_plain_callable_needs_no_signature(served):
    served.server.register("square", md.function(lambda x: x * x))
    served.server.register("plain", lambda x, y: (y, x))
    client = rpc.Client.create("grpc", served.address)
    np.testing.assert_array_equal(client.square_blocking(np.arange(4)), np.arange(4) ** 2)
    assert client.plain_blocking(1, 2.5) == (np.float32(2.5), np.int32(1))  # (Python numbers convert as TF's)
    assert client.plain_blocking(1, 2.5)[1].dtype == np.int32
    client.close()


# --- asynchrony, concurrency ---------------------------------------------------------------------------------

def test_call_returns_before_the_method_finishes(served):
    result = served.client.wait(np.float32(7))
    assert not result._future.done()  # the method is waiting for the test
    served.release.set()
    assert bool(result.is_ok()) and result.get_value() == np.float32(7)


def test_concurrent_calls_from_several_threads(served):
    together = threading.Barrier(4, timeout=DEADLINE)
    served.server.register("meet", lambda x: (together.wait(), x * 2)[1])
    client = rpc.Client.create("grpc", served.address)
    results, failures = {}, []

    def caller(i):
        try:
            results[i] = [client.meet_blocking(np.int64(i)), client.addition_blocking(np.int32(i), np.int32(i))]
        except BaseException as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]  # all 4 in the method at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not failures and results == {i: [2 * i, 2 * i] for i in range(4)}
    pending = [client.addition(np.int32(i), np.int32(1)) for i in range(100)]
    assert [int(p.get_value()) for p in pending] == [i + 1 for i in range(100)]
    client.close()


# --- failures: TF's codes, types and words -------------------------------------------------------------------

def assert_status_as_tf(result, name: str, words: str):
    want = REFERENCE[name]
    got = status(result)
    assert (got["is_ok"], got["code"]) == (want["is_ok"], want["code"]), name
    assert words in got["message"] and words in want["message"], name
    with pytest.raises(getattr(errors, want["get_value"]["raises"])) as raised:
        result.get_value()
    if want["code"] != errors.OUT_OF_RANGE:  # (md.errors.OutOfRangeError is a StopIteration, without a code)
        assert raised.value.error_code == want["code"]
    return raised.value


def test_unknown_method(served):
    result = served.client.call("no_such_method", [np.int32(2)], output_specs=TensorSpec((), np.int32))
    error = assert_status_as_tf(result, "unknown_method", "no_such_method is not registered.")
    assert "register it with server.register('no_such_method', func)" in str(error)


def test_exception_in_the_method(served):
    error = assert_status_as_tf(served.client.check_positive(np.float32(-1)), "method_raises",
                                "assertion failed: [x must be positive.  ]")
    assert "Traceback on the task at" in str(error)
    with pytest.raises(errors.InvalidArgumentError, match="x must be positive"):
        served.client.check_positive_blocking(np.float32(-1))


@pytest.mark.parametrize("name", sorted(PYTHON_ERRORS))
def test_python_exceptions_get_tfs_codes(served, name):
    error = PYTHON_ERRORS[name]
    raised = assert_status_as_tf(getattr(served.client, "raise_" + name)(np.float32(1)), "python_" + name,
                                 f"{type(error).__name__}: {error}")
    assert type(raised.__cause__) is type(error)  # the remote exception itself, as the cause
    assert type(raised).__name__ == REFERENCE[f"python_{name}_blocking"]["raises"]


def test_arguments_that_do_not_fit_the_signature(served):
    with pytest.raises(ValueError, match="don't have the same nested structure"):
        served.client.addition(np.int32(2))
    assert REFERENCE["wrong_arg_structure"]["raises"] == "ValueError"
    assert_status_as_tf(served.client.call("addition", [np.float32(2), np.float32(3)],
                                           output_specs=TensorSpec((), np.int32)),
                        "wrong_arg_dtype", "Expects arg[0] to be int32")
    result = served.client.call("addition", [np.int32(2)], output_specs=TensorSpec((), np.int32))
    assert status(result)["code"] == REFERENCE["wrong_arg_count"]["code"]
    with pytest.raises(errors.InvalidArgumentError, match=r"addition takes 2 tensor\(s\).*1 given"):
        result.get_value()
    with pytest.raises(errors.InvalidArgumentError, match="which output_specs=.* do not describe"):
        served.client.call("addition", [np.int32(2), np.int32(3)],
                           output_specs=TensorSpec((), np.float32)).get_value()


def test_timeout_then_the_client_goes_on(served):
    result = served.client.wait(np.float32(3), timeout_in_ms=200)
    assert_status_as_tf(result, "timeout", "Deadline Exceeded")
    with pytest.raises(errors.DeadlineExceededError, match="did not answer within 200 ms; raise timeout_in_ms"):
        served.client.wait_blocking(np.float32(3), timeout_in_ms=200)
    assert REFERENCE["timeout_blocking"]["raises"] == "DeadlineExceededError"
    served.release.set()
    assert served.client.addition_blocking(np.int32(1), np.int32(2)) == 3  # (fresh connections)


def test_the_clients_default_timeout():
    s = Served(timeout_in_ms=200)
    try:
        assert int(s.client.wait(np.float32(1)).get_error()[0]) == errors.DEADLINE_EXCEEDED
        s.release.set()
        assert s.client.wait_blocking(np.float32(1), timeout_in_ms=600_000) == 1
    finally:
        s.close()


def test_server_down():
    port = free_ports(1)[0]
    with pytest.raises(errors.DeadlineExceededError) as raised:
        rpc.Client.create("grpc", f"localhost:{port}", timeout_in_ms=300)
    assert type(raised.value).__name__ == REFERENCE["server_down_create"]["raises"]
    client = rpc.GrpcClient(f"localhost:{port}", timeout_in_ms=300)
    assert int(client.call("addition", [1, 2]).get_error()[0]) == REFERENCE["server_down_call"]["value"]["dict"][
        "code"]["v"]
    client.close()


def test_server_stopped_while_the_client_is_connected(served):
    assert served.client.addition_blocking(np.int32(1), np.int32(2)) == 3
    served.server.stop()
    result = served.client.addition(np.int32(1), np.int32(2))
    assert int(result.get_error()[0]) == errors.UNAVAILABLE
    with pytest.raises(errors.UnavailableError, match=f"the RPC server at {served.address} is unavailable.*start it"):
        result.get_value()


def test_bad_arguments_name_the_argument_and_the_fix(served):
    for create in (lambda layer: rpc.Server.create(layer, "localhost:0"),
                   lambda layer: rpc.Client.create(layer, served.address)):
        with pytest.raises(ValueError, match=REFERENCE["bad_rpc_layer_server"]["msg"]) as raised:
            create("tcp")
        assert "rpc_layer='tcp'" in str(raised.value) and "Pass rpc_layer='grpc'" in str(raised.value)
    for address in ("localhost", "localhost:port", 2345, ":2345", "localhost:70000"):
        with pytest.raises(ValueError, match=r"address=.*expected 'host:port'"):
            rpc.Client.create("grpc", address)
    with pytest.raises(ValueError, match=r"timeout_in_ms=-1: a whole number of milliseconds"):
        rpc.Client.create("grpc", served.address, timeout_in_ms=-1)
    with pytest.raises(ValueError, match=r"timeout_in_ms=0.5"):
        served.client.call("addition", [1, 2], timeout_in_ms=0.5)
    with pytest.raises(TypeError, match=r"method_name=3: the name the method is registered under"):
        served.client.call(3)
    with pytest.raises(ValueError, match="Only functions are supported with Register method"):
        served.server.register("not_callable", 3)
    assert REFERENCE["register_plain_callable"]["raises"] == "ValueError"
    with pytest.raises(TypeError, match=r"func.input_signature=.*a list of md.data.TensorSpec"):
        served.server.register("bad_signature", with_signature("int32")(lambda x: x))
    with pytest.raises(TypeError, match=r"args\[0\] of addition: a value of type object"):
        served.client.call("addition", [object(), 1])
    busy = rpc.Server.create("grpc", served.address)
    with pytest.raises(OSError, match="cannot listen on .* another process may hold the port"):
        busy.start()


def test_a_result_that_is_not_a_tensor(served):
    served.server.register("lock", lambda: threading.Lock())
    served.server.register("bad_error", lambda: (_ for _ in ()).throw(Unpicklable()))
    client = rpc.Client.create("grpc", served.address)
    result = client.lock()
    assert int(result.get_error()[0]) == errors.INVALID_ARGUMENT
    with pytest.raises(errors.InvalidArgumentError, match="the result of lock: a value of type lock"):
        result.get_value()
    with pytest.raises(errors.UnknownError, match="Unpicklable: cannot be pickled"):
        client.bad_error_blocking()
    client.close()


class Unpicklable(Exception):
    def __init__(self):
        super().__init__("cannot be pickled")
        self.lock = threading.Lock()


def test_a_client_of_another_token_is_refused(served, monkeypatch):
    monkeypatch.setenv("MIRRORED_JOB_TOKEN", "not-the-servers")
    client = rpc.GrpcClient(served.address)
    assert int(client.call("addition", [1, 2]).get_error()[0]) == errors.UNAVAILABLE
    client.close()


# --- shutdown --------------------------------------------------------------------------------------------------

def open_sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_stop_and_close_leave_no_threads_or_sockets():
    wait_until(lambda: not threads_named("mirrored-rpc"), "threads of earlier tests")
    sockets = open_sockets()
    s = Served()
    results = [s.client.addition(np.int32(i), np.int32(i)) for i in range(8)]
    assert [int(r.get_value()) for r in results] == [2 * i for i in range(8)]
    assert threads_named("mirrored-rpc-client") and threads_named("mirrored-rpc-server")
    in_flight = s.client.wait(np.float32(1))  # (its connection is closed when it ends, after close())
    s.close()
    in_flight.get_error()
    with pytest.raises(errors.UnavailableError, match="the client of .* is closed"):
        s.client.addition_blocking(np.int32(1), np.int32(1))
    wait_until(lambda: not threads_named("mirrored-rpc"), "threads after stop() and close()")
    assert open_sockets() == sockets


def test_deleted_server_and_client_stop():
    wait_until(lambda: not threads_named("mirrored-rpc"), "threads of earlier tests")
    server = rpc.Server.create("grpc", "localhost:0")
    server.register("addition", addition)
    server.start()
    client = rpc.Client.create("grpc", f"localhost:{server.port}")
    assert client.addition_blocking(np.int32(1), np.int32(1)) == 2
    del server, client
    wait_until(lambda: not threads_named("mirrored-rpc"), "threads after the server and client were deleted")


# --- a server in another process -----------------------------------------------------------------------------

SERVER_PROCESS = """
import sys, numpy as np, mirrored as md
def add(a, b):
    return a + b
add.input_signature = [md.data.TensorSpec([None], np.float32)] * 2
server = md.distribute.experimental.rpc.Server.create("grpc", "127.0.0.1:0")
server.register("add", add)
server.register("stats", lambda x: {"mean": x.mean(), "shape": np.array(x.shape)})
server.register("fail", lambda: {}["missing"])
server.start()
print(server.port, flush=True)
sys.stdin.read()  # serves until the test closes stdin
server.stop()
"""


@pytest.mark.multiworker
def test_a_server_in_another_process():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(md.__file__)))
    process = subprocess.Popen([sys.executable, "-c", SERVER_PROCESS], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = f"127.0.0.1:{int(process.stdout.readline())}"
        client = rpc.Client.create("grpc", address, timeout_in_ms=int(DEADLINE * 1000))
        a, b = np.arange(5, dtype=np.float32), np.full(5, 0.5, np.float32)
        np.testing.assert_array_equal(client.add_blocking(a, b), a + b)
        big = np.random.default_rng(0).standard_normal((256, 1024))
        value = client.stats_blocking(big)
        assert value["mean"] == big.mean() and value["shape"].tolist() == [256, 1024]
        with pytest.raises(errors.UnknownError, match="KeyError: 'missing'"):
            client.fail_blocking()
        process.stdin.close()
        assert process.wait(DEADLINE) == 0
        assert int(client.add(a, b).get_error()[0]) == errors.UNAVAILABLE
        client.close()
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
        if not process.stdin.closed:
            process.stdin.close()


# --- md.errors' coded types -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, code, python_type", [
    (errors.UnknownError, errors.UNKNOWN, RuntimeError), (errors.InvalidArgumentError, 3, ValueError),
    (errors.DeadlineExceededError, 4, TimeoutError), (errors.UnimplementedError, 12, NotImplementedError),
    (errors.UnavailableError, 14, ConnectionError)])
def test_coded_errors_are_tfs_and_pythons(kind, code, python_type):
    import pickle
    error = kind(None, None, "the words")  # TF's constructor: (node_def, op, message)
    assert isinstance(error, errors.OpError) and isinstance(error, python_type)
    assert (error.error_code, error.message, str(error), error.node_def, error.op) == (code, "the words",
                                                                                       "the words", None, None)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is kind and again.message == "the words"
