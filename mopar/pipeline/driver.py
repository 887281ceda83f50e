"""The driver: the stages in order (`run`), and the latency check that may plan again
(its statistics and notes: `mopar.pipeline.latency`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mopar._files import owned_folder
from mopar.config import CompileConfig, Tolerance
from mopar.emit.bundle import staging_dir
from mopar.facts import Facts
from mopar.frontend.dtypes import default_tolerance
from mopar.pipeline.document import io_section, write_graphs, write_partial
from mopar.pipeline.finish import apart, finish_staged
from mopar.pipeline.latency import (
    ROUNDS,
    Slowdown,
    compare,
    default_objective,
    next_rounds,
    recorded,
    replan_note,
)
from mopar.pipeline.release import released
from mopar.pipeline.serving import shortfall
from mopar.pipeline.sizing import in_turn, measure, serve_units, sized
from mopar.pipeline.stages import (
    emit,
    export,
    hand_off,
    plan,
    profile,
    replan,
    rewrite,
    verify,
    with_half_notes,
    with_units_of,
)
from mopar.pipeline.values import (
    Analysis,
    Bundle,
    Exported,
    HandedOver,
    Measured,
    Planned,
    Profile,
    Progress,
    Realised,
    Reference,
    Stopwatch,
    tell_progress,
)
from mopar.plan.notes import Note, Remark
from mopar.planner.recut import plan_cuts
from mopar.runner.worker import trim_heap

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
    hand_over: bool = False,
) -> Bundle | HandedOver:
    """Run the stages after capture on ``analysis`` and write the bundle at ``out``
    atomically; with ``until``, stop after that stage (one of `UNTIL`) and write what it made.

    Where the rest needs no torch (`mopar.pipeline.finish.apart`), the export stage's
    products are staged for `mopar.pipeline.finish` (`hand_off`), which carries it out: here,
    or, with ``hand_over``, in another process, to which the staged folder is released."""

    if config.tolerance is None:  # the outputs' types decide (float16, bfloat16: their steps)
        cm = analysis.captured
        config = replace(config, tolerance=default_tolerance(cm.reference, cm.output_dtypes))
    watch = Stopwatch()
    watch.add("capture", analysis.seconds)
    with watch.stage("profile"):
        profiled = profile(analysis, config, facts)
    with watch.stage("plan"):
        planned = plan(analysis, config, facts, profiled)
    with staging_dir(out, force=force) as staging:
        tmp = staging.path
        if until == "plan":
            write_partial(tmp, analysis, planned.plan, until, watch)
            return _partial(out, planned.plan, config.tolerance, until, watch)
        if until == "rewrite":
            with watch.stage("rewrite"):
                units = rewrite(analysis, planned)
            write_graphs(tmp, units)
            write_partial(
                tmp,
                analysis,
                planned.plan,
                until,
                watch,
                io=io_section(analysis, units, {}, root=None),
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
            estimate = with_units_of(analysis, r.plan, r.slices, r.codecs)
            write_partial(
                tmp,
                analysis,
                estimate,
                until,
                watch,
                io=io_section(analysis, r.slices, r.codecs, root=tmp),
            )
            return _partial(out, estimate, r.tolerance, until, watch)
        if apart(
            dynamic=analysis.captured.program is not None,
            generates=analysis.generation is not None,
            experts=profiled.experts is not None,
            config=config,
            plan=r.plan,
        ):
            hand_off(tmp, out, analysis, exported, force=force, watch=watch)
            if hand_over:
                staging.hand_over()
                return HandedOver(staged=tmp)
            return finish_staged(
                tmp,
                config=config,
                facts=facts,
                progress=progress,
                held=lambda: _weights_out(tmp, analysis, r),
            )
        tell_progress(progress, "verify", len(r.slices), len(r.slices))
        checked, exported = _verified(tmp, analysis, exported, config, watch)
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
            final = emit(
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
        plan=final,
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
    """The measure stage, with the latency check under the default objective
    (`mopar.pipeline.latency`): serve a plan of several functions beside the unsplit model
    (exported to a scratch folder), requests interleaved, for more rounds while the comparison
    is unclear; where it is over ``config.max_slowdown`` beyond the measurement's spread, plan
    again from the measurements, and export, verify and serve that plan instead. Returns the
    exported units, their verification and `Measured` (with the check's record)."""
    r = exported.realised
    if not default_objective(config, r.plan):
        return exported, checked, _alone(tmp, analysis, r, config, facts, watch, progress)
    if len(r.plan.functions) == 1:
        measured = _alone(tmp, analysis, r, config, facts, watch, progress)
        return exported, checked, recorded(config, measured, (), (), replanned=False)
    one = replan(analysis, replace(config, parallel=1), facts, profiled, planned.plan, (), ())
    skip = _no_room(one.plan, r.plan, in_turn=in_turn(tmp, analysis, r, (one.plan,)))
    if skip:
        measured = _alone(tmp, analysis, r, config, facts, watch, progress)
        return exported, checked, recorded(config, measured, (), (Remark(skip),), skipped=skip)
    with contextlib.ExitStack() as stack:
        tell_progress(progress, "export unsplit", 0, 1)
        reference = _reference(
            analysis, config, facts, profiled, one, stack.enter_context(_scratch(out)), watch
        )
        compared: list[Slowdown] = []
        notes: list[Note] = []
        for replans in range(REPLANS + 1):
            measured, slowdown = _compared(
                tmp, analysis, r, reference, config, facts, watch, progress
            )
            compared.append(slowdown)
            if not slowdown.misses:
                return exported, checked, recorded(config, measured, compared, notes)
            if replans == REPLANS:
                why = f"still over beyond the noise after planning again {REPLANS} times"
                break
            facts, profiled, again, note = _measured_replan(
                analysis, config, facts, profiled, r.plan, slowdown
            )
            notes.append(note)
            if again is None:
                why = "planning again from the measurements gave the same cuts"
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
            checked, exported = _verified(tmp, analysis, exported, config, watch)
            if len(r.plan.functions) == 1:
                measured = _alone(tmp, analysis, r, config, facts, watch, progress)
                return exported, checked, recorded(config, measured, compared, notes)
        # over beyond the noise and no better plan found: the unsplit model meets the bound
        exported = _keep_unsplit(reference, tmp / "functions")
        checked, exported = _verified(tmp, analysis, exported, config, watch)
    measured = _alone(tmp, analysis, exported.realised, config, facts, watch, progress)
    notes.append(Remark(f"latency check: {why}; kept the unsplit model (one function)"))
    return exported, checked, recorded(config, measured, compared, notes, why=why)


REPLANS = 3
"""How often the latency check plans again before it keeps the unsplit model: each round costs
an export and a serve of the new plan."""


def _alone(
    tmp: Path,
    analysis: Analysis,
    r: Realised,
    config: CompileConfig,
    facts: Facts,
    watch: Stopwatch,
    progress: Progress | None,
) -> Measured:
    """The measure stage without the unsplit model beside it."""
    tell_progress(progress, "measure", len(r.slices), len(r.slices))
    with watch.stage("measure"), _weights_out(tmp, analysis, r):
        return measure(tmp, analysis, r, config, facts)


def _verified(
    tmp: Path, analysis: Analysis, exported: Exported, config: CompileConfig, watch: Stopwatch
) -> tuple[Comparison, Exported]:
    """The verify stage, the model's weights out of memory (`_weights_out`): it compares the
    ONNX functions with reference outputs captured before, and measures what casting 16-bit
    weights costs them (`with_half_notes`), so that no session of theirs runs beside torch's
    copy of the weights."""
    with watch.stage("verify"), _weights_out(tmp, analysis, exported.realised):
        checked, exported = verify(analysis, exported), with_half_notes(exported, config)
        gc.collect()
        trim_heap()  # what their sessions held, back to the kernel before the functions serve
        return checked, exported


def _weights_out(tmp: Path, analysis: Analysis, *realised: Realised):
    """While the ONNX functions are verified or served: the model's weights out of this
    process's memory (`mopar.pipeline.release.released`), unless its dynamic dimensions need
    the captured program to make other sizes' reference outputs."""

    if analysis.captured.program is not None:
        return contextlib.nullcontext(0.0)
    roots = [analysis.captured.gm, analysis.layers.gm, analysis.experts or {}]
    for r in realised:
        for unit in r.slices:
            roots += [unit.gm, *_dispatch_modules(unit)]
    return released(roots, tmp)


def _dispatch_modules(unit) -> list:
    d = unit.dispatch
    return [] if d is None else [d.tail.gm, *([d.hot.gm] if d.hot is not None else [])]


def _compared(
    tmp: Path,
    analysis: Analysis,
    r: Realised,
    reference: Reference,
    config: CompileConfig,
    facts: Facts,
    watch: Stopwatch,
    progress: Progress | None,
) -> tuple[Measured, Slowdown]:
    """Serve ``r`` beside the unsplit ``reference`` in interleaved rounds (a large model: in
    turn, `mopar.pipeline.serving.serves_in_turn`), more of them while the comparison is
    unclear (`mopar.pipeline.latency.next_rounds`); functions are sized from the first
    batch."""
    split: list[float] = []
    whole: list[float] = []
    first = None
    rounds = ROUNDS
    turn = in_turn(tmp, analysis, r, (reference.realised.plan,))
    with _weights_out(tmp, analysis, r, reference.realised):
        while rounds:
            tell_progress(progress, "measure", len(r.slices), len(r.slices))
            with watch.stage("measure"):
                report, unsplit = serve_units(
                    tmp,
                    analysis,
                    r,
                    reference,
                    requests=rounds,
                    in_turn=turn,
                    platform=facts.platform,
                )
            first = first or report
            split += [s.latency_ms for s in report.served]
            whole += [s.latency_ms for s in unsplit.served]
            slowdown = compare(
                split,
                whole,
                functions=len(r.plan.functions),
                bound=config.max_slowdown,
                in_turn=turn,
            )
            log.info("latency check: %s, %s", slowdown.describe(), slowdown.verdict)
            rounds = next_rounds(slowdown)
        measured = sized(tmp, analysis, r, first, config, facts)
    return replace(measured, latency_ms=slowdown.p50_ms), slowdown


@contextlib.contextmanager
def _scratch(out: Path) -> Iterator[Path]:
    """A scratch folder beside ``out`` for the unsplit reference, gone on every exit path (and
    swept by a later compile to ``out`` if this process is killed: `mopar.emit.bundle.LEFTOVERS`)."""
    with owned_folder(Path(out).parent, f".{Path(out).name}.", ".unsplit") as folder:
        yield folder.path


def _no_room(unsplit: Plan, plan: Plan, *, in_turn: bool) -> str:
    """Why the unsplit model cannot be served with ``plan`` on this machine (empty: it can):
    their functions' memory together (``in_turn``: the largest one's, as each is served
    alone) is more than the memory available now."""

    short = shortfall(unsplit, plan, in_turn=in_turn)
    if short is None:
        return ""
    need, room = short
    how = "after" if in_turn else "beside"
    return (
        f"latency check: not run: serving the unsplit model {how} the plan needs {need:.0f} "
        f"MB, more than this machine has available ({room:.0f} MB); the plan's latency is the "
        "predicted one"
    )


def _reference(
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    one: Planned,
    folder: Path,
    watch: Stopwatch,
) -> Reference:
    """The unsplit model (``one``, its one-function plan) exported under ``folder``, as users
    would deploy it instead: never sharded (``--parallel`` does not apply to it), and with
    float weights (``--quantize`` neither)."""
    exported = export(
        analysis,
        one,
        folder / "functions",
        config=replace(config, quantize="none"),
        facts=facts,
        profiled=profiled,
        watch=watch,
        progress=None,
    )
    return Reference(root=folder, realised=exported.realised)


def _keep_unsplit(reference: Reference, folder: Path) -> Exported:
    """The unsplit ``reference``, copied into ``folder`` as the bundle's functions."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(reference.root / "functions", folder)
    realised = reference.realised
    return Exported(
        realised=realised, paths=tuple(folder / s.name / "model.onnx" for s in realised.slices)
    )


def _measured_replan(
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    served: Plan,
    slowdown: Slowdown,
) -> tuple[Facts, Profile, Planned | None, str]:
    """The facts and predictions corrected by what serving ``served`` beside the unsplit model
    found, the plan they give (None where its cuts are ``served``'s), and the round's note.

    Two corrections: every layer's predicted time is scaled so that the unsplit plan predicts
    the unsplit model's measured latency (a machine and model term the profiler cannot know),
    and every cut costs, on its handoff, the latency the plan measured over its corrected
    prediction, shared among its cuts.
    """

    platform = facts.platform
    # the unsplit latency the bound was made of (the strategy's own unsplit plan)
    scale = slowdown.unsplit_p50_ms / max(served.bound_ms / config.max_slowdown, 1e-9)
    layers = profiled.layers
    profiled = replace(
        profiled, layers=replace(layers, time_ms=tuple(t * scale for t in layers.time_ms))
    )
    cuts = max(len(served.path()) - 1, 1)
    computing = served.latency_ms - platform.hop_ms * cuts  # the functions' times, ms
    modelled = scale * computing + platform.hop_ms * cuts  # what the corrected times predict
    measured_ms = slowdown.ratio * slowdown.unsplit_p50_ms  # the paired estimate of its latency
    extra = max(measured_ms - modelled, 0.0) / cuts
    # what a cut costs beyond the calibration is mostly the functions' own time (reading and
    # writing the cut, onnxruntime's layout changes and lost fusions at a graph's edge), so it
    # is billed: it goes on the handoff, which the function receiving the cut pays
    links = tuple(replace(link, latency_ms=link.latency_ms + extra) for link in platform.links)
    facts = replace(facts, platform=replace(platform, links=links))
    again = plan(analysis, config, facts, profiled)
    same = plan_cuts(again.plan) == plan_cuts(served)
    return facts, profiled, (None if same else again), replan_note(slowdown, scale, extra)
