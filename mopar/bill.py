"""The bill: what a platform charges for the requests a plan serves, in its chain mode.

The one owner of billing rules. The planner prices plans with it (`mopar.planner.cost`), the
simulator (`mopar.sim`) and ``mopar load --rate`` bill what they served with it. Prices and
limits are facts (`mopar.facts.Platform`, from ``profiles/platforms.json``, and its
`mopar.facts.ChainFacts` per mode); this module only applies them.

Read in this order: `CHAINS` (the chain modes, and whether a caller waits), `Invocation` (one
function's part in one request), `invocation_usd` (its bill), `chain_usd` (what the chain mode
itself charges a request, beside its invocations), `fixed_usd_per_s` and
`reserved_usd_per_s` (what is billed by the hour, busy or idle), then `bill_plan`: a plan's
expected bill per request under the platform's traffic, the analytic model the planner
chooses with.

A chain mode is how a request travels from function to function:

- ``invoke`` (Lambda): each function invokes the next with ``RequestResponse`` and waits for its
  answer inside its own invocation, so it is billed for the rest of the chain too;
- ``stepfunctions`` (Lambda): a Step Functions Express workflow, run synchronously, calls each
  function in turn; no function waits, the workflow bills its own request and duration;
- ``event`` (Lambda): each function hands on with an ``Event`` invoke and returns; the last
  delivers the answer to a rendezvous (a store) the client reads;
- ``http`` (OpenFaaS): each function POSTs to the next and waits, holding its memory and one of
  its replica's in-flight slots;
- ``callback`` (OpenFaaS): ``/async-function`` with ``X-Callback-Url``: each function returns
  once the next call is queued;
- ``shm`` (OpenFaaS): co-located functions hand over through ``/dev/shm``, none waits.

``""`` is a platform's plain mode where it lists none (a `Platform` built in code): no waits
billed, no charges of its own.

Where replicas reserve their memory and CPU (OpenFaaS), a function is billed for the memory and
CPU its replicas hold while they exist: at least ``min_replicas`` however idle, and enough for the
requests in flight (a waiting caller in the ``http`` chain holds its slot). `invocation_usd`
there is one invocation's busy share of it (the paper's MC x the price, and its vCPU-seconds x
theirs), which is the whole bill
only when every replica is always busy; `bill_plan` adds the idle rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mopar.facts import Platform
from mopar.plan import RESPONSE, Plan
from mopar.plan.notes import GenerationCost
from mopar.runtime.chains import MODES

__all__ = [
    "BILL_PARTS",
    "MONTH_S",
    "CHAINS",
    "ColdRequest",
    "FunctionBill",
    "Invocation",
    "PlanBill",
    "Replica",
    "bill_plan",
    "bill_generation",
    "caller_waits",
    "chain_on",
    "chain_usd",
    "cold_request",
    "default_chain",
    "fixed_usd_per_s",
    "invocation_usd",
    "per_month",
    "prewarms",
    "replica_usd",
    "replicas_for",
    "reserved_usd_per_s",
    "served_usd",
]


MONTH_S = 30 * 86400
"""A month of traffic, seconds: 30 days, as AWS's pricing examples count one."""


def per_month(usd_per_request: float, rate_rps: float) -> float:
    """A bill per request as dollars a month at ``rate_rps`` requests per second."""
    return usd_per_request * rate_rps * MONTH_S


CHAINS = MODES
"""The chain modes, by name: the runtime's own (`mopar.runtime.chains.MODES`: the door that
runs each, and whether a caller waits, billed, for the rest of the chain). Which a target offers
is its own (`mopar.target.Target.chain_modes`); what each charges there is its facts'
(`mopar.facts.ChainFacts`)."""


def caller_waits(chain: str) -> bool:
    """Whether a function in ``chain`` waits, billed, for the functions after it (``""``: no)."""
    return CHAINS[chain].caller_waits if chain else False


def default_chain(platform: Platform) -> str:
    """The chain mode a plan recorded as ``""`` (made before chain modes) runs in on
    ``platform``: its first listed mode, or ``""`` where it lists none."""
    return platform.chains[0].name if platform.chains else ""


def chain_on(platform: Platform, chain: str) -> str:
    """``chain`` (a plan's mode) where ``platform`` offers it, else the platform's default: a
    bundle planned for one target, billed or simulated on another."""
    offered = {c.name for c in platform.chains}
    return chain if chain in offered else default_chain(platform)


