"""Compiling is a pipeline of named stages, each a function from data to data.

    capture -> profile -> plan -> rewrite -> compress -> export -> verify -> measure -> emit

Read in this order: `STAGES`, `Stopwatch` (how long each stage took), `run` (the driver: the
stages in order, stopping after ``until``), then one function per stage, then the writers of
``plan.json``.

========  ===================================================================================
capture   load the model, torch.export it, group it into layers (`capture`, which
          `mopar.api.analyze` calls; the CLI calls it first, so its time travels in
          `Analysis.seconds`)
profile   the profiler's per-layer memory and time predictions, and a mixture-of-experts
          model's activation trace (`Profile`): what needs the model to run is measured here,
          once, and handed to every planning round
plan      the strategy's vertical plan (`mopar.planner`), then the sharding figures of its
          slices (`mopar.profile.shards`) and η per slice from them (`Planned`). Simplifying the
          layer graph is part of it: each strategy simplifies as it builds the problem its DP
          solves
rewrite   one torch slice module per executable unit: split, then shard as analysed
          (`mopar.rewrite`)
compress  the codec of every cut tensor, autoencoders inserted (`mopar.compress`); only with
          a ``codec`` other than none
export    one ONNX file per unit, with its handler and requirements (`mopar.emit.onnx_export`).
          Where a unit does not export, `export` moves a cut (`mopar.planner.recut`) and plan,
          rewrite and compress run again: their seconds count under their own names, not
          export's
verify    the onnxruntime chain against the model's outputs
measure   every unit served through the real runtime; functions sized to cover their peaks.
          Under the default objective (``--max-slowdown``) the unsplit model, exported to a
          scratch folder, is served beside the plan; a plan measured slower than the bound
          allows is planned again from the measurements and exported, verified and served
          in its place (``check_latency``, `_measure_checked`)
emit      ``reference.npz``, ``stack.yml``, ``template.yaml``, ``plan.json`` (whose "stages"
          section holds these times, up to its own writing) and each ``function.json``
========  ===================================================================================

``until`` (``mopar compile --until``) stops after ``plan``, ``rewrite`` or ``export`` and keeps
what was made, written atomically like a whole bundle; its ``plan.json`` says ``"until"``, and
`mopar.runner.bundle.read_manifest` refuses to run it. ``plan.json`` is a
`mopar.bundle.document.BundleDocument`: built once in memory, written once, and the source of
each ``function.json`` and of the runner's view of the units it measures.

Importing this module stays light (no torch, no numpy): the CLI reads `UNTIL` from it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopar.config import CompileConfig, Tolerance
from mopar.facts import Facts, deploy_targets

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mopar.frontend import CapturedModel
    from mopar.ir import LayerGraph
    from mopar.ir.moe import MoeBlock
    from mopar.ir.subgraph import SliceModule
    from mopar.plan import Plan
    from mopar.profile.experts import Experts
    from mopar.profile.service import LayerPrediction
    from mopar.profile.shards import ShardAnalysis
    from mopar.runner.check import Comparison
    from mopar.runner.report import RunReport

__all__ = [
    "STAGES",
    "UNTIL",
    "Analysis",
    "Profile",
    "Planned",
    "Bundle",
    "StageTime",
    "Stopwatch",
    "run",
    "capture",
    "profile",
    "plan",
    "plans",
    "experts_of",
    "rewrite",
    "compress",
    "export",
    "verify",
    "measure",
    "emit",
]

log = logging.getLogger(__name__)

STAGES = (
    "capture",
    "profile",
    "plan",
    "rewrite",
    "compress",
    "export",
    "verify",
    "measure",
    "emit",
)
"""The stages of a compile, in order."""

UNTIL = ("plan", "rewrite", "export")
"""The stages a compile may stop after (``--until``)."""

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """A captured model and its layer graph.

    Attributes:
        captured: the model, its example inputs and reference outputs
            (`mopar.frontend.CapturedModel`).
        layers: its layer graph (`mopar.ir.LayerGraph`).
        seconds: how long capturing took, s (the capture stage).
        moe: the mixture-of-experts blocks found (`mopar.ir.moe.MoeBlock`), each now one
            layer of ``layers`` holding its experts' dense translation.
        experts: each block's expert modules, by block name (an expert maps (n, H) to (n, H)).
    """

    captured: CapturedModel
    layers: LayerGraph
    seconds: float
    moe: tuple[MoeBlock, ...] = ()
    experts: Mapping[str, Sequence[nn.Module]] | None = None


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What the profile stage measured of an analysed model, for every planning round.

    Attributes:
        layers: the profiler's per-layer memory and time predictions.
        experts: a mixture-of-experts model's blocks and activation trace (None: no blocks).
    """

    layers: LayerPrediction
    experts: Experts | None


