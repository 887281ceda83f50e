"""Text generation with expert functions against the sparse model whole (docs/generate.md).

    python -m benchmarks.generation [NAME ...] [--work DIR] [--results FILE.json]
        [--requests N] [--lambda-rates R,R,...] [--openfaas-rates R,R,...]
    python -m benchmarks.generation --table FILE.json

For each `examples.decoders` model (``mixtral_small``, ``qwen2_moe_small``, ``mixtral_wide``),
in fresh processes:

1. ``python -m examples.decoders save NAME DIR``: the ``save_pretrained`` folder, and the
   greedy tokens transformers gives after its 16-token prompt;
2. two bundles, each ``mopar compile DIR --generate --max-seq-len 64``: the whole model with
   ``--experts inline`` (both MoE layers inline as their sparse translation: the sparse model
   whole in one function, what the defaults give for the two small models), and with
   ``--experts functions --hot-experts none`` (a main function that calls one expert function
   per expert);
3. ``mopar generate BUNDLE --max-new-tokens 32 --requests N --json``: the whole model in
   process and over shm (the same: it calls nothing), the expert functions over ``shm``
   (co-located) and ``http``; each checked against transformers' tokens;
4. the expert functions scaled to zero (``--transport shm --cold-experts``, `COLD_RUNS`): never
   stopped once started, and stopped after `IDLE_S` idle, with the main function's warm-ups
   and without: the share of steps that found their expert functions warm;
5. ``mopar simulate BUNDLE --new-tokens 32 --target T --rate R``, per target and rate: $ per
   1,000 generated tokens, with request fees, cold starts, idle replicas and each expert
   function's invocations per token.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopar.bundle.document import read_document

__all__ = ["LATENCY_GOAL", "main", "markdown", "run_model"]

LATENCY_GOAL = 1.3
"""Expert functions' per-token p50 over the whole model's, under shm, at most (issue 36)."""

NAMES = ("mixtral_small", "qwen2_moe_small", "mixtral_wide")
TARGET_RATES = {
    "lambda": (0.01, 1.0, 10.0),  # billed per use: the rate changes only the cold starts' share
    "openfaas": (0.01, 0.1, 1.0, 10.0, 100.0),  # reserved replicas: the rate sets how many
}
IDLE_S = 0.2
"""Seconds an expert function may idle before it is stopped, in the runs that stop them: some
ten steps of ``mixtral_small``, so that an expert not picked for a while goes cold."""
COLD_RUNS = {
    "kept": (),
    "idle": ("--idle-s", str(IDLE_S)),
    "idle, no warm-ups": ("--idle-s", str(IDLE_S), "--no-prewarm"),
}
COLD_REQUESTS = 3
NEW_TOKENS = 32
SIM_SPAN_S = 120.0
"""Simulated traffic per rate, s (400 requests at least): OpenFaaS's autoscaler re-evaluates
every 10 s, so a rate's replicas settle within the span."""
BUNDLES = {
    "whole": ("--experts", "inline"),
    "experts": ("--experts", "functions", "--hot-experts", "none"),
}


