"""Run a bundle locally: one OS process per slice, tensors handed over through /dev/shm.

Read in this order: `run_bundle`, then `_Session` (the scheduler). The parent process
is the coordinator: it writes each request's inputs into a per-run tmpfs folder, announces to a
slice over its stdin pipe when all of that slice's input tensors exist, and learns over the
slice's stdout pipe when its outputs have been written (atomically). Skip connections need nothing
special: a slice is dispatched when every tensor it reads exists, wherever it was made.

Each slice writes its outputs with the codecs the manifest gives them (`BundleSlice.codecs`);
every reader decodes whatever a file's header says, so the coordinator needs no table of them.

The per-run folder is removed on every exit path: success, a failing slice, a timeout, Ctrl-C.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mopar.config import RunConfig
from mopar.errors import InputSpecError, RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.chain import ChainSession, local_redis
from mopar.runner.check import Comparison, compare_outputs
from mopar.runner.report import RunReport, SliceStats
from mopar.runtime.wire import read_tensor, write_tensor

__all__ = ["run_bundle", "run_bundles", "shm_root"]

log = logging.getLogger(__name__)


def shm_root() -> Path:
    """The tmpfs folder for handoff: /dev/shm when it exists, else the temp dir (logged)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    log.warning("/dev/shm is not available; handing tensors over through %s", tempfile.gettempdir())
    return Path(tempfile.gettempdir())


def run_bundle(
    manifest: BundleManifest,
    inputs: dict[str, np.ndarray],
    *,
    config: RunConfig,
    expected: dict[str, np.ndarray] | None = None,
    on_request: Callable[[int], None] | None = None,
    transport: str = "shm",
    redis_url: str = "",
) -> RunReport:
    """Serve one warm-up request and then ``config.requests`` measured ones.

    Args:
        manifest: the bundle to run.
        inputs: model inputs by public name.
        config: requests, concurrency, timeouts.
        expected: model outputs to compare with (by public name), or None.
        on_request: called with the number of finished measured requests (for progress bars).
        transport, redis_url: as for `run_bundles`.
    """
    return run_bundles([manifest], inputs, config=config, expected=expected, on_request=on_request,
                       transport=transport, redis_url=redis_url)[0]


def run_bundles(
    manifests: list[BundleManifest],
    inputs: dict[str, np.ndarray],
    *,
    config: RunConfig,
    expected: dict[str, np.ndarray] | None = None,
    on_request: Callable[[int], None] | None = None,
    transport: str | Sequence[str] = "shm",
    redis_url: str = "",
) -> list[RunReport]:
    """Run several bundles of one model side by side, interleaving their requests (A B A B ...).

    All bundles' processes are up at once, and each round serves ``config.concurrency`` requests
    on every bundle in turn, so that machine drift does not favour one of them.

    Args:
        transport: ``shm`` runs the slices as pipe-driven workers handing over through
            /dev/shm; ``http`` and ``redis`` run each slice's real function server on
            127.0.0.1 and chain them (`mopar.runner.chain`). One per manifest, or one for all.
        redis_url: the Redis for ``redis``; empty starts a private redis-server for the run.
    """
    for manifest in manifests:
        missing = [n for n in manifest.inputs if n not in inputs]
        if missing:
            raise InputSpecError(
                f"input file lacks {missing}; the bundle's inputs are {list(manifest.inputs)}"
            )
    transports = [transport] * len(manifests) if isinstance(transport, str) else list(transport)
    with contextlib.ExitStack() as stack:
        if "redis" in transports and not redis_url:
            redis_url = stack.enter_context(local_redis())
        shm = Path(tempfile.mkdtemp(prefix="mopar-run-", dir=shm_root()))
        sessions = []
        for i, (m, kind) in enumerate(zip(manifests, transports, strict=True)):
            if kind == "shm":
                sessions.append(_Session(m, shm, config, tag=i))
            else:
                sessions.append(ChainSession(m, config, transport=kind, redis_url=redis_url,
                                             shm_dir=str(shm)))
        return _interleave(sessions, inputs, config, expected, on_request, shm)