@dataclass(frozen=True, kw_only=True)
class Planned:
    """The plan stage's result: the plan, and the sharding analysis its η were chosen from,
    which the rewrite builds the sub-slices of (None: ``--parallel`` 1, or expert functions).
    """

    plan: Plan
    shards: ShardAnalysis | None = None


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """How long one stage took, in all its runs, s."""

    stage: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """A written bundle, or what a compile stopped with.

    Attributes:
        path: the bundle folder.
        plan: the Plan it carries out.
        max_abs_err: onnxruntime chain vs the original model, absolute (None: not verified,
            the compile stopped before).
        max_rel_err: the same, relative to the largest reference magnitude (None: likewise).
        tolerance: the allclose tolerances it was (or would be) verified with.
        until: the stage the compile stopped after (None: a whole bundle).
        stages: the seconds of each stage that ran, in order.
    """

    path: Path
    plan: Plan
    max_abs_err: float | None
    max_rel_err: float | None
    tolerance: Tolerance
    until: str | None = None
    stages: tuple[StageTime, ...] = ()


class Stopwatch:
    """Seconds per stage, each stage's own: a stage that runs inside another (rewrite inside
    export, when the export stage moves a cut) pauses the outer one. Each finished run is an
    INFO record (``mopar -v`` shows them)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._running: list[list] = []  # [stage, seconds so far] of each stage running
        self._since = 0.0

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` under stage ``name`` (a stage timed, and logged, elsewhere)."""
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name``."""
        self._tick()
        self._running.append([name, 0.0])
        try:
            yield
        finally:
            self._tick()
            _, seconds = self._running.pop()
            self.add(name, seconds)
            log.info("stage %s: %.3f s", name, seconds)

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._running:
            self._running[-1][1] += now - self._since
        self._since = now

    def times(self) -> tuple[StageTime, ...]:
        """The stages timed so far, those still running included, in pipeline order."""
        self._tick()
        seconds = dict(self._seconds)
        for name, so_far in self._running:
            seconds[name] = seconds.get(name, 0.0) + so_far
        return tuple(
            StageTime(stage=s, seconds=round(seconds[s], 3)) for s in STAGES if s in seconds
        )


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


# --- the stages -----------------------------------------------------------------------------------


def capture(
    model: Any,
    example_args: Any,
    example_kwargs: Any,
    *,
    depth: int | None,
    trust_pickle: bool,
    progress: Progress | None,
) -> Analysis:
    """Load ``model``, torch.export it on its example inputs and group it into layers."""
    from mopar.arguments import example_arrays
    from mopar.frontend import capture as capture_model
    from mopar.frontend import load_model
    from mopar.ir import build_layer_graph

    start = time.perf_counter()
    _tell(progress, "load", 0, 3)
    loaded = load_model(model, trust_pickle=trust_pickle)
    _tell(progress, "export", 1, 3)
    arrays, notes = example_arrays(loaded, example_args, example_kwargs)
    captured = capture_model(loaded, arrays, notes=notes)
    captured, blocks, experts = _experts(captured)
    _tell(progress, "layers", 2, 3)
    lg = build_layer_graph(
        captured.gm,
        input_names=captured.input_names,
        output_names=captured.output_names,
        depth=depth,
    )
    seconds = time.perf_counter() - start
    log.info("stage capture: %.3f s", seconds)
    return Analysis(captured=captured, layers=lg, seconds=seconds, moe=blocks, experts=experts)


def _experts(captured):
    """Find the model's mixture-of-experts blocks and write their experts as one layer each
    (`mopar.ir.moe`); a block that is not recognised stays as it is, with a note."""
    from mopar.ir.moe import apply_moe, find_moe

    found = find_moe(captured.gm, captured.inputs)
    blocks = apply_moe(captured.gm, found)
    if found.notes:
        captured = replace(captured, notes=(*captured.notes, *found.notes))
    return captured, blocks, dict(found.experts)


def experts_of(analysis: Analysis, config: CompileConfig) -> Experts | None:
    """A mixture-of-experts model's blocks and activation trace, as the planner takes them,
    traced on ``config.calibration`` when given (`mopar.profile.experts.experts_for`); None
    for any other model."""
    from mopar.profile.experts import experts_for

    cm = analysis.captured
    return experts_for(analysis.moe, cm.gm, cm.inputs, config.calibration)


def profile(analysis: Analysis, config: CompileConfig, facts: Facts) -> Profile:
    """The profiler's per-layer predictions and, for a mixture-of-experts model, its
    activation trace."""
    from mopar.profile.service import predict_layers

    return Profile(
        layers=predict_layers(analysis.layers, facts.predictors),
        experts=experts_of(analysis, config),
    )


def plan(analysis: Analysis, config: CompileConfig, facts: Facts, profiled: Profile) -> Planned:
    """The plan of an analysed model, from what was ``profiled``; its notes begin with what was
    assumed to read the example inputs."""
    from mopar.planner import make_plan

    vertical = make_plan(
        analysis.layers,
        model=analysis.captured.name,
        config=config,
        moe=profiled.experts,
        prediction=profiled.layers,
        facts=facts,
    )
    vertical = replace(vertical, notes=(*analysis.captured.notes, *vertical.notes))
    return _parallel(analysis, vertical, config, facts)


def plans(
    analysis: Analysis, config: CompileConfig, facts: Facts, profiled: Profile
) -> dict[str, Plan]:
    """Every strategy's plan, ``config.strategy`` first and with η chosen (``mopar plan
    --compare``)."""
    from mopar.planner import make_plans

    made = make_plans(
        analysis.layers,
        model=analysis.captured.name,
        config=config,
        prediction=profiled.layers,
        facts=facts,
        moe=profiled.experts,
    )
    return {
        name: _parallel(analysis, p, config, facts).plan if name == config.strategy else p
        for name, p in made.items()
    }


def _parallel(analysis: Analysis, vertical: Plan, config: CompileConfig, facts: Facts) -> Planned:
    """``vertical`` with η chosen per slice where ``config.parallel`` allows sub-slices, from
    the sharding figures of its slices, measured here (`mopar.profile.shards`)."""
    from mopar.planner import with_parallel
    from mopar.profile.shards import analyze_shards

    if config.parallel < 2:
        return Planned(plan=vertical)
    shards = None
    if not vertical.dispatches():  # else with_parallel refuses, saying why
        shards = analyze_shards(analysis.layers, vertical.vertical(), config.parallel)
    return Planned(plan=with_parallel(vertical, shards, config, facts=facts), shards=shards)


def rewrite(analysis: Analysis, planned: Planned) -> tuple[SliceModule, ...]:
    """One torch `SliceModule` per executable unit of ``planned``, in plan order: its slices
    split out of the layer graph, then sharded into sub-slices as analysed where it says."""
    from mopar.rewrite import split_by_plan
    from mopar.rewrite.experts import expert_units
    from mopar.rewrite.units import expand_units

    p = planned.plan
    slices = split_by_plan(analysis.layers, p)
    units = expand_units(slices, p, planned.shards) if p.sharded else slices
    return expert_units(units, p, analysis.layers, analysis.moe, analysis.experts)


def compress(
    analysis: Analysis,
    units: tuple[SliceModule, ...],
    planned: Plan,
    config: CompileConfig,
    facts: Facts,
    progress: Progress | None,
) -> tuple[tuple[SliceModule, ...], Plan, dict[str, str], Tolerance]:
    """Choose and insert the codec of every cut tensor (`mopar.compress`).

    Returns the units (autoencoders inside), the plan with each function's codec choices, the
    runtime codec of every cut tensor, and the tolerance verification holds the bundle to.
    """
    import numpy as np

    from mopar.compress.calibration import load_calibration
    from mopar.compress.choose import CodecBudget, choose_codecs
    from mopar.errors import Option, PlanError

    if planned.sharded:
        raise PlanError(
            Option("codec"),
            " with sharded sub-slices (",
            Option("parallel"),
            ") is not supported yet; drop one of them",
        )
    if planned.dispatches():
        raise PlanError(
            Option("codec"),
            " with expert functions is not supported yet; drop ",
            Option("codec"),
            ", or pass ",
            Option("experts", value="inline"),
        )
    cm = analysis.captured
    calibration = load_calibration(config.calibration, cm.inputs, seed=config.seed)
    top1 = None if config.max_top1_change is None else config.max_top1_change / 100.0
    budget = CodecBudget(max_output_error=config.max_output_error, max_top1_change=top1)
    coded, choices, runtime = choose_codecs(
        units,
        calibration,
        codec=config.codec,
        budget=budget,
        transfer_ms=lambda _slice, nbytes: facts.platform.handoff(nbytes)[1],
        budget_s=config.codec_budget_s,
        seed=config.seed,
        progress=lambda phase, done, total: _tell(progress, phase, done, total),
    )
    by_slice = {
        f.name: tuple(c.to_dict() for c in choices if c.slice == f.name) for f in planned.functions
    }
    notes = [f"codecs chosen on {calibration.source}", *calibration.notes]
    if calibration.synthetic and any(c.error > 0 for c in choices):
        notes.append(
            "codec quality was estimated on synthetic data (augmented example inputs); "
            "pass --calibration with real samples"
        )
    planned = replace(
        planned,
        functions=tuple(replace(f, codecs=by_slice[f.name]) for f in planned.functions),
        notes=(*planned.notes, *notes),
    )
    lossy = [c for c in choices if c.error > 0]
    tolerance = config.tolerance
    if lossy:  # the reference input need not be a held-out sample: allow the budget, or 2x what
        # was seen, both relative to the outputs' scale; so the absolute tolerance widens
        relative = max(config.max_output_error or 0.0, 2 * max(c.error for c in lossy))
        scale = max(
            (float(np.max(np.abs(v))) for v in cm.reference.values() if v.size), default=0.0
        )
        tolerance = replace(tolerance, atol=max(tolerance.atol, relative * scale))
    return coded, planned, runtime, tolerance


@dataclass(frozen=True, kw_only=True)
class Realised:
    """A plan made concrete for export: its executable units and the tensors between them."""

    plan: Plan  # the plan, with the codec choices when --codec
    slices: tuple[SliceModule, ...]  # one per unit, in plan order
    values: dict[str, torch.Tensor]  # every tensor on the example inputs, by value name
    codecs: dict[str, str]  # runtime codec of each cut tensor
    tolerance: Tolerance  # what verification holds the bundle to


@dataclass(frozen=True, kw_only=True)
class Exported:
    """Every unit of a plan, exported: what it was realised as, and each unit's ONNX file."""

    realised: Realised
    paths: tuple[Path, ...]


