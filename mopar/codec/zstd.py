"""zstd with a byte shuffle: lossless, and bounded on the way back.

Read `ZstdCodec`, then `compress` and `decompress` (which the composed codecs use too).

Section layout::

    filter  u8     0: the bytes as they are; 1: byte-shuffled (planes of byte k of every element)
    frame   ...    exactly one zstd frame, with its content size and checksum

The shuffle (blosc's filter) groups byte k of every element together before compressing: the
sign and exponent bytes of dense float activations are alike from element to element, while the
low mantissa bytes are noise, so zstd finds more to work with in the planes (4-12% smaller on
the real activations in docs/codecs.md). But a tensor that is mostly exact zeros (a ReLU's output) compresses better
as it is: its runs of zero elements are long matches that the shuffle cuts into four shorter
ones (40% larger at 85% zeros). So the encoder shuffles elements wider than one byte unless at
least `SPARSE_ZEROS` of them are zero, and records its choice in the filter byte.

Decompression never allocates more than the caller's limit, which comes from a validated header:
a frame whose declared content size exceeds it is refused before decompressing, a frame without a
content size is decompressed into at most ``limit`` bytes, and the window a frame asks for is
capped at the next power of two above the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import zstandard

from mopar.codec.base import CodecError, PayloadError, check_supported, expected, little_endian

__all__ = [
    "ZstdCodec",
    "compress",
    "decompress",
    "compress_bound",
    "shuffle",
    "unshuffle",
    "DEFAULT_LEVEL",
    "LEVELS",
    "SPARSE_ZEROS",
]

DEFAULT_LEVEL = 3
LEVELS = range(-7, 23)  # zstd's fast levels -1..-7, then 1..22 (0 would mean "default")
_MAGIC = b"\x28\xb5\x2f\xfd"
_FRAME_SLACK = 32  # filter byte, frame header (<= 18 bytes) and checksum (4), rounded up
_PLAIN, _SHUFFLED = 0, 1
# Measured on ReLU-like tensors (docs/codecs.md): shuffling stops paying at 30-40% zeros.
SPARSE_ZEROS = 0.3


def compress_bound(n: int) -> int:
    """The most bytes a zstd frame of ``n`` content bytes takes (ZSTD_COMPRESSBOUND + header)."""
    small = (131072 - n) >> 11 if n < 131072 else 0
    return n + (n >> 8) + small + _FRAME_SLACK


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes of ``raw`` (uint8, a whole number of ``itemsize``-byte elements)."""
    if itemsize <= 1 or raw.size <= itemsize:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(planes: np.ndarray, out: np.ndarray, itemsize: int) -> None:
    """Write the bytes of ``planes`` (from `shuffle`) back in element order into ``out`` (uint8)."""
    if itemsize <= 1 or planes.size <= itemsize:
        out[...] = planes
        return
    # One plane at a time: contiguous reads, strided writes, about 3x faster than a transpose copy.
    rows = out.reshape(-1, itemsize)
    for k, plane in enumerate(planes.reshape(itemsize, -1)):
        rows[:, k] = plane


def compress(raw: np.ndarray, *, level: int, itemsize: int) -> bytes:
    """The filter byte and one zstd frame (with content size and checksum) of ``raw``'s bytes.

    Args:
        raw: uint8, a whole number of ``itemsize``-byte elements.
        level: zstd's level.
        itemsize: the element width to shuffle with, bytes (1: never shuffled).
    """
    filt = _PLAIN
    if itemsize in (2, 4, 8) and raw.size > itemsize:
        elements = raw.view(f"<u{itemsize}")
        if np.count_nonzero(elements) > (1 - SPARSE_ZEROS) * elements.size:
            filt = _SHUFFLED
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    body = shuffle(raw, itemsize) if filt == _SHUFFLED else raw
    return bytes((filt,)) + cctx.compress(body)


