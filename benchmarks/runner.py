"""Run the benchmark: compile every (model, variant), then serve each model's bundles interleaved.

Read in this order: `run_bench` (the loop over models), `_bench_model` (one model: capture once,
plan every variant, build each distinct plan once, run them all side by side), `_plan_variants`
(the compile options of every variant: bound, baseline slice counts), then `_record` (one run's raw
measurements). The metrics are computed later, from these records, by `benchmarks.results`.

Every bundle of a model is served by the real local runtime (`mopar.runner.local.run_bundles`):
one OS process per slice, tensors handed over through /dev/shm, memory enforced (a slice over its
allocation is killed and its requests fail, as on the platform), one warm-up request per bundle
and then the measured requests interleaved A B C A B C, so that machine drift favours none. Two
variants whose plans are identical (same cuts, same memory sizes, same target) share one bundle
and one measurement; the record says so (``shares_bundle_with``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform as _platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.floor import function_floor
from benchmarks.metrics import SliceMeasure
from benchmarks.suite import TORCH, BenchModel, Variant, resolve_models, resolve_variants
from mopar.bundle.document import read_document
from mopar.config import CompileConfig, RunConfig
from mopar.errors import MoparError

__all__ = ["RunRecord", "ModelResult", "BenchResults", "run_bench", "machine_info"]

log = logging.getLogger(__name__)

Progress = Callable[[str, float, float], None]


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """The raw measurements of one (model, variant).

    Attributes:
        label: the variant's name (``mopar``, ``mopar+min-memory``, ``mopar@lambda``).
        strategy: the partition strategy.
        ablation: the ablation, or None.
        target: the platform the plan was made for.
        slices: per-slice allocation and measurements, in order.
        p50_ms, p95_ms: measured end-to-end latency of the measured requests, ms.
        requests: measured requests; errors: how many of them failed.
        max_rel_err: max relative error of every output against the original model.
        predicted_latency_ms, predicted_mc_gb_s: what the plan predicted (None: not planned,
            the eager PyTorch reference).
        slo_ms: the latency bound mopar was given (None: --max-slowdown x the unsplit latency).
        bound_ms: the bound the plan was held to (None: none).
        shares_bundle_with: the variant whose identical plan was built and measured for this one.
        notes: the plan's notes.
    """

    label: str
    strategy: str
    ablation: str | None
    target: str
    slices: tuple[SliceMeasure, ...]
    p50_ms: float
    p95_ms: float
    requests: int
    errors: int
    max_rel_err: float
    predicted_latency_ms: float | None
    predicted_mc_gb_s: float | None
    slo_ms: float | None
    bound_ms: float | None
    shares_bundle_with: str | None
    notes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ModelResult:
    """One model's runs and the layer-level figures of its ideal.

    Attributes:
        name, family, workload: the suite entry (workload in words).
        request_bytes: bytes of one request's inputs.
        layers: layers of the model.
        layer_memory_mb: each layer's predicted footprint without the safety margin, MB.
        layer_time_ms: each layer's time for the ideal, ms (see ``ideal_time``).
        ideal_time: how ``layer_time_ms`` was obtained.
        runs: one record per variant, in the order asked.
        skipped: variants that could not be planned for this model (``{"label", "reason"}``).
    """

    name: str
    family: str
    workload: str
    request_bytes: int
    layers: int
    layer_memory_mb: tuple[float, ...]
    layer_time_ms: tuple[float, ...]
    ideal_time: str
    runs: tuple[RunRecord, ...]
    skipped: tuple[dict, ...]


@dataclass(frozen=True, kw_only=True)
class BenchResults:
    """Everything a bench run measured, before metrics.

    Attributes:
        config: the options it ran with.
        machine: where it ran (`machine_info`).
        models: one result per model that ran.
        skipped: variants that do not exist yet (``{"label", "reason"}``).
        failures: models that failed (``{"model", "error"}``).
        wall_s: the whole run's time, s.
    """

    config: BenchConfig
    machine: dict[str, Any]
    models: tuple[ModelResult, ...]
    skipped: tuple[dict, ...]
    failures: tuple[dict, ...]
    wall_s: float


def run_bench(config: BenchConfig, *, progress: Progress | None = None) -> BenchResults:
    """Compile and serve every model of ``config`` with every variant; returns raw records.

    A model that fails (export, verification, a slice crash) is recorded in ``failures`` and the
    others still run.
    """
    start = time.perf_counter()
    models = resolve_models(config.models)
    variants, skipped = resolve_variants(config.variants, target=config.target)
    steps = len(variants) + 2  # capture, one compile per variant, the interleaved run
    done: list[ModelResult] = []
    failures: list[dict] = []
    for k, model in enumerate(models):

        def tell(what: str, step: float, _k: int = k, _name: str = model.name) -> None:
            if progress is not None:
                progress(f"{_name}: {what}", _k * steps + step, len(models) * steps)

        workdir = Path(tempfile.mkdtemp(prefix=f"mopar-bench-{model.name}-"))
        try:
            done.append(_bench_model(model, variants, config, workdir, tell))
        except MoparError as exc:
            log.warning("%s failed: %s", model.name, exc)
            failures.append({"model": model.name, "error": " ".join(str(exc).split())})
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if progress is not None:
        progress("done", len(models) * steps, len(models) * steps)
    return BenchResults(
        config=config,
        machine=machine_info(),
        models=tuple(done),
        skipped=skipped,
        failures=tuple(failures),
        wall_s=round(time.perf_counter() - start, 1),
    )


def _bench_model(
    model: BenchModel,
    variants,
    config: BenchConfig,
    workdir: Path,
    tell: Callable[[str, float], None],
) -> ModelResult:
    from mopar import api
    from mopar.runner.bundle import read_manifest
    from mopar.runner.local import run_bundles

    factory, specs, workload = model.source(quick=config.quick)
    tell("capture", 0)
    analysis = api.analyze(factory, list(specs))
    base = CompileConfig(target=config.target, arch=config.arch, profiles_dir=config.profiles_dir)
    facts_of = facts_loader()
    prediction = api.predict(analysis.layers, base, facts=facts_of(base))
    planned, skipped = _plan_variants(analysis, prediction, variants, config, base, facts_of)

    built: dict[tuple, tuple[str, Path]] = {}  # plan key -> (first label, bundle folder)
    run_transport: dict[str, str] = {}  # first label -> how its bundle is run
    for i, (variant, compile_config, plan) in enumerate(planned):
        key = _bundle_key(variant, plan)
        if key in built:
            continue
        tell(f"compile {variant.label}", 1 + i)
        out = workdir / f"b{len(built)}"
        api.build_bundle(
            analysis,
            out,
            config=compile_config,
            force=True,
            progress=None,
            facts=facts_of(compile_config),
        )
        built[key] = (variant.label, out)
        run_transport[variant.label] = variant.transport or "shm"

    bundles = list(built.values())
    tell("run", 1 + len(variants))
    run_config = RunConfig(
        requests=config.requests,
        concurrency=config.concurrency,
        timeout_s=config.timeout_s,
        enforce_memory=True,
    )
    cm = analysis.captured
    reports = run_bundles(
        [read_manifest(path) for _, path in bundles],
        cm.inputs,
        config=run_config,
        expected=cm.reference,
        on_request=lambda n: tell(
            f"run, request {n}/{config.requests}", 1 + len(variants) + n / config.requests * 0.99
        ),
        transport=[run_transport[label] for label, _ in bundles],
    )
    measured = {label: (path, report) for (label, path), report in zip(bundles, reports)}

    runs = []
    if any(v.strategy == TORCH for v in variants):
        tell("run the eager PyTorch reference", 1 + len(variants))
        runs.append(
            _torch_record(factory, analysis, config, facts_of(replace(base, target="openfaas")))
        )
    for variant, compile_config, plan in planned:
        owner = built[_bundle_key(variant, plan)][0]
        path, report = measured[owner]
        runs.append(
            _record(
                variant,
                compile_config,
                path,
                report,
                prediction,
                shares=None if owner == variant.label else owner,
                baseline_mb=facts_of(compile_config).platform.baseline_mb,
            )
        )
    layer_mb, layer_ms, how = _ideal_layers(runs, prediction)
    return ModelResult(
        name=model.name,
        family=model.family,
        workload=workload,
        request_bytes=int(sum(v.nbytes for v in cm.inputs.values())),
        layers=len(analysis.layers),
        layer_memory_mb=layer_mb,
        layer_time_ms=layer_ms,
        ideal_time=how,
        runs=tuple(runs),
        skipped=tuple(skipped),
    )


def facts_loader() -> Callable[[CompileConfig], Any]:
    """``facts_of(options)``: the facts of compile options, loaded once per (target, arch,
    transport): the bench is a boundary."""
    from mopar import api

    loaded: dict[tuple, Any] = {}

    def facts_of(options: CompileConfig):
        key = (options.target, options.arch, options.transport)
        if key not in loaded:
            loaded[key] = api.facts_for(options)
        return loaded[key]

    return facts_of


def _bundle_key(variant: Variant, plan) -> tuple:
    """Variants with equal keys share one bundle and one run: same cuts, sizes and handoff."""
    return (
        plan.target,
        variant.transport,
        tuple((f.layers, f.memory_mb, plan.handoff(f.name)) for f in plan.functions),
    )


def _plan_variants(
    analysis,
    prediction,
    variants: tuple[Variant, ...],
    config: BenchConfig,
    base: CompileConfig,
    facts_of: Callable[[CompileConfig], Any],
) -> tuple[list[tuple[Variant, CompileConfig, Any]], list[dict]]:
    """Each variant's compile options and plan; variants that cannot be planned are skipped.
    ``facts_of`` gives the facts (`mopar.facts.Facts`) of a variant's options.

    mopar's bound is ``slo_factor`` x the unsplit plan's predicted latency on the same target
    and sizing (``max_slowdown``). The baselines take ``baseline_slices``, else the slice count
    of mopar's plan on the same target and bound.
    """
    from mopar import api

    mopar_slices: dict[str, int | str] = {}
    base = replace(base, max_slowdown=config.slo_factor)

    def slices_of_mopar(target: str) -> int:
        if target not in mopar_slices:
            try:
                options = replace(base, target=target, strategy="mopar")
                plan = api.plan_from(analysis, options, prediction, facts=facts_of(options))
                mopar_slices[target] = len(plan.vertical())
            except MoparError as exc:
                mopar_slices[target] = " ".join(str(exc).split())
        count = mopar_slices[target]
        if isinstance(count, str):
            raise MoparError(f"takes mopar's slice count, and mopar cannot plan: {count}")
        return count

    planned, skipped = [], []
    for v in (v for v in variants if v.strategy != TORCH):  # the reference is not planned
        target = v.target or config.target
        options = replace(
            base,
            target=target,
            strategy=v.strategy,
            min_memory=v.min_memory,
            transport=v.transport,
            parallel=v.parallel,
        )
        try:
            if v.strategy in ("uniform", "params", "latency"):
                options = replace(options, slices=config.baseline_slices or slices_of_mopar(target))
            planned.append(
                (v, options, api.plan_from(analysis, options, prediction, facts=facts_of(options)))
            )
        except MoparError as exc:
            skipped.append({"label": v.label, "reason": " ".join(str(exc).split())})
    if not planned:
        raise MoparError(f"no variant could be planned: {skipped[0]['reason']}")
    return planned, skipped


def _record(
    variant: Variant,
    options: CompileConfig,
    path: Path,
    report,
    prediction,
    *,
    shares: str | None,
    baseline_mb: float,
) -> RunRecord:
    """A run's record from its bundle's ``plan.json`` (allocation) and the run's report."""
    doc = read_document(path)
    plan, sizing = doc.plan, {s.function: s for s in doc.sizing or ()}
    stats = {s.name: s for s in report.slices}
    index = {name: k for k, name in enumerate(prediction.layers)}
    layers_of = {s["name"]: s["layers"] for s in plan["functions"]}
    in_bytes = {f["name"]: 0 for f in plan["functions"]}
    for e in plan["edges"]:
        if e["dst"] in in_bytes:
            in_bytes[e["dst"]] += int(e["bytes"])
    slices = []
    for s in plan["functions"]:
        size, stat = sizing[s["name"]], stats[s["name"]]
        # a sub-slice or an early join has no layers of its own: its slice's stand in
        ks = [index[name] for name in s["layers"] or layers_of[s.get("group", "")]]
        weight = sum(prediction.time_ms[k] for k in ks)
        parallel = (
            sum(prediction.parallel[k] * prediction.time_ms[k] for k in ks) / weight
            if weight > 0
            else sum(prediction.parallel[k] for k in ks) / len(ks)
        )
        slices.append(
            SliceMeasure(
                name=s["name"],
                layers=len(s["layers"]),
                allocated_mb=float(size.planned_mb),
                deployed_mb=float(size.memory_mb),
                need_mb=float(size.need_mb),
                peak_rss_mb=max(float(stat.peak_rss_mb), float(size.peak_rss_mb)),
                p50_ms=float(stat.p50_ms or 0.0),
                p95_ms=float(stat.p95_ms or 0.0),
                in_bytes=in_bytes[s["name"]],
                parallel=round(parallel, 4),
                vcpus=float(s.get("vcpus") or 0.0),
                predicted_ms=float(size.planned_time_ms),
                floor_mb=_floor_mb(path / s["artifact"], baseline_mb),
            )
        )
    return RunRecord(
        label=variant.label,
        strategy=variant.strategy,
        ablation=variant.ablation,
        target=plan["target"],
        slices=tuple(slices),
        p50_ms=float(report.latency_p50_ms or 0.0),
        p95_ms=float(report.latency_p95_ms or 0.0),
        requests=report.requests,
        errors=report.errors,
        max_rel_err=float(report.max_rel_err if report.max_rel_err is not None else float("inf")),
        predicted_latency_ms=float(plan["latency_ms"]),
        predicted_mc_gb_s=float(plan["mc_gb_s"]),
        slo_ms=options.slo_ms,
        bound_ms=plan["bound_ms"],
        shares_bundle_with=shares,
        notes=tuple(plan["notes"]),
    )


