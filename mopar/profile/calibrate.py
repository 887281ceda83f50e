"""``mopar profile calibrate``: what a tensor handoff and a function hop cost on this machine.

Read `calibrate`, `fit_transfer`, the children (`_Procs`, `_worker`, `_http`, `_redis`), then the
readers the planner uses (`load_transports`, `transfer_ms`). A transfer hands float32 data to
another process in the runtime's payload format (`mopar.runtime.wire`), timed up to the
receiver's answer: ``shm`` is measured on `mopar run` itself (`run_bundles`): a chain of one
and a chain of three of the runtime's slice processes (`mopar.runner.worker`), each running a
handler that hands its input on unchanged, served side by side; one cut costs half the
difference of their median latencies, so the figure holds every copy, pipe wake-up and JSON line
the real runtime spends on a cut; less ``hop_ms``, which the planner adds apart, it is the point.
``http`` POSTs `encode`'s bytes to a stdlib server in a child process, which `decode`s
them; ``redis`` is `encode`, SET, GET, `decode` against a private redis-server. A line is fitted
to the per-size medians; MB = 2**20 bytes. Only 127.0.0.1 is bound; a watchdog kills every child
at the deadline; children and /dev/shm files go on every exit path.
"""

from __future__ import annotations

import datetime as _dt
import http.client
import importlib.util
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from mopar.errors import InternalError, MoparError, RuntimeFailure
from mopar.runner.chain import die_with_parent, local_redis
from mopar.runner.bundle import BundleManifest, BundleSlice
from mopar.runtime.wire import decode, encode

__all__ = ["TRANSPORTS_FORMAT_VERSION", "CalibrationError", "CalibrateConfig", "QUICK",
           "TransferFit", "calibrate", "fit_transfer", "load_transports", "transfer_ms",
           "measured_transports"]

log = logging.getLogger(__name__)

TRANSPORTS_FORMAT_VERSION = 1
TRANSPORTS = ("shm", "http", "redis")
MB = 1 << 20
_RERUN = "rerun `mopar profile calibrate --out DIR`"
# The worker loads handler.py from its function folder; this one computes nothing, so a request
# costs exactly the runtime's protocol and tensor reads.
_STUB_HANDLER = ("class SliceHandler:\n    def __init__(self, function_dir, **kw):\n        pass"
                 "\n\n    def handle(self, inputs):\n        return {}\n")
_NOTES = ("Loopback, one machine. transfer_ms = latency_ms + bytes / (mb_per_s * 2**20) * 1000, "
          "fitted to points [[bytes, median ms]]; it excludes hop_ms (a tiny request's round trip "
          "to a running slice process). See docs/calibration.md.")

_PASS_HANDLER = ("class SliceHandler:\n    def __init__(self, function_dir, **kw):\n        pass"
                 "\n\n    def handle(self, inputs):\n        return {{{out!r}: inputs[{inp!r}]}}\n")

Progress = Callable[[str, int, int], None]


class CalibrationError(MoparError):
    """A calibration could not run, or a transports profile is missing or corrupt."""


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    """What to measure, and for how long at most.

    Attributes:
        sizes_bytes: payload sizes, bytes of float32 data (two or more; multiples of 4).
        repeats: timed transfers per size, after one warm-up; a point is their median.
        hop_requests: timed empty requests to a running worker; hop_ms is their median.
        chain_requests: measured requests per size through the shm chains of `mopar run`.
        baseline_runs: fresh processes importing what a function imports (onnxruntime, numpy,
            its server and codecs); the figure is their median.
        transports: which of ``shm``, ``http``, ``redis`` to measure.
        timeout_s: seconds the whole calibration may take; then every child is killed.
    """

    sizes_bytes: tuple[int, ...] = tuple(1024 << k for k in range(17))  # 1 KB .. 64 MB
    repeats: int = 5
    hop_requests: int = 300
    chain_requests: int = 30
    baseline_runs: int = 3
    transports: tuple[str, ...] = TRANSPORTS
    timeout_s: float = 600.0


