"""Expert functions that scale to zero, on this machine: a gateway in front of them that starts
each one's server when a call or a warm-up reaches it, and stops it once idle.

`ColdGateway` is what a platform's gateway does for a function scaled to zero (OpenFaaS's
gateway with scale-from-zero, Lambda's invoke of a function with no execution environment): one
HTTP server on 127.0.0.1 that takes ``POST /function/<name>``, and

* a **call** to a function with no instance starts its function server process (a cold start:
  the process, its imports and its onnxruntime session) and waits for it; a call to one that is
  still starting waits for the rest of its start; either way the answer carries the wait in
  ``X-Mopar-Cold-Ms`` (`COLD_HEADER`), which the main function counts per step;
* a **warm-up** (``X-Mopar-Warm``) to a function with no instance starts one and is answered at
  once: a warm-up that comes early enough hides the start;
* an instance idle for ``idle_s`` is stopped (None: never), as a platform reaps it.

It forwards every other header and the body as they came (an shm reference stays a reference:
the function servers see the same folder) and counts what happened (`GatewayCounts`): calls
that found their function warm, warm because a warm-up started it, still starting after a
warm-up, or stopped; warm-ups that started an instance; starts no call used before the
instance was stopped; and each start's time. A request through the gateway pays its extra
loopback hop, as one through a platform's gateway does.
"""

from __future__ import annotations

import logging
import queue
import statistics
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from mopar.runner.emulate import LoopbackServer
from mopar.runner.processes import ServerProcess, listening_socket
from mopar.runtime.server import COLD_HEADER, WARM_HEADER
from mopar.runtime.transports import HANDSHAKE_HEADER
from mopar.runtime.transports.http import HopError, HttpClient

__all__ = ["COLD_HEADER", "SERVER_CMD", "ColdGateway", "GatewayCounts"]

log = logging.getLogger(__name__)

SERVER_CMD = (sys.executable, "-m", "mopar.runtime.server")
"""A function server: the installed mopar serves a bundle's folder, never the code it ships."""

_PREFIX = "/function/"


@dataclass(frozen=True, kw_only=True)
class GatewayCounts:
    """What the gateway saw. Calls: ``warm`` found an instance ready that was started by an
    earlier call, ``prewarmed`` one ready that a warm-up started, ``late`` one a warm-up had
    started that was still starting (the call waited for the rest), ``cold`` none (the call
    started it). ``warmups`` reached the gateway, ``warm_starts`` of them started an instance,
    ``unused_starts`` instances were stopped before any call reached them; ``start_ms``: the
    starts' median time, process start to ready."""

    calls: int = 0
    warm: int = 0
    prewarmed: int = 0
    late: int = 0
    cold: int = 0
    warmups: int = 0
    warm_starts: int = 0
    unused_starts: int = 0
    start_ms: float | None = None

    def to_dict(self) -> dict:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class _Instance:
    def __init__(self, server: ServerProcess, *, by_warm_up: bool) -> None:
        self.server = server
        self.by_warm_up = by_warm_up
        self.ready = threading.Event()
        self.failed: Exception | None = None
        self.used = False
        self.busy = 0
        self.last = time.monotonic()
        self.client: HttpClient | None = None


