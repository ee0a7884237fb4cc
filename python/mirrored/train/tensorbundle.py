"""TensorFlow checkpoints (TensorBundle, ``prefix.index`` + ``prefix.data-SSSSS-of-NNNNN``), read without TensorFlow.

So a model trained with TensorFlow loads into a port::

    md.train.list_variables("tf_run")                          # [(key, shape)], as tf.train.list_variables
    md.train.load_variable("tf_run", "model/w/.ATTRIBUTES/VARIABLE_VALUE")
    md.train.Checkpoint(model=model).restore(md.train.latest_checkpoint("tf_run"))   # by TF's object names

The format, as TensorFlow writes it (``tensorflow/core/util/tensor_bundle``):

- ``.index`` is a LevelDB table (SSTable): a 48-byte footer at the end points
  at an index block, whose entries point at data blocks; a block is
  prefix-compressed key/value entries, a restart array and a 5-byte trailer
  (compression type, masked CRC32C). The values are protobufs: under the empty
  key a ``BundleHeaderProto`` (shard count, byte order), under every tensor's
  name a ``BundleEntryProto`` (dtype, shape, shard, offset, size, CRC32C).
- ``.data-*`` shards hold the tensors' raw bytes at those offsets; a string
  tensor is its lengths (varint64), a masked CRC32C of them, then the bytes.
- ``_CHECKPOINTABLE_OBJECT_GRAPH`` (a string tensor) is a
  ``TrackableObjectGraph`` protobuf: which object is whose child under which
  name, and each variable's tensor name (``model/w/.ATTRIBUTES/VARIABLE_VALUE``).
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np

from ..data.crc32c import crc32c, unmask
from .checkpoint_io import _MAGIC, _MAX_INDEX, CheckpointError, damaged, open_regular_file, read_into

__all__ = ["BundleReader", "is_tensorflow_checkpoint", "object_keys", "object_aliases", "hint"]

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER = 48
_STRING = 7  # DT_STRING
# TensorFlow's DataType enum (types.proto) -> NumPy; bfloat16 and float8 come from ml_dtypes.
_DTYPES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 8: "complex64", 9: "int64",
           10: "bool", 14: "bfloat16", 17: "uint16", 18: "complex128", 19: "float16", 22: "uint32", 23: "uint64",
           24: "float8_e5m2", 25: "float8_e4m3fn"}
_DATA_SUFFIX = re.compile(r"\.data-\d{5}-of-\d{5}$")


# --- protobuf wire format: just enough to read the three messages ------------------------------------

class _Malformed(Exception):
    pass


def _varint(buf, pos: int):
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Malformed("a varint runs past its message")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf) -> list:
    """``[(field_number, value)]`` of a protobuf message: ints for varint/fixed fields, bytes for the rest."""
    out, pos = [], 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise _Malformed("a fixed64 runs past its message")
            (value,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise _Malformed("a length-delimited field runs past its message")
            value = bytes(buf[pos:pos + length])
            pos += length
        elif wire == 5:
            if pos + 4 > len(buf):
                raise _Malformed("a fixed32 runs past its message")
            (value,) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            raise _Malformed(f"wire type {wire} is not one of protobuf's")
        out.append((number, value))
    return out


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class BundleEntry:
    """One tensor of the bundle: ``BundleEntryProto``'s fields."""

    __slots__ = ("key", "dtype", "tf_dtype", "shape", "shard", "offset", "size", "crc32c")

    @property
    def nbytes(self) -> int:
        return self.size

    def __init__(self, key: str, proto: bytes, path: str):
        self.key, self.tf_dtype, self.shard, self.offset, self.size, self.crc32c = key, 0, 0, 0, 0, None
        dims, sliced = [], False
        for number, value in _fields(proto):
            if number == 1:
                self.tf_dtype = value
            elif number == 2:
                for n, dim in _fields(value):
                    if n == 2:
                        dims.append(_signed64(dict(_fields(dim)).get(1, 0)))
                    elif n == 3 and value:
                        raise _Malformed("its shape has an unknown rank")
            elif number == 3:
                self.shard = value
            elif number == 4:
                self.offset = _signed64(value)
            elif number == 5:
                self.size = _signed64(value)
            elif number == 6:
                self.crc32c = value
            elif number == 7:
                sliced = True
        if sliced:
            raise CheckpointError(f"path={path!r}: tensor {key!r} is a partitioned variable (saved in slices), "
                                  "which mirrored does not read; save it unpartitioned from TensorFlow")
        if any(d < 0 for d in dims) or self.offset < 0 or self.size < 0:
            raise _Malformed("a negative dimension, offset or size")
        self.shape = tuple(dims)
        if self.tf_dtype == _STRING:
            self.dtype = np.dtype(object)
            return
        name = _DTYPES.get(self.tf_dtype)
        if name is None:
            raise CheckpointError(f"path={path!r}: tensor {key!r} has TensorFlow dtype number {self.tf_dtype}, "
                                  "which has no NumPy equivalent here (numeric, bool and string tensors only)")
        if name in ("bfloat16", "float8_e5m2", "float8_e4m3fn"):
            import ml_dtypes  # noqa: F401  registers them with NumPy
        self.dtype = np.dtype(name)
        expected = self.dtype.itemsize * int(np.prod(self.shape, dtype=object))
        if self.size != expected:
            raise _Malformed(f"tensor {key!r} has {self.size} bytes, but {name}{list(self.shape)} is {expected}")


