"""Frozen configuration for compiling and running, with the unit of every field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from mopar.errors import MoparError

__all__ = ["CompileConfig", "RunConfig", "PROFILES_DIR", "load_profile"]

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """Options of `mopar.compile`.

    Attributes:
        slices: exact number of slices.
        strategy: partition strategy name.
        depth: group layers by module path truncated to this many components (None: leaf).
        tolerance: max relative error (max |diff| / max |reference|) of the chained slices.
        opset: ONNX opset version (None: the exporter's default).
        profiles_dir: folder of platform and runtime profiles.
    """

    slices: int = 3
    strategy: str = "balanced"
    depth: int | None = None
    tolerance: float = 1e-4
    opset: int | None = None
    profiles_dir: Path = PROFILES_DIR


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Options of `mopar run`.

    Attributes:
        requests: measured requests (after one warm-up request).
        concurrency: requests in flight at once.
        tolerance: max relative error for ``--check``.
        timeout_s: seconds to wait for one slice to answer before failing the run.
        intra_op_threads: onnxruntime intra-op threads per slice (0: onnxruntime's default).
    """

    requests: int = 10
    concurrency: int = 1
    tolerance: float = 1e-4
    timeout_s: float = 300.0
    intra_op_threads: int = 0


@cache
def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def load_profile(profiles_dir: Path, name: str) -> dict[str, Any]:
    """Read ``profiles_dir/name.json``; raise a `MoparError` naming the fix if it is missing."""
    path = Path(profiles_dir) / f"{name}.json"
    if not path.is_file():
        raise MoparError(f"profile {str(path)!r} is missing; pass --profiles DIR holding {name}.json")
    try:
        return _read_json(path)
    except json.JSONDecodeError as exc:
        raise MoparError(f"profile {str(path)!r} is not valid JSON ({exc}); restore it") from None
