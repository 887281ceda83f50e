"""From raw bench records to ``results.json``: one row per (model, variant) with its metrics,
per-family ratios to unsplit, and the team's goals checked against what was measured.

Read in this order: `results_doc` (the document), `run_row` (one row: the issue's keys first,
then what they were computed from), `family_ratios` (geomeans vs unsplit), `goals`.
Everything here is a pure function of the records and the platform facts.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from benchmarks.metrics import (
    geomean,
    ideal_mc_gb_s,
    lambda_cost_per_1m_usd,
    lambda_slice_ms,
    mc_gb_s,
    mem_util,
    oom_count,
    openfaas_cost_per_1m_usd,
)
from benchmarks.runner import BenchResults, ModelResult, RunRecord
from benchmarks.suite import TORCH
from mopar.facts import Platform, load_platform

__all__ = [
    "RESULTS_FORMAT_VERSION",
    "DEFINITIONS",
    "results_doc",
    "run_row",
    "family_ratios",
    "goals",
]

RESULTS_FORMAT_VERSION = 1

DEFINITIONS = {
    "allocated_mb": "the plan's memory size for a slice (plan.json sizing.planned_mb), before "
    "compile raises it to the measured peak; peak RSS above it is an OOM",
    "mc_gb_s": "sum over slices of allocated GB x measured median slice seconds, per request",
    "mem_util": "sum of peak RSS x slice time / sum of allocated x slice time",
    "oom": "slices whose measured peak RSS exceeded their allocated memory (0: none)",
    "cost_per_1m_openfaas_usd": "sum over slices of allocated GB x measured s x the reserved "
    "unit price (profiles/platforms.json), x 1e6",
    "cost_per_1m_lambda_usd": "sum over slices of the allocation rounded to Lambda sizes x the "
    "modelled Lambda time billed per 1 ms, plus $0.20 per 1M "
    "invocations per slice, x 1e6. Modelled time: the measured time "
    "at machine.threads cores -> one vCPU by Amdahl with the slice's "
    "parallel share -> the CPU share of the allocation (memory / 1,769 "
    "MB, at most 6), plus the input cut over Lambda's fastest "
    "transport (transports.json) for every slice but the first",
    "ideal_mc_gb_s": "every layer in its own function of exactly its predicted memory (no "
    "margin, no runtime baseline), no handoff or hop: sum over layers of GB x s; "
    "times: see models[].ideal_time",
    "p50_ms/p95_ms": "measured end-to-end latency of the measured requests (after one warm-up "
    "per bundle, bundles interleaved), ms",
    "max_rel_err": "max |output - original model| / max |original model| over every request",
}


def results_doc(results: BenchResults) -> dict[str, Any]:
    """The ``results.json`` document."""
    cfg = results.config
    platforms = {
        t: load_platform(cfg.profiles_dir, t, arch=cfg.arch) for t in ("openfaas", "lambda")
    }
    threads = float(results.machine.get("threads") or 1)
    rows = [run_row(m, r, platforms, threads=threads) for m in results.models for r in m.runs]
    return {
        "format_version": RESULTS_FORMAT_VERSION,
        "machine": results.machine,
        "config": {**asdict(cfg), "profiles_dir": str(cfg.profiles_dir)},
        "definitions": DEFINITIONS,
        "runs": rows,
        "models": [
            {
                "model": m.name,
                "family": m.family,
                "workload": m.workload,
                "request_bytes": m.request_bytes,
                "layers": m.layers,
                "ideal_mc_gb_s": _sig(ideal_mc_gb_s(m.layer_memory_mb, m.layer_time_ms)),
                "ideal_time": m.ideal_time,
                "skipped": list(m.skipped),
            }
            for m in results.models
        ],
        "family_ratios": family_ratios(rows),
        "goals": goals(rows),
        "skipped": list(results.skipped),
        "failures": list(results.failures),
        "wall_s": results.wall_s,
    }


def run_row(
    model: ModelResult, run: RunRecord, platforms: dict[str, Platform], *, threads: float
) -> dict[str, Any]:
    """One row of ``results.json``: the issue's keys, then their inputs, per slice."""
    s = run.slices
    lam = platforms["lambda"]
    return {
        "model": model.name,
        "family": model.family,
        "workload": model.workload,
        "strategy": run.label,
        "slices": len(s),
        "mc_gb_s": _sig(mc_gb_s(s)),
        "cost_per_1m_openfaas_usd": _sig(
            openfaas_cost_per_1m_usd(s, platforms["openfaas"], threads=threads)
        ),
        "cost_per_1m_lambda_usd": _sig(lambda_cost_per_1m_usd(s, lam, threads=threads)),
        "p50_ms": run.p50_ms,
        "p95_ms": run.p95_ms,
        "mem_util": _sig(mem_util(s)),
        "oom": oom_count(s),
        "max_rel_err": run.max_rel_err,
        "ideal_mc_gb_s": _sig(ideal_mc_gb_s(model.layer_memory_mb, model.layer_time_ms)),
        # what the above were computed from, and context
        "base_strategy": run.strategy,
        "ablation": run.ablation,
        "target": run.target,
        "request_bytes": model.request_bytes,
        "requests": run.requests,
        "errors": run.errors,
        "mc_gb_s_deployed": _sig(mc_gb_s(s, deployed=True)),
        "predicted_mc_gb_s": run.predicted_mc_gb_s,
        "predicted_latency_ms": run.predicted_latency_ms,
        "slo_ms": run.slo_ms,
        "bound_ms": run.bound_ms,
        "shares_bundle_with": run.shares_bundle_with,
        "notes": list(run.notes),
        "slice_details": [
            {
                **asdict(x),
                "lambda_mb": lam.round_mb(x.allocated_mb),
                "lambda_vcpus": round(lam.cpu(lam.round_mb(x.allocated_mb)), 3),
                # unrounded: Lambda bills whole ms, so the stored cost must follow from it exactly
                "lambda_ms": lambda_slice_ms(x, lam, threads=threads, first=k == 0),
                "oom": x.peak_rss_mb > x.allocated_mb,
            }
            for k, x in enumerate(s)
        ],
    }


