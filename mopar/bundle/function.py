"""``function.json``: what one deployed function receives, sends and returns.

The compiler derives every function's spec from the plan graph (`mopar.emit.functions`) and
writes it into the function's folder (`FunctionSpec.write`); the function reads it back when it
starts (`FunctionSpec.load`) and checks each incoming frame against it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mopar.bundle.dispatch import DispatchSpec
from mopar.bundle.generation import GenerationSpec
from mopar.bundle.layout import FUNCTION_FILE, FUNCTION_NAME_RE
from mopar.bundle.versions import FUNCTION_FORMAT_VERSION, check_version
from mopar.codec import DTYPE_CODES, get_codec
from mopar.errors import BundleError, one_line

__all__ = ["TensorSpec", "FunctionSpec", "value_outside"]

_FRAME_OVERHEAD = 64  # frame header, plus per tensor: name, lengths and the payload header
_PER_TENSOR = 512


def value_outside(array: np.ndarray, value_range: tuple[int, int] | None) -> int | None:
    """A value of integer ``array`` outside ``value_range`` (lowest, highest), the lowest
    first; None where every value is inside, or no range is set."""
    if value_range is None or array.size == 0:
        return None
    low, high = value_range
    least, most = int(array.min()), int(array.max())
    return least if least < low else most if most > high else None


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A tensor a function receives: name, shape and dtype, and its codec upstream.

    ``shape`` is the largest it may be. Every dimension is exactly that, except where
    ``min_shape`` gives a smaller lower bound (a dynamic dimension), and except the first when
    ``rows`` is set: anything from 1 (the tokens an expert function is sent).

    ``value_range`` (lowest, highest), where set, bounds an integer tensor's values: a model
    input that indexes an embedding's rows, which torch refuses out of range and onnxruntime
    would not (it reads a negative index from the end).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    codec: str = "none"
    rows: bool = False
    min_shape: tuple[int, ...] | None = None
    value_range: tuple[int, int] | None = None

    def lows(self) -> tuple[int, ...]:
        """The smallest size of each dimension a request may have."""
        low = self.min_shape or self.shape
        return (1, *low[1:]) if self.rows and low else low

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            lo <= d <= hi for d, lo, hi in zip(shape, self.lows(), self.shape)
        )

    def describe(self) -> str:
        """``float32[1, 128, 256]``, with ranges where dimensions vary: ``[1..32, 64]``."""
        dims = [str(hi) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(self.lows(), self.shape)]
        return f"{self.dtype}[{', '.join(dims)}]"

    def outside(self, array: np.ndarray) -> int | None:
        """A value of ``array`` outside ``value_range`` (None: none is, or no range is set)."""
        return value_outside(array, self.value_range)

    def max_payload_bytes(self) -> int:
        codec = get_codec(self.codec)
        return codec.max_encoded_bytes(np.dtype(self.dtype), self.shape) + _PER_TENSOR

    def to_dict(self) -> dict:
        """Its fields, as JSON has them (sizes and bounds as lists); ``rows`` where set, the
        bounds where there are some."""
        kept = {k: v for k, v in asdict(self).items() if v is not None and v is not False}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in kept.items()}

    @classmethod
    def from_dict(cls, data: dict) -> TensorSpec:
        """Raises ValueError (or KeyError, TypeError) for a field a request could never match."""
        name, shape, dtype = data["name"], tuple(data["shape"]), data["dtype"]
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(
                f"tensor {name!r} has shape {data['shape']!r}, expected a list of sizes"
            )
        if dtype not in DTYPE_CODES:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype!r}, expected one of {list(DTYPE_CODES)}"
            )
        codec = data.get("codec", "none")
        if not get_codec(codec).supports(np.dtype(dtype)):  # an unknown codec: a CodecError
            raise ValueError(f"codec {codec} cannot carry tensor {name!r}, of {dtype}")
        values = data.get("value_range")
        if values is not None and not (
            isinstance(values, list)
            and len(values) == 2
            and all(type(v) is int for v in values)
            and values[0] <= values[1]
        ):
            raise ValueError(
                f"tensor {name!r} has value_range {values!r}, expected [lowest, highest]"
            )
        low = data.get("min_shape")
        if low is not None and (
            len(low) != len(shape)
            or not all(type(d) is int and 0 <= d <= hi for d, hi in zip(low, shape))
        ):
            raise ValueError(
                f"tensor {name!r} has min_shape {low!r}, expected sizes up to its shape {shape}"
            )
        return cls(
            name=name,
            shape=shape,
            dtype=dtype,
            codec=codec,
            rows=bool(data.get("rows")),
            min_shape=tuple(low) if low is not None else None,
            value_range=tuple(values) if values is not None else None,
        )


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
            ``redis``), or None for the last one (unless its answer goes through the store) and
            for called ones.
        answers: a called function: it answers its caller with its outputs and hands nothing on.
        calls: the functions it calls before it runs (their specs), whose outputs it gathers.
        dispatch: a dispatch function's layer (``calls`` are its expert functions; its model is
            the rest of the layer, run on their summed answers).
        generation: the main function of a ``--generate`` bundle: it runs the decoding loop
            and holds the key-value cache (`mopar.runtime.generate`).
        prewarms: the chain's entry: the functions it warms up at a cold start, so that their
            INITs overlap its own (`mopar.plan.Plan.warmed_with_entry`).
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
    generation: GenerationSpec | None = None
    prewarms: tuple[str, ...] = ()

    @property
    def callee_names(self) -> tuple[str, ...]:
        """The functions it calls, in order: a join's parts, a dispatch's experts, or a main
        function's (the expert functions its path's dispatches call)."""
        if self.calls:
            return tuple(c.slice for c in self.calls)
        return self.generation.callees if self.generation is not None else ()

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
            "receives": [t.to_dict() for t in self.receives],
            "outputs": list(self.outputs),
            "codecs": dict(self.codecs),
            "sends": list(self.sends),
            "returns": dict(self.returns),
            "transport": self.transport,
            "answers": self.answers,
            "calls": [c.to_dict() for c in self.calls],
            **({"dispatch": self.dispatch.to_dict()} if self.dispatch else {}),
            **({"generation": self.generation.to_dict()} if self.generation else {}),
            **({"prewarms": list(self.prewarms)} if self.prewarms else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> FunctionSpec:
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        check_version(FUNCTION_FILE, data.get("function_format_version"), FUNCTION_FORMAT_VERSION)
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
            generation=(
                GenerationSpec.from_dict(data["generation"], where=FUNCTION_FILE)
                if data.get("generation")
                else None
            ),
            prewarms=tuple(str(x) for x in data.get("prewarms", ())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> FunctionSpec:
        """Raises BundleError (another format version), or ValueError, KeyError or TypeError."""
        return cls.from_dict(json.loads(text))

    def write(self, function_dir: Path) -> None:
        """Write this spec as ``function_dir/function.json``."""
        (Path(function_dir) / FUNCTION_FILE).write_text(self.to_json())

    @classmethod
    def load(cls, function_dir: Path) -> FunctionSpec:
        """Read ``function_dir/function.json``; a missing or malformed one is a `BundleError`
        that says to recompile."""
        path = Path(function_dir) / FUNCTION_FILE
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            raise BundleError(
                f"{str(path)!r} is missing: the bundle predates served functions; "
                "recompile it with `mopar compile`"
            ) from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise BundleError(
                f"{str(path)!r} is malformed ({one_line(str(exc))}); recompile the bundle"
            ) from None