def export(
    analysis: Analysis,
    planned: Planned,
    folder: Path,
    *,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    watch: Stopwatch,
    progress: Progress | None,
) -> Exported:
    """Export every unit of ``planned`` to ``folder/<unit>/`` (model.onnx, handler and
    requirements). Where a unit does not export, move one of its slice's cuts
    (`mopar.planner.recut.next_recut` decides which), plan at the new cuts, and realise and
    export that plan instead.

    Raises:
        CaptureError: a slice does not export however its cuts are moved (within
            `mopar.planner.recut.MAX_MOVES`); one line naming the operator, its layer and the
            cuts.
    """
    from mopar.emit.bundle import write_function
    from mopar.emit.onnx_export import export_error, export_units, failure_site, keep_only
    from mopar.errors import CaptureError
    from mopar.planner.recut import MAX_MOVES, Recut, next_recut, plan_cuts, recut_note

    base, lg = planned.plan, analysis.layers
    names = [layer.name for layer in lg.layers]
    original = plan_cuts(base)
    history: list[Recut] = []
    moves: list[str] = []
    done: dict[str, SliceModule] = {}  # the units exported so far, by name
    first = None  # the first failure, its site and its slice
    with watch.stage("export"):
        while True:
            realised = _realise(analysis, planned, config, facts, watch, progress)
            failure = export_units(
                realised.slices,
                realised.values,
                folder,
                opset=config.opset,
                done=done,
                progress=lambda name, i, n: _tell(progress, f"export {name}", i, n),
            )
            if failure is None:
                break
            failing, site = failure_site(failure, lg, planned.plan)
            first = first or (failure, site, failing)
            move = next_recut(original, history, failing, num_layers=len(names))
            if move is None:
                raise CaptureError(export_error(*first, original, names, len(history), MAX_MOVES))
            history.append(move)
            moves.append(recut_note(move, names, failed_slice=failure.slice, why=site))
            log.info("%s; trying again", moves[-1])
            with watch.stage("plan"):
                planned = _replan(analysis, config, facts, profiled, base, move.cuts, tuple(moves))
        keep_only(folder, {s.name for s in realised.slices})
        for s in realised.slices:
            write_function(folder / s.name)
    paths = tuple(folder / s.name / "model.onnx" for s in realised.slices)
    return Exported(realised=realised, paths=paths)


