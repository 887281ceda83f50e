"""What ``mopar profile calibrate`` measured: ``transports.json``, read and checked for the planner.

`load_transports` reads a profile (refusing another format version or a corrupt one, with the
command that rewrites it); `measured_transports` and `transfer_ms` are what the planner asks of
it. The measurement itself is the repository's (``tools/profiler/calibrate.py``, which writes
`TRANSPORTS_FORMAT_VERSION`); the shipped ``profiles/transports.json`` is what it wrote here.
MB = 2**20 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mopar.errors import InternalError, MoparError

__all__ = [
    "MB",
    "TRANSPORTS_FORMAT_VERSION",
    "CalibrationError",
    "load_transports",
    "measured_transports",
    "transfer_ms",
]

TRANSPORTS_FORMAT_VERSION = 1
MB = 1 << 20
_RERUN = "rerun `mopar profile calibrate --out DIR`"


class CalibrationError(MoparError):
    """A calibration could not run, or a transports profile is missing or corrupt."""


def load_transports(path: Path) -> dict[str, Any]:
    """Read and check a transports profile: a file, or a folder holding ``transports.json``."""
    path = Path(path) / "transports.json" if Path(path).is_dir() else Path(path)
    try:
        profile = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{str(path)!r} cannot be read ({exc}); {_RERUN}") from None
    version = profile.get("format_version") if isinstance(profile, dict) else None
    if version != TRANSPORTS_FORMAT_VERSION:
        raise CalibrationError(
            f"{str(path)!r} has format version {version!r}, this mopar reads "
            f"{TRANSPORTS_FORMAT_VERSION}; {_RERUN}"
        )
    if problem := _problem(profile):
        raise CalibrationError(f"{str(path)!r} is corrupt: {problem}; {_RERUN}")
    return profile


def _problem(profile: dict[str, Any]) -> str | None:
    def bad(v: Any, *, zero_ok: bool = True) -> bool:  # not a finite number >= 0 (or > 0)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
        return not (ok and (v >= 0 if zero_ok else v > 0))

    transports = profile.get("transports")
    if not isinstance(transports, dict) or not all(
        isinstance(e, dict) and e.get("measured") in (True, False) for e in transports.values()
    ):
        return f"'transports' is {transports!r}, expected an object of objects with 'measured'"
    for name, e in transports.items():
        if e["measured"] and (bad(e.get("latency_ms")) or bad(e.get("mb_per_s"), zero_ok=False)):
            return (
                f"transport {name!r} has latency_ms {e.get('latency_ms')!r} and mb_per_s "
                f"{e.get('mb_per_s')!r}, expected finite numbers >= 0 and > 0"
            )
    key = next((k for k in ("hop_ms", "runtime_baseline_mb") if bad(profile.get(k))), None)
    return key and f"{key!r} is {profile.get(key)!r}, expected a finite number >= 0"


def measured_transports(profile: dict[str, Any]) -> tuple[str, ...]:
    """The transports the profile has figures for, in its order."""
    return tuple(n for n, e in profile["transports"].items() if e.get("measured"))


def transfer_ms(profile: dict[str, Any], transport: str, nbytes: int) -> float:
    """Time to hand ``nbytes`` over ``transport``, ms: latency + bytes / bandwidth."""
    if nbytes < 0:
        raise InternalError(f"transfer_ms got {nbytes} bytes, expected >= 0")
    entry = profile["transports"].get(transport)
    if not entry or not entry.get("measured"):
        why = (entry or {}).get("reason", "it is not in the profile")
        raise CalibrationError(
            f"transport {transport!r} has no measured figures ({why}); choose "
            f"one of {list(measured_transports(profile))} or {_RERUN}"
        )
    return entry["latency_ms"] + nbytes / (entry["mb_per_s"] * MB) * 1e3
