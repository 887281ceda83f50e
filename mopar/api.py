"""The public Python API: `analyze`, `partition` and `compile` (docs/api.md).

Each runs the phases in order -- frontend, ir, partition, rewrite, emit -- and returns data.
Each takes what `torch.export.export` takes -- a model, a tuple of positional example inputs and
a dict of keyword ones -- or mopar's own input forms (`mopar.arguments` has the rule). Every
failure a caller can fix is a `MoparError` that names the Python argument. Nothing here prints
or warns: mopar logs through `logging` (the ``mopar`` logger), and ``progress`` hears about
phases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mopar.arguments import (
    COMPILE_OPTIONS, PLAN_OPTIONS, check_arguments, compile_config, example_arrays,
    python_terms,
)
from mopar.config import CompileConfig, Tolerance
from mopar.errors import OptionError

__all__ = ["Bundle", "Analysis", "analyze", "partition", "compile"]

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
Model = Any  # an nn.Module, a torch.export.ExportedProgram, a file path, or "package.module:factory"
ExampleArgs = tuple | Mapping[str, Any] | list[str] | str | os.PathLike | None
ExampleKwargs = Mapping[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """A captured model and its layer graph."""

    captured: Any  # mopar.frontend.CapturedModel
    layers: Any  # mopar.ir.LayerGraph


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """A written bundle.

    Attributes:
        path: the bundle folder.
        plan: the Plan it carries out.
        max_abs_err: onnxruntime chain vs the original model, absolute.
        max_rel_err: the same, relative to the largest reference magnitude.
        tolerance: the allclose tolerances it was verified with.
    """

    path: Path
    plan: Any  # mopar.planner.Plan
    max_abs_err: float
    max_rel_err: float
    tolerance: Tolerance


@python_terms
def analyze(
    model: Model,
    example_args: ExampleArgs = None,
    example_kwargs: ExampleKwargs = None,
    *,
    depth: int | None = None,
    trust_pickle: bool = False,
    progress: Progress | None = None,
) -> Analysis:
    """Load and capture ``model`` and group it into layers.

    Args:
        model: an ``nn.Module``, a ``torch.export.ExportedProgram``, the path of a ``.pt2``
            or TorchScript ``.pt`` file, or a factory ``"package.module:function"``.
        example_args: positional example inputs, as `torch.export.export` takes them:
            ``(x,)``; or a dict of inputs by name, a list of ``"NAME=SHAPE:DTYPE"`` specs, or
            an ``.npz`` path. None: a ``.pt2`` or ExportedProgram uses its own.
        example_kwargs: example inputs by forward() parameter name: ``{"x": x}``.
        depth: group layers by module path truncated to this depth (None: leaf modules).
        trust_pickle: allow loading a pickled ``nn.Module`` file (unpickling runs its code).
        progress: called as ``progress(phase, done, total)`` when a phase starts.

    Raises:
        MoparError: a subclass naming the argument at fault and the fix.
    """
    from mopar.frontend import capture, load_model
    from mopar.ir import build_layer_graph

    check_arguments(depth=depth, trust_pickle=trust_pickle, progress=progress)
    _tell(progress, "load", 0, 3)
    loaded = load_model(model, trust_pickle=trust_pickle)
    _tell(progress, "export", 1, 3)
    arrays, notes = example_arrays(loaded, example_args, example_kwargs)
    captured = capture(loaded, arrays, notes=notes)
    _tell(progress, "layers", 2, 3)
    lg = build_layer_graph(captured.gm, input_names=captured.input_names,
                           output_names=captured.output_names, depth=depth)
    return Analysis(captured=captured, layers=lg)


@python_terms
def partition(
    model: Model,
    example_args: ExampleArgs = None,
    example_kwargs: ExampleKwargs = None,
    *,
    depth: int | None = None,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    **options: Any,
):
    """Plan how to cut ``model`` into functions; returns a frozen `mopar.planner.Plan`.

    ``model``, ``example_args``, ``example_kwargs``, ``depth``, ``trust_pickle`` and
    ``progress`` are as in `analyze`. ``options`` are the planning fields of `CompileConfig`:
    ``slices``, ``strategy``, ``target``, ``transport``, ``arch``, ``slo_ms``,
    ``simplify_threshold``, ``min_memory``, ``parallel``, ``force_parallel``, ``profiles_dir``.

    Raises:
        MoparError: a subclass naming the argument at fault and the fix; an unknown option is
            an `OptionError` listing the valid ones.
    """
    config = compile_config("partition", PLAN_OPTIONS, depth=depth, options=options)
    analysis = analyze(model, example_args, example_kwargs, depth=depth,
                       trust_pickle=trust_pickle, progress=progress)
    return plan_from(analysis, config, predict(analysis.layers, config))


def plan_from(analysis: Analysis, config: CompileConfig, prediction):
    """The `Plan` of an analysed model for ``config``, from per-layer ``prediction``; its notes
    begin with what was assumed to read the example inputs."""
    from dataclasses import replace

    from mopar.planner import make_plan

    plan = make_plan(analysis.layers, model=analysis.captured.name, config=config,
                     prediction=prediction)
    return replace(plan, notes=(*analysis.captured.notes, *plan.notes))


def predict(lg, config: CompileConfig):
    """The profiler's per-layer predictions (`LayerPrediction`) from the predictors in
    ``config.profiles_dir``, or the shipped ones when that folder has none."""
    from mopar.config import PROFILES_DIR
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.service import predict_layers
    from mopar.profile.store import load_predictors

    folder = Path(config.profiles_dir)
    if not (folder / "predictors.json").is_file():
        log.info("no predictors in %s; using the shipped ones", folder)
        folder = PROFILES_DIR
    return predict_layers(lg, load_predictors(folder, feature_names=FEATURE_NAMES))


@python_terms
def compile(  # noqa: A001 - the verb users expect, like torch.compile
    model: Model,
    example_args: ExampleArgs = None,
    example_kwargs: ExampleKwargs = None,
    *,
    out: str | os.PathLike | None = None,
    depth: int | None = None,
    trust_pickle: bool = False,
    force: bool = False,
    progress: Progress | None = None,
    **options: Any,
) -> Bundle:
    """Compile ``model`` into a bundle at ``out`` (written atomically) and verify it.

    ``model``, ``example_args``, ``example_kwargs``, ``depth``, ``trust_pickle`` and
    ``progress`` are as in `analyze`; ``force`` replaces an existing ``out``. ``options`` are
    `CompileConfig` fields (``slices``, ``strategy``, ``target``, ``codec``, ``tolerance`` ...),
    and ``rtol``/``atol`` for the fields of ``tolerance``.

    Raises:
        MoparError: a subclass naming the argument at fault and the fix; an unknown option is
            an `OptionError` listing the valid ones.
    """
    if out is None:
        raise OptionError("compile() needs out=, the folder to write the bundle to, e.g. "
                          "mopar.compile(model, (x,), out='bundle')")
    check_arguments(out=out, force=force)
    config = compile_config("compile", COMPILE_OPTIONS, depth=depth, options=options)
    analysis = analyze(model, example_args, example_kwargs, depth=depth,
                       trust_pickle=trust_pickle, progress=progress)
    return build_bundle(analysis, Path(out), config=config, force=force, progress=progress)


def build_bundle(
    analysis: Analysis, out: Path, *, config: CompileConfig, force: bool, progress: Progress | None
) -> Bundle:
    """Plan, split, export, verify and write ``analysis`` as a bundle at ``out``."""
    from mopar.emit.bundle import staging_dir, write_function, write_manifest, write_reference
    from mopar.emit.onnx_export import export_with_retry, verify_chain
    from mopar.emit.openfaas import write_openfaas
    from mopar.emit.sam import lambda_limits, write_lambda
    from mopar.config import load_profile
    from mopar.planner.cost import load_platform
    from mopar.planner.sizing import cover_peaks
    from mopar.rewrite import output_values
    from mopar.emit.functions import write_function_specs

    cm, lg = analysis.captured, analysis.layers
    platform = load_platform(config.profiles_dir, config.target, arch=config.arch,
                             transport=config.transport)
    prediction = predict(lg, config)
    planned = plan_from(analysis, config, prediction)
    outputs = dict(zip(cm.output_names, output_values(lg)))
    with staging_dir(out, force=force) as tmp:
        exported = export_with_retry(
            planned, lg=lg, folder=tmp / "functions", opset=config.opset,
            realise=lambda plan: _realise(cm, lg, plan, config, platform, progress),
            replan=lambda cuts, notes: _replan(analysis, config, prediction, planned, cuts, notes),
            progress=lambda name, i, n: _tell(progress, f"export {name}", i, n))
        r = exported.realised
        estimate, slices, codecs, tolerance = r.plan, r.slices, r.codecs, r.tolerance
        for s in slices:
            write_function(tmp / "functions" / s.name)
        paths = list(exported.paths)
        _tell(progress, "verify", len(slices), len(slices))
        checked = verify_chain(paths, slices, cm.inputs, cm.reference, outputs,
                               tolerance=tolerance)
        _tell(progress, "measure", len(slices), len(slices))
        peaks, times = _measure_slices(tmp, estimate, slices, cm, outputs, codecs, tolerance)
        plan = with_units(cover_peaks(estimate, peaks, margin=load_profile(
            config.profiles_dir, "runtime")["measured_margin"], platform=platform), slices,
            model_inputs=cm.input_names, model_outputs=outputs.values(), codecs=codecs)
        write_reference(tmp / "reference.npz", cm.inputs, cm.reference)
        write_openfaas(tmp, plan)
        write_lambda(tmp, plan, arch=config.arch, limits=lambda_limits(config.profiles_dir))
        write_manifest(
            tmp / "plan.json",
            plan=plan,
            io={
                "inputs": lg.inputs,
                "outputs": [{"name": pub, "value": v, **_info_dict(lg, pub)} for pub, v in outputs.items()],
                "functions": [{"name": s.name, "inputs": s.inputs, "outputs": s.outputs,
                               "onnx": f"functions/{s.name}/model.onnx",
                               "codecs": {t.name: codecs[t.name] for t in s.outputs
                                          if t.name in codecs}}
                              for s in slices],
            },
            verification={"max_abs_err": checked.max_abs_err, "max_rel_err": checked.max_rel_err,
                          "rtol": tolerance.rtol, "atol": tolerance.atol,
                          "reference": "reference.npz"},
            sizing=[{"function": e.name, "need_mb": e.need_mb, "planned_mb": e.memory_mb,
                     "peak_rss_mb": peaks[e.name],
                     "memory_mb": p.memory_mb, "planned_time_ms": e.time_ms,
                     "p50_ms": times[e.name]} for e, p in zip(estimate.functions, plan.functions)],
            layers=[{"name": la.name, "type": la.module_type, "param_bytes": la.param_bytes,
                     "flops": la.flops, "output_bytes": la.output_bytes} for la in lg.layers],
        )
        write_function_specs(tmp)
    return Bundle(path=out, plan=plan, max_abs_err=checked.max_abs_err,
                  max_rel_err=checked.max_rel_err, tolerance=tolerance)


@dataclass(frozen=True, kw_only=True)
class _Realised:
    """A plan made concrete for export: its executable units and the tensors between them."""

    plan: Any  # the plan, with the codec choices when --codec
    slices: tuple  # SliceModule per unit
    values: dict  # every tensor on the example inputs, by value name
    codecs: dict[str, str]  # runtime codec of each cut tensor
    tolerance: Tolerance  # what verification holds the bundle to


def _realise(cm, lg, plan, config: CompileConfig, platform, progress) -> _Realised:
    """Split ``plan`` into slice modules, shard and add codecs as it says, run them in torch."""
    from mopar.emit.onnx_export import run_slices_torch
    from mopar.errors import PlanError
    from mopar.rewrite import split_by_plan
    from mopar.rewrite.units import expand_units

    slices = split_by_plan(lg, plan)
    codecs: dict[str, str] = {}
    tolerance = config.tolerance
    if plan.sharded:
        if config.codec != "none":
            raise PlanError("--codec with sharded sub-slices (--parallel) is not supported yet; "
                            "drop one of them")
        slices = expand_units(slices, plan)
    if config.codec != "none":
        slices, plan, codecs, tolerance = _add_codecs(cm, slices, plan, config, platform, progress)
    values = run_slices_torch(slices, cm.inputs)
    return _Realised(plan=plan, slices=_retype(slices, values), values=values, codecs=codecs,
                     tolerance=tolerance)


def _replan(analysis: Analysis, config: CompileConfig, prediction, base, cuts, notes):
    """``base`` cut at ``cuts`` instead (the export driver moved a cut), with ``notes``."""
    from dataclasses import replace

    from mopar.planner import with_parallel
    from mopar.planner.strategies import plan_at_cuts

    plan = with_parallel(analysis.layers, plan_at_cuts(
        analysis.layers, prediction, config, model=analysis.captured.name, base=base, cuts=cuts,
        notes=notes), config)
    return replace(plan, notes=tuple(dict.fromkeys(plan.notes)))


def _add_codecs(cm, slices, plan, config: CompileConfig, platform, progress):
    """Choose and insert the codec of every cut tensor (`mopar.compress`).

    Returns the slices (autoencoders inside), the plan with each slice's codec choices, the
    runtime codec of every cut tensor, and the tolerance verification holds the bundle to.
    """
    from dataclasses import replace

    from mopar.compress.calibration import load_calibration
    from mopar.compress.choose import CodecBudget, choose_codecs

    calibration = load_calibration(config.calibration, cm.inputs, seed=config.seed)
    top1 = None if config.max_top1_change is None else config.max_top1_change / 100.0
    budget = CodecBudget(max_output_error=config.max_output_error, max_top1_change=top1)
    coded, choices, runtime = choose_codecs(
        slices, calibration, codec=config.codec, budget=budget,
        transfer_ms=lambda _slice, nbytes: platform.handoff(nbytes)[1],
        budget_s=config.codec_budget_s, seed=config.seed,
        progress=lambda phase, done, total: _tell(progress, phase, done, total))
    by_slice = {f.name: tuple(c.to_dict() for c in choices if c.slice == f.name)
                for f in plan.functions}
    notes = [f"codecs chosen on {calibration.source}", *calibration.notes]
    if calibration.synthetic and any(c.error > 0 for c in choices):
        notes.append("codec quality was estimated on synthetic data (augmented example inputs); "
                     "pass --calibration with real samples")
    plan = replace(plan, functions=tuple(replace(f, codecs=by_slice[f.name])
                                         for f in plan.functions),
                   notes=(*plan.notes, *notes))
    lossy = [c for c in choices if c.error > 0]
    tolerance = config.tolerance
    if lossy:  # the reference input need not be a held-out sample: allow the budget, or 2x what
        # was seen, both relative to the outputs' scale; so the absolute tolerance widens
        relative = max(config.max_output_error or 0.0, 2 * max(c.error for c in lossy))
        scale = max((float(np.max(np.abs(v))) for v in cm.reference.values() if v.size), default=0.0)
        tolerance = replace(tolerance, atol=max(tolerance.atol, relative * scale))
    return coded, plan, runtime, tolerance


def _retype(slices, values):
    """Slices whose tensor infos match what actually crosses (an autoencoder's code, not the
    activation it stands for)."""
    from dataclasses import replace

    from mopar.ir.graph import TensorInfo

    def info(t):
        v = values[t.name]
        if tuple(v.shape) == t.shape:
            return t
        return TensorInfo(name=t.name, shape=tuple(v.shape), dtype=t.dtype, nbytes=v.numel() * v.element_size())

    return tuple(replace(s, inputs=tuple(map(info, s.inputs)), outputs=tuple(map(info, s.outputs)))
                 for s in slices)


def _measure_slices(root, plan, slices, cm, outputs, codecs: dict[str, str], tolerance):
    """Serve the reference input through the real runtime, one process per slice.

    Returns each slice's peak RSS (MB) and median time (ms), by slice name.
    """
    from mopar.config import RunConfig
    from mopar.errors import VerificationError
    from mopar.runner.bundle import BundleManifest, BundleSlice
    from mopar.runner.local import run_bundle

    manifest = BundleManifest(
        root=root,
        model=plan.model,
        inputs=cm.input_names,
        outputs=tuple(outputs.items()),
        slices=tuple(
            BundleSlice(name=s.name, inputs=tuple(t.name for t in s.inputs),
                        outputs=tuple(t.name for t in s.outputs), memory_mb=sp.memory_mb,
                        codecs={t.name: codecs[t.name] for t in s.outputs if t.name in codecs})
            for s, sp in zip(slices, plan.functions)
        ),
    )
    # Ten requests, not one: peak RSS creeps up over the first ~10 runs (glibc raises its mmap
    # threshold after large frees and keeps freed buffers), then levels off; the profiler found it.
    report = run_bundle(manifest, cm.inputs, config=RunConfig(requests=9, tolerance=tolerance),
                        expected=cm.reference)
    if report.errors or not report.comparison.passed:
        raise VerificationError(
            f"the slices disagree with the model when run as processes: "
            f"{report.comparison.describe(tolerance)}, errors {list(report.error_messages)}; "
            "report this"
        )
    return ({s.name: s.peak_rss_mb for s in report.slices},
            {s.name: s.p50_ms for s in report.slices})


def with_units(plan, units, *, model_inputs, model_outputs, codecs: dict[str, str]):
    """``plan`` with the edges its executable ``units`` (in plan order) really have: the exact
    tensors between them, with their codecs, each edge keeping the transport its producer hands
    on by."""
    from dataclasses import replace

    from mopar.plan import data_edges

    nbytes = {t.name: t.nbytes for u in units for t in (*u.inputs, *u.outputs)}
    edges = data_edges(
        [(u.name, [t.name for t in u.inputs], [t.name for t in u.outputs]) for u in units],
        model_inputs=model_inputs, model_outputs=model_outputs, nbytes=nbytes,
        transport={f.name: plan.handoff(f.name) for f in plan.functions}, codecs=codecs)
    return replace(plan, edges=edges)


def _info_dict(lg, public: str) -> dict:
    info = next(t for t in lg.outputs if t.name == public)
    return {"shape": info.shape, "dtype": info.dtype}


def _tell(progress: Progress | None, phase: str, done: int, total: int) -> None:
    log.info("%s (%d/%d)", phase, done, total)
    if progress is not None:
        progress(phase, done, total)
