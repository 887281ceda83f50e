"""Casts to 16 bits: `Fp16Codec` (IEEE half) and `Bf16Codec` (bfloat16, float32's top half).

Both halve the bytes of a float32 tensor and decode back to the tensor's own dtype.

- fp16 keeps 11 significant bits: relative error <= 2**-11 for |x| in [2**-14, 65504]; smaller
  values become subnormals (absolute error <= 2**-25); larger ones become +-inf, as a cast does.
- bf16 keeps 8 significant bits and float32's range: relative error <= 2**-8 for normal floats.
  It rounds to nearest even; NaN stays NaN (a quiet one), +-inf stays +-inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mopar.codec.base import FLOAT_DTYPES, check_supported, exact_length, expected, little_endian

__all__ = ["Fp16Codec", "Bf16Codec"]


@dataclass(frozen=True)
class _Cast:
    lossless = False
    packed_itemsize = 2  # bytes per element in the section (what zstd shuffles with)

    def supports(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype) in FLOAT_DTYPES

    def max_encoded_bytes(self, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        return 2 * math.prod(shape)


class Fp16Codec(_Cast):
    """IEEE binary16: a plain cast each way."""

    name = "fp16"
    code = 2

    def encode(self, array: np.ndarray) -> bytes:
        array = little_endian(array)
        check_supported(self, array.dtype)
        return array.astype("<f2").tobytes()

    def decode(self, data, *, dtype, shape) -> np.ndarray:
        dtype, shape, n = expected(dtype, shape)
        check_supported(self, dtype)
        view = exact_length(self.name, data, 2 * n)
        return np.frombuffer(view, dtype="<f2").reshape(shape).astype(dtype)


class Bf16Codec(_Cast):
    """bfloat16: the top 16 bits of float32, rounded to nearest even."""

    name = "bf16"
    code = 3

    def encode(self, array: np.ndarray) -> bytes:
        array = little_endian(array)
        check_supported(self, array.dtype)
        bits = array.astype("<f4", copy=False).reshape(-1).view("<u4")
        # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop 16 bits.
        # Cannot overflow uint32 except for negative NaNs, which are rewritten below.
        top = (bits >> 16) & 1
        top += 0x7FFF
        top += bits
        top >>= 16
        out = top.astype("<u2")
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        if nan.any():  # rounding could carry a NaN's low payload into +-inf; keep it a NaN
            out[nan] = (bits[nan] >> 16).astype("<u2") | 0x0040
        return out.tobytes()

    def decode(self, data, *, dtype, shape) -> np.ndarray:
        dtype, shape, n = expected(dtype, shape)
        check_supported(self, dtype)
        view = exact_length(self.name, data, 2 * n)
        bits = np.frombuffer(view, dtype="<u2").astype("<u4")
        bits <<= 16
        return bits.view("<f4").reshape(shape).astype(dtype, copy=False)
