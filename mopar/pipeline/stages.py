"""One function per compile stage (see `mopar.pipeline`), and their helpers."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mopar.arguments import example_arrays
from mopar.bill import bill_generation, prewarms
from mopar.bundle.generation import NEW_TOKENS, GenerationTiming
from mopar.bundle.layout import FUNCTIONS_DIR, REFERENCE_FILE, TOKENIZER_FILE
from mopar.compress.calibration import load_calibration
from mopar.compress.choose import choose_codecs
from mopar.config import CompileConfig, DynamicDim, Tolerance
from mopar.emit.bundle import write_function, write_reference
from mopar.emit.functions import deployed, gather_units, write_function_specs
from mopar.emit.onnx_export import (
    export_error,
    export_units,
    failure_site,
    keep_only,
    run_slices_torch,
)
from mopar.emit.session import half_note
from mopar.errors import (
    CaptureError,
    InputSpecError,
    InternalError,
    Option,
    PartitionInfeasibleError,
    PlanError,
)
from mopar.facts import MB, Facts
from mopar.frontend import capture as capture_model
from mopar.frontend import load_model
from mopar.frontend.capture import keep_last as keep_last_of
from mopar.frontend.dynamic import PICKS, resized
from mopar.frontend.generate import generation_step
from mopar.ir import build_layer_graph
from mopar.ir.dynamic import Dynamic, program_name, values_of
from mopar.ir.graph import TensorInfo
from mopar.ir.moe import apply_moe, find_moe
from mopar.ir.subgraph import placeholders
from mopar.pipeline.document import (
    bundle_document,
    experts_section,
    generation_section,
    io_section,
    public_outputs,
)
from mopar.pipeline.finish import Handoff, finished_sections
from mopar.pipeline.latency import checks_latency, plan_note
from mopar.pipeline.lossy import budget_of, quantize, widened
from mopar.pipeline.serving import sizing_requests
from mopar.pipeline.values import (
    Analysis,
    Exported,
    Measured,
    Planned,
    Profile,
    Progress,
    Realised,
    Stopwatch,
    tell_progress,
)
from mopar.plan import RESPONSE, data_edges
from mopar.plan.notes import GenerationCost, Note, Remark, as_notes, note_record
from mopar.planner import make_plan, make_plans, with_parallel
from mopar.planner.problem import one_vcpu
from mopar.planner.recut import MAX_MOVES, Recut, next_recut, plan_cuts, recut_note
from mopar.planner.strategies import plan_at_cuts
from mopar.profile.experts import experts_for
from mopar.profile.service import predict_layers
from mopar.profile.shards import analyze_shards
from mopar.rewrite import split_by_plan
from mopar.rewrite.experts import expert_units
from mopar.rewrite.units import expand_units
from mopar.runner.generation import time_generation
from mopar.runner.inprocess import verify_chain
from mopar.target import target_or_default

if TYPE_CHECKING:
    import torch

    from mopar.ir.subgraph import SliceModule
    from mopar.plan import Plan
    from mopar.profile.experts import Experts
    from mopar.runner.check import Comparison

log = logging.getLogger(__name__)

T = TypeVar("T")

# --- the stages -----------------------------------------------------------------------------------


def capture(
    model: Any,
    example_args: Any,
    example_kwargs: Any,
    *,
    depth: int | None,
    trust_pickle: bool,
    progress: Progress | None,
    dims: tuple[DynamicDim, ...] = (),
    generate: bool = False,
    max_seq_len: int | None = None,
    keep_last: bool = False,
) -> Analysis:
    """Load ``model``, torch.export it on its example inputs (``dims`` left dynamic) and group
    it into layers; with ``generate``, its generation step instead
    (`mopar.frontend.generate.generation_step`); with ``keep_last``, answering with the last
    position alone (`mopar.frontend.capture.keep_last`)."""

    start = time.perf_counter()
    tell_progress(progress, "load", 0, 3)
    loaded = load_model(model, trust_pickle=trust_pickle)
    tell_progress(progress, "export", 1, 3)
    step = None
    if generate:
        loaded, step = generation_step(
            model, loaded, example_args, example_kwargs, dims, max_seq_len
        )
        # a model without weights is planned at the example's sizes only (mopar plan)
        arrays, dims = step.example, (() if loaded.weightless else step.dims)
        notes = (
            f"generation: the decoder's step (prompt or token, and the key-value cache of up to "
            f"{step.names.max_seq_len - 1} tokens before it): a main function holds the cache, "
            "runs the decoding loop and the plan's slices and dispatches, and calls its expert "
            "functions per step",
        )
    else:
        arrays, notes = example_arrays(loaded, example_args, example_kwargs)
    captured = capture_model(loaded, arrays, notes=notes, dims=dims)
    captured = keep_last_of(captured) if keep_last else captured
    captured, blocks, experts = _experts(captured)
    if blocks and captured.dims and step is None:  # a generation step's are supported
        raise InputSpecError(
            f"{captured.name} is a mixture-of-experts model, and its dynamic dimensions "
            f"({', '.join(map(str, captured.dims))}) are not supported for those yet; leave out ",
            Option("dynamic"),
            " (a .pt2's own: export it at fixed sizes)",
        )
    tell_progress(progress, "layers", 2, 3)
    lg = build_layer_graph(
        captured.gm,
        input_names=captured.input_names,
        output_names=captured.output_names,
        depth=depth,
    )
    seconds = time.perf_counter() - start
    log.info("stage capture: %.3f s", seconds)
    return Analysis(
        captured=captured,
        layers=lg,
        seconds=seconds,
        moe=blocks,
        experts=experts,
        generation=step.names if step is not None else None,
    )


def _experts(captured):
    """Find the model's mixture-of-experts blocks and write their experts as one layer each
    (`mopar.ir.moe`); a block that is not recognised stays as it is, with a note."""

    found = find_moe(captured.gm, captured.inputs)
    blocks = apply_moe(captured.gm, found)
    if blocks and captured.program is not None:  # the same nodes, its sizes symbolic
        on_program = apply_moe(captured.program, found)
        if [b.output for b in on_program] != [b.output for b in blocks]:
            raise InternalError(
                f"the experts' translation names {[b.output for b in blocks]} in the static "
                f"graph and {[b.output for b in on_program]} in the program"
            )
    if found.notes:
        captured = replace(captured, notes=(*captured.notes, *found.notes))
    return captured, blocks, dict(found.experts)


def experts_of(analysis: Analysis, config: CompileConfig) -> Experts | None:
    """A mixture-of-experts model's blocks and activation trace, as the planner takes them,
    traced on ``config.calibration`` when given (`mopar.profile.experts.experts_for`); None
    for any other model."""

    cm = analysis.captured
    return experts_for(analysis.moe, cm.gm, cm.inputs, config.calibration)


def profile(analysis: Analysis, config: CompileConfig, facts: Facts) -> Profile:
    """The profiler's per-layer predictions and, for a mixture-of-experts model, its
    activation trace."""

    return Profile(
        layers=predict_layers(analysis.layers, facts.predictors),
        experts=experts_of(analysis, config),
    )


def plan(analysis: Analysis, config: CompileConfig, facts: Facts, profiled: Profile) -> Planned:
    """The plan of an analysed model, from what was ``profiled``; its notes begin with what was
    assumed to read the example inputs, and end, where compile's latency check will serve it
    (`mopar.pipeline.latency.checks_latency`), with a note that compile may plan again."""

    vertical, unmargined = _within_memory(make_plan, analysis, config, facts, profiled)
    notes = (*as_notes(*analysis.captured.notes), *vertical.notes, *unmargined)
    vertical = replace(vertical, notes=notes)
    planned = _parallel(analysis, vertical, config, facts)
    _main_fits(analysis, planned.plan, facts)
    planned = replace(planned, plan=generation_cost(analysis, planned.plan, facts))
    if checks_latency(config, planned.plan):  # compile may write another plan: say so
        p = planned.plan
        planned = replace(planned, plan=replace(p, notes=(*p.notes, plan_note(config))))
    return planned


def plans(
    analysis: Analysis, config: CompileConfig, facts: Facts, profiled: Profile
) -> dict[str, Plan]:
    """Every strategy's plan, ``config.strategy`` first and with η chosen (``mopar plan
    --compare``)."""

    made, unmargined = _within_memory(make_plans, analysis, config, facts, profiled)
    made = {name: replace(p, notes=(*p.notes, *unmargined)) for name, p in made.items()}
    _main_fits(analysis, made[config.strategy], facts)
    made = {
        name: _parallel(analysis, p, config, facts).plan if name == config.strategy else p
        for name, p in made.items()
    }
    return {name: generation_cost(analysis, p, facts) for name, p in made.items()}


def _main_fits(analysis: Analysis, plan: Plan, facts: Facts) -> None:
    """Refuse a ``--generate`` plan whose main function cannot exist: it holds the key-value
    cache and runs every function of the plan's path in its own process (the expert functions
    apart), so their needs, the runtime counted once, must fit one function of the target."""

    path = plan.path()
    if analysis.generation is None or len(path) < 2:
        return
    need = sum(f.need_mb for f in path) - (len(path) - 1) * facts.platform.baseline_mb
    largest = facts.platform.max_mb
    if need <= largest:
        return
    weights = sum(f.param_bytes for f in path) / MB
    room = largest - (need - weights)
    raise PartitionInfeasibleError(
        f"{analysis.captured.name} with ",
        Option("generate"),
        " needs one main function of "
        f"{need:,.0f} MB ({weights:,.0f} MB of weights): it holds the key-value cache and "
        f"runs all {len(path)} slices of the plan, over {facts.platform.target}'s "
        f"{largest:,} MB; slices that each keep their own part of the cache are not "
        "supported yet",
        f"what fits: a decoder of at most {max(room, 0):,.0f} MB of weights on "
        f"{facts.platform.target}",
        *(
            (", or ", Option("target", value="openfaas"), " (functions as large as a node)")
            if facts.platform.target == "lambda"
            else ()
        ),
    )


def generation_cost(
    analysis: Analysis, plan: Plan, facts: Facts, timing: GenerationTiming | None = None
) -> Plan:
    """``plan`` with its `GenerationCost` note (none but for ``--generate``): the bill of a
    generation of `NEW_TOKENS` after the example's prompt, on the plan as deployed. The main
    function is busy for the priced step (the example's: its prompt after a cache of half the
    sequence) times the generation's length in steps: `NEW_TOKENS` steps, or, where compile
    timed a generation (``timing``), its measured time over its first token's. The price
    stays the target's: the measurement gives the generation's shape, never this machine's
    speed."""

    generation = generation_section(analysis, plan)
    if generation is None:
        return plan
    generation = replace(generation, timing=timing)
    shown = deployed(plan, generation, facts.platform)
    step_ms = shown.function(generation.function).time_ms
    prompt = int(analysis.captured.inputs[generation.input_ids].shape[1])
    if timing is None:
        steps, timed = float(NEW_TOKENS), f"{NEW_TOKENS} steps, each priced as the planned one"
    else:
        steps = timing.request_ms(NEW_TOKENS) / timing.first_token_ms
        timed = (
            f"{steps:.3g} times the priced step, as compile's timed generation is its first "
            f"token's {timing.first_token_ms:.3g} ms then {timing.token_p50_ms:.3g} ms a token"
        )
    cost = bill_generation(
        shown,
        facts.platform,
        generation.function,
        generation_ms=step_ms * steps,
        prompt_tokens=prompt,
        new_tokens=NEW_TOKENS,
        timed=timed,
    )
    kept = tuple(n for n in plan.notes if not isinstance(n, GenerationCost))
    return replace(plan, notes=(*kept, cost))


def _within_memory(
    make: Callable[..., T],
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
) -> tuple[T, tuple[Note, ...]]:
    """What planner ``make`` (`mopar.planner.make_plan` or ``make_plans``) makes of
    ``analysis`` at the profiled predictions; where no plan fits the memory allowed
    with their margin on each layer's transient, at the predictions without it, and a note that
    says so (where none fits even so, that refusal is raised: it names the smallest memory
    planning accepts). Measured peaks then decide: compile measures every function and fails,
    naming the memory it needs, where one is over (`mopar.planner.sizing.cover_peaks`)."""

    def at(prediction) -> T:
        return make(
            analysis.layers,
            model=analysis.captured.name,
            config=config,
            moe=profiled.experts,
            prediction=prediction,
            facts=facts,
        )

    layers = profiled.layers
    try:
        return at(layers), ()
    except PartitionInfeasibleError as refused:
        if layers.unmargined_mb == layers.memory_mb:
            raise
        why = refused.why()
    made = at(replace(layers, memory_mb=layers.unmargined_mb))
    return made, (
        Remark(
            f"planned at the memory predictions without their margin: with it, {why}; the "
            "sizes hold only where compile's measured peaks do (a function measured over them "
            "fails the compile, naming the memory it needs)"
        ),
    )


def _parallel(analysis: Analysis, vertical: Plan, config: CompileConfig, facts: Facts) -> Planned:
    """``vertical`` with η chosen per slice where ``config.parallel`` allows sub-slices, from
    the sharding figures of its slices, measured here (`mopar.profile.shards`)."""

    if config.parallel < 2:
        return Planned(plan=vertical)
    shards = None
    if not vertical.dispatches():  # else with_parallel refuses, saying why
        shards = analyze_shards(analysis.layers, vertical.vertical(), config.parallel)
    return Planned(plan=with_parallel(vertical, shards, config, facts=facts), shards=shards)


def rewrite(analysis: Analysis, planned: Planned) -> tuple[SliceModule, ...]:
    """One torch `SliceModule` per executable unit of ``planned``, in plan order: its slices
    split out of the layer graph, then sharded into sub-slices as analysed where it says."""

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
    coded, choices, runtime = choose_codecs(
        units,
        calibration,
        codec=config.codec,
        budget=budget_of(config),
        transfer_ms=lambda _slice, nbytes: facts.platform.handoff(nbytes)[1],
        budget_s=config.codec_budget_s,
        seed=config.seed,
        progress=lambda phase, done, total: tell_progress(progress, phase, done, total),
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
        notes=(*planned.notes, *as_notes(*notes)),
    )
    seen = max((c.error for c in choices), default=0.0)
    return coded, planned, runtime, widened(config.tolerance, config, seen, cm.reference)


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
                progress=lambda name, i, n: tell_progress(progress, f"export {name}", i, n),
                shapes=_dynamic(analysis, realised.slices),
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
                planned = replan(analysis, config, facts, profiled, base, move.cuts, tuple(moves))
        keep_only(folder, {s.name for s in realised.slices})
        for s in realised.slices:
            write_function(folder / s.name)
    paths = tuple(folder / s.name / "model.onnx" for s in realised.slices)
    realised = replace(realised, compute=_compute(realised.plan, profiled))
    exported = Exported(realised=realised, paths=paths)
    if config.quantize != "none":
        with watch.stage("quantize"):
            exported = quantize(analysis, exported, config, facts, progress)
    return exported


def with_half_notes(exported: Exported, config: CompileConfig) -> Exported:
    """``exported`` with the plan's notes on the 16-bit weights its functions cast where used
    (`mopar.emit.session.half_note`; a quantised one holds none). Each measures a session of
    its function: the driver runs it while the model's weights are out of memory."""
    r = exported.realised
    half = (
        half_note(s.name, p, max_slowdown=config.max_slowdown)
        for s, p in zip(r.slices, exported.paths)
    )
    plan = replace(r.plan, notes=(*r.plan.notes, *as_notes(*filter(None, half))))
    return replace(exported, realised=replace(r, plan=plan))


