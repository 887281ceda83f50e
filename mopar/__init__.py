"""mopar: cut a trained PyTorch model into serverless functions.

The API is imported lazily so that ``import mopar`` (and ``mopar --help``, and every slice
process) stays free of torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["analyze", "partition", "compile", "MoparError", "__version__"]

__version__ = "0.1.0"

from mopar.errors import MoparError  # noqa: E402  (light: no torch)


def __getattr__(name: str) -> Any:
    if name in ("analyze", "partition", "compile"):
        from mopar import api

        return getattr(api, name)
    raise AttributeError(f"module 'mopar' has no attribute {name!r}")
