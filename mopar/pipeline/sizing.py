"""The measure stage: serve a compile's units as they deploy (`mopar.pipeline.serving`), and
size every function to cover the peak it measured (`sized`), in containers where asked
(`_contained`).

Read in this order: `measure` (the stage), `sized` (what a report makes of the plan), then
`_contained` and its `CONTAINER_HEADROOM`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mopar.bundle.document import BundleDocument
from mopar.config import CompileConfig, RunConfig
from mopar.container.build import images_for
from mopar.container.session import ContainerSession
from mopar.emit.functions import write_function_specs
from mopar.emit.runtime import write_runtime
from mopar.errors import Option, VerificationError
from mopar.facts import Facts
from mopar.pipeline.document import io_section
from mopar.pipeline.serving import fitted, serve, serves_in_turn, sizing_requests
from mopar.pipeline.stages import at_sizes, with_units_of
from mopar.pipeline.values import Analysis, Measured, Realised, Reference
from mopar.planner.sizing import cover_peaks
from mopar.runner.bundle import manifest_of
from mopar.runner.local import run_bundles
from mopar.runner.report import RunReport

if TYPE_CHECKING:
    from mopar.facts import Platform
    from mopar.plan import Plan

__all__ = ["CONTAINER_HEADROOM", "measure", "sized", "serve_units", "in_turn", "unit_manifest"]


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
    fit = fitted(realised.plan, peaks, facts, realised.compute)
    return Measured(
        plan=with_units_of(analysis, fit, realised.slices, realised.codecs),
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
    """`mopar.pipeline.serving.serve` of ``realised``'s units, exported under ``root``, on the
    reference input (``at``: (inputs, expected outputs) instead, `at_sizes`); with
    ``reference``, its unsplit unit beside them, requests interleaved.

    Returns the plan's `RunReport` and the reference's (None without one).
    """

    cm = analysis.captured
    plans = [realised.plan, *((reference.realised.plan,) if reference is not None else ())]
    manifests = [unit_manifest(root, analysis, realised)]
    if reference is not None:
        manifests.append(unit_manifest(reference.root, analysis, reference.realised))
    inputs, expected = at or (cm.inputs, cm.reference)
    reports = serve(
        manifests,
        plans,
        inputs,
        expected,
        tolerance=realised.tolerance,
        settle_to=sizing_requests(analysis),
        requests=requests,
        in_turn=in_turn,
        platform=platform,
    )
    return reports[0], (reports[1] if reference is not None else None)


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
