"""A small HTTP client for function-to-function POSTs: keep-alive, timeouts, bounded retries.

The standard library's `http.client`, one connection per thread and next hop, so functions need
no HTTP package of their own. Only connection errors are retried (refused, reset, or a kept-alive
connection the server had closed); a timeout or an answer, whatever its status, is final.

A body is one bytes-like object or a sequence of them (`Body`): parts are written to the socket
one after the other, never joined, so a tensor's payload (`mopar.runtime.wire.encode_parts`) is
sent straight from the array's memory. `http.client` sets TCP_NODELAY on its sockets, so the
header and a small body never wait on Nagle's algorithm.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

__all__ = ["Body", "HttpClient", "HopError", "Response", "body_parts"]

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
Body = Buffer | Sequence[Buffer]
"""A request body: one bytes-like object, or parts whose concatenation is the body."""
_RETRYABLE = (
    ConnectionRefusedError,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
    http.client.RemoteDisconnected,
    http.client.CannotSendRequest,
)


class HopError(RuntimeError):
    """The next function (or the store between) could not be reached; an HTTP 502/504 (503:
    Redis is unreachable, 507: the shm folder is full)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status

    @classmethod
    def answered(cls, who: str, status: int, error: str) -> HopError:
        """``who`` (the next hop, a called function) answered ``status`` with ``error``: a
        failed hop of that status when it is a 5xx, else of 502 (the request was handed on
        well formed, so its 4xx is no fault of the caller's)."""
        return cls(f"{who} answered {status}: {error}", status=status if status >= 500 else 502)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        try:
            value = json.loads(self.body)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def error(self) -> str:
        """The message of an error answer (its JSON ``error``, else the start of the body)."""
        return str(self.json().get("error") or self.body[:200].decode(errors="replace"))


class HttpClient:
    """POST to one URL, reusing a connection per thread.

    Args:
        url: ``http://host:port/path``.
        timeout_s: socket timeout for connecting and for the answer.
        retries: connection attempts after the first; waits 0.1 s, 0.2 s, 0.4 s, ... between.
    """

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 3) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"next hop {url!r} is not an http://host[:port]/path URL")
        self.url = url
        self.host, self.port = parts.hostname, parts.port or 80
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s = timeout_s
        self.retries = retries
        self._local = threading.local()

    def post(self, body: Body, headers: dict[str, str], *, retries: int | None = None) -> Response:
        """POST ``body``; retry connection errors; raise `HopError` when out of attempts."""
        return self.retrying(lambda: self.post_once(body, headers), retries=retries)

    def retrying(self, attempt: Callable[[], T], *, retries: int | None = None) -> T:
        """Call ``attempt`` until it does not raise a connection error, at most 1 + retries."""
        retries = self.retries if retries is None else retries
        for k in range(retries + 1):
            try:
                return attempt()
            except _RETRYABLE as exc:
                self._drop()
                if k == retries:
                    raise HopError(
                        f"next hop {self.url} is unreachable after {retries + 1} "
                        f"attempts ({type(exc).__name__}: {exc}); check that it is "
                        "running and MOPAR_NEXT is right"
                    ) from None
                time.sleep(0.1 * 2**k)
            except TimeoutError:
                self._drop()
                raise HopError(
                    f"next hop {self.url} did not answer within {self.timeout_s:g} s; "
                    "raise MOPAR_TIMEOUT_S or give the next slice more memory/CPU",
                    status=504,
                ) from None
            except OSError as exc:  # DNS failure, no route: not worth retrying
                self._drop()
                raise HopError(f"next hop {self.url} is unreachable ({exc})") from None
        raise AssertionError("unreachable")

    def post_once(self, body: Body, headers: dict[str, str]) -> Response:
        """One POST, no retry: connection errors propagate as they are."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._local.conn = conn
        parts = body_parts(body)
        # With Content-Length given, http.client sends a list body part by part, not chunked.
        conn.request(
            "POST",
            self.path,
            body=parts,
            headers={
                "Content-Type": "application/octet-stream",
                "Accept": "application/octet-stream",  # a frame: servers answer JSON unasked
                **headers,
                "Content-Length": str(sum(len(p) for p in parts)),
            },
        )
        answer = conn.getresponse()
        data = answer.read()
        if answer.getheader("Connection", "").lower() == "close":
            self._drop()
        return Response(answer.status, {k.lower(): v for k, v in answer.getheaders()}, data)

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def body_parts(body: Body) -> list[memoryview]:
    """``body`` as a list of flat byte views (no copy), the order in which they are sent."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        body = (body,)
    return [memoryview(p).cast("B") for p in body]