def _compute(plan: Plan, profiled: Profile) -> dict[str, tuple[float, float]]:
    """Each slice function's predicted compute at one vCPU and its parallel part (ms), from
    its layers' predictions: what `mopar.planner.sizing.cover_peaks` re-sizes it by where
    CPU follows memory. Sharded, expert and dispatch functions are left out."""

    layers = profiled.layers
    per = {
        name: one_vcpu(t, p, layers.threads)
        for name, t, p in zip(layers.layers, layers.time_ms, layers.parallel)
    }
    return {
        f.name: (sum(per[n][0] for n in f.layers), sum(per[n][1] for n in f.layers))
        for f in plan.functions
        if f.kind == "slice" and f.parallel == 1 and f.layers and all(n in per for n in f.layers)
    }


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

    with watch.stage("rewrite"):
        units = rewrite(analysis, planned)
    p, codecs, tolerance = planned.plan, {}, config.tolerance
    if config.codec != "none":
        with watch.stage("compress"):
            units, p, codecs, tolerance = compress(analysis, units, p, config, facts, progress)
    cm = analysis.captured
    known = {v: cm.reference[name] for name, v in public_outputs(analysis).items()}
    values = run_slices_torch(units, cm.inputs, known)  # each unit's export inputs
    return Realised(
        plan=p, slices=_retype(units, values), values=values, codecs=codecs, tolerance=tolerance
    )


