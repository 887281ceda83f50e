"""A bundle served one function at a time: how compile measures a model too large to serve whole.

`InTurnSession` runs each function of a synchronous chain in the process it deploys as (the
function server, or the Lambda handler behind `mopar.targets.aws_lambda.emulate`), alone: it serves every
request the run asks for, its peak RSS is read, and it is stopped before the next one starts.
The next one is fed, request by request, the frames the one before handed on: so at most one
function's process is alive, and the machine needs the memory of the largest function, not of
the plan.

Each function hands on as deployed, by its plan's transport, to a stand-in for the rest of the
chain (`_Rest`, an HTTP server on 127.0.0.1): the stand-in keeps the frame (taken out of its
store, so that nothing expires while the function after starts) and answers as the rest of the
chain would, with the model's outputs (through Redis where a Lambda answer is over the invoke
payload). A function therefore holds the answer while it passes it back, as in the chain. The
runner then hands each kept frame to the next function by the same transport
(`mopar.runtime.transports.Hop`, or a Lambda event). A request's latency is the sum of its
functions' times, each from the request's arrival at that function to its answer; the last
function's answers are checked against the expected outputs.

Requests are queued by `serve` and served when the report is asked for (`report`), all of one
function's before the next's: this keeps `mopar.runner.local.run_bundles`' interface. Only a
synchronous chain (``http``, ``shm``, ``invoke``, ``stepfunctions``) of functions that call no
others is served this way (`serves_in_turn`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from mopar.bundle.function import FunctionSpec
from mopar.config import RunConfig
from mopar.runner.bundle import BundleManifest
from mopar.runner.chain import AS_PLANNED, ChainSession, chain_mode_of, target_of
from mopar.runner.check import Comparison, compare_outputs
from mopar.runner.emulate import JSON, LoopbackServer
from mopar.runner.load import pct
from mopar.runner.processes import local_redis
from mopar.runner.report import RunReport, Served, SliceStats
from mopar.runner.worker import peak_rss_mb, trim_heap
from mopar.runtime.aws import INVOKE_LIMIT_BYTES, event_frame, frame_event, post_event
from mopar.runtime.chains import ChainMode, parse_spans
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from mopar.runtime.server import SPANS_HEADER, TIMING_HEADER
from mopar.runtime.transports import (
    HANDSHAKE_HEADER,
    REF_HEADER,
    Hop,
    HttpClient,
    Receiver,
    RedisStore,
    handing_on,
)

__all__ = ["InTurnSession", "serves_in_turn"]


def _specs(manifest: BundleManifest) -> list[FunctionSpec]:
    return [FunctionSpec.load(manifest.function_dir(s)) for s in manifest.slices]


def serves_in_turn(manifest: BundleManifest) -> bool:
    """Whether ``manifest``'s functions can be served one at a time: a synchronous chain mode
    (no rendezvous) and no function that calls others (an expert function's caller needs it
    alive)."""
    mode = chain_mode_of(manifest)
    return not mode.rendezvous and not any(s.calls or s.answers for s in _specs(manifest))


@dataclass(frozen=True)
class _Handoff:
    """A frame one function handed on, and the store it came through (empty: inline)."""

    frame: bytes
    scheme: str = ""


class _Rest:
    """The rest of the chain, as the function served alone hands on to it: an HTTP server on
    127.0.0.1 that keeps each frame (`handed`, in arrival order) and answers with ``answer``
    (the model's outputs as a frame), as a function server (``lambdas`` False) or a Lambda
    function behind the Invoke API would."""

    def __init__(
        self, *, lambdas: bool, answer: bytes, receiver: Receiver, store: RedisStore | None
    ):
        self.handed: list[_Handoff] = []
        self._lock = threading.Lock()

        def handle(_path: str, headers: dict[str, str], body: bytes):
            if lambdas:
                return 200, self._lambda(json.loads(body), answer, store), JSON
            return self._server(headers, body, answer, receiver)

        self._http = LoopbackServer(handle)
        self.url = self._http.url + "/"

    def _keep(self, handoff: _Handoff) -> None:
        with self._lock:
            self.handed.append(handoff)

    def _server(
        self, headers: dict[str, str], body: bytes, answer: bytes, receiver: Receiver
    ) -> tuple[int, bytes, dict[str, str]]:
        handshake = headers.get(HANDSHAKE_HEADER.lower())
        if handshake:  # a colocated transport checks the folder is shared first
            return 200, json.dumps({"shm": receiver.handshake(handshake)}).encode(), JSON
        ref = headers.get(REF_HEADER.lower(), "")
        self._keep(_Handoff(receiver.frame(body, ref), ref.partition(":")[0] if ref else ""))
        spans = {TIMING_HEADER: "", SPANS_HEADER: ""}
        return 200, answer, {"Content-Type": "application/octet-stream", **spans}

    def _lambda(self, event: dict, answer: bytes, store: RedisStore | None) -> bytes:
        self._keep(_event_handoff(event, store))
        return json.dumps(
            {
                "mopar": 1,
                "from": "",
                **frame_event(answer, store, limit=INVOKE_LIMIT_BYTES if store else None),
                "timing": "",
                "invocations": "",
            }
        ).encode()

    def close(self) -> None:
        self._http.close()


_ANSWERED = _Handoff(b"")
"""In place of a request's answer once it was checked: the answers are not kept."""


def _event_handoff(event: dict, store: RedisStore | None) -> _Handoff:
    """The frame a Lambda event or answer carries, taken out of its store."""
    return _Handoff(event_frame(event, store), "redis" if "ref" in event else "")


class InTurnSession:
    """``manifest``'s functions served one at a time (see the module docstring); the
    interface of `mopar.runner.chain.ChainSession`, for `mopar.runner.local.run_bundles`."""

    def __init__(
        self, manifest: BundleManifest, config: RunConfig, *, redis_url: str, shm_dir: str
    ) -> None:
        if config.rate is not None:
            raise ValueError("an open loop cannot be served one function at a time")
        self.manifest = manifest
        self.config = config
        self.redis_url = redis_url
        self.shm_dir = shm_dir
        self.mode: ChainMode = chain_mode_of(manifest)
        # each function in the process it deploys as: its target's entry
        self.entry = target_of(manifest).entry(self.mode, deployed=True)
        self.specs = _specs(manifest)
        self._queued: list[bool] = []  # each request's ``measure``, in order
        self._inputs: dict[str, np.ndarray] = {}
        self._expected: dict[str, np.ndarray] | None = None
        self._comparison = Comparison()
        self._own = contextlib.ExitStack()

    def start(self, *, wait: bool = True) -> None:
        """Nothing starts before the report: each function starts in its turn."""

    def wait_started(self) -> None:
        pass

    def stop(self) -> None:
        self._own.close()

    def serve(self, inputs, *, requests, concurrency, expected, measure) -> None:
        """Queue ``requests`` requests of ``inputs``: they are served at `report`."""
        self._inputs, self._expected = inputs, expected
        self._queued += [measure] * requests

    def _store(self) -> RedisStore | None:
        """The run's Redis: the one given, or a private one where a function stores frames."""
        stored = any(handing_on(s.transport or "").needs_redis for s in self.specs)
        states = self.entry.events and not self.mode.hands_on
        stand_in = self.config.redis_stand_in  # frames inline instead (compile, no redis-server)
        if not self.redis_url and (stored or states) and not stand_in:
            self.redis_url = self._own.enter_context(local_redis())
        return RedisStore(self.redis_url) if self.redis_url else None

    def report(self, *, checked: bool) -> RunReport:
        """Serve the queued requests, each function in its turn, and report them."""
        store = self._store()
        first = self.specs[0]
        handed: list[_Handoff | None] = [
            _Handoff(encode_frame({t.name: self._inputs[t.name] for t in first.receives}))
        ] * len(self._queued)
        calls: list[list[tuple[float, str]]] = [[] for _ in self._queued]  # (ms, spans) each
        stats, errors = [], []
        for k in range(len(self.manifest.slices)):
            handed, stat = self._turn(k, handed, store, calls, errors)
            stats.append(stat)
            trim_heap()  # the frames of this turn, back to the kernel
        latencies, served = [], []
        for i, measure in enumerate(self._queued):
            if not measure or handed[i] is None or len(calls[i]) != len(stats):
                continue
            latencies.append(sum(ms for ms, _ in calls[i]))
            served.append(
                Served(
                    arrival_s=sum(latencies[:-1]) / 1e3,
                    latency_ms=latencies[-1],
                    invocations=tuple(parse_spans(",".join(x for _, x in calls[i] if x))),
                )
            )
        measured_errors = [m for measure, m in errors if measure]
        return RunReport(
            slices=tuple(stats),
            latency_p50_ms=pct(latencies, 50),
            latency_p95_ms=pct(latencies, 95),
            latency_p99_ms=pct(latencies, 99),
            requests=len(latencies) + len(measured_errors),
            errors=len(measured_errors),
            comparison=self._comparison if checked else None,
            tolerance=self.config.tolerance,
            error_messages=tuple(m for _, m in errors[:5]),
            transport=AS_PLANNED,
            chain=self.mode.name,
            served=tuple(served),
            served_by=self.entry.door,
        )

    def _turn(
        self,
        k: int,
        handed: list[_Handoff | None],
        store: RedisStore | None,
        calls: list[list[tuple[float, str]]],
        errors: list[tuple[bool, str]],
    ) -> tuple[list[_Handoff | None], SliceStats]:
        """Function ``k``'s turn: start it, send it each request's frame ``handed`` (None: a
        request lost before it), stop it. Returns what it handed on per request (the last
        function: its answer, checked here and not kept) and its stats; each measured call's
        (ms, spans) goes on ``calls``, each failure on ``errors``."""
        s = self.manifest.slices[k]
        last = k == len(self.manifest.slices) - 1
        rest = None
        if not last and self.mode.hands_on:
            rest = _Rest(
                lambdas=self.entry.events,
                answer=encode_frame(self._expected or {}),
                receiver=Receiver(redis_url=self.redis_url, shm_dir=self.shm_dir),
                store=store,
            )
        session = ChainSession(
            replace(self.manifest, slices=(s,)),
            self.config,
            transport=AS_PLANNED,
            redis_url=self.redis_url,
            shm_dir=self.shm_dir,
            mode=self.mode,
            lambda_handlers=True,
            rest=rest.url if rest is not None else "",
        )
        own_ms: list[float] = []
        outgoing: list[_Handoff | None] = []
        try:
            session.start()
            send = self._sender(session, k, store)
            for i, measure in enumerate(self._queued):
                got = None
                if handed[i] is not None:
                    if rest is not None:
                        rest.handed.clear()
                    got, ms, own, spent, error = send(handed[i])
                    if rest is not None and not error:  # what it handed on, not what it answered
                        got = rest.handed[0] if len(rest.handed) == 1 else None
                        error = "" if got else f"handed on {len(rest.handed)} frames, not 1"
                    if error:
                        errors.append((measure, f"slice {s.name}: {error}"))
                        got = None
                    elif measure:
                        calls[i].append((ms, spent))
                        own_ms.append(own)
                if last and got is not None:
                    got = self._checked(got)
                outgoing.append(got)
            peak = peak_rss_mb(session.servers[0].proc.pid)
            load_ms = session.servers[0].load_ms
        finally:
            session.stop()
            if rest is not None:
                rest.close()
        stat = SliceStats(
            name=s.name,
            peak_rss_mb=round(peak, 1),
            allocated_mb=s.memory_mb,
            p50_ms=pct(own_ms, 50),
            p95_ms=pct(own_ms, 95),
            load_ms=round(load_ms, 1),
            calls=len(own_ms),
        )
        return outgoing, stat

    def _checked(self, answer: _Handoff) -> _Handoff:
        """An answer compared with the expected outputs, and dropped (`_ANSWERED`)."""
        if self._expected is not None:
            got = decode_payloads(split_frame(answer.frame))
            self._comparison = self._comparison.merge(
                compare_outputs(got, self._expected, self.config.tolerance)
            )
        return _ANSWERED

    def _sender(self, session: ChainSession, k: int, store: RedisStore | None):
        """``send(handoff) -> (answer's handoff, ms, own ms, spans, error)``: hand a frame to
        function ``k`` (started in ``session``) as the function before it would (the first:
        as a client would), and read its answer."""
        url = session.servers[0].url
        client = HttpClient(url, timeout_s=self.config.timeout_s)
        name = self.manifest.slices[k].name
        hops: dict[str, Hop] = {}

        def own_of(timing: str) -> float:
            mine = [v for n, _, v in (x.partition("=") for x in timing.split(",")) if n == name]
            return float(mine[0]) if mine else 0.0

        def send_lambda(h: _Handoff):
            event = {"mopar": 1, **frame_event(h.frame, store, force_ref=bool(h.scheme))}
            t0 = time.perf_counter()
            status, answer = post_event(client, event)
            ms = (time.perf_counter() - t0) * 1e3
            if status != 200:
                return None, ms, 0.0, "", answer["error"]
            timing, spent = str(answer.get("timing", "")), str(answer.get("invocations", ""))
            return _event_handoff(answer, store), ms, own_of(timing), spent, ""

        def send_server(h: _Handoff):
            t0 = time.perf_counter()
            if h.scheme:
                if h.scheme not in hops:
                    hops[h.scheme] = Hop(
                        url,
                        h.scheme,
                        redis_url=self.redis_url,
                        shm_dir=self.shm_dir,
                        timeout_s=self.config.timeout_s,
                    )
                got = hops[h.scheme].send(h.frame)
            else:
                got = client.post(h.frame, {})
            ms = (time.perf_counter() - t0) * 1e3
            if got.status != 200:
                return None, ms, 0.0, "", f"HTTP {got.status}: {got.error()}"
            timing = got.headers.get(TIMING_HEADER.lower(), "")
            spent = got.headers.get(SPANS_HEADER.lower(), "")
            return _Handoff(got.body), ms, own_of(timing), spent, ""

        return send_lambda if self.entry.events else send_server