def decompress(data: bytes | memoryview, *, limit: int, itemsize: int, exact: bool) -> np.ndarray:
    """Decompress a section from `compress` into a uint8 array of at most ``limit`` bytes.

    Args:
        data: the filter byte, then exactly one zstd frame, nothing after it.
        limit: the most bytes the next stage can take (from the validated header), bytes.
        itemsize: the element width the encoder shuffled with, bytes.
        exact: the content must be exactly ``limit`` bytes, not just at most.

    Raises:
        PayloadError: not a frame, a frame declaring or inflating to more than ``limit``, a
            truncated or corrupt frame (bad checksum), or bytes after the frame.
    """
    view = memoryview(data).cast("B")
    if len(view) < 1 or view[0] not in (_PLAIN, _SHUFFLED):
        raise PayloadError(
            f"zstd section has filter {view[0] if len(view) else 'nothing'}, "
            f"expected {_PLAIN} (plain) or {_SHUFFLED} (byte-shuffled)"
        )
    filt, view = view[0], view[1:]
    if bytes(view[:4]) != _MAGIC:
        raise PayloadError(
            f"zstd section does not start with a zstd frame "
            f"(magic {bytes(view[:4])!r}, expected {_MAGIC!r})"
        )
    need = "exactly" if exact else "at most"
    try:
        declared = zstandard.frame_content_size(view)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"zstd frame header is malformed or truncated ({exc})") from None
    if declared >= 0 and (declared > limit or (exact and declared != limit)):
        raise PayloadError(
            f"zstd frame declares {declared} content bytes, but the tensor takes {need} {limit}: "
            "refused before decompressing (a decompression bomb or a corrupt payload)"
        )
    window = 1 << max(zstandard.WINDOWLOG_MIN, min(31, (max(limit, 1) - 1).bit_length()))
    dctx = zstandard.ZstdDecompressor(max_window_size=window)
    try:
        # max_output_size bounds a frame that does not declare its size; zstd refuses to write
        # past a declared size. Either way at most `limit` bytes (1 for an empty tensor).
        out = dctx.decompress(view, max_output_size=max(limit, 1), allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise PayloadError(
            f"zstd frame does not decompress to {need} {limit} bytes ({exc})"
        ) from None
    if len(out) > limit or (exact and len(out) != limit):
        raise PayloadError(
            f"zstd frame decompresses to {len(out)} bytes, the tensor takes {need} {limit}"
        )
    if len(out) % max(itemsize, 1):
        raise PayloadError(
            f"zstd frame decompresses to {len(out)} bytes, not a whole number of "
            f"{itemsize}-byte elements"
        )
    planes = np.frombuffer(out, dtype=np.uint8)
    if filt == _PLAIN or itemsize <= 1:
        return planes
    result = np.empty(len(out), dtype=np.uint8)
    unshuffle(planes, result, itemsize)
    return result


def _level(level: int) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        raise CodecError(
            f"zstd level must be an integer from {LEVELS.start} to "
            f"{LEVELS.stop - 1} other than 0, got {level!r}"
        )
    if level == 0:
        raise CodecError(
            "zstd level 0 is ambiguous (zstd reads it as its default); "
            f"give a level from 1 to {LEVELS.stop - 1}, or -1 to {LEVELS.start}"
        )
    return level


@dataclass(frozen=True)
class ZstdCodec:
    """Lossless: shuffle the bytes of elements wider than one byte (unless mostly zeros), then zstd.

    Args:
        level: zstd's level, 1 (fast) to 22 (small), or -1 to -7 (faster still); decoding does
            not depend on it.
    """

    level: int = DEFAULT_LEVEL
    code = 1
    lossless = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", _level(self.level))

    @property
    def name(self) -> str:
        return "zstd" if self.level == DEFAULT_LEVEL else f"zstd:{self.level}"

    def supports(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype).kind in "biuf"

    def max_encoded_bytes(self, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        return compress_bound(np.dtype(dtype).itemsize * math.prod(shape))

    def encode(self, array: np.ndarray) -> bytes:
        array = little_endian(array)
        check_supported(self, array.dtype)
        return compress(
            array.reshape(-1).view(np.uint8), level=self.level, itemsize=array.dtype.itemsize
        )

    def decode(self, data, *, dtype, shape) -> np.ndarray:
        dtype, shape, n = expected(dtype, shape)
        check_supported(self, dtype)
        raw = decompress(data, limit=n * dtype.itemsize, itemsize=dtype.itemsize, exact=True)
        if not raw.flags.writeable:  # one-byte elements come straight from zstd's bytes
            raw = raw.copy()
        return raw.view(dtype.newbyteorder("<")).reshape(shape).astype(dtype, copy=False)
