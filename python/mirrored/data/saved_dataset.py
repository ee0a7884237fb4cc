"""``Dataset.save`` / ``Dataset.load`` / ``Dataset.snapshot``: a dataset's elements on disk, md.data's own format.

A saved dataset is a directory: ``dataset_spec.json`` (the element structure
and specs, written last, so a directory without it is an unfinished save) and
``shard_<k>/<n>.npz`` chunks of at most ``_CHUNK`` elements each, shard ``k``
holding the elements ``shard_func`` sent to it, in order. A chunk whose
elements share their shapes stores one stacked array per component, otherwise
each element's arrays (``structure.encode_state``: plain arrays and a JSON
description, never pickle). ``load`` reads the shards one after the other
(``reader_func`` may read them otherwise). The files are not TensorFlow's:
``load`` does not read a directory TF's ``save`` wrote, nor TF this one.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
import os
import shutil
import types

import numpy as np

from .._nest import flatten, pack_sequence_as
from ..device import device_util
from ..errors import NotFoundError
from .structure import DatasetSpec, TensorSpec, decode_state, encode_state, stack

SPEC_FILE = "dataset_spec.json"
_CHUNK = 1024
_COMPRESSIONS = (None, "", "NONE", "GZIP", "SNAPPY", "AUTO")


def check_path(path, argument: str = "path") -> str:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{argument}={path!r}: Expected binary or unicode string, got {type(path).__name__}; pass "
                        "a directory name")
    return os.fsdecode(path)


def check_compression(compression) -> bool:
    """Whether chunks are compressed (GZIP, SNAPPY and AUTO compress: zip's deflate stands in for both)."""
    if compression is not None and not isinstance(compression, str):
        raise TypeError(f"compression={compression!r}: expected None, 'GZIP', 'SNAPPY' or 'AUTO'")
    if compression is not None and compression.upper() not in _COMPRESSIONS:
        raise ValueError(f"compression={compression!r}: expected None, 'GZIP', 'SNAPPY' or 'AUTO'")
    return compression is not None and compression.upper() in ("GZIP", "SNAPPY", "AUTO")


# --- the element spec as JSON -----------------------------------------------------------------------------

def encode_spec(spec):
    if isinstance(spec, TensorSpec):
        return {"shape": None if spec.shape.rank is None else list(spec.shape), "dtype": spec.dtype.str}
    if isinstance(spec, DatasetSpec):
        raise TypeError("save: a dataset of datasets (window) cannot be saved; flat_map(lambda w: w.batch(size)) "
                        "first")
    if isinstance(spec, dict):
        return {"dict": [[k, encode_spec(v)] for k, v in spec.items()]}
    if hasattr(spec, "_fields"):
        return {"namedtuple": [type(spec).__name__, list(spec._fields), [encode_spec(v) for v in spec]]}
    return {"tuple": [encode_spec(v) for v in spec]}


def decode_spec(description):
    if "dtype" in description:
        return TensorSpec(description["shape"], np.dtype(description["dtype"]))
    if "dict" in description:
        return {k: decode_spec(v) for k, v in description["dict"]}
    if "namedtuple" in description:  # rebuilt as a namedtuple of the same name and fields, as TF's load does
        name, fields, items = description["namedtuple"]
        return collections.namedtuple(name, fields)(*(decode_spec(v) for v in items))
    return tuple(decode_spec(v) for v in description["tuple"])


# --- chunks ---------------------------------------------------------------------------------------------

def _write_chunk(path: str, elements: list, compress: bool) -> None:
    columns = list(zip(*(flatten(e) for e in elements)))
    if all(len({np.shape(x) for x in column}) == 1 for column in columns):
        content = {"stacked": [np.asarray(stack(list(column), i)) for i, column in enumerate(columns)]}
    else:
        content = {"elements": [list(e) for e in zip(*columns)]}
    (np.savez_compressed if compress else np.savez)(path, **encode_state(content))


def read_chunk(path: str, spec) -> list:
    with np.load(path, allow_pickle=False) as f:
        content = decode_state(dict(f))
    if "stacked" in content:
        columns = content["stacked"]
        rows = [[c[i] for c in columns] for i in range(len(columns[0]))] if columns else []
    else:
        rows = content["elements"]
    return [pack_sequence_as(spec, row) for row in rows]


def _host_leaves(element) -> list:
    return [device_util.to_host(x) if device_util.on_gpu(x) else x for x in flatten(element)]


class Writer:
    """Elements written into shard directories as they come, ``_CHUNK`` to a file."""

    def __init__(self, path: str, compress: bool):
        self._path, self._compress = path, compress
        self._pending: dict = {}
        self._chunks: dict = {}
        self.count = 0

    def add(self, shard: int, element) -> None:
        pending = self._pending.setdefault(shard, [])
        pending.append(_host_leaves(element))
        self.count += 1
        if len(pending) == _CHUNK:
            self._flush(shard)

    def _flush(self, shard: int) -> None:
        directory = os.path.join(self._path, f"shard_{shard}")
        os.makedirs(directory, exist_ok=True)
        n = self._chunks.get(shard, 0)
        _write_chunk(os.path.join(directory, f"{n}.npz"), self._pending.pop(shard), self._compress)
        self._chunks[shard] = n + 1

    def finish(self, spec) -> None:
        for shard in list(self._pending):
            self._flush(shard)
        description = {"element_spec": encode_spec(spec), "cardinality": self.count,
                       "shards": {str(k): v for k, v in sorted(self._chunks.items())}}
        tmp = os.path.join(self._path, SPEC_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(description, f)
        os.replace(tmp, os.path.join(self._path, SPEC_FILE))


def fresh_directory(path: str) -> None:
    """``path`` as an empty directory (what was there is replaced, as TF's save replaces it)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)


def publish(tmp: str, target: str) -> None:
    """A finished snapshot written in ``tmp`` becomes ``target``, unless another pass finished one first."""
    if os.path.exists(os.path.join(target, SPEC_FILE)):
        shutil.rmtree(tmp)
        return
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(tmp, target)


def shard_of(shard_func, element) -> int:
    shard = shard_func(*element) if type(element) is tuple else shard_func(element)
    if isinstance(shard, np.ndarray) and shard.shape == ():
        shard = shard[()]
    if not isinstance(shard, np.int64) or shard < 0:
        raise ValueError(f"`shard_func` must return a scalar int64 (>= 0), got {shard!r}; e.g. "
                         "lambda x: x % 4 over int64 elements, or np.int64(...)")
    return int(shard)


def read_description(path: str) -> dict:
    try:
        with open(os.path.join(path, SPEC_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NotFoundError(None, None, f"md.data saved dataset element_spec file not found: "
                            f"{os.path.join(path, SPEC_FILE)}; save the dataset with Dataset.save(path) first "
                            "(TensorFlow's saved datasets are not read)") from None


# --- snapshot ------------------------------------------------------------------------------------------

def _describe(value, out: list) -> None:
    """A stable description of one attribute of a pipeline's dataset, for its fingerprint: the same in every
    process for the same pipeline (no addresses), blind to the contents of mutable objects a function captures
    (a list it appends to is state, not configuration)."""
    if isinstance(value, (str, bytes, int, float, bool, type(None), np.generic, range, enum.Enum)):
        out.append(repr(value))
    elif isinstance(value, np.ndarray):
        out.append(f"{value.dtype.str}{value.shape}{hashlib.sha256(np.ascontiguousarray(value).data).hexdigest()}")
    elif isinstance(value, (tuple, list)):
        for v in value:
            _describe(v, out)
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            out.append(repr(k))
            _describe(value[k], out)
    elif isinstance(value, types.CodeType):
        out.append(value.co_code.hex())
        for const in value.co_consts:
            _describe(const, out)
    elif hasattr(value, "__code__"):  # a function: its code, and the immutable values it captures
        _describe(value.__code__, out)
        for cell in value.__closure__ or ():
            captured = cell.cell_contents
            _describe(captured if isinstance(captured, (str, bytes, int, float, tuple, np.generic, np.ndarray))
                      or hasattr(captured, "__code__") else type(captured).__qualname__, out)
    elif isinstance(value, (TensorSpec, DatasetSpec, np.dtype)):
        out.append(repr(value))
    else:
        out.append(type(value).__qualname__)


_NOT_FINGERPRINTED = {"_inputs", "_options", "_pipeline_options", "_spec", "_elements", "_epochs"}


def fingerprint(dataset) -> str:
    """The pipeline's fingerprint: its transformations, their arguments and functions' code, and its sources'
    values (a snapshot directory is kept per fingerprint, as TF's)."""
    out: list = []
    for d in dataset._pipeline():
        out.append(type(d).__qualname__)
        for name, value in sorted(vars(d).items()):
            if name not in _NOT_FINGERPRINTED:
                out.append(name)
                _describe(value, out)
    return hashlib.sha256("\x00".join(out).encode()).hexdigest()[:20]


