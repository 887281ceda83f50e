"""The waitress server of a function, held to limits that follow the function.

Waitress, as configured by default, lets a few clients take a server down: it holds 100
connections at most and waits 120 s for a slow one, so ~100 connections that send a head and
part of a body stop every other request; and it buffers a body whole before the application
can look at its ``Content-Length``. Here (`ServerLimits`):

* a body is refused from its ``Content-Length`` as soon as the head has arrived, against the
  limit the application gives that request (``app.body_limit(environ)``: the format's limit of
  a `mopar.runtime.server.FunctionApp`), with the application's own 413 (or 404, 415); or,
  up to `PEEK_RATIO` times the limit, once its first `PEEK_BYTES` are in, with the 400 they
  show (``app.refusal``: a tensor of another dtype or batch); a chunked body is cut off once it
  passes the limit;
* a request's head and body must arrive within ``read_timeout_s`` of its first byte, sized to
  the largest body, and a kept-alive connection with no request is closed after
  ``idle_timeout_s``;
* the connections held at once are sized so that each can buffer the largest body within a
  share of the function's memory (`function_memory_bytes`), within the open-file limit.

A refused request is answered at once; then the connection is half-closed and what its client
still sends is read and dropped for a moment (a lingering close), so that a client still
sending its body reads the answer rather than a connection reset.

Read in order: `ServerLimits`, `function_memory_bytes`, `create_function_server`, `_classes`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopar.runtime.core import RequestError

__all__ = [
    "REASONS",
    "ServerLimits",
    "create_function_server",
    "function_memory_bytes",
    "too_large",
]

log = logging.getLogger("mopar.function")

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    410: "Gone",
    411: "Length Required",
    413: "Payload Too Large",
    415: "Unsupported Media Type",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    507: "Insufficient Storage",
}
"""The reason phrase of each status a function answers."""
RECV_BYTES = 256 << 10
"""Bytes waitress asks of the socket per read (its default, 8 KB, costs a loop turn per 8 KB)."""
HEAD_BYTES = 64 << 10
"""The largest request line and headers, bytes (waitress's default: 256 KB)."""
PEEK_BYTES = 64 << 10
"""How much of a body over its size limit is read before it is refused, where the application
has a `Refusal`: enough for the headers that give its tensors' dtypes and shapes, so that a
tensor of another dtype or batch gets the 400 that names it, not the 413 of its size."""
PEEK_RATIO = 64
"""A body over `PEEK_RATIO` times its limit is refused from its ``Content-Length`` at once: a
tensor sent at up to 64x the size it should have (a batch of 64, or 32 in float64) is named by
its head; beyond that, its size says enough."""
READ_BASE_S = 10.0
"""Seconds a request's head and a small body may take to arrive."""
READ_BYTES_PER_S = 10e6
"""The slowest rate a large body is allowed to arrive at, bytes/s: it adds to `READ_BASE_S`."""
IDLE_TIMEOUT_S = 60
"""Seconds a kept-alive connection may wait for its next request (below that, it is kept for
the gateway, whose own idle timeout is longer)."""
MEMORY_SHARE = 0.25
"""The share of the function's memory its connections may fill with buffered bodies."""
FILE_RESERVE = 64
"""Open files kept free of connections: the model, logs, hand-on connections, shm files."""
LINGER_S = 2.0
"""Seconds a refused request's connection keeps reading (and dropping) what its client sends."""
LINGER_BYTES = 64 << 20
"""Bytes a refused request's connection reads and drops at most before it closes."""


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """What a function server gives its clients at most.

    Attributes:
        max_body: the largest body of any request, bytes (an application with ``body_limit``
            sets each request's own, which may be larger: the answers a facade waits for).
        read_timeout_s: a request's head and body arrive within this many seconds of its first
            byte, or its connection is closed, s.
        idle_timeout_s: a kept-alive connection with no request this long is closed, s (whole
            seconds: waitress's unit).
        connections: connections held at once; more wait in the listen backlog.
    """

    max_body: int
    read_timeout_s: float
    idle_timeout_s: int = IDLE_TIMEOUT_S
    connections: int

    @classmethod
    def sized(
        cls,
        max_body: int,
        *,
        threads: int,
        memory_bytes: int | None = None,
        read_timeout_s: float | None = None,
    ) -> ServerLimits:
        """The limits of a function whose largest body is ``max_body`` bytes.

        Args:
            threads: its worker threads: it holds at least twice as many connections.
            memory_bytes: its memory (default: `function_memory_bytes`).
            read_timeout_s: overrides the read timeout sized to ``max_body``.
        """
        memory = function_memory_bytes() if memory_bytes is None else memory_bytes
        fitting = int(memory * MEMORY_SHARE) // (max_body + HEAD_BYTES)
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        room = files - FILE_RESERVE if files != resource.RLIM_INFINITY else 1 << 16
        return cls(
            max_body=max_body,
            read_timeout_s=(
                READ_BASE_S + max_body / READ_BYTES_PER_S
                if read_timeout_s is None
                else read_timeout_s
            ),
            connections=max(2 * threads, min(fitting, room)),
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str], max_body: int, *, threads: int) -> ServerLimits:
        """`sized`, with ``MOPAR_MEMORY_MB`` and ``MOPAR_READ_TIMEOUT_S`` from ``env``.

        Raises:
            ValueError: either is not a positive finite number.
        """
        memory_mb = _positive(env, "MOPAR_MEMORY_MB")
        return cls.sized(
            max_body,
            threads=threads,
            memory_bytes=None if memory_mb is None else int(memory_mb * (1 << 20)),
            read_timeout_s=_positive(env, "MOPAR_READ_TIMEOUT_S"),
        )