@dataclass(frozen=True, kw_only=True)
class Invocation:
    """One function's part in one request.

    Attributes:
        function: the function's name.
        memory_mb: its memory.
        own_ms: its own time: from its input arriving to its output handed on.
        wait_ms: time it spent waiting for the functions after it (billed only where the chain
            mode makes a caller wait).
        init_ms: the INIT time of a cold start (0 when warm; billed where the platform bills it).
            An expected share of one (cold share x INIT) is priced the same way.
        ephemeral_mb: its ``/tmp`` size, MB (0: the free size); what exceeds the platform's
            free size is billed per GB-s like memory.
        vcpus: the CPU it requested, where CPU is billed apart from memory (OpenFaaS).
    """

    function: str
    memory_mb: float
    vcpus: float = 0.0
    own_ms: float
    wait_ms: float = 0.0
    init_ms: float = 0.0
    ephemeral_mb: float = 0.0


def invocation_usd(platform: Platform, chain: str, inv: Invocation) -> float:
    """The bill of one invocation: its billed duration (its own time, its waits where ``chain``
    makes a caller wait, INIT where billed, rounded up as ``platform`` rounds) x its memory (at
    least the platform's smallest) and its CPU where that is billed, its ephemeral storage
    above the free size, plus the request fee."""
    ms = inv.own_ms + (inv.wait_ms if caller_waits(chain) else 0.0)
    if platform.bills_init:
        ms += inv.init_ms
    seconds = platform.billed_ms(ms) / 1e3
    held = platform.usd_per_s(max(inv.memory_mb, platform.min_mb), inv.vcpus)
    extra_gb = max(inv.ephemeral_mb - platform.free_ephemeral_mb, 0.0) / 1024.0
    return (
        held * seconds
        + extra_gb * seconds * platform.ephemeral_usd_per_gb_s
        + platform.usd_per_request
    )


def chain_usd(
    platform: Platform, chain: str, *, latency_ms: float, answer_bytes: float = 0.0
) -> float:
    """What ``chain`` itself charges for one request, beside its functions' invocations: the
    orchestrator's request fee and its duration (the request's ``latency_ms`` rounded up to the
    mode's billing step, x its memory chunk: Step Functions Express), and the rendezvous's
    operations (an answer of ``answer_bytes`` written once and read once, at least a KB each).
    What a mode costs by the hour is `fixed_usd_per_s`'s."""
    c = platform.chain(chain)
    usd = c.usd_per_request
    if c.usd_per_gb_s:
        step = c.billing_ms or 1.0
        ms = math.ceil(latency_ms / step - 1e-9) * step
        usd += c.memory_mb / 1024.0 * ms / 1e3 * c.usd_per_gb_s
    if c.store:
        usd += 2 * max(math.ceil(answer_bytes / 1024), 1) * c.store_usd_per_kb
    return usd


def fixed_usd_per_s(platform: Platform, chain: str) -> float:
    """What ``chain`` costs per second however idle: its rendezvous store's hourly minimum."""
    return platform.chain(chain).store_usd_per_hour / 3600.0


def reserved_usd_per_s(
    platform: Platform, memory_mb: float, replicas: float, vcpus: float = 0.0
) -> float:
    """What ``replicas`` instances of ``memory_mb`` and ``vcpus`` cost per second where replicas
    reserve their memory and CPU while they exist (OpenFaaS), busy or idle."""
    return platform.usd_per_s(max(memory_mb, platform.min_mb), vcpus) * replicas


# --- what a platform served over a span of time ---------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One instance of a function over a span of traffic: the memory and CPU it reserved and
    for how long it existed within the span, busy or idle, s."""

    function: str
    memory_mb: float
    seconds: float
    vcpus: float = 0.0


def replica_usd(platform: Platform, replica: Replica) -> float:
    """The bill of one replica's reservation (`reserved_usd_per_s` x its lifetime)."""
    return reserved_usd_per_s(platform, replica.memory_mb, 1.0, replica.vcpus) * replica.seconds


def served_usd(
    platform: Platform, chain: str, invocations: Sequence[Invocation], replicas: Sequence[Replica]
) -> float:
    """The bill of what ``platform`` served over a span: where it bills invocations, each
    invocation's bill (`invocation_usd`: waits, INIT, rounding, request fee); where replicas
    reserve their memory (``platform.reserved``), the replicas' reservations plus each
    invocation's request fee."""
    if platform.reserved:
        fees = len(invocations) * platform.usd_per_request
        return sum(replica_usd(platform, r) for r in replicas) + fees
    return sum(invocation_usd(platform, chain, inv) for inv in invocations)


