"""The chain modes, as a function runs them: how it hands a request on, and who waits. torch-free.

Read in this order: `ChainMode` (what each mode says about itself), the doors (`SERVER`,
`HANDLER`), `MODES`, then `mode_for`, which a function calls once with its ``MOPAR_CHAIN`` and its
door, and `Spans` (what each function records of its own invocation, carried with the answer).

A door is the code that serves a function: `SERVER` is the function server
(`mopar.runtime.server`), `HANDLER` the Lambda handler (`mopar.runtime.aws`). Both ship in every
bundle's copy of the runtime, so the modes a door carries out are listed here, by the door that
runs them; a door runs only its own modes. Which of them a target offers, its default first, is
the target's (`mopar.target.Target.chain_modes`: ``mopar/targets/<target>/chains.py``), and
what each costs there is its facts' (``platforms.json`` ``chains``, `mopar.bill`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "ChainMode",
    "HANDLER",
    "MODES",
    "SERVER",
    "counterpart",
    "REQUEST_ID_RE",
    "Span",
    "SpanClock",
    "default_mode",
    "format_spans",
    "mode_for",
    "modes_of",
    "parse_spans",
]

SERVER = "server"
"""The function server's door (`mopar.runtime.server`): a WSGI app, frames in HTTP bodies."""
HANDLER = "lambda-handler"
"""The Lambda handler's door (`mopar.runtime.aws`): JSON events, frames base64-encoded."""

_DOOR_NAMES = {SERVER: "the function server", HANDLER: "the Lambda handler"}


@dataclass(frozen=True, kw_only=True)
class ChainMode:
    """A chain mode as the functions carry it out.

    Attributes:
        name: ``MOPAR_CHAIN``'s value, ``Plan.chain``'s, and its key in `mopar.bill.CHAINS`.
        door: the door that runs it: `SERVER` or `HANDLER`.
        caller_waits: a function waits, inside its own invocation, for the rest of the chain.
        hands_on: a function invokes the next one itself (False: an orchestrator calls each in
            turn and passes the answers on: Step Functions; or the co-located pipeline, where
            the next one is handed a file).
        rendezvous: where the answer comes back, when not back up the chain: ``redis`` (a Redis
            list per request, `mopar.runtime.rendezvous.RedisRendezvous`) or ``callback`` (a
            POST to the request's callback URL); the client reads it there, or the entry does
            for a client that waits. Empty: back up the chain.
    """

    name: str
    door: str
    caller_waits: bool
    hands_on: bool
    rendezvous: str = ""


MODES: dict[str, ChainMode] = {
    m.name: m
    for m in (
        ChainMode(name="invoke", door=HANDLER, caller_waits=True, hands_on=True, rendezvous=""),
        ChainMode(
            name="stepfunctions", door=HANDLER, caller_waits=False, hands_on=False, rendezvous=""
        ),
        ChainMode(
            name="event", door=HANDLER, caller_waits=False, hands_on=True, rendezvous="redis"
        ),
        ChainMode(name="http", door=SERVER, caller_waits=True, hands_on=True, rendezvous=""),
        ChainMode(
            name="callback", door=SERVER, caller_waits=False, hands_on=True, rendezvous="callback"
        ),
        ChainMode(name="shm", door=SERVER, caller_waits=False, hands_on=True, rendezvous=""),
    )
}
"""Every chain mode a door carries out; the first of each door is its default (a function
given no ``MOPAR_CHAIN``)."""

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A request id, as a client may choose it: it names the request's rendezvous key or callback."""


def modes_of(door: str) -> tuple[ChainMode, ...]:
    """The modes ``door`` runs, its default first."""
    return tuple(m for m in MODES.values() if m.door == door)


def default_mode(door: str) -> ChainMode:
    """The mode of a function that is given none, served by ``door``."""
    return modes_of(door)[0]


