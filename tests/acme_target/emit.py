"""acme's files: one manifest naming each function and its memory, and its image's Dockerfile."""

from __future__ import annotations

import json
from pathlib import Path

from mopar.config import CompileConfig
from mopar.facts import Facts
from mopar.plan import Plan
from tests.acme_target.image import RECIPE


def emit(bundle: Path, plan: Plan, *, config: CompileConfig, facts: Facts) -> None:
    doc = {f.name: f.memory_mb for f in plan.functions}
    (bundle / "acme.json").write_text(json.dumps({"target": plan.target, "functions": doc}))
    (bundle / RECIPE.dockerfile).write_text(
        "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}\nCOPY function/ /function/\n"
    )
