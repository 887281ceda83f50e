"""``mopar bench --traffic R,R,R``: where splitting pays, by model size and traffic.

For each model and target it plans, from one capture of the model:

- ``unsplit``: the model in one function, sized by mopar's rule for each rate R (its memory,
  and its CPU share where CPU is billed apart, chosen for that traffic; an MoE model with its
  experts in the sparse translation where that is predicted faster: the model as users deploy
  it);
- ``default``: the plan ``mopar plan`` makes with no traffic given (priced for
  `mopar.traffic.DEFAULT_RATE_RPS`, which its notes state);
- ``rate``: the plan ``mopar plan --rate R`` makes, for each rate R,

then simulates every distinct plan at every rate (`mopar.sim`: Poisson arrivals, the platform's
pool rules, keep-alive and CPU, each function's predicted time with the simulator's log-normal
spread) and bills it by `mopar.bill`. Plans are not compiled: the figures are the planner's
predictions served by the simulator, not measurements; ``python -m benchmarks.sim_validate`` checks
the simulator against ``mopar run`` on compiled bundles.

Each cell (model, target, rate) compares the plan made for that rate, and the default plan,
with unsplit at that rate: $ per 1M requests and p95.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mopar.config import CompileConfig
from mopar.errors import MoparError

__all__ = [
    "TRAFFIC_MODELS",
    "TrafficConfig",
    "TrafficRow",
    "run_traffic_bench",
    "traffic_markdown",
    "write_traffic_chart",
]

TRAFFIC_MODELS = (
    "resnet50",
    "vgg16",
    "inception_v3",
    "convnext_tiny",
    "lstm_cnn",
    "gru_cnn",
    "gcn",
    "graphsage",
    "bert_mini",
    "bert_small",
    "distilbert",
    "bert",
    "mixtral_small",
)
"""The suite's 12 models (`benchmarks.suite.SUITE`, their full-size workloads) and
``mixtral_small`` (128 tokens, its router's activation trace on seeded calibration tokens)."""

MOE_TOKENS = 128


@dataclass(frozen=True, kw_only=True)
class TrafficConfig:
    """What ``mopar bench --traffic`` runs.

    Attributes:
        models: names of `TRAFFIC_MODELS`.
        targets: platforms planned for and billed on.
        rates: requests per second: each a plan's traffic, and every plan simulated at each.
        requests: simulated requests per plan and rate.
        quick: the models' tiny variants.
    """

    models: tuple[str, ...] = TRAFFIC_MODELS
    targets: tuple[str, ...] = ("lambda", "openfaas")
    rates: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0)
    requests: int = 5000
    quick: bool = False


@dataclass(frozen=True, kw_only=True)
class TrafficRow:
    """One plan simulated at one rate.

    Attributes:
        model, target: the model and the platform.
        weights_mb: the model's weights, MB.
        plan: ``unsplit``, ``default`` or ``rate``.
        planned_rps: the traffic the plan was priced for (None: the default traffic).
        rate_rps: the traffic it was simulated at.
        functions: its functions; ``memory_mb`` their memory summed, ``vcpus`` their CPU;
            ``chain`` its mode.
        predicted_usd_per_m: the planner's own bill at ``planned_rps`` (its `Plan`).
        sim_usd_per_m, p50_ms, p95_ms, cold_share: the simulator's at ``rate_rps``.
    """

    model: str
    target: str
    weights_mb: float
    plan: str
    planned_rps: float | None
    rate_rps: float
    functions: int
    memory_mb: int
    vcpus: float
    chain: str
    predicted_usd_per_m: float
    sim_usd_per_m: float | None
    p50_ms: float | None
    p95_ms: float | None
    cold_share: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def _source(name: str, quick: bool, workdir: Path) -> tuple[str, tuple[str, ...], Path | None]:
    """(factory, input specs, calibration tokens or None) of one of `TRAFFIC_MODELS`."""
    if name == "mixtral_small":
        import numpy as np

        from examples.moe import calibration_tokens

        tokens = 16 if quick else MOE_TOKENS
        path = workdir / f"calibration-{tokens}.npz"
        np.savez(path, input_ids=calibration_tokens(n=64, seq_len=max(tokens, 32)))
        factory = "examples.moe:mixtral_tiny_zipf" if quick else "examples.moe:mixtral_small"
        return (
            factory,
            (f"input_ids=1x{tokens}:int64:0..256", f"attention_mask=1x{tokens}:int64:1..2"),
            path,
        )
    from benchmarks.suite import resolve_models

    (model,) = resolve_models((name,))
    factory, specs, _ = model.source(quick=quick)
    return factory, specs, None


def _plans(analysis, config: TrafficConfig, target: str, calibration: Path | None):
    """(label, planned rate, plan) of unsplit, the default plan and each rate's plan."""
    from mopar import api

    base = CompileConfig(target=target, calibration=calibration)
    prediction = api.predict(analysis.layers, base)
    out = [("default", None, base)]
    for r in config.rates:
        out += [("unsplit", r, replace(base, strategy="unsplit", rate=r))]
        out += [("rate", r, replace(base, rate=r))]
    for label, rate, options in out:
        yield label, rate, api.plan_from(analysis, options, prediction)


def _key(plan) -> tuple:
    """Plans with equal keys are served alike: the same functions, sizes, edges and mode."""
    return (
        plan.chain,
        tuple((f.name, f.memory_mb, f.vcpus, f.time_ms, f.spec.called) for f in plan.functions),
        tuple((e.src, e.dst, e.probability) for e in plan.edges),
    )


