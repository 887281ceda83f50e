"""Does the time model hold under kernel CPU limits? (docs/cpu-limits.md quotes it.)

    python -m benchmarks.cpu_limits [--models A,B,C,D] [--shares 0.25,0.5,1,2]
        [--requests N] [--warmup W] [--gap-ms G] [--work DIR] [--json OUT.json] [--trial]
    python -m benchmarks.cpu_limits --table OUT.json    # the table of saved results

For each model (`DEFAULT_MODELS` from `benchmarks.suite.SUITE`, at their workloads):

1. ``mopar compile MODEL --slices 1 --no-check-latency`` in a fresh process: the model unsplit,
   one function (the latency check serves the plan beside the unsplit model, which is the same
   thing here, and only costs time);
2. the function's predicted time at one vCPU and its parallel part, from the predictors as the
   planner has them (`mopar.api.predict`, back at one vCPU by `mopar.planner.problem.one_vcpu`,
   summed over the function's layers as `mopar.pipeline.stages` sums them): the parallel share
   ``f = par / t1``;
3. ``mopar build --kind openfaas`` on the local base (`mopar.container.build.LOCAL_BASE`), then,
   for each share ``c``, the function's container under ``podman run --cpus c`` with
   ``MOPAR_INTRA_OP = max(1, floor(c))`` (`intra_op`): a few warm-up requests, then
   ``--requests`` requests one at a time on 127.0.0.1, each its frame of the bundle's example
   inputs, each answered before the next is sent (``--gap-ms`` idles between them).

The time of a request is the function server's own (its ``X-Mopar-Timing`` entry:
`mopar.runtime.framed.SliceFunction.process`, decoding, running and encoding), so neither
HTTP nor this client's own CPU is in it; the client's round trip is recorded beside it.

The model is anchored at the measured 1-vCPU median, ``t1 := measured(1)``; at ``c`` it
predicts `mopar.planner.cost.slice_time_ms` ``(t1, f * t1, c)``, that is
``t1 * ((1 - f) / min(c, 1) + f / c)``. A share is within the goal where measured / modelled
lies in ``[1 - GOAL, 1 + GOAL]``. The container's CFS quota and throttling counters (cgroup
``cpu.stat``) are read before and after each share's requests, to show the limit was applied.

The load average is recorded before each model: on a shared machine the figures move with it,
and a run on a busy machine is no measurement of the model (``--trial`` marks such a run).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODELS",
    "DEFAULT_SHARES",
    "GOAL",
    "intra_op",
    "main",
    "markdown",
    "modelled_ms",
    "rows",
    "run_model",
]

GOAL = 0.15
"""A share's measured median may differ from the modelled time by this fraction at most."""

DEFAULT_MODELS = ("resnet50", "inception_v3", "bert_mini", "lstm_cnn")
"""Two CNNs, a transformer encoder and an LSTM at the suite's workloads (`SUITE`), each
compiled in about a minute; the predictors give them 124-291 ms a request at one vCPU."""

DEFAULT_SHARES = (0.25, 0.5, 1.0, 2.0)
"""vCPUs (podman ``--cpus``)."""

MEMORY_HEADROOM = 2.0
"""A container's memory limit over the memory its plan gives the function: the CPU limit is
under test here, not the memory sizing."""

READY_TIMEOUT_S = 180.0
"""How long a container may take to answer its health check (a 0.25 vCPU one loads slowly)."""


def intra_op(vcpus: float) -> int:
    """onnxruntime's intra-op threads for a function with ``vcpus``: one below two vCPUs, else
    the whole vCPUs (what the function's ``MOPAR_INTRA_OP`` follows)."""
    return max(1, math.floor(vcpus))


def modelled_ms(t1_ms: float, share: float, vcpus: float) -> float:
    """The time model at ``vcpus``: ``t1_ms`` at one vCPU, ``share`` of it parallel (ms)."""
    from mopar.planner.cost import slice_time_ms

    return float(slice_time_ms(t1_ms, share * t1_ms, vcpus))


# --- one model --------------------------------------------------------------------------------


def _mopar(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mopar", *args], capture_output=True, text=True, timeout=timeout_s
    )


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr.strip().splitlines() or ["?"])[-1]


