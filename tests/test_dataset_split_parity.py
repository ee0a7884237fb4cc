"""Distributed datasets split batches over the replicas as TF 2.21's MirroredStrategy does (1 to 4 logical CPUs):
every AutoShardPolicy, global batches 1..9 with and without remainders, unbatched, nested, rebatched and
filtered datasets, distribute_datasets_from_function and InputOptions; per replica the exact arrays, the
element specs, the steps a loop takes, get_next_as_optional at the end, or the same exception as TF.
Recorded by tests/data/record_tf_dataset_split.py."""

import types

import numpy as np
import pytest

import mirrored as md
from mirrored._nest import flatten
from mirrored.distribute.input_lib import DistributedDataset, batch_sizes_for_worker, emitted_batches
from data_parity import load_recorder, logical_cpus

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
    TextLineDataset = md.data.TextLineDataset
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
        return "string" if np.dtype(dtype).kind in "OSU" else np.dtype(dtype).name  # (TF's name of its strings)

    @staticmethod
    def numpy(value):
        return np.asarray(md.device_util.to_host(value))


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
    with logical_cpus(4):
        got = RECORDER.run_case(Mirrored, n, RECORDER.CASES[name])
    for key in want:
        assert key in got, f"{name} n={n}: TF answered {key}={want[key]}, mirrored did not ({got})"
        _same(got[key], want[key], f"{name} n={n} {key}")
    assert set(got) == set(want), f"{name} n={n}: mirrored answered more than TF: {got}"


# --- Several workers: TF's sources (not recordable in one process), checked on each worker's own view --------

def _worker(index, workers=2, local=2):
    """What a DistributedDataset reads of the strategy: worker ``index`` of ``workers``, ``local`` CPU replicas."""
    return types.SimpleNamespace(_num_workers=workers, _worker_index=index, _num_replicas_in_sync=workers * local,
                                 worker_devices=tuple(f"/cpu:{i}" for i in range(local)),
                                 experimental_enable_get_next_as_optional=True)


def _steps(dataset, policy, index, workers=2, local=2):
    options = md.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(md.data.AutoShardPolicy, policy)
    with logical_cpus(4):
        distributed = DistributedDataset(dataset.with_options(options), _worker(index, workers, local))
        return [[v.tolist() for v in step.values] for step in distributed]


def test_batch_sizes_for_worker_as_tf_documents_them():
    assert batch_sizes_for_worker(7, 2, 2, 0) == [2, 2, 2, 1]
    assert batch_sizes_for_worker(7, 2, 2, 1) == [2, 1, 2, 2]
    assert batch_sizes_for_worker(6, 1, 4, 0) == [2, 2, 1, 1]
    assert batch_sizes_for_worker(2, 1, 4, 0) == [1, 1, 0, 0]
    assert emitted_batches(3, [2, 1, 1, 1]) == 2 and emitted_batches(3, [1, 1, 2, 1]) == 3
    assert emitted_batches(2, [1, 1, 0, 0]) == 4 and emitted_batches(1, [1, 1, 0, 0]) == 1


def test_off_across_workers_cuts_tf_documented_sizes():
    # TF's batch_sizes_for_worker example: 7 rows, 2 workers of 2 replicas; every step adds up to 7 rows.
    ds = md.data.Dataset.range(14).batch(7)
    assert _steps(ds, "OFF", 0) == [[[0, 1], [2, 3]], [[4, 5], [6]], [[7, 8], [9, 10]], [[11, 12], [13]]]
    assert _steps(ds, "OFF", 1) == [[[0, 1], [2]], [[3, 4], [5, 6]], [[7, 8], [9]], [[10, 11], [12, 13]]]


def test_every_worker_takes_a_step_while_one_has_rows():
    # The last 3 rows of batches of 5: worker 0 (2+1+1+1) has rows for one step, worker 1 (1+1+2+1) for two.
    ds = md.data.Dataset.range(8).batch(5)
    assert _steps(ds, "OFF", 0) == [[[0, 1], [2]], [[3], [4]], [[5, 6], [7]], [[], []]]
    assert _steps(ds, "OFF", 1) == [[[0], [1]], [[2, 3], [4]], [[5], [6]], [[7], []]]


def test_data_across_workers_keeps_every_other_per_replica_batch():
    ds = md.data.Dataset.range(14).batch(7)  # ceil(7/4) = 2 rows: [0,1] [2,3] [4,5] [6] per batch
    assert _steps(ds, "DATA", 0) == [[[0, 1], [4, 5]], [[7, 8], [11, 12]]]
    assert _steps(ds, "DATA", 1) == [[[2, 3], [6]], [[9, 10], [13]]]


@pytest.mark.parametrize("buffer", [0, 1, 3])
@pytest.mark.parametrize("policy", ["OFF", "AUTO"])
def test_checkpointed_iterator_resumes_mid_stream(tmp_path, policy, buffer):
    # OFF cuts the stream of rows (a global batch's rows at a time); AUTO cuts batch by batch. Either way a
    # restored iterator goes on with the step that followed the save, whatever was prefetched.
    options = md.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(md.data.AutoShardPolicy, policy)
    dataset = md.data.Dataset.range(23).batch(6).repeat(2).with_options(options)
    with logical_cpus(4):
        strategy = md.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
        distributed = strategy.experimental_distribute_dataset(
            dataset, md.distribute.InputOptions(experimental_per_replica_buffer_size=buffer))

        def rest(iterator):
            return [[v.tolist() for v in step.values] for step in iterator]

        whole = rest(iter(distributed))
        it = iter(distributed)
        for _ in range(3):
            next(it)
        path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "c"))
        assert rest(it) == whole[3:]
        restored = iter(distributed)
        md.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
        assert rest(restored) == whole[3:]
    if policy == "OFF":  # (23 rows a pass: the second pass's batches straddle the first's short one)
        assert whole[3] == [[18, 19], [20, 21], [22], [0]]
