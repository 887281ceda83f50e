"""What a simulation (or a local run, `mopar.sim.served`) served, and its bill.

Read in this order: `Served` (one function's invocations and instances, as the engine recorded
them), `FunctionFigures` and `SimResult` (the figures people read, frozen, with ``to_dict``), then
`summarise` (from the one to the other) and `bill_usd` (a function's bill, through `mopar.bill`:
this module applies no price itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from mopar.bill import Invocation, Replica, chain_usd, fixed_usd_per_s, served_usd
from mopar.facts import Platform
from mopar.runner.load import pct
from mopar.sim.model import SimFunction

__all__ = ["FunctionFigures", "Served", "SimResult", "bill_usd", "per_1m", "summarise"]


@dataclass(frozen=True, kw_only=True)
class Served:
    """One function over a simulated span.

    Attributes:
        function: the function.
        invocations: each invocation's part, as `mopar.bill` bills it.
        own_ms: each invocation's own time, ms (with its calls' waits, not the path's).
        cold: its cold starts.
        most: the most instances it ran at once.
        lives: (born, stopped) of each instance, s, within the span.
    """

    function: SimFunction
    invocations: tuple[Invocation, ...]
    own_ms: tuple[float, ...]
    cold: int
    most: int
    lives: tuple[tuple[float, float], ...]


@dataclass(frozen=True, kw_only=True)
class FunctionFigures:
    """One function's figures: its bill per million requests, times, cold starts, instances."""

    name: str
    memory_mb: int
    invocations: int
    usd: float
    cost_per_1m_usd: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    cold_starts: int
    cold_share: float | None
    instances: int
    instance_s: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """A simulation's figures, end to end and per function.

    Attributes:
        target, chain: the platform and chain mode it was billed for.
        requests: requests answered.
        span_s: the simulated span, s (replicas are billed over it).
        usd: the whole bill.
        cost_per_1m_usd: the bill per million requests answered.
        p50_ms, p95_ms, p99_ms: request latency from arrival to answer, ms.
        cold_share: the share of requests that met at least one cold start.
        functions: per function.
        notes: what was assumed, for people (service times, INIT, pool rules).
        new_tokens: a generation bundle's tokens per request (None: one step each).
    """

    target: str
    chain: str
    requests: int
    span_s: float
    usd: float
    cost_per_1m_usd: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    cold_share: float | None
    functions: tuple[FunctionFigures, ...]
    notes: tuple[str, ...] = ()
    new_tokens: int | None = None

    @property
    def cost_per_1k_tokens_usd(self) -> float | None:
        """A generation bundle's bill per 1,000 generated tokens (None: not one)."""
        if self.new_tokens is None or self.cost_per_1m_usd is None:
            return None
        return float(f"{self.cost_per_1m_usd / 1e3 / self.new_tokens:.6g}")

    def to_dict(self) -> dict:
        tokens = (
            {"new_tokens": self.new_tokens, "cost_per_1k_tokens_usd": self.cost_per_1k_tokens_usd}
            if self.new_tokens is not None
            else {}
        )
        return {
            "target": self.target,
            "chain": self.chain,
            "requests": self.requests,
            "span_s": round(self.span_s, 3),
            "usd": self.usd,
            "cost_per_1m_usd": self.cost_per_1m_usd,
            **tokens,
            "latency_ms": {"p50": self.p50_ms, "p95": self.p95_ms, "p99": self.p99_ms},
            "cold_share": self.cold_share,
            "functions": [asdict(f) for f in self.functions],
            "notes": list(self.notes),
        }


def per_1m(usd: float, requests: int) -> float | None:
    """``usd`` per million of ``requests``, to 6 figures (None: no request)."""
    return float(f"{usd / requests * 1e6:.6g}") if requests > 0 else None


def bill_usd(
    platform: Platform,
    chain: str,
    function: str,
    memory_mb: float,
    vcpus: float,
    invocations: Sequence[Invocation],
    lives_s: Sequence[float],
) -> float:
    """One function's bill (`mopar.bill.served_usd`): its invocations, and its instances'
    lifetimes (``lives_s``, s) where the platform bills replicas (of ``memory_mb`` and
    ``vcpus``)."""
    replicas = [
        Replica(function=function, memory_mb=memory_mb, vcpus=vcpus, seconds=s) for s in lives_s
    ]
    return served_usd(platform, chain, invocations, replicas)


def summarise(
    served: Sequence[Served],
    *,
    platform: Platform,
    chain: str,
    latencies_ms: np.ndarray,
    cold_requests: int,
    span_s: float,
    notes: Sequence[str] = (),
) -> SimResult:
    """The figures of what the engine served, billed through `mopar.bill`."""
    requests = len(latencies_ms)
    figures = []
    for s in served:
        f, n = s.function, len(s.invocations)
        lives = [max(0.0, stop - born) for born, stop in s.lives]
        cpu = platform.cpu_of(f.memory_mb, f.vcpus)
        usd = bill_usd(platform, chain, f.name, f.memory_mb, cpu, s.invocations, lives)
        cold = sum(1 for inv in s.invocations if inv.init_ms > 0)
        figures.append(
            FunctionFigures(
                name=f.name,
                memory_mb=f.memory_mb,
                invocations=n,
                usd=usd,
                cost_per_1m_usd=per_1m(usd, requests),
                p50_ms=pct(s.own_ms, 50),
                p95_ms=pct(s.own_ms, 95),
                p99_ms=pct(s.own_ms, 99),
                cold_starts=s.cold,
                cold_share=round(cold / n, 6) if n else None,
                instances=s.most,
                instance_s=round(sum(lives), 3),
            )
        )
    # the chain mode's own charges: per request (an orchestrator, a rendezvous), and by the hour
    usd = sum(f.usd for f in figures) + fixed_usd_per_s(platform, chain) * span_s
    usd += sum(chain_usd(platform, chain, latency_ms=float(ms)) for ms in latencies_ms)
    return SimResult(
        target=platform.target,
        chain=chain,
        requests=requests,
        span_s=span_s,
        usd=usd,
        cost_per_1m_usd=per_1m(usd, requests),
        p50_ms=pct(latencies_ms, 50),
        p95_ms=pct(latencies_ms, 95),
        p99_ms=pct(latencies_ms, 99),
        cold_share=round(cold_requests / requests, 6) if requests else None,
        functions=tuple(figures),
        notes=tuple(notes),
    )