def _positive(env: Mapping[str, str], name: str) -> float | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={text!r} is not a positive number; set it to one, or unset it")
    return value


_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def function_memory_bytes() -> int:
    """The memory this function may use, bytes: its container's limit (OpenFaaS sets it to the
    function's ``limits.memory``), else the machine's."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < machine:
            return int(text)
    return machine


def too_large(n: int, limit: int) -> RequestError:
    """The 413 of a body of ``n`` bytes over ``limit``."""
    return RequestError(
        f"body of {n} bytes exceeds the {limit} bytes this slice can receive (its input "
        "tensors, encoded)",
        413,
    )


LISTEN_FD = "MOPAR_LISTEN_FD"
"""The variable naming a listening socket the server inherits from the process that spawned
it, which bound it: no port is chosen, freed and bound again, so none can be taken between."""


def inherited_socket(env: Mapping[str, str]) -> socket.socket | None:
    """The listening socket ``env``'s ``MOPAR_LISTEN_FD`` names, or None where it names none."""
    fd = env.get(LISTEN_FD, "")
    return socket.socket(fileno=int(fd)) if fd else None


def create_function_server(
    app: Callable,
    *,
    host: str,
    port: int,
    threads: int,
    max_body: int,
    env: Mapping[str, str] | None = None,
    sock: socket.socket | None = None,
) -> Any:
    """The waitress server of a function: what `mopar.runtime.server.main` serves, what
    ``mopar serve`` and the Lambda emulation serve, and what ``mopar bench --hops`` times, held
    to the `ServerLimits` that follow the function.

    Args:
        app: the WSGI application. It may have ``body_limit(environ) -> int``: the largest body
            of the request whose method, path and headers ``environ`` holds (WSGI keys),
            raising `RequestError` to refuse it before its body is read; without it, every
            request's limit is ``max_body``. It may have a `Refusal`: a body over its limit is
            then read as far as `PEEK_BYTES`, and refused as that says.
        host, port: where to listen (port 0: a free one; see ``effective_port``).
        threads: worker threads.
        max_body: the largest body the app accepts, bytes (of any format:
            `mopar.runtime.server.FunctionApp.max_body`).
        env: ``MOPAR_MEMORY_MB`` and ``MOPAR_READ_TIMEOUT_S`` (`ServerLimits.from_env`).
        sock: a bound socket to listen on instead (`inherited_socket`).
    """
    from waitress import create_server as waitress_server

    limits = ServerLimits.from_env(env or {}, max_body, threads=threads)

    # Bodies up to the largest body, and answers a little larger, stay in memory: a function
    # holds its frames in memory anyway, and spooling to a temporary file costs a write and a
    # read of every byte. Waitress's own body limit is left to the parser, which knows each
    # request's.
    where = dict(sockets=[sock]) if sock is not None else dict(host=host, port=port)
    server = waitress_server(
        app,
        **where,
        threads=threads,
        ident="mopar",
        max_request_header_size=HEAD_BYTES,
        max_request_body_size=1 << 62,
        inbuf_overflow=limits.max_body,
        outbuf_overflow=limits.max_body + limits.max_body // 4 + (1 << 20),
        recv_bytes=RECV_BYTES,
        connection_limit=limits.connections,
        channel_timeout=limits.idle_timeout_s,
        cleanup_interval=1,
        asyncore_use_poll=True,  # select() cannot watch a descriptor past 1023
    )
    server.channel_class = _classes(
        getattr(app, "body_limit", None), getattr(app, "refusal", None), limits
    )
    return server


Refusal = Callable[[dict, bytes, int, int], RequestError]
"""An application's ``refusal(environ, head, size, limit)``: why a body of ``size`` bytes over
its ``limit`` is refused, from its first `PEEK_BYTES` (or all of it, if shorter)."""