def _floor_mb(model: Path, baseline_mb: float) -> float | None:
    return round(function_floor(model, baseline_mb).floor_mb, 1) if model.is_file() else None


def _torch_record(factory: str, analysis, config: BenchConfig, facts) -> RunRecord:
    """The eager PyTorch reference: one function holding torch and the model, sized as compile
    sizes a function (its measured peak x (1 + margin), on the OpenFaaS grid of ``facts``)."""
    from benchmarks.torch_ref import measure_torch

    cm = analysis.captured
    run = measure_torch(
        factory, cm.inputs, cm.reference, requests=config.requests, timeout_s=config.timeout_s
    )
    size = float(facts.platform.round_mb(run.peak_rss_mb * (1 + facts.measured_margin)))
    whole = SliceMeasure(
        name="torch",
        layers=len(analysis.layers),
        allocated_mb=size,
        deployed_mb=size,
        need_mb=run.peak_rss_mb,
        peak_rss_mb=run.peak_rss_mb,
        p50_ms=run.p50_ms,
        p95_ms=run.p95_ms,
        in_bytes=0,
        parallel=0.0,
    )
    return RunRecord(
        label=TORCH,
        strategy=TORCH,
        ablation=None,
        target="openfaas",
        slices=(whole,),
        p50_ms=run.p50_ms,
        p95_ms=run.p95_ms,
        requests=run.requests,
        errors=0,
        max_rel_err=run.max_rel_err,
        predicted_latency_ms=None,
        predicted_mc_gb_s=None,
        slo_ms=None,
        bound_ms=None,
        shares_bundle_with=None,
        notes=(
            f"eager PyTorch in one process, measured after the bundles (not interleaved); "
            f"import torch and build the model: {run.load_ms:.0f} ms",
        ),
    )


