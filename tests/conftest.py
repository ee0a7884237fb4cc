"""Fixtures of the Strategy-layer tests: MirroredStrategy over 1, 2 and 4 logical CPU replicas."""

import pytest

import mirrored as md


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