def _realise(
    analysis: Analysis,
    planned: Planned,
    config: CompileConfig,
    facts: Facts,
    watch: Stopwatch,
    progress: Progress | None,
) -> Realised:
    """``planned``'s executable units (rewritten, and compressed with ``--codec``) and the
    tensors between them on the example inputs."""
    from mopar.emit.onnx_export import run_slices_torch

    with watch.stage("rewrite"):
        units = rewrite(analysis, planned)
    p, codecs, tolerance = planned.plan, {}, config.tolerance
    if config.codec != "none":
        with watch.stage("compress"):
            units, p, codecs, tolerance = compress(analysis, units, p, config, facts, progress)
    values = run_slices_torch(units, analysis.captured.inputs)  # each unit's export inputs
    return Realised(
        plan=p, slices=_retype(units, values), values=values, codecs=codecs, tolerance=tolerance
    )


def verify(analysis: Analysis, exported: Exported) -> Comparison:
    """Chain the exported units in onnxruntime against the model's reference outputs
    (`mopar.emit.onnx_export.verify_chain`); `VerificationError` when they disagree."""
    from mopar.emit.onnx_export import verify_chain

    cm, r = analysis.captured, exported.realised
    return verify_chain(
        list(exported.paths),
        r.slices,
        cm.inputs,
        cm.reference,
        _outputs(analysis),
        tolerance=r.tolerance,
    )


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What serving the units found: the plan sized to cover it, each unit's peak RSS (MB)
    and median time (ms), and the request's median latency (ms), alone and, when the unsplit
    model was served beside it, that model's."""

    plan: Plan
    peaks_mb: dict[str, float]
    p50_ms: dict[str, float]
    latency_ms: float
    unsplit_ms: float | None = None

    @property
    def slowdown(self) -> float:
        """The plan's median latency over the unsplit model's (1.0 when not measured)."""
        return self.latency_ms / self.unsplit_ms if self.unsplit_ms else 1.0


