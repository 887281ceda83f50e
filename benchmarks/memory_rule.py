"""How many copies of its weights the planner must count for a function (issue 50, point 1).

The planner sizes a function as the runtime baseline + ``weight_copies`` x its weights + the
largest predicted transient + the bytes in and out (`mopar.planner.problem`). Compile measures
each function's peak RSS in its server (``plan.json``'s ``sizing``). Since every other term is
independent of ``weight_copies``, the copies that would have made the prediction meet the peak
exactly are

    copies_needed = copies + (peak - need) / weights

and the smallest grid value at or above every function's is the rule's value. Run it on bundles
compiled with the copies given (``--copies``, the value in ``profiles/runtime.json`` then):

    python -m benchmarks.memory_rule build/rule-* --copies 2.0
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["needed_copies", "main"]

MB = float(1 << 20)


def needed_copies(plan: dict, copies: float) -> list[dict]:
    """One row per function of a bundle's ``plan.json`` that holds weights."""
    weights = {f["name"]: f["param_bytes"] / MB for f in plan["plan"]["functions"]}
    rows = []
    for s in plan.get("sizing", []):
        w = weights.get(s["function"], 0.0)
        if w <= 0 or not s.get("peak_rss_mb"):
            continue
        rows.append(
            {
                "model": plan["plan"]["model"],
                "function": s["function"],
                "weights_mb": round(w, 1),
                "need_mb": s["need_mb"],
                "peak_mb": s["peak_rss_mb"],
                "copies_needed": round(copies + (s["peak_rss_mb"] - s["need_mb"]) / w, 3),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument(
        "--copies", type=float, required=True, help="the copies they were planned at"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [
        r
        for b in args.bundles
        for r in needed_copies(json.loads((b / "plan.json").read_text()), args.copies)
    ]
    worst = max(r["copies_needed"] for r in rows)
    print("| model | function | weights, MB | need, MB | peak, MB | copies needed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['function']} | {r['weights_mb']:g} | {r['need_mb']:g} | "
            f"{r['peak_mb']:g} | {r['copies_needed']:.2f} |"
        )
    print(
        f"\nthe most any function needs: {worst:.2f}; at 0.05 steps: {math.ceil(worst * 20) / 20:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"copies": args.copies, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