def _ideal_layers(runs: list[RunRecord], prediction):
    """Per-layer memory and time of the ideal, and how the time was obtained.

    Memory: the profiler's per-layer prediction without its safety margin (each layer's own
    footprint beyond the runtime baseline). Time: the per-layer predicted times, scaled so that
    they add up to the measured time of the unsplit run (the one slice that holds every layer);
    the predictions alone when no one-slice run was measured.
    """
    memory = prediction.unmargined_mb
    whole = next((r for r in runs if r.strategy == "unsplit"), None) or next(
        (r for r in runs if len(r.slices) == 1), None
    )
    total = sum(prediction.time_ms)
    if whole is None or total <= 0 or whole.slices[0].p50_ms <= 0:
        return memory, tuple(prediction.time_ms), "predicted per-layer times (no one-slice run)"
    scale = whole.slices[0].p50_ms / total
    return (
        memory,
        tuple(t * scale for t in prediction.time_ms),
        f"predicted per-layer times scaled x{scale:.3g} to the measured one-slice "
        f"({whole.label}) time of {whole.slices[0].p50_ms:.3g} ms",
    )


def machine_info() -> dict[str, Any]:
    """The machine and software a bench ran on."""
    import psutil

    cpu = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(
            (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), ""
        )
    except OSError:
        pass

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return ""

    return {
        "cpu": cpu or _platform.processor(),
        "cores": os.cpu_count(),
        "threads": psutil.cpu_count(logical=False) or os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": _platform.platform(),
        "python": _platform.python_version(),
        "versions": {d: version(d) for d in ("mopar", "torch", "onnxruntime", "onnx")},
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
