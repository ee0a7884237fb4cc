"""Distributed datasets split batches over the replicas as TF 2.21's MirroredStrategy does (1 to 4 logical CPUs):
every AutoShardPolicy, global batches 1..9 with and without remainders, unbatched, nested, rebatched and
filtered datasets, distribute_datasets_from_function and InputOptions; per replica the exact arrays, the
element specs, the steps a loop takes, get_next_as_optional at the end, or the same exception as TF.
Recorded by tests/data/record_tf_dataset_split.py."""

import contextlib

import numpy as np
import pytest

import mirrored as md
from mirrored._nest import flatten
from data_parity import load_recorder

RECORDER, REFERENCE = load_recorder("record_tf_dataset_split", "tf_dataset_split.json")

# TF's own exception classes and the built-in ones mirrored raises in their place.
_TF_ERRORS = {"InvalidArgumentError": "ValueError", "NotFoundError": "FileNotFoundError"}


class Mirrored:
    """The recorder's adapter over mirrored."""

    Dataset = md.data.Dataset
    Options = md.data.Options
    AutoShardPolicy = md.data.experimental.AutoShardPolicy
    InputOptions = md.distribute.InputOptions
    InputReplicationMode = md.distribute.InputReplicationMode
    flatten = staticmethod(flatten)

    @staticmethod
    def strategy(n, fresh):
        return md.MirroredStrategy([f"/cpu:{i}" for i in range(n)])

    @staticmethod
    def per_replica_specs(spec):
        return list(spec._specs)

    @staticmethod
    def spec_shape(spec):
        return None if spec.shape.rank is None else list(spec.shape.as_list())

    @staticmethod
    def dtype_name(dtype):
        return np.dtype(dtype).name

    @staticmethod
    def numpy(value):
        return np.asarray(md.device_util.to_host(value))


@contextlib.contextmanager
def _logical_cpus(count):
    cpu = md.config.list_physical_devices("CPU")[0]
    md.config.set_logical_device_configuration(cpu, [md.config.LogicalDeviceConfiguration()] * count)
    try:
        yield
    finally:
        md.config.set_logical_device_configuration(cpu, None)


def _same(got, want, path):
    if isinstance(want, dict) and "raises" in want:
        assert isinstance(got, dict) and "raises" in got, f"{path}: TF raised {want}; mirrored gave {got}"
        assert got["raises"] in (want["raises"], _TF_ERRORS.get(want["raises"])), (path, got, want)
        return
    assert got == want, f"{path}: mirrored gave {got}, TF {want}"


def test_every_case_is_recorded():
    assert REFERENCE["_tf_version"].startswith("2.21")
    assert set(REFERENCE["cases"]) == set(RECORDER.CASES)


CASES = [(name, n) for name, case in sorted(RECORDER.CASES.items()) for n in case["ns"]]


@pytest.mark.parametrize("name,n", CASES, ids=[f"{name}-{n}" for name, n in CASES])
def test_matches_tensorflow(name, n):
    want = REFERENCE["cases"][name][str(n)]
    with _logical_cpus(4):
        got = RECORDER.run_case(Mirrored, n, RECORDER.CASES[name])
    for key in want:
        assert key in got, f"{name} n={n}: TF answered {key}={want[key]}, mirrored did not ({got})"
        _same(got[key], want[key], f"{name} n={n} {key}")
    assert set(got) == set(want), f"{name} n={n}: mirrored answered more than TF: {got}"
