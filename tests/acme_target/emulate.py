"""acme's platform on 127.0.0.1: it notes each function it starts in ``ACME_LOG`` (a folder),
then serves it with the function server (``python -m tests.acme_target.emulate``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mopar.runtime.chains import ChainMode


def emulation(mode: ChainMode, *, workers: int, timeout_s: float) -> None:
    """Nothing in front of acme's functions: they POST to each other."""
    return None


def main() -> int:
    log = os.environ.get("ACME_LOG")
    if log:
        (Path(log) / Path(os.environ["MOPAR_FUNCTION_DIR"]).name).write_text(
            os.environ.get("MOPAR_CHAIN", "")
        )
    from mopar.runtime.server import main as serve

    return serve()


if __name__ == "__main__":
    sys.exit(main())
