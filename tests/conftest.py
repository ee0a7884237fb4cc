"""Fixtures of the Strategy-layer tests: MirroredStrategy over 1, 2 and 4 logical CPU replicas;
and the GPU machine every ``gpu``-marked test runs on (real, or simulated: see gpu_env.py)."""

import os
import signal
import zlib

import pytest

import mirrored as md

# A run started in the background of a non-interactive shell (`make test &`) inherits SIGINT
# ignored, and so would every process the tests start: Python then never raises KeyboardInterrupt,
# and the Ctrl-C tests could not deliver one. A handler of our own is reset to the default in the
# children, so they get Python's usual one.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests start jobs whose tasks run in a temporary directory: a relative PYTHONPATH (the development habit,
# PYTHONPATH=python) would not reach them, and they would silently import the mirrored installed in the venv.
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                               for p in os.environ["PYTHONPATH"].split(os.pathsep))


def cpus(n):
    return [f"/cpu:{i}" for i in range(n)]


@pytest.fixture
def one():
    return md.MirroredStrategy(cpus(1))


@pytest.fixture
def two():
    return md.MirroredStrategy(cpus(2))


@pytest.fixture
def four():
    return md.MirroredStrategy(cpus(4))


def replica_id():
    return md.get_replica_context().replica_id_in_sync_group


@pytest.fixture(autouse=True)
def gpu_machine(request):
    """gpu tests run on the machine's GPUs, or on the simulated ones (seeded by the test's id)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import gpu_env

    if gpu_env.cupy is None:
        pytest.skip(gpu_env.SKIP_REASON)
    with gpu_env.machine(zlib.crc32(request.node.nodeid.encode())):
        yield
