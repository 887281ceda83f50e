"""`mopar run --transport http|redis`: the bundle's real function servers, chained on 127.0.0.1.

Each slice runs the server a deployed function runs (`mopar.runtime.server`, from the installed
mopar: a bundle is data here, and the template code it ships for its images never runs), on a
loopback socket bound here and inherited (`mopar.runner.processes`); each one's ``MOPAR_NEXT``
is the next one's URL, so a request POSTed to the first travels the chain and the last answers
with the model outputs. ``redis`` hands frames over through a real redis-server: the one
``--redis-url`` names, or a private one started on loopback for the run.

`ChainSession` has the interface of `mopar.runner.shm_session.ShmSession`, so `run_bundles`
interleaves either kind the same way. A slice whose server dies or stops answering ends the run
with an error naming it (no instance replaces it here): each hop waits `HOP_GRACE_S` longer
than the hop after it (as a deployed chain's timeouts cover the rest of the path), so the
innermost wait expires first and its 504 names the slice that hung.

The bundle's chain mode (`mopar.runtime.chains`) decides how a request travels:

- ``http`` and ``invoke`` (and ``shm`` served this way): each server POSTs to the next and
  waits for its answer;
- ``stepfunctions``: no server has a next one; the runner, as the state machine, POSTs each
  one's answer to the one after;
- ``callback``: each server hands on through the gateway's queue and answers 202; the last
  POSTs the answer to the request's ``X-Callback-Url``: both the target's emulation of its
  platform (`mopar.target.Emulation`, ``target.emulation(mode)``: OpenFaaS's
  `mopar.targets.openfaas.emulate.Gateway`);
- ``event``: each function is the bundle's Lambda handler behind Lambda's Invoke API
  (`mopar.targets.aws_lambda.emulate.LambdaHost`), handing on by ``Event`` invokes; the runner
  invokes the entry with ``"async": true`` and reads the answer from the Redis rendezvous, as a
  client.

Which process serves a function in a mode is its target's answer (`mopar.target.Entry`, from
``target.entry(mode, deployed=lambda_handlers)``): the function server, or a handler that takes
JSON events behind its platform's emulated Invoke API (`Entry.events`). With
``lambda_handlers`` (compile's measurement: each function in the process it deploys as) a
Lambda plan's functions are its Lambda handlers in the synchronous modes too: ``invoke`` (the
runner invokes the entry, which invokes the next and answers with what it answered) and
``stepfunctions`` (the runner, as the state machine, invokes each with the one before's
answer). With transport `AS_PLANNED` each function hands on as its ``function.json`` says.

Every request's invocations (each function's own, wait and INIT ms, from the spans the
functions hand on) are kept in the report (`mopar.runner.report.Served`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from mopar.bundle.function import FunctionSpec
from mopar.config import RunConfig
from mopar.errors import BundleError, RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.check import Comparison, compare_outputs
from mopar.runner.load import load_summary, pct, poisson_arrivals
from mopar.runner.processes import ServerProcess, listening_socket, local_redis
from mopar.runner.report import RunReport, Served, SliceStats
from mopar.runner.worker import peak_rss_mb
from mopar.runtime.aws import event_frame, frame_event, post_event
from mopar.runtime.chains import MODES, ChainMode, parse_spans
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from mopar.runtime.rendezvous import REQUEST_HEADER, Answer, RedisRendezvous
from mopar.runtime.transports import HopError, HttpClient, RedisStore, Response, handing_on
from mopar.target import Emulation, Target, target_or_default

__all__ = ["AS_PLANNED", "ChainSession", "chain_mode_of", "target_of"]

AS_PLANNED = "plan"
"""The transport of a session whose functions hand on as their plan says (each one's
``function.json``: shm between co-located ones, HTTP or Redis elsewhere), not all by one."""

REST = "mopar-rest"
"""The name the functions after a session's last go by, where ``rest`` stands for them."""

HOP_GRACE_S = 1.0
"""Seconds a hop waits beyond ``--timeout`` for each slice after it on the request path."""