def _predicted(factory: str, inputs: Sequence[str], layers: Sequence[str]) -> dict[str, float]:
    """The function's predicted time at one vCPU and its parallel part (ms), and the share."""
    from mopar.api import analyze, predict
    from mopar.config import CompileConfig
    from mopar.planner.problem import one_vcpu

    analysis = analyze(factory, list(inputs))
    layer = predict(analysis.layers, CompileConfig())
    per = {
        name: one_vcpu(t, p, layer.threads)
        for name, t, p in zip(layer.layers, layer.time_ms, layer.parallel)
    }
    missing = [n for n in layers if n not in per]
    if missing:
        raise RuntimeError(f"layers of the function not predicted: {missing[:3]}")
    t1 = sum(per[n][0] for n in layers)
    par = sum(per[n][1] for n in layers)
    return {"t1_ms": round(t1, 3), "par_ms": round(par, 3), "share": par / t1 if t1 else 0.0}


def run_model(
    name: str,
    shares: Sequence[float],
    *,
    requests: int,
    warmup: int,
    gap_ms: float,
    work: Path,
    engine,
    timeout_s: float,
    block: int,
    intra: int | None = None,
) -> dict[str, Any]:
    """Compile, predict, build and serve one suite model at every share (see the module)."""
    from benchmarks.suite import SUITE
    from mopar.bundle.document import read_document
    from mopar.container.build import LOCAL_BASE
    from mopar.runner.bundle import read_reference

    m = SUITE[name]
    factory, inputs, workload = m.source(quick=False)
    out: dict[str, Any] = {
        "model": name,
        "family": m.family,
        "workload": workload,
        "load_before": os.getloadavg(),
    }
    folder = work / name
    compile_args = [factory, *(a for spec in inputs for a in ("--input", spec))]
    compile_args += ["--slices", "1", "--no-check-latency", "--out", str(folder), "--force"]
    out["compile_command"] = "mopar compile " + " ".join(compile_args)
    start = time.perf_counter()
    compiled = _mopar("compile", *compile_args, timeout_s=timeout_s)
    out["compile_s"] = round(time.perf_counter() - start, 1)
    if compiled.returncode:
        out["error"] = "compile: " + _last_line(compiled)
        return out
    (function,) = read_document(folder).plan["functions"]
    out["function"], out["memory_mb"] = function["name"], function["memory_mb"]
    out["predicted"] = _predicted(factory, inputs, function["layers"])
    start = time.perf_counter()
    built = _mopar(
        "build", str(folder), "--kind", "openfaas", "--base-image", LOCAL_BASE, "--json",
        timeout_s=timeout_s,
    )  # fmt: skip
    out["build_s"] = round(time.perf_counter() - start, 1)
    if built.returncode:
        out["error"] = "build: " + _last_line(built)
        return out
    (image,) = json.loads(built.stdout)["images"]
    out["image"] = image["tag"]
    frame = _frame(read_reference(folder / "reference.npz")[0])
    out["request_bytes"] = len(frame)
    memory_mb = math.ceil(MEMORY_HEADROOM * function["memory_mb"])
    out["runs"] = serve(
        engine,
        image["tag"],
        shares,
        frame=frame,
        memory_mb=memory_mb,
        requests=requests,
        warmup=warmup,
        gap_ms=gap_ms,
        block=block,
        intra=intra,
    )
    out["load_after"] = os.getloadavg()
    return out


def _frame(inputs: dict) -> bytes:
    from mopar.runtime.frame import encode_frame

    return encode_frame(inputs)


# --- one container ----------------------------------------------------------------------------

_CGROUP_PROBE = (
    "import glob, json, os; r = lambda p: open(p).read().split(); "
    "d = next(x for x in ('/sys/fs/cgroup/cpu', '/sys/fs/cgroup/cpu,cpuacct', '/sys/fs/cgroup') "
    "if glob.glob(x + '/cpu.stat')); "
    "f = {k: r(d + '/' + k) for k in ('cpu.cfs_quota_us', 'cpu.cfs_period_us', 'cpu.max') "
    "if glob.glob(d + '/' + k)}; "
    "s = dict(zip(*[iter(r(d + '/cpu.stat'))] * 2)); "
    "u = glob.glob('/sys/fs/cgroup/cpu*/cpuacct.usage'); "
    "s.update({'cpuacct_usage_ns': r(u[0])[0]} if u else {}); "
    "print(json.dumps({'limit': f, 'stat': s, 'cpu_count': os.cpu_count(), "
    "'affinity': len(os.sched_getaffinity(0))}))"
)
"""Run inside the container: its CFS quota and period (cgroup v1) or cpu.max (v2), its
``cpu.stat`` (throttled periods and time; v2: the CPU time used) and v1's ``cpuacct.usage``
(the CPU time used, ns), and the CPUs a process there sees."""