@dataclass(frozen=True, kw_only=True)
class Reference:
    """The unsplit model exported to a scratch folder, served beside the plan
    (`CompileConfig.check_latency`): the folder and its realised unit."""

    root: Path
    realised: Realised


def measure(
    root: Path,
    analysis: Analysis,
    realised: Realised,
    facts: Facts,
    *,
    reference: Reference | None = None,
) -> Measured:
    """Serve the reference input through the real runtime, one process per unit (with the
    unsplit ``reference`` side by side, requests interleaved, when given), and size every
    function to at least its peak RSS plus ``facts.measured_margin``."""
    from mopar.planner.sizing import cover_peaks

    report, unsplit = _measure_slices(root, realised, analysis, reference)
    peaks = {s.name: s.peak_rss_mb for s in report.slices}
    sized = cover_peaks(realised.plan, peaks, margin=facts.measured_margin, platform=facts.platform)
    return Measured(
        plan=_with_units(analysis, sized, realised.slices, realised.codecs),
        peaks_mb=peaks,
        p50_ms={s.name: s.p50_ms for s in report.slices},
        latency_ms=report.latency_p50_ms,
        unsplit_ms=unsplit.latency_p50_ms if unsplit else None,
    )


def emit(
    root: Path,
    analysis: Analysis,
    realised: Realised,
    measured: Measured,
    checked: Comparison,
    *,
    config: CompileConfig,
    facts: Facts,
    experts: Experts | None,
    watch: Stopwatch,
) -> None:
    """Write the reference, the deployment files of every target with an emitter
    (`mopar.facts.deploy_targets`), ``plan.json`` and each function's ``function.json`` (derived
    from the same document) into ``root``."""
    from mopar.bundle.document import LatencyCheck, Sizing, Verification
    from mopar.emit.bundle import write_reference
    from mopar.emit.functions import write_function_specs

    cm, estimate, tolerance = analysis.captured, realised.plan, realised.tolerance
    final, peaks, times = measured.plan, measured.peaks_mb, measured.p50_ms
    write_reference(root / "reference.npz", cm.inputs, cm.reference)
    for target in deploy_targets():
        target.emit(root, final, arch=config.arch, facts=facts)
    document = _document(
        analysis,
        final,
        watch,
        io=_io(analysis, realised.slices, realised.codecs, root=root),
        verification=Verification(
            max_abs_err=checked.max_abs_err,
            max_rel_err=checked.max_rel_err,
            rtol=tolerance.rtol,
            atol=tolerance.atol,
        ),
        latency_check=(
            LatencyCheck(
                p50_ms=measured.latency_ms,
                unsplit_p50_ms=measured.unsplit_ms,
                slowdown=round(measured.slowdown, 4),
            )
            if measured.unsplit_ms
            else None
        ),
        experts=_experts_section(experts, config) if experts is not None else None,
        sizing=tuple(
            Sizing(
                function=e.name,
                need_mb=e.need_mb,
                planned_mb=e.memory_mb,
                peak_rss_mb=peaks[e.name],
                memory_mb=p.memory_mb,
                planned_time_ms=e.time_ms,
                p50_ms=times[e.name],
            )
            for e, p in zip(estimate.functions, final.functions)
        ),
    )
    document.write(root)
    write_function_specs(root, final, document.io)


