"""The facts a compile plans with, loaded once at the API or CLI boundary and passed down.

Read in this order: `Link` and `Platform` (billing, sizing and handoff facts of one target),
the targets a plan may be made for (`target_named`: a registered target package,
`mopar.target`, or a `PricingTarget` that ``platforms.json`` alone lists) and `platform_of`, the
`Platform` of one from its facts,
`Facts` (all of it, with the predictors and the
runtime figures), then the loaders: `load_facts` and `load_platform`.

Only the boundary (`mopar.api`, `mopar.cli`, `mopar.bench`) calls the loaders; the phases below
it (planner, rewrite, compress, emit, runner) take a `Facts` or a `Platform` and never open
``profiles/`` (tests/test_facts.py checks). A caller may build a `Platform` in code for a
provider that has no profile: ``mopar.partition(model, (x,), platform=Platform(...))``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mopar.config import DEFAULT_TARGET, PROFILES_DIR, CompileConfig, load_profile
from mopar.errors import Option, OptionError, PlanError
from mopar.runtime.chains import MODES, ChainMode
from mopar.runtime.transports import names, transport_named, transports
from mopar.target import (
    Client,
    Emulation,
    Entry,
    ImageRecipe,
    Target,
    deploy_targets,
    register_target,
    registered,
    target_or_default,
    unregister_target,
)
from mopar.traffic import Traffic

if TYPE_CHECKING:
    from mopar.plan import Plan

__all__ = [
    "ChainFacts",
    "Emitter",
    "Facts",
    "Link",
    "Platform",
    "PricingTarget",
    "Target",
    "deploy_targets",
    "load_facts",
    "load_platform",
    "only_transport",
    "colocated",
    "platform_of",
    "register_target",
    "target_named",
    "target_names",
    "unregister_target",
]

log = logging.getLogger(__name__)

MB = 1 << 20
KEEP_LAST = ("answer with the last position alone (", Option("keep_positions", value="last"), ")")
"""The next step where a model's answer is too large for the target: what to say."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """A measured transport: handing ``n`` bytes over costs ``latency_ms + n / bandwidth``."""

    name: str
    latency_ms: float
    mb_per_s: float

    def transfer_ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / MB / self.mb_per_s * 1e3