def replicas_for(platform: Platform, in_flight: float) -> float:
    """The replicas a function holds with ``in_flight`` requests being served on average, where
    replicas are reserved: at least ``min_replicas``.

    Where the platform's autoscaler sets them from the load (``scale_every_s``), the load it sees
    counts the requests queued for a slot too: the fewest whole replicas ``c`` that keep
    ``target_load`` in flight on each with that queue, ``c >= (in_flight + Lq(c)) /
    target_load``, ``Lq`` the mean queue of Poisson arrivals at ``c x max_inflight`` slots
    (Erlang C). Else the load over each replica's ``max_inflight`` (the mean of a pool that
    starts an instance whenever every one is full)."""
    least = float(platform.min_replicas)
    slots = max(platform.max_inflight, 1)
    if platform.scale_every_s <= 0:
        return max(least, in_flight / slots)
    c = max(int(least), math.ceil(in_flight / platform.target_load - 1e-9), 1)
    while c < 100_000 and c * platform.target_load < in_flight + _queued(c * slots, in_flight):
        c += 1
    return float(c)


def _queued(servers: int, load: float) -> float:
    """The mean number of requests waiting for one of ``servers`` slots under a Poisson ``load``
    (Erlang: mean requests in service), M/M/c; infinite at or past saturation."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return math.inf
    term = total = 1.0  # load**k / k!, summed for k < servers
    for k in range(1, servers):
        term *= load / k
        total += term
    top = term * load / (servers - load)  # load**c / c! x c / (c - load)
    return top / (total + top) * load / (servers - load)


# --- a plan under traffic -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FunctionBill:
    """One function's part of a plan's bill, per request on average.

    Attributes:
        name: the function.
        probability: the share of requests that invoke it.
        wait_ms: how long it waits for the functions after it, ms (billed where the mode waits).
        cold_share: the share of its invocations that start cold.
        instances: instances it holds on average (where replicas are reserved: at least
            ``min_replicas``).
        usd: what it costs per request, USD (x ``probability`` already).
    """

    name: str
    probability: float
    wait_ms: float
    cold_share: float
    instances: float
    usd: float


BILL_PARTS: tuple[tuple[str, str], ...] = (
    ("compute_usd", "the functions' own time"),
    ("waits_usd", "callers' waits"),
    ("init_usd", "INIT of cold starts"),
    ("fees_usd", "request fees"),
    ("orchestration_usd", "the chain mode's charges"),
    ("idle_usd", "idle replicas (CPU and memory) and stores"),
)
"""A `PlanBill`'s parts (its fields) and what each is, in the order the bill lists them."""


@dataclass(frozen=True, kw_only=True)
class PlanBill:
    """A plan's expected bill per request, in one chain mode, under the platform's traffic.

    Attributes:
        chain: the chain mode.
        traffic: the traffic, in words.
        latency_ms: a warm request's latency: the path's functions, a hop before each but the
            first (the mode's own latency included), and the mode's entry latency.
        usd: the whole bill per request, USD: the sum of the parts below.
        compute_usd: the functions' own time x memory.
        waits_usd: the time callers are billed for waiting (``invoke``, ``http``).
        init_usd: the INIT of cold starts, where billed.
        fees_usd: the platform's request fees, one per invocation.
        orchestration_usd: what the mode charges per request (Step Functions, rendezvous).
        idle_usd: what is billed by the hour, spread over the requests: idle reserved replicas,
            the rendezvous store's minimum.
        functions: each function's part.
    """

    chain: str
    traffic: str
    latency_ms: float
    usd: float
    compute_usd: float
    waits_usd: float
    init_usd: float
    fees_usd: float
    orchestration_usd: float
    idle_usd: float
    functions: tuple[FunctionBill, ...]

    def to_dict(self) -> dict[str, object]:
        """Per 1M requests, with each part (``--json``)."""
        return {
            "chain": self.chain,
            "traffic": self.traffic,
            "latency_ms": round(self.latency_ms, 3),
            "cost_per_1m_usd": float(f"{self.usd * 1e6:.6g}"),
            "includes_per_1m_usd": {
                key: float(f"{getattr(self, key) * 1e6:.6g}") for key, _ in BILL_PARTS
            },
        }

    def includes(self) -> str:
        """What the figure includes, in words, the parts that are not zero."""
        parts = [(getattr(self, key), what) for key, what in BILL_PARTS]
        shown = [f"{what} {usd / self.usd:.0%}" for usd, what in parts if usd > 0 and self.usd]
        return ", ".join(shown) or "nothing billed"