_RATIO_KEYS = {
    "mc": "mc_gb_s",
    "cost_openfaas": "cost_per_1m_openfaas_usd",
    "cost_lambda": "cost_per_1m_lambda_usd",
    "p95": "p95_ms",
}


def family_ratios(rows: list[dict]) -> dict[str, dict[str, dict[str, float | int | None]]]:
    """Per family (and ``all``), per variant: the geomean over models of each metric / unsplit's
    (below 1: better than unsplit), with the number of models it covers."""
    base = {r["model"]: r for r in rows if r["strategy"] == "unsplit"}
    out: dict[str, dict[str, dict]] = {}
    for fam in [*dict.fromkeys(r["family"] for r in rows), "all"]:
        mine = [r for r in rows if (fam == "all" or r["family"] == fam) and r["model"] in base]
        for label in dict.fromkeys(r["strategy"] for r in mine):
            picked = [r for r in mine if r["strategy"] == label]
            entry: dict[str, float | int | None] = {"models": len(picked)}
            for name, key in _RATIO_KEYS.items():
                ratios = [_ratio(r[key], base[r["model"]][key]) for r in picked]
                entry[name] = _sig_or_none(geomean(ratios))
            entry["oom"] = sum(r["oom"] for r in picked)
            out.setdefault(fam, {})[label] = entry
    return out