def _interleave(sessions, inputs, config: RunConfig, expected, on_request, shm: Path
                ) -> list[RunReport]:
    try:
        for session in sessions:
            session.start()
        for session in sessions:  # warm-up: one request each, not measured
            session.serve(inputs, requests=1, concurrency=1, expected=expected, measure=False)
        done = 0
        while done < config.requests:
            batch = min(config.concurrency, config.requests - done)
            for session in sessions:
                session.serve(inputs, requests=batch, concurrency=batch, expected=expected,
                              measure=True)
            done += batch
            if on_request is not None:
                on_request(done)
        return [s.report(checked=expected is not None) for s in sessions]
    finally:
        for session in sessions:
            session.stop()
        shutil.rmtree(shm, ignore_errors=True)


class _Worker:
    """A slice process with reader threads that turn its stdout lines into events."""

    def __init__(self, index: int, function_dir: Path, shm: Path, threads: int, events: queue.Queue):
        self.index = index
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mopar.runner.worker", str(function_dir), str(shm), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=env,
        )
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=30)
        threading.Thread(target=self._pump_out, args=(events,), daemon=True).start()
        self.err_pump = threading.Thread(target=self._pump_err, daemon=True)
        self.err_pump.start()

    def _pump_out(self, events: queue.Queue) -> None:
        for line in self.proc.stdout:
            try:
                events.put((self.index, json.loads(line)))
            except json.JSONDecodeError:
                self.stderr_tail.append(line.rstrip())
        events.put((self.index, {"event": "exit"}))

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip())

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Session:
    def __init__(self, manifest: BundleManifest, shm: Path, config: RunConfig, *, tag: int) -> None:
        self.manifest = manifest
        self.tag = tag  # keeps file names of bundles sharing the folder apart
        self.shm = shm
        self.config = config
        self.events: queue.Queue = queue.Queue()
        self.workers: list[_Worker] = []
        values = list(manifest.inputs) + [v for s in manifest.slices for v in s.outputs]
        self.value_index = {v: k for k, v in enumerate(dict.fromkeys(values))}
        self.next_id = 0
        self.slice_ms: list[list[float]] = [[] for _ in manifest.slices]
        self.peak_rss = [0.0] * len(manifest.slices)
        self.load_ms = [0.0] * len(manifest.slices)
        self.latencies: list[float] = []
        self.errors: list[str] = []  # of measured requests
        self.warmup_errors: list[str] = []
        self.comparison = Comparison()

    # -- processes ---------------------------------------------------------------------------

    def start(self) -> None:
        for i, s in enumerate(self.manifest.slices):
            fdir = self.manifest.function_dir(s)
            self.workers.append(_Worker(i, fdir, self.shm, self.config.intra_op_threads, self.events))
        ready = 0
        while ready < len(self.workers):
            index, msg = self._next_event()
            if msg["event"] == "ready":
                ready += 1
                self.load_ms[index] = msg["load_ms"]
                self.peak_rss[index] = msg["peak_rss_mb"]

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def _next_event(self) -> tuple[int, dict]:
        try:
            index, msg = self.events.get(timeout=self.config.timeout_s)
        except queue.Empty:
            raise RuntimeFailure(
                f"no slice answered within {self.config.timeout_s:.0f} s; raise --timeout or check "
                "the slices' memory"
            ) from None
        if msg["event"] == "exit":
            w = self.workers[index]
            code = w.proc.wait()
            w.err_pump.join(timeout=5)  # the last stderr lines say why it died
            tail = next((line for line in reversed(w.stderr_tail) if line.strip()), "no output")
            raise RuntimeFailure(
                f"slice {self.manifest.slices[index].name} exited with code {code}: {tail}"
            )
        return index, msg

    # -- requests ----------------------------------------------------------------------------

    def _file(self, rid: int, value: str) -> str:
        return f"r{self.tag}x{rid}-v{self.value_index[value]}.t"

    def serve(self, inputs, *, requests, concurrency, expected, measure) -> None:
        state: dict[int, dict] = {}
        started = finished = 0
        while finished < requests:
            while started < requests and len(state) < concurrency:
                rid = self.next_id
                self.next_id += 1
                state[rid] = self._begin(rid, inputs)
                started += 1
            index, msg = self._next_event()
            rid = msg.get("id")
            if rid not in state:
                continue
            st = state[rid]
            if msg["event"] == "error":
                message = f"{self.manifest.slices[index].name}: {msg['message']}"
                (self.errors if measure else self.warmup_errors).append(message)
                st["failed"] = True
            else:
                if measure:
                    self.slice_ms[index].append(msg["ms"])
                self.peak_rss[index] = max(self.peak_rss[index], msg["peak_rss_mb"])
                st["have"].update(self.manifest.slices[index].outputs)
            st["pending"] -= 1
            if not st.get("failed"):
                self._dispatch(rid, st)
            if st["pending"] == 0 and (st.get("failed") or self._complete(st)):
                self._finish(rid, st, expected, measure)
                del state[rid]
                finished += 1

    def _begin(self, rid: int, inputs: dict[str, np.ndarray]) -> dict:
        t0 = time.perf_counter()
        for name in self.manifest.inputs:
            write_tensor(self.shm / self._file(rid, name), inputs[name])
        st = {"t0": t0, "have": set(self.manifest.inputs), "sent": set(), "pending": 0}
        self._dispatch(rid, st)
        return st

    def _dispatch(self, rid: int, st: dict) -> None:
        for i, s in enumerate(self.manifest.slices):
            if i in st["sent"] or not all(v in st["have"] for v in s.inputs):
                continue
            st["sent"].add(i)
            st["pending"] += 1
            msg = {
                "id": rid,
                "inputs": {v: self._file(rid, v) for v in s.inputs},
                "outputs": {v: self._file(rid, v) for v in s.outputs},
            }
            if s.codecs:
                msg["codecs"] = dict(s.codecs)
            self.workers[i].send(msg)

    def _complete(self, st: dict) -> bool:
        return all(value in st["have"] for _, value in self.manifest.outputs)

    def _finish(self, rid: int, st: dict, expected, measure: bool) -> None:
        if not st.get("failed"):
            got = {pub: read_tensor(self.shm / self._file(rid, value))
                   for pub, value in self.manifest.outputs}
            if measure:
                self.latencies.append((time.perf_counter() - st["t0"]) * 1e3)
            if expected is not None:
                self.comparison = self.comparison.merge(
                    compare_outputs(got, expected, self.config.tolerance))
        for path in self.shm.glob(f"r{self.tag}x{rid}-v*.t"):
            path.unlink(missing_ok=True)

    def report(self, *, checked: bool) -> RunReport:
        manifest = self.manifest
        def pct(values: list[float], q: float) -> float | None:
            return round(float(np.percentile(values, q)), 3) if values else None

        slices = tuple(
            SliceStats(
                name=s.name, peak_rss_mb=round(self.peak_rss[i], 1), allocated_mb=s.memory_mb,
                p50_ms=pct(self.slice_ms[i], 50), p95_ms=pct(self.slice_ms[i], 95),
                load_ms=round(self.load_ms[i], 1),
            )
            for i, s in enumerate(manifest.slices)
        )
        return RunReport(
            slices=slices,
            latency_p50_ms=pct(self.latencies, 50),
            latency_p95_ms=pct(self.latencies, 95),
            requests=len(self.latencies) + len(self.errors),
            errors=len(self.errors),
            comparison=self.comparison if checked else None,
            tolerance=self.config.tolerance,
            error_messages=tuple((self.warmup_errors + self.errors)[:5]),
        )
