"""onnxruntime's speed at 1 and 2 intra-op threads, per op family (issue 50, point 3).

    python -m benchmarks.threads [--rounds 5] [--seconds 1.5] [--cpus 0,1] [--json OUT.json]

The planner gives each layer the share of its time that runs in parallel across onnxruntime's
threads (Amdahl's ``p``, per op family: ``parallel_fraction`` in ``profiles/predictors.json``,
measured by the profiler at 1 and 2 threads within one process per layer) and, for a Lambda
function above 1,769 MB (more than one vCPU), speeds up only that share
(`mopar.planner.cost.slice_time_ms`). This measures the same figure again, per family, on
small hand-built ONNX models, each run in a fresh process pinned with ``taskset`` to ``--cpus``
under `mopar.runtime.handler.session_options` at 1 and at 2 threads. The processes take turns
(every family at both counts, then the next round), so drift on a shared VM moves them alike.

Per family, from the median times ``t1`` and ``t2`` over the rounds: speed-up ``s = t1 / t2``
and ``p = (1 - 1/s) / (1 - 1/2)``, the parallel fraction that gives that speed-up at 2 threads.
The load average (``/proc/loadavg``) is kept before every process: a run on a busy machine
says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.session_memory import build as build_matmuls

__all__ = ["FAMILIES", "build_all", "fraction", "main", "markdown", "measure"]


def _model(folder: Path, name: str, nodes, inputs, output, inits=()) -> Path:
    """Save a one-graph model as ``folder/name.onnx`` (weights inline: they are small)."""
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, [output], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / f"{name}.onnx"
    onnx.save_model(model, str(path))
    return path


def _info(name: str, shape: Sequence[int], elem: int | None = None):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, list(shape))


def _conv(folder: Path) -> Path:
    """A 3x3 convolution, 128 channels at 28x28 (a ResNet's second stage)."""
    import numpy as np
    from onnx import helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((128, 128, 3, 3), dtype=np.float32) * 0.03
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    return _model(
        folder,
        "conv",
        [node],
        [_info("x", (1, 128, 28, 28))],
        _info("y", (1, 128, 28, 28)),
        [numpy_helper.from_array(w, "w")],
    )


def _attention(folder: Path) -> Path:
    """softmax(Q K^T) V for 12 heads of 64 over 128 positions (BERT-base's attention core)."""
    from onnx import helper

    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["a"], axis=-1),
        helper.make_node("MatMul", ["a", "v"], ["y"]),
    ]
    shape = (1, 12, 128, 64)
    ins = [_info(n, shape) for n in ("q", "k", "v")]
    return _model(folder, "attention", nodes, ins, _info("y", shape))


def _elementwise(folder: Path) -> Path:
    """x * sigmoid(x) + x over 128 x 3072 (an MLP's activation, as element-wise ops)."""
    from onnx import helper

    nodes = [
        helper.make_node("Sigmoid", ["x"], ["g"]),
        helper.make_node("Mul", ["x", "g"], ["m"]),
        helper.make_node("Add", ["m", "x"], ["y"]),
    ]
    return _model(
        folder, "elementwise", nodes, [_info("x", (1, 128, 3072))], _info("y", (1, 128, 3072))
    )


def _layer_norm(folder: Path) -> Path:
    """LayerNormalization over 768 of 512 positions."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.ones(768, np.float32), "g"),
        numpy_helper.from_array(np.zeros(768, np.float32), "b"),
    ]
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)
    shape = (1, 512, 768)
    return _model(folder, "layer_norm", [node], [_info("x", shape)], _info("y", shape), inits)


def _gather(folder: Path) -> Path:
    """512 rows of a 32,000 x 768 embedding table (98 MB)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((32000, 768), dtype=np.float32)
    node = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)
    return _model(
        folder,
        "gather",
        [node],
        [_info("ids", (1, 512), TensorProto.INT64)],
        _info("y", (1, 512, 768)),
        [numpy_helper.from_array(table, "table")],
    )


def _matmuls(rows: int) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        sub = folder / f"matmul_{rows}"
        sub.mkdir()
        return build_matmuls(sub, mb=64, layers=4, rows=rows)

    return make


