"""The tensor payload format: a fixed header, then the codec's section. Never pickle.

Layout (little-endian), version 2::

    magic   4s  b"MOPT"
    version u8  2
    dtype   u8  the ORIGINAL dtype, code from mopar.codec.DTYPE_CODES (what decoding returns)
    codec   u8  code from mopar.codec.CODES (0 = none: the raw C-ordered bytes)
    ndim    u8  0..8
    length  u64 bytes of the codec section that follows
    dims    ndim x u64, the ORIGINAL shape
    section length bytes

The header is validated completely -- magic, version, dtype, codec (and that it can carry that
dtype), rank, dims (at most `MAX_PAYLOAD_BYTES` of tensor), and the length (exactly the tensor's
bytes for codec none; at most the codec's bound on its section otherwise; and what is actually
there) -- before anything is allocated, so a malformed or hostile payload costs nothing. Decoding
a section then allocates at most the tensor's bytes (see `mopar.codec.zstd` for bombs).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from mopar.codec import DTYPE_CODES, Codec, PayloadError, codec_for_code, get_codec
from mopar.codec.base import little_endian
from mopar.errors import InternalError

__all__ = [
    "PayloadError",
    "encode",
    "encode_parts",
    "decode",
    "describe",
    "MAX_PAYLOAD_BYTES",
    "VERSION",
    "prepare_payload",
    "write_into",
    "read_from",
    "DATA_OFFSET",
]

MAGIC = b"MOPT"
VERSION = 2
_HEAD = struct.Struct("<4sBBBBQ")
MAX_NDIM = 8
MAX_PAYLOAD_BYTES = 16 << 30  # 16 GiB: larger than any function's memory
CODEC_NONE = 0
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items() if name != "bfloat16"}


def _codec(codec: str | Codec) -> Codec:
    return get_codec(codec) if isinstance(codec, str) else codec


def _header(array: np.ndarray, codec: Codec, length: int) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, DTYPE_CODES[array.dtype.name], codec.code, array.ndim, length)
    return head + struct.pack(f"<{array.ndim}Q", *array.shape)


def _check_sendable(array: np.ndarray, codec: Codec) -> None:
    name = array.dtype.name
    if name not in DTYPE_CODES or name == "bfloat16":
        raise PayloadError(
            f"dtype {name} cannot be sent; expected one of {sorted(_CODE_DTYPES.values())}"
        )
    if array.ndim > MAX_NDIM:
        raise PayloadError(f"rank {array.ndim} exceeds the maximum {MAX_NDIM}")
    if not codec.supports(array.dtype):
        raise PayloadError(f"codec {codec.name} cannot carry {name} tensors; use none or zstd")


def _section(array: np.ndarray, codec: Codec) -> bytes:
    section = codec.encode(array)
    bound = codec.max_encoded_bytes(array.dtype, array.shape)
    if len(section) > bound:  # the decoder would refuse it; a bug, not the user's doing
        raise InternalError(
            f"codec {codec.name} wrote {len(section)} bytes for "
            f"{array.dtype}{list(array.shape)}, over its own bound {bound}"
        )
    return section


def _parse(
    head: bytes, read_dims: Callable[[int], bytes]
) -> tuple[np.dtype, tuple[int, ...], Codec, int]:
    if len(head) < _HEAD.size:
        raise PayloadError(
            f"payload is {len(head)} bytes, shorter than the {_HEAD.size}-byte header"
        )
    magic, version, dtype_code, codec_code, ndim, length = _HEAD.unpack(head[: _HEAD.size])
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}: not a mopar tensor payload")
    if version != VERSION:
        raise PayloadError(
            f"payload version {version} is not supported (expected {VERSION}); "
            "both ends of a handoff must run the same mopar"
        )
    if dtype_code not in _CODE_DTYPES:
        raise PayloadError(f"unknown dtype code {dtype_code}")
    codec = codec_for_code(codec_code)
    if codec is None:
        raise PayloadError(f"unknown codec code {codec_code}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"rank {ndim} exceeds the maximum {MAX_NDIM}")
    raw = read_dims(8 * ndim)
    if len(raw) != 8 * ndim:
        raise PayloadError("payload ends inside the shape")
    shape = struct.unpack(f"<{ndim}Q", raw)
    dtype = np.dtype(_CODE_DTYPES[dtype_code])
    if not codec.supports(dtype):
        raise PayloadError(f"codec {codec.name} (code {codec_code}) cannot carry {dtype} tensors")
    expected = dtype.itemsize
    for d in shape:
        expected *= d
        if expected > MAX_PAYLOAD_BYTES:
            raise PayloadError(f"shape {shape} is larger than the {MAX_PAYLOAD_BYTES} byte limit")
    if codec.code == CODEC_NONE and length != expected:
        raise PayloadError(
            f"length field {length} does not match shape {shape} of {dtype} ({expected})"
        )
    bound = codec.max_encoded_bytes(dtype, shape)
    if length > bound:
        raise PayloadError(
            f"length field {length} exceeds the {bound}-byte bound of codec "
            f"{codec.name} for shape {shape} of {dtype}"
        )
    return dtype, tuple(shape), codec, length


def encode(array: np.ndarray, codec: str | Codec = "none") -> bytes:
    """Serialise ``array`` to header + codec section.

    Args:
        array: any C- or Fortran-ordered array of a dtype in `DTYPE_CODES` (not bfloat16).
        codec: a codec or its name (``"zstd"``, ``"int8+zstd"``; see `mopar.codec.get_codec`).
    """
    return b"".join(encode_parts(array, codec))  # one copy of the tensor, not two


def encode_parts(
    array: np.ndarray, codec: str | Codec = "none"
) -> tuple[bytes, bytes | memoryview]:
    """`encode` as its two parts, (header, section), not joined: their concatenation is the payload.

    For codec none the section is a view of the array's own bytes (of a C-ordered copy when the
    array is not C-ordered and little-endian), so nothing is copied: a sender that writes the
    parts one after the other (`mopar.runtime.transports.HttpClient`) hands the tensor over
    without building the payload. The array must not change until the parts are sent.
    """
    array, codec = little_endian(array), _codec(codec)
    _check_sendable(array, codec)
    section: bytes | memoryview
    if codec.code != CODEC_NONE:
        section = _section(array, codec)
    else:  # a uint8 view: any dtype's bytes, whatever its memoryview format
        # numpy's stubs give an ndarray __buffer__ (a Buffer) on Python >= 3.12 only
        section = memoryview(array.reshape(-1).view(np.uint8)) if array.nbytes else b""  # type: ignore[arg-type]
    return _header(array, codec, len(section)), section


def decode(data: bytes | memoryview) -> np.ndarray:
    """Parse a payload made by `encode`, validating the header first; decode its codec section."""
    view = memoryview(data).cast("B")
    offset = _HEAD.size

    def read_dims(n: int) -> bytes:
        return bytes(view[offset : offset + n])

    dtype, shape, codec, length = _parse(bytes(view[: _HEAD.size]), read_dims)
    start = _HEAD.size + 8 * len(shape)
    if len(view) - start != length:
        raise PayloadError(f"payload has {len(view) - start} data bytes, header says {length}")
    if codec.code == CODEC_NONE:
        raw = np.frombuffer(view[start:], dtype=dtype.newbyteorder("<"))
        return raw.reshape(shape).astype(dtype)
    return codec.decode(view[start:], dtype=dtype, shape=shape)


def describe(data: bytes | memoryview) -> tuple[np.dtype, tuple[int, ...], str]:
    """(dtype, shape, codec name) from a payload's header, validated, without decoding it."""
    view = memoryview(data).cast("B")
    dtype, shape, codec, _ = _parse(
        bytes(view[: _HEAD.size]), lambda n: bytes(view[_HEAD.size : _HEAD.size + n])
    )
    return dtype, shape, codec.name


