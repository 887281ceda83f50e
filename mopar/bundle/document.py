"""``plan.json``: the bundle's versioned manifest, as typed values.

Read in this order: `BundleDocument` (the whole file), its ``io`` section (`Io`: the model's
inputs and outputs, `IoTensor` and `IoOutput`, and what each function takes and gives,
`IoFunction`), the sections a finished compile adds (`Verification`, `LatencyCheck`, `Sizing`),
the model's layers and the stages' times (`LayerSummary`, `StageSeconds`), then `read_document`,
the one reader of the file.

The plan itself stays the JSON object `mopar.plan.Plan.to_dict` makes (``Plan.from_dict`` reads
it, with its own format version), and so does the ``experts`` section the planner describes:
this package sits below both. Parsing checks what a runner relies on (function names are folder
names the plan has, memory sizes are positive, codecs fit their tensors, tolerances are
numbers); every refusal is a `BundleError` naming the file and saying to recompile.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mopar.bundle.dispatch import DispatchSpec
from mopar.bundle.generation import GenerationSpec
from mopar.bundle.layout import FUNCTION_NAME_RE, PLAN_FILE, REFERENCE_FILE
from mopar.bundle.versions import BUNDLE_FORMAT_VERSION, check_version
from mopar.codec import CodecError, get_codec
from mopar.errors import BundleError, one_line

__all__ = [
    "IoTensor",
    "IoOutput",
    "IoFunction",
    "Io",
    "Verification",
    "LatencyComparison",
    "LatencyCheck",
    "Sizing",
    "LayerSummary",
    "StageSeconds",
    "BundleDocument",
    "read_document",
]


class _Flat:
    """A flat dataclass: its JSON object is its fields, in order."""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True)
class IoTensor(_Flat):
    """A tensor a function takes or gives (or a model input): name, shape, dtype and bytes at
    the example's sizes (the shape the plan was made for), and, where a dimension is dynamic,
    its smallest and largest shape; ``value_range``, for a model input that indexes an
    embedding's rows, the values it may hold (0 to its rows - 1).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    min_shape: tuple[int, ...] | None = None
    max_shape: tuple[int, ...] | None = None
    value_range: tuple[int, int] | None = None

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` is one this tensor may be."""
        low, high = self.min_shape or self.shape, self.max_shape or self.shape
        return len(shape) == len(high) and all(lo <= d <= hi for d, lo, hi in zip(shape, low, high))

    def describe(self) -> str:
        """``int64 [1, 128]``, or with its dynamic dimensions ``int64 [1, 1..512]``."""
        low, high = self.min_shape or self.shape, self.max_shape or self.shape
        dims = [str(hi) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(low, high)]
        return f"{self.dtype} [{', '.join(dims)}]"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_dict().items() if v is not None}  # bounds where dynamic

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> IoTensor:
        def bound(key: str) -> tuple[int, ...] | None:
            return tuple(int(d) for d in data[key]) if data.get(key) is not None else None

        return cls(
            name=data["name"],
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            nbytes=int(data["nbytes"]),
            min_shape=bound("min_shape"),
            max_shape=bound("max_shape"),
            value_range=_value_range(data),
        )


def _value_range(data: Mapping[str, Any]) -> tuple[int, int] | None:
    values = data.get("value_range")
    if values is None:
        return None
    low, high = (int(v) for v in values)
    if low > high:
        raise ValueError(f"tensor {data['name']!r} has value_range {values!r}, lowest first")
    return low, high


@dataclass(frozen=True, kw_only=True)
class IoOutput(_Flat):
    """A model output: its public ``name`` and the ``value`` (tensor) that holds it."""

    name: str
    value: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> IoOutput:
        return cls(
            name=data["name"],
            value=data["value"],
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
        )


@dataclass(frozen=True, kw_only=True)
class IoFunction:
    """What one function takes and gives, and where its files are.

    Attributes:
        onnx: its ONNX file, relative to the bundle (None before export).
        graph: its FX code (``--until rewrite`` only), relative to the bundle.
        weights: its weights file (ONNX external data), when it has one.
        dispatch: a dispatch function's layer: it calls the expert functions its ``callees``
            name, and its model is the rest of the layer, run on their summed answers.
        rows: an expert function: run only when its dispatch calls it, on the tokens routed to
            it (the first dimension of its inputs is at most their size).
        codecs: the codec name (`mopar.codec.get_codec`) each output is written with; an
            output not named is written raw (codec none).
    """

    name: str
    inputs: tuple[IoTensor, ...]
    outputs: tuple[IoTensor, ...]
    onnx: str | None = None
    graph: str | None = None
    weights: str | None = None
    dispatch: DispatchSpec | None = None
    rows: bool = False
    codecs: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        files = {k: v for k, v in (("graph", self.graph), ("onnx", self.onnx)) if v is not None}
        return {
            "name": self.name,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            **files,
            **({"weights": self.weights} if self.weights is not None else {}),
            **({"dispatch": self.dispatch.to_dict()} if self.dispatch is not None else {}),
            **({"rows": True} if self.rows else {}),
            "codecs": dict(self.codecs),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> IoFunction:
        outputs = tuple(IoTensor.from_dict(t) for t in data["outputs"])
        return cls(
            name=data["name"],
            inputs=tuple(IoTensor.from_dict(t) for t in data["inputs"]),
            outputs=outputs,
            onnx=data.get("onnx"),
            graph=data.get("graph"),
            weights=data.get("weights"),
            dispatch=DispatchSpec.from_dict(data["dispatch"]) if "dispatch" in data else None,
            rows=bool(data.get("rows")),
            codecs=_codecs(data["name"], data.get("codecs", {}), outputs),
        )


@dataclass(frozen=True, kw_only=True)
class Io:
    """The ``io`` section: the model's inputs and outputs, and each function's, in plan order."""

    inputs: tuple[IoTensor, ...]
    outputs: tuple[IoOutput, ...]
    functions: tuple[IoFunction, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "functions": [f.to_dict() for f in self.functions],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Io:
        return cls(
            inputs=tuple(IoTensor.from_dict(t) for t in data["inputs"]),
            outputs=tuple(IoOutput.from_dict(t) for t in data["outputs"]),
            functions=tuple(IoFunction.from_dict(f) for f in data["functions"]),
        )


@dataclass(frozen=True, kw_only=True)
class Verification(_Flat):
    """How the compiled functions matched the model, and the tolerances they were held to
    (which lossy codecs may have widened); ``reference`` names the inputs and outputs."""

    max_abs_err: float
    max_rel_err: float
    rtol: float
    atol: float
    reference: str = REFERENCE_FILE

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> Verification:
        if not isinstance(data, dict) or not all(
            type(data.get(k, 0.0)) in (int, float) for k in ("rtol", "atol")
        ):
            raise BundleError(
                f"{source!r} has verification {data!r}, expected an object "
                "with numbers rtol and atol; recompile"
            )
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True, kw_only=True)
class LatencyComparison(_Flat):
    """One plan served beside the unsplit model, requests interleaved (A B A B ...).

    Attributes:
        functions: the plan's functions.
        rounds: rounds served, one request of each per round.
        p50_ms: the plan's median latency, ms.
        unsplit_p50_ms: the unsplit model's, ms.
        slowdown: the median of the rounds' latency ratios (plan over unsplit).
        low: the lower end of its interval (``LatencyCheck.confidence``).
        high: the upper end.
        verdict: ``within`` (the interval at or below the bound), ``over`` (above it) or
            ``unclear`` (the bound inside it).
    """

    functions: int
    rounds: int
    p50_ms: float
    unsplit_p50_ms: float
    slowdown: float
    low: float
    high: float
    verdict: str


@dataclass(frozen=True, kw_only=True)
class LatencyCheck(_Flat):
    """The default objective's check: each plan served beside the unsplit model, and what
    compile decided from it.

    Attributes:
        p50_ms: the written plan's median latency, ms (None: it was not compared, being one
            function, the unsplit model itself).
        unsplit_p50_ms: the unsplit model's, served beside it, ms (None: likewise).
        slowdown: the written plan's slowdown, the median of the rounds' ratios (None:
            likewise).
        max_slowdown: the bound (``--max-slowdown``).
        confidence: the two-sided coverage of each comparison's interval.
        comparisons: every plan compared, in order (the last is the written plan's where it
            was compared).
        decision: why compile planned again or did not, and what it wrote.
    """

    p50_ms: float | None = None
    unsplit_p50_ms: float | None = None
    slowdown: float | None = None
    max_slowdown: float | None = None
    confidence: float | None = None
    comparisons: tuple[LatencyComparison, ...] = ()
    decision: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "comparisons": [c.to_dict() for c in self.comparisons]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyCheck:
        comparisons = tuple(LatencyComparison(**c) for c in data.get("comparisons", ()))
        return cls(**{**data, "comparisons": comparisons})


@dataclass(frozen=True, kw_only=True)
class Sizing(_Flat):
    """One function, planned against measured: the predicted need and the memory planned for
    it, its measured peak RSS and p50 time, the memory it got (raised to cover the peak), and
    the process the peak was measured in: ``server`` (the function server), ``lambda-handler``
    (the Lambda handler), ``container`` (its image, under a memory limit: the cgroup's peak) or
    ``worker`` (the shm runner's; bundles of earlier mopars say nothing: empty)."""

    function: str
    need_mb: float
    planned_mb: int
    peak_rss_mb: float
    memory_mb: int
    planned_time_ms: float
    p50_ms: float
    measured_in: str = ""


@dataclass(frozen=True, kw_only=True)
class LayerSummary(_Flat):
    """One layer of the model, as the plan was made from it."""

    name: str
    type: str
    param_bytes: int
    flops: int
    output_bytes: int


@dataclass(frozen=True, kw_only=True)
class StageSeconds(_Flat):
    """How long one compile stage took, s (`mopar.pipeline.STAGES` names them)."""

    stage: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class BundleDocument:
    """``plan.json``, whole.

    A compile stopped early (``until``) writes the plan, and from ``rewrite`` on the ``io``
    section; a finished one adds ``verification``, ``sizing`` and, as the objective and the
    model call for them, ``latency_check`` and ``experts``.

    Attributes:
        plan: the plan, as `mopar.plan.Plan.to_dict` makes it.
        io: what the model and each function take and give.
        until: the stage a compile stopped after (``mopar compile --until``), else None.
        experts: each MoE layer found, and the activation trace planned with.
        generation: how the main function generates (``--generate``), else None.
        layers: the model's layers.
        stages: each compile stage's seconds, up to the writing of this file.
        mopar_version, created, versions: which mopar wrote it, when (ISO 8601, UTC) and
            with which torch, onnx and onnxruntime.
    """

    plan: Mapping[str, Any]
    io: Io | None = None
    until: str | None = None
    verification: Verification | None = None
    latency_check: LatencyCheck | None = None
    experts: Mapping[str, Any] | None = None
    generation: GenerationSpec | None = None
    sizing: tuple[Sizing, ...] | None = None
    layers: tuple[LayerSummary, ...] = ()
    stages: tuple[StageSeconds, ...] = ()
    mopar_version: str = ""
    created: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)

    def memory_mb(self) -> dict[str, int]:
        """Each function's memory size in the plan, MB."""
        return {f["name"]: f["memory_mb"] for f in self.plan["functions"]}

    def to_dict(self) -> dict[str, Any]:
        optional = {
            "io": self.io.to_dict() if self.io else None,
            "verification": self.verification.to_dict() if self.verification else None,
            "latency_check": self.latency_check.to_dict() if self.latency_check else None,
            "experts": self.experts,
            "generation": self.generation.to_dict() if self.generation else None,
            "sizing": [s.to_dict() for s in self.sizing] if self.sizing is not None else None,
        }
        return {
            "bundle_format_version": BUNDLE_FORMAT_VERSION,
            "mopar_version": self.mopar_version,
            "created": self.created,
            "versions": dict(self.versions),
            **({"until": self.until} if self.until else {}),
            "plan": self.plan,
            **{k: v for k, v in optional.items() if v is not None},
            "layers": [la.to_dict() for la in self.layers],
            "stages": [st.to_dict() for st in self.stages],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write(self, root: Path) -> None:
        """Write this document as ``root/plan.json``."""
        (Path(root) / PLAN_FILE).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str, *, source: str = PLAN_FILE) -> BundleDocument:
        """Parse ``plan.json``'s text; ``source`` names the file in errors.

        Raises:
            BundleError: another format version, or a malformed or inconsistent document.
        """
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            check_version("bundle", data.get("bundle_format_version"), BUNDLE_FORMAT_VERSION)
            doc = cls._from_dict(data, source=source)
            if doc.io is not None:
                _check_functions(source, [f.name for f in doc.io.functions], doc.memory_mb())
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise BundleError(
                f"{source!r} is malformed ({type(exc).__name__}: {one_line(str(exc))}); recompile"
            ) from None
        return doc

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any], *, source: str) -> BundleDocument:
        until = data.get("until")

        def has(key: str) -> bool:
            return data.get(key) is not None

        return cls(
            plan=data["plan"],
            io=Io.from_dict(data["io"]) if "io" in data or not until else None,
            until=until,
            verification=(
                Verification.from_dict(data["verification"], source=source)
                if "verification" in data
                else None
            ),
            latency_check=(
                LatencyCheck.from_dict(data["latency_check"]) if has("latency_check") else None
            ),
            experts=data.get("experts"),
            generation=(
                GenerationSpec.from_dict(data["generation"], where=source)
                if has("generation")
                else None
            ),
            sizing=tuple(Sizing(**s) for s in data["sizing"]) if has("sizing") else None,
            layers=tuple(LayerSummary(**la) for la in data.get("layers", ())),
            stages=tuple(StageSeconds(**st) for st in data.get("stages", ())),
            mopar_version=str(data.get("mopar_version", "")),
            created=str(data.get("created", "")),
            versions=dict(data.get("versions", {})),
        )


def read_document(root: Path) -> BundleDocument:
    """Read ``root/plan.json``.

    Raises:
        BundleError: ``root`` is no folder or has no ``plan.json`` (the message says how to
            make a bundle), or the file is of another format version or malformed.
    """
    path = Path(root) / PLAN_FILE
    if not Path(root).is_dir():
        raise BundleError(f"bundle {str(root)!r} does not exist; create it with `mopar compile`")
    if not path.is_file():
        raise BundleError(
            f"{str(root)!r} has no {PLAN_FILE}, so it is not a mopar bundle; "
            "create it with `mopar compile MODEL --out DIR`"
        )
    return BundleDocument.from_json(path.read_text(), source=str(path))


def _check_functions(source: str, names: list, memory: dict) -> None:
    """Each function ``io`` lists is a folder name and has a positive ``memory_mb`` in the plan."""
    for name in names:
        if not isinstance(name, str) or not FUNCTION_NAME_RE.match(name):
            raise BundleError(
                f"{source!r} names function {name!r}, which is not a folder "
                f"name (expected {FUNCTION_NAME_RE.pattern}); recompile"
            )
        if name not in memory:
            raise BundleError(
                f"{source!r} lists function {name!r} in io.functions, but the "
                f"plan has only {sorted(memory)}; recompile"
            )
        mb = memory[name]
        if type(mb) not in (int, float) or not mb > 0:  # NaN too
            raise BundleError(
                f"{source!r} gives function {name} memory_mb {mb!r}, expected a "
                "positive number of MB; recompile"
            )


def _codecs(function: str, given: Any, outputs: tuple[IoTensor, ...]) -> dict[str, str]:
    """A function's ``codecs`` (absent: none), checked against its outputs and their dtypes."""
    if not isinstance(given, dict):
        raise BundleError(
            f"slice {function}: codecs must map tensor names to codec names, "
            f"got {given!r}; fix {PLAN_FILE} or recompile"
        )
    dtypes = {t.name: t.dtype for t in outputs}
    codecs = {}
    for tensor, name in given.items():
        if tensor not in dtypes:
            raise BundleError(
                f"slice {function}: codecs names {tensor!r}, which is not one of "
                f"its outputs {list(dtypes)}; fix {PLAN_FILE} or recompile"
            )
        try:
            codec = get_codec(name)
        except CodecError as exc:
            raise BundleError(
                f"slice {function}, tensor {tensor!r}: {exc}; fix {PLAN_FILE} or recompile"
            ) from None
        if not codec.supports(np.dtype(dtypes[tensor])):
            raise BundleError(
                f"slice {function}: codec {codec.name} cannot carry {tensor!r}, "
                f"a {dtypes[tensor]} tensor; use none or zstd for it in {PLAN_FILE}"
            )
        codecs[tensor] = codec.name
    return codecs
