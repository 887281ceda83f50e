"""Do predictions hold before anything is measured? (docs/predictions.md quotes it.)

    python -m benchmarks.predict [MODEL ...] [--pt2 NAME=PATH ...] [--work DIR]
        [--results FILE.json]
    python -m benchmarks.predict --table FILE.json    # the table of saved results

For each model (the suite's 12 by default, `benchmarks.suite.SUITE`, at their workloads; a
``.pt2`` saved by another process with ``--pt2``), in fresh processes:

1. ``mopar plan MODEL --json``: the first plan, priced before anything is measured, with the
   CPU it was priced for (``priced_for``: the target and its time factor);
2. ``mopar compile MODEL --out DIR`` at the defaults, whose latency check serves that plan
   beside the unsplit model and may plan again; then ``DIR/plan.json`` is read: the written
   plan, and the first plan's measured p50 (the latency check's first comparison; a plan of one
   function is the unsplit model, whose function p50 is taken).

Two ratios per model, the goals of issue 35: the written plan's cost over the first plan's
(within 1.25x), and the first plan's measured latency over its predicted one (within 1.15x).
The load average is recorded before each model: on a shared machine the ratios move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopar.bundle.document import read_document

__all__ = ["COST_GOAL", "LATENCY_GOAL", "main", "markdown", "run_model", "row"]

COST_GOAL = 1.25
"""The written plan's cost may differ from the first plan's by this ratio at most."""
LATENCY_GOAL = 1.15
"""The first plan's measured latency may differ from its predicted one by this ratio at most."""


ORDER = (
    "bert_mini",
    "gcn",
    "lstm_cnn",
    "gru_cnn",
    "resnet50",
    "bert_small",
    "distilbert",
    "inception_v3",
    "convnext_tiny",
    "graphsage",
    "bert",
    "vgg16",
)
"""The suite's 12 models, quickest to compile first: a run cut short has the most rows."""