FAMILIES: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "gemm 1 row": ("gemm", _matmuls(1)),
    "gemm 128 rows": ("gemm", _matmuls(128)),
    "conv": ("conv", _conv),
    "attention": ("attention", _attention),
    "elementwise": ("elementwise", _elementwise),
    "layer_norm": ("layer_norm", _layer_norm),
    "gather": ("other", _gather),
}
"""Each family measured: the profiler's family name (`mopar.profile.features`) whose
``parallel_fraction`` it checks, and how its model is built. ``gemm``: 4 square MatMuls over
64 MB of weights (d = 2,048), as `benchmarks.session_memory` builds them, at 1 row (a decoder's
token) and at 128 (a prompt)."""


def build_all(folder: Path) -> dict[str, Path]:
    """Every family's model, under ``folder``."""
    return {name: make(folder) for name, (_, make) in FAMILIES.items()}


_CHILD = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
from mopar.runtime.handler import session_options

path, threads, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = ort.InferenceSession(path, session_options(threads), providers=["CPUExecutionProvider"])
rng = np.random.default_rng(1)
feed = {}
for i in s.get_inputs():
    shape = [d if isinstance(d, int) else 1 for d in i.shape]
    if i.type == "tensor(int64)":
        feed[i.name] = rng.integers(0, 32000, shape).astype(np.int64)
    else:
        feed[i.name] = rng.standard_normal(shape).astype(np.float32)
for _ in range(3):
    s.run(None, feed)
times, end = [], time.perf_counter() + seconds
while time.perf_counter() < end or len(times) < 5:
    t0 = time.perf_counter()
    s.run(None, feed)
    times.append((time.perf_counter() - t0) * 1e3)