# -- in-place payloads (the local runner's reusable shared-memory buffers, `mopar.runner.shmbuf`)

DATA_OFFSET = 128
"""Where a buffer's codec section starts: 64-byte aligned, after an 8-byte pointer to the header."""
_PTR = struct.Struct("<Q")


def prepare_payload(
    array: np.ndarray, codec: str | Codec = "none"
) -> tuple[np.ndarray, Codec, bytes | None]:
    """The prepared array, its codec and its encoded section (None for codec none: copied in place)."""
    array, codec = little_endian(array), _codec(codec)
    _check_sendable(array, codec)
    return array, codec, (None if codec.code == CODEC_NONE else _section(array, codec))


def write_into(buf: memoryview, array: np.ndarray, codec: Codec, section: bytes | None) -> None:
    """Write a payload into ``buf`` (at least `DATA_OFFSET` + the section's bytes long).

    The layout is an 8-byte offset of the wire header, the header (ending at `DATA_OFFSET`),
    then the section, so that a raw tensor read back in place is aligned for every dtype.
    """
    length = array.nbytes if section is None else len(section)
    head = _header(array, codec, length)
    start = DATA_OFFSET - len(head)
    buf[: _PTR.size] = _PTR.pack(start)
    buf[start:DATA_OFFSET] = head
    if section is not None:
        buf[DATA_OFFSET : DATA_OFFSET + length] = section
    elif length:
        # Copied as the tensor's own dtype: numpy copies uint8 arrays much more slowly.
        dest = np.frombuffer(buf, dtype=array.dtype, count=array.size, offset=DATA_OFFSET)
        np.copyto(dest, array.reshape(-1))


def _parse_at(buf: memoryview) -> tuple[np.dtype, tuple[int, ...], Codec, int]:
    (start,) = _PTR.unpack(buf[: _PTR.size])
    if not _PTR.size <= start < DATA_OFFSET:
        raise PayloadError(f"buffer header offset {start} is outside 8..{DATA_OFFSET}")
    head = bytes(buf[start : start + _HEAD.size])
    return _parse(head, lambda n: bytes(buf[start + _HEAD.size : start + _HEAD.size + n]))


def read_from(buf: memoryview) -> np.ndarray:
    """The tensor in ``buf``: a view over the buffer itself for codec none (no copy), else decoded.

    The view is valid until the buffer is written again; the caller owns that ordering.
    """
    dtype, shape, codec, length = _parse_at(buf)
    if DATA_OFFSET + length > len(buf):
        raise PayloadError(
            f"buffer holds {len(buf) - DATA_OFFSET} data bytes, header says {length}"
        )
    if codec.code != CODEC_NONE:
        return codec.decode(buf[DATA_OFFSET : DATA_OFFSET + length], dtype=dtype, shape=shape)
    count = length // dtype.itemsize
    raw = np.frombuffer(buf, dtype=dtype.newbyteorder("<"), count=count, offset=DATA_OFFSET)
    return raw.reshape(shape).astype(dtype, copy=False)