def verify(analysis: Analysis, exported: Exported) -> Comparison:
    """Chain the exported units in onnxruntime against the model's reference outputs
    (`mopar.runner.inprocess.verify_chain`); `VerificationError` when they disagree."""

    cm, r = analysis.captured, exported.realised
    checked = verify_chain(
        list(exported.paths),
        r.slices,
        cm.inputs,
        cm.reference,
        public_outputs(analysis),
        tolerance=r.tolerance,
    )
    for pick in PICKS if cm.program is not None else ():
        inputs, reference = at_sizes(cm, pick)
        checked = checked.merge(
            verify_chain(
                list(exported.paths),
                r.slices,
                inputs,
                reference,
                public_outputs(analysis),
                tolerance=r.tolerance,
                where=f" at the {pick} sizes ({_sizes(inputs, cm.dims)})",
            )
        )
    return checked


def at_sizes(cm, pick: str) -> tuple[dict, dict]:
    """(inputs, the model's outputs on them) of captured model ``cm`` with its dynamic
    dimensions at their ``pick`` sizes (`mopar.frontend.dynamic.sizes_at`); the outputs are
    the captured program's."""

    inputs = resized(cm.inputs, cm.dims, pick)
    out = values_of(cm.program, inputs.values(), ())
    reference = {n: out[f"output:{i}"].numpy() for i, n in enumerate(cm.output_names)}
    return inputs, reference


