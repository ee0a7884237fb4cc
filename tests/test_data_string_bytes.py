"""String tensors keep every byte, trailing NUL bytes included, through every md.data step.

A serialized record often ends in a 0 byte (a protobuf whose last field is an int64 0 does). NumPy's
``S`` arrays pad with NUL bytes, so a string stored in one loses its trailing ones; md.data holds string
tensors of rank >= 1 as object arrays of ``bytes`` (what TF's ``.numpy()`` gives) and scalars as
``np.bytes_``, which keep them. Each test here failed when batches were ``S`` arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mirrored as md
from mirrored.data.readers import tfrecord_bytes

D = md.data.Dataset
RECORDS = [b"x\x00\x00", b"yy", b"\x00", b"", b"z\x00w\x00", b"\x01\x00"]


def as_bytes(batch) -> list:
    return [bytes(x) for x in np.asarray(batch, dtype=object).reshape(-1)]


@pytest.fixture
def records_file(tmp_path):
    path = tmp_path / "r.tfrecord"
    path.write_bytes(b"".join(tfrecord_bytes(r) for r in RECORDS))
    return str(path)


def test_records_keep_their_trailing_nul_bytes_one_by_one_and_in_batches(records_file):
    ds = md.data.TFRecordDataset(records_file)
    assert [bytes(r) for r in ds] == RECORDS
    batches = list(ds.batch(4))
    assert [as_bytes(b) for b in batches] == [RECORDS[:4], RECORDS[4:]]
    assert all(b.dtype == object and all(type(x) is bytes for x in b) for b in batches)  # as TF's .numpy()
    assert ds.batch(4).element_spec == md.data.TensorSpec((None,), np.dtype("S"))
    assert [bytes(r) for r in ds.batch(4).unbatch()] == RECORDS
    assert [x for b in ds.batch(3).rebatch(2) for x in as_bytes(b)] == RECORDS
    assert sorted(x for b in ds.batch(2).shuffle(3, seed=1) for x in as_bytes(b)) == sorted(RECORDS)
    assert [as_bytes(b) for b in ds.batch(4).as_numpy_iterator()] == [RECORDS[:4], RECORDS[4:]]


def test_padded_batches_pad_with_empty_strings_and_keep_the_bytes(records_file):
    ds = md.data.TFRecordDataset(records_file).map(lambda r: (r, np.array([r, r], dtype=object)))
    scalars, pairs = next(iter(ds.padded_batch(3, padded_shapes=((), (3,)))))
    assert as_bytes(scalars) == RECORDS[:3]
    assert pairs.shape == (3, 3) and [as_bytes(row) for row in pairs] == [[r, r, b""] for r in RECORDS[:3]]


def test_slices_tensors_and_generators_of_bytes_keep_them():
    assert [bytes(x) for x in D.from_tensor_slices(RECORDS)] == RECORDS
    assert [bytes(x) for x in D.from_tensor_slices(np.array(RECORDS, dtype=object))] == RECORDS
    assert as_bytes(next(iter(D.from_tensors(RECORDS)))) == RECORDS
    assert list(D.from_tensor_slices(RECORDS).as_numpy_iterator()) == RECORDS
    gen = D.from_generator(lambda: iter([RECORDS[:2], RECORDS[2:4]]),
                           output_signature=md.data.TensorSpec((2,), np.dtype("S")))
    assert [as_bytes(x) for x in gen] == [RECORDS[:2], RECORDS[2:4]]
    scalars = D.from_generator(lambda: iter(RECORDS), output_signature=md.data.TensorSpec((), np.dtype("S")))
    assert [bytes(x) for x in scalars] == RECORDS


def test_unique_tells_strings_apart_by_every_byte():
    assert [bytes(x) for x in D.from_tensor_slices(RECORDS + RECORDS[::-1]).unique()] == RECORDS


def test_saved_and_cached_datasets_give_back_the_bytes(tmp_path):
    ds = D.from_tensor_slices(RECORDS).batch(4)
    ds.save(str(tmp_path / "saved"))
    assert [as_bytes(b) for b in D.load(str(tmp_path / "saved"))] == [RECORDS[:4], RECORDS[4:]]
    cached = D.from_tensor_slices(RECORDS).batch(4).cache(str(tmp_path / "cache"))
    assert [as_bytes(b) for b in cached] == [as_bytes(b) for b in cached] == [RECORDS[:4], RECORDS[4:]]


def test_written_records_read_back_byte_for_byte(records_file, tmp_path):
    out = str(tmp_path / "copy.tfrecord")
    md.data.experimental.TFRecordWriter(out).write(md.data.TFRecordDataset(records_file).batch(4).unbatch())
    assert [bytes(r) for r in md.data.TFRecordDataset(out)] == RECORDS


@pytest.mark.parametrize("position", [0, 1, 3, 5])
def test_a_restored_iterator_holding_strings_gives_the_same_bytes(records_file, tmp_path, position):
    def pipeline():
        return md.data.TFRecordDataset(records_file).shuffle(4, seed=3).batch(2, drop_remainder=False)

    expected = [as_bytes(b) for b in pipeline()]
    it = iter(pipeline().unbatch())  # (a shuffle buffer and a partly read batch hold strings at the save)
    flat = [x for b in expected for x in b]
    assert sorted(flat) == sorted(RECORDS)
    for _ in range(position):
        next(it)
    path = md.train.Checkpoint(iterator=it).save(str(tmp_path / "ckpt" / "it"))
    restored = iter(pipeline().unbatch())
    md.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert [bytes(x) for x in restored] == flat[position:]


def test_replicas_receive_the_bytes_of_their_rows(records_file):
    strategy = md.MirroredStrategy(["/cpu:0", "/cpu:1"])
    dist = strategy.experimental_distribute_dataset(md.data.TFRecordDataset(records_file).batch(4))
    got = [[as_bytes(part) for part in strategy.experimental_local_results(batch)] for batch in dist]
    # (TF's split of a file pipeline: the rows stream into even per-replica batches, docs/datasets_split.md)
    assert got == [[RECORDS[0:2], RECORDS[2:4]], [RECORDS[4:6], []]]
    rows = strategy.experimental_distribute_dataset(D.from_tensor_slices(RECORDS).batch(4))
    got = [[as_bytes(part) for part in strategy.experimental_local_results(batch)] for batch in rows]
    assert got == [[RECORDS[0:2], RECORDS[2:4]], [RECORDS[4:5], RECORDS[5:6]]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=6).map(lambda b: b + b"\x00" * (len(b) % 3)), min_size=1, max_size=9),
       st.integers(1, 4))
def test_any_bytes_survive_batch_and_unbatch(strings, batch):
    ds = D.from_tensor_slices(strings).batch(batch)
    assert [x for b in ds for x in as_bytes(b)] == strings
    assert [bytes(x) for x in ds.unbatch()] == strings
