"""Plan: the frozen, JSON-serialisable decision of how to cut a model.

A Plan lists slices in topological order; each slice is a contiguous run of layers and carries
the memory size chosen for its function. Rewrites and emitters apply a Plan; they never decide.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mopar.errors import BundleError

__all__ = ["PLAN_FORMAT_VERSION", "STRATEGIES", "SlicePlan", "Plan"]

PLAN_FORMAT_VERSION = 2
STRATEGIES = ("mopar", "mopar-paper", "unsplit", "uniform", "params", "latency")
"""Every partition strategy; `mopar.planner.strategies` says what each does."""


@dataclass(frozen=True, kw_only=True)
class SlicePlan:
    """One slice of a Plan.

    Attributes:
        name: the slice's name (``s0``, ``s1``, ...), also its function folder.
        layers: layer names, in topological order.
        memory_mb: memory size of the slice's function, MB.
        param_bytes: bytes of parameters and buffers the slice holds.
        flops: forward FLOPs of the slice.
        in_bytes: bytes of tensors the slice receives (model inputs included).
        out_bytes: bytes of tensors the slice hands on.
        time_ms: predicted billed time per request at ``memory_mb`` (compute at the slice's
            CPU share, plus reading the cut it receives), ms.
        need_mb: predicted memory the slice needs, MB (``memory_mb`` is this rounded up to the
            platform's sizes, or raised for CPU).
        vcpus: the CPU the slice gets at ``memory_mb``.
        transport: how the slice hands its output on (``shm``, ``http``, ``redis``; the last
            slice: ``response``).
        cost_per_1m_usd: predicted cost of a million invocations of this slice.
        codecs: the codec of each tensor it hands on, with the bytes, ratio and output change
            measured on held-out calibration samples (``mopar compile --codec``).
        parallel: η of the slice this belongs to (1: not sharded).
        group: the sharded slice this is part of ("" when ``parallel`` is 1).
        role: ``shard`` (one of η sub-slices: no layers of its own, 1/η of the weights),
            ``join`` (aggregates the parts and runs the rest of the slice; carries its layers)
            or "" (an ordinary slice).
    """

    name: str
    layers: tuple[str, ...]
    memory_mb: int
    param_bytes: int
    flops: int
    in_bytes: int
    out_bytes: int
    time_ms: float = 0.0
    need_mb: float = 0.0
    vcpus: float = 0.0
    transport: str = ""
    cost_per_1m_usd: float = 0.0
    codecs: tuple[dict[str, Any], ...] = ()
    parallel: int = 1
    group: str = ""
    role: str = ""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to cut a model into slices.

    Attributes:
        model: the model's name.
        strategy: the strategy that made the plan.
        slices: the slices, in topological order.
        memory_source: how ``memory_mb`` was obtained (a predictor, or a measurement).
        target: the platform it was priced for.
        cost_per_1m_usd: predicted cost of a million requests, request fees included.
        latency_ms: predicted latency of a request (slices, handoffs and hops).
        mc_gb_s: the paper's MC: allocated GB x predicted seconds, summed over slices.
        bound_ms: the latency bound the plan was held to (None: none).
        frontier: the cost/latency Pareto frontier the DP found (``mopar`` only).
        notes: human-readable caveats about the plan.
    """

    model: str
    strategy: str
    slices: tuple[SlicePlan, ...]
    memory_source: str
    target: str = "openfaas"
    cost_per_1m_usd: float = 0.0
    latency_ms: float = 0.0
    mc_gb_s: float = 0.0
    bound_ms: float | None = None
    frontier: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    format_version: int = PLAN_FORMAT_VERSION

    @property
    def num_layers(self) -> int:
        return sum(len(s.layers) for s in self.slices)

    def stages(self) -> list[tuple[int, tuple[int, ...]]]:
        """The chain the functions form: (entry, its sub-slices) per stage, by slice index.

        An entry is an ordinary slice or a join; a join's sub-slices come right before it.
        """
        out, shards = [], []
        for i, s in enumerate(self.slices):
            if s.role == "shard":
                shards.append(i)
            else:
                out.append((i, tuple(shards)))
                shards = []
        return out

    def vertical(self) -> Plan:
        """The plan without its sub-slices: one entry per slice of the vertical cut (a sharded
        slice's last join, which carries its name and layers)."""
        return replace(self, slices=tuple(s for s in self.slices if s.role == "" or s.name == s.group))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        version = data.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise BundleError(
                f"plan format version {version!r} is not supported (expected "
                f"{PLAN_FORMAT_VERSION}); recompile the bundle with this mopar"
            )
        slices = tuple(
            SlicePlan(**{**s, "layers": tuple(s["layers"]), "codecs": tuple(s.get("codecs", ()))})
            for s in data["slices"]
        )
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "slices": slices, "frontier": tuple(data.get("frontier", ())),
                      "notes": tuple(data.get("notes", ()))})