def _cgroup(engine, container: str) -> dict[str, Any]:
    done = engine.run("exec", container, "python", "-c", _CGROUP_PROBE, check=False)
    if done.returncode:
        return {"error": done.stderr.decode(errors="replace").strip()[-200:]}
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _throttled(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What the container did between two `_cgroup` readings: its periods and throttled ones,
    the throttled time and the CPU time it used, ms (cgroup v1 ``throttled_time`` and
    ``cpuacct.usage`` in ns; v2 ``throttled_usec`` and ``usage_usec``)."""
    a, b = before.get("stat", {}), after.get("stat", {})
    diff = {k: int(b[k]) - int(a[k]) for k in b if k in a}
    ms = diff.get("throttled_time", 0) / 1e6 + diff.get("throttled_usec", 0) / 1e3
    cpu = diff.get("cpuacct_usage_ns", 0) / 1e6 + diff.get("usage_usec", 0) / 1e3
    return {
        "periods": diff.get("nr_periods", 0),
        "throttled_periods": diff.get("nr_throttled", 0),
        "throttled_ms": round(ms, 1),
        "cpu_ms": round(cpu, 1),
    }


def _post(conn: http.client.HTTPConnection, frame: bytes) -> tuple[float, float]:
    """One request: (the function's own time, the client's round trip), ms."""
    t0 = time.perf_counter()
    conn.request("POST", "/", body=frame, headers={"Content-Type": "application/octet-stream"})
    answer = conn.getresponse()
    answer.read()
    rtt = (time.perf_counter() - t0) * 1e3
    if answer.status != 200:
        raise RuntimeError(f"the function answered {answer.status}")
    timing = answer.getheader("X-Mopar-Timing", "")
    own = timing.split(",")[-1].partition("=")[2]  # this function's entry: the last
    if not own:
        raise RuntimeError(f"no X-Mopar-Timing in the answer ({timing!r})")
    return float(own), rtt


def _wait_ready(port: int, container: str, engine) -> float:
    """Seconds until the function answers its health check."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < READY_TIMEOUT_S:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/_/health")
            if conn.getresponse().status == 200:
                conn.close()
                return time.perf_counter() - t0
        except OSError:
            pass
        state = engine.run("inspect", "--format", "{{.State.Running}}", container, check=False)
        if state.returncode or state.stdout.decode().strip() != "true":
            logs = engine.run("logs", container, check=False).stderr.decode(errors="replace")
            raise RuntimeError(f"container {container} ended: {logs.strip()[-300:]}")
        time.sleep(0.2)
    raise RuntimeError(f"container {container} not ready within {READY_TIMEOUT_S:g} s")


