"""``mopar bench --rate R,R,R``: plans under traffic, billed as the platforms bill them.

For each model it compiles every strategy asked for (unsplit, mopar and the baselines), then
serves each bundle with an open loop of Poisson arrivals at each rate (`mopar.runner.local`)
under a Lambda-like autoscaler: one request per instance, at most ``instances`` instances per
function, an instance idle for ``idle_s`` stopped (scale to zero), every start a timed cold
start, and memory enforced (an instance over its allocation is killed). From what each run
measured it prices one million requests as ``mopar run --rate`` does (`mopar.sim.served.bill_run`,
`mopar.bill`'s rules), on Lambda (chain ``invoke``: each invocation with its waits, rounded to
the ms, the INIT of every cold start and a request fee per invocation) and on OpenFaaS (the
memory the replicas reserved over the run).

Rates, the duration and the autoscaler are the user's; the figures depend on the machine, so
`docs/serving.md` quotes them with the command that produced them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mopar.config import CompileConfig, RunConfig
from mopar.errors import MoparError

__all__ = [
    "ServingConfig",
    "ServingRow",
    "ColdRow",
    "compiled_bundles",
    "run_serving_bench",
    "serving_markdown",
    "cold_markdown",
    "write_curves",
]


@dataclass(frozen=True, kw_only=True)
class ServingConfig:
    """What ``mopar bench --rate`` runs.

    Attributes:
        models: suite model names.
        variants: strategies to compile (``unsplit``, ``mopar``, ``uniform``, ...).
        rates: offered requests per second.
        duration_s: seconds of arrivals per (bundle, rate).
        instances: the most instances per function.
        idle_s: an instance idle this long is stopped (scale to zero).
        enforce_memory: kill an instance over its allocation.
        quick: the models' tiny variants.
        target: the platform the plans are made for.
        baseline_slices: slices of the baselines (None: mopar's count).
        cold_repeats: cold first requests per bundle with pre-warm and as many without,
            alternated (0: none).
    """

    models: tuple[str, ...]
    variants: tuple[str, ...] = ("unsplit", "mopar", "uniform", "params")
    rates: tuple[float, ...] = (2.0, 8.0, 32.0)
    duration_s: float = 10.0
    instances: int = 4
    idle_s: float = 2.0
    enforce_memory: bool = True
    quick: bool = False
    target: str = "openfaas"
    baseline_slices: int | None = None
    cold_repeats: int = 3


@dataclass(frozen=True, kw_only=True)
class ServingRow:
    """One bundle at one rate."""

    model: str
    variant: str
    functions: int
    rate_rps: float
    offered: int
    served: int
    throughput_rps: float
    errors: int
    oom_kills: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    cold_starts: int
    cold_start_ms: float | None
    invocations: int
    lambda_usd_per_m: float | None
    openfaas_usd_per_m: float | None
    max_abs_err: float | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ColdRow:
    """A bundle's first request from zero instances, with and without the chain pre-warm:
    medians over the repeats; ``start_ms`` is each function's start (process and session)."""

    model: str
    variant: str
    prewarm: bool
    first_request_ms: float
    start_ms: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def measure_cold(model: str, variant: str, manifest, inputs, repeats: int) -> list[ColdRow]:
    """``repeats`` cold first requests with the chain pre-warm and as many without, alternated,
    each from a fresh set of processes (`RunConfig.start_cold`)."""
    from mopar.runner.local import run_bundles

    seen: dict[bool, list] = {True: [], False: []}
    for _ in range(repeats):
        for prewarm in (True, False):
            seen[prewarm].append(
                run_bundles(
                    [manifest],
                    inputs,
                    config=RunConfig(requests=1, start_cold=True, prewarm=prewarm, timeout_s=60.0),
                )[0]
            )
    rows = []
    for prewarm, reports in seen.items():
        rows.append(
            ColdRow(
                model=model,
                variant=variant,
                prewarm=prewarm,
                first_request_ms=_median([r.cold["first_request_ms"] for r in reports]),
                start_ms={
                    s.name: _median([r.slices[k].cold_start_ms for r in reports])
                    for k, s in enumerate(reports[0].slices)
                },
            )
        )
    return rows


def price(report, manifest, platforms) -> tuple[float | None, ...]:
    """USD per million answered requests on each of ``platforms``, in its default chain mode:
    `mopar.sim.served.bill_run`, the bill ``mopar run --rate`` reports."""
    from mopar.bill import default_chain
    from mopar.sim.served import bill_run

    return tuple(
        bill_run(report, manifest.document, p, default_chain(p)).cost_per_1m_usd for p in platforms
    )


def compiled_bundles(
    models: Sequence[str],
    variants: Sequence[str],
    *,
    target: str,
    baseline_slices: int | None,
    quick: bool,
    workdir: Path,
    tell: Callable[[str], None],
):
    """Each model's strategies compiled into bundles under ``workdir``: yields (model name,
    strategy label, manifest, the model's analysis), a bundle compiled once however many
    strategies plan it."""
    from benchmarks.config import BenchConfig
    from benchmarks.runner import _bundle_key, _plan_variants, facts_loader
    from benchmarks.suite import resolve_models, resolve_variants
    from mopar import api
    from mopar.runner.bundle import read_manifest

    resolved, _ = resolve_variants(tuple(variants), target=target)
    base = CompileConfig(target=target)
    bench_like = BenchConfig(
        models=tuple(models),
        variants=tuple(variants),
        target=target,
        baseline_slices=baseline_slices,
    )
    for model in resolve_models(tuple(models)):
        factory, specs, _ = model.source(quick=quick)
        tell(f"{model.name}: capture")
        analysis = api.analyze(factory, list(specs))
        facts_of = facts_loader()
        prediction = api.predict(analysis.layers, base, facts=facts_of(base))
        planned, skipped = _plan_variants(
            analysis, prediction, resolved, bench_like, base, facts_of
        )
        for s in skipped:
            tell(f"{model.name}: {s['label']} skipped: {s['reason']}")
        built: dict[tuple, Path] = {}
        for variant, options, plan in planned:
            key = _bundle_key(variant, plan)
            if key not in built:
                tell(f"{model.name}: compile {variant.label}")
                built[key] = workdir / f"{model.name}-{variant.label}"
                api.build_bundle(
                    analysis,
                    built[key],
                    config=options,
                    force=True,
                    progress=None,
                    facts=facts_of(options),
                )
            yield model.name, variant.label, read_manifest(built[key]), analysis


def run_serving_bench(
    config: ServingConfig,
    workdir: Path,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[ServingRow], list[ColdRow]]:
    """Compile each model's strategies and serve each bundle at each rate (see the module);
    then time its cold first request with and without the chain pre-warm (`measure_cold`)."""
    from mopar.facts import load_platform
    from mopar.runner.local import run_bundles

    tell = progress or (lambda _: None)
    base = CompileConfig(target=config.target)
    platforms = tuple(load_platform(base.profiles_dir, t) for t in ("lambda", "openfaas"))
    rows: list[ServingRow] = []
    colds: list[ColdRow] = []
    for model, label, manifest, analysis in compiled_bundles(
        config.models,
        config.variants,
        target=config.target,
        baseline_slices=config.baseline_slices,
        quick=config.quick,
        workdir=workdir,
        tell=tell,
    ):
        if config.cold_repeats and len(manifest.slices) > 1:
            tell(f"{model}: {label}, cold first requests")
            colds += measure_cold(
                model, label, manifest, analysis.captured.inputs, config.cold_repeats
            )
        for rate in config.rates:
            tell(f"{model}: {label} at {rate:g} req/s")
            run = RunConfig(
                rate=rate,
                duration_s=config.duration_s,
                instances=config.instances,
                instance_concurrency=1,
                idle_s=config.idle_s,
                enforce_memory=config.enforce_memory,
                timeout_s=60.0,
            )
            report = run_bundles(
                [manifest],
                analysis.captured.inputs,
                config=run,
                expected=analysis.captured.reference,
            )[0]
            lam, ofs = price(report, manifest, platforms)
            rows.append(
                ServingRow(
                    model=model,
                    variant=label,
                    functions=len(manifest.slices),
                    rate_rps=rate,
                    offered=report.load["offered"],
                    served=report.load["completed"],
                    throughput_rps=report.load["throughput_rps"],
                    errors=report.errors,
                    oom_kills=report.oom_kills,
                    p50_ms=report.latency_p50_ms,
                    p95_ms=report.latency_p95_ms,
                    p99_ms=report.latency_p99_ms,
                    cold_starts=sum(s.cold_starts for s in report.slices),
                    cold_start_ms=_median([s.cold_start_ms for s in report.slices]),
                    invocations=sum(s.calls for s in report.slices),
                    lambda_usd_per_m=_sig(lam),
                    openfaas_usd_per_m=_sig(ofs),
                    max_abs_err=report.max_abs_err,
                )
            )
    if not rows:
        raise MoparError("no bundle could be served; see the messages above")
    return rows, colds


def _median(values: Sequence[float | None]) -> float | None:
    got = sorted(v for v in values if v is not None)
    return None if not got else round(got[len(got) // 2], 1)


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def serving_markdown(rows: Sequence[ServingRow]) -> str:
    """The rows as a markdown table, with each cost also as a ratio to unsplit's at that rate."""
    unsplit = {(r.model, r.rate_rps): r for r in rows if r.variant == "unsplit"}

    def ratio(r: ServingRow, field: str) -> str:
        ours, base = getattr(r, field), getattr(unsplit.get((r.model, r.rate_rps)), field, None)
        if ours is None:
            return "-"
        return f"{ours:.4g}" + (f" ({ours / base:.2f}x)" if base else "")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        "| model | plan | functions | offered req/s | served req/s | p50 ms | p95 ms | "
        "p99 ms | errors | OOM kills | cold starts | Lambda $/1M | OpenFaaS $/1M |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.variant} | {r.functions} | {r.rate_rps:g} | "
            f"{r.throughput_rps:.3g} | {ms(r.p50_ms)} | {ms(r.p95_ms)} | {ms(r.p99_ms)} | "
            f"{r.errors} | {r.oom_kills} | {r.cold_starts} | {ratio(r, 'lambda_usd_per_m')} | "
            f"{ratio(r, 'openfaas_usd_per_m')} |"
        )
    return "\n".join(lines) + "\n"


def cold_markdown(rows: Sequence[ColdRow]) -> str:
    """Cold first requests: each function's start and the request's latency, with the chain
    pre-warm and without, and their ratio."""
    lines = [
        "| model | plan | function starts, ms (pre-warm / none) | first request ms, pre-warm "
        "| first request ms, none | ratio |",
        "|---|---|---|---|---|---|",
    ]
    pairs: dict[tuple[str, str], dict[bool, ColdRow]] = {}
    for r in rows:
        pairs.setdefault((r.model, r.variant), {})[r.prewarm] = r
    for (model, variant), pair in pairs.items():
        on, off = pair[True], pair[False]
        starts = ", ".join(
            f"{name} {on.start_ms[name]:.0f} / {off.start_ms[name]:.0f}" for name in on.start_ms
        )
        lines.append(
            f"| {model} | {variant} | {starts} | {on.first_request_ms:.0f} | "
            f"{off.first_request_ms:.0f} | {on.first_request_ms / off.first_request_ms:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_curves(rows: Sequence[ServingRow], folder: Path) -> list[Path]:
    """Per model, a PNG of served throughput and p95 latency against the offered rate, one line
    per plan; returns the paths written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    for model in dict.fromkeys(r.model for r in rows):
        fig = Figure(figsize=(9, 3.6))
        FigureCanvasAgg(fig)
        served, p95 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for variant in dict.fromkeys(r.variant for r in rows if r.model == model):
            mine = sorted(
                (r for r in rows if r.model == model and r.variant == variant),
                key=lambda r: r.rate_rps,
            )
            rates = [r.rate_rps for r in mine]
            served.plot(rates, [r.throughput_rps for r in mine], marker="o", label=variant)
            p95.plot(
                rates,
                [r.p95_ms if r.p95_ms is not None else math.nan for r in mine],
                marker="o",
                label=variant,
            )
        served.set(xlabel="offered (req/s)", ylabel="served (req/s)", title="throughput")
        p95.set(xlabel="offered (req/s)", ylabel="p95 (ms)", title="p95 latency", yscale="log")
        served.legend(fontsize=8)
        fig.suptitle(f"{model}: open loop, Poisson arrivals")
        fig.tight_layout()
        path = folder / f"serving-{model}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
