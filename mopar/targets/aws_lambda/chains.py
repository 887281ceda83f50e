"""The chain modes AWS Lambda offers, its default first: each a mode of the Lambda handler
(`mopar.runtime.chains`). What each costs is its ``platforms.json`` entry's (``chains``)."""

from __future__ import annotations

from mopar.runtime.chains import MODES as DOOR_MODES
from mopar.runtime.chains import ChainMode

__all__ = ["MODES"]

MODES: tuple[ChainMode, ...] = tuple(DOOR_MODES[n] for n in ("invoke", "stepfunctions", "event"))
"""``invoke`` (a synchronous invoke of the next, waited for), ``stepfunctions`` (a Step
Functions Express workflow calls each in turn), ``event`` (queued ``Event`` invokes, the answer
left in a Redis rendezvous)."""