def mode_for(name: str, door: str) -> ChainMode:
    """The mode ``name`` (empty: the default) as ``door`` runs it.

    Raises:
        ValueError: one line: an unknown mode, or one of another door, and the modes it runs.
    """
    if not name:
        return default_mode(door)
    mode = MODES.get(name)
    offered = [m.name for m in modes_of(door)]
    if mode is None or mode.door != door:
        what = (
            "is not a chain mode"
            if mode is None
            else f"is a chain mode of {_DOOR_NAMES.get(mode.door, mode.door)}"
        )
        raise ValueError(
            f"MOPAR_CHAIN={name} {what}; {_DOOR_NAMES.get(door, door)} runs one of {offered}: "
            f"set MOPAR_CHAIN to one of them or recompile for the target that offers {name}"
        )
    return mode


def counterpart(mode: ChainMode, offered: Sequence[ChainMode]) -> ChainMode:
    """``mode`` where ``offered`` (a target's modes, its default first) holds it, else the one
    of them that hands a request on as ``mode`` does (one with a rendezvous for one with a
    rendezvous, a waiting caller for a waiting caller), else the default."""
    if mode in offered:
        return mode
    alike = [
        m
        for m in offered
        if (bool(m.rendezvous), m.caller_waits, m.hands_on)
        == (bool(mode.rendezvous), mode.caller_waits, mode.hands_on)
    ]
    return alike[0] if alike else offered[0]


@dataclass(frozen=True, kw_only=True)
class Span:
    """One function's part in one request, as it measured it.

    Attributes:
        function: its name.
        own_ms: its invocation's own time: from the request reaching it to its answer or its
            hand-off, less ``wait_ms``; a synchronous call of the functions it calls (a join's
            parts, a dispatch's experts) is in it: every chain mode bills that wait.
        wait_ms: time it waited for the rest of the chain (the next function's answer, or, for
            an entry that offers a synchronous facade, the rendezvous).
        init_ms: its instance's start (INIT) when this was the instance's first request, else 0.
    """

    function: str
    own_ms: float
    wait_ms: float = 0.0
    init_ms: float = 0.0

    def text(self) -> str:
        return f"{self.function}={self.own_ms:.3f}/{self.wait_ms:.3f}/{self.init_ms:.1f}"


class SpanClock:
    """One invocation's own time as it goes, for its `Span`: it starts at creation; `waiting`
    counts a call's time as the wait for the rest of the chain; ``before`` holds the spans of
    the functions before it and ``called`` those of the functions it called."""

    def __init__(self, function: str, *, init_ms: float, before: str = "") -> None:
        self.function = function
        self.start = time.perf_counter()
        self.init_ms = init_ms
        self.wait_ms = 0.0
        self.before = before
        self.called: list[str] = []

    def waiting(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, counting its time as this invocation's wait for the rest of the chain."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.wait_ms += (time.perf_counter() - t0) * 1e3

    def spans(self) -> str:
        """The spans so far: those of the functions before it, those it called, then its own,
        measured now."""
        own = (time.perf_counter() - self.start) * 1e3 - self.wait_ms
        span = Span(
            function=self.function,
            own_ms=round(own, 3),
            wait_ms=round(self.wait_ms, 3),
            init_ms=round(self.init_ms, 1),
        )
        return ",".join(x for x in (self.before, *self.called, span.text()) if x)

    def waited_in(self, spans: str) -> str:
        """``spans`` (the rest of the chain's, as a rendezvous brought them back) with this
        invocation's own span told its wait for them."""
        return format_spans(
            [
                replace(s, wait_ms=round(self.wait_ms, 3)) if s.function == self.function else s
                for s in parse_spans(spans)
            ]
        )


def format_spans(spans: list[Span] | tuple[Span, ...]) -> str:
    """``X-Mopar-Invocations``'s value (and a Lambda answer's ``invocations``):
    ``s0=own/wait/init,s1=...``, ms, in the order the functions ran."""
    return ",".join(s.text() for s in spans)


def parse_spans(text: str) -> list[Span]:
    """The spans `format_spans` wrote; items that are not spans are skipped."""
    out = []
    for item in (text or "").split(","):
        name, _, value = item.strip().partition("=")
        parts = value.split("/")
        if not name or len(parts) != 3:
            continue
        try:
            own, wait, init = (float(p) for p in parts)
        except ValueError:
            continue
        out.append(Span(function=name, own_ms=own, wait_ms=wait, init_ms=init))
    return out
