"""A function process's start, by the size of its weights, from a warm and a cold page cache
(issue 50, point 3).

    python -m benchmarks.cold_start [--mb 128,512,1024,2048] [--rounds 3] [--json OUT.json]

The planner prices a cold start's INIT as ``base_ms`` + ``ms_per_weight_mb`` x the function's
weights (``cold_start`` in ``profiles/runtime.json``; `mopar.facts.Platform.init_ms`). This
measures what that stands for: a fresh Python process that imports numpy and onnxruntime, loads
a function folder as `mopar.runtime.handler.SliceHandler` does (``model.onnx`` with its weights
as external data, under `session_options`, with ``--settings``' config entries) and answers its
first request. onnxruntime maps external data; a kernel that pre-packs reads its weights at
load, and the others' pages are read when a layer first touches them, so the first run pays:
INIT here is start to the end of the first run, less one warm run (the request's own time).

Each folder holds ``--layers`` square MatMuls over one row (a decoder's token), built by
`benchmarks.session_memory.build`. Every round, each size runs twice, interleaved:

- ``cold``: after ``os.sync()``, the folder's files are evicted from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)``); ``fincore`` (util-linux), where installed, reports
  how much of the weights stayed resident before the start;
- ``warm``: at once after, with the weights in the page cache.

Python's and onnxruntime's own files stay cached in both (on Lambda, the runtime's layers are
shared by many functions and cached on the worker: see docs/big-model-facts.md). A linear fit
of INIT over the weights' MB, per setting and cache state, gives the load rate. Each round also
times a plain read of the evicted weights file (the disk's own rate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.session_memory import MB, build

__all__ = ["evict", "fit", "main", "markdown", "measure", "resident_bytes"]

_CHILD = r"""
import sys, time
t0 = time.time()
import json
import numpy as np
import onnxruntime as ort
from mopar.runtime.handler import fix_mmap_threshold, session_options
t_import = time.time()
fix_mmap_threshold()  # as SliceHandler does
opts = session_options(int(sys.argv[2]))
for k, v in json.loads(sys.argv[3]).items():
    opts.add_session_config_entry(k, v)
