"""`Int8Codec`: per-channel affine quantisation to 8 bits.

Each channel c gets a zero point ``z[c]`` (its minimum, in the tensor's units) and a step
``s[c]``; an element becomes ``q = rint((x - z[c]) / s[c])`` in 0..255 and decodes to
``z[c] + q * s[c]``. With ``s[c] = (max - min) / 255`` every element lies in
``[z[c], z[c] + 255 s[c]]``, so ``|x - decode(encode(x))| <= s[c] / 2`` (plus float rounding).
The zero point is a float, not an integer as in integer-only inference: rounding it to the grid
would cost up to another half step.

The channel is axis 1 (NCHW channels, a sequence's positions) for rank >= 2, when each channel
holds at least `MIN_CHANNEL_ELEMENTS` elements; otherwise the whole tensor is one channel, since
8 bytes of parameters per channel would outweigh a few 1-byte elements (a ``(1, 1000)`` logit
row would grow 9x).

Section layout (little-endian)::

    channels  u32          C: 0 (empty tensor), 1 (per tensor) or shape[1] (per channel)
    zero      C x f32      channel minimum, rounded down to float32
    step      C x f32      channel step, rounded up to float32; 0 for a constant channel
    q         n x u8       C-ordered like the tensor
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from mopar.codec.base import (
    FLOAT_DTYPES,
    CodecError,
    PayloadError,
    check_supported,
    expected,
    little_endian,
)

__all__ = ["Int8Codec", "MIN_CHANNEL_ELEMENTS"]

MIN_CHANNEL_ELEMENTS = 64
_COUNT = struct.Struct("<I")


def _channels(shape: tuple[int, ...]) -> int:
    """How many channels the encoder uses for a tensor of ``shape`` (0 when it is empty)."""
    n = math.prod(shape)
    if n == 0:
        return 0
    if len(shape) >= 2 and shape[1] > 1 and n // shape[1] >= MIN_CHANNEL_ELEMENTS:
        return shape[1]
    return 1


def _by_channel(values: np.ndarray, ndim: int, channels: int) -> np.ndarray:
    """Reshape per-channel values to broadcast against a tensor of rank ``ndim``."""
    if channels == 1:
        return values.reshape(())
    return values.reshape((1, channels) + (1,) * (ndim - 2))


@dataclass(frozen=True)
class Int8Codec:
    """Per-channel affine quantisation to uint8; zero points and steps travel in the section."""

    name = "int8"
    code = 4
    lossless = False
    packed_itemsize = 1

    def supports(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype) in FLOAT_DTYPES

    def max_encoded_bytes(self, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        n = math.prod(shape)
        most = (shape[1] if len(shape) >= 2 else 1) if n else 0
        return _COUNT.size + 8 * most + n

    def encode(self, array: np.ndarray) -> bytes:
        x = little_endian(array)
        check_supported(self, x.dtype)
        channels = _channels(x.shape)
        x = x.reshape(x.shape or (1,))  # numpy ufuncs on 0-d arrays return scalars
        if channels == 0:
            return _COUNT.pack(0)
        if channels == 1:
            lo, hi = np.array([x.min()]), np.array([x.max()])
        else:
            axes = tuple(i for i in range(x.ndim) if i != 1)
            lo, hi = x.min(axis=axes), x.max(axis=axes)
        zero, step = _grid(lo.astype(np.float64), hi.astype(np.float64))
        work = np.float64 if x.dtype == np.float64 else np.float32
        inverse = np.divide(1.0, step, out=np.zeros_like(step, dtype=np.float64), where=step > 0)
        q = np.subtract(x, _by_channel(zero.astype(work), x.ndim, channels), dtype=work)
        q *= _by_channel(inverse.astype(work), x.ndim, channels)
        np.rint(q, out=q)
        np.clip(q, 0, 255, out=q)
        return b"".join(
            (_COUNT.pack(channels), zero.tobytes(), step.tobytes(), q.astype(np.uint8).tobytes())
        )

    def decode(self, data, *, dtype, shape) -> np.ndarray:
        dtype, shape, n = expected(dtype, shape)
        check_supported(self, dtype)
        zero, step, q = self._split(data, shape, n)
        if n == 0:
            return np.zeros(shape, dtype=dtype)
        work = np.float64 if dtype == np.float64 else np.float32
        channels = len(zero)
        out = q.reshape(shape).astype(work)
        with np.errstate(over="ignore"):  # a forged step may overflow to inf: no crash, no noise
            out *= _by_channel(step.astype(work), len(shape), channels)
            out += _by_channel(zero.astype(work), len(shape), channels)
            return out.astype(dtype, copy=False)

    def steps(self, data: bytes | memoryview, *, shape: tuple[int, ...]) -> np.ndarray:
        """The step of each element's channel, broadcastable to ``shape``.

        Half of it bounds the quantisation error, with no need to decode.
        """
        _, shape, n = expected(np.float32, shape)
        _, step, _ = self._split(data, shape, n)
        return _by_channel(step, len(shape), len(step)) if n else np.zeros(())

    def _split(self, data, shape: tuple[int, ...], n: int):
        view = memoryview(data).cast("B")
        if len(view) < _COUNT.size:
            raise PayloadError(
                f"int8 section has {len(view)} bytes, shorter than its "
                f"{_COUNT.size}-byte channel count"
            )
        (channels,) = _COUNT.unpack(view[: _COUNT.size])
        allowed = {0} if n == 0 else {1, shape[1]} if len(shape) >= 2 else {1}
        if channels not in allowed:
            raise PayloadError(
                f"int8 section has {channels} channels; a tensor of shape "
                f"{shape} takes {' or '.join(map(str, sorted(allowed)))}"
            )
        want = _COUNT.size + 8 * channels + n
        if len(view) != want:
            raise PayloadError(
                f"int8 section has {len(view)} bytes; {channels} channels and "
                f"{n} elements take {want}"
            )
        head = _COUNT.size + 4 * channels
        zero = np.frombuffer(view[_COUNT.size : head], dtype="<f4")
        step = np.frombuffer(view[head : head + 4 * channels], dtype="<f4")
        if not (np.isfinite(zero).all() and np.isfinite(step).all() and (step >= 0).all()):
            raise PayloadError(
                "int8 section has a non-finite zero point or a negative or non-finite step"
            )
        return zero, step, np.frombuffer(view[head + 4 * channels :], dtype=np.uint8)


def _grid(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 zero points <= lo and steps with zero + 255 step >= hi, per channel."""
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise CodecError(
            "codec int8 cannot carry NaN or infinite values; use fp16, bf16 or zstd for this tensor"
        )
    with np.errstate(over="ignore"):  # float64 beyond float32's range: refused just below
        zero = lo.astype(np.float32)
        zero = np.where(zero > lo, np.nextafter(zero, np.float32(-np.inf)), zero)
        exact = (hi - zero.astype(np.float64)) / 255.0
        step = exact.astype(np.float32)
        step = np.where(step < exact, np.nextafter(step, np.float32(np.inf)), step)
    if not (np.isfinite(zero).all() and np.isfinite(step).all()):
        raise CodecError(
            "codec int8 cannot carry values beyond float32's range (about "
            "3.4e38); use zstd for this tensor"
        )
    return zero.astype("<f4"), step.astype("<f4")
