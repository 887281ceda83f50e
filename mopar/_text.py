"""Words for counts in what mopar writes for people: ``1 function``, ``3 functions``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["counted", "few"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural (``plural``, else ``noun + "s"``) unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def few(items: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``items`` and how many more: ``a, b, c and 10 more``."""
    items = list(items)
    head = ", ".join(items[:shown])
    return head + (f" and {len(items) - shown} more" if len(items) > shown else "")
