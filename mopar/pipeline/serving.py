"""Serving a compile's units on this machine, as they deploy, to measure them: how many
requests each serves before its peak is read (`sizing_requests`), whether they are served one
at a time (`serves_in_turn`), and the run itself (`serve_units`), whose reports size the
functions (`mopar.pipeline.sizing.sized`) and judge the latency (`mopar.pipeline.driver`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopar.bundle.document import BundleDocument
from mopar.config import RunConfig
from mopar.emit.functions import write_function_specs
from mopar.errors import VerificationError
from mopar.pipeline.document import io_section
from mopar.pipeline.release import RELEASE_FROM_MB, room_for, shortfall
from mopar.pipeline.values import Analysis, Realised, Reference
from mopar.runner.bundle import manifest_of
from mopar.runner.chain import AS_PLANNED
from mopar.runner.local import run_bundles
from mopar.runner.stepwise import serves_in_turn as chain_allows
from mopar.runtime.transports import handing_on, transport_named

if TYPE_CHECKING:
    from mopar.facts import Platform
    from mopar.plan import Plan
    from mopar.runner.report import RunReport

__all__ = [
    "SIZING_REQUESTS",
    "FEW_SIZING_REQUESTS",
    "CREEP_BYTES",
    "sizing_requests",
    "redis_hops_ms",
    "redis_stand_in",
    "serve_units",
    "serves_in_turn",
    "in_turn",
    "unit_manifest",
]

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


def serve_units(
    root: Path,
    analysis: Analysis,
    realised: Realised,
    reference: Reference | None = None,
    *,
    requests: int = 9,
    at: tuple[dict, dict] | None = None,
    in_turn: bool | None = None,
    platform: Platform | None = None,
) -> tuple[RunReport, RunReport | None]:
    """Serve the reference input ``requests`` times (measured; then more, up to
    `sizing_requests` in all, for the peaks alone) through every unit as it deploys: the
    process its target deploys (the function server for OpenFaaS, the Lambda handler for
    Lambda), handing on by the plan's transports (`mopar.runner.chain.AS_PLANNED`), so that
    each peak RSS is that process's, request body, answer and threads included. With
    ``reference``, its unsplit unit too, served the same way, requests interleaved (A B A B
    ...: `run_bundles`), so that drift of a busy machine falls on both alike. ``at``: (inputs,
    expected outputs) to serve instead of the example's (`at_sizes`). ``in_turn``: whether
    the functions are served one at a time (None: as `serves_in_turn` decides). Where a plan
    hands frames over through Redis and no redis-server is here (`redis_stand_in`), those go
    inline, and each request's latency gains the Redis hops ``platform``'s profiles predict
    (`redis_hops_ms`).

    Returns the plan's `RunReport` and the reference's (None without one).
    """

    cm, tolerance = analysis.captured, realised.tolerance
    plans = [realised.plan, *((reference.realised.plan,) if reference is not None else ())]
    manifests = [unit_manifest(root, analysis, realised)]
    if reference is not None:
        manifests.append(unit_manifest(reference.root, analysis, reference.realised))
    if in_turn is None:
        in_turn = serves_in_turn(plans, manifests)
    room_for(*plans, in_turn=in_turn)
    inputs, expected = at or (cm.inputs, cm.reference)
    run = RunConfig(
        requests=requests,
        tolerance=tolerance,
        start_one_at_a_time=_large(realised.plan),  # no two load peaks at once
        in_turn=in_turn,
        redis_stand_in=any(redis_stand_in(p) for p in plans),
    )
    reports = run_bundles(
        manifests,
        inputs,
        config=run,
        expected=expected,
        transport=AS_PLANNED,
        settle=max(0, sizing_requests(analysis) - 1 - requests),  # after the warm-up, the measured
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
    return reports[0], (reports[1] if reference is not None else None)


def _large(plan: Plan) -> bool:
    """Whether ``plan``'s weights are enough for compile to keep its memory down as it
    measures (`mopar.pipeline.release.RELEASE_FROM_MB`)."""

    return sum(f.param_bytes for f in plan.functions) / (1 << 20) >= RELEASE_FROM_MB


def serves_in_turn(plans: Sequence[Plan], manifests: Sequence[Any]) -> bool:
    """Whether compile serves ``plans`` (a plan, and the unsplit model beside it for the
    latency check) one function at a time (`mopar.runner.stepwise`), the machine holding one
    function instead of all: where the plan's weights are large (`_large`) or the functions
    together do not fit the memory available, and each chain (its ``manifests``) allows it:
    synchronous, with no expert functions."""

    crowded = _large(plans[0]) or shortfall(*plans) is not None
    return crowded and all(chain_allows(m) for m in manifests)


def in_turn(
    root: Path, analysis: Analysis, realised: Realised, beside: Sequence[Plan] = ()
) -> bool:
    """`serves_in_turn` of ``realised`` (exported under ``root``), with plans ``beside``."""
    return serves_in_turn([realised.plan, *beside], [unit_manifest(root, analysis, realised)])


def unit_manifest(root: Path, analysis: Analysis, realised: Realised):
    """The runner's manifest of ``realised``'s units, exported under ``root``: the one
    `mopar.runner.bundle.manifest_of` makes of their ``plan.json`` document, before it is
    written; each unit's ``function.json`` is written beside its model, as its function
    process reads it (emit writes the final plan's over it)."""

    io = io_section(analysis, realised.slices, realised.codecs, root=root)
    write_function_specs(root, realised.plan, io)
    return manifest_of(root, BundleDocument(plan=realised.plan.to_dict(), io=io))
