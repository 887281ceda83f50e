"""The Redis store: SET with an expiry under an internal key, GET then DEL by the receiver.

Works with any Redis speaking RESP (a local ``redis-server``, ElastiCache). The key is
``mopar:<uuid4>``, so concurrent requests never meet; GET and DEL run in one MULTI transaction,
so a frame is consumed exactly once, and the expiry removes what a crashed receiver never took.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from mopar.runtime.transports.http import Body, HopError, body_parts

__all__ = ["RedisClient", "RedisStore"]

_KEY_RE = re.compile(r"^mopar:[0-9a-f]{32}$")
T = TypeVar("T")


class RedisClient:
    """The Redis at ``url`` (``redis://host:port/db``): what is left there expires after
    ``ttl_s``, and a call that cannot reach it is a `HopError` (503) naming it as ``called``."""

    called = "redis"

    def __init__(self, url: str, *, ttl_s: float, timeout_s: float = 10.0) -> None:
        import redis  # the function's transport client; only functions with redis cuts need it

        self.url = url
        self.ttl_ms = int(ttl_s * 1000)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._errors as exc:
            raise HopError(
                f"{self.called} at {self.url} is unreachable while {what} ({exc}); check "
                "REDIS_URL and that the server is up",
                status=503,
            ) from None


class RedisStore(RedisClient):
    """Put and take frames in the Redis at ``url`` (``redis://host:port/db``)."""

    scheme = "redis"

    def __init__(self, url: str, *, ttl_s: float = 120.0, timeout_s: float = 10.0) -> None:
        super().__init__(url, ttl_s=ttl_s, timeout_s=timeout_s)

    def put(self, data: Body) -> str:
        parts = body_parts(data)
        # redis-py writes a large value to the socket as it is; parts must be one value first
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        key = f"mopar:{uuid.uuid4().hex}"
        self._call("storing a frame", lambda: self.client.set(key, data, px=self.ttl_ms))
        return key

    def take(self, key: str) -> bytes:
        if not _KEY_RE.match(key):
            raise ValueError(f"redis reference {key!r} is not a mopar key")

        def get_del() -> Any:
            pipe = self.client.pipeline(transaction=True)
            pipe.get(key)
            pipe.delete(key)
            return pipe.execute()[0]

        data = self._call("fetching a frame", get_del)
        if data is None:
            raise ValueError(f"redis key {key!r} does not exist: already consumed or expired")
        return data

    def discard(self, key: str) -> None:
        try:
            self.client.delete(key)
        except self._errors:
            pass  # the expiry removes it
