"""A split bundle's cold request with its functions started together (pre-warm) and one after
another, on the local runner or through its Lambda handlers (issue 50, point 3).

    python -m benchmarks.cold_chain BUNDLE [--lambda] [--rounds 4] [--requests 3] [--json OUT.json]

Each run is ``mopar run BUNDLE --cold --requests N --json``: no function runs before the first
request, whose latency the report gives (``first_request_ms``). With ``--prewarm`` (the default)
the runner starts every other function the moment the request finds the entry cold, so their
starts overlap (`mopar.runner.shm_session`); with ``--no-prewarm`` each starts when the request
reaches it. The two take turns, ``--rounds`` times each.

With ``--lambda`` (a bundle compiled ``--target lambda``) each function is the bundle's Lambda
handler behind the emulated Invoke API (`mopar.targets.aws_lambda.emulate`), in the plan's chain
mode, its INIT left to its first invocation as on Lambda. Together, the entry's handler warms
up the others at the start of its INIT (its ``MOPAR_PREWARM``, as ``template.yaml`` sets it);
one after another, it does not. Each function's start is then its INIT as its handler measured
it (the spans of the cold request).

Against each run's own figures, the two rules `mopar.planner.cost.cold_latency_ms` prices: the warm
latency (the report's median, the cold request aside when there are 3 or more) plus the
largest function's start (together) or the sum of them (one after another), each function's
start being the report's ``cold_start_ms`` (process start to a loaded session).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "markdown", "measure"]

MODES = {"together": "--prewarm", "one after another": "--no-prewarm"}


def measure(bundle: Path, mode: str, *, requests: int) -> dict[str, Any]:
    """One cold ``mopar run`` of ``bundle`` in ``mode`` (a key of `MODES`): the cold request's
    latency, the warm median, each function's start, and the two rules' estimates, ms."""
    cmd = [sys.executable, "-m", "mopar", "run", str(bundle), "--cold", MODES[mode]]
    cmd += ["--requests", str(requests), "--json"]
    load = float(Path("/proc/loadavg").read_text().split()[0])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    report = json.loads(done.stdout)
    starts = [s["cold_start_ms"] for s in report["slices"]]
    warm = report["latency_ms"]["p50"]
    return {
        "mode": mode,
        "load": load,
        "first_request_ms": report["cold"]["first_request_ms"],
        "warm_p50_ms": warm,
        "start_ms": starts,
        "together_rule_ms": round(warm + max(starts), 1),
        "sum_rule_ms": round(warm + sum(starts), 1),
    }


def measure_lambda(bundle: Path, mode: str, *, requests: int) -> dict[str, Any]:
    """`measure` through the bundle's Lambda handlers (`mopar.runner.chain.AS_PLANNED`), each
    starting cold, the entry warming up the others or not by ``mode``."""
    from mopar.config import RunConfig
    from mopar.runner.bundle import read_manifest, read_reference
    from mopar.runner.chain import AS_PLANNED
    from mopar.runner.local import run_bundles

    inputs, expected = read_reference(bundle / "reference.npz")
    config = RunConfig(requests=requests, start_cold=True, prewarm=mode == "together")
    load = float(Path("/proc/loadavg").read_text().split()[0])
    (report,) = run_bundles(
        [read_manifest(bundle)], inputs, config=config, expected=expected, transport=AS_PLANNED
    )
    assert report.cold is not None and not report.errors, report.error_messages
    starts = [s.init_ms for s in report.served[0].invocations]
    warm = statistics.median(r.latency_ms for r in report.served[1:] if r.latency_ms is not None)
    return {
        "mode": mode,
        "load": load,
        "first_request_ms": report.cold["first_request_ms"],
        "warm_p50_ms": round(warm, 3),
        "start_ms": [round(x, 1) for x in starts],
        "together_rule_ms": round(warm + max(starts), 1),
        "sum_rule_ms": round(warm + sum(starts), 1),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path, help="a split bundle (mopar compile --slices 3)")
    parser.add_argument("--rounds", type=int, default=4, help="runs per mode (default 4)")
    parser.add_argument("--requests", type=int, default=3, help="requests per run (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument(
        "--lambda",
        dest="handlers",
        action="store_true",
        help="through the bundle's Lambda handlers (a --target lambda bundle)",
    )
    args = parser.parse_args(argv)
    how = measure_lambda if args.handlers else measure
    rows = []
    for turn in range(args.rounds):
        order = list(MODES) if turn % 2 == 0 else list(MODES)[::-1]
        rows += [{"round": turn, **how(args.bundle, m, requests=args.requests)} for m in order]
    results = {
        "command": "python -m benchmarks.cold_chain "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "bundle": str(args.bundle),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")


def markdown(results: dict[str, Any]) -> str:
    """One row per mode (medians over its runs), then the ratio of the two cold requests."""
    lines = [
        f"{results['date']}, {results['cores']} cores, {results['bundle']}; load average "
        f"{max(r['load'] for r in results['rows']):.2f} at most.",
        "",
        "| functions start | cold request, ms | warm p50, ms | each function's start, ms "
        "| warm + largest start, ms | warm + sum of starts, ms |",
        "|---|---|---|---|---|---|",
    ]
    med = {}
    for mode in MODES:
        rs = [r for r in results["rows"] if r["mode"] == mode]
        m = {
            k: statistics.median(r[k] for r in rs)
            for k in rs[0]
            if k.endswith("_ms") and k != "start_ms"
        }
        starts = [
            statistics.median(r["start_ms"][k] for r in rs) for k in range(len(rs[0]["start_ms"]))
        ]
        med[mode] = m
        lines.append(
            f"| {mode} | {m['first_request_ms']:.0f} | {m['warm_p50_ms']:.0f} | "
            f"{', '.join(f'{s:.0f}' for s in starts)} | {m['together_rule_ms']:.0f} | "
            f"{m['sum_rule_ms']:.0f} |"
        )
    a, b = (med[m]["first_request_ms"] for m in MODES)
    lines += ["", f"cold request, one after another / together: {b / a:.2f}x."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
