"""File sources: ``Dataset.list_files``, ``md.data.TextLineDataset``, ``FixedLengthRecordDataset`` and
``TFRecordDataset`` (the sources FILE sharding splits), and ``experimental.TFRecordWriter``.

The readers share tf.data's file handling: ``filenames`` (a name, a list, or a
dataset of names) are read one after the other, or ``num_parallel_reads`` at
a time interleaved record by record (TF's order); ``compression_type`` is
``None``/``""``, ``"GZIP"`` or ``"ZLIB"``. TFRecord files are TF's format
(a length, its masked CRC32C, the record, its masked CRC32C), so files written
by TensorFlow read here and the other way round.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import struct
import zlib

import numpy as np

from ..errors import DataLossError, from_os_error
from .crc32c import crc32c, mask, unmask
from .dataset_ops import AUTOTUNE, UNKNOWN, Dataset, ListFilesDataset, _Interleave, _Iterator, _int
from .structure import TensorSpec, to_leaf

__all__ = ["ListFilesDataset", "TextLineDataset", "FixedLengthRecordDataset", "TFRecordDataset", "TFRecordWriter",
           "CsvDataset"]


def _check_compression(compression_type) -> str:
    compression = (compression_type or "").upper() if isinstance(compression_type, (str, type(None))) else None
    if compression not in ("", "GZIP", "ZLIB"):
        raise ValueError(f"compression_type={compression_type!r}: expected None, '', 'GZIP' or 'ZLIB'")
    return compression


def _open(path: str, compression: str, mode: str = "rb"):
    if compression == "GZIP":
        return gzip.open(path, mode)
    if compression == "ZLIB":
        return _ZlibWriter(path) if "w" in mode else io.BufferedReader(_ZlibReader(path), ZLIB_CHUNK)
    return open(path, mode)


def _decompress_error(path: str, compression: str, error: Exception) -> DataLossError:
    return DataLossError(None, None, f"{path}: cannot decompress it as {compression} ({error}); check "
                         "compression_type")


ZLIB_CHUNK = 1 << 16  # compressed bytes read at a time, and the most decompressed bytes one read produces


class _ZlibReader(io.RawIOBase):
    """A ZLIB-compressed file (one zlib stream, TF's ZLIB compression) read as a stream: memory holds one
    chunk of the file and what it decompresses to, however large the file. Seeking forward decompresses up to
    the offset; seeking back starts the stream again (a checkpoint's restore seeks forward from the start)."""

    def __init__(self, path: str):
        self._path = path
        self._file = open(path, "rb")
        self._rewind()

    def _rewind(self) -> None:
        self._file.seek(0)
        self._decompressor, self._position = zlib.decompressobj(), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = b""
        try:
            while not data and len(buffer):
                if self._decompressor.eof:
                    return 0
                pending = self._decompressor.unconsumed_tail or self._file.read(ZLIB_CHUNK)
                data = self._decompressor.decompress(pending, min(len(buffer), ZLIB_CHUNK))
                if not data and not pending and not self._decompressor.eof:
                    raise EOFError("the file ends inside the compressed stream")
        except (zlib.error, EOFError) as e:
            raise _decompress_error(self._path, "ZLIB", e) from None
        buffer[:len(data)] = data
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._position
        elif whence == io.SEEK_END:
            while self.read(ZLIB_CHUNK):
                pass
            offset += self._position
        if offset < self._position:
            self._rewind()
        while self._position < offset and self.read(min(ZLIB_CHUNK, offset - self._position)):
            pass
        return self._position

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _ZlibWriter(io.RawIOBase):
    """A file written as one zlib stream (TF's ZLIB compression)."""

    def __init__(self, path: str):
        self._file, self._compressor = open(path, "wb"), zlib.compressobj()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._file.write(self._compressor.compress(bytes(data)))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._file.write(self._compressor.flush())
            self._file.close()
        super().close()


class _FileReader(Dataset):
    """What the file readers share: the names, the compression, FILE sharding and ``num_parallel_reads``.
    A subclass gives ``_iterator(state)`` (one file after the other) and ``_spec``."""

    def __init__(self, filenames, compression_type=None, num_parallel_reads=None):
        if isinstance(filenames, Dataset):
            names = filenames
        else:
            if isinstance(filenames, (str, bytes, os.PathLike)):
                filenames = [filenames]
            if not isinstance(filenames, (list, tuple, np.ndarray)) or not all(
                    isinstance(f, (str, bytes, os.PathLike, np.str_, np.bytes_)) for f in filenames):
                raise TypeError(f"filenames={filenames!r}: expected a file name, a list of them or a Dataset of "
                                "them (the `filenames` argument must contain string elements)")
            if not len(filenames):
                raise ValueError("filenames=[]: pass at least one file")
            names = Dataset.from_tensor_slices(np.array([os.fsencode(f) for f in filenames]))
        super().__init__(names)
        self._compression = _check_compression(compression_type)
        if num_parallel_reads is not None:
            num_parallel_reads = _int(num_parallel_reads, "num_parallel_reads", "a positive int or AUTOTUNE")
            if num_parallel_reads <= 0 and num_parallel_reads != AUTOTUNE:
                raise ValueError(f"num_parallel_reads={num_parallel_reads}: must be greater than zero (or AUTOTUNE)")
        self._parallel_reads = num_parallel_reads

    def _compute_spec(self):
        return TensorSpec((), np.dtype("S"))

    def _cardinality(self):
        return UNKNOWN

    def _one_file(self, name) -> "_FileReader":
        clone = self._clone([Dataset.from_tensors(name)])
        clone._parallel_reads = None
        return clone

    def _make_iterator(self, state=None):
        if self._parallel_reads is None or self._parallel_reads == 1:
            return self._iterator(state)
        # TF: num_parallel_reads files at a time, a record from each in turn (parallel, in order unless the
        # pipeline's options say deterministic=False); AUTOTUNE reads the files in order, one read ahead.
        reads = 1 if self._parallel_reads == AUTOTUNE else self._parallel_reads
        interleaved = _Interleave(self._input, self._one_file, reads, 1, reads)
        interleaved._pipeline_options = self._pipeline_options
        return interleaved._make_iterator(state)

    def _file_sharded(self, num_shards, index):
        inner = self._input._file_sharded(num_shards, index)
        return self._clone([inner if inner is not None else self._input.shard(num_shards, index)])

    def _file_count(self):
        inner = self._input._file_count()
        if inner is not None:
            return inner
        n = self._input._cardinality()
        return n if n >= 0 else None

    def _open(self, name: bytes):
        path = os.fsdecode(bytes(name))
        try:
            return _open(path, self._compression)
        except OSError as e:  # TF's classes: a missing file is a NotFoundError (and still a FileNotFoundError)
            raise from_os_error(e, f"{type(self).__name__}: {path}; {e.strerror}") from None


class _FileRecordsIterator(_Iterator):
    """Records of the files one after the other; ``_record(file)`` reads the next one (None at the end)."""

    def __init__(self, ds, state):
        super().__init__(ds._input._make_iterator(None if state is None else state["files"]))
        self._ds = ds
        self._file, self._name = None, None
        if state is not None and state["name"] is not None:
            self._start(state["name"])
            self._file.seek(state["offset"])

    def _start(self, name: bytes) -> None:
        self._file = self._ds._open(name)
        self._name = bytes(name)
        self._opened()

    def _opened(self) -> None:
        """Called with a file just opened (a subclass skips its header)."""

    def _record(self):
        raise NotImplementedError

    def _element(self, record):
        return np.bytes_(record)

    def next(self):
        while True:
            if self._file is None:
                self._start(self._inputs[0].next())
            try:
                record = self._record()
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a damaged or mislabelled compressed file
                raise _decompress_error(os.fsdecode(self._name), self._ds._compression, e) from None
            if record is not None:
                return self._element(record)
            self._file.close()
            self._file = self._name = None

    def save(self):
        return {"files": self._inputs[0].save(), "name": self._name,
                "offset": None if self._file is None else self._file.tell()}

    def close(self):
        if self._file is not None:
            self._file.close()
        super().close()


class TextLineDataset(_FileReader):
    """``md.data.TextLineDataset(filenames, compression_type=None)``: the lines of the files, one file after the
    other, as bytes without their line ending (``\\n``; a ``\\r`` before it goes too, as in tf.data)."""

    def __init__(self, filenames, compression_type=None, buffer_size=None, num_parallel_reads=None, name=None):
        super().__init__(filenames, compression_type, num_parallel_reads)

    def _iterator(self, state):
        return _TextLineIterator(self, state)


class _TextLineIterator(_FileRecordsIterator):
    def _record(self):
        line = self._file.readline()
        if not line:
            return None
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        return line


class FixedLengthRecordDataset(_FileReader):
    """``md.data.FixedLengthRecordDataset(filenames, record_bytes, header_bytes=0, footer_bytes=0)``: each file's
    body (after ``header_bytes``, before ``footer_bytes``) cut into records of ``record_bytes`` bytes; a body
    that is not a whole number of records raises ``ValueError`` (TF's InvalidArgumentError)."""

    def __init__(self, filenames, record_bytes, header_bytes=None, footer_bytes=None, buffer_size=None,
                 compression_type=None, num_parallel_reads=None, name=None):
        super().__init__(filenames, compression_type, num_parallel_reads)
        self._record_bytes = _int(record_bytes, "record_bytes", "a positive int")
        if self._record_bytes <= 0:
            raise ValueError(f"`record_bytes` must be > 0, got record_bytes={record_bytes}")
        self._header = _int(0 if header_bytes is None else header_bytes, "header_bytes", "an int >= 0")
        self._footer = _int(0 if footer_bytes is None else footer_bytes, "footer_bytes", "an int >= 0")
        if self._header < 0 or self._footer < 0:
            raise ValueError(f"header_bytes={header_bytes}, footer_bytes={footer_bytes}: must be >= 0")

    def _iterator(self, state):
        return _FixedLengthIterator(self, state)


class _FixedLengthIterator(_FileRecordsIterator):
    def _opened(self) -> None:
        ds = self._ds
        try:  # a compressed file decompresses to its end (bounded memory) to learn its size
            self._file.seek(0, io.SEEK_END)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise _decompress_error(os.fsdecode(self._name), self._ds._compression, e) from None
        size = self._file.tell()
        body = size - ds._header - ds._footer
        if body < 0 or body % ds._record_bytes:
            raise ValueError(f"Excluding the header ({ds._header} bytes) and footer ({ds._footer} bytes), input file "
                             f"\"{os.fsdecode(self._name)}\" has body length {body} bytes, which is not an exact "
                             f"multiple of the record length ({ds._record_bytes} bytes).")
        self._end = size - ds._footer
        self._file.seek(ds._header)

    def _record(self):
        if self._file.tell() >= self._end:
            return None
        return self._file.read(self._ds._record_bytes)


class TFRecordDataset(_FileReader):
    """``md.data.TFRecordDataset(filenames, compression_type=None, buffer_size=None, num_parallel_reads=None)``:
    the records of TFRecord files as bytes, each checked against its CRC32C (a damaged file raises
    ``md.errors.DataLossError``, a ``ValueError``, as TF's; so does a file that ends inside a record, which TF
    drops without a word where the cut falls in a record's header). Parse them with your own decoder
    (``tf.train.Example`` protos need protobuf, which md.data does not carry)."""

    def __init__(self, filenames, compression_type=None, buffer_size=None, num_parallel_reads=None, name=None):
        super().__init__(filenames, compression_type, num_parallel_reads)

    def _iterator(self, state):
        return _TFRecordIterator(self, state)


class _TFRecordIterator(_FileRecordsIterator):
    def _record(self):
        start = self._file.tell()
        header = self._file.read(12)
        if not header:
            return None
        if len(header) < 12:
            raise DataLossError(None, None, f"truncated record at {start} of {os.fsdecode(self._name)}")
        length, length_crc = struct.unpack("<QI", header)
        if unmask(length_crc) != crc32c(header[:8]):
            raise DataLossError(None, None, f"corrupted record at {start} of {os.fsdecode(self._name)}"
                                + (" (Is this even a TFRecord file?)" if start == 0 else ""))
        data = self._file.read(length)
        footer = self._file.read(4)
        if len(data) < length or len(footer) < 4:
            raise DataLossError(None, None, f"truncated record at {start} of {os.fsdecode(self._name)}")
        if unmask(struct.unpack("<I", footer)[0]) != crc32c(data):
            raise DataLossError(None, None, f"corrupted record at {start + 12} of {os.fsdecode(self._name)}")
        return data


def tfrecord_bytes(record: bytes) -> bytes:
    """One record in TFRecord framing."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", mask(crc32c(length))) + record + struct.pack("<I", mask(crc32c(record)))


class TFRecordWriter:
    """``md.data.experimental.TFRecordWriter(filename, compression_type=None).write(dataset)``: a dataset of
    scalar strings written as a TFRecord file (TensorFlow reads it)."""

    def __init__(self, filename, compression_type=None):
        if not isinstance(filename, (str, bytes, os.PathLike)):
            raise TypeError(f"filename={filename!r}: expected a file name")
        self._filename = os.fsdecode(filename)
        self._compression = _check_compression(compression_type)

    def write(self, dataset) -> None:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"Invalid `dataset`. Expected a `tf.data.Dataset` object but got {type(dataset)}.")
        spec = dataset.element_spec
        if not isinstance(spec, TensorSpec) or spec.dtype.kind != "S" or spec.shape != ():
            raise TypeError("Invalid `dataset`. Expected a`dataset` that produces scalar `tf.string` elements, but "
                            f"got a dataset which produces elements {spec}; map the elements to bytes first")
        with _open(self._filename, self._compression, "wb") as f:
            for record in dataset:
                f.write(tfrecord_bytes(bytes(record)))


# --- CSV -------------------------------------------------------------------------------------------------

_CSV_TYPES = {np.dtype(np.int32): "int32", np.dtype(np.int64): "int64", np.dtype(np.float32): "float",
              np.dtype(np.float64): "double", np.dtype("S"): "string"}


def _column(default, i: int):
    """(dtype, default value or None for a required column) of ``record_defaults[i]``: a scalar default (its
    type, converted as tf.constant: 0 is int32, 0.0 float32, "" a string), or a dtype / empty array (a
    required column of that dtype)."""
    if isinstance(default, (type, np.dtype)):
        dtype, value = np.dtype(default), None
    elif isinstance(default, np.ndarray) and default.size == 0:
        dtype, value = default.dtype, None
    else:
        value = to_leaf(default, f"record_defaults[{i}]")
        if np.ndim(value):
            raise ValueError(f"record_defaults[{i}]={default!r}: a default must be a scalar (or an empty array / a "
                             "dtype for a required column)")
        dtype = np.asarray(value).dtype
    dtype = np.dtype("S") if dtype.kind in "SU" else dtype
    if dtype not in _CSV_TYPES:
        raise TypeError(f"record_defaults[{i}]: type {dtype} is not supported; use int32, int64, float32, float64 "
                        "or string")
    return dtype, value


class CsvDataset(_FileReader):
    """``md.data.experimental.CsvDataset(filenames, record_defaults, compression_type=None, buffer_size=None,
    header=False, field_delim=",", use_quote_delim=True, na_value="", select_cols=None, exclude_cols=None)``:
    one tuple of scalars per CSV record. ``record_defaults[i]`` gives column ``i``'s type and the value of an
    empty (or ``na_value``) field, or, as a dtype or an empty array, a required column of that type. Quoted
    fields (``use_quote_delim``) may hold the delimiter, ``""`` for a quote, and line breaks; an empty line is a
    record of one empty field, as in TF."""

    def __init__(self, filenames, record_defaults, compression_type=None, buffer_size=None, header=False,
                 field_delim=",", use_quote_delim=True, na_value="", select_cols=None, exclude_cols=None):
        super().__init__(filenames, compression_type)
        if not isinstance(record_defaults, (list, tuple)) or not record_defaults:
            raise ValueError("record_defaults: pass one default (or dtype) per output column")
        self._columns = [_column(d, i) for i, d in enumerate(record_defaults)]
        if not isinstance(field_delim, str) or len(field_delim) != 1:
            raise ValueError(f"field_delim={field_delim!r}: field_delim should be only 1 char")
        if select_cols is not None and exclude_cols is not None:
            raise ValueError("Either select_cols or exclude_cols should be empty, not both")
        if select_cols is not None:
            select_cols = [_int(c, "select_cols", "a list of ints") for c in select_cols]
            if any(b <= a for a, b in zip(select_cols, select_cols[1:])) or min(select_cols, default=0) < 0:
                raise ValueError(f"select_cols={select_cols}: select_cols is not monotonically increasing (or "
                                 "negative)")
            if len(select_cols) != len(self._columns):
                raise ValueError(f"select_cols should match output size: {len(select_cols)} columns selected, "
                                 f"{len(self._columns)} record_defaults")
        self._select = select_cols
        self._exclude = None if exclude_cols is None else {_int(c, "exclude_cols", "a list of ints")
                                                           for c in exclude_cols}
        self._header, self._delim, self._quotes = bool(header), field_delim, bool(use_quote_delim)
        self._na_value = na_value

    def _compute_spec(self):
        return tuple(TensorSpec((), dtype) for dtype, _ in self._columns)

    def _iterator(self, state):
        return _CsvIterator(self, state)


class _CsvIterator(_FileRecordsIterator):
    def _opened(self) -> None:
        if self._ds._header:
            self._record()

    def _record(self):
        """The next record's text (latin-1, so every byte survives): lines joined while a quote is open."""
        line = self._file.readline()
        if not line:
            return None
        text = line.decode("latin-1")
        while self._ds._quotes and text.count('"') % 2:
            more = self._file.readline()
            if not more:
                break
            text += more.decode("latin-1")
        return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text

    def _element(self, text):
        ds = self._ds
        reader = csv.reader([text], delimiter=ds._delim, quotechar='"', doublequote=True,
                            quoting=csv.QUOTE_MINIMAL if ds._quotes else csv.QUOTE_NONE, strict=False)
        fields = next(reader, None) or [""]  # an empty line: one empty field
        if ds._select is not None:
            fields = [fields[c] for c in ds._select if c < len(fields)]
        elif ds._exclude is not None:
            fields = [f for c, f in enumerate(fields) if c not in ds._exclude]
        n = len(ds._columns)
        if len(fields) != n:
            have = "more" if len(fields) > n else len(fields)
            raise ValueError(f"Expect {n} fields but have {have} in record")
        return tuple(_parse(field, i, dtype, default, ds._na_value)
                     for i, (field, (dtype, default)) in enumerate(zip(fields, ds._columns)))


def _parse(field: str, i: int, dtype: np.dtype, default, na_value: str):
    if field == "" or field == na_value:
        if default is None:
            raise ValueError(f"Field {i} is required but missing in record!")
        return np.asarray(default, dtype)[()]
    if dtype.kind == "S":
        return np.bytes_(field.encode("latin-1"))
    try:
        value = int(field) if dtype.kind == "i" else float(field)
        with np.errstate(over="ignore"):
            out = np.asarray(value).astype(dtype)[()] if dtype.kind == "f" else np.array(value, dtype)[()]
        if dtype.kind == "f" and np.isinf(out) and not np.isinf(value):
            raise OverflowError(field)  # too large for the type (TF's strtof/strtod refuse it)
    except (ValueError, OverflowError):
        raise ValueError(f"Field {i} in record is not a valid {_CSV_TYPES[dtype]}: {field}") from None
    return out
