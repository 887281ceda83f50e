"""A frame: the named tensors one request hands from a function to the next. Never pickle.

Layout (little-endian), version 1::

    magic   4s  b"MOPF"
    version u8  1
    count   u16 number of tensors
    then, per tensor:
        name_len u16, name (UTF-8), payload_len u64, payload (a `mopar.runtime.wire` payload)

A frame is what travels over HTTP bodies, Redis values, shm files and Lambda events. Each
tensor's payload keeps its own codec header, so a function forwards the tensors it only carries
(skip connections for a later slice) byte for byte, without decoding and re-encoding them: a lossy
codec is applied once, by the slice that made the tensor.

`split_frame` checks the whole framing before anything is decoded; `decode` of each payload then
checks the payload's own header (`mopar.runtime.wire`).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping

import numpy as np

from mopar.codec import PayloadError
from mopar.runtime import wire

__all__ = [
    "MAGIC",
    "encode_frame",
    "join_frame",
    "split_frame",
    "peek_frame",
    "decode_payloads",
    "NAME_RE",
]

MAGIC = b"MOPF"
VERSION = 1
_HEAD = struct.Struct("<4sBH")
_NAME = struct.Struct("<H")
_LEN = struct.Struct("<Q")
MAX_TENSORS = 4096
NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,256}$")
"""Tensor names a frame may carry (ONNX value names as mopar writes them)."""


def join_frame(payloads: Mapping[str, bytes | memoryview]) -> bytes:
    """A frame of already-encoded payloads, in the mapping's order."""
    if len(payloads) > MAX_TENSORS:
        raise PayloadError(f"a frame holds at most {MAX_TENSORS} tensors, got {len(payloads)}")
    parts: list[bytes | memoryview] = [_HEAD.pack(MAGIC, VERSION, len(payloads))]
    for name, payload in payloads.items():
        raw = name.encode()
        if not NAME_RE.match(name):
            raise PayloadError(
                f"tensor name {name!r} cannot be sent; names match {NAME_RE.pattern}"
            )
        # join takes views as they are: one copy of each payload, into the frame
        parts += [_NAME.pack(len(raw)), raw, _LEN.pack(memoryview(payload).nbytes), payload]
    return b"".join(parts)


def encode_frame(
    tensors: Mapping[str, np.ndarray], codecs: Mapping[str, str] | None = None
) -> bytes:
    """Encode each tensor with its codec (absent from ``codecs``: none) into one frame."""
    codecs = codecs or {}
    return join_frame({k: wire.encode(v, codecs.get(k, "none")) for k, v in tensors.items()})


def split_frame(data: bytes | memoryview) -> dict[str, memoryview]:
    """The payload of each tensor, by name, as views into ``data`` (nothing is copied or decoded).

    Raises:
        PayloadError: the framing is malformed: bad magic or version, truncated, a duplicate or
            ill-formed name, or trailing bytes.
    """
    view = memoryview(data).cast("B")
    out: dict[str, memoryview] = {}
    end = _HEAD.size
    for name, payload, after in _entries(view, cut=False):
        if name in out:
            raise PayloadError(f"tensor name {name!r} is ill-formed or repeated")
        out[name], end = payload, after
    if end != len(view):
        raise PayloadError(f"{len(view) - end} bytes after the last tensor of the frame")
    return out


def peek_frame(head: bytes | memoryview) -> Iterator[tuple[str, memoryview]]:
    """Each tensor's name and payload (the last one cut where ``head`` ends), as far as
    ``head``, the first bytes of a frame, goes: enough to read their headers.

    Raises:
        PayloadError: as `split_frame`, where ``head`` is not a frame's start.
    """
    for name, payload, _ in _entries(memoryview(head).cast("B"), cut=True):
        yield name, payload


def _entries(view: memoryview, *, cut: bool) -> Iterator[tuple[str, memoryview, int]]:
    """Each tensor's name, payload and where it ends; ``cut``: a payload longer than what is
    left is the last, cut there."""
    if len(view) < _HEAD.size:
        raise PayloadError(
            f"body is {len(view)} bytes, shorter than the {_HEAD.size}-byte frame "
            "header; send a frame made by mopar.runtime.frame.encode_frame"
        )
    magic, version, count = _HEAD.unpack(view[: _HEAD.size])
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a mopar frame")
    if version != VERSION:
        raise PayloadError(
            f"frame version {version} is not supported (expected {VERSION}); "
            "both ends of a handoff must run the same mopar"
        )
    if count > MAX_TENSORS:
        raise PayloadError(f"frame claims {count} tensors, more than {MAX_TENSORS}")
    pos = _HEAD.size
    for _ in range(count):
        (n,) = _take(view, pos, _NAME)
        pos += _NAME.size
        if pos + n > len(view):
            raise PayloadError("frame ends inside a tensor name")
        try:
            name = bytes(view[pos : pos + n]).decode()
        except UnicodeDecodeError:
            raise PayloadError("a tensor name is not UTF-8") from None
        pos += n
        if not NAME_RE.match(name):
            raise PayloadError(f"tensor name {name!r} is ill-formed or repeated")
        (length,) = _take(view, pos, _LEN)
        pos += _LEN.size
        if length > len(view) - pos:
            if cut:
                yield name, view[pos:], len(view)
                return
            raise PayloadError(
                f"tensor {name!r} claims {length} bytes, the frame has {len(view) - pos} left"
            )
        yield name, view[pos : pos + length], pos + length
        pos += length


def decode_payloads(payloads: Mapping[str, bytes | memoryview]) -> dict[str, np.ndarray]:
    """Decode every payload (`mopar.runtime.wire.decode` validates each header first)."""
    out = {}
    for name, payload in payloads.items():
        try:
            out[name] = wire.decode(payload)
        except PayloadError as exc:
            raise PayloadError(f"tensor {name!r}: {exc}") from None
    return out


def _take(view: memoryview, pos: int, st: struct.Struct) -> tuple:
    if pos + st.size > len(view):
        raise PayloadError("frame ends inside a tensor entry")
    return st.unpack(view[pos : pos + st.size])