class ColdGateway:
    """The gateway of ``folders`` (function name -> its folder), none started.

    Args:
        env: the environment of every function server (the transport's settings included).
        idle_s: stop an instance idle this long, s (None: never).
        prewarm: a warm-up starts a stopped function (False: it is answered and starts none).
        timeout_s: how long a call waits for a start and for its answer, s.
    """

    def __init__(
        self,
        folders: Mapping[str, object],
        env: Mapping[str, str],
        *,
        idle_s: float | None = None,
        prewarm: bool = True,
        timeout_s: float = 120.0,
    ) -> None:
        self.folders = dict(folders)
        self.env = dict(env)
        self.idle_s = idle_s
        self.prewarm = prewarm
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._pending_ms: dict[str, float] = {}  # a handshake's wait, told with the next call
        self._counts = {k: 0 for k in GatewayCounts.__dataclass_fields__ if k != "start_ms"}
        self._start_ms: list[float] = []
        self._spawns: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        # servers are spawned from one long-lived thread, fork-safe: a child's parent-death
        # signal follows the thread that spawned it (`mopar.runner.processes.ServerProcess`)
        self._spawner = threading.Thread(target=self._spawn_loop, daemon=True)
        self._spawner.start()
        self._server = LoopbackServer(self._handle)
        if idle_s is not None:
            threading.Thread(target=self._reap_loop, daemon=True).start()

    def url(self, name: str) -> str:
        """Where ``name`` is called (and warmed)."""
        return f"{self._server.url}{_PREFIX}{name}"

    def counts(self) -> GatewayCounts:
        with self._lock:
            started = list(self._start_ms)
            return GatewayCounts(
                **self._counts, start_ms=statistics.median(started) if started else None
            )

    def close(self) -> None:
        """Stop the gateway and every instance."""
        self._closed.set()
        self._server.close()
        self._spawns.put(None)
        with self._lock:
            instances, self._instances = list(self._instances.values()), {}
        for x in instances:
            x.server.terminate()
        for x in instances:
            x.server.stop()

    # --- instances ----------------------------------------------------------------------------

    def _spawn_loop(self) -> None:
        while (job := self._spawns.get()) is not None:
            name, done = job
            try:
                env = {**self.env, "MOPAR_FUNCTION_DIR": str(self.folders[name])}
                done.set_result(
                    ServerProcess(
                        list(SERVER_CMD),
                        env,
                        name,
                        self.timeout_s,
                        wait=False,
                        fork_safe=True,
                        sock=listening_socket(),
                    )
                )
            except Exception as exc:  # noqa: BLE001 - told to the call that waits for it
                done.set_exception(exc)

    def _start(self, name: str, *, by_warm_up: bool) -> _Instance:
        """Start ``name`` (the lock held); its readiness is awaited in a thread of its own."""
        done: Future = Future()
        self._spawns.put((name, done))
        server = done.result(timeout=self.timeout_s)
        x = _Instance(server, by_warm_up=by_warm_up)
        self._instances[name] = x

        def wait() -> None:
            try:
                server.wait_ready()
                x.client = HttpClient(server.url, timeout_s=self.timeout_s, retries=0)
                with self._lock:
                    self._start_ms.append(server.load_ms)
            except Exception as exc:  # noqa: BLE001 - told to the calls that wait for it
                x.failed = exc
            x.last = time.monotonic()
            x.ready.set()

        threading.Thread(target=wait, daemon=True).start()
        return x

    def _instance(self, name: str, *, warm_up: bool) -> _Instance | None:
        """The instance a call to ``name`` goes to, counted by what it found (None: a
        warm-up, which waits for nothing)."""
        with self._lock:
            x = self._instances.get(name)
            if warm_up:
                self._counts["warmups"] += 1
                if x is None and self.prewarm:
                    self._counts["warm_starts"] += 1
                    self._start(name, by_warm_up=True)
                return None
            self._counts["calls"] += 1
            if x is None:
                found = "cold"
                x = self._start(name, by_warm_up=False)
            elif not x.ready.is_set():
                found = "late" if x.by_warm_up and not x.used else "warm"
            else:
                found = "prewarmed" if x.by_warm_up and not x.used else "warm"
            self._counts[found] += 1
            x.used = True
            x.busy += 1
            return x

    def _reap_loop(self) -> None:
        tick = max(min(self.idle_s / 4, 1.0), 0.01)
        while not self._closed.wait(tick):
            now, stopped = time.monotonic(), []
            with self._lock:
                for name, x in list(self._instances.items()):
                    if x.ready.is_set() and not x.busy and now - x.last > self.idle_s:
                        del self._instances[name]
                        self._counts["unused_starts"] += not x.used
                        stopped.append(x)
            for x in stopped:
                x.server.stop()

    # --- requests -----------------------------------------------------------------------------

    def _handle(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes, dict]:
        """A POST to ``/function/<name>`` (headers by lower-case name): its status, body and
        headers. The mopar headers and the content type go on to the function."""
        name = path[len(_PREFIX) :] if path.startswith(_PREFIX) else ""
        if name not in self.folders:
            return 404, f"no function {name!r} behind this gateway".encode(), {}
        keep = {k: v for k, v in headers.items() if k.startswith("x-mopar-")}
        if "content-type" in headers:  # in the client's own spelling, which it then keeps
            keep["Content-Type"] = headers["content-type"]
        return self._serve(name, body, keep)

    def _serve(self, name: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, dict]:
        warm_up = WARM_HEADER.lower() in headers
        try:
            x = self._instance(name, warm_up=warm_up)
        except Exception as exc:  # noqa: BLE001 - the process did not spawn: the caller's 502
            return 502, f"function {name} could not start: {exc!r}".encode(), {}
        if x is None:
            return 200, b"", {}
        start, was_ready = time.perf_counter(), x.ready.is_set()
        try:
            if not x.ready.wait(self.timeout_s) or x.failed is not None:
                return 502, f"function {name} did not start: {x.failed}".encode(), {}
            waited = 0.0 if was_ready else (time.perf_counter() - start) * 1e3
            if HANDSHAKE_HEADER.lower() in headers:
                with self._lock:  # the call that follows it is the one that waited
                    self._pending_ms[name] = self._pending_ms.get(name, 0.0) + waited
                waited = 0.0
            else:
                with self._lock:
                    waited += self._pending_ms.pop(name, 0.0)
            try:
                answer = x.client.post_once(body, headers)
            except (HopError, OSError) as exc:
                return 502, f"function {name} failed: {exc}".encode(), {}
            out = {k: v for k, v in answer.headers.items() if k.startswith("x-mopar-")}
            out["content-type"] = answer.headers.get("content-type", "application/octet-stream")
            out[COLD_HEADER] = f"{waited:.3f}"
            return answer.status, answer.body, out
        finally:
            with self._lock:
                x.busy -= 1
                x.last = time.monotonic()
