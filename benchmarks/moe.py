"""``mopar bench --moe``: the placement policies of mixture-of-experts layers, side by side.

For each example family (Mixtral-style stacked experts; Qwen2-MoE-style expert modules with a
shared expert), router (the synthetic Zipf skew, and uniform) and request length, it compiles

- ``unsplit``: the model in one function, its experts inline (``--slices 1 --experts inline``)
  in their sparse translation, each expert on the tokens routed to it: the model as users
  deploy it, and the baseline every other row is a ratio to;
- ``unsplit-dense`` and ``unsplit-sparse``: the same bundle with its function's model exported
  with every experts layer in the dense translation (every expert on every token, E/k times
  the experts' arithmetic: what mopar's figures were measured against before issue 31), and
  in the sparse one, from the same layer graph in this process (`_with_forms`), whichever form
  the planner chose for ``unsplit`` (it predicts which is faster);
- ``all-remote``: every expert in an expert function (``--hot-experts none``);
- ``hot-cold``: the planner's default, hot experts kept in the dispatch (``--hot-experts auto``);
- ``hot-cold+replicas``: the same, sized for a request rate (``--rate``): replicas of the most
  loaded cold experts,

each from a fresh ``mopar compile`` process with the activation trace measured on 64 seeded
calibration sequences of the request's length (unsplit has no use for it), then serves them all
with their requests interleaved (`mopar.runner.local.run_bundles`) and reports, per bundle: MC
per request (each function's allocated GB x median seconds, weighted by the share of requests
that invoked it), cost per 1M requests on OpenFaaS (MC at its GB-second price) and on Lambda
(each invocation at the bundle's sizes rounded to Lambda's, billed per ms, plus the request
fee), p50 and p95, the largest function's peak RSS, functions invoked per request, and the
trace's pre-warm prediction accuracy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopar.bundle.document import read_document
from mopar.errors import MoparError

__all__ = [
    "MOE_MODELS",
    "FAMILIES",
    "POLICIES",
    "BASELINE",
    "MoeRow",
    "run_moe_bench",
    "moe_markdown",
]

MOE_MODELS: dict[str, dict[str, str]] = {
    "mixtral_tiny": {
        "zipf": "examples.moe:mixtral_tiny_zipf",
        "uniform": "examples.moe:mixtral_tiny",
    },
    "qwen2_moe_tiny": {
        "zipf": "examples.moe:qwen2_moe_tiny_zipf",
        "uniform": "examples.moe:qwen2_moe_tiny",
    },
    "mixtral": {
        "zipf": "examples.moe:mixtral_small",
        "uniform": "examples.moe:mixtral_small_uniform",
    },
    "qwen2_moe": {
        "zipf": "examples.moe:qwen2_moe_small",
        "uniform": "examples.moe:qwen2_moe_small_uniform",
    },
}
"""Family -> router -> factory: the tiny examples (experts of 49-98 KB), and ``mixtral`` and
``qwen2_moe`` at a size where experts outweigh a function's runtime (6-13 MB each)."""

FAMILIES = ("mixtral", "qwen2_moe")
"""The families measured when none are named."""

BASELINE = "unsplit"
"""The policy every row is a ratio to."""

RATE = 100.0
"""Requests per second ``hot-cold+replicas`` is sized for."""

POLICIES: dict[str, tuple[str, ...]] = {
    BASELINE: ("--slices", "1", "--experts", "inline"),
    "all-remote": ("--hot-experts", "none"),
    "hot-cold": (),
    "hot-cold+replicas": ("--rate", f"{RATE:g}"),
}


