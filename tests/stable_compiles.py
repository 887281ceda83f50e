"""Compile each suite model several times and report whether the plans agree (not a test: it
takes minutes per model; ``tests/test_stable.py`` covers the check's logic in the default suite).

    python -m tests.stable_compiles [--models resnet50,bert_mini,gcn,lstm_cnn] [--repeats 3]
                                    [--plans-only] [--free-cuts] [--out build/stable]

For each model of `benchmarks.suite.SUITE` (its full-size inputs), ``mopar plan --json`` runs
twice under different ``PYTHONHASHSEED`` (the plan before any measurement must not depend on
the process), then ``mopar compile`` ``--repeats`` times, each in a fresh process; it prints one
line per model: the planned function counts, the compiled ones, and each compile's latency
check (its comparisons' ratios and intervals, and its decision). ``--json`` prints them all.
``--free-cuts`` compiles on a platform where every cut is predicted free (`FREE_CUTS_COMPILE`),
so that the check has a split plan to judge.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mopar(*args: str, seed: str = "0") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mopar", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=1800,
    )


def _cuts(plan: dict) -> list[list[str]]:
    return [f["layers"] for f in plan["functions"]]


FREE_CUTS_COMPILE = """
import sys
import mopar
from tests.test_pipeline import FREE_CUTS
mopar.compile(sys.argv[1], sys.argv[3:], out=sys.argv[2], force=True, platform=FREE_CUTS)
"""
"""A compile on `tests.test_pipeline.FREE_CUTS`, where every cut is predicted free: the plan
splits far, and the latency check has to bring it back (the examples plan one function at the
defaults on the shipped profiles, where the check does not run)."""


def _compile(factory: str, inputs, bundle: Path, seed: str, free_cuts: bool):
    if not free_cuts:
        specs = [a for spec in inputs for a in ("--input", spec)]
        return _mopar("compile", factory, *specs, "--out", str(bundle), "--force", seed=seed)
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", FREE_CUTS_COMPILE, factory, str(bundle), *inputs],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=1800,
    )


def model_report(
    name: str, repeats: int, plans_only: bool, out: Path, *, free_cuts: bool = False
) -> dict:
    from benchmarks.suite import SUITE

    factory, inputs, _ = SUITE[name].source(quick=False)
    specs = [a for spec in inputs for a in ("--input", spec)]
    planned = []
    for seed in ("0", "12345"):
        proc = _mopar("plan", factory, *specs, "--json", seed=seed)
        if proc.returncode:
            return {"model": name, "error": proc.stderr.strip().splitlines()[-1:]}
        planned.append(json.loads(proc.stdout))
    report = {
        "model": name,
        "planned_functions": [len(p["functions"]) for p in planned],
        "plans_agree": _cuts(planned[0]) == _cuts(planned[1]),
        "compiles": [],
    }
    for i in range(0 if plans_only else repeats):
        bundle = out / f"{name}-{i}"
        start = time.perf_counter()
        proc = _compile(factory, inputs, bundle, str(i), free_cuts)
        seconds = round(time.perf_counter() - start, 1)
        if proc.returncode:
            report["compiles"].append({"error": proc.stderr.strip().splitlines()[-1:]})
            continue
        doc = json.loads((bundle / "plan.json").read_text())
        check = doc.get("latency_check") or {}
        report["compiles"].append(
            {
                "functions": len(doc["plan"]["functions"]),
                "same_as_planned": _cuts(doc["plan"]) == _cuts(planned[0]),
                "seconds": seconds,
                "comparisons": [
                    f"{c['functions']} fn: {c['slowdown']:.3f}x [{c['low']:.3f}, {c['high']:.3f}] "
                    f"{c['rounds']} rounds, {c['verdict']}"
                    for c in check.get("comparisons", ())
                ],
                "decision": check.get("decision"),
            }
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert_mini,gcn,lstm_cnn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plans-only", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--free-cuts", action="store_true", help="compile on FREE_CUTS (see FREE_CUTS_COMPILE)"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="mopar-stable-"))
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for name in args.models.split(","):
        report = model_report(name, args.repeats, args.plans_only, out, free_cuts=args.free_cuts)
        reports.append(report)
        compiled = [c.get("functions", "error") for c in report.get("compiles", ())]
        print(
            f"{name}: planned {report.get('planned_functions')} "
            f"(agree: {report.get('plans_agree')}), compiled {compiled}",
            flush=True,
        )
        for c in report.get("compiles", ()):
            print(f"    {c}", flush=True)
    if args.json:
        print(json.dumps(reports, indent=2))


if __name__ == "__main__":
    main()
