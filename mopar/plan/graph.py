"""Plan: the frozen, JSON-serialisable decision of how a model is deployed, as a graph.

Nodes are functions (`Function`): each has a kind (`mopar.plan.kinds`), the layers it runs, its
artifact, its memory, CPU and predicted time. Edges (`Edge`) are the tensors one function hands
another: their names, bytes, transport and codecs, and whether the edge is always taken or taken
with a probability. Model inputs come from `REQUEST`; model outputs go to `RESPONSE`.

A chain of slices is the simplest such graph; a parameter-sharded slice adds called sub-slices
that fan out from the tensors the slice reads and fan in to its join. Every consumer walks the
graph with the methods here (`path`, `callees`, `invocation_probability`, ...) and asks a
function's `Kind` what it is; none tests a kind by name.

Functions are listed in a topological order of the data edges. The planner decides a plan; the
rewrite, the exporter and the emitters apply it, and never decide.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mopar.config import DEFAULT_TARGET
from mopar.errors import BundleError, one_line
from mopar.plan.kinds import Kind, kind_of
from mopar.plan.notes import Note, Remark

__all__ = [
    "PLAN_FORMAT_VERSION",
    "STRATEGIES",
    "REQUEST",
    "RESPONSE",
    "PROBABILITY_SOURCES",
    "Function",
    "Edge",
    "Plan",
    "data_edges",
]

PLAN_FORMAT_VERSION = 3
STRATEGIES = ("mopar", "mopar-paper", "unsplit", "uniform", "params", "latency")
"""Every partition strategy; `mopar.planner.strategies` says what each does."""

REQUEST = "<request>"
"""The source of the edges that carry the model's inputs."""
RESPONSE = "<response>"
"""The sink of the edges that carry the model's outputs."""

PROBABILITY_SOURCES = ("always", "measured", "assumed")
"""How an edge's probability is known: it is always taken (1), or taken with a probability that
was measured on calibration data, or assumed (uniform routing, say)."""


@dataclass(frozen=True, kw_only=True)
class Function:
    """One function of a plan.

    Attributes:
        name: the function's name (``s0``, ``s1.p0``, ...), also its folder in the bundle.
        kind: a key of `mopar.plan.kinds.KINDS`.
        group: the slice of the vertical cut it carries out (its own name for an unsharded slice).
        layers: layer names it runs, in topological order (empty: it holds none of its own).
        artifact: its model file, relative to the bundle.
        memory_mb: memory size of the function, MB.
        need_mb: predicted memory it needs, MB (``memory_mb`` is this rounded up to the
            platform's sizes, or raised for CPU).
        vcpus: the CPU it gets at ``memory_mb``.
        time_ms: predicted billed time per invocation at ``memory_mb``, ms: compute at its CPU
            share, reading what it receives, and waiting for the functions it calls.
        param_bytes: bytes of parameters and buffers it holds.
        flops: forward FLOPs of its layers.
        cost_per_1m_usd: predicted cost of a million invocations.
        parallel: η of its group (1: not sharded); a sharded slice's fork-join stages are
            its shard and join functions, in order (`mopar.planner.horizontal.stage_names`).
        codecs: the codec of each tensor it hands on, with the bytes, ratio and output change
            measured on held-out calibration samples (``mopar compile --codec``).
        quantized: the form of its weights (``int8``, ``int4``; absent: float, as exported),
            with their bytes, the float ones', and the change of the model's final outputs
            measured with it alone on held-out calibration samples (``mopar compile
            --quantize``).
        experts: the experts an expert function holds (its group, as indices in its layer; an
            expert held by several expert functions is replicated, its tokens shared out among
            them), or the hot experts a dispatch function holds and runs itself.
        sparse_experts: the experts layers among ``layers`` it runs in their sparse
            translation, each expert on the tokens routed to it (the others: dense).
    """

    name: str
    kind: str = "slice"
    group: str = ""
    layers: tuple[str, ...] = ()
    artifact: str = ""
    memory_mb: int
    need_mb: float = 0.0
    vcpus: float = 0.0
    time_ms: float = 0.0
    param_bytes: int = 0
    flops: int = 0
    cost_per_1m_usd: float = 0.0
    parallel: int = 1
    codecs: tuple[dict[str, Any], ...] = ()
    quantized: dict[str, Any] | None = None
    experts: tuple[int, ...] = ()
    sparse_experts: tuple[str, ...] = ()

    @property
    def spec(self) -> Kind:
        return kind_of(self.kind)

    @property
    def expert_span(self) -> str:
        """The experts it holds, as people read them: ``0-3``, or ``0,2``."""
        e = self.experts
        if len(e) > 2 and e == tuple(range(e[0], e[-1] + 1)):
            return f"{e[0]}-{e[-1]}"
        return ",".join(map(str, e))

    def label(self, k: int = 0) -> str:
        """How tables and graphs name it; ``k``: its index among its caller's called functions."""
        return self.spec.label.format(
            name=self.name, group=self.group, k=k, parallel=self.parallel, experts=self.expert_span
        )


