"""``mopar profile calibrate``: what a tensor handoff and a function hop cost on this machine.

Read `calibrate`, `fit_transfer`, then the chains (`_chain`, `_chain_cut_ms`); the profile it
returns is ``transports.json``, whose reader the planner uses is `mopar.profile.calibrate`
(`load_transports`, `transfer_ms`). Every transport is measured on `mopar run`
itself, not on a piece of it: for each size, `run_bundles` serves a chain of one and a chain of
four functions side by side, each handing on a float32 tensor of that size. Over ``shm`` they
are the runtime's slice processes (`mopar.runner.worker`, mapped buffers and pipes) with a
handler that returns its input; over ``http`` and ``redis`` the function servers
(`mopar.runtime.server`) chained on 127.0.0.1, each running an ONNX Identity with the handler
every function ships, redis through a private redis-server. One cut costs a third of the
difference of the chains' median latencies, less the Identity's own run (http, redis), never
less than a copy of its bytes; less ``hop_ms`` (an empty request's round trip to a slice
process), which the planner adds apart, it is the point. A line is fitted to the points;
MB = 2**20 bytes. Only 127.0.0.1 is bound; a watchdog kills the children it starts at the
deadline; children and /dev/shm files go on every exit path.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from mopar.bundle.document import BundleDocument, Io, IoFunction, IoOutput, IoTensor
from mopar.bundle.function import FunctionSpec, TensorSpec
from mopar.errors import DEBUG, Option
from mopar.profile.calibrate import MB, TRANSPORTS_FORMAT_VERSION, CalibrationError
from mopar.runner.bundle import BundleManifest, manifest_of
from mopar.runtime.server import die_with_parent
from mopar.runtime.transports import names, transport_named

__all__ = ["CalibrateConfig", "QUICK", "TransferFit", "calibrate", "fit_transfer"]

log = logging.getLogger(__name__)

# The worker's handler here (through ``MOPAR_HANDLER``, the runtime's hook) computes nothing,
# so a request costs exactly the runtime's protocol and tensor reads. A handler names the inputs
# it reads (`inputs`): the function core decodes only those.
_STUB_HANDLER = (
    "class SliceHandler:\n    inputs = {}\n\n    def __init__(self, function_dir, **kw):\n"
    "        pass\n\n    def handle(self, inputs):\n        return {}\n"
)
_NOTES = (
    "Loopback, one machine. transfer_ms = latency_ms + bytes / (mb_per_s * 2**20) * 1000, "
    "fitted to points [[bytes, ms of one cut on mopar run's chains]]; it excludes hop_ms "
    "(a tiny request's round trip to a running slice process). See docs/calibration.md."
)

_PASS_HANDLER = """
import json
import pathlib


class SliceHandler:
    def __init__(self, function_dir, **kw):
        spec = json.loads((pathlib.Path(function_dir) / "function.json").read_text())
        self.inp, self.out = spec["receives"][0]["name"], spec["outputs"][0]
        self.inputs = {self.inp: None}

    def handle(self, inputs):
        return {self.out: inputs[self.inp]}
