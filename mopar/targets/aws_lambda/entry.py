"""How a Lambda function runs: the Lambda handler (`mopar.runtime.aws`, its image's CMD), behind
this package's emulation of Lambda's Invoke API on this machine (`mopar.targets.aws_lambda.emulate`).
Where neither the mode nor the caller needs the handler itself, the function server plays the
mode's counterpart: the same core behind another door."""

from __future__ import annotations

from mopar.runtime.chains import SERVER, ChainMode, counterpart, modes_of
from mopar.target import Entry

__all__ = ["EMULATION", "HANDLER", "entry"]

HANDLER = "mopar.runtime.aws.lambda_handler"
"""The function entry point its image runs (``Dockerfile.lambda``'s CMD: the bundle's copy)."""
EMULATION = "mopar.targets.aws_lambda.emulate"
"""What runs one handler on 127.0.0.1 behind the Invoke API (``python -m``)."""


def entry(mode: ChainMode, *, deployed: bool) -> Entry:
    """A function in ``mode``: its Lambda handler behind the emulated Invoke API where the mode
    has a rendezvous (its functions invoke each other by name) or it is measured as deployed;
    else the function server, in the counterpart of ``mode``."""
    if mode.rendezvous or deployed:
        return Entry(module=EMULATION, mode=mode)
    return Entry(module="mopar.runtime.server", mode=counterpart(mode, modes_of(SERVER)))