@dataclass(frozen=True, kw_only=True)
class Edge:
    """Tensors one function hands another.

    Attributes:
        src: the producing function, or `REQUEST` for model inputs.
        dst: the consuming function, or `RESPONSE` for model outputs.
        tensors: the tensors' value names (their ONNX names), in the producer's order.
        bytes: their raw size, bytes.
        transport: how they travel: ``shm``, ``http``, ``redis``; ``request`` and ``response``
            at the ends (an answer over the payload limit: the store's, ``redis``).
        codecs: the codec of each tensor that is encoded on the way (absent: none).
        probability: the share of requests that take this edge.
        probability_source: one of `PROBABILITY_SOURCES`.
    """

    src: str
    dst: str
    tensors: tuple[str, ...]
    bytes: int
    transport: str
    codecs: Mapping[str, str] = field(default_factory=dict)
    probability: float = 1.0
    probability_source: str = "always"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to deploy a model: a graph of functions.

    Attributes:
        model: the model's name.
        strategy: the strategy that made the plan.
        functions: the functions, in a topological order of ``edges``.
        edges: the tensors between them.
        memory_source: how ``memory_mb`` was obtained (a predictor, or a measurement).
        target: the platform it was priced for.
        cost_per_1m_usd: predicted cost of a million requests, request fees included.
        latency_ms: predicted latency of a request along the critical path.
        mc_gb_s: the paper's MC: allocated GB x predicted seconds, summed over invocations.
        bound_ms: the latency bound the plan was held to (None: none).
        chain: how a request travels from function to function on the target: a chain mode of
            `mopar.bill.CHAINS` (empty: the target's default, as plans before chain modes).
        frontier: the cost/latency Pareto frontier the DP found (``mopar`` only).
        notes: caveats about the plan, each a record of its kind (`mopar.plan.notes`);
            ``str(note)`` is its sentence, what ``plan.json`` keeps.
        priced_for: the CPU its predicted times were priced for: ``target``, ``time_factor``
            (what every predicted time was multiplied by: the target's speed against the
            predictors' measuring CPU), ``source`` (where that factor comes from), and
            ``trained_on`` (that CPU); older plans say ``machine`` and the factor of the machine
            that compiled them. Empty: not said.
    """

    model: str
    strategy: str
    functions: tuple[Function, ...]
    edges: tuple[Edge, ...] = ()
    memory_source: str = ""
    target: str = DEFAULT_TARGET
    cost_per_1m_usd: float = 0.0
    latency_ms: float = 0.0
    mc_gb_s: float = 0.0
    bound_ms: float | None = None
    chain: str = ""
    frontier: tuple[dict[str, Any], ...] = ()
    notes: tuple[Note, ...] = ()
    priced_for: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = PLAN_FORMAT_VERSION

    # -- the graph ------------------------------------------------------------------------------

    def function(self, name: str) -> Function:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(name)

    def edges_in(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.dst == name)

    def edges_out(self, name: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == name)

    def path(self) -> tuple[Function, ...]:
        """The functions a request travels through, in order; called ones hang off them."""
        return tuple(f for f in self.functions if not f.spec.called)

    def callees(self, name: str) -> tuple[Function, ...]:
        """The called functions ``name`` invokes (those whose outputs it consumes), in order."""
        producers = {e.src for e in self.edges_in(name)}
        return tuple(f for f in self.functions if f.spec.called and f.name in producers)

    def caller(self, name: str) -> Function:
        """The function that invokes called function ``name``: the one consuming its outputs."""
        consumers = {e.dst for e in self.edges_out(name)}
        return next(f for f in self.functions if f.name in consumers)

    def invocation_probability(self, name: str) -> float:
        """The share of requests that invoke ``name``: its most likely incoming edge's; an
        expert function, which its dispatch sends tokens made per call, has only its answer's."""
        edges = self.edges_in(name) or self.edges_out(name)
        return max((e.probability for e in edges), default=1.0)

    def dispatches(self) -> tuple[Function, ...]:
        """The functions that route a mixture-of-experts layer's tokens to its experts: the
        dispatches of the layers placed as expert functions."""
        return tuple(f for f in self.path() if f.spec.routes)

    def prewarms(self, name: str) -> tuple[Function, ...]:
        """The functions dispatch ``name`` may pre-warm: the expert functions of the next
        dispatch on the path, whose experts it predicts (empty for the last, or any other)."""
        dispatches = [f.name for f in self.dispatches()]
        if name not in dispatches or name == dispatches[-1]:
            return ()
        return self.callees(dispatches[dispatches.index(name) + 1])

    def warmed_with_entry(self) -> tuple[Function, ...]:
        """The functions the entry pre-warms at a cold start, so that their INITs overlap its
        own: every other function each request invokes (the rest of the path, and the ones
        called every time). Expert functions are their dispatch's to warm, by prediction."""
        if len(self.functions) < 2:
            return ()
        entry = self.path()[0].name
        return tuple(
            f
            for f in self.functions
            if f.name != entry and self.invocation_probability(f.name) >= 1.0
        )

    def handoff(self, name: str) -> str:
        """How ``name`` hands its outputs on: the transport of its edges out."""
        return next((e.transport for e in self.edges_out(name)), "response")

    @property
    def answer(self) -> str:
        """How the answer goes back: ``response`` (in the last function's answer), or the
        transport of the store the last function puts it in (over the payload limit)."""
        return next((e.transport for e in self.edges_in(RESPONSE)), "response")

    def vertical(self) -> tuple[Function, ...]:
        """The slices of the vertical cut: the functions that hold layers, in order."""
        return tuple(f for f in self.functions if f.layers)

    @property
    def sharded(self) -> bool:
        return any(f.parallel > 1 for f in self.functions)

    @property
    def num_layers(self) -> int:
        return sum(len(f.layers) for f in self.functions)

    # -- JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``plan.json`` holds it; each note as its sentence."""
        return {**asdict(self), "notes": tuple(str(n) for n in self.notes)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan ``plan.json`` holds.

        Raises:
            BundleError: another format version, or a malformed plan; the message says to
                recompile.
        """
        version = data.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise BundleError(
                f"plan format version {version!r} is not supported (expected "
                f"{PLAN_FORMAT_VERSION}); recompile the bundle with this mopar"
            )
        try:
            functions = tuple(
                Function(
                    **{
                        **f,
                        "layers": tuple(f["layers"]),
                        "codecs": tuple(f.get("codecs", ())),
                        "experts": tuple(f.get("experts", ())),
                        "sparse_experts": tuple(f.get("sparse_experts", ())),
                    }
                )
                for f in data["functions"]
            )
            edges = tuple(Edge(**{**e, "tensors": tuple(e["tensors"])}) for e in data["edges"])
            fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
            plan = cls(
                **{
                    **fields,
                    "functions": functions,
                    "edges": edges,
                    "frontier": tuple(data.get("frontier", ())),
                    "notes": tuple(Remark(str(n)) for n in data.get("notes", ())),
                }
            )
        except (KeyError, TypeError) as exc:
            raise BundleError(
                f"plan is malformed ({type(exc).__name__}: {one_line(str(exc))}); recompile the bundle"
            ) from None
        for f in plan.functions:
            f.spec  # noqa: B018 - an unknown kind is refused here, with the fix
        return plan


def data_edges(
    io: Sequence[tuple[str, Sequence[str], Sequence[str]]],
    *,
    model_inputs: Iterable[str],
    model_outputs: Iterable[str],
    nbytes: Mapping[str, int],
    transport: Mapping[str, str],
    codecs: Mapping[str, str] | None = None,
) -> tuple[Edge, ...]:
    """The edges of functions that read and make the tensors ``io`` names.

    Args:
        io: (function, tensors it reads, tensors it makes) per function, in topological order.
        model_inputs, model_outputs: the model's input and output value names.
        nbytes: each tensor's size.
        transport: how each function hands its outputs on, and under `RESPONSE` how the
            answer goes back (absent: ``response``, in the answer itself; `Plan.answer`).
        codecs: the codec of each encoded tensor (absent: none).
    """
    codecs = codecs or {}
    producer = {t: REQUEST for t in model_inputs}
    flows: dict[tuple[str, str], list[str]] = {}
    for name, reads, makes in io:
        for t in reads:
            if t not in producer:
                raise BundleError(f"function {name} reads {t!r}, which nothing before it makes")
            flows.setdefault((producer[t], name), []).append(t)
        producer.update((t, name) for t in makes)
    for t in model_outputs:
        flows.setdefault((producer[t], RESPONSE), []).append(t)
    return tuple(
        Edge(
            src=src,
            dst=dst,
            tensors=tuple(ts),
            bytes=sum(int(nbytes[t]) for t in ts),
            transport="request"
            if src == REQUEST
            else transport.get(RESPONSE, "response")
            if dst == RESPONSE
            else transport.get(src, "shm"),
            codecs={t: codecs[t] for t in ts if codecs.get(t, "none") != "none"},
        )
        for (src, dst), ts in flows.items()
    )
