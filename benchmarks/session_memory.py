"""How much memory an onnxruntime session holds beyond its weights, by session option (issue 50).

    python -m benchmarks.session_memory [--mb 512] [--layers 8] [--op matmul|conv] [--rows 1]
        [--runs 10] [--repeat 2] [--json OUT.json]
    python -m benchmarks.session_memory --bundle DIR ...    # a one-function bundle's function

A function holds its weights as external data beside ``model.onnx`` (`mopar.emit.onnx_export`):
onnxruntime maps that file on the CPU rather than copying it, but kernels that pre-pack their
weights (MatMul, Gemm, Conv) make a packed copy of each on the heap at load. The planner sizes a
function as baseline + ``weight_copies`` x its weights (2.0, ``profiles/runtime.json``).

This builds one model of ``--layers`` square float32 MatMuls over ``--rows`` x ``d`` (``--op conv``:
3x3 convolutions at 7x7), ``--mb`` MB of weights in all, saved as external data, and loads it in
a fresh process per setting:

- ``default``: `mopar.runtime.handler.session_options` as every slice runs today;
- ``no-prepack``: the same with ``session.disable_prepacking`` = 1;
- ``arena``: the same with the CPU memory arena on (onnxruntime's own default);
- ``extended``: graph optimisations up to ``extended``, not ``all`` (no NCHWc layout
  transform), alone and with ``no-prepack``.

Each process reports its peak RSS (``VmHWM``) after the session loads and after ``--runs``
runs, its RSS before loading (the runtime baseline: Python, numpy and onnxruntime imported),
the load time, the first run's time (where weights mapped but not yet read are paged in) and
the median of the runs after it. Peak beyond the baseline over the weights is the
``copies`` figure the planner's ``weight_copies`` stands for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SETTINGS", "build", "main", "markdown", "measure"]

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "chosen": {"chosen": "1"},
    "no-prepack": {"session.disable_prepacking": "1"},
    "arena": {"arena": "1"},
    "extended": {"level": "extended"},
    "extended, no-prepack": {"level": "extended", "session.disable_prepacking": "1"},
}
"""Each setting: session config entries added to the slices' options (``chosen``: those
mopar chose for the graph, its ``session.json``, none for a synthetic model; ``arena``: the CPU arena
on instead; ``level``: graph optimisations up to ``extended``, without the layout transforms of
``all`` that rewrite a conv's weights into new initializers)."""

MB = 1 << 20

SPATIAL = 7
"""The height and width of the conv variant's activations (a CNN's last stage at 224x224)."""


def build(folder: Path, *, mb: int, layers: int, op: str = "matmul", rows: int = 1) -> Path:
    """``folder/model.onnx`` of ``layers`` square MatMuls over ``rows x d`` (``op`` conv: 3x3
    convolutions of ``d`` channels at `SPATIAL` x `SPATIAL`) holding ``mb`` MB of float32
    weights in all, as external data (``model.onnx.data``)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    per = mb * MB / 4 / layers  # float32 weights per layer
    d = int((per / 9) ** 0.5) if op == "conv" else int(per**0.5)
    d -= d % 16  # channels in blocks of 16, as onnxruntime's NCHWc layout takes them
    shape = [1, d, SPATIAL, SPATIAL] if op == "conv" else [rows, d]
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        dims = (d, d, 3, 3) if op == "conv" else (d, d)
        w = rng.standard_normal(dims, dtype=np.float32) / d**0.5
        inits.append(numpy_helper.from_array(w.astype(np.float32), f"w{k}"))
        if op == "conv":
            nodes.append(helper.make_node("Conv", [x, f"w{k}"], [f"h{k}"], pads=[1, 1, 1, 1]))
        else:
            nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"h{k}"]))
        x = f"h{k}"
    graph = helper.make_graph(
        nodes,
        op,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "model.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    return path


_CHILD = r"""
import json, statistics, sys, time
import numpy as np, onnxruntime as ort
from pathlib import Path
from mopar.runtime.handler import SESSION_FILE, fix_mmap_threshold, open_session, saved_settings, session_options

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
path, entries, runs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
before = status("VmRSS:")
chosen = entries.pop("chosen", None) is not None  # what mopar chose for the graph
settings = saved_settings(Path(path).with_name(SESSION_FILE)) if chosen else {}
fix_mmap_threshold(settings.pop("mmap_threshold", 0))
opts = session_options(1)
for k, v in entries.items():
    if k == "arena":
        opts.enable_cpu_mem_arena = True
    elif k == "level":
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    else:
        opts.add_session_config_entry(k, v)