@dataclass(frozen=True, kw_only=True)
class ChainFacts:
    """A chain mode as a target offers it: its limits, latencies and charges (``platforms.json``
    ``chains``). What a mode *is* (whether a caller waits) is `mopar.bill.CHAINS`'s.

    Attributes:
        name: the mode (a key of `mopar.bill.CHAINS`).
        payload_bytes: the largest frame a hop carries inline in this mode (0: no limit);
            larger ones go through a store (Redis).
        hop_ms: latency this mode adds to each hop beyond the measured one, ms (a Step Functions
            state transition, an Event queue).
        entry_ms: latency it adds once per request, ms (starting the workflow, reading the
            answer from the rendezvous).
        colocated: the functions share a host folder: only co-located transports (shm) carry
            its cuts; a mode that is not co-located never uses them.
        usd_per_request: what the mode's orchestrator charges per request (Step Functions).
        usd_per_gb_s, memory_mb, billing_ms: the orchestrator's duration charge: the request's
            latency rounded up to ``billing_ms``, x ``memory_mb`` (Step Functions Express:
            100 ms, 64 MB chunks).
        store: the rendezvous the answer is left in ("" : none).
        store_usd_per_hour: what the rendezvous costs per hour however idle.
        store_usd_per_kb: what writing or reading one KB of it costs.
    """

    name: str
    payload_bytes: int = 0
    hop_ms: float = 0.0
    entry_ms: float = 0.0
    colocated: bool = False
    usd_per_request: float = 0.0
    usd_per_gb_s: float = 0.0
    memory_mb: float = 0.0
    billing_ms: float = 0.0
    store: str = ""
    store_usd_per_hour: float = 0.0
    store_usd_per_kb: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Platform:
    """Billing, sizing and handoff facts of one target.

    Attributes:
        target: the platform's name: ``"openfaas"`` or ``"lambda"`` from the profiles, or any
            name for one built in code.
        usd_per_gb_s: price of one GB of memory for one second.
        usd_per_request: fee per invocation (each slice is one invocation).
        billing_ms: billed time is rounded up to a multiple of this (0: not rounded).
        min_mb, max_mb, step_mb: the memory sizes a function may have.
        mb_per_vcpu: memory that buys one vCPU (0: CPU does not follow memory).
        max_vcpus: the CPU share's upper bound.
        vcpus: the CPU of a function whose share is not its own choice, where CPU does not
            follow memory.
        cpu_grid: the CPU shares a function may request, vCPUs, where CPU is a resource of its
            own (OpenFaaS on Kubernetes: requested, limited and billed apart from memory); the
            planner chooses one per function (`sizes`). Empty: CPU follows memory
            (``mb_per_vcpu``), or is ``vcpus``.
        usd_per_vcpu_s: price of one requested vCPU for one second (0: CPU is not billed apart
            from memory).
        colocates: whether two functions share a host folder here (a tmpfs), which a
            colocated transport and a co-located chain mode need: on OpenFaaS only when a
            compile asks for it (``colocate``: the bundle's ``k8s/`` patch), never on Lambda.
        colocation: what co-locating functions needs here, in words (``platforms.json``'s
            ``colocation.needs``: OpenFaaS Pro's Profiles, a hostPath, ...); empty where
            functions cannot be co-located (Lambda), or are by default.
        links: transports a cut may use here, measured on this machine.
        hop_ms: fixed latency of invoking one more function.
        baseline_mb: memory every function pays before it loads a slice (the runtime).
        sync_payload_bytes: largest frame an HTTP hop may carry inline (0: no limit): the
            platform's payload limit, less its encoding (`_frame_bytes`).
        answer_payload_bytes: the same for the answer (0: no limit): a chain mode's, where the
            answer comes back up the chain (not through a rendezvous: `Platform.answer`).
        answer_waits: the answer waits in a rendezvous store for the caller (``event``).
        bills_init: whether a cold start's INIT phase is billed (Lambda, since August 2025).
        init_base_ms, init_ms_per_mb: a cold start's INIT time is ``init_base_ms`` (process,
            Python, numpy and onnxruntime) plus ``init_ms_per_mb`` per MB of weights loaded,
            ms (``runtime.json``, measured).
        cold_start_rate: the share of invocations of a function on every request that start
            cold, 0-1: given (``cold_start_rate``), or what ``traffic`` implies with
            ``keep_alive_s``; where INIT is billed, every invocation is charged this share of an
            INIT in the DP (`mopar.bill` prices each function at its own share).
        chains: the chain modes it offers, its default first (empty: one plain mode, no waits
            billed, no charges of its own: a platform built in code).
        keep_alive_s: how long an idle instance is kept before it is reaped, s (inf: never).
        min_replicas: instances every function keeps however idle (OpenFaaS CE: 1).
        max_replicas: the most instances of one function at once (Lambda's default concurrency
            quota, OpenFaaS's ``com.openfaas.scale.max``); past it, requests queue.
        reserved: replicas are billed for the memory they reserve while they exist, busy or
            idle (OpenFaaS), not per invocation.
        max_inflight: requests one instance serves at once.
        scale_every_s: how often the platform's autoscaler sets each function's replicas from
            its load, s (0: an instance starts whenever a request finds every one busy, as
            Lambda does).
        target_load: requests in flight per replica the autoscaler keeps (``scale_every_s``).
        free_ephemeral_mb, ephemeral_usd_per_gb_s: ``/tmp`` a function gets for free, MB, and
            the price of each GB above it per second.
        traffic: the requests plans are priced for.
        time_factor: the target's CPU against the one the time predictors were measured on:
            every predicted time is multiplied by it (``platforms.json``'s ``speed``; 1: the
            same speed). A stated fact of the target, never this machine's load.
        time_source: where ``time_factor`` comes from, in words (empty: built in code).
        int8_kernels: the int8 kernel family its CPUs run quantised weights with
            (`mopar.compress.kernels`: ``avx2``, ``vnni``, ``arm64-dot``), and
            ``int8_kernels_source`` where that fact comes from.
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
    cpu_grid: tuple[float, ...] = ()
    usd_per_vcpu_s: float = 0.0
    links: tuple[Link, ...]
    colocates: bool = False
    colocation: str = ""
    hop_ms: float
    baseline_mb: float
    sync_payload_bytes: int = 0
    answer_payload_bytes: int = 0
    answer_waits: bool = False
    bills_init: bool = False
    init_base_ms: float = 0.0
    init_ms_per_mb: float = 0.0
    cold_start_rate: float = 0.0
    chains: tuple[ChainFacts, ...] = ()
    keep_alive_s: float = math.inf
    min_replicas: int = 0
    max_replicas: int = 20
    reserved: bool = False
    max_inflight: int = 1
    scale_every_s: float = 0.0
    target_load: float = 1.0
    free_ephemeral_mb: float = 0.0
    ephemeral_usd_per_gb_s: float = 0.0
    traffic: Traffic = Traffic()
    time_factor: float = 1.0
    time_source: str = ""
    int8_kernels: str = "avx2"
    int8_kernels_source: str = ""

    def chain(self, name: str) -> ChainFacts:
        """The chain mode ``name`` as offered here; ``""``: the default (the first), or a plain
        mode where the platform lists none.

        Raises:
            PlanError: the platform does not offer ``name``.
        """
        if not self.chains:
            if name:
                raise PlanError(
                    Option("chain", value=name, quoted=True),
                    f" is not offered on {self.target}, which lists no chain modes",
                )
            return ChainFacts(name="")
        if not name:
            return self.chains[0]
        for c in self.chains:
            if c.name == name:
                return c
        raise PlanError(
            Option("chain", value=name, quoted=True),
            f" is not a chain mode of {self.target}; choose one of "
            f"{', '.join(c.name for c in self.chains)}",
        )

    def for_chain(self, name: str) -> Platform | None:
        """This platform as a plan in chain mode ``name`` sees it: cuts only on the transports
        the mode allows (co-located ones in a co-located mode, the others elsewhere), its
        payload limit, and each hop slower by the mode's own latency; None where no measured
        transport fits the mode."""
        if not self.chains:
            return self
        c = self.chain(name)
        links = tuple(x for x in self.links if transport_named(x.name).colocated == c.colocated)
        if not links:
            return None
        back = not getattr(MODES.get(c.name), "rendezvous", "")  # the answer comes up the chain
        return replace(
            self,
            links=links,
            sync_payload_bytes=c.payload_bytes,
            answer_payload_bytes=c.payload_bytes if back else 0,
            answer_waits=not back,
            hop_ms=self.hop_ms + c.hop_ms,
        )

    def cpu(self, memory_mb: float) -> float:
        """vCPUs a function of ``memory_mb`` gets where its CPU is not its own choice."""
        if self.mb_per_vcpu <= 0:
            return self.vcpus
        return min(memory_mb / self.mb_per_vcpu, self.max_vcpus)

    def cpu_of(self, memory_mb: float, requested: float) -> float:
        """The vCPUs a function of ``memory_mb`` that requested ``requested`` (its plan's
        ``vcpus``) gets here: its request where CPU is a resource of its own (``cpu_grid``;
        `vcpus` for a request of 0), else what its memory buys."""
        if self.cpu_grid:
            return requested if requested > 0 else self.vcpus
        return self.cpu(memory_mb)

    def sizes(self, need_mb: float) -> tuple[tuple[int, float], ...]:
        """The (memory MB, vCPUs) sizes worth considering for a function needing ``need_mb``;
        empty if none fits: each of `memory_options` at its CPU, or, where CPU is a resource
        of its own (``cpu_grid``), the smallest fitting memory at every CPU share."""
        if not self.cpu_grid:
            return tuple((mb, self.cpu(mb)) for mb in self.memory_options(need_mb))
        low = self.round_mb(need_mb)
        return tuple((low, c) for c in self.cpu_grid) if low <= self.max_mb else ()

    def usd_per_s(self, memory_mb: float, vcpus: float) -> float:
        """What a function of ``memory_mb`` and ``vcpus`` is billed per second it runs (or,
        where replicas are reserved, exists): its memory, and its CPU where that is billed."""
        return memory_mb / 1024.0 * self.usd_per_gb_s + vcpus * self.usd_per_vcpu_s

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

    def init_ms(self, param_bytes: float) -> float:
        """Predicted INIT time of a cold function holding ``param_bytes`` of weights, ms."""
        return self.init_base_ms + param_bytes / MB * self.init_ms_per_mb

    def init_share_ms(self, param_bytes: float) -> float:
        """The INIT time each invocation pays on average, ms: `init_ms` x the cold-start rate
        where INIT is billed, else 0."""
        return self.init_ms(param_bytes) * self.cold_start_rate if self.bills_init else 0.0

    def cost_usd(
        self, memory_mb: float, time_ms: float, param_bytes: float = 0.0, vcpus: float | None = None
    ) -> float:
        """The bill of one invocation of ``memory_mb`` and ``vcpus`` (None: `cpu`'s) running
        ``time_ms``, with its share of a cold start's INIT for a function holding
        ``param_bytes`` of weights."""
        billed_s = (self.billed_ms(time_ms) + self.init_share_ms(param_bytes)) / 1e3
        cpu = self.cpu(memory_mb) if vcpus is None else vcpus
        return self.usd_per_s(memory_mb, cpu) * billed_s + self.usd_per_request

    def handoff(self, nbytes: int, *, what: str = "cut") -> tuple[str, float]:
        """The fastest transport for a cut carrying ``nbytes`` (``what``: a cut, the answer),
        and its time (ms).

        An inline transport (HTTP) is ruled out above the platform's synchronous payload limit.
        Where there is such a limit (Lambda), another (a store, Redis) is taken only above it:
        within it, a direct invoke needs no infrastructure the user must provide, and loopback
        figures cannot say that an ElastiCache round trip beats it.
        """
        best: tuple[str, float] | None = None
        limit = self.sync_payload_bytes
        inline = {link.name: transport_named(link.name).inline for link in self.links}
        direct = limit and nbytes <= limit and any(inline.values())
        for link in self.links:
            if inline[link.name] and limit and nbytes > limit:
                continue
            if direct and not inline[link.name]:
                continue
            ms = link.transfer_ms(nbytes)
            if best is None or ms < best[1]:
                best = (link.name, ms)
        if best is None:
            raise PlanError(
                f"no transport can carry a {nbytes / MB:.1f} MB {what} on {self.target}; run "
                "`mopar profile calibrate` with redis-server installed, or ",
                *(("cut elsewhere",) if what == "cut" else KEEP_LAST),
            )
        return best

    def answer(self, nbytes: int) -> tuple[str, float]:
        """How an answer of ``nbytes`` goes back to the caller, and its time (ms): in the
        answer itself (``response``, 0 ms) within the payload limit, else as a cut that large
        is handed over (`handoff`: the last function puts it in the store, the answer names it).
        Where it waits in a rendezvous, it is the answer all the same, at a handoff's time.
        """
        if self.answer_waits:
            return "response", self.handoff(nbytes, what="answer")[1]
        if not self.answer_payload_bytes or nbytes <= self.answer_payload_bytes:
            return "response", 0.0
        return self.handoff(nbytes, what="answer")


class Emitter(Protocol):
    """Writes a target's deployment files into a bundle, from its plan, deciding nothing (a
    target package's ``emit``); the compile's ``config`` gives what they carry beside the plan
    (``arch``, ``image_prefix``, ``gateway``, ``redis_url``)."""

    def __call__(
        self, bundle: Path, plan: Plan, *, config: CompileConfig, facts: Facts
    ) -> None: ...


@dataclass(frozen=True, kw_only=True)
class PricingTarget:
    """A target ``platforms.json`` lists and no package is registered for: planned and priced
    for, with no files, images or functions of its own (a `mopar.target.Target`; it runs as the
    default target's functions do)."""

    name: str

    @property
    def deploys(self) -> bool:
        return False

    def facts(self, profiles_dir: Path) -> Mapping[str, Any] | None:
        entry = load_profile(profiles_dir, "platforms").get(self.name)
        return entry if isinstance(entry, dict) else None

    def chain_modes(self) -> tuple[ChainMode, ...]:
        return ()

    def entry(self, mode: ChainMode, *, deployed: bool) -> Entry:
        return target_or_default(None).entry(mode, deployed=deployed)

    def image(self) -> ImageRecipe | None:
        return None

    def client(self) -> Client | None:
        return None

    def emulation(self, mode: ChainMode, *, workers: int, timeout_s: float) -> Emulation | None:
        return target_or_default(None).emulation(mode, workers=workers, timeout_s=timeout_s)

    def emit(self, bundle: Path, plan: Any, *, config: CompileConfig, facts: Any) -> None:
        """Nothing: a pricing-only target adds no files."""


def target_names(profiles_dir: Path = PROFILES_DIR) -> tuple[str, ...]:
    """The targets a plan may be made for (``--target``'s choices): the registered ones, then
    the pricing-only ones ``platforms.json`` in ``profiles_dir`` adds."""
    listed = load_profile(profiles_dir, "platforms")
    known = [t.name for t in registered()]
    return (*known, *(k for k, v in listed.items() if isinstance(v, dict) and k not in known))


def target_named(name: str, profiles_dir: Path = PROFILES_DIR) -> Target:
    """The target ``name``: the registered one, else a pricing-only one from ``platforms.json``.

    Raises:
        PlanError: neither knows it.
    """
    for target in registered():
        if target.name == name:
            return target
    known = target_names(profiles_dir)
    if name not in known:
        raise PlanError(
            "unknown ",
            Option("target", value=name, quoted=True),
            f"; choose one of {', '.join(known)}",
        )
    return PricingTarget(name=name)


def platform_of(
    target: Target, profiles_dir: Path, *, arch: str = "x86_64", colocate: bool = False
) -> Platform:
    """``target``'s `Platform`: prices, memory grid and CPU rule from its facts (its
    ``platforms.json`` entry), and a link for each transport that allows it and
    ``transports.json`` has measured. With ``colocate``, its functions co-located
    (`colocated`): the shm transport and chain mode are offered.

    Raises:
        PlanError: an unknown ``arch``, no facts for it, or ``colocate`` where it cannot.
    """
    facts = target.facts(profiles_dir)
    if facts is None:
        raise PlanError(
            f"target {target.name!r} has no entry in platforms.json; add its prices and "
            "memory grid there, or return them from its package's facts()"
        )
    from mopar.profile.calibrate import load_transports, measured_transports

    own = Path(profiles_dir) / "transports.json"
    measured = load_transports(own if own.is_file() else PROFILES_DIR / "transports.json")
    usable = measured_transports(measured)
    price = facts["usd_per_gb_s"]
    if isinstance(price, dict):
        if arch not in price:
            raise PlanError(
                "unknown ",
                Option("arch", value=arch, quoted=True),
                f" for {target.name}; choose one of {', '.join(price)}",
            )
        price = price[arch]
    mem = facts["memory_mb"]
    cold = load_profile(profiles_dir, "runtime").get("cold_start", {})
    replicas = facts.get("replicas", {})
    ephemeral = facts.get("ephemeral", {})
    encoding = str(facts.get("payload_encoding", ""))
    time_factor, time_source = _speed(target.name, facts.get("speed"), profiles_dir)
    platform = Platform(
        target=target.name,
        usd_per_gb_s=float(price),
        usd_per_request=float(facts["usd_per_request"]),
        billing_ms=float(facts["billing_ms"]),
        min_mb=int(mem["min"]),
        max_mb=int(mem["max"]),
        step_mb=int(mem["step"]),
        mb_per_vcpu=float(facts.get("mb_per_vcpu", 0)),
        max_vcpus=float(facts.get("max_vcpus", 0)),
        vcpus=float(facts.get("vcpus", 1)),
        cpu_grid=_cpu_grid(target.name, facts),
        usd_per_vcpu_s=float(facts.get("usd_per_vcpu_s", 0.0)),
        colocates=bool(facts.get("colocates", False)),
        colocation=str((facts.get("colocation") or {}).get("needs", "")),
        links=(),
        hop_ms=float(measured["hop_ms"]),
        baseline_mb=float(measured["runtime_baseline_mb"]),
        sync_payload_bytes=_frame_bytes(facts.get("sync_payload_mb", 0), encoding),
        bills_init=bool(facts.get("bills_init", False)),
        init_base_ms=float(cold.get("base_ms", 0.0)),
        init_ms_per_mb=float(cold.get("ms_per_weight_mb", 0.0)),
        chains=tuple(_chain(name, c, encoding) for name, c in facts.get("chains", {}).items()),
        keep_alive_s=float(facts.get("keep_alive_s") or math.inf),
        min_replicas=int(replicas.get("min", 0)),
        max_replicas=int(replicas.get("max", 20)),
        reserved=bool(replicas.get("reserved", False)),
        max_inflight=int(replicas.get("max_inflight", 1)),
        scale_every_s=float(replicas.get("scale", {}).get("every_s", 0.0)),
        target_load=float(replicas.get("scale", {}).get("target_load", 1.0)),
        free_ephemeral_mb=float(ephemeral.get("free_mb", 0)),
        ephemeral_usd_per_gb_s=float(ephemeral.get("usd_per_gb_s", 0.0)),
        time_factor=time_factor,
        time_source=time_source,
        int8_kernels=_per_arch(facts.get("int8_kernels", "avx2"), arch),
        int8_kernels_source=str(facts.get("int8_kernels_source", "")),
    )
    if colocate:
        platform = colocated(platform)
    links = (_link(t.name, measured) for t in transports() if t.name in usable)
    return replace(
        platform, links=tuple(x for x in links if transport_named(x.name).allows(platform))
    )


def _per_arch(value: Any, arch: str) -> str:
    """A fact given once, or per architecture (``{"x86_64": ..., "arm64": ...}``): ``arch``'s."""
    return str(value.get(arch, next(iter(value.values()))) if isinstance(value, dict) else value)


_COLOCATE = Option("colocate", value=True)


def colocated(platform: Platform) -> Platform:
    """``platform`` with its functions co-located (``--colocate``): what its ``colocation``
    says it needs is then the deployer's to provide.

    Raises:
        PlanError: the platform cannot co-locate functions (its facts say nothing of how).
    """
    if platform.colocates:
        return platform
    if not platform.colocation:
        raise PlanError(
            _COLOCATE,
            f" asks for co-located functions, which {platform.target} cannot give (its "
            "functions share no host folder); leave it out",
        )
    return replace(platform, colocates=True)


def _cpu_grid(target: str, facts: Mapping[str, Any]) -> tuple[float, ...]:
    """The ``cpu.grid`` of ``target``'s facts, checked against its node and its price.

    Raises:
        PlanError: a share that is not a positive number or exceeds ``cpu.node_vcpus``, or a
            grid without a ``usd_per_vcpu_s`` to bill it at.
    """
    cpu = facts.get("cpu") or {}
    grid = cpu.get("grid") or ()
    node = cpu.get("node_vcpus")
    most = f" and at most the node's {node}" if node else ""
    for share in grid:
        ok = isinstance(share, (int, float)) and not isinstance(share, bool) and share > 0
        if not ok or (node is not None and share > node):
            raise PlanError(
                f"target {target!r}: CPU share {share!r} in platforms.json's cpu.grid is not "
                f"a number of vCPUs above 0{most}; fix the grid"
            )
    price = facts.get("usd_per_vcpu_s")
    if grid and (isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0):
        raise PlanError(
            f"target {target!r} requests CPU (cpu.grid in platforms.json) but its node type "
            f"has no price for it (usd_per_vcpu_s is {price!r}); add the price of one vCPU "
            "per second, e.g. the node's hourly rate split as OpenCost splits it, / 3600"
        )
    return tuple(sorted(float(s) for s in grid))


def _speed(target: str, entry: Any, profiles_dir: Path) -> tuple[float, str]:
    """The ``speed`` entry of ``target``'s facts: its time factor and its source.

    Raises:
        PlanError: no entry, or a factor that is not a positive number.
    """
    where = f"{Path(profiles_dir) / 'platforms.json'} (or the shipped one)"
    factor = entry.get("time_factor") if isinstance(entry, Mapping) else None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise PlanError(
            f'target {target!r} states no speed in {where}: add "speed": '
            '{"time_factor": F, "source": "..."} (1: the CPU the predictors were measured on), '
            f"or measure it with `mopar profile calibrate --speed {target} --out DIR` and pass ",
            Option("profiles_dir", metavar="DIR", cli="profiles"),
        )
    if not (math.isfinite(factor) and factor > 0):
        raise PlanError(
            f"target {target!r}'s speed.time_factor {factor!r} in {where} is not a positive "
            "number; set it to what predicted times are multiplied by on its CPU (1: as "
            "measured)"
        )
    return float(factor), str(entry.get("source", ""))


@dataclass(frozen=True, kw_only=True)
class Facts:
    """Everything a compile knows about the world besides the model, loaded once.

    Attributes:
        platform: the target the plan is priced and sized for.
        predictors: the per-layer memory and time predictors
            (`mopar.profile.store.Predictors`, from ``predictors.json``).
        weight_copies: copies of a slice's weights its process holds at its peak, a
            multiplier of the weight bytes (``runtime.json``).
        answer_copies: what the function that answers spends encoding the model's outputs as
            JSON, a multiplier of their bytes (``runtime.json``).
        measured_margin: headroom compile adds over a slice's measured peak RSS, a fraction
            (0.25: 25 %; ``runtime.json``).
        targets: every registered target's facts (its ``platforms.json`` entry), by name,
            for the emitters: each target's files obey its own limits (Lambda's memory grid,
            whatever target the plan was priced for).
    """

    platform: Platform
    predictors: Any
    weight_copies: float
    answer_copies: float
    measured_margin: float
    targets: Mapping[str, Mapping[str, Any]]


# --- loading (the boundary only) ------------------------------------------------------------------


def load_facts(
    profiles_dir: Path = PROFILES_DIR,
    *,
    target: str = DEFAULT_TARGET,
    arch: str = "x86_64",
    transport: str | None = None,
    platform: Platform | None = None,
    max_memory_mb: int | None = None,
    cold_start_rate: float | None = None,
    traffic: Traffic | None = None,
    colocate: bool = False,
    predictors: bool = True,
) -> Facts:
    """The `Facts` of a compile, from the profiles in ``profiles_dir`` (the shipped ones for
    any file it lacks).

    Args:
        target, arch: which entry of ``platforms.json`` to plan for (ignored with ``platform``).
        transport: restrict cuts to this transport (None: each cut takes the fastest).
        platform: a `Platform` built in code, used instead of ``platforms.json``; it need not
            be a registered target (`target_names`).
        max_memory_mb: the largest function allowed (an account's limit, a node's size); None:
            the platform's.
        cold_start_rate: the share of invocations that start cold, given (None: what the
            traffic implies with the platform's keep-alive; `Traffic.cold_share`).
        traffic: the requests plans are priced for (None: `Traffic`'s default).
        colocate: co-locate the functions (`colocated`), which offers the shm transport and
            chain mode where the target says how (OpenFaaS: Pro's Profiles and a hostPath).
        predictors: load the predictors (False: `Facts.predictors` is None, for what only
            measures and emits: XGBoost stays out of its process).

    Predicted times are priced for the target's CPU (`Platform.time_factor`), never for this
    machine's.

    Raises:
        PlanError: an unknown target, arch or transport.
        OptionError: a ``platform`` that cannot be planned for.
        MoparError: a profile file is missing or corrupt.
    """
    if platform is None:
        platform = load_platform(
            profiles_dir, target, arch=arch, transport=transport, colocate=colocate
        )
    else:
        checked = _checked(platform)
        platform = only_transport(colocated(checked) if colocate else checked, transport)
    platform = _workload(
        platform,
        max_memory_mb=max_memory_mb,
        traffic=traffic or Traffic(),
        cold_start_rate=cold_start_rate,
    )
    runtime = load_profile(profiles_dir, "runtime")
    return Facts(
        platform=platform,
        predictors=_predictors(Path(profiles_dir), platform.time_factor) if predictors else None,
        weight_copies=float(runtime["weight_copies"]),
        answer_copies=float(runtime["answer_copies"]),
        measured_margin=float(runtime["measured_margin"]),
        targets={
            t.name: entry for t in registered() if (entry := t.facts(profiles_dir)) is not None
        },
    )


def load_platform(
    profiles_dir: Path,
    target: str,
    *,
    arch: str = "x86_64",
    transport: str | None = None,
    colocate: bool = False,
) -> Platform:
    """The `Platform` for ``target`` from ``platforms.json`` and ``transports.json``.

    Args:
        transport: restrict cuts to this transport (None: each cut takes the fastest).
        colocate: co-locate the functions (`platform_of`).
    """
    named = target_named(target, profiles_dir)
    platform = platform_of(named, profiles_dir, arch=arch, colocate=colocate)
    return only_transport(platform, transport)


def only_transport(platform: Platform, transport: str | None) -> Platform:
    """``platform`` with its links restricted to ``transport`` (None: all of them)."""
    if transport is None:
        return platform
    links = tuple(link for link in platform.links if link.name == transport)
    if not links:
        why: tuple[str | Option, ...] = (
            " (shm needs co-located functions, which Lambda cannot give)",
        )
        if transport in names() and transport_named(transport).colocated and platform.colocation:
            why = (f" ({transport} needs co-located functions: add ", _COLOCATE, ")")
        raise PlanError(
            Option("transport", value=transport),
            f" is not available on {platform.target}; choose one of "
            f"{', '.join(link.name for link in platform.links)}",
            *why,
        )
    return replace(platform, links=links)


def _workload(
    platform: Platform,
    *,
    max_memory_mb: int | None,
    traffic: Traffic,
    cold_start_rate: float | None,
) -> Platform:
    """``platform`` capped at ``max_memory_mb`` and priced for ``traffic``, with
    ``cold_start_rate`` of cold invocations where given."""
    if cold_start_rate is not None and not 0 <= cold_start_rate <= 1:
        raise OptionError(
            Option("cold_start_rate"),
            f" must be between 0 and 1 (a share of invocations), got {cold_start_rate:g}",
        )
    cap = platform.max_mb
    if max_memory_mb is not None:
        if max_memory_mb < platform.min_mb:
            raise OptionError(
                Option("max_memory_mb", value=max_memory_mb),
                f" is below the smallest {platform.target} function ({platform.min_mb} MB); "
                "raise it",
            )
        # the largest allowed size at or below the cap
        cap = min(
            cap,
            platform.min_mb
            + (max_memory_mb - platform.min_mb) // platform.step_mb * platform.step_mb,
        )
    if cold_start_rate is not None:
        traffic = replace(traffic, cold_start_rate=float(cold_start_rate))
    return replace(
        platform,
        max_mb=int(cap),
        traffic=traffic,
        cold_start_rate=traffic.cold_share(platform.keep_alive_s),
    )


ENVELOPE_BYTES = 1024
"""What an event carries besides its frame's base64 text: the JSON around it (mopar's events
are ``{"mopar": 1, "frame": ...}`` with timing and invocations)."""


def _frame_bytes(payload_mb: float, encoding: str) -> int:
    """The largest frame a payload limit of ``payload_mb`` carries inline (0: no limit): with
    ``encoding`` ``base64`` (Lambda's JSON events), 3/4 of it less `ENVELOPE_BYTES`."""
    limit = int(float(payload_mb) * MB)
    if not limit or encoding != "base64":
        return limit
    return max((limit - ENVELOPE_BYTES) * 3 // 4, 0)


def _chain(name: str, entry: Mapping[str, Any], encoding: str = "") -> ChainFacts:
    """A ``chains`` entry of ``platforms.json`` as `ChainFacts` (``encoding``: the
    platform's ``payload_encoding``, `_frame_bytes`)."""
    store = entry.get("rendezvous", {})
    return ChainFacts(
        name=name,
        payload_bytes=_frame_bytes(entry.get("payload_mb", 0), encoding),
        hop_ms=float(entry.get("hop_ms", 0.0)),
        entry_ms=float(entry.get("entry_ms", 0.0)),
        colocated=bool(entry.get("colocated", False)),
        usd_per_request=float(entry.get("usd_per_request", 0.0)),
        usd_per_gb_s=float(entry.get("usd_per_gb_s", 0.0)),
        memory_mb=float(entry.get("memory_mb", 0.0)),
        billing_ms=float(entry.get("billing_ms", 0.0)),
        store=str(store.get("store", "")),
        store_usd_per_hour=float(store.get("usd_per_hour", 0.0)),
        store_usd_per_kb=float(store.get("usd_per_kb", 0.0)),
    )


def _checked(platform: Platform) -> Platform:
    """A caller's own ``platform``, checked as far as planning needs it."""
    problems = [
        f"{name} is {getattr(platform, name)!r}, expected {want}"
        for name, ok, want in (
            ("step_mb", platform.step_mb >= 1, "at least 1"),
            ("min_mb", 0 < platform.min_mb <= platform.max_mb, "between 1 and max_mb"),
            ("usd_per_gb_s", platform.usd_per_gb_s >= 0, "at least 0"),
            ("usd_per_vcpu_s", platform.usd_per_vcpu_s >= 0, "at least 0"),
            ("cpu_grid", all(c > 0 for c in platform.cpu_grid), "shares above 0, vCPUs"),
            ("usd_per_request", platform.usd_per_request >= 0, "at least 0"),
            (
                "links",
                bool(platform.links)
                and all(isinstance(x, Link) and x.name in names() for x in platform.links),
                f"a non-empty tuple of mopar.facts.Link, each named one of {list(names())}",
            ),
            (
                "vcpus",
                platform.mb_per_vcpu > 0 or platform.vcpus > 0,
                "above 0 when mb_per_vcpu is 0",
            ),
        )
        if not ok
    ]
    if problems:
        raise OptionError(
            f"platform={platform.target!r} cannot be planned for: "
            f"{'; '.join(problems)}; fix the Platform you pass"
        )
    return platform


def _link(name: str, measured: dict[str, Any]) -> Link:
    entry = measured["transports"][name]
    return Link(name=name, latency_ms=float(entry["latency_ms"]), mb_per_s=float(entry["mb_per_s"]))


def _predictors(profiles_dir: Path, time_factor: float) -> Any:
    """The predictors in ``profiles_dir`` (the shipped ones when that folder has none), their
    times multiplied by the target's ``time_factor``."""
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors

    folder = profiles_dir
    if not (folder / "predictors.json").is_file():
        log.info("no predictors in %s; using the shipped ones", folder)
        folder = PROFILES_DIR
    return replace(load_predictors(folder, feature_names=FEATURE_NAMES), time_factor=time_factor)
