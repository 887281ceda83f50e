"""The cost model: what a slice costs and how long it takes on a target platform.

Read in this order: `Link` and `Platform` (frozen facts, loaded from ``profiles/platforms.json``
and the measured ``profiles/transports.json`` by `load_platform`), then the three pure functions
the solvers call: `slice_time_ms` (the CPU-share time model), `Platform.memory_options` (which
memory sizes are worth considering for a slice) and `Platform.cost_usd` (the bill).

Time model. A slice's time at one full vCPU is ``t1``; ``par`` of it runs in parallel across
onnxruntime's threads (Amdahl, the share measured per op family by the profiler). With ``c``
vCPUs, ``t(c) = (t1 - par) / min(c, 1) + par / c``: below one vCPU everything slows down
in proportion (Lambda throttles the whole process), above one only the parallel share speeds up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mopar.config import PROFILES_DIR, load_profile
from mopar.errors import PlanError

__all__ = ["TARGETS", "Link", "Platform", "load_platform", "slice_time_ms"]

TARGETS = ("openfaas", "lambda")
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Link:
    """A measured transport: handing ``n`` bytes over costs ``latency_ms + n / bandwidth``."""

    name: str
    latency_ms: float
    mb_per_s: float

    def transfer_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / MB / self.mb_per_s * 1e3


@dataclass(frozen=True, kw_only=True)
class Platform:
    """Billing, sizing and handoff facts of one target.

    Attributes:
        target: ``"openfaas"`` or ``"lambda"``.
        usd_per_gb_s: price of one GB of memory for one second.
        usd_per_request: fee per invocation (each slice is one invocation).
        billing_ms: billed time is rounded up to a multiple of this (0: not rounded).
        min_mb, max_mb, step_mb: the memory sizes a function may have.
        mb_per_vcpu: memory that buys one vCPU (0: CPU does not follow memory).
        max_vcpus: the CPU share's upper bound.
        vcpus: the fixed CPU of every function when CPU does not follow memory.
        links: transports a cut may use here, measured on this machine.
        hop_ms: fixed latency of invoking one more function.
        baseline_mb: memory every function pays before it loads a slice (the runtime).
        sync_payload_bytes: largest payload an HTTP hop may carry (0: no limit).
    """

    target: str
    usd_per_gb_s: float
    usd_per_request: float
    billing_ms: float
    min_mb: int
    max_mb: int
    step_mb: int
    mb_per_vcpu: float
    max_vcpus: float
    vcpus: float
    links: tuple[Link, ...]
    hop_ms: float
    baseline_mb: float
    sync_payload_bytes: int = 0

    def cpu(self, memory_mb: float) -> float:
        """vCPUs a function of ``memory_mb`` gets."""
        if self.mb_per_vcpu <= 0:
            return self.vcpus
        return min(memory_mb / self.mb_per_vcpu, self.max_vcpus)

    def round_mb(self, need_mb: float) -> int:
        """The smallest allowed size holding ``need_mb`` (may exceed ``max_mb``: caller checks)."""
        steps = math.ceil(max(need_mb, self.min_mb) / self.step_mb - 1e-9)
        return int(steps * self.step_mb)

    def cpu_steps(self) -> tuple[int, ...]:
        """Where CPU follows memory: the sizes of 1, 2 and 4 vCPUs and the maximum (1,769,
        3,538, 7,076 and 10,240 MB on Lambda). Empty elsewhere. Every size is a trade-off the
        DP carries along, so its work grows with their number; sizes in between buy little."""
        if self.mb_per_vcpu <= 0:
            return ()
        steps = {self.round_mb(k * self.mb_per_vcpu) for k in (1, 2, 4) if k <= self.max_vcpus}
        return tuple(sorted(s for s in steps | {self.max_mb} if s <= self.max_mb))

    def memory_options(self, need_mb: float) -> tuple[int, ...]:
        """Memory sizes worth considering for a slice needing ``need_mb``; empty if none fits.

        The smallest fitting size, and where CPU follows memory every `cpu_steps` size above
        it: below one vCPU the cost of a compute-bound slice is flat in memory while its time
        falls, above it time falls only by the parallel share, so cost and latency trade off
        at these points.
        """
        low = self.round_mb(need_mb)
        if low > self.max_mb:
            return ()
        return (low, *(s for s in self.cpu_steps() if s > low))

    def billed_ms(self, time_ms: float) -> float:
        if self.billing_ms <= 0:
            return time_ms
        return math.ceil(time_ms / self.billing_ms - 1e-9) * self.billing_ms

    def cost_usd(self, memory_mb: float, time_ms: float) -> float:
        """The bill of one invocation of ``memory_mb`` running ``time_ms``."""
        return (memory_mb / 1024.0) * (self.billed_ms(time_ms) / 1e3) * self.usd_per_gb_s + self.usd_per_request

    def handoff(self, nbytes: int) -> tuple[str, float]:
        """The fastest transport for a cut carrying ``nbytes``, and its time (ms).

        HTTP is ruled out above the platform's synchronous payload limit. Where there is such a
        limit (Lambda), a store (Redis) is taken only above it: within it, a direct invoke
        needs no infrastructure the user must provide, and loopback figures cannot say that
        an ElastiCache round trip beats it.
        """
        best: tuple[str, float] | None = None
        limit = self.sync_payload_bytes
        direct = limit and nbytes <= limit and any(x.name == "http" for x in self.links)
        for link in self.links:
            if link.name == "http" and limit and nbytes > limit:
                continue
            if direct and link.name != "http":
                continue
            ms = link.transfer_ms(nbytes)
            if best is None or ms < best[1]:
                best = (link.name, ms)
        if best is None:
            raise PlanError(
                f"no transport can carry a {nbytes / MB:.1f} MB cut on {self.target}; run "
                "`mopar profile calibrate` with redis-server installed, or cut elsewhere"
            )
        return best


def slice_time_ms(t1_ms, parallel_ms, vcpus):
    """Time of a slice with ``vcpus``, from its time at one vCPU and the parallel part of it
    (numbers or numpy arrays)."""
    serial = np.maximum(np.subtract(t1_ms, parallel_ms), 0.0)
    return serial / np.minimum(vcpus, 1.0) + np.divide(parallel_ms, vcpus)


def load_platform(profiles_dir: Path, target: str, *, arch: str = "x86_64",
                  transport: str | None = None) -> Platform:
    """The `Platform` for ``target`` from ``platforms.json`` and ``transports.json``.

    Args:
        transport: restrict cuts to this transport (None: each cut takes the fastest).
    """
    if target not in TARGETS:
        raise PlanError(f"unknown --target {target!r}; choose one of {', '.join(TARGETS)}")
    from mopar.profile.calibrate import load_transports, measured_transports

    facts = load_profile(profiles_dir, "platforms")[target]
    own = Path(profiles_dir) / "transports.json"
    measured = load_transports(own if own.is_file() else PROFILES_DIR / "transports.json")
    links = tuple(_link(name, measured) for name in facts["transports"]
                  if name in measured_transports(measured) and transport in (None, name))
    if transport is not None and not links:
        usable = [n for n in facts["transports"] if n in measured_transports(measured)]
        raise PlanError(f"--transport {transport} is not available on {target}; choose one of "
                        f"{', '.join(usable)} (shm needs co-located functions, which Lambda "
                        "cannot give)")
    price = facts["usd_per_gb_s"]
    if isinstance(price, dict):
        if arch not in price:
            raise PlanError(f"unknown --arch {arch!r} for {target}; choose one of {', '.join(price)}")
        price = price[arch]
    mem = facts["memory_mb"]
    return Platform(
        target=target,
        usd_per_gb_s=float(price),
        usd_per_request=float(facts["usd_per_request"]),
        billing_ms=float(facts["billing_ms"]),
        min_mb=int(mem["min"]), max_mb=int(mem["max"]), step_mb=int(mem["step"]),
        mb_per_vcpu=float(facts.get("mb_per_vcpu", 0)),
        max_vcpus=float(facts.get("max_vcpus", 0)),
        vcpus=float(facts.get("vcpus", 1)),
        links=links,
        hop_ms=float(measured["hop_ms"]),
        baseline_mb=float(measured["runtime_baseline_mb"]),
        sync_payload_bytes=int(facts.get("sync_payload_mb", 0) * MB),
    )


def _link(name: str, measured: dict[str, Any]) -> Link:
    entry = measured["transports"][name]
    return Link(name=name, latency_ms=float(entry["latency_ms"]), mb_per_s=float(entry["mb_per_s"]))
