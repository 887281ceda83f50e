"""One deployed function: a slice, what it receives, what it hands on. torch-free.

Read in this order: `FunctionSpec` (the ``function.json`` every function folder carries),
`function_specs` (how the compiler derives them from ``plan.json``), then `SliceFunction` (what
a server or a Lambda handler calls per request).

The functions of a bundle form a chain: the first receives the model inputs; each one runs its
slice and sends on a frame (`mopar.runtime.frame`) of the tensors that later slices still read:
its own outputs and, for skip connections, tensors it only carries. The last one answers with
the model outputs under their public names. Carried tensors are forwarded byte for byte.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mopar.codec import PayloadError, get_codec
from mopar.errors import BundleError
from mopar.runtime import wire
from mopar.runtime.frame import decode_payloads, join_frame, split_frame

__all__ = ["FUNCTION_FORMAT_VERSION", "TensorSpec", "FunctionSpec", "function_specs",
           "write_function_specs", "SliceFunction", "RequestError"]

FUNCTION_FORMAT_VERSION = 1
_FRAME_OVERHEAD = 64  # frame header, plus per tensor: name, lengths and the payload header
_PER_TENSOR = 512


class RequestError(ValueError):
    """A request this function cannot serve, by the caller's fault (an HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A tensor a function receives: name, exact shape and dtype, and its codec upstream."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    codec: str = "none"

    def max_payload_bytes(self) -> int:
        codec = get_codec(self.codec)
        return codec.max_encoded_bytes(np.dtype(self.dtype), self.shape) + _PER_TENSOR