# --- the table (.index) ------------------------------------------------------------------------------

def _block(index: bytes, handle: bytes, path: str) -> list:
    """The ``(key, value)`` entries of the block ``handle`` points at, its CRC32C checked."""
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    if offset + size + 5 > len(index):
        raise _Malformed("a block lies beyond the end of the file")
    data, kind = index[offset:offset + size], index[offset + size]
    (stored,) = struct.unpack_from("<I", index, offset + size + 1)
    if unmask(stored) != crc32c(index[offset:offset + size + 1]):
        raise damaged(f"path={path!r} is corrupted (a block's CRC32C does not match); restore an "
                              "earlier checkpoint")
    if kind != 0:
        raise CheckpointError(f"path={path!r}: its blocks are compressed (type {kind}); TensorFlow writes "
                              "uncompressed bundles, so this file is not one mirrored can read")
    if len(data) < 4:
        raise _Malformed("a block is shorter than its restart count")
    (restarts,) = struct.unpack_from("<I", data, len(data) - 4)
    end = len(data) - 4 - 4 * restarts
    if end < 0:
        raise _Malformed("a block's restart array is larger than the block")
    entries, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(data, pos)
        unshared, pos = _varint(data, pos)
        length, pos = _varint(data, pos)
        if shared > len(key) or pos + unshared + length > end:
            raise _Malformed("a block entry runs past its block")
        key = key[:shared] + data[pos:pos + unshared]
        pos += unshared
        entries.append((key, data[pos:pos + length]))
        pos += length
    return entries


def _table(path: str, index: bytes) -> list:
    if len(index) < _FOOTER or struct.unpack_from("<Q", index, len(index) - 8)[0] != _TABLE_MAGIC:
        raise damaged(f"path={path!r} is not a TensorFlow checkpoint index (no table footer); pass the "
                              "prefix of a checkpoint written by tf.train.Checkpoint")
    footer = index[len(index) - _FOOTER:]
    _, pos = _varint(footer, 0)
    _, pos = _varint(footer, pos)  # the metaindex block handle: TensorBundle stores nothing there
    entries = []
    for _, handle in _block(index, footer[pos:], path):
        entries.extend(_block(index, handle, path))
    return entries


# --- the reader ----------------------------------------------------------------------------------------

def _prefix(path: str) -> str:
    if path.endswith(".index"):
        return path[:-len(".index")]
    return _DATA_SUFFIX.sub("", path)


def is_tensorflow_checkpoint(path: str) -> bool:
    """Whether ``path`` names a TensorBundle: its prefix, its ``.index`` or one of its data shards."""
    return os.path.isfile(_prefix(os.fspath(path)) + ".index") and not _is_mirrored_file(path)


