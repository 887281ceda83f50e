"""Request and answer bodies a client may use besides mopar's frame. Never unpickles. torch-free.

Read in this order: `Format`, `request_format` and `answer_format` (which format a request's
``Content-Type`` and ``Accept`` name), `Limits` (the largest body of each format a function
takes: the one owner of those limits), `decode_request`, `encode_answer`, then `request_frame`
and `answer_body`, which the doors call: the function server (`mopar.runtime.server`), the
Lambda handler (`mopar.runtime.aws`) and ``mopar serve``.

================ ========================== ===================================================
format           Content-Type / Accept      body
================ ========================== ===================================================
frame            application/octet-stream   `mopar.runtime.frame`, as functions hand on to
                                            each other
JSON             application/json           ``{"inputs": {name: nested lists}}``; answers
                                            ``{"outputs": {name: nested lists}}`` (the default
                                            answer). The dtypes are the function's declared ones
.npy             application/x-npy          one array: a function with one input, an answer
                                            with one output
.npz             application/x-npz          arrays by name (``numpy.savez``, or
                                            ``savez_compressed``)
================ ========================== ===================================================

A ``text/plain`` body (``faas-cli invoke``'s default type) is read as JSON. A body sent as
``application/octet-stream`` (or with no type) is told by its first bytes:
``\\x93NUMPY`` is an .npy, ``PK\\x03\\x04`` an .npz, anything else is read as a frame (whose
reader checks its own magic, ``MOPF``). An answer is JSON unless ``Accept`` names another
format, as curl, Triton's and KServe's users expect; a chain's functions ask for frames by name
(``Accept: application/octet-stream``), and hand them on unchanged.

Every decoded tensor is checked against the tensors the function receives (names, shape, dtype)
and refused in one line naming it, what was expected and what came: a 400 (`RequestError`).
Arrays are read with ``allow_pickle=False`` only, and an .npz member's size is checked against
what the function could take before it is inflated.
"""

from __future__ import annotations

import enum
import json
import math
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import TYPE_CHECKING

import numpy as np

from mopar.codec import PayloadError
from mopar.runtime.core import RequestError
from mopar.runtime.frame import decode_payloads, encode_frame, peek_frame, split_frame
from mopar.runtime.httpd import too_large
from mopar.runtime.wire import describe as describe_payload

if TYPE_CHECKING:
    from mopar.bundle.function import TensorSpec

__all__ = [
    "Format",
    "Limits",
    "answer_body",
    "checked",
    "answer_format",
    "decode_answer",
    "decode_json",
    "decode_request",
    "encode_answer",
    "as_far_as_read",
    "head_tensors",
    "json_outputs",
    "refusal",
    "request_format",
    "request_frame",
    "to_frame",
    "write_npz",
]


class Format(enum.Enum):
    """A body format, by its media type."""

    FRAME = "application/octet-stream"
    JSON = "application/json"
    NPY = "application/x-npy"
    NPZ = "application/x-npz"

    @property
    def media_type(self) -> str:
        return self.value


_NAMED = {f.media_type: f for f in Format}
_TEXT = "text/plain"
"""Read as JSON: ``faas-cli invoke`` sends its body as text/plain unless told otherwise, and JSON
is the one format here that is text."""
_SNIFFED = ("", Format.FRAME.media_type)  # told by their first bytes
_ANY = ("*/*", "application/*")
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
_SERVED = (
    "application/json, application/x-npy, application/x-npz or a mopar frame as "
    "application/octet-stream"
)

JSON_BYTES_PER_ELEMENT = 32
"""Bytes a JSON body may spend per tensor element. A float32 written from numpy (``tolist``
gives the float64 repr, ``-0.10000000149011612``) takes up to 25 characters and its separator
2; the rest leaves room for brackets and light indentation."""
TENSOR_SLACK_BYTES = 16 << 10
"""Bytes per tensor beyond its data: an .npy header (numpy writes 128, reads up to 10,000) and
its zip entry's headers, or a JSON key."""
BODY_SLACK_BYTES = 64 << 10
"""Bytes per body beyond its tensors (a zip's central directory, JSON's outer object)."""