@dataclass(frozen=True, kw_only=True)
class ColdRequest:
    """A request that finds every function of a plan cold (`cold_request`).

    Attributes:
        delays_ms: how long each function's invocation waits for an INIT before it runs, ms.
        extra_ms: what those waits add to the request's latency, ms.
        warmed: the functions the entry warms up: those of `Plan.warmed_with_entry` whose INIT
            ends before the request reaches them. Another would still be busy with its warm-up
            then, so the platform would start a second instance for the request anyway, and
            the warm-up's INIT would buy nothing.
    """

    delays_ms: dict[str, float]
    extra_ms: float
    warmed: tuple[str, ...] = ()

    def after(self, plan: Plan) -> dict[str, float]:
        """For each function on ``plan``'s path, the INIT waits the request meets from its own
        callees on to the end of the path, ms: what it waits for, cold, where callers wait."""
        out, rest = {}, 0.0
        for f in reversed(plan.path()):
            rest += max([self.delays_ms[c.name] for c in plan.callees(f.name)] or [0.0])
            out[f.name] = rest
            rest += self.delays_ms[f.name]
        return out


def _warm_ups_usd(plan: Plan, platform: Platform, cold: ColdRequest) -> float:
    """What a cold entry's warm-ups cost: one invocation of the shortest billed duration for
    each function it warms up (their INITs are billed as theirs)."""
    usd = 0.0
    for w in plan.functions:
        if w.name in cold.warmed:
            inv = Invocation(function=w.name, memory_mb=w.memory_mb, vcpus=w.vcpus, own_ms=1.0)
            usd += invocation_usd(platform, "", inv)
    return usd


def prewarms(plan: Plan, platform: Platform) -> tuple[str, ...]:
    """The functions ``plan``'s entry warms up at a cold start on ``platform``
    (`ColdRequest.warmed`); none where replicas are kept (OpenFaaS)."""
    return cold_request(plan, platform, prewarm=not platform.reserved).warmed


def cold_request(
    plan: Plan, platform: Platform, chain: str | None = None, *, prewarm: bool = True
) -> ColdRequest:
    """A request that finds every function of ``plan`` cold, in ``chain`` (None: its own).

    With ``prewarm`` (the Lambda handler's entry, `mopar.runtime.aws`) the entry warms up
    `Plan.warmed_with_entry` as its INIT begins, and each starts its INIT a hop later. A request
    that reaches one whose INIT has ended finds it warm; one that reaches it sooner would find
    it busy with its warm-up and wait for a new instance's whole INIT, so the entry warms up
    only the others (``warmed``). Without, each function starts when the request reaches it,
    and the request waits for every INIT in turn.
    """
    mode = platform.chain(chain_on(platform, plan.chain if chain is None else chain))
    hop = platform.hop_ms + mode.hop_ms
    init = {f.name: platform.init_ms(f.param_bytes) for f in plan.functions}
    warmed = {f.name for f in plan.warmed_with_entry()} if prewarm else set()
    delays: dict[str, float] = {}
    ready: list[str] = []

    def wait(name: str, arrive_ms: float) -> float:
        if name in warmed and hop + init[name] <= arrive_ms:
            ready.append(name)
            return 0.0
        return init[name]

    t = extra = 0.0
    for k, f in enumerate(plan.path()):
        arrive = t + (hop if k else 0.0)
        delays[f.name] = wait(f.name, arrive)
        start = arrive + delays[f.name]
        late = 0.0
        for c in plan.callees(f.name):
            delays[c.name] = wait(c.name, start + hop)
            late = max(late, delays[c.name])
        extra += delays[f.name] + late
        t = start + f.time_ms + late
    return ColdRequest(delays_ms=delays, extra_ms=extra, warmed=tuple(ready))


