"""Where an asynchronous chain's answer waits for whoever reads it. torch-free.

Read in this order: `Answer` (what the last function delivers: the model outputs, or the error
that ended the request, with every function's timing and spans), `RedisRendezvous` (Lambda's
``event`` mode: a Redis list per request), then `post_answer` and `answer_of` (OpenFaaS's
``callback`` mode: an HTTP POST to the callback URL, and how its receiver reads it).

A request's rendezvous is named by its request id (`mopar.runtime.chains.REQUEST_ID_RE`), which
the entry function makes (or the client chooses) and every hand-off carries on. Each answer is
delivered once; a failed function delivers its error, so a reader never waits out its timeout
for a request that already failed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields
from typing import cast

from mopar.runtime.transports.http import HopError, HttpClient
from mopar.runtime.transports.redis import RedisClient

__all__ = [
    "Answer",
    "ANSWER_PREFIX",
    "REQUEST_HEADER",
    "STATUS_HEADER",
    "RedisRendezvous",
    "Waiters",
    "answer_of",
    "post_answer",
]

ANSWER_PREFIX = "mopar:answer:"
"""The Redis key of a request's answer: this prefix and its request id."""
REQUEST_HEADER = "X-Mopar-Request"
STATUS_HEADER = "X-Mopar-Status"
_TIMING = "X-Mopar-Timing"
_SPANS = "X-Mopar-Invocations"


@dataclass(frozen=True, kw_only=True)
class Answer:
    """A request's answer as the rendezvous holds it.

    Attributes:
        status: 200, or the HTTP-style status of the error that ended the request.
        frame: the model outputs (a frame, `mopar.runtime.frame`) when ``status`` is 200.
        error: the error's message, else empty.
        slice: the function that delivered it.
        timing: every function's compute ms (``X-Mopar-Timing``'s form).
        spans: every function's own, wait and INIT ms (`mopar.runtime.chains.format_spans`).
    """

    status: int
    frame: bytes = b""
    error: str = ""
    slice: str = ""
    timing: str = ""
    spans: str = ""

    def to_bytes(self) -> bytes:
        """One JSON line of everything but the frame, then the frame."""
        head = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "frame"}
        return json.dumps(head).encode() + b"\n" + self.frame

    @classmethod
    def from_bytes(cls, data: bytes) -> Answer:
        """Raises ValueError: not what `to_bytes` writes."""
        head, sep, frame = bytes(data).partition(b"\n")
        try:
            meta = json.loads(head) if sep else None
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or not isinstance(meta.get("status"), int):
            raise ValueError("the rendezvous holds something that is not a mopar answer")
        texts = {k: str(meta.get(k, "")) for k in ("error", "slice", "timing", "spans")}
        return cls(status=meta["status"], frame=frame, **texts)


class RedisRendezvous(RedisClient):
    """Answers as one-element Redis lists, ``mopar:answer:<request id>``, with an expiry.

    The last function RPUSHes the answer; a reader BLPOPs it (so it waits without polling) and
    deletes the key. The expiry removes an answer nobody read.

    Args:
        url: ``redis://host:port/db`` (``REDIS_URL``; ElastiCache on AWS).
        ttl_s: how long an unread answer is kept, s.
        timeout_s: socket timeout of a delivery, s.
    """

    called = "the rendezvous redis"

    def __init__(self, url: str, *, ttl_s: float = 300.0, timeout_s: float = 10.0) -> None:
        import redis

        super().__init__(url, ttl_s=ttl_s, timeout_s=timeout_s)
        # a blocking read waits longer than any socket timeout: its own connection, none
        self._reader = redis.Redis.from_url(url, socket_connect_timeout=timeout_s)

    @staticmethod
    def key(request: str) -> str:
        return ANSWER_PREFIX + request

    def deliver(self, request: str, answer: Answer) -> None:
        """Leave ``answer`` for request ``request``'s reader.

        Raises:
            HopError: (503) Redis is unreachable.
        """

        def push() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.rpush(self.key(request), answer.to_bytes())
            pipe.pexpire(self.key(request), self.ttl_ms)
            pipe.execute()

        self._call("delivering an answer", push)

    def wait(self, request: str, timeout_s: float) -> Answer | None:
        """The answer of request ``request``, waiting up to ``timeout_s`` for it (None: it did
        not come); read once, then deleted.

        Raises:
            HopError: (503) Redis is unreachable.
            ValueError: the key holds something else.
        """
        got = self._call(
            "waiting for an answer",
            lambda: self._reader.blpop([self.key(request)], timeout=max(timeout_s, 0.01)),
        )
        if got is None:
            return None
        self._call("deleting an answer", lambda: self.client.delete(self.key(request)))
        # a client without decode_responses reads bytes; redis-py's types allow str too
        return Answer.from_bytes(cast(bytes, got[1]))


