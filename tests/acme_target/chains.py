"""acme offers one chain mode: the function server's ``http``."""

from __future__ import annotations

from mopar.runtime.chains import MODES as DOOR_MODES
from mopar.runtime.chains import ChainMode

MODES: tuple[ChainMode, ...] = (DOOR_MODES["http"],)