t0 = time.perf_counter()
if chosen:
    s = open_session(Path(path), 1, settings)
else:
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
load_ms = (time.perf_counter() - t0) * 1e3
loaded = status("VmHWM:")
if len(sys.argv) > 4:  # a bundle's example inputs
    ref = np.load(sys.argv[4])
    feed = {k[6:]: ref[k] for k in ref.files if k.startswith("input.")}
else:
    shape = s.get_inputs()[0].shape
    feed = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
t0 = time.perf_counter()
s.run(None, feed)
first_ms = (time.perf_counter() - t0) * 1e3
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    s.run(None, feed)
    times.append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"baseline_mb": before, "peak_after_load_mb": loaded,
                  "peak_mb": status("VmHWM:"), "rss_mb": status("VmRSS:"),
                  "load_ms": load_ms, "first_run_ms": first_ms,
                  "run_ms": statistics.median(times)}))
"""


def measure(
    path: Path, entries: dict[str, str], *, runs: int, inputs: Path | None = None
) -> dict[str, Any]:
    """Load ``path`` in a fresh process under ``entries`` and run it on ``inputs`` (a bundle's
    ``reference.npz``; None: a random ``x``); what it reports (see the module)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), json.dumps(entries), str(runs)]
        + ([str(inputs)] if inputs else []),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="MB of weights (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    parser.add_argument("--op", choices=("matmul", "conv"), default="matmul", help="layer kind")
    parser.add_argument(
        "--rows", type=int, default=1, help="matmul: rows of the input (1: a token; 128: a prompt)"
    )
    parser.add_argument(
        "--bundle", type=Path, default=None, help="measure this one-function bundle's function"
    )
    parser.add_argument("--runs", type=int, default=10, help="timed runs (default 10)")
    parser.add_argument("--repeat", type=int, default=2, help="processes per setting")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mopar-session-memory-") as tmp:
        inputs = None
        if args.bundle:  # its one function, on its example inputs
            (path,) = sorted(args.bundle.glob("functions/*/model.onnx"))
            inputs = args.bundle / "reference.npz"
        else:
            path = build(Path(tmp), mb=args.mb, layers=args.layers, op=args.op, rows=args.rows)
        weights_mb = (path.parent / "model.onnx.data").stat().st_size / MB
        rows = []
        for turn in range(args.repeat):  # the settings take turns: drift moves them alike
            for name, entries in SETTINGS.items():
                got = measure(path, entries, runs=args.runs, inputs=inputs)
                copies = (got["peak_mb"] - got["baseline_mb"]) / weights_mb
                rows.append({"setting": name, "turn": turn, "copies": round(copies, 3), **got})
    results = {
        "command": "python -m benchmarks.session_memory "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "weights_mb": round(weights_mb, 1),
        "layers": args.layers,
        "op": args.op,
        "input_rows": args.rows,
        "bundle": str(args.bundle) if args.bundle else None,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")


def markdown(results: dict[str, Any]) -> str:
    """The table of a run, one row per setting (medians over its processes)."""
    lines = [
        f"{results['date']}, {results['cores']} cores, {results['weights_mb']:g} MB of weights in "
        + (
            f"the function of {results['bundle']}, on its example inputs"
            if results.get("bundle")
            else f"{results['layers']} {results['op']} layers"
            + (f" over {results['input_rows']} rows" if results["op"] == "matmul" else "")
        )
        + ", external data.",
        "",
        "| setting | baseline, MB | peak after load, MB | peak after runs, MB | (peak - baseline) "
        "/ weights | load, ms | first run, ms | run, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in SETTINGS:
        rs = [r for r in results["rows"] if r["setting"] == name]
        if not rs:
            continue
        med = {
            k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("setting", "turn")
        }
        lines.append(
            f"| {name} | {med['baseline_mb']:.0f} | {med['peak_after_load_mb']:.0f} | "
            f"{med['peak_mb']:.0f} | {med['copies']:.2f} | {med['load_ms']:.0f} | "
            f"{med['first_run_ms']:.0f} | {med['run_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
