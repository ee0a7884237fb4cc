"""CRC32C (Castagnoli), masked as LevelDB, TensorBundle and TFRecord files mask it.

Used by the TFRecord reader and writer (readers.py) and TensorFlow checkpoint
reading (train/tensorbundle.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["crc32c", "mask", "unmask"]


def _crc_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def _crc32c_bytes(data: bytes, crc: int) -> int:
    table = _CRC_TABLE
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_BLOCK = 64  # columns of the lanes transposed at a time
_NP_CRC_TABLE = np.array(_CRC_TABLE, np.uint32)


def _gf2_times(matrix, vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_product(a, b):
    """The operator ``a`` after ``b``."""
    return [_gf2_times(a, column) for column in b]


def _zeros_operator(nbytes: int):
    """The linear map taking the CRC register over ``nbytes`` zero bytes (zlib's crc32_combine, as a matrix)."""
    one_bit = [0x82F63B78] + [1 << i for i in range(31)]
    power = _gf2_product(one_bit, one_bit)             # 2 zero bits
    power = _gf2_product(power, power)                 # 4
    power = _gf2_product(power, power)                 # 8: one zero byte
    result = [1 << i for i in range(32)]
    while nbytes:
        if nbytes & 1:
            result = _gf2_product(power, result)
        nbytes >>= 1
        if nbytes:
            power = _gf2_product(power, power)
    return result


def _apply(matrix, vectors: np.ndarray) -> np.ndarray:
    """``matrix`` applied to each uint32 of ``vectors`` (GF(2), one NumPy pass per bit)."""
    out = np.zeros_like(vectors)
    for bit, column in enumerate(matrix):
        out ^= ((vectors >> np.uint32(bit)) & np.uint32(1)) * np.uint32(column)
    return out


def crc32c(data, crc: int = 0) -> int:
    """CRC32C of ``data`` continuing ``crc`` (``crc32c(b + c) == crc32c(c, crc32c(b))``).

    Large inputs are cut into many lanes whose CRCs NumPy computes side by
    side, then combined pairwise (CRC is linear: ``crc(A + B) =
    Z(crc(A)) ^ crc(B)``, ``Z`` the operator of ``len(B)`` zero bytes), so no
    compiled dependency is needed.
    """
    data = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    lanes = next((n for n in (1 << 16, 1 << 12) if len(data) // n >= 64), None)
    if lanes is None:
        return _crc32c_bytes(data.tobytes(), crc)
    length = len(data) // lanes
    state = np.full(lanes, 0xFFFFFFFF, np.uint32)
    table = _NP_CRC_TABLE
    columns = data[:lanes * length].reshape(lanes, length)
    index, shifted = np.empty(lanes, np.intp), np.empty(lanes, np.uint32)
    for start in range(0, length, _BLOCK):
        for column in np.ascontiguousarray(columns[:, start:start + _BLOCK].T):
            # state = table[(state ^ byte) & 0xFF] ^ (state >> 8), in place
            np.bitwise_xor(state & np.uint32(0xFF), column, out=index, casting="unsafe")
            np.right_shift(state, np.uint32(8), out=shifted)
            np.take(table, index, out=state)
            state ^= shifted
    crcs = state ^ np.uint32(0xFFFFFFFF)
    shift = _zeros_operator(length)
    while len(crcs) > 1:  # neighbours joined: lanes of twice the length, half as many
        crcs = _apply(shift, crcs[0::2]) ^ crcs[1::2]
        shift = _gf2_product(shift, shift)
    crc = _gf2_times(shift, crc) ^ int(crcs[0])  # ``shift`` now spans all the lanes
    return _crc32c_bytes(data[lanes * length:].tobytes(), crc)


def unmask(masked: int) -> int:
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def mask(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
