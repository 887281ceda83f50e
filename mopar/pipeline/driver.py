"""The driver: the stages in order (`run`), and the latency check that may plan again."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mopar.config import CompileConfig, Tolerance
from mopar.facts import Facts
from mopar.pipeline.document import _io, _write_graphs, _write_partial
from mopar.pipeline.stages import (
    _replan,
    _tell,
    _with_units,
    emit,
    export,
    measure,
    plan,
    profile,
    rewrite,
    verify,
)
from mopar.pipeline.values import (
    Analysis,
    Bundle,
    Exported,
    Measured,
    Planned,
    Profile,
    Progress,
    Realised,
    Reference,
    Stopwatch,
)

if TYPE_CHECKING:
    from mopar.plan import Plan
    from mopar.runner.check import Comparison

log = logging.getLogger(__name__)

# --- the driver -----------------------------------------------------------------------------------


def run(
    analysis: Analysis,
    out: Path,
    *,
    config: CompileConfig,
    facts: Facts,
    force: bool,
    progress: Progress | None = None,
    until: str | None = None,
) -> Bundle:
    """Run the stages after capture on ``analysis`` and write the bundle at ``out``
    atomically; with ``until``, stop after that stage (one of `UNTIL`) and write what it made."""
    from mopar.emit.bundle import staging_dir

    watch = Stopwatch()
    watch.add("capture", analysis.seconds)
    with watch.stage("profile"):
        profiled = profile(analysis, config, facts)
    with watch.stage("plan"):
        planned = plan(analysis, config, facts, profiled)
    with staging_dir(out, force=force) as tmp:
        if until == "plan":
            _write_partial(tmp, analysis, planned.plan, until, watch)
            return _partial(out, planned.plan, config.tolerance, until, watch)
        if until == "rewrite":
            with watch.stage("rewrite"):
                units = rewrite(analysis, planned)
            _write_graphs(tmp, units)
            _write_partial(
                tmp, analysis, planned.plan, until, watch, io=_io(analysis, units, {}, root=None)
            )
            return _partial(out, planned.plan, config.tolerance, until, watch)
        exported = export(
            analysis,
            planned,
            tmp / "functions",
            config=config,
            facts=facts,
            profiled=profiled,
            watch=watch,
            progress=progress,
        )
        r = exported.realised
        if until == "export":
            estimate = _with_units(analysis, r.plan, r.slices, r.codecs)
            _write_partial(
                tmp,
                analysis,
                estimate,
                until,
                watch,
                io=_io(analysis, r.slices, r.codecs, root=tmp),
            )
            return _partial(out, estimate, r.tolerance, until, watch)
        _tell(progress, "verify", len(r.slices), len(r.slices))
        with watch.stage("verify"):
            checked = verify(analysis, exported)
        exported, checked, measured = _measure_checked(
            tmp,
            out,
            analysis,
            exported,
            checked,
            config=config,
            facts=facts,
            profiled=profiled,
            planned=planned,
            watch=watch,
            progress=progress,
        )
        r = exported.realised
        with watch.stage("emit"):
            emit(
                tmp,
                analysis,
                r,
                measured,
                checked,
                config=config,
                facts=facts,
                experts=profiled.experts,
                watch=watch,
            )
    return Bundle(
        path=out,
        plan=measured.plan,
        max_abs_err=checked.max_abs_err,
        max_rel_err=checked.max_rel_err,
        tolerance=r.tolerance,
        stages=watch.times(),
    )


def _partial(out: Path, plan: Plan, tolerance: Tolerance, until: str, watch: Stopwatch) -> Bundle:
    return Bundle(
        path=out,
        plan=plan,
        max_abs_err=None,
        max_rel_err=None,
        tolerance=tolerance,
        until=until,
        stages=watch.times(),
    )


# --- the latency check (CompileConfig.check_latency) ----------------------------------------------


def _measure_checked(
    tmp: Path,
    out: Path,
    analysis: Analysis,
    exported: Exported,
    checked: Comparison,
    *,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    planned: Planned,
    watch: Stopwatch,
    progress: Progress | None,
) -> tuple[Exported, Comparison, Measured]:
    """The measure stage, with the latency check where `_checks_latency` says: serve the plan
    beside the unsplit model (exported to a scratch folder), and where it is slower than
    ``config.max_slowdown`` allows, plan again from the measurements, and export, verify and
    serve that plan instead. Returns the exported units, their verification and `Measured`."""
    reference = None

    def serve(r: Realised) -> Measured:
        _tell(progress, "measure", len(r.slices), len(r.slices))
        with watch.stage("measure"):
            return measure(tmp, analysis, r, facts, reference=reference)

    r = exported.realised
    with contextlib.ExitStack() as stack:
        if _checks_latency(config, r.plan):
            _tell(progress, "export unsplit", 0, 1)
            reference = _reference(
                analysis,
                config,
                facts,
                profiled,
                planned.plan,
                Path(stack.enter_context(_scratch(out))),
                watch,
            )
        measured = serve(r)
        for _ in range(REPLANS if reference is not None else 0):
            if measured.slowdown <= config.max_slowdown:
                break
            facts, profiled, again = _measured_replan(
                analysis, config, facts, profiled, r.plan, measured
            )
            if again is None:  # the same cuts again
                break
            shutil.rmtree(tmp / "functions")
            exported = export(
                analysis,
                again,
                tmp / "functions",
                config=config,
                facts=facts,
                profiled=profiled,
                watch=watch,
                progress=progress,
            )
            r = exported.realised
            with watch.stage("verify"):
                checked = verify(analysis, exported)
            measured = serve(r)
    notes = _latency_notes(config, measured) if reference is not None else ()
    measured = replace(measured, plan=replace(measured.plan, notes=(*measured.plan.notes, *notes)))
    return exported, checked, measured


REPLANS = 3
"""How often the latency check plans again before it keeps what it has: each round costs an
export and a serve of the new plan."""


def _checks_latency(config: CompileConfig, plan) -> bool:
    """Whether the plan is measured against the unsplit model: under the default objective
    (a bound relative to the unsplit plan: no --slices, no --slo-ms, and a model that fits one
    function) of mopar's strategy, for a plan of more than one function, without codecs (they
    trade latency by design) and without expert functions (their cuts are forced: the layer's
    experts are placed by cost, not by the latency bound)."""
    return (
        config.check_latency
        and config.strategy == "mopar"
        and config.slices is None
        and config.slo_ms is None
        and config.codec == "none"
        and len(plan.functions) > 1
        and plan.bound_ms is not None
        and plan.bound_ms < float("inf")
        and not plan.dispatches()
    )


@contextlib.contextmanager
def _scratch(out: Path) -> Iterator[str]:
    """A scratch folder beside ``out`` for the unsplit reference, gone on every exit path."""
    folder = tempfile.mkdtemp(prefix=f".{Path(out).name}.", suffix=".unsplit", dir=Path(out).parent)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _reference(
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    planned: Plan,
    folder: Path,
    watch: Stopwatch,
) -> Reference:
    """The unsplit model exported under ``folder`` as the one-function plan (never sharded:
    ``--parallel`` does not apply to it)."""
    one = _replan(analysis, replace(config, parallel=1), facts, profiled, planned, (), ())
    exported = export(
        analysis,
        one,
        folder / "functions",
        config=config,
        facts=facts,
        profiled=profiled,
        watch=watch,
        progress=None,
    )
    return Reference(root=folder, realised=exported.realised)


def _measured_replan(
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    served: Plan,
    measured: Measured,
) -> tuple[Facts, Profile, Planned | None]:
    """The facts and predictions corrected by what serving ``served`` beside the unsplit model
    found, and the plan they give (None where its cuts are ``served``'s).

    Two corrections: every layer's predicted time is scaled so that the unsplit plan predicts
    the unsplit model's measured latency (a machine and model term the profiler cannot know),
    and every cut costs, on its handoff, the latency the plan measured over its corrected
    prediction, shared among its cuts.
    """
    from mopar.planner.recut import plan_cuts

    platform = facts.platform
    # the unsplit latency the bound was made of (the strategy's own unsplit plan)
    scale = measured.unsplit_ms / max(served.bound_ms / config.max_slowdown, 1e-9)
    layers = profiled.layers
    profiled = replace(
        profiled, layers=replace(layers, time_ms=tuple(t * scale for t in layers.time_ms))
    )
    cuts = max(len(served.path()) - 1, 1)
    computing = served.latency_ms - platform.hop_ms * cuts  # the functions' times, ms
    modelled = scale * computing + platform.hop_ms * cuts  # what the corrected times predict
    extra = max(measured.latency_ms - modelled, 0.0) / cuts
    # what a cut costs beyond the calibration is mostly the functions' own time (reading and
    # writing the cut, onnxruntime's layout changes and lost fusions at a graph's edge), so it
    # is billed: it goes on the handoff, which the function receiving the cut pays
    links = tuple(replace(link, latency_ms=link.latency_ms + extra) for link in platform.links)
    facts = replace(facts, platform=replace(platform, links=links))
    note = (
        f"measured: a plan of {len(served.functions)} functions served at "
        f"{measured.slowdown:.3f}x the unsplit model's median latency, over --max-slowdown "
        f"{config.max_slowdown:g}; planned again with layer times x{scale:.2f} and "
        f"{extra:.2f} ms more per cut"
    )
    again = plan(analysis, config, facts, profiled)
    notes = (*again.plan.notes, *_replan_notes(served), note)
    again = replace(again, plan=replace(again.plan, notes=notes))
    return facts, profiled, (None if plan_cuts(again.plan) == plan_cuts(served) else again)


def _replan_notes(served: Plan) -> tuple[str, ...]:
    """The notes of earlier rounds that ``served`` carried, to keep in the next plan."""
    return tuple(n for n in served.notes if n.startswith("measured: a plan of"))


def _latency_notes(config: CompileConfig, measured: Measured) -> tuple[str, ...]:
    verdict = (
        "within"
        if measured.slowdown <= config.max_slowdown
        else "over (pass --max-slowdown higher, or --slices 1 to keep the model whole)"
    )
    return (
        f"measured before writing: median latency {measured.latency_ms:.1f} ms against "
        f"{measured.unsplit_ms:.1f} ms unsplit, {measured.slowdown:.3f}x, {verdict} "
        f"--max-slowdown {config.max_slowdown:g}",
    )