# --- helpers of the stages ------------------------------------------------------------------------


def _replan(
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    base: Plan,
    cuts: Sequence[int],
    notes: Sequence[str],
) -> Planned:
    """``base`` cut at ``cuts`` instead (`export` moved a cut), with ``notes``."""
    from mopar.planner.strategies import plan_at_cuts

    vertical = plan_at_cuts(
        analysis.layers,
        profiled.layers,
        config,
        model=analysis.captured.name,
        facts=facts,
        base=base,
        cuts=cuts,
        notes=notes,
        moe=profiled.experts,
    )
    planned = _parallel(analysis, vertical, config, facts)
    return replace(
        planned, plan=replace(planned.plan, notes=tuple(dict.fromkeys(planned.plan.notes)))
    )


def _retype(
    slices: tuple[SliceModule, ...], values: dict[str, torch.Tensor]
) -> tuple[SliceModule, ...]:
    """Slices whose tensor infos match what actually crosses (an autoencoder's code, not the
    activation it stands for)."""
    from mopar.ir.graph import TensorInfo

    def info(t):
        v = values[t.name]
        if tuple(v.shape) == t.shape:
            return t
        return TensorInfo(
            name=t.name, shape=tuple(v.shape), dtype=t.dtype, nbytes=v.numel() * v.element_size()
        )

    return tuple(
        replace(s, inputs=tuple(map(info, s.inputs)), outputs=tuple(map(info, s.outputs)))
        for s in slices
    )


