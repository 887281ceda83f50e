"""Write a bench run's files: ``results.json``, ``results.md`` (a table like the paper's Table III,
per-family geomean ratios vs unsplit, the goals, what was skipped) and the PNG charts.

Read in this order: `write_results`, then `markdown` and its sections.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.charts import write_charts
from benchmarks.results import results_doc
from benchmarks.runner import BenchResults
from mopar.errors import MoparError

__all__ = ["write_results", "markdown", "jsonable"]


def write_results(results: BenchResults, out: Path) -> tuple[dict[str, Any], list[Path]]:
    """Write everything into ``out`` (created if missing); returns the document and the paths."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MoparError(
            f"cannot create --out folder {str(out)!r} ({exc.strerror}); pass a writable folder"
        ) from None
    doc = jsonable(results_doc(results))
    paths = [
        _write_text(out / "results.json", json.dumps(doc, indent=2, allow_nan=False) + "\n"),
        _write_text(out / "results.md", markdown(doc)),
    ]
    paths += write_charts(doc["runs"], out)
    return doc, paths


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def markdown(doc: dict[str, Any]) -> str:
    """``results.md``: the runs, the per-family ratios, the goals, what is missing, definitions."""
    m, c = doc["machine"], doc["config"]
    baselines = f"{c['baseline_slices']} slices" if c["baseline_slices"] else "mopar's slice count"
    head = [
        "# mopar bench results",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['threads']} used by onnxruntime), "
        f"{m['memory_gb']} GB; torch {m['versions']['torch']}, onnxruntime "
        f"{m['versions']['onnxruntime']}; {m['date']}.",
        f"Run: {'--quick (tiny models), ' if c['quick'] else ''}{c['requests']} measured requests "
        f"per bundle after 1 warm-up, concurrency {c['concurrency']}, bundles of a model "
        f"interleaved; plans for {c['target']}; mopar's bound {c['slo_factor']:.2f} x the unsplit "
        f"plan's predicted latency; uniform, params and latency at {baselines}; "
        f"{doc['wall_s']:.0f} s in all.",
        "",
    ]
    return (
        "\n".join(
            [*head, *_runs(doc), *_families(doc), *_goals(doc), *_missing(doc), *_definitions(doc)]
        )
        + "\n"
    )


def _runs(doc: dict[str, Any]) -> list[str]:
    base = {r["model"]: r for r in doc["runs"] if r["strategy"] == "unsplit"}
    rows = []
    for r in doc["runs"]:
        b = base.get(r["model"])
        rows.append(
            [
                r["model"],
                r["family"],
                _bytes(r["request_bytes"]),
                r["strategy"],
                str(r["slices"]),
                _num(r["mc_gb_s"]),
                _x(r["mc_gb_s"], b and b["mc_gb_s"]),
                _x(r["mc_gb_s"], r["ideal_mc_gb_s"]),
                _usd(r["cost_per_1m_openfaas_usd"]),
                _usd(r["cost_per_1m_lambda_usd"]),
                _num(r["p50_ms"], 1),
                _num(r["p95_ms"], 1),
                _x(r["p95_ms"], b and b["p95_ms"]),
                _num(r["predicted_latency_ms"], 1)
                if r["predicted_latency_ms"] is not None
                else "-",
                _x(r["p50_ms"], r["predicted_latency_ms"]),
                _num(r["mem_util"], 2),
                str(r["oom"]) if r["oom"] else "0",
                _num(r["max_rel_err"], None),
            ]
        )
    return [
        "## Runs (measured)",
        "",
        "MC in GB-s per request; costs per 1M requests; latencies in ms; ratios are to the same "
        'model\'s unsplit run, and to the ideal; "p50 / predicted" is the measured p50 over the '
        "plan's predicted latency.",
        "",
        *_table(
            [
                "model",
                "family",
                "request",
                "strategy",
                "slices",
                "MC",
                "MC vs unsplit",
                "MC / ideal",
                "OpenFaaS $/1M",
                "Lambda $/1M",
                "p50",
                "p95",
                "p95 vs unsplit",
                "predicted",
                "p50 / predicted",
                "mem util",
                "OOM",
                "max rel err",
            ],
            rows,
        ),
        "",
    ]


def _families(doc: dict[str, Any]) -> list[str]:
    rows = []
    for fam, per in doc["family_ratios"].items():
        for label, e in per.items():
            rows.append(
                [
                    fam,
                    label,
                    str(e["models"]),
                    _x1(e["mc"]),
                    _x1(e["cost_openfaas"]),
                    _x1(e["cost_lambda"]),
                    _x1(e["p95"]),
                    str(e["oom"]),
                ]
            )
    return [
        "## Geomean ratios vs unsplit, per family",
        "",
        "Each metric divided by the same model's unsplit run, geomean over the family's models "
        "(below 1.00x: lower than unsplit).",
        "",
        *_table(
            [
                "family",
                "strategy",
                "models",
                "MC",
                "cost OpenFaaS",
                "cost Lambda",
                "p95",
                "OOM slices",
            ],
            rows,
        ),
        "",
    ]


def _goals(doc: dict[str, Any]) -> list[str]:
    met = {True: "yes", False: "**no**", None: "not measured"}
    rows = [
        [g["goal"], "-" if g["value"] is None else f"{g['value']:.3g}", met[g["met"]]]
        for g in doc["goals"]
    ]
    return ["## Goals (mopar)", "", *_table(["goal", "measured", "met"], rows), ""]


def _missing(doc: dict[str, Any]) -> list[str]:
    lines = ["## Not measured", ""]
    for s in doc["skipped"]:
        lines.append(f"- `{s['label']}`: skipped, {s['reason']}.")
    for model in doc["models"]:
        for s in model["skipped"]:
            lines.append(f"- {model['model']} `{s['label']}`: could not be planned: {s['reason']}")
    for f in doc["failures"]:
        lines.append(f"- {f['model']}: failed: {f['error']}")
    shared = [r for r in doc["runs"] if r["shares_bundle_with"]]
    if shared:
        pairs = ", ".join(
            f"{r['model']} {r['strategy']} = {r['shares_bundle_with']}" for r in shared
        )
        lines.append(f"- Identical plans share one bundle and one measurement: {pairs}.")
    if len(lines) == 2:
        lines.append("- nothing: every requested variant ran.")
    return [*lines, ""]


def _definitions(doc: dict[str, Any]) -> list[str]:
    lines = ["## Definitions", ""]
    lines += [f"- **{k}**: {v}." for k, v in doc["definitions"].items()]
    lines += [
        "",
        "Ideal times per model: "
        + "; ".join(f"{m['model']}: {m['ideal_time']}" for m in doc["models"])
        + ".",
    ]
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    align = [
        "---" if k == 0 or not rows or not _numeric(rows[0][k]) else "---:"
        for k in range(len(header))
    ]
    return [line(header), line(align), *(line(r) for r in rows)]


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "$-") and cell != "-"


def _num(v: float | None, digits: int | None = 4) -> str:
    if v is None:
        return "-"
    if digits is None:
        return f"{v:.1e}"
    return f"{v:.{digits}f}" if abs(v) >= 10**-digits or v == 0 else f"{v:.2e}"


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _x1(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _usd(v: float | None) -> str:
    if v is None:
        return "-"
    return f"${v:.3g}" if v < 1 else f"${v:,.2f}"


def _bytes(n: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _write_text(path: Path, text: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
