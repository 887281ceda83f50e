"""What a local run served, request by request: each function's part, for the bill.

`Served` is one measured request: when it arrived, its latency, and each invocation it made
(`mopar.runtime.chains.Span`: the function, its own ms, the ms it waited for the rest of the
chain, and its INIT ms when the invocation found its instance cold). `mopar.bill` turns these
into money: own time is always billed, the wait where the chain mode makes a caller wait
(`RunReport.chain` names the mode that was emulated), INIT where the platform bills it.

Both runners fill it in: the shm runner from its workers' replies (a function's own time is its
worker's; a caller's wait is emulated from the chain mode: in ``invoke`` and ``http`` a function
on the path waits from its own answer to the request's, and its instance stays busy meanwhile),
the chain of function servers and Lambda handlers from the spans each function measured and
handed on with the answer (``X-Mopar-Invocations``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mopar.runtime.chains import Span

__all__ = ["Served", "Span"]


@dataclass(frozen=True, kw_only=True)
class Served:
    """One measured request.

    Attributes:
        arrival_s: when it arrived, s since the measured window began.
        latency_ms: from its arrival to its answer, ms (None: it failed).
        invocations: each function invocation it made, in the order they ran (a failed
            request: those the runner heard of).
        answered_ms: when each of ``invocations`` answered, ms after the arrival, as the runner
            saw it (the shm runner; empty where functions hand their spans on themselves).
    """

    arrival_s: float
    latency_ms: float | None
    invocations: tuple[Span, ...] = ()
    answered_ms: tuple[float, ...] = ()

    @property
    def cold_starts(self) -> int:
        """Invocations that found their instance cold (and waited for its INIT)."""
        return sum(1 for s in self.invocations if s.init_ms > 0)