def _measure_slices(
    root: Path, realised: Realised, analysis: Analysis, reference: Reference | None
) -> tuple[RunReport, RunReport | None]:
    """Serve the reference input through the real runtime, one process per slice; with
    ``reference``, its unsplit unit too, interleaved (`run_bundles`), so that drift of a busy
    machine falls on both alike.

    Returns the plan's `RunReport` and the reference's (None without one).
    """
    from mopar.config import RunConfig
    from mopar.errors import VerificationError
    from mopar.runner.local import run_bundles

    cm, tolerance = analysis.captured, realised.tolerance
    manifests = [_manifest(root, analysis, realised)]
    if reference is not None:
        manifests.append(_manifest(reference.root, analysis, reference.realised))
    # Ten requests, not one: peak RSS creeps up over the first ~10 runs (glibc raises its mmap
    # threshold after large frees and keeps freed buffers), then levels off; the profiler found it.
    reports = run_bundles(
        manifests,
        cm.inputs,
        config=RunConfig(requests=9, tolerance=tolerance),
        expected=cm.reference,
    )
    for report in reports:
        if report.errors or not report.comparison.passed:
            raise VerificationError(
                f"the slices disagree with the model when run as processes: "
                f"{report.comparison.describe(tolerance)}, errors {list(report.error_messages)}; "
                "report this"
            )
    return reports[0], (reports[1] if reference is not None else None)


def _manifest(root: Path, analysis: Analysis, realised: Realised):
    """The runner's manifest of ``realised``'s units, exported under ``root``: the one
    `mopar.runner.bundle.manifest_of` makes of their ``plan.json`` document, before it is
    written."""
    from mopar.bundle.document import BundleDocument
    from mopar.runner.bundle import manifest_of

    io = _io(analysis, realised.slices, realised.codecs, root=root)
    return manifest_of(root, BundleDocument(plan=realised.plan.to_dict(), io=io))


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


def with_units(
    plan: Plan,
    units: Sequence[SliceModule],
    *,
    model_inputs: Iterable[str],
    model_outputs: Iterable[str],
    codecs: dict[str, str],
) -> Plan:
    """``plan`` with the edges its executable ``units`` (in plan order) really have: the exact
    tensors between them, with their codecs, each edge keeping the transport its producer hands
    on by."""
    from mopar.plan import data_edges

    nbytes = {t.name: t.nbytes for u in units for t in (*u.inputs, *u.outputs)}
    fed = {u.name for u in units if u.rows}  # expert functions: the plan's edges
    edges = data_edges(
        [
            (u.name, [t.name for t in u.inputs], [t.name for t in u.outputs])
            for u in units
            if u.name not in fed
        ],
        model_inputs=model_inputs,
        model_outputs=model_outputs,
        nbytes=nbytes,
        transport={f.name: plan.handoff(f.name) for f in plan.functions},
        codecs=codecs,
    )
    kept = tuple(e for e in plan.edges if e.src in fed or e.dst in fed)
    return replace(plan, edges=edges + kept)


def _with_units(
    analysis: Analysis, planned: Plan, units: tuple[SliceModule, ...], codecs: dict[str, str]
) -> Plan:
    return with_units(
        planned,
        units,
        model_inputs=analysis.captured.input_names,
        model_outputs=_outputs(analysis).values(),
        codecs=codecs,
    )


def _outputs(analysis: Analysis) -> dict[str, str]:
    """The model's public output names and the layer-graph value of each."""
    from mopar.rewrite import output_values

    return dict(zip(analysis.captured.output_names, output_values(analysis.layers)))


def _tell(progress: Progress | None, phase: str, done: int, total: int) -> None:
    log.info("%s (%d/%d)", phase, done, total)
    if progress is not None:
        progress(phase, done, total)