def _media(header: str | None) -> str:
    return (header or "").split(";")[0].strip().lower()


def request_format(content_type: str | None) -> Format | None:
    """The format a request's ``Content-Type`` names; None where the body's first bytes tell
    (``application/octet-stream``, or no type).

    Raises:
        RequestError: (415) a type not served.
    """
    kind = _media(content_type)
    if kind in _SNIFFED:
        return None
    if kind in _NAMED:
        return _NAMED[kind]
    if kind == _TEXT:
        return Format.JSON
    raise RequestError(
        f"content type {kind!r} is not served; send {_SERVED} (curl: -H 'Content-Type: "
        "application/json' with a JSON body)",
        415,
    )


def sniff(body: bytes | memoryview) -> Format:
    """The format of a body sent as ``application/octet-stream``, by its first bytes."""
    head = bytes(memoryview(body)[:8])
    if head.startswith(NPY_MAGIC):
        return Format.NPY
    if head.startswith(ZIP_MAGIC):
        return Format.NPZ
    return Format.FRAME  # the frame reader checks its magic and says what is wrong


def answer_format(accept: str | None) -> Format:
    """The format an ``Accept`` header asks for: the first one it names that is served; JSON
    when it names none, ``*/*`` or ``application/*`` (a client's default: curl sends ``*/*``).
    mopar's own hops ask for frames by name (`mopar.runtime.transports.http`).

    Raises:
        RequestError: (406) it names only types that are not served.
    """
    asked = []
    for item in (accept or "").split(","):
        kind, *params = (p.strip().lower() for p in item.split(";"))
        if not kind or any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00") for p in params):
            continue
        if kind in _NAMED:
            return _NAMED[kind]
        if kind in _ANY:
            return Format.JSON
        asked.append(kind)
    if asked:
        raise RequestError(f"Accept {accept!r} names no answer format served; ask {_SERVED}", 406)
    return Format.JSON


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The largest request body of each format a function takes, bytes (HTTP 413 above it),
    checked against ``Content-Length`` before a body is read.

    Attributes:
        frame: a frame (`mopar.bundle.function.FunctionSpec.max_body_bytes`).
        json: a JSON body: `JSON_BYTES_PER_ELEMENT` per element, plus slack.
        npy: an .npy body: the tensor's bytes and its header; None where the function receives
            more than one tensor.
        npz: an .npz body: every tensor's bytes and headers (a compressed member may be a little
            larger than its data: 0.1% allowed).
    """

    frame: int
    json: int
    npy: int | None
    npz: int

    @classmethod
    def of(cls, receives: Sequence[TensorSpec], *, frame_bytes: int) -> Limits:
        """The limits of a function receiving ``receives``, whose frames are at most
        ``frame_bytes``."""
        sizes = [(t.name, _elements(t), _nbytes(t)) for t in receives]
        npz = BODY_SLACK_BYTES + sum(
            n + n // 1000 + TENSOR_SLACK_BYTES + 2 * len(name) for name, _, n in sizes
        )
        return cls(
            frame=frame_bytes,
            json=BODY_SLACK_BYTES
            + sum(JSON_BYTES_PER_ELEMENT * max(k, 1) + TENSOR_SLACK_BYTES for _, k, _ in sizes),
            npy=sizes[0][2] + TENSOR_SLACK_BYTES if len(sizes) == 1 else None,
            npz=npz,
        )

    def of_format(self, fmt: Format | None) -> int:
        """The limit of a body of ``fmt`` (None: not known until read, the largest it may be)."""
        if fmt is None:
            return max(self.frame, self.npz, self.npy or 0)
        return {
            Format.FRAME: self.frame,
            Format.JSON: self.json,
            Format.NPY: self.npy or self.npz,  # refused once read, with the reason
            Format.NPZ: self.npz,
        }[fmt]

    def within(self, frame: bytes | memoryview) -> bytes | memoryview:
        """``frame``, once it is seen to be within the `frame` limit (a body may decode to more).

        Raises:
            RequestError: (413) it is larger.
        """
        if len(frame) > self.frame:
            raise RequestError(
                f"frame of {len(frame)} bytes exceeds the {self.frame} this slice can receive", 413
            )
        return frame

    @property
    def largest(self) -> int:
        """The largest body of any format (what a server must be ready to buffer)."""
        return max(self.frame, self.json, self.npz, self.npy or 0)


def _elements(t: TensorSpec) -> int:
    return math.prod(t.shape)


def _nbytes(t: TensorSpec) -> int:
    return _elements(t) * np.dtype(t.dtype).itemsize


# --- requests -------------------------------------------------------------------------------


def decode_request(
    body: bytes | memoryview, content_type: str | None, io: Sequence[TensorSpec]
) -> dict[str, np.ndarray]:
    """The tensors a request body of any format holds, checked against ``io`` (what the
    function receives), in ``io``'s order.

    Raises:
        RequestError: 415 for a type not served; 400 for a body that does not read as its
            format, or tensors that are not exactly ``io``'s names, shapes and dtypes.
    """
    fmt = request_format(content_type) or sniff(body)
    if fmt is Format.FRAME:
        try:
            arrays = decode_payloads(split_frame(body))
        except PayloadError as exc:
            raise RequestError(f"malformed frame: {exc}") from None
        return checked(arrays, io, "frame")
    if fmt is Format.JSON:
        try:
            doc = json.loads(bytes(body))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(
                f'the body is not JSON ({exc}); send {{"inputs": {{name: nested lists}}}}'
            ) from None
        return decode_json(doc, io)
    if fmt is Format.NPY:
        return checked(_read_npy(body, io), io, ".npy")
    return checked(_read_npz(body, io), io, ".npz")


def decode_json(doc: object, io: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """The tensors of a parsed JSON request, ``{"inputs": {name: nested lists}}``, each read
    as its declared dtype (integers and booleans only from whole numbers, within range).

    Raises:
        RequestError: (400) naming what is wrong.
    """
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(inputs, dict):
        got = f"keys {sorted(doc)}" if isinstance(doc, dict) else type(doc).__name__
        raise RequestError(
            f'a JSON request is {{"inputs": {{name: nested lists}}}}, got {got}; inputs '
            f"{[t.name for t in io]}"
        )
    _names(inputs, io, "JSON")
    return {t.name: _from_json(t, inputs[t.name]) for t in io}


def _from_json(t: TensorSpec, value: object) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nesting
        raise RequestError(
            f"input {t.name!r} is not a rectangular nested list; expected {t.describe()}"
        ) from None
    want = np.dtype(t.dtype)
    if array.dtype.kind not in "biuf":
        what = "text" if array.dtype.kind in "US" else "mixed, null or out of range"
        raise RequestError(
            f"input {t.name!r} holds {what} values, not numbers; expected {t.describe()}"
        )
    if want.kind in "biu" and array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
            raise RequestError(
                f"input {t.name!r} holds fractional numbers; expected {t.describe()}"
            )
    if want.kind in "iu" and array.size:
        info = np.iinfo(want)
        if array.min() < info.min or array.max() > info.max:
            raise RequestError(
                f"input {t.name!r} holds values outside {t.dtype}'s range [{info.min}, {info.max}]"
            )
    if want.kind == "b" and array.dtype.kind != "b" and not np.isin(array, (0, 1)).all():
        raise RequestError(f"input {t.name!r} holds values other than 0 and 1; expected bool")
    _check_shape(t, array, "JSON")
    return array.astype(want)


def _read_npy(body: bytes | memoryview, io: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    if len(io) != 1:
        raise RequestError(
            f"an .npy body holds one array, and this function receives {len(io)} tensors "
            f"{[t.name for t in io]}; send an .npz (numpy.savez) or JSON keyed by name"
        )
    try:
        array = np.load(_stream(body), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise RequestError(
            f"the .npy body is not readable ({exc}); write it with numpy.save"
        ) from None
    if not isinstance(array, np.ndarray):
        raise RequestError("the body is not an .npy array; write it with numpy.save")
    return {io[0].name: array}


def _read_npz(body: bytes | memoryview, io: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    by_name = {t.name: t for t in io}
    try:
        with zipfile.ZipFile(_stream(body)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise RequestError(
            f"the .npz body is not a readable zip ({exc}); write it with numpy.savez"
        ) from None
    names = {}
    for m in members:  # sizes checked before anything is inflated: no zip bomb
        name = m.filename.removesuffix(".npy")
        if not m.filename.endswith(".npy"):
            raise RequestError(
                f"the .npz body holds {m.filename!r}, not an .npy array; write it with "
                "numpy.savez(file, name=array, ...)"
            )
        names[name] = m
        want = by_name.get(name)
        if want is not None and m.file_size > _nbytes(want) + TENSOR_SLACK_BYTES:
            raise RequestError(
                f"input {name!r} in the .npz is {m.file_size} bytes, more than {want.describe()} "
                "takes"
            )
    _names(names, io, ".npz")
    try:
        with np.load(_stream(body), allow_pickle=False) as data:
            return {t.name: _array(data[t.name]) for t in io}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise RequestError(
            f"the .npz body is not readable ({exc}); write it with numpy.savez"
        ) from None


def _array(value: object) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ValueError("a member is not an array")
    return value


def _stream(body: bytes | memoryview) -> BytesIO:
    return BytesIO(body if isinstance(body, bytes) else bytes(body))


def _names(got: Mapping[str, object], io: Sequence[TensorSpec], what: str) -> None:
    names = [t.name for t in io]
    missing = [n for n in names if n not in got]
    extra = [n for n in got if n not in names]
    if missing or extra:
        raise RequestError(
            f"the {what} body lacks {missing} and has unexpected {extra}; this function "
            f"receives {names}"
        )


def checked(
    arrays: Mapping[str, np.ndarray], io: Sequence[TensorSpec], what: str
) -> dict[str, np.ndarray]:
    """``arrays`` in ``io``'s order, each of its name's shape and dtype (native byte order)."""
    _names(arrays, io, what)
    out = {}
    for t in io:
        array = arrays[t.name]
        wrong = _mismatch(t, array.dtype, tuple(array.shape), what)
        if wrong is not None:
            raise wrong
        out[t.name] = array.astype(array.dtype.newbyteorder("="), copy=False)
    return out


def _mismatch(
    t: TensorSpec, dtype: np.dtype | None, shape: tuple[int, ...], what: str
) -> RequestError | None:
    """The 400 of a tensor of ``dtype`` (None: not known) and ``shape`` sent for ``t``; None
    where ``t`` takes it."""
    if dtype is not None and dtype.newbyteorder("=") != np.dtype(t.dtype):
        return RequestError(
            f"input {t.name!r} is {dtype.name} {list(shape)} in the {what} body, expected "
            f"{t.dtype} {list(t.shape)}; convert it with array.astype('{t.dtype}')"
        )
    if t.fits(shape):
        return None
    return RequestError(
        f"input {t.name!r} is {list(shape)} in the {what} body, expected {t.describe()}"
        + _sizes_taken(t, shape)
    )


def _sizes_taken(t: TensorSpec, shape: tuple[int, ...]) -> str:
    """Where only sizes differ from ``t``'s: what the bundle was compiled for on the first axis
    that differs, and the compile that takes the size sent."""
    if len(shape) != len(t.shape):
        return ""
    axes = zip(shape, t.lows(), t.shape)
    a, (d, lo, hi) = next((a, x) for a, x in enumerate(axes) if not x[1] <= x[0] <= x[2])
    sizes = f"{hi}" if lo == hi else f"{lo}..{hi}"
    top = max(d, hi)
    return (
        f" (compiled for {sizes} on axis {a}; `mopar compile --dynamic {t.name}:{a}=1..{top}` "
        f"takes {d})"
    )


def _check_shape(t: TensorSpec, array: np.ndarray, what: str) -> None:
    wrong = _mismatch(t, None, tuple(array.shape), what)
    if wrong is not None:
        raise wrong


# --- bodies over their limit ----------------------------------------------------------------

Seen = tuple[str | None, np.dtype | None, tuple[int, ...]]
"""A tensor as a body's head shows it: its name (None: the body's one tensor), its dtype (None:
not shown) and its shape."""


def refusal(
    seen: Sequence[Seen], what: str, io: Sequence[TensorSpec], *, size: int, limit: int
) -> RequestError:
    """Why a body of ``size`` bytes over ``limit`` is refused: the 400 of the first tensor
    ``seen`` in its head (`head_tensors`) whose dtype, rank or sizes ``io`` does not take, else
    the 413 of its size."""
    by_name = {t.name: t for t in io}
    for name, dtype, shape in seen:
        t = by_name.get(name) if name is not None else (io[0] if len(io) == 1 else None)
        wrong = None if t is None else _mismatch(t, dtype, shape, what)
        if wrong is not None:
            return wrong
    return too_large(size, limit)


def head_tensors(head: bytes, content_type: str | None) -> tuple[list[Seen], str]:
    """The tensors the first bytes of a frame, .npy or .npz body show (as many as they hold
    headers of; none where they do not read as the body's format, or it is JSON, whose numbers
    come before their shape), and the format's name for messages."""
    try:
        fmt = request_format(content_type) or sniff(head)
    except RequestError:
        return [], ""
    read = {Format.FRAME: _frame_heads, Format.NPY: _npy_heads, Format.NPZ: _npz_heads}
    what = {Format.FRAME: "frame", Format.NPY: ".npy", Format.NPZ: ".npz"}.get(fmt, "JSON")
    return as_far_as_read(read[fmt](head) if fmt in read else iter(())), what