s = ort.InferenceSession(sys.argv[1] + "/model.onnx", opts, providers=["CPUExecutionProvider"])
t_session = time.time()
feed = {i.name: np.ones([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
        for i in s.get_inputs()}
s.run(None, feed)
t_first = time.time()
cpu_s = time.process_time()
warm = []
for _ in range(3):
    t = time.perf_counter()
    s.run(None, feed)
    warm.append((time.perf_counter() - t) * 1e3)
print(json.dumps({"t0": t0, "import": t_import, "session": t_session, "first": t_first,
                  "cpu_s": cpu_s, "warm_run_ms": sorted(warm)[1]}))
"""

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "no-prepack": {"session.disable_prepacking": "1"},
}
"""Session config entries added to `mopar.runtime.handler.session_options`: as slices run
today, and without pre-packing (MatMul weights then stay mapped, read at the first run)."""


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (written back first)."""
    os.sync()
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(path: Path) -> int | None:
    """How many bytes of ``path`` the page cache holds (``fincore``; None: not installed)."""
    if shutil.which("fincore") is None:
        return None
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[0])


def read_ms(path: Path) -> float:
    """The time to read ``path`` through once, in 16 MB reads, ms."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 * MB):
            pass
    return (time.perf_counter() - t0) * 1e3


def measure(folder: Path, *, threads: int, entries: dict[str, str]) -> dict[str, Any]:
    """Start a function process on ``folder`` (``model.onnx`` under `session_options` with
    ``entries``, as `mopar.runtime.handler.SliceHandler` loads it); its phases, ms from before
    the spawn, and its CPU time up to the end of the first run."""
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), str(threads), json.dumps(entries)],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    first_ms = (got["first"] - spawned) * 1e3
    return {
        "interpreter_ms": round((got["t0"] - spawned) * 1e3, 1),
        "import_ms": round((got["import"] - got["t0"]) * 1e3, 1),
        "session_ms": round((got["session"] - got["import"]) * 1e3, 1),
        "first_run_ms": round((got["first"] - got["session"]) * 1e3, 1),
        "warm_run_ms": round(got["warm_run_ms"], 2),
        # INIT: everything up to the first answer but that request's own (warm) time
        "init_ms": round(first_ms - got["warm_run_ms"], 1),
        "init_cpu_ms": round(got["cpu_s"] * 1e3 - got["warm_run_ms"], 1),
    }


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``(base_ms, ms_per_mb)`` of ``(mb, ms)`` points."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="128,512,1024,2048", help="weight sizes, MB")
    parser.add_argument("--layers", type=int, default=16, help="MatMul layers per model")
    parser.add_argument("--rounds", type=int, default=3, help="cold and warm starts per size")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument(
        "--settings", default="default,no-prepack", help=f"of {', '.join(SETTINGS)}"
    )
    parser.add_argument("--dir", type=Path, default=None, help="build the models here (kept)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.mb.split(",")]
    settings = [s for s in args.settings.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mopar-cold-start-", dir=args.dir) as tmp:
        folders = {}
        for mb in sizes:
            folders[mb] = Path(tmp) / f"w{mb}"
            folders[mb].mkdir()
            build(folders[mb], mb=mb, layers=args.layers, rows=1)
        for turn in range(args.rounds):
            for folder in folders.values():
                data = folder / "model.onnx.data"
                evict(folder)
                raw = read_ms(data)  # the disk's own rate, cold
                for setting in settings:
                    for cache in ("cold", "warm"):
                        if cache == "cold":
                            evict(folder)
                        resident = resident_bytes(data)
                        load = load_average()
                        got = measure(folder, threads=args.threads, entries=SETTINGS[setting])
                        rows.append(
                            {
                                "mb": round(data.stat().st_size / MB, 1),
                                "setting": setting,
                                "cache": cache,
                                "round": turn,
                                "resident_before_mb": None if resident is None else resident / MB,
                                "read_ms": round(raw, 1),
                                "load": load,
                                **got,
                            }
                        )
    results = {
        "command": "python -m benchmarks.cold_start "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "layers": args.layers,
        "load_max": max(r["load"] for r in rows),
        "rows": rows,
        "fits": fits(rows),
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")


def fits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and cache state, INIT (wall, and the process's CPU) fitted over the MB."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for cache in ("cold", "warm"):
            rs = [r for r in rows if r["setting"] == setting and r["cache"] == cache]
            if len({r["mb"] for r in rs}) < 2:
                continue
            entry = {"setting": setting, "cache": cache}
            for key in ("init_ms", "init_cpu_ms"):
                base, slope = fit([(r["mb"], r[key]) for r in rs])
                entry[key] = {"base_ms": round(base, 1), "ms_per_mb": round(slope, 3)}
            out.append(entry)
    raw = {r["mb"]: r["read_ms"] for r in rows}
    base, slope = fit(list(raw.items())) if len(raw) > 1 else (0.0, 0.0)
    out.append(
        {
            "setting": "plain read",
            "cache": "cold",
            "read_ms": {"base_ms": round(base, 1), "ms_per_mb": round(slope, 3)},
        }
    )
    return out


def markdown(results: dict[str, Any]) -> str:
    """One row per size, setting and cache state (medians over the rounds), then the fits."""
    lines = [
        f"{results['date']}, {results['cores']} cores, {results['threads']} intra-op thread(s), "
        f"{results['layers']} MatMul layers over 1 row, external data; load average "
        f"{results['load_max']:.2f} at most.",
        "",
        "| weights, MB | setting | cache | resident before, MB | interpreter, ms | imports, ms "
        "| session, ms | first run, ms | warm run, ms | INIT, ms | INIT, CPU ms | plain read, ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ("interpreter_ms", "import_ms", "session_ms", "first_run_ms", "warm_run_ms")
    keys += ("init_ms", "init_cpu_ms", "read_ms")
    rows = results["rows"]
    for mb in sorted({r["mb"] for r in rows}):
        for setting in dict.fromkeys(r["setting"] for r in rows):
            for cache in ("cold", "warm"):
                rs = [
                    r for r in rows if (r["mb"], r["setting"], r["cache"]) == (mb, setting, cache)
                ]
                med = {k: statistics.median(r[k] for r in rs) for k in keys}
                res = [r["resident_before_mb"] for r in rs if r["resident_before_mb"] is not None]
                lines.append(
                    f"| {mb:g} | {setting} | {cache} | {f'{max(res):.0f}' if res else '-'} | "
                    + " | ".join(f"{med[k]:.0f}" for k in keys)
                    + " |"
                )
    lines.append("")
    for f in results["fits"]:
        for key, what in (("init_ms", "INIT"), ("init_cpu_ms", "its CPU"), ("read_ms", "read")):
            if key in f:
                b, m = f[key]["base_ms"], f[key]["ms_per_mb"]
                rate = f" ({1e3 / m:.0f} MB/s)" if m > 0 else ""
                lines.append(
                    f"- {f['setting']}, {f['cache']}: {what} = {b:.0f} ms + {m:.3f} ms per MB{rate}"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
