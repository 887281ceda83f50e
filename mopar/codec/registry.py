"""Codec names and codes: `get_codec` parses a name, `codec_for_code` answers a payload header.

A name is one stage, or a lossy stage then zstd::

    none | zstd[:LEVEL] | fp16 | bf16 | int8 | (fp16 | bf16 | int8)+zstd[:LEVEL]

Other compositions make no sense (zstd twice, a cast after quantising) and are refused. The
level changes only the encoder, so one code serves every level.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mopar.codec.base import Codec, CodecError, NoneCodec, check_supported, expected
from mopar.codec.cast import Bf16Codec, Fp16Codec
from mopar.codec.quant import Int8Codec
from mopar.codec.zstd import DEFAULT_LEVEL, ZstdCodec, compress, compress_bound, decompress

__all__ = ["ZstdChain", "get_codec", "codec_for_code", "CODEC_NAMES", "CODES"]

_LOSSY = {"fp16": Fp16Codec, "bf16": Bf16Codec, "int8": Int8Codec}

# The one-byte codes in payload headers. Never reuse or renumber one within a payload version:
# the two ends of a handoff may run different mopar releases that speak the same version.
CODES: dict[str, int] = {
    "none": 0,
    "zstd": 1,
    "fp16": 2,
    "bf16": 3,
    "int8": 4,
    "fp16+zstd": 5,
    "bf16+zstd": 6,
    "int8+zstd": 7,
}
CODEC_NAMES: tuple[str, ...] = tuple(CODES)


@dataclass(frozen=True)
class ZstdChain:
    """A lossy stage, then zstd over its section (shuffled by the stage's element width).

    Args:
        first: the lossy stage (`Fp16Codec`, `Bf16Codec` or `Int8Codec`).
        zstd: the zstd stage; only its level matters.
    """

    first: Fp16Codec | Bf16Codec | Int8Codec
    zstd: ZstdCodec
    lossless = False

    @property
    def code(self) -> int:
        return CODES[f"{self.first.name}+zstd"]

    @property
    def name(self) -> str:
        return f"{self.first.name}+{self.zstd.name}"

    def supports(self, dtype: np.dtype) -> bool:
        return self.first.supports(dtype)

    def max_encoded_bytes(self, dtype: np.dtype, shape: tuple[int, ...]) -> int:
        return compress_bound(self.first.max_encoded_bytes(dtype, shape))

    def encode(self, array: np.ndarray) -> bytes:
        section = np.frombuffer(self.first.encode(array), dtype=np.uint8)
        return compress(section, level=self.zstd.level, itemsize=self.first.packed_itemsize)

    def decode(self, data, *, dtype, shape) -> np.ndarray:
        dtype, shape, _ = expected(dtype, shape)
        check_supported(self, dtype)
        section = decompress(
            data,
            limit=self.first.max_encoded_bytes(dtype, shape),
            itemsize=self.first.packed_itemsize,
            exact=False,
        )
        return self.first.decode(section, dtype=dtype, shape=shape)


def _is_zstd(stage: str) -> bool:
    return stage.partition(":")[0] == "zstd"


def _zstd(stage: str) -> ZstdCodec:
    _, colon, level = stage.partition(":")
    if not colon:
        return ZstdCodec(DEFAULT_LEVEL)
    try:
        number = int(level)
    except ValueError:
        raise CodecError(f"zstd level must be an integer, got {level!r} in {stage!r}") from None
    return ZstdCodec(number)


def get_codec(name: str) -> Codec:
    """The codec a name stands for (see the module docstring for the grammar).

    Raises:
        CodecError: the name is not a string, or names an unknown codec or composition.
    """
    if not isinstance(name, str):
        raise CodecError(f"a codec name must be a string, got {name!r}")
    return _parse(name)


@functools.lru_cache(maxsize=64)  # codecs are immutable; the worker asks once per tensor written
def _parse(name: str) -> Codec:
    stages = name.split("+")
    usage = f"expected one of {', '.join(CODEC_NAMES)} (zstd may take a level, as in zstd:9)"
    try:
        if len(stages) == 1 and name == "none":
            return NoneCodec()
        if len(stages) == 1 and name in _LOSSY:
            return _LOSSY[name]()
        if len(stages) == 1 and _is_zstd(name):
            return _zstd(name)
        if len(stages) == 2 and stages[0] in _LOSSY and _is_zstd(stages[1]):
            return ZstdChain(_LOSSY[stages[0]](), _zstd(stages[1]))
    except CodecError as exc:
        raise CodecError(f"codec {name!r}: {exc}; {usage}") from None
    raise CodecError(f"unknown codec {name!r}; {usage}")


def codec_for_code(code: int) -> Codec | None:
    """The codec that decodes a payload of this header code, or None for an unknown code."""
    name = next((n for n, c in CODES.items() if c == code), None)
    return None if name is None else get_codec(name)