def run_traffic_bench(
    config: TrafficConfig,
    workdir: Path,
    progress: Callable[[str], None] | None = None,
) -> list[TrafficRow]:
    """Plan and simulate every model on every target at every rate (see the module)."""
    from mopar import api
    from mopar.bill import chain_on
    from mopar.bundle.document import BundleDocument
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform
    from mopar.sim import SimConfig, Traffic, pool_rules, simulate_bundle

    tell = progress or (lambda _: None)
    unknown = [m for m in config.models if m not in TRAFFIC_MODELS]
    if unknown:
        raise MoparError(
            f"no model {unknown[0]!r} in the traffic benchmark; choose from "
            f"{', '.join(TRAFFIC_MODELS)}"
        )
    rows: list[TrafficRow] = []
    for name in config.models:
        factory, specs, calibration = _source(name, config.quick, workdir)
        tell(f"{name}: capture")
        analysis = api.analyze(factory, list(specs))
        weights_mb = analysis.layers.param_bytes / 1e6
        for target in config.targets:
            platform = load_platform(PROFILES_DIR, target)
            rules = pool_rules(platform)
            simulated: dict[tuple, dict[float, object]] = {}
            tell(f"{name} on {target}: plan")
            for label, planned, plan in _plans(analysis, config, target, calibration):
                key = _key(plan)
                if key not in simulated:
                    tell(f"{name} on {target}: simulate {len(plan.functions)} function(s)")
                    document = BundleDocument(plan=plan.to_dict())
                    sim = SimConfig(rules=rules, chain=chain_on(platform, plan.chain))
                    simulated[key] = {
                        rate: simulate_bundle(
                            document,
                            platform,
                            Traffic(rate=rate, duration_s=config.requests / rate),
                            sim,
                        )
                        for rate in config.rates
                    }
                for rate, result in simulated[key].items():
                    rows.append(
                        TrafficRow(
                            model=name,
                            target=target,
                            weights_mb=round(weights_mb, 1),
                            plan=label,
                            planned_rps=planned,
                            rate_rps=rate,
                            functions=len(plan.functions),
                            memory_mb=sum(f.memory_mb for f in plan.functions),
                            vcpus=sum(f.vcpus for f in plan.functions),
                            chain=chain_on(platform, plan.chain),
                            predicted_usd_per_m=plan.cost_per_1m_usd,
                            sim_usd_per_m=result.cost_per_1m_usd,
                            p50_ms=result.p50_ms,
                            p95_ms=result.p95_ms,
                            cold_share=result.cold_share,
                        )
                    )
    return rows


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One model on one target at one rate: unsplit and the plan, both made for that rate, and
    the default plan."""

    unsplit: TrafficRow
    rate: TrafficRow
    default: TrafficRow

    def ratio(self, plan: str, field: str = "sim_usd_per_m") -> float | None:
        ours, base = getattr(getattr(self, plan), field), getattr(self.unsplit, field)
        return None if ours is None or not base else ours / base


def cells(rows: Sequence[TrafficRow]) -> list[Cell]:
    """The rows as cells, in the order they were run."""
    found: dict[tuple, dict[str, TrafficRow]] = {}
    for r in rows:
        mine = found.setdefault((r.model, r.target, r.rate_rps), {})
        if r.plan == "default" or r.planned_rps == r.rate_rps:
            mine[r.plan] = r
    return [Cell(**plans) for plans in found.values() if len(plans) == 3]


def traffic_markdown(rows: Sequence[TrafficRow]) -> str:
    """The cells as a markdown table: unsplit's bill, then the rate's plan and the default plan
    as ratios to it (bill and p95)."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None or math.isnan(x) else format(x, fmt)

    lines = [
        "| model | weights MB | target | req/s | unsplit $/1M | unsplit p95 ms "
        "| plan for the rate: functions, chain | its $ | its p95 | default plan: functions "
        "| its $ | its p95 |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells(rows):
        u, r, d = c.unsplit, c.rate, c.default
        lines.append(
            f"| {u.model} | {u.weights_mb:,.1f} | {u.target} | {u.rate_rps:g} "
            f"| {num(u.sim_usd_per_m, '.4g')} | {num(u.p95_ms, '.1f')} "
            f"| {r.functions}, {r.chain} | {num(c.ratio('rate'), '.2f')}x "
            f"| {num(c.ratio('rate', 'p95_ms'), '.2f')}x | {d.functions} "
            f"| {num(c.ratio('default'), '.2f')}x | {num(c.ratio('default', 'p95_ms'), '.2f')}x |"
        )
    return "\n".join(lines) + "\n"


def write_traffic_chart(rows: Sequence[TrafficRow], path: Path) -> Path:
    """One panel per target: each model's plan-for-the-rate bill as a ratio to unsplit's, against
    the rate (log scale); below 1, splitting pays."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    found = cells(rows)
    targets = list(dict.fromkeys(c.unsplit.target for c in found))
    fig = Figure(figsize=(5 * max(len(targets), 1), 4))
    FigureCanvasAgg(fig)
    for k, target in enumerate(targets):
        ax = fig.add_subplot(1, len(targets), k + 1)
        for model in dict.fromkeys(c.unsplit.model for c in found):
            mine = [c for c in found if c.unsplit.model == model and c.unsplit.target == target]
            ax.plot(
                [c.unsplit.rate_rps for c in mine],
                [c.ratio("rate") or math.nan for c in mine],
                marker="o",
                label=model,
            )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(
            xscale="log",
            xlabel="requests/s",
            ylabel="$ per 1M, plan for the rate / unsplit",
            title=target,
        )
    if targets:
        fig.axes[-1].legend(fontsize=7)
    fig.suptitle("simulated bill of the plan made for each rate, against unsplit")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