@dataclass(frozen=True, kw_only=True)
class MoeRow:
    """One bundle's measurements (see the module docstring)."""

    family: str
    router: str
    tokens: int
    policy: str
    functions: int
    invoked_per_request: float
    mc_gb_s: float
    openfaas_per_1m_usd: float
    lambda_per_1m_usd: float
    p50_ms: float
    p95_ms: float
    peak_rss_mb: float
    prewarm_precision: float | None
    prewarm_recall: float | None
    max_abs_err: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_moe_bench(
    *,
    families: Sequence[str],
    routers: Sequence[str],
    tokens: Sequence[int],
    requests: int,
    out: Path,
    progress: Callable[[str], None] = lambda _: None,
) -> list[MoeRow]:
    """Compile, serve and measure every (family, router, tokens) with every policy."""
    from mopar.config import RunConfig
    from mopar.facts import load_facts
    from mopar.runner.bundle import read_manifest, read_reference
    from mopar.runner.local import run_bundles

    unknown = [f for f in families if f not in MOE_MODELS]
    if unknown:
        raise MoparError(f"unknown MoE family {unknown[0]!r}; choose from {', '.join(MOE_MODELS)}")
    prices = {t: load_facts(target=t).platform for t in ("openfaas", "lambda")}
    rows: list[MoeRow] = []
    out.mkdir(parents=True, exist_ok=True)
    for family in families:
        for router in routers:
            for t in tokens:
                calibration = _calibration(out, t)
                bundles = {}
                for policy, flags in POLICIES.items():
                    progress(f"compiling {family} ({router}, {t} tokens): {policy}")
                    bundles[policy] = _compile(
                        MOE_MODELS[family][router],
                        t,
                        flags,
                        calibration,
                        out / f"{family}-{router}-{t}-{policy}",
                    )
                progress(f"exporting {family} ({router}, {t} tokens): unsplit, both forms")
                bundles = _with_forms(
                    bundles, MOE_MODELS[family][router], t, out / f"{family}-{router}-{t}"
                )
                progress(f"serving {family} ({router}, {t} tokens): {len(bundles)} bundles")
                inputs, expected = read_reference(bundles[BASELINE] / "reference.npz")
                reports = run_bundles(
                    [read_manifest(b) for b in bundles.values()],
                    inputs,
                    config=RunConfig(requests=requests),
                    expected=expected,
                )
                for (policy, bundle), report in zip(bundles.items(), reports):
                    rows.append(_row(family, router, t, policy, bundle, report, prices))
                (out / "moe.json").write_text(json.dumps([r.to_dict() for r in rows], indent=1))
    return rows


def _with_forms(bundles: dict[str, Path], factory: str, tokens: int, stem: Path) -> dict:
    """``bundles`` with ``unsplit-dense`` and ``unsplit-sparse`` after ``unsplit``: copies of
    the unsplit bundle whose one function runs every experts layer in the dense translation,
    and in the sparse one, whichever the planner chose for ``unsplit``; both exported here from
    the same layer graph, under the same plan and memory size."""
    from mopar import api
    from mopar.emit.onnx_export import run_slices_torch, try_export_slice
    from mopar.ir.subgraph import extract_slices
    from mopar.plan import Plan
    from mopar.rewrite.experts import sparse_unit

    plan = Plan.from_dict(read_document(bundles[BASELINE]).plan)
    analysis = api.analyze(factory, list(_specs(tokens)))
    (dense,) = extract_slices(analysis.layers, plan.functions)
    values = run_slices_torch((dense,), analysis.captured.inputs)
    sparse = dense
    for block in analysis.moe:
        sparse = sparse_unit(sparse, block, analysis.experts[block.name])
    out = {}
    for policy, bundle in bundles.items():
        out[policy] = bundle
        if policy != BASELINE:
            continue
        for form, unit in (("dense", dense), ("sparse", sparse)):
            dest = stem.with_name(f"{stem.name}-unsplit-{form}")
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(bundle, dest)
            failure = try_export_slice(unit, values, dest / plan.functions[0].artifact, opset=None)
            if failure is not None:
                raise MoparError(
                    f"exporting {factory} with {form} experts failed: {failure.reason}"
                )
            out[f"unsplit-{form}"] = dest
    return out


def _specs(tokens: int) -> tuple[str, str]:
    return (f"input_ids=1x{tokens}:int64:0..256", f"attention_mask=1x{tokens}:int64:1..2")


