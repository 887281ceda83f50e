"""The target's facts: its entry of ``profiles/platforms.json`` (prices, memory grid, CPU rule,
replicas, chain modes' limits and charges), which `mopar.facts.platform_of` turns into the
`mopar.facts.Platform` a plan is priced for."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mopar.config import load_profile
from mopar.targets.openfaas import NAME

__all__ = ["facts"]


def facts(profiles_dir: Path) -> Mapping[str, Any] | None:
    """Its entry of ``platforms.json`` in ``profiles_dir`` (None: that file has none)."""
    entry = load_profile(profiles_dir, "platforms").get(NAME)
    return entry if isinstance(entry, dict) else None