def target_of(manifest: BundleManifest) -> Target:
    """The target ``manifest``'s plan was made for (`mopar.target.target_or_default`: the
    default target for one that names none, or a pricing-only one)."""
    return target_or_default(manifest.document.plan.get("target"))


def chain_mode_of(manifest: BundleManifest) -> ChainMode:
    """The chain mode ``manifest``'s plan names (none: its target's default).

    Raises:
        BundleError: the plan names a mode this mopar does not know.
    """
    name = manifest.document.plan.get("chain") or ""
    if not name:
        target = target_of(manifest)
        offered = target.chain_modes() or target_or_default(None).chain_modes()
        return offered[0]
    if name not in MODES:
        raise BundleError(
            f"{str(manifest.root)!r} chains its functions by {name!r}, which this mopar does "
            f"not know (it knows {list(MODES)}); recompile the bundle with this mopar"
        )
    return MODES[name]


class ChainSession:
    """The bundle's functions, chained by ``transport`` in chain ``mode``; requests sent to
    the first (see the module docstring). ``rest``: the URL the last of them hands on to, which
    stands for the functions after it (`mopar.runner.stepwise`; empty: it answers)."""

    def __init__(
        self,
        manifest: BundleManifest,
        config: RunConfig,
        *,
        transport: str,
        redis_url: str = "",
        shm_dir: str = "",
        mode: ChainMode | None = None,
        lambda_handlers: bool = False,
        rest: str = "",
    ) -> None:
        self.manifest = manifest
        self.rest = rest
        self.config = config
        self.transport = transport
        self.lambda_handlers = lambda_handlers
        self.redis_url = redis_url
        self.shm_dir = shm_dir
        self.mode = mode or chain_mode_of(manifest)
        # the process each function runs as in this mode: its target's answer
        self.entry = target_of(manifest).entry(self.mode, deployed=lambda_handlers)
        self.servers: list[ServerProcess] = []
        self.platform: Emulation | None = None  # what the target plays in front of them
        self.rendezvous: RedisRendezvous | None = None
        self._lock = threading.Lock()
        self._own = contextlib.ExitStack()  # what it started for itself (a private Redis)
        self._bound: dict[str, socket.socket] = {}  # each function's socket, until launched
        self.lazy = config.start_cold and self.entry.events
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (a new load step)."""
        self.slice_ms: dict[str, list[float]] = {s.name: [] for s in self.manifest.slices}
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.warmup_errors: list[str] = []
        self.records: list[tuple[float, float | None]] = []  # open loop: (arrival s, ms | None)
        self.window = [0.0, 0.0]
        self.comparison = Comparison()
        self.served: list[Served] = []
        # started cold (Lambda handlers only): INIT at each one's first invocation
        self.cold = {"first_request_ms": None} if self.lazy else None

    def _needs_redis(self, specs: dict[str, FunctionSpec]) -> bool:
        """Whether the chain needs a Redis the caller did not give: for the answers'
        rendezvous, for a state over Step Functions' limit, or for a plan's Redis handoffs."""
        planned = self.transport == AS_PLANNED and any(
            handing_on(spec.transport or "").needs_redis for spec in specs.values()
        )
        states = self.entry.events and not self.mode.hands_on
        if self.config.redis_stand_in:  # frames inline instead (compile, no redis-server)
            return self.mode.rendezvous == "redis"
        return self.mode.rendezvous == "redis" or states or planned

    def start(self, *, wait: bool = True) -> None:
        """Start every function's process and, with ``wait``, wait until all are ready (else
        `wait_started` does)."""
        specs = {
            s.name: FunctionSpec.load(self.manifest.function_dir(s)) for s in self.manifest.slices
        }
        route = [s.name for s in self.manifest.slices if not specs[s.name].answers]
        after = {name: len(route) - 1 - k for k, name in enumerate(route)}  # called ones: 0
        started: dict[str, ServerProcess] = {}
        self.platform = target_of(self.manifest).emulation(
            self.mode, workers=2 * self.config.max_in_flight, timeout_s=self._wait_s(len(route))
        )
        if not self.redis_url and self._needs_redis(specs):  # a private one, as for redis cuts
            self.redis_url = self._own.enter_context(local_redis())
        if self.mode.rendezvous == "redis":
            self.rendezvous = RedisRendezvous(self.redis_url)
        threads = 2 * max(self.config.concurrency, 2)  # a facade's wait holds a thread
        # every port is chosen before any server starts, so that each knows the URLs of those
        # it calls and all start at once (a server's start is mostly imports: ~0.3 s)
        ports = self._reserve([s.name for s in self.manifest.slices])
        urls = {name: f"http://127.0.0.1:{port}/" for name, port in ports.items()}
        if self.platform is not None:
            for name, url in urls.items():
                self.platform.add(name, url)

        def address(name: str) -> str:  # how a function names another
            return name if self.entry.events else urls[name]

        if self.rest:
            urls[REST] = self.rest
        envs: dict[str, dict[str, str]] = {}
        nxt = REST if self.rest else ""
        for s in reversed(self.manifest.slices):  # the path, the last first
            spec = specs[s.name]
            own = dict(MOPAR_NEXT="")  # a called function hands on nothing
            if not spec.answers:
                calls = ",".join(address(x.slice) for x in spec.calls)
                warm = ",".join(
                    address(f) for f, _ in (spec.dispatch.warm if spec.dispatch else ())
                )
                own = dict(
                    MOPAR_NEXT=self._next_of(nxt, urls),
                    MOPAR_CALLS=calls,
                    MOPAR_WARM=warm,
                    # none where the runner serves the functions in turn (not all are here)
                    MOPAR_PREWARM=",".join(address(f) for f in spec.prewarms)
                    if self.config.prewarm and set(spec.prewarms) <= set(ports)
                    else "",
                )
                nxt = s.name
            envs[s.name] = dict(
                PORT=str(ports[s.name]),
                MOPAR_HOST="127.0.0.1",
                MOPAR_TRANSPORT=self._transport_of(spec),
                REDIS_URL=self.redis_url,
                MOPAR_SHM_DIR=self.shm_dir,
                MOPAR_THREADS=str(threads),
                MOPAR_TIMEOUT_S=str(self._wait_s(after.get(s.name, 0))),
                MOPAR_INTRA_OP=str(self.config.intra_op_threads),
                MOPAR_CHAIN=self.entry.mode.name,
                MOPAR_LOCAL_FUNCTIONS=json.dumps(urls),
                MOPAR_LAZY_INIT="1" if self.lazy else "",
                MOPAR_PAYLOAD_LIMITS="off" if self.config.redis_stand_in else "",
                **own,
            )
        try:
            for s in self.manifest.slices:  # all spawned, then each waited for
                started[s.name] = self._launch(s, envs[s.name])
                if self.config.start_one_at_a_time:
                    started[s.name].wait_ready()
        finally:
            self.servers = [started[s.name] for s in self.manifest.slices if s.name in started]
        self.clients = [
            HttpClient(urls[n], timeout_s=self._wait_s(len(route) - k)) for k, n in enumerate(route)
        ]
        self.client = self.clients[0]
        first = next(specs[s.name] for s in self.manifest.slices if not specs[s.name].answers)
        self.sent = tuple(t.name for t in first.receives)  # a model input no layer reads is not
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every function's process is ready.

        Raises:
            RuntimeFailure: one did not start (named, with its last line of stderr).
        """
        for server in self.servers:
            server.wait_ready()

    def _transport_of(self, spec: FunctionSpec) -> str:
        """``MOPAR_TRANSPORT`` of the function of ``spec``: the run's transport, or none (as
        planned); a cut planned through Redis goes inline (``http``) where Redis stands in."""
        if self.transport != AS_PLANNED:
            return self.transport
        stored = handing_on(spec.transport or "").needs_redis
        return "http" if stored and self.config.redis_stand_in else ""

    def _next_of(self, name: str, urls: dict[str, str]) -> str:
        """``MOPAR_NEXT`` of the function before ``name`` (empty: none): its URL, its queue's,
        or (a Lambda function) its name; none where the runner calls each in turn."""
        if not name or not self.mode.hands_on:
            return ""
        if self.entry.events:
            return name
        if self.platform is not None:
            return self.platform.url_of(name)
        return urls[name]

    def _reserve(self, names: list[str]) -> dict[str, int]:
        """Each function's port: a socket bound here, which its server inherits at launch."""
        for name in names:
            self._bound[name] = listening_socket()
        return {name: self._bound[name].getsockname()[1] for name in names}

    def _launch(self, s, env: dict[str, str]) -> ServerProcess:
        """Start slice ``s``'s process (its target's entry for the mode: the function server,
        or a Lambda handler behind the Invoke API) with the ``MOPAR_*`` settings ``env``."""
        # a bundle is data here: the installed mopar serves it, never the code it ships
        cmd = [sys.executable, "-m", self.entry.module]
        env = dict(
            os.environ,
            MOPAR_FUNCTION_DIR=str(self.manifest.function_dir(s)),
            PYTHONUNBUFFERED="1",
            **env,
        )
        env.setdefault("MALLOC_ARENA_MAX", "1")  # as the function images set it
        sock = self._bound.pop(s.name)
        return ServerProcess(cmd, env, s.name, self.config.timeout_s, wait=False, sock=sock)

    def _wait_s(self, after: int) -> float:
        """How long a hop with ``after`` slices after it on the path waits for its answer."""
        return self.config.timeout_s + HOP_GRACE_S * after

    def stop(self) -> None:
        for server in self.servers:  # all asked at once, then each waited for
            server.terminate()
        for server in self.servers:
            server.stop()
        if self.platform is not None:
            self.platform.close()
        for sock in self._bound.values():  # of servers never launched
            sock.close()
        self._bound.clear()
        self._own.close()

    def serve(self, inputs, *, requests, concurrency, expected, measure) -> None:
        frame = encode_frame({n: inputs[n] for n in self.sent})
        if measure and not self.window[0]:
            self.window[0] = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for _ in pool.map(lambda _: self._one(frame, expected, measure), range(requests)):
                pass

    def serve_open(
        self, inputs, *, rate: float, duration_s: float, expected, seed: int = 0
    ) -> None:
        """An open loop of Poisson arrivals (see `mopar.runner.shm_session`): each request is sent
        when due, on a thread of its own, its latency counted from then; arrivals while
        ``max_in_flight`` requests are in flight are refused (throttled) and counted as errors."""
        frame = encode_frame({n: inputs[n] for n in self.sent})
        in_flight = threading.BoundedSemaphore(self.config.max_in_flight)
        t0 = self.window[0] = time.perf_counter()

        def one(due: float) -> None:
            try:
                ms = self._one(frame, expected, True, due=due)
            finally:
                in_flight.release()
            with self._lock:
                self.records.append((due - t0, ms))

        with ThreadPoolExecutor(max_workers=self.config.max_in_flight) as pool:
            futures = []
            for at in poisson_arrivals(rate, duration_s, seed):
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                if not in_flight.acquire(blocking=False):
                    with self._lock:
                        self.errors.append(
                            f"throttled: {self.config.max_in_flight} requests "
                            "in flight (--max-in-flight)"
                        )
                        self.records.append((at, None))
                    continue
                futures.append(pool.submit(one, t0 + at))
            for f in futures:
                f.result()  # a dead server ends the run here
        self.window[1] = time.perf_counter()

    def _one(self, frame: bytes, expected, measure: bool, due: float | None = None) -> float | None:
        """One request; its latency in ms (None: it failed), counted from ``due`` if given."""
        t0 = time.perf_counter() if due is None else due
        try:
            answer = self._request(frame)
        except HopError as exc:
            if lost := self._dead_server_check(t0):
                return self._error(lost, measure)
            raise RuntimeFailure(
                self._timed_out(str(exc)) if exc.status == 504 else str(exc)
            ) from None
        ms = (time.perf_counter() - t0) * 1e3
        if answer.status != 200:
            if answer.status >= 500:  # a dead server or a timeout ends the run
                if lost := self._dead_server_check(t0):
                    return self._error(lost, measure)
                if answer.status == 504:
                    raise RuntimeFailure(self._timed_out(answer.error()))
            return self._error(f"HTTP {answer.status}: {answer.error()}", measure)
        got = decode_payloads(split_frame(answer.body))
        err = (
            compare_outputs(got, expected, self.config.tolerance) if expected is not None else None
        )
        with self._lock:
            if measure:
                if not self.latencies and self.cold is not None:
                    self.cold["first_request_ms"] = round(ms, 3)
                self.latencies.append(ms)
                for item in answer.headers.get("x-mopar-timing", "").split(","):
                    name, _, value = item.partition("=")
                    if name in self.slice_ms:
                        self.slice_ms[name].append(float(value))
                self.served.append(
                    Served(
                        arrival_s=t0 - (self.window[0] or t0),
                        latency_ms=ms,
                        invocations=tuple(parse_spans(answer.headers.get("x-mopar-invocations"))),
                    )
                )
            if err is not None:
                self.comparison = self.comparison.merge(err)
        return ms

    def request(self, frame: bytes) -> Response:
        """One request, not measured (``mopar serve``, ``mopar invoke``): its answer; a 4xx or
        a slice's 500 as it came.

        Raises:
            RuntimeFailure: a function server died, or a slice did not answer in time (named).
        """
        try:
            answer = self._request(frame)
        except HopError as exc:
            self._dead_server_check(0.0)
            raise RuntimeFailure(
                self._timed_out(str(exc)) if exc.status == 504 else str(exc)
            ) from None
        if answer.status >= 500:
            self._dead_server_check(0.0)
        return answer

    def _request(self, frame: bytes) -> Response:
        """Send one request the chain mode's way; its answer as an HTTP answer would be.

        Raises:
            HopError: the entry is unreachable, or the answer did not come in time.
        """
        if self.entry.events and not self.mode.rendezvous:
            return self._request_lambdas(frame)
        if not self.mode.hands_on:  # the runner is the state machine
            timing, spans = [], []
            for client in self.clients:
                answer = client.post(frame, {})
                if answer.status != 200:
                    return answer
                frame = answer.body
                timing.append(answer.headers.get("x-mopar-timing", ""))
                spans.append(answer.headers.get("x-mopar-invocations", ""))
            return Response(
                200,
                {"x-mopar-timing": ",".join(timing), "x-mopar-invocations": ",".join(spans)},
                frame,
            )
        if not self.mode.rendezvous:
            return self.client.post(frame, {})
        rid = uuid.uuid4().hex
        if self.platform is not None:
            platform = self.platform
            try:
                headers = {"X-Callback-Url": platform.expect(rid), REQUEST_HEADER: rid}
                answer = self.client.post(frame, headers)
                queued = answer.status == 202 or answer.json().get("delivered") is True
                if not queued:  # an error, answered at once
                    return answer
                got = self._await(lambda t: platform.wait(rid, t))
            finally:
                platform.forget(rid)
        else:
            event = {"mopar": 1, **frame_event(frame, None), "async": True}
            answer = self.client.post(json.dumps({**event, "request": rid}).encode(), {})
            accepted = answer.json()
            if "error" in accepted or "errorMessage" in accepted:
                return Response(
                    int(accepted.get("status", 500)),
                    {},
                    json.dumps(
                        {"error": accepted.get("error") or accepted["errorMessage"]}
                    ).encode(),
                )
            got = self._await(lambda t: self.rendezvous.wait(rid, t))
        headers = {"x-mopar-timing": got.timing, "x-mopar-invocations": got.spans}
        if got.status != 200:
            return Response(got.status, headers, json.dumps({"error": got.error}).encode())
        return Response(200, headers, got.frame)

    def _request_lambdas(self, frame: bytes) -> Response:
        """A synchronous chain of Lambda handlers: the entry's answer is the chain's
        (``invoke``), or the runner, as the state machine, invokes each with the answer before
        (``stepfunctions``: it names the function it came ``from``, so its spans ride on)."""
        event: dict = {"mopar": 1, **frame_event(frame, None)}
        for client in self.clients if not self.mode.hands_on else self.clients[:1]:
            status, event = post_event(client, event)
            if status != 200:
                return Response(status, {}, json.dumps(event).encode())
        headers = {
            "x-mopar-timing": str(event.get("timing", "")),
            "x-mopar-invocations": str(event.get("invocations", "")),
        }
        # an answer over the payload limit waits in the store
        store = RedisStore(self.redis_url) if "ref" in event else None
        return Response(200, headers, event_frame(event, store))

    def _await(self, wait) -> Answer:
        """The answer ``wait(timeout_s)`` brings, checking the functions are alive meanwhile.

        Raises:
            HopError: (504) it did not come within the chain's time.
        """
        deadline = time.monotonic() + self._wait_s(len(self.clients))
        while time.monotonic() < deadline:
            got = wait(min(0.5, max(0.01, deadline - time.monotonic())))
            if got is not None:
                return got
            self._dead_server_check(0.0)
            if self.platform is not None and self.platform.failures:
                raise HopError(f"a queued call failed: {self.platform.failures[-1]}")
        raise HopError(
            f"no answer reached the rendezvous within {self._wait_s(len(self.clients)):g} s",
            status=504,
        )

    def _error(self, message: str, measure: bool) -> None:
        with self._lock:
            (self.errors if measure else self.warmup_errors).append(message)

    def _dead_server_check(self, since: float) -> str | None:
        """A failed request's check of the servers: a dead one ends the run (a runner that can
        replace it returns what the request lost instead; ``since``: when the request began)."""
        for server in self.servers:
            code = server.proc.poll()
            if code is not None and code < 0:
                raise RuntimeFailure(
                    f"the function server of slice {server.name} was killed by "
                    f"signal {-code} ({signal.strsignal(-code)}); the system "
                    "log (dmesg) says why, e.g. the out-of-memory killer"
                )
            if code is not None:
                tail = next((x for x in reversed(server.stderr_tail) if x.strip()), "no output")
                raise RuntimeFailure(
                    f"the function server of slice {server.name} exited with code {code}: {tail}"
                )
        return None

    def _timed_out(self, message: str) -> str:
        """A hop's timeout ``message`` told as the slice it waited for: the server it names last
        (the innermost hop; none named: the first, which the runner itself waits for)."""
        name = max(self.servers, key=lambda s: message.rfind(s.url)).name
        return (
            f"slice {name} did not answer within {self.config.timeout_s:g} s; raise --timeout "
            "or check the slice's memory and CPU"
        )

    def report(self, *, checked: bool) -> RunReport:
        slices = tuple(
            SliceStats(
                name=s.name,
                peak_rss_mb=round(peak_rss_mb(srv.proc.pid), 1),
                allocated_mb=s.memory_mb,
                p50_ms=pct(self.slice_ms[s.name], 50),
                p95_ms=pct(self.slice_ms[s.name], 95),
                load_ms=round(srv.load_ms, 1),
                calls=len(self.slice_ms[s.name]),
            )
            for s, srv in zip(self.manifest.slices, self.servers)
        )
        return RunReport(
            slices=slices,
            latency_p50_ms=pct(self.latencies, 50),
            latency_p95_ms=pct(self.latencies, 95),
            latency_p99_ms=pct(self.latencies, 99),
            requests=len(self.latencies) + len(self.errors),
            errors=len(self.errors),
            comparison=self.comparison if checked else None,
            tolerance=self.config.tolerance,
            error_messages=tuple((self.warmup_errors + self.errors)[:5]),
            transport=self.transport,
            chain=self.mode.name,
            served=tuple(self.served),
            served_by=self.entry.door,
            cold=self.cold,
            load=None
            if self.config.rate is None
            else load_summary(self.records, self.config, self.window[1] - self.window[0]),
        )
