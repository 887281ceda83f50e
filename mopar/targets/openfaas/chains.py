"""The chain modes OpenFaaS offers, its default first: each a mode of the function server
(`mopar.runtime.chains`). What each costs is its ``platforms.json`` entry's (``chains``)."""

from __future__ import annotations

from mopar.runtime.chains import MODES as DOOR_MODES
from mopar.runtime.chains import ChainMode

__all__ = ["MODES"]

MODES: tuple[ChainMode, ...] = tuple(DOOR_MODES[n] for n in ("http", "callback", "shm"))
"""``http`` (each function POSTs to the next and waits), ``callback`` (the gateway's queue, the
answer POSTed to the request's callback URL), ``shm`` (co-located, through a shared tmpfs)."""