"""
"""The shm chain's handler: each slice hands its input on (the Identity's run, timed apart, is
too noisy to subtract there)."""


@contextlib.contextmanager
def _handler(path: Path, code: str) -> Iterator[None]:
    """Slice processes started meanwhile run the ``SliceHandler`` of ``code`` (written to
    ``path``): ``MOPAR_HANDLER``, the runtime's hook, set in this process's environment."""
    path.write_text(code)
    before = os.environ.get("MOPAR_HANDLER")
    os.environ["MOPAR_HANDLER"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MOPAR_HANDLER", None)
        else:
            os.environ["MOPAR_HANDLER"] = before


Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    """What to measure, and for how long at most.

    Attributes:
        sizes_bytes: payload sizes, bytes of float32 data (two or more; multiples of 4).
        hop_requests: timed empty requests to a running worker; hop_ms is their median.
        chain_requests: measured requests per size through each pair of chains (after one
            warm-up; fewer above 8 MB, so that a size moves at most 256 MB, and at least 3).
        baseline_runs: fresh processes importing what a function imports (onnxruntime, numpy,
            its server and codecs); the figure is their median.
        transports: which registered transports to measure (default: all of them).
        timeout_s: seconds the whole calibration may take; then every child is killed.
    """

    sizes_bytes: tuple[int, ...] = tuple(1024 << k for k in range(17))  # 1 KB .. 64 MB
    hop_requests: int = 300
    chain_requests: int = 30
    baseline_runs: int = 3
    transports: tuple[str, ...] = field(default_factory=names)
    timeout_s: float = 600.0


QUICK = CalibrateConfig(sizes_bytes=(1 << 10, 1 << 18, 1 << 24), hop_requests=50, chain_requests=7)
"""For tests: three sizes, the largest big enough (16 MB) that its cut stands out of the noise
of a busy machine, so the fitted bandwidth stays positive."""


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
        return _measure_all(config, procs, progress or (lambda *_: None))
    except Exception:
        if procs.expired:
            raise CalibrationError(
                f"calibration ran past its {config.timeout_s:g} s limit; rerun with ",
                Option("quick", value=True),
                " or on an idle machine",
            ) from None
        raise
    finally:
        procs.close()
        shutil.rmtree(work, ignore_errors=True)


def _measure_all(config: CalibrateConfig, procs: _Procs, progress: Progress) -> dict[str, Any]:
    done, total = 0, config.baseline_runs + 1 + len(config.sizes_bytes) * len(config.transports)
    baseline = []
    for i in range(config.baseline_runs):
        progress("runtime baseline", done, total)
        # what a deployed function imports: its server, the codecs, onnxruntime (not Redis's
        # client, which only functions with a redis cut load: about 9 MB more)
        code = (
            "import json, numpy, onnxruntime, waitress, mopar.runtime.server\n"
            "print(json.dumps([l.split()[1] for l in "
            "open('/proc/self/status') if l.startswith('VmHWM:')]))"
        )
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
        if reason := transport_named(name).missing():
            log.warning("%s not measured: %s", name, reason)
            transports[name] = {"measured": False, "reason": reason}
            done += len(config.sizes_bytes)
            continue
        points = []
        for nbytes in config.sizes_bytes:
            progress(name, done, total)
            if procs.expired:  # the chains' processes are not the watchdog's: stop between them
                raise CalibrationError("the time limit passed")
            array = payload[: nbytes // 4]
            # big payloads get fewer requests: a 64 MB redis cut takes about 0.5 s
            requests = max(3, min(config.chain_requests, (256 << 20) // nbytes))
            cut = _chain_cut_ms(procs.work, array, requests, transport=name)
            # the planner adds the hop apart from the transfer
            points.append((nbytes, max(cut - hop_ms, cut / 2)))
            done += 1
        fit = fit_transfer(points, name)
        transports[name] = {
            "measured": True,
            "latency_ms": round(fit.latency_ms, 4),
            "mb_per_s": round(fit.mb_per_s, 1),
            "max_rel_err": round(fit.max_rel_err, 3),
            "points": [[n, round(ms, 4)] for n, ms in points],
        }
    progress("done", done, total)
    return {
        "format_version": TRANSPORTS_FORMAT_VERSION,
        "transports": transports,
        "hop_ms": round(hop_ms, 4),
        "runtime_baseline_mb": round(statistics.median(baseline), 1),
        "measured": _facts(config),
        "notes": _NOTES,
    }


def fit_transfer(points: Sequence[tuple[int, float]], name: str = "transfer") -> TransferFit:
    """Fit ``ms = latency + bytes * slope`` to ``(bytes, ms)`` points, on relative error.

    Plain least squares would let the 64 MB points' noise decide the latency; dividing each row
    by its measured time weighs every size alike. A negative intercept is clamped to 0 and the
    slope refitted through the origin.
    """
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    if len(set(x)) < 2 or not np.all(np.isfinite(y) & (y > 0)):
        raise CalibrationError(
            f"{name}: cannot fit a line to the points {list(points)}; "
            "measure two or more sizes with positive times"
        )
    (latency, slope), *_ = np.linalg.lstsq(
        np.stack([1 / y, x / y], axis=1), np.ones_like(y), rcond=None
    )
    if latency < 0:
        latency, slope = 0.0, float(np.sum(x / y) / np.sum((x / y) ** 2))
    if not (np.isfinite(slope) and slope > 0):
        raise CalibrationError(
            f"{name}: the fitted time per byte is {slope}, expected > 0 "
            f"(points {list(points)}); rerun on an idle machine"
        )
    rel = np.abs(latency + slope * x - y) / y
    return TransferFit(
        latency_ms=float(latency), mb_per_s=1e3 / (float(slope) * MB), max_rel_err=float(rel.max())
    )


def _median_ms(fn: Callable[[], None], n: int, *, warmup: int) -> float:
    """Median time of ``n`` calls of ``fn`` after ``warmup`` ones, ms."""
    times = []
    for _ in range(warmup + n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[warmup:])


def _facts(config: CalibrateConfig) -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    versions = {
        d: metadata.version(d) for d in ("onnxruntime", "redis") if importlib.util.find_spec(d)
    }
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "date": _dt.date.today().isoformat(),
        "onnxruntime": versions.get("onnxruntime", ""),
        "redis_py": versions.get("redis", ""),
        "python": platform.python_version(),
        "requests": config.chain_requests,
        "sizes_bytes": [min(config.sizes_bytes), max(config.sizes_bytes)],
        "command": "mopar profile calibrate" + (" --quick" if config == QUICK else ""),
    }


# --- child processes ----------------------------------------------------------------------------


class _Procs:
    """One calibration's children, by name, each logging stderr to ``work/NAME.err``.

    A watchdog kills them all at the deadline, so no read from a child can block past it.
    """

    def __init__(self, work: Path, timeout_s: float) -> None:
        self.work, self.expired = work, False
        self.procs: dict[str, subprocess.Popen] = {}
        self.timer = threading.Timer(timeout_s, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def start(self, name: str, argv: list[str]) -> None:
        with open(self.work / f"{name}.err", "wb") as err:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                preexec_fn=die_with_parent,
            )
        if self.expired:  # the watchdog fired while this one was starting
            self.procs[name].kill()

    def check(self, name: str, *, wait: bool = False) -> None:
        """Raise if ``name`` has exited, quoting the last line of its stderr."""
        code = self.procs[name].wait() if wait else self.procs[name].poll()
        if code is not None:
            lines = (self.work / f"{name}.err").read_text(errors="replace").strip().splitlines()
            raise CalibrationError(
                f"the {name} process exited with code {code}: "
                f"{lines[-1][:300] if lines else 'no output'}; rerun with ",
                DEBUG,
            )

    def send(self, name: str, msg: dict) -> None:
        self.procs[name].stdin.write(json.dumps(msg) + "\n")
        self.procs[name].stdin.flush()

    def answer(self, name: str, want: str | None = None) -> Any:
        line = self.procs[name].stdout.readline() or self.check(name, wait=True)
        msg = json.loads(line)
        if want is not None and msg.get("event") != want:
            raise CalibrationError(
                f"the {name} process answered {msg}, expected event {want!r}; rerun with ", DEBUG
            )
        return msg

    def _expire(self) -> None:
        self.expired = True
        for proc in list(self.procs.values()):
            proc.kill()

    def close(self) -> None:
        self.timer.cancel()
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
    with _handler(procs.work / "stub_handler.py", _STUB_HANDLER):
        procs.start(
            "worker",
            [
                sys.executable, "-m", "mopar.runner.worker",
                str(procs.work / "fn"), str(procs.work), "1",
            ],
        )  # fmt: skip
    procs.answer("worker", "ready")
    ids = itertools.count(1)

    def ask(inputs: dict[str, str]) -> None:
        procs.send("worker", {"id": next(ids), "inputs": inputs, "outputs": {}})
        procs.answer("worker", "done")

    return ask


def _chain(root: Path, k: int, array: np.ndarray) -> BundleManifest:
    """A bundle of ``k`` slices, each handing ``array`` on: an ONNX Identity the function server
    runs with the runtime's own handler, and a handler that returns its input for the slice
    processes of shm (the Identity's run, timed apart, is too noisy to subtract there)."""
    import onnx
    from onnx import TensorProto, helper

    tensor = lambda name: IoTensor(  # noqa: E731
        name=name, shape=tuple(array.shape), dtype="float32", nbytes=array.nbytes
    )
    functions = []
    for i in range(k):
        folder = root / "functions" / f"s{i}"
        folder.mkdir(parents=True)
        inp, out = f"v{i}", f"v{i + 1}"
        graph = helper.make_graph(
            [helper.make_node("Identity", [inp], [out])],
            f"s{i}",
            [helper.make_tensor_value_info(inp, TensorProto.FLOAT, list(array.shape))],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, list(array.shape))],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 8  # what opset 18 needs; the onnx package writes newer by default
        onnx.save(model, str(folder / "model.onnx"))
        spec = FunctionSpec(
            model="calibration",
            slice=f"s{i}",
            index=i,
            count=k,
            receives=(TensorSpec(name=inp, shape=tuple(array.shape), dtype="float32"),),
            outputs=(out,),
            sends=(out,),
            returns={out: "y"} if i == k - 1 else {},
        )
        spec.write(folder)
        functions.append(IoFunction(name=f"s{i}", inputs=(tensor(inp),), outputs=(tensor(out),)))
    plan = {
        "model": "calibration",
        "functions": [{"name": f.name, "memory_mb": 128} for f in functions],
    }
    io = Io(
        inputs=(tensor("v0"),),
        outputs=(IoOutput(name="y", value=f"v{k}", shape=tuple(array.shape), dtype="float32"),),
        functions=tuple(functions),
    )
    return manifest_of(root, BundleDocument(plan=plan, io=io))