def as_far_as_read(heads: Iterator[Seen]) -> list[Seen]:
    """The tensors ``heads`` gives until a header is cut short or malformed."""
    seen: list[Seen] = []
    try:
        for tensor in heads:
            seen.append(tensor)
    except (PayloadError, ValueError, struct.error, zlib.error, UnicodeDecodeError):
        pass  # what was read so far stands; the rest is not known
    return seen


def _npy_heads(head: bytes, name: str | None = None) -> Iterator[Seen]:
    f = BytesIO(head)
    version = np.lib.format.read_magic(f)
    read = {
        (1, 0): np.lib.format.read_array_header_1_0,
        (2, 0): np.lib.format.read_array_header_2_0,
    }
    if version in read:
        shape, _, dtype = read[version](f)
        yield name, dtype, tuple(shape)


_LOCAL = struct.Struct("<4sHHHHHIIIHH")
"""A zip member's local header: signature, version, flags, method, time, date, crc, sizes,
name and extra lengths."""


def _npz_heads(head: bytes) -> Iterator[Seen]:
    pos = 0
    while head[pos : pos + 4] == ZIP_MAGIC and pos + _LOCAL.size <= len(head):
        _, _, flags, method, _, _, _, csize, _, n, extra = _LOCAL.unpack_from(head, pos)
        name = head[pos + _LOCAL.size : pos + _LOCAL.size + n].decode().removesuffix(".npy")
        start = pos + _LOCAL.size + n + extra
        data = head[start:]
        if method == zipfile.ZIP_DEFLATED:
            data = zlib.decompressobj(-15).decompress(data, 4096)
        elif method != zipfile.ZIP_STORED:
            return
        yield from _npy_heads(data, name)
        if flags & 0x08 or csize == 0xFFFFFFFF:
            return  # its size follows its data (numpy streams members): the next is not found
        pos = start + csize