def _run(*args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed: {proc.stderr.strip()[-500:]}")
    return proc


def run_model(
    name: str, work: Path, *, requests: int, target_rates: dict[str, Sequence[float]]
) -> dict:
    """One model's row: each bundle's per-token figures by transport, the expert functions'
    runs scaled to zero, and $/1k tokens by target and rate."""
    folder = work / name
    _run("-m", "examples.decoders", "save", name, str(folder))
    expected = json.loads((folder / "expected.json").read_text())
    prompt = ",".join(map(str, expected["prompt"]))

    def generate(bundle: Path, n: int, *flags: str) -> dict:
        out = json.loads(
            _run(
                "-m",
                "mopar",
                "generate",
                str(bundle),
                "--input-ids",
                prompt,
                "--max-new-tokens",
                str(NEW_TOKENS),
                "--requests",
                str(n),
                "--json",
                *flags,
            ).stdout  # fmt: skip
        )
        out["exact"] = out.pop("tokens") == expected["tokens"]
        return out

    row: dict[str, Any] = {"model": name, "bundles": {}}
    for kind, flags in BUNDLES.items():
        bundle = work / f"{name}-{kind}"
        started = time.perf_counter()
        _run("-m", "mopar", "compile", str(folder), "--generate", "--max-seq-len", "64",
             "--out", str(bundle), "--force", *flags)  # fmt: skip
        document = read_document(bundle)
        entry: dict[str, Any] = {
            "compile_s": round(time.perf_counter() - started, 1),
            "functions": len(document.plan["functions"]),
            "callees": len(document.generation.callees),
            "timing": document.generation.timing.to_dict(),
            "generate": {},
            "cold": {},
            "usd_per_1k_tokens": {},
        }
        for transport in ("inprocess", "shm", "http"):
            if transport != "http" or entry["callees"]:
                entry["generate"][transport] = generate(bundle, requests, "--transport", transport)
        for run, more in COLD_RUNS.items() if entry["callees"] else ():
            entry["cold"][run] = generate(
                bundle, COLD_REQUESTS, "--transport", "shm", "--cold-experts", *more
            )
        for target, rates in target_rates.items():
            usd: dict[str, float] = {}
            latency: dict[str, dict] = {}
            entry["usd_per_1k_tokens"][target] = usd
            entry.setdefault("request_latency_ms", {})[target] = latency
            for rate in rates:
                sim = json.loads(
                    _run(
                        "-m",
                        "mopar",
                        "simulate",
                        str(bundle),
                        "--target",
                        target,
                        "--rate",
                        str(rate),
                        "--requests",
                        str(max(400, int(rate * SIM_SPAN_S))),
                        "--new-tokens",
                        str(NEW_TOKENS),
                        "--json",
                    ).stdout  # fmt: skip
                )
                usd[str(rate)] = sim["cost_per_1k_tokens_usd"]
                latency[str(rate)] = sim["latency_ms"]
        row["bundles"][kind] = entry
    whole = row["bundles"]["whole"]["generate"]["shm"]["token_p50_ms"]
    experts = row["bundles"]["experts"]["generate"]["shm"]["token_p50_ms"]
    row["token_p50_ratio_shm"] = round(experts / whole, 3)
    return row


def markdown(rows: Sequence[dict]) -> str:
    """Three tables: per-token latency; the expert functions scaled to zero; $ per 1,000
    tokens by target and rate."""
    lines = [
        "| model | bundle | functions | exact | first token p50 ms (shm) | per token p50 / p95 "
        "ms: in process | shm | http | precision / recall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for kind, b in r["bundles"].items():
            g = b["generate"]

            def cell(t: str, g=g) -> str:
                if t not in g:
                    return "-"
                return f"{g[t]['token_p50_ms']:.2f} / {g[t]['token_p95_ms']:.2f}"

            foresight = (
                f"{g['shm']['prewarm_precision']:.2f} / {g['shm']['prewarm_recall']:.2f}"
                if "prewarm_precision" in g["shm"]
                else "-"
            )
            exact = all(x["exact"] for x in (*g.values(), *b["cold"].values()))
            lines.append(
                f"| {r['model']} | {kind} | {b['functions']} | {'yes' if exact else '**no**'} | "
                f"{g['shm']['first_token_p50_ms']:.2f} | {cell('inprocess')} | {cell('shm')} | "
                f"{cell('http')} | {foresight} |"
            )
        ratio = r["token_p50_ratio_shm"]
        met = "met" if ratio <= LATENCY_GOAL else "**not met**"
        lines.append(
            f"| {r['model']} | experts / whole (shm p50) | | | | | {ratio:.2f}x {met} | | |"
        )
    lines += [
        "",
        "| model | expert functions | steps warm | calls: warm / pre-warmed in time / late / "
        "cold | warm-ups (started) | start p50 ms | per token p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for run, c in r["bundles"]["experts"]["cold"].items():
            g = c["gateway"]
            lines.append(
                f"| {r['model']} | {run} | {c['warm_steps']:.1%} | {g['warm']} / "
                f"{g['prewarmed']} / {g['late']} / {g['cold']} | {g['warmups']} "
                f"({g['warm_starts']}) | {g['start_ms']:.0f} | {c['token_p50_ms']:.2f} |"
            )
    targets = list(rows[0]["bundles"]["whole"]["usd_per_1k_tokens"]) if rows else []
    for target in targets:
        rates = list(rows[0]["bundles"]["whole"]["usd_per_1k_tokens"][target])
        lines += ["", f"| {target}: model | bundle | " + " | ".join(f"{x} req/s" for x in rates)]
        lines[-1] += " |"
        lines.append("|---|---|" + "---|" * len(rates))
        for r in rows:
            for kind, b in r["bundles"].items():
                usd = b["usd_per_1k_tokens"][target]
                cells = " | ".join(f"${usd[x]:.3g}" if usd.get(x) else "-" for x in rates)
                lines.append(f"| {r['model']} | {kind} | {cells} |")
            w, e = (r["bundles"][k]["usd_per_1k_tokens"][target] for k in ("whole", "experts"))
            ratios = " | ".join(
                f"{e[x] / w[x]:.2f}x" if w.get(x) and e.get(x) else "-" for x in rates
            )
            lines.append(f"| {r['model']} | experts / whole | {ratios} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(NAMES), metavar="NAME")
    parser.add_argument("--work", type=Path, default=Path("bench-generation"))
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=10)
    for target, rates in TARGET_RATES.items():
        parser.add_argument(f"--{target}-rates", default=",".join(map(str, rates)))
    parser.add_argument("--table", type=Path, default=None, help="print the saved results' table")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())["rows"]))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    target_rates = {
        t: [float(x) for x in getattr(args, f"{t}_rates").split(",")] for t in TARGET_RATES
    }
    rows = []
    for name in args.names:
        rows.append(run_model(name, args.work, requests=args.requests, target_rates=target_rates))
        if args.results is not None:
            args.results.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