def goals(rows: list[dict]) -> list[dict[str, Any]]:
    """The issue's goals for ``mopar``, each with its measured value and whether it is met
    (None: not measured in this run)."""
    by = {(r["model"], r["strategy"]): r for r in rows}
    mopar = [r for r in rows if r["strategy"] == "mopar" and (r["model"], "unsplit") in by]

    def ratio(r: dict, key: str, other: str = "unsplit") -> float:
        o = by.get((r["model"], other))
        return _ratio(o[key], r[key]) if o else math.nan  # >1: mopar is lower

    non_tf = [r for r in mopar if r["family"] != "transformer"]
    fams = sorted({r["family"] for r in non_tf})
    out = []
    mc_every = geomean([ratio(r, "mc_gb_s") for r in mopar])
    out.append(
        _goal("MC >= 2x lower than unsplit (geomean, every model)", mc_every, mc_every >= 2.0)
    )
    mc_all = geomean([ratio(r, "mc_gb_s") for r in non_tf])
    out.append(_goal("MC >= 2.5x lower than unsplit (geomean, CNN/RNN/GCN)", mc_all, mc_all >= 2.5))
    for fam in fams:
        g = geomean([ratio(r, "mc_gb_s") for r in non_tf if r["family"] == fam])
        out.append(_goal(f"MC >= 2x lower than unsplit ({fam})", g, g >= 2.0))
    ooms = sum(r["oom"] for r in mopar) if mopar else math.nan
    out.append(_goal("zero OOMs (mopar)", ooms, ooms == 0))
    ideal = max(
        (r["mc_gb_s"] / r["ideal_mc_gb_s"] for r in mopar if r["ideal_mc_gb_s"]), default=math.nan
    )
    out.append(_goal("MC within 1.5x of the ideal (worst model)", ideal, ideal <= 1.5))
    p95 = max((1 / ratio(r, "p95_ms") for r in mopar), default=math.nan)
    out.append(_goal("p95 <= 1.05x unsplit (worst model, mopar / unsplit)", p95, p95 <= 1.05))
    # predictions that hold, on every multi-slice plan
    split = [r for r in mopar if r["slices"] > 1]
    worst = max(
        (abs(r["predicted_latency_ms"] / r["p50_ms"] - 1) for r in split if r["p50_ms"]),
        default=math.nan,
    )
    out.append(
        _goal(
            "predicted latency within 10% of the measured p50 (worst multi-slice plan, "
            "|predicted / p50 - 1|)",
            worst,
            worst <= 0.10,
        )
    )
    errs = [
        abs(x["predicted_ms"] / x["p50_ms"] - 1)
        for r in split
        for x in r["slice_details"]
        if x.get("predicted_ms") is not None and x["p50_ms"]
    ]
    held = sum(e <= 0.15 for e in errs) / len(errs) if errs else math.nan
    out.append(
        _goal(
            "every slice's predicted time within 15% of its measured p50 (share of slices)",
            held,
            held == 1.0,
        )
    )
    over = [
        x["peak_rss_mb"] / x["floor_mb"]
        for r in rows
        if r["strategy"] in ("unsplit", "mopar")
        for x in r["slice_details"]
        if x.get("floor_mb")
    ]
    worst = max(over, default=math.nan)
    out.append(
        _goal(
            "peak RSS <= baseline + 1.1 x weights + largest live activations (worst "
            "function of unsplit and mopar, peak / floor)",
            worst,
            worst <= 1.0,
        )
    )
    # what users would deploy instead: eager PyTorch in one function
    torch = [r for r in mopar if (r["model"], TORCH) in by]
    mc_torch = geomean([ratio(r, "mc_gb_s", TORCH) for r in torch])
    out.append(
        _goal(
            "MC lower than eager PyTorch unsplit (geomean, torch / mopar)", mc_torch, mc_torch > 1.0
        )
    )
    p95_torch = max((1 / ratio(r, "p95_ms", TORCH) for r in torch), default=math.nan)
    out.append(
        _goal(
            "p95 no worse than eager PyTorch unsplit (worst model, mopar / torch)",
            p95_torch,
            p95_torch <= 1.0,
        )
    )
    paper = geomean(
        [ratio(r, "mc_gb_s", "mopar-paper") for r in mopar if (r["model"], "mopar-paper") in by]
    )
    out.append(_goal("MC >= 1.2x lower than mopar-paper (geomean)", paper, paper >= 1.2))
    # mopar's plan for Lambda (CPU-aware sizing), not its OpenFaaS plan billed on Lambda
    on_lambda = [
        r
        for r in rows
        if r["base_strategy"] == "mopar"
        and r["ablation"] is None
        and r["target"] == "lambda"
        and (r["model"], "unsplit") in by
    ]
    lam = max((1 / ratio(r, "cost_per_1m_lambda_usd") for r in on_lambda), default=math.nan)
    out.append(
        _goal(
            "Lambda cost of mopar's Lambda plan never above unsplit's (worst model, ratio)",
            lam,
            lam <= 1.0,
        )
    )
    return out


def _goal(name: str, value: float, met: bool) -> dict[str, Any]:
    measured = isinstance(value, (int, float)) and math.isfinite(value)
    return {
        "goal": name,
        "value": _sig(value) if measured else None,
        "met": bool(met) if measured else None,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def _sig(x: float) -> float:
    return float(f"{x:.6g}") if math.isfinite(x) else x


def _sig_or_none(x: float) -> float | None:
    return _sig(x) if math.isfinite(x) else None
