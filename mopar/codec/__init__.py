"""Codecs for the tensors handed over at cuts: lossless (zstd), casts (fp16, bf16), int8.

`get_codec` turns a name (``"int8+zstd"``) into a `Codec`; `codec_for_code` turns a payload
header's one-byte code into one. Imports numpy and zstandard only, never torch: the runtime and
every deployed function import this package.
"""

from __future__ import annotations

from mopar.codec.base import DTYPE_CODES, Codec, CodecError, NoneCodec, PayloadError
from mopar.codec.cast import Bf16Codec, Fp16Codec
from mopar.codec.quant import Int8Codec
from mopar.codec.registry import CODEC_NAMES, CODES, ZstdChain, codec_for_code, get_codec
from mopar.codec.zstd import ZstdCodec

__all__ = [
    "Codec",
    "CodecError",
    "PayloadError",
    "get_codec",
    "codec_for_code",
    "CODEC_NAMES",
    "CODES",
    "DTYPE_CODES",
    "NoneCodec",
    "ZstdCodec",
    "Fp16Codec",
    "Bf16Codec",
    "Int8Codec",
    "ZstdChain",
]