times.sort()
print(json.dumps({"ms": times[len(times) // 2], "runs": len(times)}))
"""


def load_average() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def _busy_s() -> float:
    """CPU-seconds every CPU has been busy since boot (``/proc/stat``: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_others: float, *, most_s: float = 30.0) -> float:
    """Wait (up to ``most_s``) for a second in which the machine is busy for at most
    ``max_others`` cores; the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < most_s:
        busy = _busy_s()
        time.sleep(1.0)
        if _busy_s() - busy <= max_others:
            break
    return time.perf_counter() - start


def measure(
    path: Path,
    threads: int,
    *,
    seconds: float,
    cpus: str,
    max_others: float = 0.15,
    tries: int = 3,
    quiet_s: float = 30.0,
    nice: int = 0,
) -> dict[str, Any]:
    """The median run of ``path`` at ``threads`` intra-op threads in a fresh process pinned to
    ``cpus`` (a ``taskset`` list; empty: not pinned) at niceness ``nice``, timed for ``seconds``.

    Other processes' CPU while it ran (the machine's busy time less the child's own, in cores)
    is kept as ``others``. Each start waits up to ``quiet_s`` for a quiet second (`wait_quiet`); a process that met
    others above ``max_others`` is run again, up to ``tries`` times (the last is kept, and says so)."""
    cmd = [sys.executable, "-c", _CHILD, str(path), str(threads), str(seconds)]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    for attempt in range(1, tries + 1):
        wait_quiet(max_others, most_s=quiet_s)
        load, busy, t0 = load_average(), _busy_s(), time.perf_counter()
        mine = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        own = after.ru_utime + after.ru_stime - mine.ru_utime - mine.ru_stime
        others = max(_busy_s() - busy - own, 0.0) / (time.perf_counter() - t0)
        if others <= max_others or attempt == tries:
            break
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {**got, "load": load, "others": round(others, 3), "tries": attempt}


def fraction(t1_ms: float, tn_ms: float, n: int = 2) -> float:
    """Amdahl's parallel fraction that turns ``t1_ms`` at one thread into ``tn_ms`` at ``n``,
    clipped to [0, 1] (as `tools.profiler.train.parallel_fractions` takes it)."""
    p = (1.0 - tn_ms / t1_ms) / (1.0 - 1.0 / n)
    return min(max(p, 0.0), 1.0)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family: median times at 1 and 2 threads, the speed-up, the parallel fraction, the
    spread of the per-round fractions, and the profiler's figure (predictors.json)."""
    from mopar.facts import PROFILES_DIR
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors

    predictors = load_predictors(PROFILES_DIR, feature_names=FEATURE_NAMES)
    out = []
    for name, (family, _) in FAMILIES.items():
        rs = [r for r in rows if r["family"] == name]
        if not rs:
            continue
        t1 = statistics.median(r["ms"] for r in rs if r["threads"] == 1)
        t2 = statistics.median(r["ms"] for r in rs if r["threads"] == 2)
        per_round = [
            fraction(a["ms"], b["ms"])
            for a in rs
            for b in rs
            if a["round"] == b["round"] and a["threads"] == 1 and b["threads"] == 2
        ]
        out.append(
            {
                "family": name,
                "profiler_family": family,
                "t1_ms": round(t1, 3),
                "t2_ms": round(t2, 3),
                "speedup": round(t1 / t2, 3),
                "parallel_fraction": round(fraction(t1, t2), 3),
                "fraction_low": round(min(per_round), 3),
                "fraction_high": round(max(per_round), 3),
                "profiler_fraction": predictors.parallel_fraction(family),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="processes per family and count")
    parser.add_argument("--seconds", type=float, default=1.5, help="timed seconds per process")
    parser.add_argument("--cpus", default="0,1", help="taskset CPU list ('' to not pin)")
    parser.add_argument(
        "--max-others", type=float, default=0.15, help="rerun above this many cores of others"
    )
    parser.add_argument("--quiet-s", type=float, default=30.0, help="wait for a quiet second")
    parser.add_argument(
        "--nice", type=int, default=0, help="run each child at this niceness (-20: ahead of others)"
    )
    parser.add_argument("--only", default="", help="comma-separated families (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    only = [f for f in args.only.split(",") if f]
    rows = []
    started = load_average()
    with tempfile.TemporaryDirectory(prefix="mopar-threads-") as tmp:
        paths = build_all(Path(tmp))
        for turn in range(args.rounds):
            for name, path in paths.items():
                if only and name not in only:
                    continue
                # which count goes first alternates, so a trend favours neither
                for threads in (1, 2) if turn % 2 == 0 else (2, 1):
                    got = measure(
                        path,
                        threads,
                        seconds=args.seconds,
                        cpus=args.cpus,
                        max_others=args.max_others,
                        quiet_s=args.quiet_s,
                        nice=args.nice,
                    )
                    rows.append({"family": name, "threads": threads, "round": turn, **got})
    import onnxruntime

    results = {
        "command": "python -m benchmarks.threads "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "onnxruntime": onnxruntime.__version__,
        "load_start": started,
        "load_end": load_average(),
        "load_max": max(r["load"] for r in rows),
        "others_max": max(r["others"] for r in rows),
        "retried": sum(r["tries"] > 1 for r in rows),
        "rows": rows,
        "families": summary(rows),
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")


def markdown(results: dict[str, Any]) -> str:
    """The table of a run, one row per family."""
    lines = [
        f"{results['date']}, {results['cores']} cores, onnxruntime {results['onnxruntime']}, "
        f"load average {results['load_start']:.2f} at the start, {results['load_max']:.2f} at "
        f"most, {results['load_end']:.2f} at the end; other processes' CPU during a measured "
        f"process at most {results['others_max']:.2f} cores ({results['retried']} of "
        f"{len(results['rows'])} processes rerun for it).",
        "",
        "| family | 1 thread, ms | 2 threads, ms | speed-up | parallel fraction (rounds' range) "
        "| profiler's (predictors.json) |",
        "|---|---|---|---|---|---|",
    ]
    for f in results["families"]:
        lines.append(
            f"| {f['family']} | {f['t1_ms']:.3f} | {f['t2_ms']:.3f} | {f['speedup']:.2f}x | "
            f"{f['parallel_fraction']:.2f} ({f['fraction_low']:.2f}-{f['fraction_high']:.2f}) | "
            f"{f['profiler_fraction']:.2f} ({f['profiler_family']}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