def _frame_heads(head: bytes) -> Iterator[Seen]:
    for name, payload in peek_frame(head):
        dtype, shape, _ = describe_payload(payload)
        yield name, dtype, shape


def request_frame(
    body: bytes | memoryview, content_type: str | None, receives: Sequence[TensorSpec]
) -> bytes | memoryview:
    """The frame a request body stands for: a frame as it came (the function checks it), any
    other format decoded, checked and encoded with each tensor's codec from ``receives``.

    Raises:
        RequestError: as `decode_request`.
    """
    if (request_format(content_type) or sniff(body)) is Format.FRAME:
        return body
    return to_frame(decode_request(body, content_type, receives), receives)


def to_frame(arrays: Mapping[str, np.ndarray], receives: Sequence[TensorSpec]) -> bytes:
    """A frame of decoded tensors, each encoded with its codec from ``receives``."""
    return encode_frame(arrays, {t.name: t.codec for t in receives})


# --- answers --------------------------------------------------------------------------------


def encode_answer(
    outputs: Mapping[str, np.ndarray], accept: str | Format | None
) -> tuple[bytes, str]:
    """``outputs`` as the body ``accept`` (an ``Accept`` header, or a `Format`) asks for, and
    its content type.

    Raises:
        RequestError: 406 for an ``Accept`` of nothing served, or .npy for more than one output.
    """
    fmt = accept if isinstance(accept, Format) else answer_format(accept)
    if fmt is Format.FRAME:
        return encode_frame(outputs), fmt.media_type
    if fmt is Format.JSON:
        return json.dumps(json_outputs(outputs)).encode(), fmt.media_type
    if fmt is Format.NPY:
        if len(outputs) != 1:
            raise RequestError(
                f"an .npy answer holds one array, and there are {len(outputs)} outputs "
                f"{list(outputs)}; ask application/x-npz or application/json",
                406,
            )
        buf = BytesIO()
        np.save(buf, np.asarray(next(iter(outputs.values()))), allow_pickle=False)
        return buf.getvalue(), fmt.media_type
    return write_npz(outputs), fmt.media_type


