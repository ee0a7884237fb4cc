"""Compressed files are read as streams: a GZIP or ZLIB file much larger than the reader's chunk
(readers.ZLIB_CHUNK) is read with memory bounded by a few chunks and a record, never the whole file, by
TFRecordDataset, TextLineDataset and FixedLengthRecordDataset alike; damaged and truncated streams still
raise ValueError naming the compression."""

import hashlib
import tracemalloc
import zlib

import numpy as np
import pytest

import mirrored as md
from mirrored.data import readers

D = md.data.Dataset
RECORD_BYTES = 20000
RECORDS = 100  # 2 MB decompressed: about 30 chunks


def records():
    # Random bytes, so the compressed file is as large as its records; each ends in "." since a NumPy string
    # drops trailing NULs.
    rng = np.random.default_rng(7)
    return [rng.bytes(RECORD_BYTES - 1) + b"." for _ in range(RECORDS)]


def digest(items):
    h = hashlib.sha256()
    for item in items:
        h.update(bytes(item))
    return h.hexdigest()


def streamed_peak(dataset):
    """(digest of the elements, peak bytes Python allocated while reading them one by one)."""
    tracemalloc.start()
    try:
        return digest(iter(dataset)), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("compressed")
    data = records()
    out = {}
    for compression in ("GZIP", "ZLIB"):
        out["tfrecord", compression] = str(base / f"r.{compression}")
        md.data.experimental.TFRecordWriter(out["tfrecord", compression], compression).write(
            D.from_generator(lambda: iter(data), output_signature=md.data.TensorSpec((), np.bytes_)))
        out["fixed", compression] = str(base / f"f.{compression}")
        with readers._open(out["fixed", compression], compression, "wb") as f:
            f.write(b"H" * 7 + b"".join(data) + b"F" * 3)
    return data, out


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_tfrecord_file_is_read_with_bounded_memory(files, compression):
    data, paths = files
    size = RECORD_BYTES * RECORDS
    assert size > 24 * readers.ZLIB_CHUNK
    got, peak = streamed_peak(md.data.TFRecordDataset(paths["tfrecord", compression], compression))
    assert got == digest(data)
    assert peak < 8 * readers.ZLIB_CHUNK, f"reading held {peak} bytes of a {size}-byte file"


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_fixed_length_file_is_read_with_bounded_memory(files, compression):
    data, paths = files
    ds = md.data.FixedLengthRecordDataset(paths["fixed", compression], RECORD_BYTES, header_bytes=7, footer_bytes=3,
                                          compression_type=compression)
    got, peak = streamed_peak(ds)
    assert got == digest(data)
    assert peak < 8 * readers.ZLIB_CHUNK, peak


def test_a_zlib_text_file_streams_its_lines_and_restores_mid_file(tmp_path):
    path = str(tmp_path / "t.zlib")
    lines = [f"line {i} ".encode() * (i % 50) for i in range(20000)]
    with open(path, "wb") as f:
        f.write(zlib.compress(b"\n".join(lines) + b"\n"))
    assert list(md.data.TextLineDataset(path, "ZLIB")) == lines
    it = iter(md.data.TextLineDataset(path, "ZLIB"))
    for _ in range(15000):
        next(it)
    state = it._serialize_to_tensors()
    restored = iter(md.data.TextLineDataset(path, "ZLIB"))
    restored._restore_from_tensors(state)
    assert list(restored) == list(it) == lines[15000:]


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "not compressed"])
def test_a_damaged_zlib_stream_raises_naming_the_compression(tmp_path, damage):
    whole = zlib.compress(b"".join(readers.tfrecord_bytes(r) for r in records()[:20]))
    body = {"truncated": whole[:len(whole) // 2],
            "corrupted": whole[:-4] + bytes(b ^ 0x5A for b in whole[-4:]),  # its Adler-32 check
            "not compressed": readers.tfrecord_bytes(b"plain")}[damage]
    path = tmp_path / "bad.zlib"
    path.write_bytes(body)
    with pytest.raises(ValueError, match="cannot decompress it as ZLIB"):
        list(md.data.TFRecordDataset(str(path), "ZLIB"))
    with pytest.raises(ValueError, match="cannot decompress it as ZLIB"):
        list(md.data.FixedLengthRecordDataset(str(path), 1, compression_type="ZLIB"))
