"""How a recorded TensorFlow result is written down, shared by a recorder (tests/data/record_*.py, run where
TensorFlow is installed and mirrored is not) and the test that replays it on mirrored (where TensorFlow is not):
so this module imports neither."""

import numpy as np

# Python exceptions a remote function raises, by the name a recorded case gives them (rpc).
PYTHON_ERRORS = {"value_error": ValueError("bad value"), "type_error": TypeError("bad type"),
                 "zero_division": ZeroDivisionError("division by zero"), "key_error": KeyError("k"),
                 "stop_iteration": StopIteration(), "runtime_error": RuntimeError("boom"),
                 "not_implemented": NotImplementedError("later"), "index_error": IndexError("index")}


def flat_values(x) -> list:
    """An array's values in order as JSON: complex numbers as [real, imag], strings as text, inf and nan
    (which JSON lacks) by their repr."""
    x = np.asarray(x)
    if x.dtype.kind == "c":
        return [[float(v.real), float(v.imag)] for v in x.reshape(-1)]
    if x.dtype.kind in "SO":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in x.reshape(-1)]
    return [v if np.isfinite(v) else repr(v) for v in x.reshape(-1).astype(np.float64).tolist()]


def nest(value):
    """A result with its nesting kept: dicts, lists and tuples by kind, arrays by dtype, shape and values,
    strings as text."""
    if isinstance(value, dict):
        return {"dict": {k: nest(v) for k, v in sorted(value.items())}}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [nest(v) for v in value]}
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind == "S":
        return {"bytes": array.item().decode() if array.ndim == 0 else [b.decode() for b in array.ravel()]}
    return {"dtype": array.dtype.name, "shape": list(array.shape), "v": array.tolist()}


def replica_values(value, distributed_type):
    """A collective's result: a ``distributed_type`` (TF's or mirrored's DistributedValues) by its replicas'
    values, lists and tuples as lists, arrays by dtype, shape and values."""
    if isinstance(value, distributed_type):
        return {"per_replica": [replica_values(v, distributed_type) for v in value.values]}
    if isinstance(value, (list, tuple)):
        return [replica_values(v, distributed_type) for v in value]
    a = np.asarray(value)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "v": a.tolist()}