def _sizes(inputs: dict, dims) -> str:
    return ", ".join(f"{n} {list(inputs[n].shape)}" for n in dict.fromkeys(d.input for d in dims))


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
) -> Plan:
    """Write the reference, each function's ``function.json``, the deployment files of the
    target the plan was made for (`mopar.target.target_or_default`: its emitter, its files
    alone, sized by this plan) and ``plan.json`` (from the same ``io``) into ``root``; a
    ``--generate`` bundle's generation is timed in between, and billed (`generation_cost`).
    Returns the plan written."""

    cm, estimate, tolerance = analysis.captured, realised.plan, realised.tolerance
    final = measured.plan
    write_reference(root / REFERENCE_FILE, cm.inputs, cm.reference)
    tokenizer = analysis.generation.tokenizer if analysis.generation is not None else None
    io = io_section(analysis, realised.slices, realised.codecs, root=root)
    generation = generation_section(analysis, final)
    write_function_specs(root, final, io, generation, prewarms(final, facts.platform))
    gather_units(root, generation)
    if tokenizer is not None:  # the main function tokenizes a request's text with its copy
        main = root / FUNCTIONS_DIR / generation.function
        for into in (root, main):
            shutil.copyfile(tokenizer, into / TOKENIZER_FILE)
        write_function(main, tokenizer=True)  # its image installs tokenizers
    if generation is not None:  # a generation timed, for the bill of a whole request
        prompt = cm.inputs[generation.input_ids]
        timing = time_generation(root, generation, prompt, margin=facts.measured_margin)
        generation = replace(generation, timing=timing)
        final = generation_cost(analysis, final, facts, timing)
    target = target_or_default(final.target)
    target.emit(root, deployed(final, generation, facts.platform), config=config, facts=facts)
    document = bundle_document(
        analysis,
        final,
        watch,
        io=io,
        experts=experts_section(experts, config) if experts is not None else None,
        generation=generation,
        **finished_sections(estimate, final, measured, checked, tolerance),
    )
    document.write(root)
    return final


