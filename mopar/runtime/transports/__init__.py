"""How a function hands its frame to the next one: ``shm``, ``http`` or ``redis``.

Read in this order: `registry` (each transport as a type, registered once and looked up by
name), `Hop` (the sending end), then `Receiver` (the receiving end), then the stores in `shm`
and `redis`.

Every transport invokes the next function with an HTTP POST (locally, through the OpenFaaS
gateway, or a Kubernetes service URL). What differs is where the frame travels:

- ``http``: the frame is the request body (``application/octet-stream``).
- ``redis``: the frame is SET under an internal key with an expiry; the body is empty and the
  header ``X-Mopar-Ref: redis:<key>`` names it; the receiver GETs and DELetes it.
- ``shm``: the frame is written atomically to a shared tmpfs folder; the header names the file,
  and the receiver reads and unlinks it. Before its first shm handoff a sender checks that its
  peer sees the same folder (a handshake file); when it does not, it falls back to ``http``.

A request never shares a key or file with another: names are random (uuid4), and each is
consumed once. The sender deletes what it stored when the hop fails.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import cast

from mopar.runtime.transports.http import Body, HopError, HttpClient, Response
from mopar.runtime.transports.redis import RedisStore
from mopar.runtime.transports.registry import (
    SharedStore,
    Store,
    Transport,
    Where,
    handing_on,
    inline,
    names,
    register,
    shared,
    store,
    transport_named,
    transports,
    unregister,
)

__all__ = [
    "Body",
    "Hop",
    "HopError",
    "HttpClient",
    "Receiver",
    "RedisStore",
    "Response",
    "REF_HEADER",
    "HANDSHAKE_HEADER",
    "Transport",
    "Where",
    "handing_on",
    "inline",
    "names",
    "register",
    "shared",
    "store",
    "transport_named",
    "transports",
    "unregister",
]

log = logging.getLogger(__name__)

REF_HEADER = "X-Mopar-Ref"
HANDSHAKE_HEADER = "X-Mopar-Handshake"


class Hop:
    """The sending end of a cut: POST a frame to ``url`` by ``transport``.

    Args:
        url: the next function's URL.
        transport: the name of a registered transport (`transport_named`).
        redis_url: the Redis to store frames in (a store in Redis only).
        shm_dir: the shared tmpfs folder (a colocated transport only).
        timeout_s: seconds to wait for the next function's answer (the whole rest of the chain).
        ttl_s: expiry of a stored frame, seconds: a crashed receiver leaks nothing for longer.

    Raises:
        ValueError: an unknown transport, or one missing its setting.
    """

    def __init__(
        self,
        url: str,
        transport: str,
        *,
        redis_url: str = "",
        shm_dir: str = "",
        timeout_s: float = 60.0,
        ttl_s: float = 120.0,
    ) -> None:
        self.url = url
        self.requested = transport_named(transport)
        self.client = HttpClient(url, timeout_s=timeout_s)
        self.store: Store | None = self.requested.sender(
            Where(redis_url=redis_url, shm_dir=shm_dir, ttl_s=ttl_s)
        )
        self._checked = not self.requested.colocated
        self._lock = threading.Lock()

    @property
    def transport(self) -> str:
        """The transport in use: the one requested, or the inline one after a failed
        handshake."""
        return (inline() if self.store is None else self.requested).name

    def send(self, frame: Body, headers: dict[str, str] | None = None) -> Response:
        """Hand ``frame`` to the next function; return its answer.

        ``frame`` may be given as parts (see `Body`): ``http`` sends them without joining them.

        Raises:
            HopError: the next function is unreachable after retries, or timed out.
        """
        if not self._checked:
            self._handshake()
        headers = dict(headers or {})
        store = self.store
        if store is None:
            return self.client.post(frame, headers)

        def attempt() -> Response:
            key = store.put(frame)
            try:
                answer = self.client.post_once(
                    b"", {**headers, REF_HEADER: f"{store.scheme}:{key}"}
                )
            except BaseException:
                store.discard(key)
                raise
            if answer.status == 410 and self.requested.colocated:
                # a replica on another node answered: it cannot see the folder; send the frame
                store.discard(key)
                return self.client.post_once(frame, headers)
            return answer

        return self.client.retrying(attempt)

    def _handshake(self) -> None:
        with self._lock:
            if self._checked:
                return
            # unchecked: the transport is colocated, and its sender's store a shared one
            store = cast(SharedStore, self.store)
            name, token = store.handshake_file(secrets.token_hex(8))
            try:
                answer = self.client.post(b"", {HANDSHAKE_HEADER: f"{name}:{token}"})
                shared = answer.status == 200 and answer.json().get("shm") is True
            finally:
                store.discard(name)
            if not shared:
                log.warning(
                    "the next function at %s does not see %s; handing over by %s",
                    self.url,
                    store.folder,
                    inline().name,
                )
                self.store = None
            self._checked = True


class Receiver:
    """The receiving end: turn a request's body or ``X-Mopar-Ref`` into the frame it names."""

    def __init__(self, *, redis_url: str = "", shm_dir: str = "") -> None:
        self.where = Where(redis_url=redis_url, shm_dir=shm_dir)
        self._stores: dict[str, Store] = {}

    def _store(self, transport: Transport) -> Store:
        if transport.name not in self._stores:
            self._stores[transport.name] = transport.receiver(self.where)
        return self._stores[transport.name]

    def frame(self, body: bytes | memoryview, ref: str | None) -> bytes | memoryview:
        """The frame of a request.

        Raises:
            ValueError: the reference is malformed, unknown or already consumed.
            HopError: the store (Redis) is unreachable.
        """
        if not ref:
            return body
        scheme, _, key = ref.partition(":")
        transport = next((t for t in transports() if t.name == scheme and not t.inline), None)
        if transport is None:
            raise ValueError(
                f"{REF_HEADER} {ref!r} names the unknown store {scheme!r}; expected "
                + " or ".join(f"{t.name}:{t.reference}" for t in transports() if not t.inline)
            )
        return self._store(transport).take(key)

    def handshake(self, value: str) -> bool:
        """Whether the handshake file named in ``value`` (``name:token``) is visible here."""
        name, _, token = value.partition(":")
        return any(
            cast(SharedStore, self._store(t)).holds(name, token)
            for t in transports()
            if t.colocated
        )
