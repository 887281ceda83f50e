"""mopar's tools, beside the package in its repository (not in the wheel): the profiler's
collection and training (`tools.profiler`) and the plots (`tools.plot`).

Run them from the root of a checkout: ``mopar profile collect|train|report|calibrate`` and the
``--plot`` options of ``mopar plan`` and ``mopar profile experts`` import them inside the
command (`mopar.cli.checkout`); mopar never imports them at module level. What plan and compile
need at run time (the shipped predictors, the features, the machine probe, the transports
profile's reader) stays in ``mopar/profile``.

Importing this package stays light (the standard library alone): the profiler's measuring child,
``python -m tools.profiler.probe``, imports it and must import only what a slice imports.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHECKOUT", "checkout_env"]

CHECKOUT = Path(__file__).resolve().parent.parent
"""The repository's root, which holds ``mopar/``, ``benchmarks/``, ``tools/`` and ``examples/``."""


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with `CHECKOUT` first on ``PYTHONPATH``, so
    that a child ``python -m tools.NAME`` or ``-m benchmarks.NAME`` imports the lab (and the
    example models) from this checkout, whatever folder it starts in."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH")) if p)
    return env