def _chain_cut_ms(work: Path, array: np.ndarray, requests: int, *, transport: str) -> float:
    """What one more cut of ``array`` costs `mopar run --transport`, ms: chains of 4 and 1
    served side by side (`run_bundles` interleaves them): a third of the difference of their
    median latencies, less the Identity's own run over http and redis (timed here, in one
    process). Never less than a copy of the bytes: on a busy machine the difference of two
    medians can come out lower."""
    from mopar.config import RunConfig
    from mopar.runner.local import run_bundles

    root = Path(tempfile.mkdtemp(prefix="chain-", dir=work))
    colocated = transport_named(transport).colocated  # the workers hand on; servers run Identity
    try:
        with (
            _handler(root / "pass_handler.py", _PASS_HANDLER)
            if colocated
            else contextlib.nullcontext()
        ):
            one, four = run_bundles(
                [_chain(root / "one", 1, array), _chain(root / "four", 4, array)],
                {"v0": array},
                config=RunConfig(requests=requests, timeout_s=120),
                transport=transport,
            )
        # over shm the slices hand their input on in Python; the servers run the Identity
        identity = 0.0 if colocated else _identity_ms(root / "one" / "functions" / "s0", array)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if one.errors or four.errors:
        raise CalibrationError(
            f"the {transport} chains failed: "
            f"{[*one.error_messages, *four.error_messages]}; rerun with ",
            DEBUG,
        )
    dest = np.empty_like(array)
    copy = _median_ms(lambda: np.copyto(dest, array), 5, warmup=1)
    return max((four.latency_p50_ms - one.latency_p50_ms) / 3 - identity, copy)


def _identity_ms(function_dir: Path, array: np.ndarray) -> float:
    from mopar.runtime.handler import SliceHandler

    handler = SliceHandler(function_dir, intra_op_threads=1)
    return _median_ms(lambda: handler.handle({"v0": array}), 9, warmup=2)