def _is_mirrored_file(path: str) -> bool:
    try:
        with open_regular_file(path) as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except (OSError, CheckpointError):
        return False


def hint(path: str) -> str:
    """The sentence to add to an error about ``path`` when it is (part of) a TensorFlow checkpoint, else ''."""
    prefix = _prefix(os.fspath(path))
    if not os.path.isfile(prefix + ".index"):
        return ""
    return (f"; it is part of the TensorFlow checkpoint {prefix!r}: pass that prefix to "
            "md.train.Checkpoint(...).restore, md.train.list_variables or md.train.load_variable")


class BundleReader:
    """A TensorFlow checkpoint opened for reading: ``keys``, ``entry(key)``, ``read(key)``.

    Reading a tensor checks its CRC32C; ``verify(keys)`` checks several before
    any is used (a restore assigns nothing unless all are intact).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.prefix = _prefix(self.path)
        index_path = self.prefix + ".index"
        with open_regular_file(index_path) as f:
            size = os.fstat(f.fileno()).st_size
            # An index holds a few hundred bytes per tensor: refuse sizes no real one reaches before reading.
            if size > _MAX_INDEX:
                raise CheckpointError(f"path={index_path!r} is {size} bytes, too large for a checkpoint index")
            index = f.read()
        self._entries, self._verified = {}, set()
        try:
            header = None
            for raw_key, value in _table(index_path, index):
                key = raw_key.decode("utf-8", errors="replace")
                if key == "":
                    header = dict(_fields(value))
                else:
                    self._entries[key] = BundleEntry(key, value, index_path)
        except _Malformed as e:
            raise damaged(f"path={index_path!r} is damaged: {e}; restore an earlier checkpoint") from None
        if header is None:
            raise damaged(f"path={index_path!r} has no BundleHeaderProto (the empty key); it is damaged")
        self._shards = header.get(1, 1)
        self._big_endian = header.get(2, 0) == 1
        if not 1 <= self._shards <= 1 << 16 or any(e.shard >= self._shards for e in self._entries.values()):
            raise damaged(f"path={index_path!r} is damaged: a tensor names a shard beyond the "
                                  f"{self._shards} the header declares")
        self._files = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    @property
    def keys(self) -> list:
        return sorted(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def entry(self, key: str) -> BundleEntry:
        return self._entries[key]

    def _shard(self, shard: int):
        if shard not in self._files:
            self._files[shard] = open_regular_file(f"{self.prefix}.data-{shard:05d}-of-{self._shards:05d}")
        return self._files[shard]

    def _raw(self, e: BundleEntry) -> bytearray:
        f = self._shard(e.shard)
        out = bytearray(e.size)
        if read_into(f, e.offset, memoryview(out)) < e.size:
            raise damaged(f"path={f.name!r} is truncated: tensor {e.key!r} ends at byte "
                                  f"{e.offset + e.size}, past the end of the file")
        return out

    def _check(self, e: BundleEntry, crc: int) -> None:
        if e.crc32c is not None and unmask(e.crc32c) != crc:
            raise damaged(f"path={self.prefix!r}: tensor {e.key!r} is corrupted (CRC32C mismatch in "
                                  f"shard {e.shard}); restore an earlier checkpoint")

    def verify(self, keys) -> None:
        """Check the CRC32C of each of ``keys`` (done once per tensor)."""
        for key in keys:
            if key not in self._verified:
                self._decode(self._entries[key])

    def read(self, key: str):
        """The tensor ``key`` as a NumPy array (bytes for a scalar string, an object array of bytes otherwise)."""
        if key not in self._entries:
            raise KeyError(f"name={key!r} is not in the TensorFlow checkpoint {self.prefix!r}; it holds "
                           f"{self.keys}")
        return self._decode(self._entries[key])

    def _decode(self, e: BundleEntry):
        raw = self._raw(e)
        if e.tf_dtype == _STRING:
            value, crc = self._strings(e, raw)
        else:
            crc = None if e.key in self._verified or e.crc32c is None else crc32c(raw)
            dtype = e.dtype.newbyteorder(">") if self._big_endian and e.dtype.itemsize > 1 else e.dtype
            value = np.frombuffer(raw, dtype=dtype).reshape(e.shape).astype(e.dtype, copy=False)
        if crc is not None:
            self._check(e, crc)
        self._verified.add(e.key)
        return value

    def _strings(self, e: BundleEntry, raw):
        """Decode a string tensor: varint64 lengths, a masked CRC32C of them, the bytes."""
        count = int(np.prod(e.shape, dtype=object))
        try:
            lengths, pos, crc = [], 0, 0
            for _ in range(count):
                n, pos = _varint(raw, pos)
                lengths.append(n)
                # Lengths that fit 32 bits are checksummed as uint32 (older bundles had no others).
                crc = crc32c(struct.pack("<I" if n <= 0xFFFFFFFF else "<Q", n), crc)
            if pos + 4 + sum(lengths) != len(raw):
                raise _Malformed("its lengths do not add up to its size")
        except _Malformed as err:
            raise damaged(f"path={self.prefix!r}: string tensor {e.key!r} is damaged: {err}") from None
        crc = crc32c(raw[pos:pos + 4], crc)
        pos += 4
        items = []
        for n in lengths:
            items.append(bytes(raw[pos:pos + n]))
            crc = crc32c(raw[pos:pos + n], crc)
            pos += n
        if not e.shape:
            return items[0], crc
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(e.shape), crc


def _object_paths(bundle: BundleReader):
    """``(nodes, paths, aliases)`` of the object graph: each node's fields, the path of names it is first reached
    by from the root (breadth first, as TensorFlow names a shared object), and every other edge to a node
    (``parent's path/name`` -> the node's path)."""
    try:
        nodes = [_fields(node) for number, node in _fields(bundle.read(OBJECT_GRAPH_KEY)) if number == 1]
        paths, queue, aliases = {0: ()}, [0], {}
        while queue:
            node = queue.pop(0)
            for number, child in nodes[node]:
                if number == 1:
                    ref = dict(_fields(child))
                    target, name = ref.get(1, 0), ref.get(2, b"").decode("utf-8", errors="replace")
                    if target >= len(nodes):
                        raise _Malformed(f"a child refers to node {target} of {len(nodes)}")
                    if target not in paths:
                        paths[target] = paths[node] + (name,)
                        queue.append(target)
                    elif paths[target] != paths[node] + (name,):
                        aliases["/".join(paths[node] + (name,))] = "/".join(paths[target])
    except _Malformed as e:
        raise damaged(f"path={bundle.prefix!r}: its object graph is damaged: {e}") from None
    return nodes, paths, aliases


def object_keys(bundle: BundleReader) -> dict:
    """``{mirrored key: tensor name}`` from the object graph: ``model/w`` -> ``model/w/.ATTRIBUTES/VARIABLE_VALUE``.

    Every object reachable from the root by its children's names (the first
    path found wins, as TensorFlow names a shared object) gives its variable
    value the path of names, which is the key ``md.train.Checkpoint`` tracks
    it under. A checkpoint without an object graph (TF1's name-based saver)
    maps each tensor name to itself.
    """
    if OBJECT_GRAPH_KEY not in bundle:
        return {key: key for key in bundle.keys}
    nodes, paths, _ = _object_paths(bundle)
    keys = {}
    for node, path in paths.items():
        for number, attribute in nodes[node]:
            if number == 2:
                fields = dict(_fields(attribute))
                name = fields.get(1, b"").decode("utf-8", errors="replace")
                tensor = fields.get(3, b"").decode("utf-8", errors="replace")
                if name == "VARIABLE_VALUE" and tensor in bundle and path:
                    keys["/".join(path)] = tensor
    return keys


def object_aliases(bundle: BundleReader) -> dict:
    """The object graph's other paths to shared objects: ``path -> the path object_keys names it by``."""
    return _object_paths(bundle)[2] if OBJECT_GRAPH_KEY in bundle else {}
