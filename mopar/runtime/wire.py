"""The tensor payload format: a fixed header, then the raw C-ordered bytes. Never pickle.

Layout (little-endian)::

    magic  4s   b"MOPT"
    version u8  1
    dtype   u8  code from DTYPE_CODES
    codec   u8  0 = none (later codecs add codes)
    ndim    u8  0..8
    length  u64 payload bytes
    dims    ndim x u64
    payload

The header is validated completely -- magic, version, dtype, codec, rank, dims, and that the length
equals the product of the dims times the item size and what is actually there -- before anything
is allocated, so a malformed or hostile payload costs nothing.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = [
    "PayloadError",
    "encode",
    "decode",
    "write_tensor",
    "read_tensor",
    "DTYPE_CODES",
    "MAX_PAYLOAD_BYTES",
]

MAGIC = b"MOPT"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBQ")
MAX_NDIM = 8
MAX_PAYLOAD_BYTES = 16 << 30  # 16 GiB: larger than any function's memory
CODEC_NONE = 0
DTYPE_CODES: dict[str, int] = {
    "float32": 1, "float16": 2, "float64": 3, "bfloat16": 4,
    "int64": 5, "int32": 6, "int16": 7, "int8": 8, "uint8": 9, "bool": 10,
}
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items() if name != "bfloat16"}


class PayloadError(ValueError):
    """A tensor payload is malformed; the message says which field and why."""


def _prepare(array: np.ndarray) -> np.ndarray:
    """C-ordered and little-endian, keeping 0-d arrays 0-d (np.ascontiguousarray would not)."""
    array = np.require(array, requirements="C")
    return array.astype(array.dtype.newbyteorder("<"), copy=False)


def _header(array: np.ndarray) -> bytes:
    name = array.dtype.name
    if name not in DTYPE_CODES or name == "bfloat16":
        raise PayloadError(f"dtype {name} cannot be sent; expected one of {sorted(_CODE_DTYPES.values())}")
    if array.ndim > MAX_NDIM:
        raise PayloadError(f"rank {array.ndim} exceeds the maximum {MAX_NDIM}")
    head = _HEAD.pack(MAGIC, VERSION, DTYPE_CODES[name], CODEC_NONE, array.ndim, array.nbytes)
    return head + struct.pack(f"<{array.ndim}Q", *array.shape)


def _parse(head: bytes, read_dims) -> tuple[np.dtype, tuple[int, ...], int]:
    if len(head) < _HEAD.size:
        raise PayloadError(f"payload is {len(head)} bytes, shorter than the {_HEAD.size}-byte header")
    magic, version, dtype_code, codec, ndim, length = _HEAD.unpack(head[: _HEAD.size])
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}: not a mopar tensor payload")
    if version != VERSION:
        raise PayloadError(f"payload version {version} is not supported (expected {VERSION})")
    if dtype_code not in _CODE_DTYPES:
        raise PayloadError(f"unknown dtype code {dtype_code}")
    if codec != CODEC_NONE:
        raise PayloadError(f"unknown codec code {codec}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"rank {ndim} exceeds the maximum {MAX_NDIM}")
    raw = read_dims(8 * ndim)
    if len(raw) != 8 * ndim:
        raise PayloadError("payload ends inside the shape")
    shape = struct.unpack(f"<{ndim}Q", raw)
    dtype = np.dtype(_CODE_DTYPES[dtype_code])
    expected = dtype.itemsize
    for d in shape:
        expected *= d
        if expected > MAX_PAYLOAD_BYTES:
            raise PayloadError(f"shape {shape} is larger than the {MAX_PAYLOAD_BYTES} byte limit")
    if length != expected:
        raise PayloadError(f"length field {length} does not match shape {shape} of {dtype} ({expected})")
    return dtype, tuple(shape), length


def encode(array: np.ndarray) -> bytes:
    """Serialise ``array`` to header + payload bytes."""
    array = _prepare(array)
    return _header(array) + array.tobytes()


def decode(data: bytes | memoryview) -> np.ndarray:
    """Parse a payload made by `encode`, validating the header first."""
    view = memoryview(data)
    offset = _HEAD.size

    def read_dims(n: int) -> bytes:
        return bytes(view[offset : offset + n])

    dtype, shape, length = _parse(bytes(view[: _HEAD.size]), read_dims)
    start = _HEAD.size + 8 * len(shape)
    if len(view) - start != length:
        raise PayloadError(f"payload has {len(view) - start} data bytes, header says {length}")
    return np.frombuffer(view[start:], dtype=dtype.newbyteorder("<")).reshape(shape).astype(dtype)


def write_tensor(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` atomically: a temporary name in the same folder, then rename."""
    array = _prepare(array)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_header(array))
            f.write(memoryview(array.reshape(-1)).cast("B") if array.nbytes else b"")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_tensor(path: Path) -> np.ndarray:
    """Read a tensor written by `write_tensor`, validating the header before allocating."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        dtype, shape, length = _parse(f.read(_HEAD.size), f.read)
        if size - f.tell() != length:
            raise PayloadError(f"{path.name}: file has {size - f.tell()} data bytes, header says {length}")
        out = np.empty(shape, dtype=dtype.newbyteorder("<"))
        if length:
            _readinto(f, memoryview(out.reshape(-1)).cast("B"))
    return out.astype(dtype, copy=False)


def _readinto(f: BinaryIO, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            raise PayloadError("file ended before its payload")
        got += n