def serve(
    engine,
    tag: str,
    shares: Sequence[float],
    *,
    frame: bytes,
    memory_mb: int,
    requests: int,
    warmup: int,
    gap_ms: float,
    block: int,
    intra: int | None = None,
) -> list[dict[str, Any]]:
    """Serve image ``tag`` under ``--cpus c`` for each of ``shares``, each in a container of its
    own, all up at once; each share's requests' times (see the module).

    A share is measured in blocks of ``block`` requests sent back to back, the first of each
    block unmeasured (it finds the container idle, so its CFS period has its quota unspent), and
    the shares take turns block by block: a change in the host's speed while measuring moves
    every share alike, where measuring one share after another would put it between them.
    ``intra``: onnxruntime's intra-op threads (None: `intra_op`; 0: onnxruntime's choice).
    """
    from mopar.runner.processes import free_port

    runs: list[dict[str, Any]] = []
    places: list[tuple[str, int]] = []  # each share's container and port
    try:
        for c in shares:
            threads = intra_op(c) if intra is None else intra
            port = free_port()
            container = f"mopar-cpulimits-{os.getpid()}-{port}"
            runs.append({"vcpus": c, "intra_op": threads, "gap_ms": gap_ms, "block": block})
            places.append((container, port))
            engine.run(
                "run", "-d", "--rm", "--network", "host", "--name", container,
                "--cpus", f"{c:g}", "--memory", f"{memory_mb}m", "--memory-swap",
                f"{memory_mb}m", "-e", f"PORT={port}", "-e", "MOPAR_HOST=127.0.0.1",
                "-e", f"MOPAR_INTRA_OP={threads}", tag,
            )  # fmt: skip
        conns = []
        for run, (container, port) in zip(runs, places):
            run["ready_s"] = round(_wait_ready(port, container, engine), 2)
            conns.append(http.client.HTTPConnection("127.0.0.1", port, timeout=300))
            for _ in range(warmup):
                _post(conns[-1], frame)
        before = [_cgroup(engine, container) for container, _ in places]
        own: list[list[float]] = [[] for _ in runs]
        rtt: list[list[float]] = [[] for _ in runs]
        sent = [0 for _ in runs]  # between the cgroup readings: the unmeasured firsts too
        for turn in range(math.ceil(requests / block)):
            for k in range(len(runs)):
                k = (k + turn) % len(runs)  # each share in every place of the order in turn
                for i in range(min(block, requests - turn * block) + 1):
                    if gap_ms:
                        time.sleep(gap_ms / 1e3)
                    o, r = _post(conns[k], frame)
                    sent[k] += 1
                    if i:
                        own[k].append(o)
                        rtt[k].append(r)
        after = [_cgroup(engine, container) for container, _ in places]
        for conn in conns:
            conn.close()
    finally:
        for container, _ in places:
            engine.run("rm", "-f", "-t", "0", container, check=False)
    for run, o, r, n, a, b in zip(runs, own, rtt, sent, before, after):
        run.update(
            requests=len(o),
            sent=n,
            median_ms=round(statistics.median(o), 2),
            mean_ms=round(statistics.fmean(o), 2),
            p10_ms=round(_quantile(o, 0.1), 2),
            p90_ms=round(_quantile(o, 0.9), 2),
            client_median_ms=round(statistics.median(r), 2),
            own_ms=[round(x, 2) for x in o],
            cgroup=b.get("limit", b),
            cpus_seen=b.get("cpu_count"),
            throttled=_throttled(a, b),
        )
    return runs


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# --- the table --------------------------------------------------------------------------------


def rows(model: dict[str, Any]) -> list[dict[str, Any]]:
    """One model's rows: each share's measured median and mean, the modelled time anchored at
    the measured 1-vCPU median, their ratio and whether it is within `GOAL`."""
    if "error" in model:
        return [{"model": model["model"], "error": model["error"]}]
    f = model["predicted"]["share"]
    anchor = next((r["median_ms"] for r in model["runs"] if r["vcpus"] == 1.0), None)
    out = []
    for r in model["runs"]:
        row = {
            "model": model["model"],
            "share": round(f, 3),
            "vcpus": r["vcpus"],
            "intra_op": r["intra_op"],
            "measured_ms": r["median_ms"],
            "mean_ms": r["mean_ms"],
            # the CPU the container used over every request it was sent while measured
            "cpu_ms": round(r["throttled"]["cpu_ms"] / r.get("sent", r["requests"]), 1),
            "throttled_periods": r["throttled"]["throttled_periods"],
            "periods": r["throttled"]["periods"],
            "load": round(model["load_before"][0], 2),
        }
        if anchor is not None:
            modelled = modelled_ms(anchor, f, r["vcpus"])
            ratio = r["median_ms"] / modelled
            row.update(
                modelled_ms=round(modelled, 2),
                ratio=round(ratio, 3),
                mean_ratio=round(r["mean_ms"] / modelled, 3),
                within=1 - GOAL <= ratio <= 1 + GOAL,
            )
        out.append(row)
    return out


