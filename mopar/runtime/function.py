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
from collections.abc import Callable, Mapping
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


Fork = Callable[[list[str], list[bytes]], list[bytes]]
"""(sub-slice names, their incoming frames) -> their answers, in order."""


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
        role: ``shard`` for a sub-slice (it answers its caller, the join, with its parts),
            else "".
        shards: a join's sub-slices (their specs), whose parts it gathers before it runs.
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
    role: str = ""
    shards: tuple[FunctionSpec, ...] = ()

    @property
    def last(self) -> bool:
        return self.index == self.count - 1 and self.role != "shard"

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
            "transport": self.transport, "role": self.role,
            "shards": [sh.to_dict() for sh in self.shards],
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
            transport=data.get("transport"), role=data.get("role", ""),
            shards=tuple(cls.from_dict(x) for x in data.get("shards", ())),
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
    """The `FunctionSpec` of every function, in ``io.slices`` order, from a parsed ``plan.json``.

    The chain runs over stages: an ordinary slice, or a sharded slice's join, which receives
    what its sub-slices and its tail read, forks the sub-slices (each answers with its parts)
    and joins.
    """
    io = doc["io"]
    roles = {s["name"]: s.get("role", "") for s in doc["plan"]["slices"]}
    transports = {s["name"]: s.get("transport") for s in doc["plan"]["slices"]}
    info: dict[str, dict] = {t["name"]: t for t in io["inputs"]}
    codec_of: dict[str, str] = {}
    stages: list[tuple[dict, list[dict]]] = []
    pending: list[dict] = []
    for s in io["slices"]:
        info.update((t["name"], t) for t in s["outputs"])
        codec_of.update(s.get("codecs", {}))
        if roles.get(s["name"]) == "shard":
            pending.append(s)
        else:
            stages.append((s, pending))
            pending = []
    returns = {t["value"]: t["name"] for t in io["outputs"]}
    names = lambda ts: [t["name"] for t in ts]  # noqa: E731

    def reads(entry: dict, shards: list[dict]) -> set[str]:
        parts = {v for sh in shards for v in names(sh["outputs"])}
        return (set(names(entry["inputs"])) - parts) | {v for sh in shards
                                                        for v in names(sh["inputs"])}

    needed_after: list[set[str]] = []  # [k]: read after stage k, or returned by the model
    later: set[str] = set(returns)
    for entry, shards in reversed(stages):
        needed_after.append(set(later))
        later |= reads(entry, shards)
    needed_after.reverse()

    def spec(s: dict, k: int, receives: list[str], sends: list[str], **more) -> FunctionSpec:
        return FunctionSpec(
            model=doc["plan"]["model"], slice=s["name"], index=k, count=len(stages),
            receives=tuple(TensorSpec(name=v, shape=tuple(info[v]["shape"]),
                                      dtype=info[v]["dtype"], codec=codec_of.get(v, "none"))
                           for v in receives),
            outputs=tuple(names(s["outputs"])), codecs=dict(s.get("codecs", {})),
            sends=tuple(sends), **more)

    specs: dict[str, FunctionSpec] = {}
    available = names(io["inputs"])
    for k, (entry, shards) in enumerate(stages):
        last = k == len(stages) - 1
        need = reads(entry, shards)
        receives = [v for v in available if v in need or v in needed_after[k]]
        outputs = names(entry["outputs"])
        for sh in shards:
            own = set(names(sh["inputs"]))
            specs[sh["name"]] = spec(sh, k, [v for v in available if v in own],
                                     names(sh["outputs"]), role="shard")
        specs[entry["name"]] = spec(
            entry, k, receives, [v for v in [*receives, *outputs] if v in needed_after[k]],
            returns=returns if last else {},
            transport=None if last else (transports.get(entry["name"]) or "shm"),
            shards=tuple(specs[sh["name"]] for sh in shards))
        available = [*available, *outputs]
    return [specs[s["name"]] for s in io["slices"]]


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

    def process(self, data: bytes | memoryview, fork: Fork | None = None) -> tuple[bytes, float]:
        """Run the slice on one incoming frame; return the outgoing frame and the compute ms.

        Args:
            fork: a join's way to run its sub-slices: called with each sub-slice's name and
                incoming frame, it returns their answers (frames of parts) in the same order.
        """
        payloads = self.check(data)
        if self.spec.shards:
            if fork is None:
                raise RuntimeError(f"slice {self.spec.slice} joins "
                                   f"{[x.slice for x in self.spec.shards]} but was given no way "
                                   "to reach them; set MOPAR_SHARDS")
            payloads.update(self._gather(payloads, fork))
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

    def _gather(self, payloads: dict[str, memoryview], fork: Fork) -> dict[str, memoryview]:
        """Scatter the inputs to the sub-slices and gather their parts: the framing and the
        names are checked here, each part's header when it is decoded, its shape by the slice."""
        frames = [join_frame({t.name: payloads[t.name] for t in spec.receives})
                  for spec in self.spec.shards]
        parts: dict[str, memoryview] = {}
        for spec, answer in zip(self.spec.shards, fork([s.slice for s in self.spec.shards],
                                                       frames)):
            try:
                got = split_frame(answer)
            except PayloadError as exc:
                raise RuntimeError(f"sub-slice {spec.slice} answered a malformed frame: {exc}"
                                   ) from None
            if set(got) != set(spec.sends):
                raise RuntimeError(f"sub-slice {spec.slice} answered {sorted(got)}, expected "
                                   f"{list(spec.sends)}")
            parts.update(got)
        return parts
