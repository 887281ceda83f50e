"""The bill: what a platform charges for the requests a plan serves, in its chain mode.

The one owner of billing rules. The planner prices plans with it (`mopar.planner.cost`), the
simulator (`mopar.sim`) and ``mopar run --rate`` bill what they served with it. Prices and
limits are facts (`mopar.facts.Platform`, from ``profiles/platforms.json``); this module only
applies them.

Read in this order: `CHAINS` (the chain modes, and whether a caller waits), `Invocation` (one
function's part in one request), `invocation_usd` (its bill), `request_usd` (a request's bill:
its invocations plus what the chain mode itself charges).

A chain mode is how a request travels from function to function:

- ``invoke`` (Lambda): each function invokes the next with ``RequestResponse`` and waits for its
  answer inside its own invocation, so it is billed for the rest of the chain too;
- ``stepfunctions`` (Lambda): a Step Functions Express workflow, run synchronously, calls each
  function in turn; no function waits, the workflow bills its own request and duration;
- ``event`` (Lambda): each function hands on with an ``Event`` invoke and returns; the last
  delivers the answer to a rendezvous the entry or the client reads;
- ``http`` (OpenFaaS): each function POSTs to the next and waits, holding its memory and one of
  its replica's in-flight slots;
- ``callback`` (OpenFaaS): ``/async-function`` with ``X-Callback-Url``: each function returns
  once the next call is queued;
- ``shm`` (OpenFaaS): co-located functions hand over through ``/dev/shm``, none waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mopar.facts import Platform

__all__ = [
    "CHAINS",
    "Chain",
    "Invocation",
    "Replica",
    "bills_replicas",
    "default_chain",
    "invocation_usd",
    "replica_usd",
    "request_usd",
    "served_usd",
]


@dataclass(frozen=True, kw_only=True)
class Chain:
    """A chain mode: its name, its target, and whether a caller is billed while it waits."""

    name: str
    target: str
    caller_waits: bool


CHAINS = {
    c.name: c
    for c in (
        Chain(name="invoke", target="lambda", caller_waits=True),
        Chain(name="stepfunctions", target="lambda", caller_waits=False),
        Chain(name="event", target="lambda", caller_waits=False),
        Chain(name="http", target="openfaas", caller_waits=True),
        Chain(name="callback", target="openfaas", caller_waits=False),
        Chain(name="shm", target="openfaas", caller_waits=False),
    )
}


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
    """

    function: str
    memory_mb: float
    own_ms: float
    wait_ms: float = 0.0
    init_ms: float = 0.0


def invocation_usd(platform: Platform, chain: str, inv: Invocation) -> float:
    """The bill of one invocation: its billed duration (its own time, its waits where ``chain``
    makes a caller wait, rounded as ``platform`` rounds) and INIT where billed, x its memory,
    plus the request fee."""
    waits = CHAINS[chain].caller_waits
    ms = platform.billed_ms(inv.own_ms + (inv.wait_ms if waits else 0.0))
    if platform.bills_init:
        ms += inv.init_ms
    return inv.memory_mb / 1024.0 * ms / 1e3 * platform.usd_per_gb_s + platform.usd_per_request


def request_usd(platform: Platform, chain: str, invocations: Sequence[Invocation]) -> float:
    """The bill of one request: its invocations, plus the chain mode's own charges."""
    return sum(invocation_usd(platform, chain, inv) for inv in invocations)


# --- what a platform served over a span of time ---------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One instance of a function over a span of traffic: the memory it reserved and for how
    long it existed within the span, busy or idle, s."""

    function: str
    memory_mb: float
    seconds: float


def bills_replicas(platform: Platform) -> bool:
    """Whether ``platform`` bills the memory its replicas reserve while they exist (OpenFaaS on
    one's own nodes: a node is paid for whether its replicas are busy or not) rather than each
    invocation's duration (Lambda).

    A smallest version for the simulator and ``mopar run``: a platform whose CPU does not
    follow memory and which charges no request fee is a cluster of reserved nodes. To be
    replaced by a platform fact.
    """
    return platform.mb_per_vcpu <= 0 and platform.usd_per_request == 0


def replica_usd(platform: Platform, replica: Replica) -> float:
    """The bill of one replica's reservation: its memory x its lifetime x the GB-s price."""
    return replica.memory_mb / 1024.0 * replica.seconds * platform.usd_per_gb_s


def served_usd(
    platform: Platform,
    chain: str,
    invocations: Sequence[Invocation],
    replicas: Sequence[Replica],
) -> float:
    """The bill of what ``platform`` served over a span: where it bills invocations, each
    invocation's bill (`invocation_usd`: waits, INIT, rounding, request fee); where it bills
    replicas (`bills_replicas`), the replicas' reservations plus each invocation's request fee.
    """
    if bills_replicas(platform):
        fees = len(invocations) * platform.usd_per_request
        return sum(replica_usd(platform, r) for r in replicas) + fees
    return sum(invocation_usd(platform, chain, inv) for inv in invocations)


def default_chain(platform: Platform) -> str:
    """The chain mode a plan with none (``Plan.chain == ""``) runs in on ``platform``: the first
    of `CHAINS` for its target (``invoke`` on Lambda, ``http`` on OpenFaaS); for a target with
    none of its own, the synchronous one of the platforms it bills like."""
    own = next((c.name for c in CHAINS.values() if c.target == platform.target), None)
    return own or ("http" if bills_replicas(platform) else "invoke")