def markdown(results: dict[str, Any]) -> str:
    """The table, as docs/cpu-limits.md shows it, with the run's machine and date above."""
    head = (
        "| model | parallel share f | vCPUs (--cpus) | intra-op threads | measured median, ms | "
        f"mean, ms | CPU ms per request | modelled, ms | median / modelled | within {GOAL:.0%} | "
        "mean / modelled | "
        "throttled / periods | load average |"
    )
    lines = [
        f"{'TRIAL run, not a measurement: ' if results.get('trial') else ''}"
        f"{results['date']}, {results['cpu']} ({results['cores']} cores), {results['podman']}, "
        f"{results['requests']} requests per share after {results['warmup']} warm-up, "
        f"{results['gap_ms']:g} ms between requests"
        + (
            f", the shares taking turns in blocks of {results['block']} (each block's first "
            "unmeasured)."
            if results.get("block")
            else "."
        ),
        "",
        head,
        "|" + "---|" * head.count(" | ") + "---|",
    ]
    yes = {True: "yes", False: "**no**", None: "-"}
    for model in results["models"]:
        for r in rows(model):
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * 11)
                continue
            lines.append(
                f"| {r['model']} | {r['share']:.3f} | {r['vcpus']:g} | {r['intra_op']} | "
                f"{r['measured_ms']:.1f} | {r['mean_ms']:.1f} | {r['cpu_ms']:.1f} | "
                f"{format(r['modelled_ms'], '.1f') if 'modelled_ms' in r else '-'} | "
                f"{format(r['ratio'], '.3f') if 'ratio' in r else '-'} | "
                f"{yes[r.get('within')]} | "
                f"{format(r['mean_ratio'], '.3f') if 'mean_ratio' in r else '-'} | "
                f"{r['throttled_periods']} / {r['periods']} | "
                f"{r['load']} |"
            )
    return "\n".join(lines) + "\n"


def _podman_version(engine) -> str:
    done = engine.run("--version", check=False)
    return done.stdout.decode().strip() or "?"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="suite models")
    parser.add_argument(
        "--shares", default=",".join(f"{c:g}" for c in DEFAULT_SHARES), help="vCPUs (--cpus)"
    )
    parser.add_argument("--requests", type=int, default=50, help="measured requests per share")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up requests per share")
    parser.add_argument(
        "--block", type=int, default=10, help="requests a share takes in a turn (default: 10)"
    )
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle time before each request (default: none)"
    )
    parser.add_argument(
        "--intra-op",
        type=int,
        default=None,
        help="onnxruntime intra-op threads at every share, 0: its own choice (default: "
        "max(1, floor(vCPUs)), as the planner sets them)",
    )
    parser.add_argument("--work", type=Path, default=Path("build/cpu-limits-bench"))
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument(
        "--trial", action="store_true", help="mark the run a trial (a busy machine): no figures"
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument(
        "--table", type=Path, default=None, metavar="FILE.json", help="print a saved run's table"
    )
    args = parser.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.table.read_text())), end="")
        return
    from benchmarks.suite import resolve_models
    from mopar.container.build import LOCAL_BASE
    from mopar.container.engine import find_engine
    from mopar.errors import MoparError
    from mopar.profile.store import cpu_model

    names = [m.name for m in resolve_models(tuple(args.models.split(",")))]
    shares = [float(c) for c in args.shares.split(",")]
    engine = find_engine("podman")
    if engine.image_id(LOCAL_BASE) is None:
        sys.exit(f"no {LOCAL_BASE}: make it with `make base-image`")
    engine = engine.ready_for(LOCAL_BASE)
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "trial": args.trial,
        "command": "python -m benchmarks.cpu_limits "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "podman": _podman_version(engine),
        "engine_notes": list(engine.notes),
        "requests": args.requests,
        "warmup": args.warmup,
        "block": args.block,
        "gap_ms": args.gap_ms,
        "intra_op": "max(1, floor(vCPUs))" if args.intra_op is None else args.intra_op,
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "models": [],
    }
    for name in names:
        print(f"{name}: compile, build, serve at {shares} vCPUs ...", file=sys.stderr, flush=True)
        try:
            r = run_model(
                name,
                shares,
                requests=args.requests,
                warmup=args.warmup,
                gap_ms=args.gap_ms,
                work=args.work,
                engine=engine,
                timeout_s=args.timeout_s,
                block=args.block,
                intra=args.intra_op,
            )
        except (subprocess.TimeoutExpired, RuntimeError, MoparError) as exc:
            r = {"model": name, "error": " ".join(str(exc).split())[:200]}
        results["models"].append(r)
        for row in rows(r):
            print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results), end="")


if __name__ == "__main__":
    main()
