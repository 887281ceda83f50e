"""What a deployed function is: its ``function.json``. torch-free.

`FunctionSpec` is the ``function.json`` every function folder carries; the compiler derives them
from the plan graph (`mopar.emit.functions`), and `mopar.runtime.framed.SliceFunction` serves a
function by it (through `mopar.runtime.core.FunctionCore`).

A request travels the functions on the plan's path: the first receives the model inputs; each
one runs its slice and sends on a frame (`mopar.runtime.frame`) of the tensors that later
functions still read: its own outputs and, for skip connections, tensors it only carries. The
last one answers with the model outputs under their public names. Carried tensors are forwarded
byte for byte. A function may call others before it runs (the sub-slices of a sharded slice):
it sends each the tensors it reads and gathers their answers; those answer and go no further.
A dispatch function (a mixture-of-experts layer, `mopar.runtime.dispatch`) calls only the expert
functions its tokens were routed to, each with those tokens, adds their answers, and runs its
model (the rest of its layer) on that sum.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mopar.codec import get_codec
from mopar.errors import BundleError
from mopar.runtime import wire
from mopar.runtime.dispatch import DispatchSpec

__all__ = [
    "FUNCTION_FORMAT_VERSION",
    "FUNCTION_NAME_RE",
    "TensorSpec",
    "FunctionSpec",
]

FUNCTION_FORMAT_VERSION = 2
FUNCTION_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""A function's name (``s0``, ``s1.e0-e3``, ``s2-shard1``): also its folder's in a bundle
(``functions/<name>``), so never a path."""
_FRAME_OVERHEAD = 64  # frame header, plus per tensor: name, lengths and the payload header
_PER_TENSOR = 512


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A tensor a function receives: name, shape and dtype, and its codec upstream.

    ``rows``: the first dimension may be anything from 1 to ``shape[0]`` (the tokens an expert
    function is sent); otherwise the shape is exact.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    codec: str = "none"
    rows: bool = False

    def fits(self, shape: tuple[int, ...]) -> bool:
        if not self.rows:
            return shape == self.shape
        return (
            len(shape) == len(self.shape)
            and shape[1:] == self.shape[1:]
            and 1 <= shape[0] <= self.shape[0]
        )

    def max_payload_bytes(self) -> int:
        codec = get_codec(self.codec)
        return codec.max_encoded_bytes(np.dtype(self.dtype), self.shape) + _PER_TENSOR

    @classmethod
    def from_dict(cls, data: dict) -> TensorSpec:
        """Raises ValueError (or KeyError, TypeError) for a field a request could never match."""
        name, shape, dtype = data["name"], tuple(data["shape"]), data["dtype"]
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(
                f"tensor {name!r} has shape {data['shape']!r}, expected a list of sizes"
            )
        if dtype not in wire.DTYPE_CODES:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype!r}, expected one of {list(wire.DTYPE_CODES)}"
            )
        codec = data.get("codec", "none")
        if not get_codec(codec).supports(np.dtype(dtype)):  # an unknown codec: a CodecError
            raise ValueError(f"codec {codec} cannot carry tensor {name!r}, of {dtype}")
        return cls(name=name, shape=shape, dtype=dtype, codec=codec, rows=bool(data.get("rows")))


@dataclass(frozen=True, kw_only=True)
class FunctionSpec:
    """``function.json``: everything a function knows about its place in the plan.

    Attributes:
        model: the model's name.
        slice: this function's name; ``index`` of ``count`` on the request path (a called
            function: its caller's).
        receives: the tensors of an incoming frame, exactly (the slice's inputs and the
            tensors it carries for later slices).
        outputs: the slice's own outputs (ONNX output names).
        codecs: the codec each output is sent with (absent: none).
        sends: the tensors of the outgoing frame, in order.
        returns: for the last slice, public model output name by value name; else empty.
        transport: the handoff to the next function the plan chose (``shm``, ``http``,
            ``redis``), or None for the last one and for called ones.
        answers: a called function: it answers its caller with its outputs and hands nothing on.
        calls: the functions it calls before it runs (their specs), whose outputs it gathers.
        dispatch: a dispatch function's layer (``calls`` are its expert functions; its model is
            the rest of the layer, run on their summed answers).
    """

    model: str
    slice: str
    index: int
    count: int
    receives: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    codecs: Mapping[str, str] = field(default_factory=dict)
    sends: tuple[str, ...]
    returns: Mapping[str, str] = field(default_factory=dict)
    transport: str | None = None
    answers: bool = False
    calls: tuple[FunctionSpec, ...] = ()
    dispatch: DispatchSpec | None = None

    @property
    def last(self) -> bool:
        return self.index == self.count - 1 and not self.answers

    def max_body_bytes(self) -> int:
        """The largest incoming frame a valid request can produce."""
        return _FRAME_OVERHEAD + sum(t.max_payload_bytes() for t in self.receives)

    def to_dict(self) -> dict:
        return {
            "function_format_version": FUNCTION_FORMAT_VERSION,
            "model": self.model,
            "slice": self.slice,
            "index": self.index,
            "count": self.count,
            "receives": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "codec": t.codec,
                    **({"rows": True} if t.rows else {}),
                }
                for t in self.receives
            ],
            "outputs": list(self.outputs),
            "codecs": dict(self.codecs),
            "sends": list(self.sends),
            "returns": dict(self.returns),
            "transport": self.transport,
            "answers": self.answers,
            "calls": [c.to_dict() for c in self.calls],
            **({"dispatch": self.dispatch.to_dict()} if self.dispatch else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> FunctionSpec:
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("function_format_version")
        if version != FUNCTION_FORMAT_VERSION:
            raise BundleError(
                f"function.json format {version} is not supported (expected "
                f"{FUNCTION_FORMAT_VERSION}); recompile the bundle with this mopar"
            )
        if not isinstance(data["slice"], str) or not FUNCTION_NAME_RE.match(data["slice"]):
            raise ValueError(
                f"slice {data['slice']!r} is not a function name (expected "
                f"{FUNCTION_NAME_RE.pattern})"
            )
        return cls(
            model=data["model"],
            slice=data["slice"],
            index=int(data["index"]),
            count=int(data["count"]),
            receives=tuple(TensorSpec.from_dict(t) for t in data["receives"]),
            outputs=tuple(data["outputs"]),
            codecs=dict(data.get("codecs", {})),
            sends=tuple(data["sends"]),
            returns=dict(data.get("returns", {})),
            transport=data.get("transport"),
            answers=bool(data.get("answers", False)),
            calls=tuple(cls.from_dict(x) for x in data.get("calls", ())),
            dispatch=DispatchSpec.from_dict(data["dispatch"]) if data.get("dispatch") else None,
        )

    @classmethod
    def load(cls, function_dir: Path) -> FunctionSpec:
        path = Path(function_dir) / "function.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise BundleError(
                f"{str(path)!r} is missing: the bundle predates served functions; "
                "recompile it with `mopar compile`"
            ) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"{str(path)!r} is malformed ({exc}); recompile the bundle") from None
