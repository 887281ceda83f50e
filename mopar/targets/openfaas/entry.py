"""How an OpenFaaS function runs: the function server (`mopar.runtime.server`), which the
template's ``index.py`` runs behind the of-watchdog, and ``mopar run`` runs as a process."""

from __future__ import annotations

from mopar.runtime.chains import ChainMode, counterpart
from mopar.target import Entry
from mopar.targets.openfaas.chains import MODES

__all__ = ["HANDLER", "entry"]

HANDLER = "mopar.runtime.server"
"""The function entry point its image runs (the bundle's copy of it)."""


def entry(mode: ChainMode, *, deployed: bool) -> Entry:
    """A function in ``mode`` (one of its own, else its `counterpart`) is its function server,
    deployed or not."""
    return Entry(module=HANDLER, mode=counterpart(mode, MODES))