def hand_off(
    root: Path, out: Path, analysis: Analysis, exported: Exported, *, force: bool, watch: Stopwatch
) -> None:
    """Stage what `mopar.pipeline.finish.finish_staged` needs into ``root``, beside the
    exported functions: ``reference.npz``, each ``function.json`` and a ``plan.json`` of the
    estimate (with its ``io`` section), and its `mopar.pipeline.finish.Handoff`."""

    cm, r = analysis.captured, exported.realised
    write_reference(root / REFERENCE_FILE, cm.inputs, cm.reference)
    io = io_section(analysis, r.slices, r.codecs, root=root)
    write_function_specs(root, r.plan, io)
    bundle_document(analysis, r.plan, watch, io=io).write(root)
    united = with_units_of(analysis, r.plan, r.slices, r.codecs)
    Handoff(
        out=str(out),
        force=force,
        requests=sizing_requests(analysis),
        compute=r.compute,
        edges=tuple(united.to_dict()["edges"]),
        notes=tuple(note_record(n) for n in r.plan.notes),
        tolerance=r.tolerance,
        stages=watch.times(),
    ).write(root)


# --- helpers of the stages ------------------------------------------------------------------------


def replan(
    analysis: Analysis,
    config: CompileConfig,
    facts: Facts,
    profiled: Profile,
    base: Plan,
    cuts: Sequence[int],
    notes: Sequence[Note | str],
) -> Planned:
    """``base`` cut at ``cuts`` instead (`export` moved a cut), with ``notes``."""

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


