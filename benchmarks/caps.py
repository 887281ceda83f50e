"""The smallest memory cap (``max_memory_mb``) that planning a model accepts.

`smallest_cap` bisects the target's memory grid: one capture, then one plan per probe (a cap is
refused at planning, so a plan is enough). `cap_search_in_subprocess` runs it in a process of
its own, as ``python -m benchmarks.compile_memory --cap-search`` does before compiling at the
cap it found (docs/scale-measured.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from tools import checkout_env

__all__ = ["CapSearch", "smallest_cap", "cap_search_in_subprocess", "environment"]


@dataclass(frozen=True, kw_only=True)
class CapSearch:
    """The smallest ``max_memory_mb`` planning accepts (`smallest_cap`).

    Attributes:
        target: the platform planned for.
        cap_mb: the smallest accepted cap on the platform's memory grid, MB (None: even the
            largest is refused).
        refused_mb: the largest refused cap below it, MB (None: the smallest is accepted).
        refusal: that refusal's message.
        functions: the functions of the plan at ``cap_mb``.
        planned_mb: their memory sizes there, MB.
        probes: plans made; seconds: the whole search, capture included, s.
    """

    target: str
    cap_mb: int | None
    refused_mb: int | None
    refusal: str
    functions: int
    planned_mb: tuple[int, ...]
    probes: int
    seconds: float


def smallest_cap(
    model: str, inputs: Sequence[str] = (), *, target: str = "lambda", arch: str = "x86_64"
) -> CapSearch:
    """The smallest ``max_memory_mb`` on ``target``'s memory grid that planning ``model``
    accepts, by bisection (acceptance grows with the cap): one capture, then one plan per probe,
    each with the cap's facts; a `mopar.errors.MoparError` is a refusal. Loads the model into
    this process: call it in one of its own (``--cap-search`` does)."""
    from mopar import api
    from mopar.config import CompileConfig
    from mopar.errors import MoparError

    began = time.monotonic()
    analysis = api.analyze(model, list(inputs) or None)
    base = CompileConfig(target=target, arch=arch)
    grid = api.facts_for(base).platform
    prediction = api.predict(analysis.layers, base)
    caps = list(range(grid.min_mb, grid.max_mb + 1, grid.step_mb))
    outcome: dict[int, Any] = {}

    def accepts(cap: int) -> bool:
        config = replace(base, max_memory_mb=cap)
        try:
            outcome[cap] = api.plan_from(analysis, config, prediction, facts=api.facts_for(config))
        except MoparError as exc:
            outcome[cap] = str(exc).splitlines()[0]
            return False
        return True

    lo, hi = -1, len(caps) - 1  # caps[lo] refused (-1: none tried), caps[hi] accepted?
    if not accepts(caps[hi]):
        hi = len(caps)
    elif accepts(caps[0]):
        hi = 0
    else:
        lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if accepts(caps[mid]) else (mid, hi)
    found = caps[hi] if hi < len(caps) else None
    refused = caps[lo] if lo >= 0 else (caps[-1] if found is None else None)
    plan = outcome.get(found) if found is not None else None
    return CapSearch(
        target=target,
        cap_mb=found,
        refused_mb=refused,
        refusal=outcome[refused] if refused is not None else "",
        functions=len(plan.functions) if plan is not None else 0,
        planned_mb=tuple(f.memory_mb for f in plan.functions) if plan is not None else (),
        probes=len(outcome),
        seconds=round(time.monotonic() - began, 1),
    )


_CAP_CHILD = "import sys; from benchmarks.caps import _cap_child; _cap_child(sys.argv[1:])"


def _cap_child(argv: Sequence[str]) -> None:
    model, target, arch, *inputs = argv
    print(json.dumps(asdict(smallest_cap(model, inputs, target=target, arch=arch))))


def cap_search_in_subprocess(
    model: str, args: Sequence[str], *, timeout: float = 3600
) -> CapSearch:
    """`smallest_cap` in a fresh process, with the target, architecture and ``--input`` specs
    of the compile arguments ``args``."""
    options = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    options.add_argument(
        "--target", default="openfaas", type=lambda t: t.replace("all", "openfaas")
    )
    options.add_argument("--arch", default="x86_64")
    options.add_argument("--input", action="append", default=[])
    opts, _ = options.parse_known_args(list(args))
    proc = subprocess.run(
        [sys.executable, "-c", _CAP_CHILD, model, opts.target, opts.arch, *opts.input],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the cap search failed: {proc.stderr.strip().splitlines()[-1:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return CapSearch(**{**doc, "planned_mb": tuple(doc["planned_mb"])})


def environment() -> dict[str, str]:
    """This environment, with the repository importable and Hugging Face offline."""
    # the compile imports this module (`_child`) and, for factories, the repository's examples
    return {**checkout_env(), "HF_HUB_OFFLINE": "1"}