QUICK = CalibrateConfig(sizes_bytes=(1 << 10, 1 << 14, 1 << 18, 1 << 22), repeats=3,
                        hop_requests=50, chain_requests=10)


@dataclass(frozen=True, kw_only=True)
class TransferFit:
    """``ms = latency_ms + bytes / (mb_per_s * 2**20) * 1000``, fitted to measured points."""

    latency_ms: float  # the intercept, ms: what an empty handoff costs
    mb_per_s: float  # the bandwidth from the slope, MB (2**20 bytes) per second
    max_rel_err: float  # the largest |fit - measured| / measured over the points


def calibrate(config: CalibrateConfig, *, progress: Progress | None = None) -> dict[str, Any]:
    """Measure the runtime baseline, the hop and each transport; return the profile dict.

    ``progress(phase, done, total)`` hears about every step. Child processes and the /dev/shm
    folder are gone when this returns or raises.
    """
    shm_ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    work = Path(tempfile.mkdtemp(prefix="mopar-calib-", dir="/dev/shm" if shm_ok else None))
    procs = _Procs(work, config.timeout_s)
    try:
        return _measure_all(config, procs, shm_ok, progress or (lambda *_: None))
    except Exception:
        if procs.expired:
            raise CalibrationError(f"calibration ran past its {config.timeout_s:g} s limit; "
                                   "rerun with --quick or on an idle machine") from None
        raise
    finally:
        procs.close()
        shutil.rmtree(work, ignore_errors=True)


