"""The lab beside the package: what some commands run from a checkout of mopar's repository.

The wheel holds mopar alone. The repository's root also holds `LAB`: ``examples/`` (the example
models), ``benchmarks/`` (the bench harness and the experiments) and ``tools/`` (the profiler's
collection and training, the plots). ``mopar bench``, ``mopar profile collect|train|report|
calibrate`` and the ``--plot`` options import them inside the command, after `need_checkout`:
no module of mopar imports them at its top, and nothing below the CLI imports them at all
(``lint-imports``; tests/test_layers.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from mopar.errors import MoparError

__all__ = ["LAB", "need_checkout"]

LAB = {
    "examples": "mopar's example models",
    "benchmarks": "mopar's benchmarks",
    "tools": "mopar's profiler and plotting tools",
}
"""The repository's top-level packages beside ``mopar/``, by name, and what each holds."""


def need_checkout(command: str, package: str) -> ModuleType:
    """The repository's ``package`` (a key of `LAB`), which ``command`` runs; imported here, at once.

    The installed ``mopar`` script does not search the current folder, so a checkout's root is
    added to ``sys.path`` as ``python -m`` would. A package of that name from elsewhere (a
    stray ``tools`` in site-packages) is not the repository's: it needs ``mopar/`` beside it.

    Raises:
        MoparError: ``package`` is not the checkout's, in one line that says where to run from.
    """
    here = Path.cwd()
    if (here / package / "__init__.py").is_file() and str(here) not in sys.path:
        sys.path.insert(0, str(here))
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name != package:
            raise
        module = None
    root = Path(getattr(module, "__file__", None) or "/").resolve().parent.parent
    if module is None or not (root / "mopar" / "__init__.py").is_file():
        raise MoparError(
            f"`mopar {command}` runs {LAB[package]}, which are in its repository's {package}/ "
            "folder, not in the installed package; run it from the root of a mopar checkout "
            "(git clone, then cd into it)"
        )
    return module