def _classes(
    body_limit: Callable[[dict], int] | None, refusal: Refusal | None, limits: ServerLimits
) -> type:
    """Waitress's connection class, held to ``limits``, and answering what it refuses as the
    app answers: one line of JSON, ``{"error": ...}``, not waitress's text page."""
    from waitress.channel import HTTPChannel
    from waitress.parser import HTTPRequestParser
    from waitress.task import ErrorTask
    from waitress.utilities import Error

    class Refused(Error):
        """A request the application refused from its head: its own status and words."""

        def __init__(self, exc: RequestError) -> None:
            super().__init__(str(exc))
            self.code = exc.status
            self.reason = REASONS.get(exc.status, "Error")

    class Parser(HTTPRequestParser):
        error: Error | None  # waitress's own: what ends the request, set by it or by us
        completed: bool  # waitress's own: the request (and its body) is in

        def __init__(self, adj: Any) -> None:
            super().__init__(adj)
            self.started = time.monotonic()
            self.limit = limits.max_body
            self.over = 0  # > 0: the limit its body is over, refused once its head is in

        def received(self, data: bytes) -> int:
            heading = not self.headers_finished
            n = super().received(data)
            if self.error is not None or self.empty:
                return n
            try:
                if heading and self.headers_finished:
                    self.limit = body_limit(self._environ()) if body_limit else limits.max_body
                    if self.content_length > self.limit:
                        if refusal is None or self.content_length > PEEK_RATIO * self.limit:
                            raise too_large(self.content_length, self.limit)
                        self.over = self.limit  # its head is read first, to say why
                if self.over and refusal is not None and self.body_rcv is not None:
                    buf = self.body_rcv.getbuf()
                    if self.completed or len(buf) >= PEEK_BYTES:
                        head = buf.get(PEEK_BYTES)
                        raise refusal(self._environ(), head, self.content_length, self.over)
                if self.chunked and self.body_rcv is not None:
                    # framing aside, a chunked body is cut off once it passes its limit
                    if len(self.body_rcv) > self.limit:
                        raise too_large(len(self.body_rcv), self.limit)
                    if self.body_bytes_received > 2 * self.limit + HEAD_BYTES:
                        raise RequestError("chunked body has more framing than data", 400)
            except RequestError as exc:
                self.error = Refused(exc)
                self.completed = True
                self.expect_continue = False  # no 100 Continue: the body is not wanted
            return n

        def _environ(self) -> dict:
            environ = {
                "REQUEST_METHOD": self.command,
                "PATH_INFO": self.path,
                "CONTENT_TYPE": self.headers.get("CONTENT_TYPE", ""),
                "CONTENT_LENGTH": self.headers.get("CONTENT_LENGTH", ""),
            }
            for key, value in self.headers.items():
                if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                    environ["HTTP_" + key] = value
            return environ

    class JsonErrorTask(ErrorTask):
        def execute(self) -> None:
            e = self.request.error
            said = e.body if isinstance(e, Refused) else f"{e.reason.lower()}: {e.body}"
            body = json.dumps({"error": said}).encode()
            self.status = f"{e.code} {e.reason}"
            self.response_headers.append(("Content-Type", "application/json"))
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)
            self.channel.refused = True

    class LimitedChannel(HTTPChannel):
        parser_class = Parser
        error_task_class = JsonErrorTask
        refused = False  # it answered an error: close it lingering
        lingering_until = 0.0  # > 0: half-closed, dropping what its client still sends
        dropped = 0

        def readable(self) -> bool:
            now = time.monotonic()
            if self.lingering_until:
                if now > self.lingering_until:
                    HTTPChannel.handle_close(self)
                    return False
                return True
            request = self.request  # one being received (not one being served)
            late = request is not None and now - request.started > limits.read_timeout_s
            if late and not self.requests:
                log.debug(  # debug: a slow client's every connection would be a line
                    "closed a connection from %s: its request did not arrive within %g s",
                    self.addr,
                    limits.read_timeout_s,
                )
                self.will_close = True
                return False
            return super().readable()

        def writable(self) -> bool:
            return not self.lingering_until and super().writable()

        def handle_read(self) -> None:
            if not self.lingering_until:
                return super().handle_read()
            try:
                self.dropped += len(self.recv(RECV_BYTES))  # b"" at its end: closed there
            except OSError:
                HTTPChannel.handle_close(self)
                return
            if self.dropped > LINGER_BYTES and self.connected:
                HTTPChannel.handle_close(self)

        def handle_close(self) -> None:
            if self.lingering_until or not self.refused or not self.connected:
                return super().handle_close()
            try:
                self.socket.shutdown(socket.SHUT_WR)
            except OSError:
                return super().handle_close()
            self.will_close = self.close_when_flushed = False
            self.lingering_until = time.monotonic() + LINGER_S

    return LimitedChannel