def write_npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz of ``arrays``, as ``numpy.savez`` writes it (without its keyword arguments: an
    output may be named ``file``)."""
    buf = BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def decode_answer(body: bytes | memoryview, content_type: str | None) -> dict[str, np.ndarray]:
    """The outputs of an answer (a client's side): a frame, an .npz or JSON (whose numbers
    come back as float64, int64 or bool).

    Raises:
        ValueError: the body does not read as its content type, or is an .npy (unnamed).
    """
    fmt = _NAMED.get(_media(content_type)) or sniff(body)
    if fmt is Format.FRAME:
        return decode_payloads(split_frame(body))
    if fmt is Format.JSON:
        doc = json.loads(bytes(body))
        if not isinstance(doc, dict) or not isinstance(doc.get("outputs"), dict):
            raise ValueError('a JSON answer is {"outputs": {name: nested lists}}')
        return {k: np.asarray(v) for k, v in doc["outputs"].items()}
    if fmt is Format.NPY:
        raise ValueError("an .npy answer holds one unnamed array; ask application/x-npz")
    try:
        with np.load(_stream(body), allow_pickle=False) as data:
            return {k: _array(data[k]) for k in data.files}
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(str(exc)) from None


def json_outputs(outputs: Mapping[str, np.ndarray]) -> dict:
    """A JSON answer's document: ``{"outputs": {name: nested lists}}``."""
    return {"outputs": {k: np.asarray(v).tolist() for k, v in outputs.items()}}


def answer_body(frame: bytes | memoryview, accept: str | Format | None) -> tuple[bytes, str]:
    """A function's answer frame as the body ``accept`` asks for (a frame: as it is)."""
    fmt = accept if isinstance(accept, Format) else answer_format(accept)
    if fmt is Format.FRAME:
        return bytes(frame) if not isinstance(frame, bytes) else frame, fmt.media_type
    return encode_answer(decode_payloads(split_frame(frame)), fmt)
