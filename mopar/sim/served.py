"""The bill of what ``mopar run`` served, by the simulator's rules (`mopar.bill`).

From the run's own records (`mopar.runner.report.Served`): each answered request's invocations (each
function's own time, the time it waited for the rest of the chain in the mode the run emulated,
and the start of an instance it was the first to use), and each function's instance-seconds.
Where the chain mode makes a caller wait (``invoke``, ``http``), the wait is billed. Failed
requests are not billed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mopar.bill import CHAINS, Invocation
from mopar.bundle.document import BundleDocument
from mopar.facts import Platform
from mopar.plan import Plan
from mopar.runner.report import RunReport, SliceStats
from mopar.sim.result import bill_usd, per_1m

__all__ = ["RunBill", "bill_run"]


@dataclass(frozen=True, kw_only=True)
class RunBill:
    """A run's bill on one platform.

    Attributes:
        target, chain: the platform and chain mode it is billed for.
        requests: the answered requests billed.
        usd: the whole bill, USD.
        cost_per_1m_usd: per million answered requests (None: none answered).
        functions: each function's share of ``cost_per_1m_usd``, by name.
        includes: what the bill counts, for people.
    """

    target: str
    chain: str
    requests: int
    usd: float
    cost_per_1m_usd: float | None
    functions: dict[str, float]
    includes: str

    def to_dict(self) -> dict:
        """The bill as ``--json`` shows it: its fields by name."""
        return asdict(self)


def bill_run(
    report: RunReport, document: BundleDocument, platform: Platform, chain: str
) -> RunBill:
    """What ``platform`` would bill for what ``report`` served, in chain mode ``chain``."""
    plan = Plan.from_dict(dict(document.plan))
    called = {f.name for f in plan.functions if f.spec.called}
    on_path = [i for i, s in enumerate(report.slices) if s.name not in called]
    waits = CHAINS[chain].caller_waits
    # deployed at the platform's smallest size at least (a bundle planned for another)
    memory = [max(s.allocated_mb, platform.min_mb) for s in report.slices]
    requested = {f.name: f.vcpus for f in plan.functions}
    cpus = [platform.cpu_of(m, requested.get(s.name, 0.0)) for m, s in zip(memory, report.slices)]
    if report.served:
        invocations, requests = _recorded(report, memory, cpus)
        how = "each request's invocations as recorded"
    else:
        invocations = _approximate(report.slices, on_path, waits, memory, cpus)
        requests = report.requests - report.errors
        how = "approximate: each function's median time, waits the later functions' medians"
    functions, total = {}, 0.0
    for i, s in enumerate(report.slices):
        usd = bill_usd(platform, chain, s.name, memory[i], cpus[i], invocations[i], [s.instance_s])
        total += usd
        functions[s.name] = per_1m(usd, requests) or 0.0
    if platform.reserved:
        includes = f"the instance-seconds the run reserved x memory and CPU ({how})"
    else:
        wait = "waits" if waits else "no waits"
        includes = f"each invocation's own time, {wait}, INIT of cold starts, request fees ({how})"
    return RunBill(
        target=platform.target,
        chain=chain,
        requests=requests,
        usd=total,
        cost_per_1m_usd=per_1m(total, requests),
        functions=functions,
        includes=includes,
    )


def _recorded(
    report: RunReport, memory: list[int], cpus: list[float]
) -> tuple[list[list[Invocation]], int]:
    """Each answered request's invocations as the run recorded them (`RunReport.served`: own
    time, wait, INIT), by function; and how many requests were answered. Failed requests are not
    billed."""
    index = {s.name: k for k, s in enumerate(report.slices)}
    out: list[list[Invocation]] = [[] for _ in report.slices]
    answered = [r for r in report.served if r.latency_ms is not None]
    for request in answered:
        for span in request.invocations:
            k = index[span.function]
            out[k].append(
                Invocation(
                    function=span.function,
                    memory_mb=memory[k],
                    vcpus=cpus[k],
                    own_ms=span.own_ms,
                    wait_ms=span.wait_ms,
                    init_ms=span.init_ms,
                )
            )
    return out, len(answered)


def _approximate(
    slices: Sequence[SliceStats],
    on_path: list[int],
    waits: bool,
    memory: list[int],
    cpus: list[float],
) -> list[list[Invocation]]:
    """Without per-request records (the function-server chains): each call at its function's
    median, a caller's wait the medians of the path after it, the starts on the first calls."""
    out: list[list[Invocation]] = []
    for i, s in enumerate(slices):
        own = s.p50_ms or 0.0
        later = [slices[j].p50_ms or 0.0 for j in on_path if j > i] if i in on_path else []
        init = [s.init_ms] + [0.0] * max(0, s.calls - 1)
        out.append(
            [
                Invocation(
                    function=s.name,
                    memory_mb=memory[i],
                    vcpus=cpus[i],
                    own_ms=own,
                    wait_ms=sum(later) if waits else 0.0,
                    init_ms=init[k],
                )
                for k in range(s.calls)
            ]
        )
    return out
