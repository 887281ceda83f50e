"""mopar: cut a trained PyTorch model into serverless functions.

``mopar.analyze``, ``mopar.partition`` and ``mopar.compile`` are `mopar.api`'s functions,
imported lazily so that ``import mopar`` (and ``mopar --help``, and every slice process) stays
free of torch. No subpackage may take one of their names: importing ``mopar.<name>`` would
bind the submodule over the function (tests/test_api.py checks).

mopar logs through the ``mopar`` logger and never prints: with no handler configured, nothing
reaches stderr (the CLI's ``--verbose`` shows the INFO records).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["analyze", "partition", "compile", "MoparError", "__version__"]

__version__ = "0.1.0"

from mopar.errors import MoparError  # noqa: E402  (light: no torch)

# A library's loggers get a NullHandler, so that Python's last-resort handler never prints
# mopar's warnings on a caller's stderr; applications choose where they go.
logging.getLogger(__name__).addHandler(logging.NullHandler())

_API = ("analyze", "partition", "compile")


def __getattr__(name: str) -> Any:
    if name in _API:
        from mopar import api

        return getattr(api, name)
    raise AttributeError(f"module 'mopar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
