"""Run a bundle locally: one OS process per slice, tensors handed over through /dev/shm.

Read in this order: `run_bundle`, then `_Session` (the scheduler). The parent process
is the coordinator: it writes each request's inputs into a per-run tmpfs folder, announces to a
slice over its stdin pipe when all of that slice's input tensors exist, and learns over the
slice's stdout pipe when its outputs have been written. Skip connections need nothing
special: a slice is dispatched when every tensor it reads exists, wherever it was made.

Each request in flight holds one of ``concurrency`` slots, and each (slot, value) pair has one
reusable mapped buffer (`mopar.runner.shmbuf`), so the folder holds at most
slots x values files however many requests run, and a handoff is one copy into a mapping that
is already faulted in. A slot is reused only after its request has finished, so no buffer is
overwritten while a slice still reads it.

Each slice writes its outputs with the codecs the manifest gives them (`BundleSlice.codecs`);
every reader decodes whatever a file's header says, so the coordinator needs no table of them.

A dispatch function (a mixture-of-experts layer) is dispatched like a slice; when it asks for
expert functions (a ``call`` event: those its tokens reached, their tokens and gates already in
their buffers), the coordinator sends each of them its request and, once all have answered,
resumes the dispatch. Expert functions no token reached get no message at all.

With ``cold_experts`` the expert functions start cold, as on a platform that scaled them to
zero: none runs before it is first needed, and all stop after each request. A call to a stopped
one starts it (a cold start, timed) and waits for it; a ``warm`` event from a dispatch -- the
next layer's expert functions it predicts -- starts the predicted ones that are stopped, so
their start overlaps the layers in between (``prewarm``).

The per-run folder is removed on every exit path: success, a failing slice, a timeout, Ctrl-C.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import selectors
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
from mopar.runner.shmbuf import BufferPool
from mopar.runner.worker import peak_rss_mb
from mopar.runtime.dispatch import expert_tensors

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
    """A slice process; its stdout pipe is read by the session's selector, in the main thread.

    No reader thread and queue between the pipe and the scheduler: a reply costs one read.
    """

    def __init__(self, index: int, function_dir: Path, shm: Path, threads: int,
                 dispatch: dict | None = None) -> None:
        self.index = index
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        extra = [json.dumps(dispatch)] if dispatch else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mopar.runner.worker", str(function_dir), str(shm), str(threads),
             *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
            env=env,
        )
        self.stdout_fd = self.proc.stdout.fileno()
        self.pending = b""
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=30)
        self.err_pump = threading.Thread(target=self._pump_err, daemon=True)
        self.err_pump.start()

    def read_events(self) -> list[dict]:
        """What one read of stdout brings: whole reply lines, or ``exit`` at end of file."""
        data = os.read(self.stdout_fd, 1 << 16)
        if not data:
            return [{"event": "exit"}]
        *lines, self.pending = (self.pending + data).split(b"\n")
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                self.stderr_tail.append(line.decode(errors="replace").rstrip())
        return events

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail.append(line.decode(errors="replace").rstrip())

    def send(self, msg: dict) -> None:
        os.write(self.proc.stdin.fileno(), json.dumps(msg).encode() + b"\n")

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
        self.proc.stdout.close()


class _Session:
    def __init__(self, manifest: BundleManifest, shm: Path, config: RunConfig, *, tag: int) -> None:
        self.manifest = manifest
        self.tag = tag  # keeps file names of bundles sharing the folder apart
        self.shm = shm
        self.config = config
        self.events: collections.deque[tuple[int, dict]] = collections.deque()
        self.selector = selectors.DefaultSelector()
        self.workers: list[_Worker | None] = []  # None: not running (a cold expert function)
        values = list(manifest.inputs) + [v for s in manifest.slices for v in (*s.inputs, *s.outputs)]
        self.index = {s.name: i for i, s in enumerate(manifest.slices)}
        self.value_index = {v: k for k, v in enumerate(dict.fromkeys(values))}
        self.next_id = 0
        self.slice_ms: list[list[float]] = [[] for _ in manifest.slices]
        self.peak_rss = [0.0] * len(manifest.slices)
        self.load_ms = [0.0] * len(manifest.slices)
        self.latencies: list[float] = []
        self.errors: list[str] = []  # of measured requests
        self.warmup_errors: list[str] = []
        self.comparison = Comparison()
        self.pool = BufferPool(shm)
        self.free_slots: list[int] = []
        self.slots = 0
        # cold expert functions: messages for those still starting, when each start began,
        # the ones a warm-up started and no call has used yet, and what was counted
        self.queued: dict[int, list[dict]] = {}
        self.started_at: dict[int, float] = {}
        self.warmed: set[int] = set()
        self.measuring = False
        self.cold = {"cold_starts": 0, "prewarmed": 0, "prewarm_used": 0, "start_ms": []}
        self.warm_log: list[tuple[int, str]] = []  # (request, function) of each warm-up

    # -- processes ---------------------------------------------------------------------------

    def start(self) -> None:
        self.workers = [None] * len(self.manifest.slices)
        for i, s in enumerate(self.manifest.slices):
            if not (self.config.cold_experts and s.called):
                self._spawn(i)
        while self.queued:
            index, msg = self._next_event()
            if msg["event"] == "ready":
                self._ready(index, msg)

    def stop(self) -> None:
        self.selector.close()
        for w in self.workers:
            if w is not None:
                w.stop()
        self.pool.close()

    def _spawn(self, i: int) -> None:
        """Start slice ``i``'s process; messages for it wait until it is ready."""
        s = self.manifest.slices[i]
        worker = _Worker(i, self.manifest.function_dir(s), self.shm, self.config.intra_op_threads,
                         s.dispatch)
        self.workers[i] = worker
        self.selector.register(worker.stdout_fd, selectors.EVENT_READ, worker)
        self.queued[i] = []
        self.started_at[i] = time.perf_counter()

    def _ready(self, i: int, msg: dict) -> None:
        if i not in self.queued:  # stopped while it started
            return
        self.load_ms[i] = msg["load_ms"]
        self.peak_rss[i] = max(self.peak_rss[i], msg["peak_rss_mb"])
        if self.measuring:
            self.cold["start_ms"].append((time.perf_counter() - self.started_at[i]) * 1e3)
        for m in self.queued.pop(i):
            self.workers[i].send(m)

    def _send(self, i: int, msg: dict) -> None:
        """Send slice ``i`` a request; a stopped one is started first (a cold start)."""
        if self.workers[i] is None:
            self._spawn(i)
            self.cold["cold_starts"] += self.measuring
        if i in self.warmed:
            self.warmed.discard(i)
            self.cold["prewarm_used"] += self.measuring
        if i in self.queued:
            self.queued[i].append(msg)
        else:
            self.workers[i].send(msg)

    def _warm(self, rid: int, names: list[str]) -> None:
        """Start the predicted expert functions that are stopped, and only those."""
        if not (self.config.cold_experts and self.config.prewarm):
            return
        for name in names:
            i = self.index[name]
            if self.workers[i] is None:
                self._spawn(i)
                self.warmed.add(i)
                self.warm_log.append((rid, name))
                self.cold["prewarmed"] += self.measuring

    def _scale_to_zero(self) -> None:
        """Stop every expert function (no request is in flight)."""
        for i, w in enumerate(self.workers):
            if w is None or not self.manifest.slices[i].called:
                continue
            self.peak_rss[i] = max(self.peak_rss[i], peak_rss_mb(w.proc.pid))
            self.selector.unregister(w.stdout_fd)
            w.stop()
            self.workers[i] = None
            self.queued.pop(i, None)
            self.warmed.discard(i)
        self.events = collections.deque((i, m) for i, m in self.events
                                        if self.workers[i] is not None)

    def _next_event(self) -> tuple[int, dict]:
        deadline = time.monotonic() + self.config.timeout_s
        while not self.events:
            ready = self.selector.select(timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeFailure(
                    f"no slice answered within {self.config.timeout_s:.0f} s; raise --timeout or "
                    "check the slices' memory"
                )
            for key, _ in ready:
                worker = key.data
                events = worker.read_events()
                if events and events[-1]["event"] == "exit":
                    self.selector.unregister(worker.stdout_fd)
                self.events.extend((worker.index, e) for e in events)
        index, msg = self.events.popleft()
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

    def _file(self, slot: int, value: str) -> str:
        return f"r{self.tag}x{slot}-v{self.value_index[value]}.t"

    def _take_slot(self) -> int:
        if not self.free_slots:
            self.free_slots.append(self.slots)
            self.slots += 1
        return self.free_slots.pop()

    def serve(self, inputs, *, requests, concurrency, expected, measure) -> None:
        state: dict[int, dict] = {}
        started = finished = 0
        self.measuring = measure
        while finished < requests:
            while started < requests and len(state) < concurrency:
                rid = self.next_id
                self.next_id += 1
                state[rid] = self._begin(rid, inputs)
                started += 1
            index, msg = self._next_event()
            if msg["event"] == "ready":  # a cold function has started
                self._ready(index, msg)
                continue
            rid = msg.get("id")
            if rid not in state:
                continue
            st = state[rid]
            if msg["event"] == "call":  # a dispatch asks for its expert functions
                self._call(rid, st, index, msg["calls"])
                continue
            if msg["event"] == "warm":  # a dispatch predicts the next layer's
                self._warm(rid, msg["functions"])
                continue
            if msg["event"] == "error":
                if not st.get("failed"):  # one message per failed request
                    message = f"{self.manifest.slices[index].name}: {msg['message']}"
                    (self.errors if measure else self.warmup_errors).append(message)
                st["failed"] = True
            else:
                if measure:
                    self.slice_ms[index].append(msg["ms"])
                st["have"].update(self.manifest.slices[index].outputs)
            st["pending"] -= 1
            self._answered(rid, st, index)
            if not st.get("failed"):
                self._dispatch(rid, st)
            if st["pending"] == 0 and (st.get("failed") or self._complete(st)):
                self._finish(rid, st, expected, measure)
                del state[rid]
                finished += 1
                if self.config.cold_experts and not state:
                    self._scale_to_zero()

    def _begin(self, rid: int, inputs: dict[str, np.ndarray]) -> dict:
        t0 = time.perf_counter()
        slot = self._take_slot()
        for name in self.manifest.inputs:
            self.pool.write(self._file(slot, name), inputs[name])
        st = {"t0": t0, "slot": slot, "have": set(self.manifest.inputs), "sent": set(), "pending": 0}
        self._dispatch(rid, st)
        return st

    def _call(self, rid: int, st: dict, caller: int, names: list[str]) -> None:
        """Run the expert functions a dispatch asked for; it is resumed when all have answered."""
        st.setdefault("waiting", {})[caller] = set(names)
        for name in names:
            i, s = self.index[name], self.manifest.slices[self.index[name]]
            st["pending"] += 1
            self._send(i, {
                "id": rid, "inputs": {v: self._file(st["slot"], v) for v in s.inputs},
                "outputs": {v: self._file(st["slot"], v) for v in s.outputs}})

    def _answered(self, rid: int, st: dict, index: int) -> None:
        """An expert function answered: resume its dispatch once the last of its calls has."""
        for caller, names in st.get("waiting", {}).items():
            name = self.manifest.slices[index].name
            if name in names:
                names.discard(name)
                if not names:
                    self.workers[caller].send({"id": rid, "resume": True,
                                               "abort": bool(st.get("failed"))})
                return

    def _dispatch(self, rid: int, st: dict) -> None:
        for i, s in enumerate(self.manifest.slices):
            if s.called or i in st["sent"] or not all(v in st["have"] for v in s.inputs):
                continue
            st["sent"].add(i)
            st["pending"] += 1
            slot = st["slot"]
            msg = {
                "id": rid,
                "inputs": {v: self._file(slot, v) for v in s.inputs},
                "outputs": {v: self._file(slot, v) for v in s.outputs},
            }
            if s.codecs:
                msg["codecs"] = dict(s.codecs)
            if s.dispatch is not None:
                msg["calls"] = {
                    c: {k: self._file(slot, v) for k, v in
                        zip(("tokens", "gates", "out"), expert_tensors(c))}
                    for c in s.dispatch["callees"]}
            self.workers[i].send(msg)

    def _complete(self, st: dict) -> bool:
        return all(value in st["have"] for _, value in self.manifest.outputs)

    def _finish(self, rid: int, st: dict, expected, measure: bool) -> None:
        if not st.get("failed"):
            got = {pub: self.pool.read(self._file(st["slot"], value))
                   for pub, value in self.manifest.outputs}
            if measure:
                self.latencies.append((time.perf_counter() - st["t0"]) * 1e3)
            if expected is not None:
                self.comparison = self.comparison.merge(
                    compare_outputs(got, expected, self.config.tolerance))
        self.free_slots.append(st["slot"])  # every slice of this request has answered

    def report(self, *, checked: bool) -> RunReport:
        manifest = self.manifest
        def pct(values: list[float], q: float) -> float | None:
            return round(float(np.percentile(values, q)), 3) if values else None

        for i, w in enumerate(self.workers):  # still running: their VmHWM covers every request
            if w is not None:
                self.peak_rss[i] = max(self.peak_rss[i], peak_rss_mb(w.proc.pid))
        slices = tuple(
            SliceStats(
                name=s.name, peak_rss_mb=round(self.peak_rss[i], 1), allocated_mb=s.memory_mb,
                p50_ms=pct(self.slice_ms[i], 50), p95_ms=pct(self.slice_ms[i], 95),
                load_ms=round(self.load_ms[i], 1), calls=len(self.slice_ms[i]),
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
            cold=None if not self.config.cold_experts else {
                **{k: v for k, v in self.cold.items() if k != "start_ms"},
                "start_ms_p50": pct(self.cold["start_ms"], 50)},
        )