def _measure_all(config: CalibrateConfig, procs: _Procs, shm_ok: bool,
                 progress: Progress) -> dict[str, Any]:
    done, total = 0, config.baseline_runs + 1 + len(config.sizes_bytes) * len(config.transports)
    baseline = []
    for i in range(config.baseline_runs):
        progress("runtime baseline", done, total)
        # what a deployed function imports: its server, the codecs, onnxruntime (not Redis's
        # client, which only functions with a redis cut load: about 9 MB more)
        code = ("import json, numpy, onnxruntime, waitress, mopar.runtime.server\n"
                "print(json.dumps([l.split()[1] for l in "
                "open('/proc/self/status') if l.startswith('VmHWM:')]))")
        procs.start(f"baseline-{i}", [sys.executable, "-c", code])
        baseline.append(int(procs.answer(f"baseline-{i}")[0]) / 1024.0)  # kB
        done += 1
    progress("hop", done, total)
    ask = _worker(procs)
    hop_ms = _median_ms(lambda: ask({}), config.hop_requests, warmup=10)
    done += 1
    payload = np.random.default_rng(0).random(max(config.sizes_bytes) // 4, dtype=np.float32)
    transports: dict[str, dict[str, Any]] = {}
    for name in config.transports:
        if reason := _unavailable(name, shm_ok):
            log.warning("%s not measured: %s", name, reason)
            transports[name] = {"measured": False, "reason": reason}
            done += len(config.sizes_bytes)
            continue
        points = []
        if name == "shm":
            for nbytes in config.sizes_bytes:
                progress(name, done, total)
                cut = _chain_cut_ms(procs.work, payload[: nbytes // 4], config.chain_requests)
                # the planner adds the hop apart from the transfer
                points.append((nbytes, max(cut - hop_ms, 1e-3)))
                done += 1
        else:
            send = {"http": _http, "redis": _redis}[name](procs)
            for nbytes in config.sizes_bytes:
                progress(name, done, total)
                array = payload[: nbytes // 4]
                points.append((nbytes, _median_ms(lambda: send(array), config.repeats, warmup=1)))
                done += 1
        fit = fit_transfer(points, name)
        transports[name] = {
            "measured": True, "latency_ms": round(fit.latency_ms, 4),
            "mb_per_s": round(fit.mb_per_s, 1), "max_rel_err": round(fit.max_rel_err, 3),
            "points": [[n, round(ms, 4)] for n, ms in points]}
    progress("done", done, total)
    return {"format_version": TRANSPORTS_FORMAT_VERSION, "transports": transports,
            "hop_ms": round(hop_ms, 4),
            "runtime_baseline_mb": round(statistics.median(baseline), 1),
            "measured": _facts(config), "notes": _NOTES}


def fit_transfer(points: Sequence[tuple[int, float]], name: str = "transfer") -> TransferFit:
    """Fit ``ms = latency + bytes * slope`` to ``(bytes, ms)`` points, on relative error.

    Plain least squares would let the 64 MB points' noise decide the latency; dividing each row
    by its measured time weighs every size alike. A negative intercept is clamped to 0 and the
    slope refitted through the origin.
    """
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if len(set(x)) < 2 or not np.all(np.isfinite(y) & (y > 0)):
        raise CalibrationError(f"{name}: cannot fit a line to the points {list(points)}; "
                               "measure two or more sizes with positive times")
    (latency, slope), *_ = np.linalg.lstsq(np.stack([1 / y, x / y], axis=1), np.ones_like(y),
                                           rcond=None)
    if latency < 0:
        latency, slope = 0.0, float(np.sum(x / y) / np.sum((x / y) ** 2))
    if not (np.isfinite(slope) and slope > 0):
        raise CalibrationError(f"{name}: the fitted time per byte is {slope}, expected > 0 "
                               f"(points {list(points)}); rerun on an idle machine")
    rel = np.abs(latency + slope * x - y) / y
    return TransferFit(latency_ms=float(latency), mb_per_s=1e3 / (float(slope) * MB),
                       max_rel_err=float(rel.max()))


def _median_ms(fn: Callable[[], None], n: int, *, warmup: int) -> float:
    """Median time of ``n`` calls of ``fn`` after ``warmup`` ones, ms."""
    times = []
    for _ in range(warmup + n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[warmup:])


def _unavailable(name: str, shm_ok: bool) -> str | None:
    if name == "shm" and not shm_ok:
        return "/dev/shm is missing or not writable on this machine"
    if name == "redis" and shutil.which("redis-server") is None:
        return "redis-server is not on PATH; install it (apt-get install redis-server)"
    if name == "redis" and importlib.util.find_spec("redis") is None:
        return "the redis Python package is not installed; pip install redis"
    return None


def _facts(config: CalibrateConfig) -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    versions = {d: metadata.version(d) for d in ("onnxruntime", "redis")
                if importlib.util.find_spec(d)}
    return {"machine": f"{cpu}, {os.cpu_count()} cores", "date": _dt.date.today().isoformat(),
            "onnxruntime": versions.get("onnxruntime", ""), "redis_py": versions.get("redis", ""),
            "python": platform.python_version(), "repeats": config.repeats,
            "sizes_bytes": [min(config.sizes_bytes), max(config.sizes_bytes)],
            "command": "mopar profile calibrate" + (" --quick" if config == QUICK else "")}


# --- child processes ----------------------------------------------------------------------------


class _Procs:
    """One calibration's children, by name, each logging stderr to ``work/NAME.err``.

    A watchdog kills them all at the deadline, so no read from a child can block past it.
    """

    def __init__(self, work: Path, timeout_s: float) -> None:
        self.work, self.expired = work, False
        self.procs: dict[str, subprocess.Popen] = {}
        self.cleanups: list[Callable[[], None]] = []  # clients to close before the servers go
        self.timer = threading.Timer(timeout_s, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def start(self, name: str, argv: list[str]) -> None:
        with open(self.work / f"{name}.err", "wb") as err:
            self.procs[name] = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                bufsize=1, env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent)
        if self.expired:  # the watchdog fired while this one was starting
            self.procs[name].kill()

    def check(self, name: str, *, wait: bool = False) -> None:
        """Raise if ``name`` has exited, quoting the last line of its stderr."""
        code = self.procs[name].wait() if wait else self.procs[name].poll()
        if code is not None:
            lines = (self.work / f"{name}.err").read_text(errors="replace").strip().splitlines()
            raise CalibrationError(f"the {name} process exited with code {code}: "
                                   f"{lines[-1][:300] if lines else 'no output'}; rerun with --debug")

    def send(self, name: str, msg: dict) -> None:
        self.procs[name].stdin.write(json.dumps(msg) + "\n")
        self.procs[name].stdin.flush()

    def answer(self, name: str, want: str | None = None) -> Any:
        line = self.procs[name].stdout.readline() or self.check(name, wait=True)
        msg = json.loads(line)
        if want is not None and msg.get("event") != want:
            raise CalibrationError(f"the {name} process answered {msg}, expected event {want!r}; "
                                   "rerun with --debug")
        return msg

    def _expire(self) -> None:
        self.expired = True
        for proc in list(self.procs.values()):
            proc.kill()

    def close(self) -> None:
        self.timer.cancel()
        for cleanup in self.cleanups:
            cleanup()
        for proc in self.procs.values():
            proc.terminate()
            try:
                proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _worker(procs: _Procs) -> Callable[[dict[str, str]], None]:
    """Start the runtime's slice process on a stub handler; return ``ask(inputs)``, one request."""
    (procs.work / "fn").mkdir()
    (procs.work / "fn" / "handler.py").write_text(_STUB_HANDLER)
    procs.start("worker", [sys.executable, "-m", "mopar.runner.worker", str(procs.work / "fn"),
                           str(procs.work), "1"])
    procs.answer("worker", "ready")
    ids = itertools.count(1)

    def ask(inputs: dict[str, str]) -> None:
        procs.send("worker", {"id": next(ids), "inputs": inputs, "outputs": {}})
        procs.answer("worker", "done")

    return ask


def _chain(root: Path, k: int) -> BundleManifest:
    """A bundle of ``k`` slices, each handing its one input on as its output."""
    slices = []
    for i in range(k):
        folder = root / "functions" / f"s{i}"
        folder.mkdir(parents=True)
        (folder / "handler.py").write_text(_PASS_HANDLER.format(out=f"v{i + 1}", inp=f"v{i}"))
        slices.append(BundleSlice(name=f"s{i}", inputs=(f"v{i}",), outputs=(f"v{i + 1}",),
                                  memory_mb=128))
    return BundleManifest(root=root, model="calibration", inputs=("v0",),
                          outputs=(("y", f"v{k}"),), slices=tuple(slices))


def _chain_cut_ms(work: Path, array: np.ndarray, requests: int) -> float:
    """What one more cut of ``array`` costs `mopar run`, ms: chains of 3 and 1 served side by
    side (`run_bundles` interleaves them), half the difference of their median latencies."""
    from mopar.config import RunConfig
    from mopar.runner.local import run_bundles

    root = Path(tempfile.mkdtemp(prefix="chain-", dir=work))
    try:
        one, three = run_bundles([_chain(root / "one", 1), _chain(root / "three", 3)],
                                 {"v0": array}, config=RunConfig(requests=requests, timeout_s=60))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if one.errors or three.errors:
        raise CalibrationError(f"the shm chains failed: {[*one.error_messages, *three.error_messages]}"
                               "; rerun with --debug")
    return max((three.latency_p50_ms - one.latency_p50_ms) / 2, 1e-3)


def _http(procs: _Procs) -> Callable[[np.ndarray], None]:
    procs.start("http", [sys.executable, "-c",
                         "from mopar.profile.calibrate import _serve_http; _serve_http()"])
    conn = http.client.HTTPConnection("127.0.0.1", procs.answer("http")["port"])
    procs.cleanups.append(conn.close)

    def send(array: np.ndarray) -> None:
        conn.request("POST", "/tensor", body=encode(array),
                     headers={"Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status != 200 or json.loads(answer) != {"bytes": array.nbytes}:
            raise CalibrationError(f"the HTTP server answered {resp.status} {answer[:200]!r} to "
                                   f"{array.nbytes} bytes, expected 200; rerun with --debug")

    return send


def _redis(procs: _Procs) -> Callable[[np.ndarray], None]:
    import redis

    server = local_redis()
    try:
        url = server.__enter__()
    except RuntimeFailure as exc:
        raise CalibrationError(str(exc)) from None
    procs.cleanups.append(lambda: server.__exit__(None, None, None))
    client = redis.Redis.from_url(url)
    procs.cleanups.insert(0, client.close)

    def send(array: np.ndarray) -> None:
        client.set("mopar-calib", encode(array))
        if decode(client.get("mopar-calib")).nbytes != array.nbytes:
            raise CalibrationError("redis returned another payload than it was given; "
                                   "rerun with --debug")

    return send


def _serve_http() -> None:
    """Child process: POST /tensor decodes an octet-stream payload; stdin closing stops it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive
        disable_nagle_algorithm = True  # else headers and body wait on a delayed ACK

        def do_POST(self) -> None:
            array = decode(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"bytes": array.nbytes}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    sys.stdin.read()  # the parent closed our stdin, or died
    server.shutdown()


# --- the profile file ---------------------------------------------------------------------------


def load_transports(path: Path) -> dict[str, Any]:
    """Read and check a transports profile: a file, or a folder holding ``transports.json``."""
    path = Path(path) / "transports.json" if Path(path).is_dir() else Path(path)
    try:
        profile = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{str(path)!r} cannot be read ({exc}); {_RERUN}") from None
    version = profile.get("format_version") if isinstance(profile, dict) else None
    if version != TRANSPORTS_FORMAT_VERSION:
        raise CalibrationError(f"{str(path)!r} has format version {version!r}, this mopar reads "
                               f"{TRANSPORTS_FORMAT_VERSION}; {_RERUN}")
    if problem := _problem(profile):
        raise CalibrationError(f"{str(path)!r} is corrupt: {problem}; {_RERUN}")
    return profile


def _problem(profile: dict[str, Any]) -> str | None:
    def bad(v: Any, *, zero_ok: bool = True) -> bool:  # not a finite number >= 0 (or > 0)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
        return not (ok and (v >= 0 if zero_ok else v > 0))

    transports = profile.get("transports")
    if not isinstance(transports, dict) or not all(
            isinstance(e, dict) and e.get("measured") in (True, False) for e in transports.values()):
        return f"'transports' is {transports!r}, expected an object of objects with 'measured'"
    for name, e in transports.items():
        if e["measured"] and (bad(e.get("latency_ms")) or bad(e.get("mb_per_s"), zero_ok=False)):
            return (f"transport {name!r} has latency_ms {e.get('latency_ms')!r} and mb_per_s "
                    f"{e.get('mb_per_s')!r}, expected finite numbers >= 0 and > 0")
    key = next((k for k in ("hop_ms", "runtime_baseline_mb") if bad(profile.get(k))), None)
    return key and f"{key!r} is {profile.get(key)!r}, expected a finite number >= 0"


def measured_transports(profile: dict[str, Any]) -> tuple[str, ...]:
    """The transports the profile has figures for, in its order."""
    return tuple(n for n, e in profile["transports"].items() if e.get("measured"))


def transfer_ms(profile: dict[str, Any], transport: str, nbytes: int) -> float:
    """Time to hand ``nbytes`` over ``transport``, ms: latency + bytes / bandwidth."""
    if nbytes < 0:
        raise InternalError(f"transfer_ms got {nbytes} bytes, expected >= 0")
    entry = profile["transports"].get(transport)
    if not entry or not entry.get("measured"):
        why = (entry or {}).get("reason", "it is not in the profile")
        raise CalibrationError(f"transport {transport!r} has no measured figures ({why}); choose "
                               f"one of {list(measured_transports(profile))} or {_RERUN}")
    return entry["latency_ms"] + nbytes / (entry["mb_per_s"] * MB) * 1e3

