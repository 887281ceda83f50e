"""Serving a compile's functions on this machine, as they deploy, to measure them: how many
requests each serves before its peak is read (`sizing_requests`), whether they are served one
at a time (`serves_in_turn`), whether the machine holds them (`room_for`), and the run itself
(`serve`), whose reports size the functions (`mopar.pipeline.sizing.sized`,
`mopar.pipeline.finish`) and judge the latency (`mopar.pipeline.driver`). It imports no torch:
`mopar.pipeline.finish` measures in a process without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mopar.config import RunConfig, Tolerance
from mopar.errors import MoparError, VerificationError
from mopar.plan.notes import as_notes
from mopar.planner.sizing import cover_peaks
from mopar.runner.chain import AS_PLANNED
from mopar.runner.local import run_bundles
from mopar.runner.stepwise import serves_in_turn as chain_allows
from mopar.runtime.transports import handing_on, transport_named

if TYPE_CHECKING:
    from mopar.facts import Facts, Platform
    from mopar.pipeline.values import Analysis
    from mopar.plan import Plan
    from mopar.runner.bundle import BundleManifest
    from mopar.runner.report import RunReport

__all__ = [
    "SIZING_REQUESTS",
    "FEW_SIZING_REQUESTS",
    "CREEP_BYTES",
    "RELEASE_FROM_MB",
    "sizing_requests",
    "redis_hops_ms",
    "redis_stand_in",
    "serve",
    "fitted",
    "serves_in_turn",
    "shortfall",
    "room_for",
]

RELEASE_FROM_MB = 256.0
"""The weights (MiB) from which compile keeps its memory down as it measures: it serves the
functions one at a time and starts them one at a time, and its own copy of the weights goes out
of memory meanwhile (`mopar.pipeline.release`); below, that costs more than the memory is worth."""

SIZING_REQUESTS = 30
"""Requests each unit serves before its peak RSS is read, the warm-up included. Peak RSS creeps
up over the first requests (glibc raises its mmap threshold after large frees and keeps freed
buffers in the heap), and in the function server, whose requests land on any of its threads,
for longer: bert_mini's server rose from 130 to 329 MB over its first 15 requests, then stayed
(the shm worker's levels off within 10)."""

FEW_SIZING_REQUESTS = 10
"""`SIZING_REQUESTS` of a model whose tensors cannot make its peak creep (`CREEP_BYTES`)."""

CREEP_BYTES = 32 * 1024
"""The largest layer output or model input, bytes, under which a model's peak does not creep:
glibc's mmap threshold starts at 128 KiB and only a buffer at least that large raises it, and a
layer's intermediates may be a few times its output."""


def sizing_requests(analysis: Analysis) -> int:
    """Requests each of ``analysis``'s units serves before its peak is read (the warm-up
    included): `SIZING_REQUESTS`, or `FEW_SIZING_REQUESTS` where no tensor reaches
    `CREEP_BYTES` (the tests' tiny models: the compile stays as fast as it was)."""
    largest = max(
        [layer.output_bytes for layer in analysis.layers.layers]
        + [v.nbytes for v in analysis.captured.inputs.values()],
        default=0,
    )
    return SIZING_REQUESTS if largest >= CREEP_BYTES else FEW_SIZING_REQUESTS


def redis_stand_in(plan: Plan) -> str | None:
    """Why ``plan``'s Redis hops are measured inline (no redis-server here), or None: it has
    none, or Redis is at hand."""
    if not any(handing_on(e.transport).needs_redis for e in plan.edges):
        return None
    return transport_named("redis").missing()


def redis_hops_ms(plan: Plan, platform: Platform) -> float:
    """What ``plan``'s Redis hops take a request, ms, as the profiles predict them (the
    ``redis`` link of ``platform``): what an inline stand-in's measurement leaves out."""
    link = next((k for k in platform.links if k.name == "redis"), None)
    hops = [e for e in plan.edges if handing_on(e.transport).needs_redis]
    return sum(link.transfer_ms(e.bytes) for e in hops) if link is not None else 0.0


def _with_redis_hops(report: RunReport, plan: Plan, platform: Platform | None) -> RunReport:
    """``report`` with the Redis hops ``plan`` would make added to every request's latency."""
    extra = redis_hops_ms(plan, platform) if platform is not None else 0.0
    if not extra:
        return report
    served = tuple(
        replace(r, latency_ms=None if r.latency_ms is None else r.latency_ms + extra)
        for r in report.served
    )
    shift = lambda ms: None if ms is None else round(ms + extra, 3)  # noqa: E731
    return replace(
        report,
        served=served,
        latency_p50_ms=shift(report.latency_p50_ms),
        latency_p95_ms=shift(report.latency_p95_ms),
        latency_p99_ms=shift(report.latency_p99_ms),
    )


def serve(
    manifests: Sequence[BundleManifest],
    plans: Sequence[Plan],
    inputs: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    tolerance: Tolerance,
    settle_to: int,
    requests: int = 9,
    in_turn: bool | None = None,
    platform: Platform | None = None,
) -> list[RunReport]:
    """Serve ``inputs`` ``requests`` times (measured; then more, up to ``settle_to`` in all,
    for the peaks alone: `sizing_requests`) through every function of each of ``manifests``
    (the bundles of ``plans``, in the same order) as it deploys: the process its target deploys
    (the function server for OpenFaaS, the Lambda handler for Lambda), handing on by the plan's
    transports (`mopar.runner.chain.AS_PLANNED`), so that each peak RSS is that process's,
    request body, answer and threads included. Several bundles are served requests
    interleaved (A B A B ...: `run_bundles`), so that drift of a busy machine falls on all
    alike. ``in_turn``: whether the functions are served one at a time (None: as
    `serves_in_turn` decides). Where a plan hands frames over through Redis and no
    redis-server is here (`redis_stand_in`), those go inline, and each request's latency gains
    the Redis hops ``platform``'s profiles predict (`redis_hops_ms`).

    Raises:
        VerificationError: a function failed, or the answers are not ``expected``.
    """

    if in_turn is None:
        in_turn = serves_in_turn(plans, manifests)
    room_for(*plans, in_turn=in_turn)
    run = RunConfig(
        requests=requests,
        tolerance=tolerance,
        start_one_at_a_time=_large(plans[0]),  # no two load peaks at once
        in_turn=in_turn,
        redis_stand_in=any(redis_stand_in(p) for p in plans),
    )
    reports = run_bundles(
        list(manifests),
        dict(inputs),
        config=run,
        expected=dict(expected),
        transport=AS_PLANNED,
        settle=max(0, settle_to - 1 - requests),  # after the warm-up, the measured
    )
    for report in reports:
        if report.errors or not report.comparison.passed:
            raise VerificationError(
                f"the slices disagree with the model when run as processes: "
                f"{report.comparison.describe(tolerance)}, errors {list(report.error_messages)}; "
                "report this"
            )
    if run.redis_stand_in:
        reports = [_with_redis_hops(r, p, platform) for r, p in zip(reports, plans)]
    return reports


def _large(plan: Plan) -> bool:
    """Whether ``plan``'s weights are enough for compile to keep its memory down as it
    measures (`RELEASE_FROM_MB`)."""

    return sum(f.param_bytes for f in plan.functions) / (1 << 20) >= RELEASE_FROM_MB


def serves_in_turn(plans: Sequence[Plan], manifests: Sequence[Any]) -> bool:
    """Whether compile serves ``plans`` (a plan, and the unsplit model beside it for the
    latency check) one function at a time (`mopar.runner.stepwise`), the machine holding one
    function instead of all: where the plan's weights are large (`_large`) or the functions
    together do not fit the memory available, and each chain (its ``manifests``) allows it:
    synchronous, with no expert functions."""

    crowded = _large(plans[0]) or shortfall(*plans) is not None
    return crowded and all(chain_allows(m) for m in manifests)


def shortfall(*plans: Any, in_turn: bool = False) -> tuple[float, float] | None:
    """(MB the functions of ``plans`` need at their planned sizes, MB available) where the
    machine cannot hold them all at once (``in_turn``: the largest alone, as they are served
    one at a time); None where it can."""
    import psutil

    sizes = [f.memory_mb for p in plans for f in p.functions]
    need = max(sizes) if in_turn else sum(sizes)
    room = psutil.virtual_memory().available / (1 << 20)
    return (need, room) if need > room else None


def room_for(*plans: Any, in_turn: bool = False) -> None:
    """Refuse to serve more functions at once than this machine's available memory holds,
    by their planned sizes (the kernel would kill one of them, or something else)."""

    if (short := shortfall(*plans, in_turn=in_turn)) is not None:
        need, room = short
        count = sum(len(p.functions) for p in plans)
        what = "its largest function alone" if in_turn else f"its {count} functions at once"
        raise MoparError(
            f"measuring the plan serves {what}, {need:.0f} MB as planned, more than this "
            f"machine has available ({room:.0f} MB); compile on a machine with at least "
            f"{need:.0f} MB free"
        )


def fitted(plan: Plan, peaks: Mapping[str, float], facts: Facts, compute=None) -> Plan:
    """``plan`` with every function sized to cover its measured peak RSS (``peaks``, MB) plus
    ``facts.measured_margin`` (`mopar.planner.sizing.cover_peaks`; ``compute``: each slice's
    predicted compute, where CPU follows memory), and a note where Redis hops were measured
    inline."""

    fit = cover_peaks(
        plan, dict(peaks), margin=facts.measured_margin, platform=facts.platform, compute=compute
    )
    if (why := redis_stand_in(plan)) is None:
        return fit
    hops = redis_hops_ms(plan, facts.platform)
    return replace(
        fit,
        notes=(
            *fit.notes,
            *as_notes(
                f"measured without Redis ({why}): the cuts planned through Redis were "
                f"handed over inline, and each request's latency was given the Redis hops' "
                f"{hops:.1f} ms the profiles predict; `mopar run` and the deployed "
                "functions need a Redis (REDIS_URL)"
            ),
        ),
    )