def _calibration(out: Path, tokens: int) -> Path:
    """Seeded calibration tokens of at least ``tokens`` per sequence (the shipped file's 32
    are too short for longer requests)."""
    from examples.moe import calibration_tokens

    path = out / f"calibration-{tokens}.npz"
    if not path.is_file():  # 64 sequences: 64 to 128 requests, a minute of tracing at most
        np.savez(path, input_ids=calibration_tokens(n=64, seq_len=max(tokens, 32)))
    return path


def _compile(
    factory: str, tokens: int, flags: tuple[str, ...], calibration: Path, bundle: Path
) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "mopar",
        "compile",
        factory,
        *(x for spec in _specs(tokens) for x in ("--input", spec)),
        *(() if "inline" in flags else ("--calibration", str(calibration))),
        *flags,
        "--out",
        str(bundle),
        "--force",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MoparError(f"compiling {factory} with {' '.join(flags) or 'defaults'} failed: {last}")
    return bundle


def _row(
    family: str, router: str, tokens: int, policy: str, bundle: Path, report, prices
) -> MoeRow:
    doc = read_document(bundle)
    n = max(report.requests, 1)
    lam = prices["lambda"]
    lambda_usd = sum(
        s.calls / n * lam.cost_usd(lam.round_mb(s.allocated_mb), s.p50_ms or 0.0)
        for s in report.slices
    )
    scores = [
        x["prewarm"]
        for x in (doc.experts or {}).get("trace", {}).get("layers", [])
        if "prewarm" in x
    ]
    return MoeRow(
        family=family,
        router=router,
        tokens=tokens,
        policy=policy,
        functions=len(doc.plan["functions"]),
        invoked_per_request=round(report.invocations(), 2),
        mc_gb_s=report.mc_gb_s(),
        openfaas_per_1m_usd=report.mc_gb_s() * prices["openfaas"].usd_per_gb_s * 1e6,
        lambda_per_1m_usd=lambda_usd * 1e6,
        p50_ms=report.latency_p50_ms or 0.0,
        p95_ms=report.latency_p95_ms or 0.0,
        peak_rss_mb=max((s.peak_rss_mb for s in report.slices), default=0.0),
        prewarm_precision=float(np.mean([s["precision"] for s in scores])) if scores else None,
        prewarm_recall=float(np.mean([s["recall"] for s in scores])) if scores else None,
        max_abs_err=report.max_abs_err,
    )


def moe_markdown(rows: Sequence[MoeRow]) -> str:
    """The results as a Markdown table, each policy's MC, p50, p95 and largest function's peak
    RSS also as ratios to the unsplit bundle (sparse experts) of the same model and request
    length."""
    base = {(r.family, r.router, r.tokens): r for r in rows if r.policy == BASELINE}
    lines = [
        "| model | router | tokens | policy | functions | invoked / request | MC vs unsplit | "
        "p50 vs unsplit | p95 vs unsplit | largest RSS vs unsplit | OpenFaaS $/1M | "
        "Lambda $/1M | pre-warm P / R |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        d = base[(r.family, r.router, r.tokens)]
        warm = (
            f"{r.prewarm_precision:.2f} / {r.prewarm_recall:.2f}"
            if r.prewarm_precision is not None and not r.policy.startswith(BASELINE)
            else "-"
        )
        lines.append(
            f"| {r.family} | {r.router} | {r.tokens} | {r.policy} | {r.functions} | "
            f"{r.invoked_per_request:g} | {r.mc_gb_s / d.mc_gb_s:.2f}x | "
            f"{r.p50_ms / d.p50_ms:.2f}x | {r.p95_ms / d.p95_ms:.2f}x | "
            f"{r.peak_rss_mb / d.peak_rss_mb:.2f}x | "
            f"{r.openfaas_per_1m_usd:.3g} | {r.lambda_per_1m_usd:.3g} | {warm} |"
        )
    return "\n".join(lines) + "\n"