def _mopar(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mopar", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _sources(names: Sequence[str], pt2: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(row name, the model's ``mopar`` arguments) of each model to run."""
    from benchmarks.suite import resolve_models

    out = []
    for m in resolve_models(tuple(names) if names else ORDER):
        factory, inputs, _ = m.source(quick=False)
        out.append((m.name, [factory, *(a for spec in inputs for a in ("--input", spec))]))
    for spec in pt2:
        name, _, path = spec.partition("=")
        out.append((name, [path]) if path else (Path(name).stem, [name]))
    return out


def run_model(name: str, args: Sequence[str], work: Path, *, timeout_s: float) -> dict[str, Any]:
    """Plan and compile one model; the figures `row` turns into a table row."""
    out: dict[str, Any] = {"model": name, "load_before": os.getloadavg()[0]}
    start = time.perf_counter()
    planned = _mopar("plan", *args, "--json", timeout_s=timeout_s)
    out["plan_s"] = round(time.perf_counter() - start, 1)
    if planned.returncode:
        out["error"] = "plan: " + (planned.stderr.strip().splitlines() or ["?"])[-1]
        return out
    first = json.loads(planned.stdout)
    out["first"] = _plan_figures(first)
    out["first_unsplit"] = (first.get("bill") or {}).get("unsplit")  # its prediction, priced alike
    folder = work / name
    start = time.perf_counter()
    compiled = _mopar("compile", *args, "--out", str(folder), "--force", timeout_s=timeout_s)
    out["compile_s"] = round(time.perf_counter() - start, 1)
    if compiled.returncode:
        out["error"] = "compile: " + (compiled.stderr.strip().splitlines() or ["?"])[-1]
        return out
    doc = read_document(folder)
    out["written"] = _plan_figures(doc.plan)
    check = doc.latency_check
    if check is not None and check.comparisons:
        out["first_measured_ms"] = check.comparisons[0].p50_ms
        out["first_measured_functions"] = check.comparisons[0].functions
        out["unsplit_measured_ms"] = check.comparisons[0].unsplit_p50_ms
    elif doc.sizing:  # one function: the unsplit model itself, not compared
        out["first_measured_ms"] = sum(s.p50_ms for s in doc.sizing)
        out["first_measured_functions"] = len(doc.sizing)
    out["decision"] = check.decision if check is not None else ""
    out["load_after"] = os.getloadavg()[0]
    shutil.rmtree(folder, ignore_errors=True)
    return out


def _plan_figures(plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "functions": len(plan["functions"]),
        "cost_per_1m_usd": plan["cost_per_1m_usd"],
        "latency_ms": plan["latency_ms"],
        "priced_for": plan.get("priced_for", {}),
    }


def row(r: dict[str, Any]) -> dict[str, Any]:
    """The table's columns for one model's figures (``run_model``'s)."""
    if "error" in r:
        return {"model": r["model"], "error": r["error"]}
    first, written = r["first"], r["written"]
    cost = written["cost_per_1m_usd"] / first["cost_per_1m_usd"]
    out = {
        "model": r["model"],
        "factor": f"x{first['priced_for'].get('time_factor')} / "
        f"x{written['priced_for'].get('time_factor')}",
        "functions": f"{first['functions']} -> {written['functions']}",
        "cost_ratio": round(cost, 3),
        "cost_ok": 1 / COST_GOAL <= cost <= COST_GOAL,
        "predicted_ms": round(first["latency_ms"], 1),
        "measured_ms": r.get("first_measured_ms"),
        "load": round(r["load_before"], 2),
        "compile_s": r["compile_s"],
    }
    measured = r.get("first_measured_ms")
    if measured and r.get("first_measured_functions") == first["functions"]:
        ratio = measured / first["latency_ms"]
        out["latency_ratio"] = round(ratio, 3)
        out["latency_ok"] = 1 / LATENCY_GOAL <= ratio <= LATENCY_GOAL
        # the first plan at the factor compile priced with (measured nearer its latency check,
        # under the load it ran in): every predicted time scaled, hops and handoffs too
        scale = _factor(written) / _factor(first)
        out["latency_ratio_at_compile_factor"] = round(ratio / scale, 3)
    return out


def _factor(plan: dict[str, Any]) -> float:
    return float(plan["priced_for"].get("time_factor") or 1.0)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table, as docs/predictions.md shows it."""
    head = (
        "| model | factor (plan / compile) | functions (first -> written) | cost written / first | "
        f"within {COST_GOAL:g}x | first plan p50 predicted, ms | measured, ms | "
        f"measured / predicted | within {LATENCY_GOAL:g}x | the same at compile's factor | "
        "load average | compile, s |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    yes = {True: "yes", False: "**no**", None: "-"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['model']} | {r['factor']} | {r['functions']} | {r['cost_ratio']:.2f} | "
            f"{yes[r['cost_ok']]} | {r['predicted_ms']} | {r['measured_ms'] or '-'} | "
            f"{r.get('latency_ratio', '-')} | {yes[r.get('latency_ok')]} | "
            f"{r.get('latency_ratio_at_compile_factor', '-')} | {r['load']} | {r['compile_s']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="suite models (default: all 12)")
    parser.add_argument(
        "--pt2",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a .pt2 saved by another process, as a row NAME (repeatable)",
    )
    parser.add_argument("--work", type=Path, default=Path("build/predict-bench"))
    parser.add_argument("--results", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument(
        "--table",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="print the table of saved --results",
    )
    args = parser.parse_args(argv)
    if args.table:
        print(markdown([row(r) for r in json.loads(args.table.read_text())["models"]]), end="")
        return
    args.work.mkdir(parents=True, exist_ok=True)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "models": [],
    }
    rows = []
    for name, model_args in _sources(args.models, args.pt2):
        print(f"{name}: plan, then compile ...", file=sys.stderr, flush=True)
        try:
            r = run_model(name, model_args, args.work, timeout_s=args.timeout_s)
        except subprocess.TimeoutExpired as exc:
            r = {"model": name, "error": f"{exc.cmd[3]}: over --timeout-s {args.timeout_s:g}"}
        results["models"].append(r)
        rows.append(row(r))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.results:
            args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(rows), end="")


if __name__ == "__main__":
    main()
