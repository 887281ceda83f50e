"""The function server: a WSGI app around one `SliceFunction`, served by waitress.

This is what the OpenFaaS template's ``index.py`` runs behind the of-watchdog (http mode,
``upstream_url=http://127.0.0.1:5000``), and what ``mopar run --transport http|redis`` starts,
one per slice, on 127.0.0.1. Configuration comes from the environment:

==================== ===========================================================================
MOPAR_FUNCTION_DIR   folder with ``model.onnx``, ``handler.py``, ``function.json``
                     (default: ``function/`` next to the entry script)
PORT, MOPAR_HOST     where to listen (default 5000 on 127.0.0.1; port 0 picks a free one)
MOPAR_LISTEN_FD      a bound socket inherited from the runner that spawned it: listen there
MOPAR_NEXT           the next function's URL; empty for the last slice
MOPAR_CALLS          URLs of the functions it calls (a join's sub-slices, a dispatch's expert
                     functions), comma-separated, in order (forked in parallel); a dispatch
                     whose layer's mode is ``store`` sends them their tokens through Redis
MOPAR_WARM           a dispatch's pre-warm targets: URLs of the next MoE layer's expert
                     functions, comma-separated, in the order of its ``function.json``; a
                     predicted one not predicted in the last MOPAR_WARM_KEEP_S seconds (default
                     300) is sent a warm-up, a POST with ``X-Mopar-Warm: 1`` and no body, which
                     a function answers 200 at once
MOPAR_TRANSPORT      shm, http or redis: the handoff to the next (default: the plan's choice)
REDIS_URL            redis://host:port/db, for redis handoffs (sending or receiving)
MOPAR_SHM_DIR        the shared tmpfs folder (default /dev/shm/mopar)
MOPAR_THREADS        waitress worker threads (default 4)
MOPAR_TIMEOUT_S      seconds to wait for the next function (default 60)
MOPAR_READ_TIMEOUT_S seconds a request's head and body may take to arrive (default 10, plus
                     1 s per 10 MB of the largest body the function takes)
MOPAR_MEMORY_MB      the function's memory, which sizes the connections it holds (default: its
                     container's memory limit, else the machine's)
MOPAR_INTRA_OP       onnxruntime intra-op threads (default 0: onnxruntime's choice)
MOPAR_CHAIN          the chain mode: ``http`` (default), ``callback`` or ``shm``
                     (`mopar.runtime.chains`); a Lambda mode is refused at start
MOPAR_PARENT_PID     end with this parent process: SIGTERMed when it ends, gone at once if it
                     has (a local runner that spawned the server from a thread sets it)
MOPAR_CALLBACK_BASE  ``callback``: the URL other functions reach this one at, for the answers of
                     the requests it waits for (default ``http://<MOPAR_HOST>:<PORT>``; with
                     MOPAR_CALLBACK_PORT, ``http://<this pod's IP>:<that port>``)
==================== ===========================================================================

With ``MOPAR_CHAIN=callback`` a function does not wait for the next one: ``MOPAR_NEXT`` is the
gateway's ``/async-function/<next>``, which queues the call and answers 202. A request names
where its answer goes: a client's ``X-Callback-Url``, carried on from function to function as
``X-Mopar-Callback`` (not as ``X-Callback-Url``, on which the gateway's queue-worker would POST
every intermediate acknowledgement), with ``X-Mopar-Request`` (its id), the timing and the
spans so far. A function answers 202 once the next call is queued; the last POSTs the answer
to the callback URL (`mopar.runtime.rendezvous.post_answer`), and so does a function that fails,
with its error. A client that sends no callback URL gets a synchronous facade: the function it
called waits for the answer at its own ``/_/callback/<request id>`` and answers with it.

Requests: besides a frame, a client may send the tensors the function receives as JSON, an .npy
or an .npz, and ask for its answer as JSON, .npz or .npy with ``Accept``
(`mopar.runtime.bodies`); each format's size limit is checked against ``Content-Length``
before the body is read. Functions hand frames to each other, so only the entry of a chain
reads the other formats, and only the function a client called writes them.

Answers (``http``, ``shm``): 200 with the next function's answer (the last slice: the model outputs as a frame,
or the format ``Accept`` asks for);
4xx with ``{"error": ...}`` for a request at fault (malformed body, wrong tensor, too large,
a type not served),
502/503/504 when the next hop or Redis fails, 500 when the slice itself fails. A bad request
never takes the server down. Each answer carries ``X-Mopar-Timing``: ``slice=ms`` of every slice
it went through, comma-separated, and ``X-Mopar-Invocations`` each one's own, wait and INIT ms
(`mopar.runtime.chains.format_spans`).

Connections are kept alive (HTTP/1.1; every answer has a Content-Length) and waitress is tuned for
frames of many megabytes (`create_function_server`): it reads the socket in large pieces and keeps
a body in memory up to the largest one the slice accepts (by default it spools anything over
512 KB to a temporary file), and `read_body` takes that buffer as it is instead of copying it.
Its limits follow the function (`mopar.runtime.httpd`): a body over the limit of its format is
refused from its Content-Length before it is read (`FunctionApp.body_limit`), a request must
arrive within ``MOPAR_READ_TIMEOUT_S``, and the connections it holds are sized to its memory.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from mopar.runtime import bodies, oip
from mopar.runtime.chains import REQUEST_ID_RE, SERVER, ChainMode, SpanClock, default_mode, mode_for
from mopar.runtime.core import RequestError
from mopar.runtime.dispatch import WARM_KEEP_S, Warmer
from mopar.runtime.frame import decode_payloads, split_frame
from mopar.runtime.framed import SliceFunction
from mopar.runtime.generate import MainFunction
from mopar.runtime.httpd import REASONS, create_function_server, inherited_socket, too_large
from mopar.runtime.rendezvous import REQUEST_HEADER, Answer, Waiters, answer_of, post_answer
from mopar.runtime.transports import (
    HANDSHAKE_HEADER,
    REF_HEADER,
    Hop,
    HopError,
    HttpClient,
    Receiver,
    Response,
    handing_on,
    store,
)

__all__ = [
    "CALLBACK_HEADER",
    "CALLBACK_PATH",
    "CLIENT_CALLBACK_HEADER",
    "COLD_HEADER",
    "FunctionApp",
    "SPANS_HEADER",
    "main",
    "serve_ready",
    "TIMING_HEADER",
    "WARM_HEADER",
    "create_function_server",
    "read_body",
]

log = logging.getLogger("mopar.function")

TIMING_HEADER = "X-Mopar-Timing"
SPANS_HEADER = "X-Mopar-Invocations"
WARM_HEADER = "X-Mopar-Warm"
COLD_HEADER = "X-Mopar-Cold-Ms"
"""How long a call waited for its function's instance to start, ms, where the platform's
gateway tells it (`mopar.runner.gateway`, which starts functions scaled to zero)."""
CLIENT_CALLBACK_HEADER = "X-Callback-Url"
"""Where a client of a ``callback`` chain wants its answer POSTed (OpenFaaS's header)."""
CALLBACK_HEADER = "X-Mopar-Callback"
"""The same URL as one function hands it on to the next."""
CALLBACK_PATH = "/_/callback/"
"""Where a function that offers the synchronous facade receives its requests' answers."""
GENERATE_BODY_BYTES = 1 << 20
"""The largest generation request: its JSON token ids and options."""

ANSWER_BYTES = 1 << 31
"""The largest answer a function waiting for it (the facade) takes, bytes: the model's
outputs, which its own input limits do not bound."""


def _wsgi_header(name: str) -> str:
    return "HTTP_" + name.upper().replace("-", "_")


class FunctionApp:
    """The WSGI application of one function.

    Args:
        function: the slice to run.
        hop: the handoff to the next function, or None for the last slice.
        receiver: resolves ``X-Mopar-Ref`` bodies and shm handshakes.
        calls: hops to the functions it calls, in order (forked side by side).
        warm: a dispatch's pre-warm targets, by function name (`Warmer` picks the cold ones).
        mode: the chain mode (default: OpenFaaS's, ``http``).
        init_ms: how long the function took to start (its INIT), reported with its first request.
        callback_base: ``callback``: the URL this function is reached at, for the answers of the
            requests it waits for (the facade); `main` sets it once it listens.
        timeout_s: how long the facade waits for an answer, s.
    """

    def __init__(
        self,
        function: SliceFunction,
        hop: Hop | None,
        receiver: Receiver,
        calls: tuple[Hop, ...] = (),
        warm: dict[str, HttpClient] | None = None,
        warmer: Warmer | None = None,
        *,
        mode: ChainMode | None = None,
        init_ms: float = 0.0,
        callback_base: str = "",
        timeout_s: float = 60.0,
    ) -> None:
        self.function = function
        self.hop = hop
        self.receiver = receiver
        self.calls = calls
        self.warm = warm or {}
        self.warmer = warmer or Warmer()
        self.mode = mode or default_mode(SERVER)
        self.callback_base = callback_base
        self.timeout_s = timeout_s
        self._init_ms = init_ms
        self._lock = threading.Lock()
        self._waiters = Waiters()
        # a stand-in function (``mopar bench --hops``' sink) has no receives: it takes frames
        self.receives = tuple(getattr(function.spec, "receives", ()))
        self.limits = bodies.Limits.of(self.receives, frame_bytes=function.spec.max_body_bytes())
        self.max_body = self.limits.largest  # what the server must be ready to buffer
        self._pool = ThreadPoolExecutor(max_workers=max(len(calls), 1) * 4) if calls else None
        self._warm_pool = ThreadPoolExecutor(max_workers=2) if self.warm else None
        self._timing = threading.local()  # the called functions' timings of this request
        self.main = (  # a main function generates too
            MainFunction.of(
                function,
                self._fork if calls else None,
                self._prewarm if self.warm else None,
                cold=self._cold_waits if calls else None,
            )
            if getattr(function.spec, "generation", None) is not None
            else None
        )

    def _prewarm(self, names: list[str]) -> None:
        """Send the predicted functions taken to be cold a warm-up, without waiting for it."""
        assert self._warm_pool is not None  # it pre-warms: it has warm-up targets, and the pool
        for name in self.warmer.cold(names):
            if name in self.warm:
                self._warm_pool.submit(self._warm_up, name, self.warm[name])

    @staticmethod
    def _warm_up(name: str, client: HttpClient) -> None:
        try:
            client.post(b"", {WARM_HEADER: "1"}, retries=0)
        except HopError as exc:  # a warm-up is a hint: its failure fails no request
            log.info("warm-up of %s failed: %s", name, exc)

    def _cold_waits(self) -> list[float]:
        """The waits for a cold start (ms, `COLD_HEADER`) of the calls of the last `_fork` of
        this thread."""
        return getattr(self._timing, "cold", [])

    def _fork(self, names: list[str], frames: list[bytes]) -> list[bytes]:
        """Send each named called function its frame, all at once; their answers, in order.
        (A dispatch function names only the experts its tokens reached.)"""
        by_name = dict(zip(self.function.spec.callee_names, self.calls))
        hops = [by_name[n] for n in names]

        def send(name: str, hop: Hop, frame: bytes) -> Response:
            try:
                return hop.send(frame)
            except HopError as exc:
                raise HopError(f"function {name}: {exc}", status=exc.status) from None

        assert self._pool is not None  # it forks: it calls functions, and has the pool
        answers = list(self._pool.map(send, names, hops, frames))
        for name, hop, answer in zip(names, hops, answers):
            if answer.status != 200:
                raise HopError.answered(
                    f"function {name} at {hop.url}", answer.status, answer.error()
                )
        self._timing.calls = [a.headers.get(TIMING_HEADER.lower(), "") for a in answers]
        told = COLD_HEADER.lower()  # by a gateway that starts functions (`mopar generate`'s)
        self._timing.cold = [float(a.headers[told]) for a in answers if told in a.headers]
        if self._timing.req is not None:  # a frame's request: its callees' spans ride on
            self._timing.req.called += [a.headers.get(SPANS_HEADER.lower(), "") for a in answers]
        return [a.body for a in answers]

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        self._timing.req = None
        try:
            status, headers, body = self._serve(environ)
        except (RequestError, HopError) as exc:
            status, headers, body = self._error(exc.status, str(exc))
        except Exception as exc:  # the slice failed; say so, keep serving
            log.exception("slice %s failed", self.function.spec.slice)
            status, headers, body = self._error(
                500, f"slice {self.function.spec.slice} failed: {type(exc).__name__}: {exc}"
            )
        req = self._timing.req
        if status >= 400 and req is not None and req.callback:  # its client waits there
            self._deliver(req, Answer(status=status, error=json.loads(body)["error"]))
        headers = [*headers, ("Content-Length", str(len(body)))]
        start_response(f"{status} {REASONS.get(status, 'Error')}", headers)
        return [body]

    def refusal(self, environ: dict, head: bytes, size: int, limit: int) -> RequestError:
        """Why a body over its limit is refused (`mopar.runtime.httpd.Refusal`): the 400 of a
        tensor of another dtype or size, where its head shows one; else the 413."""
        return oip.refusal(environ, head, self.receives, size=size, limit=limit)

    def body_limit(self, environ: dict) -> int:
        """The largest body of the request ``environ`` describes (its method, path and
        headers), bytes: the server refuses a larger one before reading it.

        Raises:
            RequestError: (415) a type not served; (404) an answer for the facade that no
                request here waits for.
        """
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") != "POST":
            return self.limits.frame  # nothing is read: its answer says what is served
        if CALLBACK_PATH in path:
            rid = path.rsplit(CALLBACK_PATH, 1)[1].strip("/")
            if not self._waiters.expects(rid):
                raise RequestError(f"no request {rid!r} waits for its answer here", 404)
            return ANSWER_BYTES
        if environ.get(_wsgi_header(WARM_HEADER)) or environ.get(_wsgi_header(HANDSHAKE_HEADER)):
            return self.limits.frame  # answered without reading a body
        if path.startswith("/v2/"):  # the Open Inference Protocol: JSON, or JSON and binary
            return self.limits.largest
        if self._generates(environ):
            return GENERATE_BODY_BYTES
        return self.limits.of_format(bodies.request_format(environ.get("CONTENT_TYPE", "")))

    def _error(self, status: int, message: str) -> tuple[int, list, bytes]:
        body = json.dumps({"error": message, "slice": self.function.spec.slice}).encode()
        return status, [("Content-Type", "application/json")], body

    def _take_init(self) -> float:
        with self._lock:
            init, self._init_ms = self._init_ms, 0.0
        return init

    def _serve(self, environ: dict) -> tuple[int, list, bytes]:
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO", "")
        if method == "POST" and CALLBACK_PATH in path:
            return self._callback(path.rsplit(CALLBACK_PATH, 1)[1].strip("/"), environ)
        if (route := oip.route(path)) is not None:
            return self._protocol(route, method, environ)
        if method == "GET" and environ.get("PATH_INFO", "").rstrip("/").endswith("/_/health"):
            spec = self.function.spec
            health = json.dumps({"slice": spec.slice, "index": spec.index, "ready": True}).encode()
            return 200, [("Content-Type", "application/json")], health
        if method != "POST":
            raise RequestError(
                f"{method} is not served; POST a frame (application/octet-stream), JSON, "
                ".npy or .npz",
                405,
            )
        if environ.get(_wsgi_header(WARM_HEADER)):  # started, and so warm: nothing to run
            warm = json.dumps({"slice": self.function.spec.slice, "warm": True}).encode()
            return 200, [("Content-Type", "application/json")], warm
        handshake = environ.get(_wsgi_header(HANDSHAKE_HEADER))
        if handshake:
            seen = self.receiver.handshake(handshake)
            return 200, [("Content-Type", "application/json")], json.dumps({"shm": seen}).encode()
        if self._generates(environ):
            return self._generate(environ)
        req = self._timing.req = _Request(self, environ)
        answer_as = bodies.answer_format(environ.get("HTTP_ACCEPT"))  # 406 before any work
        content_type = environ.get("CONTENT_TYPE", "")
        body = read_body(environ, self.body_limit(environ))
        ref = environ.get(_wsgi_header(REF_HEADER))
        frame: bytes | memoryview
        if ref:
            try:
                frame = self.receiver.frame(body, ref)
            except ValueError as exc:
                raise RequestError(str(exc), 410 if "consumed" in str(exc) else 400) from None
        else:
            frame = bodies.request_frame(body, content_type, self.receives)
        status, headers, out = self._run(self.limits.within(frame), req)
        return self._answered_as(answer_as, status, headers, out)

    def _protocol(self, route: oip.Route, method: str, environ: dict) -> tuple[int, list, bytes]:
        """A request of the Open Inference Protocol (`mopar.runtime.oip`): the tensors this
        function receives are its inputs; the outputs it lists are none (a function knows the
        model's outputs by name alone: ``mopar serve`` lists them, from ``plan.json``)."""
        spec = self.function.spec
        inputs = [oip.Tensor.received(t) for t in self.receives]
        doc = oip.described(route, method, spec.model, inputs, ())
        if doc is not None:
            return 200, [("Content-Type", "application/json")], json.dumps(doc).encode()
        req = self._timing.req = _Request(self, environ)
        body = read_body(environ, self.body_limit(environ))
        length = environ.get("HTTP_INFERENCE_HEADER_CONTENT_LENGTH")
        infer = oip.read_infer(body, length, self.receives)
        frame = bodies.to_frame(infer.arrays, self.receives)
        status, headers, out = self._run(self.limits.within(frame), req)
        if status != 200 or ("Content-Type", bodies.Format.FRAME.media_type) not in headers:
            return status, headers, out  # an asynchronous chain's 202, or a refusal
        answer, kinds = oip.write_infer(spec.model, decode_payloads(split_frame(out)), infer)
        kept = [h for h in headers if h[0] != "Content-Type"]
        return status, [*kinds, *kept], answer

    def _generates(self, environ: dict) -> bool:
        """Whether a POST is a generation request: to a main function, at ``/generate`` or as
        JSON (a step's tensors come as frames)."""
        return self.main is not None and (
            environ.get("PATH_INFO", "").rstrip("/").endswith("/generate")
            or environ.get("CONTENT_TYPE", "").startswith("application/json")
        )

    def _generate(self, environ: dict) -> tuple[int, list, bytes]:
        """Run a generation request (`mopar.runtime.generate`) and answer its tokens as JSON."""
        body = read_body(environ, GENERATE_BODY_BYTES)
        try:
            data = json.loads(bytes(body))
        except ValueError as exc:
            raise RequestError(
                f"a generation request is JSON ({exc}); send "
                '{"input_ids": [1, 2, 3], "max_new_tokens": 16}'
            ) from None
        assert self.main is not None  # `_generates`: a main function's request
        answer = self.main.answer(data).to_dict()
        return 200, [("Content-Type", "application/json")], json.dumps(answer).encode()

    @staticmethod
    def _answered_as(
        answer_as: bodies.Format, status: int, headers: list, out: bytes
    ) -> tuple[int, list, bytes]:
        """A 200 frame answer in the format its client asked for (anything else as it is)."""
        frame_type = ("Content-Type", bodies.Format.FRAME.media_type)
        if status != 200 or answer_as is bodies.Format.FRAME or frame_type not in headers:
            return status, headers, out
        body, kind = bodies.answer_body(out, answer_as)
        return status, [("Content-Type", kind), *(h for h in headers if h != frame_type)], body

    def _run(self, frame: bytes | memoryview, req: _Request) -> tuple[int, list, bytes]:
        self._timing.calls = []
        out, ms = self.function.process(
            frame, self._fork if self.calls else None, self._prewarm if self.warm else None
        )
        own = f"{self.function.spec.slice}={ms:.3f}"
        timing = ",".join(x for x in (req.timing, *self._timing.calls, own) if x)
        frame_type = ("Content-Type", "application/octet-stream")
        if self.mode.rendezvous and not self.function.spec.answers:  # a called one answers
            return self._hand_on_async(out, timing, req)
        hop = self.hop
        if hop is None:
            return 200, [frame_type, (TIMING_HEADER, timing), (SPANS_HEADER, req.spans())], out
        answer = req.waiting(lambda: hop.send(out))
        if answer.status != 200:
            raise HopError.answered(f"next hop {hop.url}", answer.status, answer.error())
        timing = ",".join(x for x in (timing, answer.headers.get(TIMING_HEADER.lower(), "")) if x)
        spans = ",".join(x for x in (req.spans(), answer.headers.get(SPANS_HEADER.lower())) if x)
        return 200, [frame_type, (TIMING_HEADER, timing), (SPANS_HEADER, spans)], answer.body

    def _hand_on_async(self, out: bytes, timing: str, req: _Request) -> tuple[int, list, bytes]:
        """``callback``: queue the next call and answer 202; the last delivers the answer. A
        request with no callback URL waits for its answer here (the synchronous facade)."""
        name = self.function.spec.slice
        if self.hop is None:
            spans = req.spans()
            if not req.callback:  # called directly, the last answers as in a synchronous chain
                headers = [(TIMING_HEADER, timing), (SPANS_HEADER, spans)]
                return 200, [("Content-Type", "application/octet-stream"), *headers], out
            self._deliver(req, Answer(status=200, frame=out, timing=timing, spans=spans))
            body = json.dumps({"request": req.id, "delivered": True, "slice": name}).encode()
            return 200, [("Content-Type", "application/json"), (SPANS_HEADER, spans)], body
        facade = not req.callback
        callback = req.callback
        if facade:
            if not self.callback_base:
                raise HopError(
                    f"function {name} cannot wait for an answer: it has no callback URL of "
                    "its own; set MOPAR_CALLBACK_BASE, or send X-Callback-Url"
                )
            callback = f"{self.callback_base.rstrip('/')}{CALLBACK_PATH}{req.id}"
            self._waiters.open(req.id)
        try:
            sent = {
                CALLBACK_HEADER: callback,
                REQUEST_HEADER: req.id,
                TIMING_HEADER: timing,
                SPANS_HEADER: req.spans(),
            }
            queued = self.hop.send(out, sent)
            if queued.status not in (200, 202):
                raise HopError.answered(f"next hop {self.hop.url}", queued.status, queued.error())
            if not facade:
                req.callback = ""  # handed on: the next function answers the callback
                body = json.dumps({"request": req.id, "handed_on": self.hop.url}).encode()
                return 202, [("Content-Type", "application/json"), (REQUEST_HEADER, req.id)], body
            got = req.waiting(lambda: self._waiters.wait(req.id, self.timeout_s))
        finally:
            if facade:
                self._waiters.close(req.id)
        if got is None:
            raise HopError(
                f"no answer reached {name} for request {req.id} within {self.timeout_s:g} s; "
                "raise MOPAR_TIMEOUT_S or look for the function that failed",
                status=504,
            )
        if got.status != 200:
            raise HopError(got.error, status=got.status)
        spans = req.waited_in(got.spans)
        headers = [(TIMING_HEADER, got.timing), (SPANS_HEADER, spans), (REQUEST_HEADER, req.id)]
        return 200, [("Content-Type", "application/octet-stream"), *headers], got.frame

    def _deliver(self, req: _Request, answer: Answer) -> None:
        """POST ``answer`` to the request's callback URL (a failure to is logged: the caller's
        own answer still says what happened)."""
        answer = replace(
            answer,
            slice=answer.slice or self.function.spec.slice,
            timing=answer.timing or req.timing,
            spans=answer.spans or req.spans(),
        )
        try:
            post_answer(req.callback, req.id, answer, timeout_s=self.timeout_s)
        except HopError as exc:
            log.warning("could not deliver the answer of request %s: %s", req.id, exc)
        req.callback = ""

    def _callback(self, rid: str, environ: dict) -> tuple[int, list, bytes]:
        """An answer POSTed to the facade: hand it to the request waiting for it."""
        body = read_body(environ, self.body_limit(environ))
        headers = {
            k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")
        }
        if not self._waiters.deliver(rid, answer_of(headers, body)):
            raise RequestError(f"no request {rid!r} waits for its answer here", 404)
        return 200, [("Content-Type", "application/json")], b'{"received": true}'


class _Request(SpanClock):
    """One request's bookkeeping in a function: its id, where its answer goes (``callback``),
    and the timing and spans of the functions before it, then its own."""

    def __init__(self, app: FunctionApp, environ: dict) -> None:
        super().__init__(app.function.spec.slice, init_ms=app._take_init())
        self.app = app
        carried = environ.get(_wsgi_header(CALLBACK_HEADER), "")
        self.callback = carried or environ.get(_wsgi_header(CLIENT_CALLBACK_HEADER), "")
        rid = environ.get(_wsgi_header(REQUEST_HEADER), "")
        self.id = rid if REQUEST_ID_RE.match(rid) else uuid.uuid4().hex
        # a function's own hand-on carries the earlier functions' figures; a client's does not
        self.timing = environ.get(_wsgi_header(TIMING_HEADER), "") if carried else ""
        self.before = environ.get(_wsgi_header(SPANS_HEADER), "") if carried else ""


def callback_base(env: dict[str, str], host: str, port: int) -> str:
    """Where a ``callback`` function is reached for its facade's answers: ``MOPAR_CALLBACK_BASE``;
    with ``MOPAR_CALLBACK_PORT`` (behind the of-watchdog), this pod's IP and that port; else
    the address it listens on."""
    if env.get("MOPAR_CALLBACK_BASE"):
        return env["MOPAR_CALLBACK_BASE"]
    if env.get("MOPAR_CALLBACK_PORT"):
        port = int(env["MOPAR_CALLBACK_PORT"])
    elif host not in ("", "0.0.0.0", "::"):
        return f"http://{host}:{port}"
    return f"http://{socket.gethostbyname(socket.gethostname())}:{port}"


def read_body(environ: dict, max_body: int) -> bytes | memoryview:
    """The request body, of exactly its Content-Length, at most ``max_body`` bytes.

    Waitress hands the app a body it has already read whole into an `io.BytesIO`;
    ``getvalue()`` returns that buffer itself (no copy). Any other input stream is read into
    one buffer allocated up front.

    Raises:
        RequestError: 411 without a Content-Length, 413 over ``max_body``, 400 when short.
    """
    length = environ.get("CONTENT_LENGTH") or ""
    if not length.isdigit():
        raise RequestError("a Content-Length header is required", 411)
    n = int(length)
    if n > max_body:
        raise too_large(n, max_body)
    stream = environ["wsgi.input"]
    if isinstance(stream, io.BytesIO) and stream.tell() == 0:
        data = stream.getvalue()
        if len(data) == n:
            return data
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            raise RequestError(f"body ended after {got} of {n} bytes")
        got += k
    return view


def app_from_env(
    env: dict[str, str] | None = None, *, default_dir: Path | None = None
) -> FunctionApp:
    """Build the `FunctionApp` the environment describes (see the module docstring)."""
    started = time.perf_counter()
    env = dict(os.environ if env is None else env)
    mode = mode_for(env.get("MOPAR_CHAIN", ""), SERVER)  # before anything loads
    function_dir = Path(env.get("MOPAR_FUNCTION_DIR") or default_dir or "function")
    function = SliceFunction(function_dir, intra_op_threads=int(env.get("MOPAR_INTRA_OP", "0")))
    shm_dir = env.get("MOPAR_SHM_DIR", "")
    redis_url = env.get("REDIS_URL", "")
    transport = handing_on(env.get("MOPAR_TRANSPORT") or function.spec.transport)

    def hop(url: str, transport: str = transport.name) -> Hop:
        return Hop(
            url,
            transport,
            redis_url=redis_url,
            shm_dir=shm_dir,
            timeout_s=float(env.get("MOPAR_TIMEOUT_S", "60")),
        )

    # a dispatch whose layer sends its tokens through the store calls its experts through it
    dispatch = function.spec.dispatch
    calls_by = store() if dispatch is not None and dispatch.mode == "store" else transport
    if calls_by.needs_redis and not redis_url:
        raise ValueError(
            f"function {function.spec.slice} hands over through Redis but "
            "REDIS_URL is not set; set it to the store's URL"
        )

    next_url = env.get("MOPAR_NEXT", "").strip()
    if not next_url and not function.spec.last and not function.spec.answers:
        log.warning(
            "slice %s is not the last but MOPAR_NEXT is empty: answering with its outgoing frame",
            function.spec.slice,
        )
    call_urls = function.calls_named(env.get("MOPAR_CALLS", ""))
    warm = (  # a main function warms the experts it calls
        dict(zip(function.spec.callee_names, call_urls))
        if function.spec.generation is not None
        else function.warm_named(env.get("MOPAR_WARM", ""))
    )
    return FunctionApp(
        function,
        hop(next_url) if next_url else None,
        Receiver(redis_url=redis_url, shm_dir=shm_dir),
        tuple(hop(u, calls_by.name) for u in call_urls),
        warm={n: HttpClient(u, timeout_s=5.0) for n, u in warm.items()},
        warmer=Warmer(float(env.get("MOPAR_WARM_KEEP_S", WARM_KEEP_S))),
        mode=mode,
        init_ms=(time.perf_counter() - started) * 1e3,
        callback_base=env.get("MOPAR_CALLBACK_BASE", ""),
        timeout_s=float(env.get("MOPAR_TIMEOUT_S", "60")),
    )


_LIBC = ctypes.CDLL(None)  # loaded before any fork: a preexec_fn must not load libraries


def die_with_parent() -> None:
    """SIGTERM this process when its parent ends (Linux's PR_SET_PDEATHSIG), so even a
    SIGKILLed run leaves none: a local runner's preexec_fn, or `_end_with_parent`."""
    if hasattr(_LIBC, "prctl"):
        _LIBC.prctl(1, int(signal.SIGTERM))


def _end_with_parent(pid: str) -> None:
    """With ``MOPAR_PARENT_PID``: be SIGTERMed when that parent ends, and exit now if it
    already has. A runner that spawns servers from a thread of a busy process sets it rather
    than running code in the child before exec."""
    if not pid:
        return
    die_with_parent()
    if os.getppid() != int(pid):
        raise SystemExit(0)


def main(default_dir: Path | None = None) -> int:
    """Serve the function until SIGTERM/SIGINT; print one ``ready`` JSON line on stdout."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    t0 = time.perf_counter()
    _end_with_parent(os.environ.get("MOPAR_PARENT_PID", ""))
    host = os.environ.get("MOPAR_HOST", "127.0.0.1")
    try:
        app = app_from_env(default_dir=default_dir)
        server = create_function_server(
            app,
            host=host,
            port=int(os.environ.get("PORT", "5000")),
            threads=int(os.environ.get("MOPAR_THREADS", "4")),
            max_body=app.max_body,
            env=os.environ,
            sock=inherited_socket(os.environ),
        )
    except Exception as exc:  # a broken function must say why in one line, then exit
        print(f"error: {exc}", file=sys.stderr)
        return 1
    app.callback_base = callback_base(dict(os.environ), host, server.effective_port)
    return serve_ready(server, app.function.spec.slice, t0)


def serve_ready(server: Any, name: str, started: float) -> int:
    """Print function ``name``'s one ``ready`` JSON line (its port, and its ms since
    ``started``), then serve until SIGTERM/SIGINT; 0."""

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    ready = {"event": "ready", "slice": name, "port": server.effective_port}
    print(
        json.dumps({**ready, "load_ms": round((time.perf_counter() - started) * 1e3, 1)}),
        flush=True,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
