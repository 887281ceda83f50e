"""The transports, as types: each knows its name, its sender and receiver ends, and where it may run.

Read in this order: `Transport` (what every transport says about itself), the three built-in
ones (`Shm`, `Http`, `Redis`), then the registry: `register`, `transport_named`, `names`.

A transport is registered once and looked up by name, as onnxruntime's execution providers are;
code elsewhere asks the object (``transport.colocated``, ``transport.allows(target)``) and never
compares names. Its measured link (latency, bandwidth) is a compiler-side fact, read from
``profiles/transports.json`` for every registered transport (`mopar.facts`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from mopar.runtime.transports.http import Body
from mopar.runtime.transports.redis import RedisStore
from mopar.runtime.transports.shm import ShmStore

__all__ = [
    "Host",
    "Http",
    "Redis",
    "Shm",
    "SharedStore",
    "Store",
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


class Store(Protocol):
    """Where a frame waits between two functions; ``X-Mopar-Ref: <scheme>:<key>`` names it."""

    scheme: str

    def put(self, data: Body) -> str: ...

    def take(self, key: str) -> bytes: ...

    def discard(self, key: str) -> None: ...


class SharedStore(Store, Protocol):
    """The store of a colocated transport: a folder its peer must see too, checked by a
    handshake file before the first frame (`ShmStore`)."""

    folder: Path

    def handshake_file(self, token: str) -> tuple[str, str]: ...

    def holds(self, name: str, token: str) -> bool: ...


class Host(Protocol):
    """What a transport asks of a target (`mopar.facts.Platform` is one)."""

    @property
    def colocates(self) -> bool:
        """Whether two functions can share a host folder (a tmpfs) there."""
        ...


@dataclass(frozen=True, kw_only=True)
class Where:
    """A function's settings for its transports' stores (its environment).

    Attributes:
        redis_url: the Redis frames are stored in (``REDIS_URL``; empty: none).
        shm_dir: the shared tmpfs folder (``MOPAR_SHM_DIR``; empty: the default).
        ttl_s: expiry of a stored frame, s: a crashed receiver leaks nothing for longer.
    """

    redis_url: str = ""
    shm_dir: str = ""
    ttl_s: float = 120.0


class Transport:
    """How a function hands its frame to the next one. Subclass it and `register` an instance.

    Attributes:
        name: the name a plan, ``MOPAR_TRANSPORT`` and ``--transport`` use; also the scheme of
            the ``X-Mopar-Ref`` references its store writes.
        colocated: whether sender and receiver must share a host folder: such a transport
            checks its peer first (a handshake) and falls back to the inline one, and
            ``mopar run`` serves it with its shared-memory runner.
        inline: whether the frame travels in the request body (no store), so that a platform's
            synchronous payload limit caps it; a store-less fallback for the others.
        reference: how a reference names a frame, for messages (``<key>``).
        client: the distribution a function needs for it (empty: none).
        needs_redis: whether its frames wait in the Redis at ``REDIS_URL`` (a function needs
            that setting for it, and a local run starts a private ``redis-server``).
    """

    name: ClassVar[str]
    colocated: ClassVar[bool] = False
    inline: ClassVar[bool] = False
    reference: ClassVar[str] = "<key>"
    client: ClassVar[str] = ""
    needs_redis: ClassVar[bool] = False

    def sender(self, where: Where) -> Store | None:
        """The store a sending function puts its frames in (None: in the body).

        Raises:
            ValueError: ``where`` lacks a setting this transport needs.
        """
        return None

    def receiver(self, where: Where) -> Store:
        """The store a receiving function takes the frames a reference names from.

        Raises:
            ValueError: ``where`` lacks a setting this transport needs.
        """
        raise ValueError(f"transport {self.name} hands frames over in the body, not by reference")

    def allows(self, target: Host) -> bool:
        """Whether functions on ``target`` may hand over by this transport."""
        return target.colocates or not self.colocated

    def missing(self) -> str | None:
        """Why this machine cannot run this transport (None: it can); what to install."""
        return None

    @property
    def stores(self) -> bool:
        """Whether frames wait in an external store every function reaches (neither inline nor
        in a shared folder): the one a platform falls back to above its payload limit."""
        return not self.inline and not self.colocated


class Shm(Transport):
    """A file written atomically into a tmpfs folder both functions mount (`ShmStore`)."""

    name = "shm"
    colocated = True
    reference = "<name>"

    def sender(self, where: Where) -> SharedStore:
        return ShmStore(where.shm_dir)

    def receiver(self, where: Where) -> SharedStore:
        return ShmStore(where.shm_dir, create=False)

    def missing(self) -> str | None:
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            return None
        return "/dev/shm is missing or not writable on this machine"


class Http(Transport):
    """The frame is the body of the POST to the next function."""

    name = "http"
    inline = True


class Redis(Transport):
    """SET under an internal key with an expiry, GET and DEL by the receiver (`RedisStore`)."""

    name = "redis"
    client = "redis"
    needs_redis = True

    def sender(self, where: Where) -> Store:
        if not where.redis_url:
            raise ValueError(
                "transport redis needs REDIS_URL (redis://host:port/db); set it "
                "or choose MOPAR_TRANSPORT=http"
            )
        return RedisStore(where.redis_url, ttl_s=where.ttl_s)

    def receiver(self, where: Where) -> Store:
        if not where.redis_url:
            raise ValueError(
                "the request names a redis handoff, but this function has no "
                "REDIS_URL; set it in the function's environment"
            )
        return RedisStore(where.redis_url)

    def missing(self) -> str | None:
        if shutil.which("redis-server") is None:
            return "redis-server is not on PATH; install it (apt-get install redis-server)"
        if importlib.util.find_spec("redis") is None:
            return "the redis Python package is not installed; pip install redis"
        return None


_REGISTRY: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    """Add ``transport`` to the registry under its name; return it.

    Raises:
        ValueError: another transport already has that name.
    """
    if transport.name in _REGISTRY:
        raise ValueError(
            f"a transport named {transport.name!r} is already registered; give yours another name"
        )
    _REGISTRY[transport.name] = transport
    return transport


def unregister(name: str) -> None:
    """Remove the transport ``name`` from the registry (a plug-in's tests clean up with it)."""
    _REGISTRY.pop(name, None)


def transport_named(name: str) -> Transport:
    """The registered transport ``name``.

    Raises:
        ValueError: no transport has that name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"transport {name!r} is not one of {list(_REGISTRY)}") from None


def transports() -> tuple[Transport, ...]:
    """Every registered transport, in registration order."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    """The names of the registered transports (``--transport``'s choices)."""
    return tuple(_REGISTRY)


def handing_on(name: str | None) -> Transport:
    """The transport a function hands on by, from its ``MOPAR_TRANSPORT`` or its spec: the
    inline one for an empty name or ``response`` (the last function hands on nothing)."""
    return _REGISTRY[name] if name in _REGISTRY else inline()


def inline() -> Transport:
    """The transport that hands the frame over in the body: the fallback of the others."""
    return next(t for t in _REGISTRY.values() if t.inline)


def shared() -> Transport:
    """The transport that hands frames over through a folder co-located functions share."""
    return next(t for t in _REGISTRY.values() if t.colocated)


def store() -> Transport:
    """The transport that parks frames in an external store (above a payload limit)."""
    return next(t for t in _REGISTRY.values() if t.stores)


for _builtin in (Shm(), Http(), Redis()):
    register(_builtin)
