"""The `Codec` protocol, the codec errors, and the helpers every codec shares.

A codec turns one array into bytes and back. It never sees the payload header: the caller (the
wire format, `mopar.runtime.wire`) records the ORIGINAL dtype and shape, validates them, and hands
them to `Codec.decode`, which returns an array of exactly that dtype and shape. Every decoder
checks the size of its section against what that dtype and shape allow before it allocates, and
refuses anything else with a `PayloadError`.

Imports numpy only (and zstandard in `zstd.py`): this package ships inside every function.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import numpy as np

from mopar.errors import MoparError

__all__ = ["Codec", "CodecError", "PayloadError", "NoneCodec", "FLOAT_DTYPES", "DTYPE_CODES"]

# What the lossy codecs take: activations. Integer and bool tensors (indices, masks) only go
# through the lossless ones.
FLOAT_DTYPES = frozenset({np.dtype("float16"), np.dtype("float32"), np.dtype("float64")})
DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "float64": 3,
    "bfloat16": 4,
    "int64": 5,
    "int32": 6,
    "int16": 7,
    "int8": 8,
    "uint8": 9,
    "bool": 10,
}
"""The dtypes a handed-over tensor may have, and their one-byte codes in a payload header
(`mopar.runtime.wire`); ``function.json`` names a tensor's dtype by one of these names."""


class PayloadError(ValueError):
    """A tensor payload is malformed; the message says which field or section and why."""


class CodecError(MoparError, ValueError):
    """A codec name is unknown or malformed, or a codec cannot carry a tensor's dtype."""


@runtime_checkable
class Codec(Protocol):
    """Turns an array into bytes and back.

    Attributes:
        name: the canonical name, as `get_codec` parses it (``"int8+zstd"``, ``"zstd:9"``).
        code: the one-byte code the payload header carries; decoding needs nothing else.
        lossless: whether ``decode(encode(x))`` is bit-exact.
    """

    @property
    def name(self) -> str: ...

    @property
    def code(self) -> int: ...

    @property
    def lossless(self) -> bool: ...

    def supports(self, dtype: np.dtype) -> bool:
        """Whether this codec can carry tensors of ``dtype``."""
        ...

    def max_encoded_bytes(self, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        """An upper bound on ``len(encode(x))`` for any ``x`` of this dtype and shape, bytes."""
        ...

    def encode(self, array: np.ndarray) -> bytes:
        """The codec's section for ``array`` (which must be of a supported dtype)."""
        ...

    def decode(
        self, data: bytes | bytearray | memoryview, *, dtype: np.dtype | str, shape: tuple[int, ...]
    ) -> np.ndarray:
        """Rebuild the array of ``dtype`` and ``shape``; raise `PayloadError` if ``data`` is not a
        section this codec could have written for them."""
        ...


def expected(
    dtype: np.dtype | str, shape: tuple[int, ...]
) -> tuple[np.dtype, tuple[int, ...], int]:
    """Normalise a decode request: the dtype, the shape as ints, and the element count."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise PayloadError(f"shape {shape} has a negative dimension")
    return dtype, shape, math.prod(shape)


def little_endian(array: np.ndarray) -> np.ndarray:
    """C-ordered and little-endian, keeping 0-d arrays 0-d (np.ascontiguousarray would not)."""
    array = np.require(array, requirements="C")
    return array.astype(array.dtype.newbyteorder("<"), copy=False)


def check_supported(codec: Codec, dtype: np.dtype) -> None:
    if not codec.supports(dtype):
        hint = (
            "the lossy codecs take float16, float32 and float64 tensors only; use none or "
            "zstd for this one"
            if dtype.kind in "biu"
            else "no codec can"
        )
        raise CodecError(f"codec {codec.name} cannot carry {dtype} tensors ({hint})")


def exact_length(codec: str, data: bytes | memoryview, want: int) -> memoryview:
    view = memoryview(data).cast("B")
    if len(view) != want:
        raise PayloadError(f"{codec} section has {len(view)} bytes, the tensor needs {want}")
    return view


class NoneCodec:
    """No codec: the raw little-endian C-ordered bytes."""

    name = "none"
    code = 0
    lossless = True

    def supports(self, dtype: np.dtype) -> bool:
        return np.dtype(dtype).kind in "biuf"

    def max_encoded_bytes(self, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        return np.dtype(dtype).itemsize * math.prod(shape)

    def encode(self, array: np.ndarray) -> bytes:
        return little_endian(array).tobytes()

    def decode(self, data, *, dtype, shape) -> np.ndarray:
        dtype, shape, n = expected(dtype, shape)
        view = exact_length(self.name, data, n * dtype.itemsize)
        return np.frombuffer(view, dtype=dtype.newbyteorder("<")).reshape(shape).astype(dtype)

    def __repr__(self) -> str:
        return "NoneCodec()"
