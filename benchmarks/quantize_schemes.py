"""Each int8 scheme's accuracy and speed on this machine's int8 kernels, on real weights and
real data (docs/quantize-benchmarks.md quotes it).

    python -m benchmarks.quantize_schemes efficientnet minilm [--work DIR] [--json]

For each model: its float32 unsplit function (``mopar compile MODEL --slices 1``, as
`benchmarks.quantize` compiles it), then each int8 scheme `mopar.compress.kernels.schemes_for`
gives this machine's kernels (those that keep convolutions float only for a model that has
some), made by mopar's own `write_form` from that function, calibrated on the first `TRAIN`
calibration samples, and run in onnxruntime (one thread) on the evaluation samples, which no
compile sees:

- EfficientNet-Lite0: the top-1 change against float32, with its 95% interval, and the floor
  these photos set: the top-1 change that Gaussian noise of 1% of the inputs' spread causes in
  the float model itself;
- all-MiniLM-L6-v2: the lowest cosine of the mean-pooled sentence embedding (the rows the
  attention mask keeps), of any row the mask keeps, and of any row at all (padding included);

and each scheme's time per sample against float32's (the fastest of 3 passes).

Needs what `benchmarks.quantize` needs (scikit-image's photos, the real-weight packages).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quantize import MODELS, calibration

__all__ = ["TRAIN", "NOISE", "measure_schemes", "main"]

TRAIN = 32
"""Calibration samples the static convolutions' activation ranges are taken from (what a
compile keeps to calibrate when a 1% budget holds the rest out: `mopar.compress.budget`)."""

NOISE = 0.01
"""The input noise of the floor, as a share of the inputs' standard deviation."""


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run(session, samples: Sequence[Mapping[str, np.ndarray]]) -> tuple[list, float]:
    names = {i.name for i in session.get_inputs()}
    feeds = [{k: v for k, v in s.items() if k in names} for s in samples]
    outs = [session.run(None, f)[0] for f in feeds]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for f in feeds:
            session.run(None, f)
        best = min(best, (time.perf_counter() - start) / len(feeds) * 1e3)
    return outs, best


def _judge(name: str, ref: list, got: list, held: Sequence[Mapping[str, np.ndarray]]) -> dict:
    """The measures of a scheme's first output against float32's, by mopar's own `effect_of`:
    EfficientNet's top-1 change and interval; MiniLM's pooled, kept-row and every-row cosine."""
    from mopar.compress.budget import effect_of

    refs, gots = [{"y": r} for r in ref], [{"y": g} for g in got]
    if name == "efficientnet":
        e = effect_of(refs, gots)
        return {"top1_change": e.top1_change, "interval": e.top1_interval(), "samples": e.rows}
    kept = effect_of(refs, gots, masks=[s["attention_mask"] for s in held])
    return {
        "pooled_cosine": kept.pooled_cosine,
        "kept_rows_cosine": kept.cosine,
        "every_row_cosine": effect_of(refs, gots).cosine,
        "samples": len(held),
    }


def _noise_floor(session, held: Sequence[Mapping[str, np.ndarray]], ref: list) -> float:
    rng = np.random.default_rng(0)
    noisy = [
        {k: v + rng.normal(0, NOISE * v.std(), v.shape).astype(v.dtype) for k, v in s.items()}
        for s in held
    ]
    got, _ = _run(session, noisy)
    r, g = np.concatenate(ref), np.concatenate(got)
    return float((r.argmax(-1) != g.argmax(-1)).mean())


def measure_schemes(name: str, work: Path) -> dict[str, Any]:
    """Every scheme of model ``name`` against its float32 function (compiled under ``work``)."""
    import onnx

    from mopar.compress.kernels import describe, schemes_for, this_machine
    from mopar.compress.quantize import write_form

    spec = MODELS[name]
    calib, held, source = calibration(name)
    unsplit = work / name / "U"
    if not (unsplit / "plan.json").is_file():
        inputs = [a for i in spec.inputs for a in ("--input", i)]
        cmd = [sys.executable, "-m", "mopar", "compile", spec.target, *inputs, *spec.unsplit]
        subprocess.run([*cmd, "--out", str(unsplit), "--force"], check=True, stdout=sys.stderr)
    (path,) = sorted((unsplit / "functions").glob("*/model.onnx"))
    count = len(next(iter(calib.values())))
    train = [{k: v[i] for k, v in calib.items()} for i in range(min(TRAIN, count))]
    ref, float_ms = _run(_session(path), held)
    rows = []
    convs = any(
        n.op_type == "Conv" for n in onnx.load(str(path), load_external_data=False).graph.node
    )
    for scheme in schemes_for(this_machine(), this_machine(), convs=convs):
        folder = work / name / "schemes" / scheme.name.replace(" ", "_").replace(",", "")
        made = write_form(path, folder, "int8", train, scheme)
        if made is None:
            continue
        got, ms = _run(_session(made), held)
        rows.append({"scheme": scheme.name, **_judge(name, ref, got, held), "speed": float_ms / ms})
    out: dict[str, Any] = {
        "model": name,
        "kernels": describe(this_machine()),
        "data": source,
        "train": len(train),
        "float_ms": float_ms,
        "schemes": rows,
    }
    if name == "efficientnet":
        out["noise_floor_top1_change"] = _noise_floor(_session(path), held, ref)
    return out


def _table(result: Mapping[str, Any]) -> str:
    lines = [f"{result['model']} on {result['kernels']} ({result['data']})"]
    for r in result["schemes"]:
        if "top1_change" in r:
            low, high = r["interval"]
            what = f"top-1 change {r['top1_change']:6.1%} ({low:.1%}-{high:.1%})"
        else:
            what = (
                f"cosine pooled {r['pooled_cosine']:.4f}, kept rows {r['kept_rows_cosine']:.4f}, "
                f"every row {r['every_row_cosine']:.4f}"
            )
        lines.append(f"  {r['scheme']:32s} {what}  speed {r['speed']:.2f}x float32")
    if "noise_floor_top1_change" in result:
        lines.append(
            f"  floor: {NOISE:.0%} input noise changes {result['noise_floor_top1_change']:.1%}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", choices=("efficientnet", "minilm"))
    parser.add_argument("--work", type=Path, default=Path("quantize-bench"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    results = [measure_schemes(m, args.work) for m in args.models]
    print(json.dumps(results, indent=2) if args.json else "\n\n".join(map(_table, results)))


if __name__ == "__main__":
    main()
