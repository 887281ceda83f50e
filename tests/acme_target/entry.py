"""An acme function runs as acme's own emulation of its platform (`tests.acme_target.emulate`)
around the function server."""

from __future__ import annotations

from mopar.runtime.chains import ChainMode, counterpart
from mopar.target import Entry
from tests.acme_target.chains import MODES

HANDLER = "mopar.runtime.server"


def entry(mode: ChainMode, *, deployed: bool) -> Entry:
    return Entry(module="tests.acme_target.emulate", mode=counterpart(mode, MODES))