def post_answer(url: str, request: str, answer: Answer, *, timeout_s: float = 30.0) -> None:
    """POST ``answer`` to the callback ``url``: the frame as the body (an error: JSON
    ``{"error": ...}``), ``X-Mopar-Status`` its status, ``X-Mopar-Request`` the request id,
    and the timing and spans headers.

    Raises:
        HopError: the callback URL is unreachable or answered an error.
    """
    ok = answer.status == 200
    body = (
        answer.frame if ok else json.dumps({"error": answer.error, "slice": answer.slice}).encode()
    )
    headers = {
        REQUEST_HEADER: request,
        STATUS_HEADER: str(answer.status),
        _TIMING: answer.timing,
        _SPANS: answer.spans,
        "Content-Type": "application/octet-stream" if ok else "application/json",
    }
    try:
        client = HttpClient(url, timeout_s=timeout_s)
    except ValueError as exc:
        raise HopError(f"callback {exc}".replace("next hop ", ""), status=502) from None
    got = client.post(body, headers)
    if got.status >= 300:
        raise HopError(f"callback {url} answered {got.status}: {got.error()}")


def answer_of(headers: dict[str, str], body: bytes | memoryview) -> Answer:
    """The `Answer` a callback POST carries (``headers`` with lower-case names)."""
    try:
        status = int(headers.get(STATUS_HEADER.lower(), "200"))
    except ValueError:
        status = 502
    error = ""
    if status != 200:
        try:
            error = str(json.loads(bytes(body)).get("error", ""))  # json reads no memoryview
        except (ValueError, AttributeError):
            error = bytes(body[:200]).decode(errors="replace")
    return Answer(
        status=status,
        frame=bytes(body) if status == 200 else b"",
        error=error,
        timing=headers.get(_TIMING.lower(), ""),
        spans=headers.get(_SPANS.lower(), ""),
    )


class Waiters:
    """An in-process rendezvous: the requests a process waits for, by id, and their answers
    once delivered (by a POST to its callback URL)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[threading.Event, list[Answer]]] = {}

    def open(self, request: str) -> None:
        """Expect the answer of ``request`` (before it can arrive)."""
        with self._lock:
            self._slots[request] = (threading.Event(), [])

    def expects(self, request: str) -> bool:
        """Whether ``request``'s answer is expected and not yet delivered."""
        with self._lock:
            slot = self._slots.get(request)
        return slot is not None and not slot[1]

    def deliver(self, request: str, answer: Answer) -> bool:
        """Hand ``answer`` to ``request``'s waiter; False: none expects it (or it has one)."""
        with self._lock:
            slot = self._slots.get(request)
            if slot is None or slot[1]:
                return False
            slot[1].append(answer)
        slot[0].set()
        return True

    def wait(self, request: str, timeout_s: float) -> Answer | None:
        """``request``'s answer, waiting up to ``timeout_s`` (None: not yet)."""
        event, box = self._slots[request]
        return box[0] if event.wait(timeout_s) and box else None

    def close(self, request: str) -> None:
        """Stop expecting ``request``'s answer."""
        with self._lock:
            self._slots.pop(request, None)