def _dynamic(analysis: Analysis, slices: Sequence[SliceModule]):
    """What exporting ``slices`` with the model's dynamic dimensions needs
    (`mopar.ir.dynamic.Dynamic`), or None for a model without."""

    cm = analysis.captured
    if cm.program is None:
        return None
    units = [*slices]
    for s in slices:  # a dispatch's own: the layer's tail, its hot experts, the next router
        if s.dispatch is not None:
            units += [u for u in (s.dispatch.tail, s.dispatch.hot, s.dispatch.warm) if u]
    names = {program_name(p) for u in units for p in placeholders(u.gm.graph)}
    middle = resized(cm.inputs, cm.dims, "mid")
    return Dynamic(
        program=cm.program,
        ranges=cm.ranges,
        values=values_of(cm.program, middle.values(), names),
    )


def _retype(
    slices: tuple[SliceModule, ...], values: dict[str, torch.Tensor]
) -> tuple[SliceModule, ...]:
    """Slices whose tensor infos match what actually crosses (an autoencoder's code, not the
    activation it stands for)."""

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
        transport={**{f.name: plan.handoff(f.name) for f in plan.functions}, RESPONSE: plan.answer},
        codecs=codecs,
    )
    kept = tuple(e for e in plan.edges if e.src in fed or e.dst in fed)
    return replace(plan, edges=edges + kept)


def with_units_of(
    analysis: Analysis, planned: Plan, units: tuple[SliceModule, ...], codecs: dict[str, str]
) -> Plan:
    return with_units(
        planned,
        units,
        model_inputs=analysis.captured.input_names,
        model_outputs=public_outputs(analysis).values(),
        codecs=codecs,
    )