@dataclass(frozen=True, kw_only=True)
class FunctionSpec:
    """``function.json``: everything a function knows about its place in the chain.

    Attributes:
        model: the model's name.
        slice: this slice's name; ``index`` of ``count`` in the chain.
        receives: the tensors of an incoming frame, exactly (the slice's inputs and the
            tensors it carries for later slices).
        outputs: the slice's own outputs (ONNX output names).
        codecs: the codec each output is sent with (absent: none).
        sends: the tensors of the outgoing frame, in order.
        returns: for the last slice, public model output name by value name; else empty.
        transport: the handoff to the next function the plan chose (``shm``, ``http``,
            ``redis``), or None for the last slice.
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

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def max_body_bytes(self) -> int:
        """The largest incoming frame a valid request can produce."""
        return _FRAME_OVERHEAD + sum(t.max_payload_bytes() for t in self.receives)

    def to_dict(self) -> dict:
        return {
            "function_format_version": FUNCTION_FORMAT_VERSION,
            "model": self.model, "slice": self.slice, "index": self.index, "count": self.count,
            "receives": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                          "codec": t.codec} for t in self.receives],
            "outputs": list(self.outputs), "codecs": dict(self.codecs),
            "sends": list(self.sends), "returns": dict(self.returns),
            "transport": self.transport,
        }

    @classmethod
    def from_dict(cls, data: dict) -> FunctionSpec:
        version = data.get("function_format_version")
        if version != FUNCTION_FORMAT_VERSION:
            raise BundleError(f"function.json format {version} is not supported (expected "
                              f"{FUNCTION_FORMAT_VERSION}); recompile the bundle with this mopar")
        return cls(
            model=data["model"], slice=data["slice"], index=int(data["index"]),
            count=int(data["count"]),
            receives=tuple(TensorSpec(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                                      codec=t.get("codec", "none")) for t in data["receives"]),
            outputs=tuple(data["outputs"]), codecs=dict(data.get("codecs", {})),
            sends=tuple(data["sends"]), returns=dict(data.get("returns", {})),
            transport=data.get("transport"),
        )

    @classmethod
    def load(cls, function_dir: Path) -> FunctionSpec:
        path = Path(function_dir) / "function.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise BundleError(f"{str(path)!r} is missing: the bundle predates served functions; "
                              "recompile it with `mopar compile`") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"{str(path)!r} is malformed ({exc}); recompile the bundle") from None


def function_specs(doc: dict) -> list[FunctionSpec]:
    """The `FunctionSpec` of every slice, from a parsed ``plan.json``."""
    io = doc["io"]
    slices = io["slices"]
    plan_slices = {s["name"]: s for s in doc["plan"]["slices"]}
    info: dict[str, dict] = {t["name"]: t for t in io["inputs"]}
    codec_of: dict[str, str] = {}
    for s in slices:
        info.update((t["name"], t) for t in s["outputs"])
        codec_of.update(s.get("codecs", {}))
    returns = {t["value"]: t["name"] for t in io["outputs"]}
    # needed_after[k]: values read by a slice after k, or returned by the model
    needed_after: list[set[str]] = []
    later: set[str] = set(returns)
    for s in reversed(slices):
        needed_after.append(set(later))
        later |= {t["name"] for t in s["inputs"]}
    needed_after.reverse()
    available = [t["name"] for t in io["inputs"]]
    specs = []
    for k, s in enumerate(slices):
        own_in = {t["name"] for t in s["inputs"]}
        receives = [v for v in available if v in own_in or v in needed_after[k]]
        outputs = [t["name"] for t in s["outputs"]]
        sends = [v for v in [*receives, *outputs] if v in needed_after[k]]
        last = k == len(slices) - 1
        specs.append(FunctionSpec(
            model=doc["plan"]["model"], slice=s["name"], index=k, count=len(slices),
            receives=tuple(TensorSpec(name=v, shape=tuple(info[v]["shape"]),
                                      dtype=info[v]["dtype"], codec=codec_of.get(v, "none"))
                           for v in receives),
            outputs=tuple(outputs), codecs=dict(s.get("codecs", {})), sends=tuple(sends),
            returns=returns if last else {},
            transport=None if last else (plan_slices[s["name"]].get("transport") or "shm"),
        ))
        available = [*available, *outputs]
    return specs


def write_function_specs(bundle: Path) -> None:
    """Write ``functions/<slice>/function.json`` for every slice of the bundle at ``bundle``."""
    doc = json.loads((Path(bundle) / "plan.json").read_text())
    for spec in function_specs(doc):
        path = Path(bundle) / "functions" / spec.slice / "function.json"
        path.write_text(json.dumps(spec.to_dict(), indent=2) + "\n")


class SliceFunction:
    """A slice ready to serve: its spec and its onnxruntime session.

    `process` is the whole per-request work of a function minus the handoff: validate the
    incoming frame against the spec, run the slice, and build the outgoing frame.
    """

    def __init__(self, function_dir: Path, *, intra_op_threads: int = 0) -> None:
        from mopar.runtime.handler import SliceHandler

        self.dir = Path(function_dir)
        self.spec = FunctionSpec.load(self.dir)
        self.handler = SliceHandler(self.dir, intra_op_threads=intra_op_threads)
        self._receives = {t.name: t for t in self.spec.receives}

    def check(self, data: bytes | memoryview) -> dict[str, memoryview]:
        """Split a frame and check it holds exactly the expected tensors, shapes and dtypes.

        Raises:
            RequestError: (400) naming the first problem, before anything is decoded.
        """
        try:
            payloads = split_frame(data)
        except PayloadError as exc:
            raise RequestError(f"malformed frame: {exc}") from None
        missing = [n for n in self._receives if n not in payloads]
        extra = [n for n in payloads if n not in self._receives]
        if missing or extra:
            raise RequestError(f"slice {self.spec.slice} expects tensors {list(self._receives)}; "
                               f"missing {missing}, unexpected {extra}")
        for name, payload in payloads.items():
            want = self._receives[name]
            try:
                dtype, shape, _ = wire.describe(payload)
            except PayloadError as exc:
                raise RequestError(f"tensor {name!r}: {exc}") from None
            if dtype.name != want.dtype or shape != want.shape:
                raise RequestError(f"tensor {name!r} is {dtype.name}{list(shape)}, expected "
                                   f"{want.dtype}{list(want.shape)}")
        return payloads

    def process(self, data: bytes | memoryview) -> tuple[bytes, float]:
        """Run the slice on one incoming frame; return the outgoing frame and the compute ms."""
        payloads = self.check(data)
        start = time.perf_counter()
        own = set(self.handler.inputs)
        try:
            inputs = decode_payloads({k: v for k, v in payloads.items() if k in own})
        except PayloadError as exc:
            raise RequestError(str(exc)) from None
        results = self.handler.handle(inputs)
        out: dict[str, bytes | memoryview] = {}
        for name in self.spec.sends:
            if name in results:
                out[name] = wire.encode(results[name], self.spec.codecs.get(name, "none"))
            else:
                out[name] = payloads[name]
        if self.spec.last:
            out = {self.spec.returns.get(k, k): v for k, v in out.items()}
        frame = join_frame(out)
        return frame, (time.perf_counter() - start) * 1e3