# --- plan.json ------------------------------------------------------------------------------------


def _io(analysis: Analysis, units, codecs: dict[str, str], *, root: Path | None):
    """The ``io`` section (an `mopar.bundle.document.Io`): the model's inputs and outputs, and
    what each unit takes and gives (with its ONNX file, its weights file if it has one, and
    codecs once exported to ``root``; else, ``root`` None, its FX code)."""
    from mopar.bundle.document import Io, IoFunction, IoOutput, IoTensor
    from mopar.bundle.layout import FUNCTIONS_DIR, MODEL_FILE, WEIGHTS_FILE

    lg = analysis.layers
    tensors = lambda ts: tuple(  # noqa: E731
        IoTensor(name=t.name, shape=tuple(t.shape), dtype=t.dtype, nbytes=t.nbytes) for t in ts
    )

    def unit(s) -> IoFunction:
        folder = f"{FUNCTIONS_DIR}/{s.name}"
        exported = root is not None
        weights = exported and (root / folder / WEIGHTS_FILE).is_file()
        return IoFunction(
            name=s.name,
            inputs=tensors(s.inputs),
            outputs=tensors(s.outputs),
            graph=None if exported else f"{folder}/graph.py",
            onnx=f"{folder}/{MODEL_FILE}" if exported else None,
            weights=f"{folder}/{WEIGHTS_FILE}" if weights else None,
            dispatch=s.dispatch.spec if exported and s.dispatch is not None else None,
            rows=bool(s.rows),
            codecs={t.name: codecs[t.name] for t in s.outputs if t.name in codecs},
        )

    outputs = {t.name: t for t in lg.outputs}
    return Io(
        inputs=tensors(lg.inputs),
        outputs=tuple(
            IoOutput(name=pub, value=v, shape=tuple(outputs[pub].shape), dtype=outputs[pub].dtype)
            for pub, v in _outputs(analysis).items()
        ),
        functions=tuple(unit(s) for s in units),
    )


def _experts_section(moe: Experts, config: CompileConfig) -> dict:
    """``plan.json``'s ``experts``: each MoE layer found, and the activation trace planned with."""
    return {
        "mode": config.experts,
        "layers": [{"layer": b.name, **b.describe()} for b in moe.blocks],
        "trace": moe.trace.to_dict(),
    }


def _document(analysis: Analysis, planned, watch: Stopwatch, **sections):
    """``plan.json`` (a `mopar.bundle.document.BundleDocument`): the plan, the given sections,
    the layers and the stages' seconds so far, stamped with the versions that made it."""
    from mopar.bundle.document import BundleDocument, LayerSummary, StageSeconds
    from mopar.emit.bundle import stamp

    return BundleDocument(
        **stamp(),
        plan=planned.to_dict(),
        **sections,
        layers=tuple(
            LayerSummary(
                name=la.name,
                type=la.module_type,
                param_bytes=la.param_bytes,
                flops=la.flops,
                output_bytes=la.output_bytes,
            )
            for la in analysis.layers.layers
        ),
        stages=tuple(StageSeconds(stage=t.stage, seconds=t.seconds) for t in watch.times()),
    )


def _write_partial(
    root: Path, analysis: Analysis, planned, until: str, watch: Stopwatch, **sections
) -> None:
    """The ``plan.json`` of a compile stopped after stage ``until``."""
    _document(analysis, planned, watch, until=until, **sections).write(root)


def _write_graphs(root: Path, units) -> None:
    """Each unit's FX code, ``functions/<unit>/graph.py``, to read (not to run)."""
    for s in units:
        folder = root / "functions" / s.name
        folder.mkdir(parents=True, exist_ok=True)
        args = ", ".join(t.name for t in s.inputs)
        head = (
            f"# {s.name}: the FX code of this unit's forward({args}), as `mopar compile "
            "--until rewrite` left it; it returns " + ", ".join(t.name for t in s.outputs)
        )
        (folder / "graph.py").write_text(f"{head}\n{s.gm.code.strip()}\n")
