"""The measure stage: serve a compile's units as they deploy (`mopar.pipeline.serving`), and
size every function to cover the peak it measured (`sized`), in containers where asked
(`_contained`).

Read in this order: `measure` (the stage), `sized` (what a report makes of the plan), then
`_contained` and its `CONTAINER_HEADROOM`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mopar.config import CompileConfig, RunConfig
from mopar.container.build import images_for
from mopar.container.session import ContainerSession
from mopar.emit.runtime import write_runtime
from mopar.errors import Option, VerificationError
from mopar.facts import Facts
from mopar.pipeline.serving import (
    redis_hops_ms,
    redis_stand_in,
    serve_units,
    sizing_requests,
    unit_manifest,
)
from mopar.pipeline.stages import at_sizes, with_units_of
from mopar.pipeline.values import Analysis, Measured, Realised
from mopar.plan.notes import as_notes
from mopar.planner.sizing import cover_peaks
from mopar.runner.local import run_bundles
from mopar.runner.report import RunReport

__all__ = ["CONTAINER_HEADROOM", "measure", "sized"]


def measure(
    root: Path, analysis: Analysis, realised: Realised, config: CompileConfig, facts: Facts
) -> Measured:
    """Serve the reference input through each unit as it deploys (`serve_units`), and size
    every function to at least its peak RSS plus ``facts.measured_margin`` (`sized`)."""
    report, _ = serve_units(root, analysis, realised, platform=facts.platform)
    return sized(root, analysis, realised, report, config, facts)


def sized(
    root: Path,
    analysis: Analysis,
    realised: Realised,
    report: RunReport,
    config: CompileConfig,
    facts: Facts,
) -> Measured:
    """``realised``'s plan with every function sized to cover the peak RSS ``report``
    measured (plus ``facts.measured_margin``) in the process it names (``served_by``), and
    what else the report says of it. A model with dynamic dimensions is served again at their
    largest sizes, and sized for those. With ``config.measure`` ``containers``, the larger of
    that peak and its container's cgroup peak (`_contained`), times and latency staying the
    host's. Not the cgroup's alone: the kernel charges a shared library's page cache to the
    first container that reads it (here 120 MB for the first of three slices, 30 MB for the
    others, whose servers' RSS was 65 MB), and a function deployed alone pays for its own."""

    measured = report
    peaks = {s.name: s.peak_rss_mb for s in report.slices}
    if analysis.captured.program is not None:
        at = at_sizes(analysis.captured, "max")
        largest, _ = serve_units(root, analysis, realised, at=at, platform=facts.platform)
        peaks = {s.name: max(peaks[s.name], s.peak_rss_mb) for s in largest.slices}
    if config.measure == "containers":
        measured = _contained(root, analysis, realised, report, config, facts)
        peaks = {s.name: max(peaks[s.name], s.peak_rss_mb) for s in measured.slices}
    fitted = cover_peaks(
        realised.plan,
        peaks,
        margin=facts.measured_margin,
        platform=facts.platform,
        compute=realised.compute,
    )
    if (why := redis_stand_in(realised.plan)) is not None:
        hops = redis_hops_ms(realised.plan, facts.platform)
        fitted = replace(
            fitted,
            notes=(
                *fitted.notes,
                *as_notes(
                    f"measured without Redis ({why}): the cuts planned through Redis were "
                    f"handed over inline, and each request's latency was given the Redis hops' "
                    f"{hops:.1f} ms the profiles predict; `mopar run` and the deployed "
                    "functions need a Redis (REDIS_URL)"
                ),
            ),
        )
    return Measured(
        plan=with_units_of(analysis, fitted, realised.slices, realised.codecs),
        peaks_mb=peaks,
        p50_ms={s.name: s.p50_ms for s in report.slices},
        latency_ms=report.latency_p50_ms,
        measured_in=measured.served_by,
    )


CONTAINER_HEADROOM = 2.0
"""A function's memory limit while compile measures it in a container, over the size its
host measurement gives it: enough that measuring is not itself killed."""


def _contained(
    root: Path,
    analysis: Analysis,
    realised: Realised,
    host: RunReport,
    config: CompileConfig,
    facts: Facts,
) -> RunReport:
    """Serve ``realised``'s units in containers of their images (built here, as `mopar build`
    does, from the runtime written into ``root`` first), each limited to
    `CONTAINER_HEADROOM` x the size its ``host`` peak gives it; the report's peaks are the
    containers' cgroup peaks."""

    plan = realised.plan
    write_runtime(root)  # the OpenFaaS image, for either target: the containers serve over HTTP
    on_host = cover_peaks(
        plan,
        {s.name: s.peak_rss_mb for s in host.slices},
        margin=facts.measured_margin,
        platform=facts.platform,
    )
    limit = {f.name: int(CONTAINER_HEADROOM * f.memory_mb) for f in on_host.functions}
    manifest = unit_manifest(root, analysis, realised)
    engine, images = images_for(manifest, base_image=config.base_image or None)
    manifest = replace(
        manifest,
        slices=tuple(replace(s, memory_mb=limit[s.name]) for s in manifest.slices),
    )
    tags = {b.function: b.tag for b in images}
    run = RunConfig(requests=9, tolerance=realised.tolerance)
    cm = analysis.captured
    (report,) = run_bundles(
        [manifest],
        cm.inputs,
        config=run,
        expected=cm.reference,
        session_for=lambda m, _i, url: ContainerSession(
            m, run, engine=engine, images=tags, redis_url=url
        ),
        settle=max(0, sizing_requests(analysis) - 1 - run.requests),
    )
    if report.errors or report.oom_kills or not report.comparison.passed:
        raise VerificationError(
            f"the functions failed in their containers, limited to {CONTAINER_HEADROOM:g}x "
            f"their host-measured size: {list(report.error_messages)}; compile with ",
            Option("measure", value="host"),
            ", and report this",
        )
    return report