def bill_plan(plan: Plan, platform: Platform, chain: str | None = None) -> PlanBill:
    """``plan``'s expected bill per request in ``chain`` (None: ``plan.chain``) on ``platform``,
    under ``platform.traffic``.

    Each function is billed as `invocation_usd` bills it, weighted by the share of requests
    that invoke it: its own time; in a mode where callers wait, the rest of the path after it
    (hops included); its cold share of an INIT (`mopar.traffic.Traffic.cold_share` with the
    platform's keep-alive; none where replicas are kept), and, where it waits, that share of the
    INITs a cold request waits for after it (`cold_request`: pre-warmed where billed per
    invocation, as the Lambda handler's entry warms up the rest); its request fee. The entry's
    cold share pays for its warm-ups: each a request fee and a shortest billed invocation. Where replicas are
    reserved, a function holds the replicas its load calls for (`replicas_for`, with
    ``rate x p x (own + wait)`` in flight), their memory spread over the requests. The mode
    adds `chain_usd` per request and `fixed_usd_per_s` spread over the requests.
    """
    chain = plan.chain if chain is None else chain
    mode = platform.chain(chain)
    traffic = platform.traffic
    rate = traffic.rate_rps
    waits = caller_waits(mode.name)
    path = plan.path()
    hop = platform.hop_ms + mode.hop_ms
    after: dict[str, float] = {}
    elapsed = 0.0
    for k in reversed(range(len(path))):
        after[path[k].name] = elapsed
        elapsed += path[k].time_ms + (hop if k > 0 else 0.0)
    latency = elapsed + mode.entry_ms
    parts = dict.fromkeys(("compute", "waits", "init", "fees", "idle"), 0.0)
    functions = []

    def cold_of(p: float) -> float:
        return traffic.cold_share(platform.keep_alive_s, p) if platform.min_replicas == 0 else 0.0

    cold_req = cold_request(plan, platform, chain, prewarm=not platform.reserved)
    cold_after = cold_req.after(plan)
    entry_cold = cold_of(1.0)
    for f in plan.functions:
        p = plan.invocation_probability(f.name)
        wait = after.get(f.name, 0.0)
        cold = cold_of(p)
        inv = Invocation(
            function=f.name,
            memory_mb=f.memory_mb,
            vcpus=f.vcpus,
            own_ms=f.time_ms,
            wait_ms=wait + cold * cold_after.get(f.name, 0.0),
            init_ms=cold * platform.init_ms(f.param_bytes),
        )
        bare = invocation_usd(platform, "", replace(inv, wait_ms=0.0, init_ms=0.0))
        waited = invocation_usd(platform, mode.name, replace(inv, init_ms=0.0))
        billed = invocation_usd(platform, mode.name, inv)
        fee = platform.usd_per_request
        busy_s = (f.time_ms + (inv.wait_ms if waits else 0.0)) / 1e3
        instances = rate * p * busy_s / max(platform.max_inflight, 1)  # Lambda: its mean
        share = {
            "compute": p * (bare - fee),
            "waits": p * (waited - bare),
            "init": p * (billed - waited),
            "fees": p * fee,
            "idle": 0.0,
        }
        if f is path[0] and not platform.reserved:
            share["init"] += entry_cold * _warm_ups_usd(plan, platform, cold_req)
        if platform.reserved:
            instances = replicas_for(platform, rate * p * busy_s)
            held = reserved_usd_per_s(platform, f.memory_mb, instances, f.vcpus) / rate
            share["idle"] = max(held - share["compute"] - share["waits"] - share["init"], 0.0)
        for key, usd in share.items():
            parts[key] += usd
        functions.append(
            FunctionBill(
                name=f.name,
                probability=p,
                wait_ms=inv.wait_ms if waits else 0.0,
                cold_share=cold,
                instances=instances,
                usd=sum(share.values()),
            )
        )
    answer = sum(e.bytes for e in plan.edges if e.dst == RESPONSE)
    orchestration = chain_usd(
        platform,
        mode.name,
        latency_ms=latency + entry_cold * cold_req.extra_ms,
        answer_bytes=answer,
    )
    parts["idle"] += fixed_usd_per_s(platform, mode.name) / rate
    return PlanBill(
        chain=mode.name,
        traffic=traffic.describe(),
        latency_ms=latency,
        usd=sum(parts.values()) + orchestration,
        compute_usd=parts["compute"],
        waits_usd=parts["waits"],
        init_usd=parts["init"],
        fees_usd=parts["fees"],
        orchestration_usd=orchestration,
        idle_usd=parts["idle"],
        functions=tuple(functions),
    )


def bill_generation(
    plan: Plan,
    platform: Platform,
    main: str,
    *,
    generation_ms: float,
    prompt_tokens: int,
    new_tokens: int,
    timed: str,
) -> GenerationCost:
    """One generation's bill on ``plan`` as deployed (`mopar.emit.functions.deployed`: its main
    function ``main`` runs the decoding loop and its units): ``main`` invoked once and busy for
    ``generation_ms`` (one request fee, one INIT where cold), and each function it calls (the
    expert functions) invoked at every one of the ``new_tokens`` steps, at its step's bill."""
    step = bill_plan(plan, platform)
    busy = tuple(replace(f, time_ms=generation_ms) if f.name == main else f for f in plan.functions)
    once = bill_plan(replace(plan, functions=busy), platform)
    callees = sum(b.usd for b in step.functions if b.name != main)
    return GenerationCost(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        generation_ms=generation_ms,
        usd=once.usd + (new_tokens - 1) * callees,
        timed=timed,
    )
