"""File sources: ``Dataset.list_files`` and ``md.data.TextLineDataset`` (the sources FILE sharding splits)."""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from .dataset_ops import UNKNOWN, Dataset, ListFilesDataset, _Iterator
from .structure import TensorSpec

__all__ = ["ListFilesDataset", "TextLineDataset"]


class TextLineDataset(Dataset):
    """``md.data.TextLineDataset(filenames, compression_type=None)``: the lines of the files, one file after the
    other, as bytes without their line ending (``\\n``; a ``\\r`` before it goes too, as in tf.data)."""

    def __init__(self, filenames, compression_type=None, buffer_size=None, num_parallel_reads=None, name=None):
        if isinstance(filenames, Dataset):
            names = filenames
        else:
            if isinstance(filenames, (str, bytes, os.PathLike)):
                filenames = [filenames]
            names = Dataset.from_tensor_slices(np.array([os.fsencode(f) for f in filenames]))
            if not len(filenames):
                raise ValueError("filenames=[]: pass at least one file")
        super().__init__(names)
        compression_type = (compression_type or "").upper()
        if compression_type not in ("", "GZIP", "ZLIB"):
            raise ValueError(f"compression_type={compression_type!r}: expected None, '', 'GZIP' or 'ZLIB'")
        self._compression = compression_type

    def _compute_spec(self):
        return TensorSpec((), np.dtype("S"))

    def _cardinality(self):
        return UNKNOWN

    def _make_iterator(self, state=None):
        return _TextLineIterator(self, state)

    def _file_sharded(self, num_shards, index):
        inner = self._input._file_sharded(num_shards, index)
        return self._clone([inner if inner is not None else self._input.shard(num_shards, index)])

    def _file_count(self):
        inner = self._input._file_count()
        if inner is not None:
            return inner
        n = self._input._cardinality()
        return n if n >= 0 else None

    def _open(self, name: str):
        if self._compression == "GZIP":
            return gzip.open(name, "rb")
        if self._compression == "ZLIB":
            with open(name, "rb") as f:
                import io

                return io.BytesIO(zlib.decompress(f.read()))
        return open(name, "rb")


class _TextLineIterator(_Iterator):
    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["files"]))
        self._ds = ds
        self._file, self._name = None, None
        if state is not None and state["name"] is not None:
            self._start(state["name"])
            self._file.seek(state["offset"])

    def _start(self, name: bytes) -> None:
        path = os.fsdecode(bytes(name))
        try:
            self._file = self._ds._open(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"TextLineDataset: {path}: No such file or directory") from None
        self._name = bytes(name)

    def next(self):
        while True:
            if self._file is None:
                self._start(self._inputs[0].next())
            line = self._file.readline()
            if line:
                if line.endswith(b"\n"):
                    line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
                return np.bytes_(line)
            self._file.close()
            self._file = self._name = None

    def save(self):
        return {"files": self._inputs[0].save(), "name": self._name,
                "offset": None if self._file is None else self._file.tell()}

    def close(self):
        if self._file is not None:
            self._file.close()
        super().close()
