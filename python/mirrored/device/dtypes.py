"""The one table between NumPy dtypes and the native core's dtype codes.

Codes match ``csrc/core/dtype.h`` (and, in the same order, NCCL's set).
bfloat16 is NumPy's ``ml_dtypes.bfloat16`` when ml_dtypes is installed.
"""

from __future__ import annotations

import numpy as np

# name -> code, as in csrc/core/dtype.h
CODES = {
    "float16": 0,
    "bfloat16": 1,
    "float32": 2,
    "float64": 3,
    "int8": 4,
    "uint8": 5,
    "int32": 6,
    "int64": 7,
}
SUPPORTED = tuple(CODES)

# reduce op name -> code, as in csrc/core/reduce_op.h
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "mean": 4}


def dtype_code(dtype, argument: str = "buffers") -> int:
    """Native code of a NumPy dtype, or a TypeError naming the argument and the fix."""
    dt = np.dtype(dtype)
    code = CODES.get(dt.name)
    if code is None:
        raise TypeError(
            f"{argument}: dtype {dt} is not supported; use one of {', '.join(SUPPORTED)} "
            f"(convert with .astype(...))"
        )
    if not dt.isnative:  # the core reads native numbers: a swapped array would be misread
        raise TypeError(f"{argument}: dtype {dt.str} is not in this machine's byte order; convert with "
                        f".astype({dt.newbyteorder('=').str!r})")
    return code


def op_code(op, argument: str = "op") -> int:
    """Native code of a reduce op given as a string (any case) or an enum with a string value."""
    name = getattr(op, "value", op)
    if not isinstance(name, str) or name.lower() not in OPS:
        raise ValueError(
            f"{argument}={op!r} is not a reduce op; use one of "
            f"{', '.join(repr(k) for k in OPS)} (any case) or mirrored.ReduceOp"
        )
    return OPS[name.lower()]


def op_name(op, argument: str = "op") -> str:
    code = op_code(op, argument)
    return next(k for k, v in OPS.items() if v == code)
