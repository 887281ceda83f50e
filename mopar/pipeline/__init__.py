"""Compiling is a pipeline of named stages, each a function from data to data.

    capture -> profile -> plan -> rewrite -> compress -> export -> quantize -> verify -> measure
    -> emit

Read in this order: `values.py` (`STAGES`, `Stopwatch`: how long each stage took, and the
typed values the stages hand each other), `driver.py` (`run`: the stages in order, stopping
after ``until``, and the latency check), `stages.py` (one function per stage; the lossy ones'
budget and the ``quantize`` stage in `lossy.py`), then
`latency.py` (the latency check's statistics and notes) and `document.py` (the writers
of ``plan.json``).

========  ===================================================================================
capture   load the model, torch.export it, group it into layers (`capture`, which
          `mopar.api.analyze` calls; the CLI calls it first, so its time travels in
          `Analysis.seconds`)
profile   the profiler's per-layer memory and time predictions, and a mixture-of-experts
          model's activation trace (`Profile`): what needs the model to run is measured here,
          once, and handed to every planning round
plan      the strategy's vertical plan (`mopar.planner`), then the sharding figures of its
          slices (`mopar.profile.shards`) and η per slice from them (`Planned`). Simplifying the
          layer graph is part of it: each strategy simplifies as it builds the problem its DP
          solves
rewrite   one torch slice module per executable unit: split, then shard as analysed
          (`mopar.rewrite`)
compress  the codec of every cut tensor, autoencoders inserted (`mopar.compress`); only with
          a ``codec`` other than none
export    one ONNX file per unit, with its handler and requirements (`mopar.emit.onnx_export`).
          Where a unit does not export, `export` moves a cut (`mopar.planner.recut`) and plan,
          rewrite and compress run again: their seconds count under their own names, not
          export's
quantize  the form of every function's weights within the budget (`mopar.compress.quantize`),
          the chosen ones in place of the float files; only with a ``quantize`` other than
          none
verify    the onnxruntime chain against the model's outputs
measure   every unit served through the real runtime; functions sized to cover their peaks.
          Under the default objective (``--max-slowdown``) a plan of several functions is
          served beside the unsplit model (exported to a scratch folder), requests
          interleaved; a plan slower than the bound beyond the measurement's spread is planned
          again from the measurements and exported, verified and served in its place
          (``check_latency``, `_measure_checked`; the numbers: `latency.py`)
emit      ``reference.npz``, the plan's target's files (``stack.yml`` or ``template.yaml``),
          ``README.md``, ``plan.json`` (whose "stages"
          section holds these times, up to its own writing) and each ``function.json``
========  ===================================================================================

Where the rest needs no torch (a plan the latency check does not serve beside the unsplit
model, of a model without dynamic dimensions, ``--generate`` or expert functions: `finish.py`'s
``apart``), the driver stages what verify, measure and emit need into the bundle's folder, and
`finish.py` carries them out from it alone: in this process, or, for ``mopar compile`` of a
model of 256 MB and more, in the CLI's parent process once the child that ran torch has exited
(`mopar.cli.child`).

``until`` (``mopar compile --until``) stops after ``plan``, ``rewrite`` or ``export`` and keeps
what was made, written atomically like a whole bundle; its ``plan.json`` says ``"until"``, and
`mopar.runner.bundle.read_manifest` refuses to run it. ``plan.json`` is a
`mopar.bundle.document.BundleDocument`: built once in memory, written once, and the source of
each ``function.json`` and of the runner's view of the units it measures.

Importing this package stays light (no torch, no numpy): it imports `values.py` alone, which
names the stages (`STAGES`, and `UNTIL`, which the CLI's ``--until`` reads) and types the values
they hand each other. The stages and the driver (`stages.py`, `driver.py` and the modules they
use) import what they need at their top, torch included; this package names each of its
functions below (`run`, `capture`, ...) and imports its module when one is first asked for,
as ``from mopar import pipeline; pipeline.plan(...)`` in a command's body does.
"""

from __future__ import annotations

import importlib
from typing import Any

from mopar.pipeline.values import (
    STAGES,
    UNTIL,
    Analysis,
    Bundle,
    HandedOver,
    Planned,
    Profile,
    StageTime,
    Stopwatch,
)

FUNCTIONS = {
    "run": "driver",
    **{
        name: "stages"
        for name in (
            "capture",
            "profile",
            "plan",
            "plans",
            "experts_of",
            "rewrite",
            "compress",
            "export",
            "verify",
            "measure",
            "emit",
        )
    },
}
"""Each function this package offers, and the module of the package that holds it."""

__all__ = [
    "STAGES",
    "UNTIL",
    "Analysis",
    "Profile",
    "Planned",
    "Bundle",
    "HandedOver",
    "StageTime",
    "Stopwatch",
    *FUNCTIONS,
]


def __getattr__(name: str) -> Any:
    if name in FUNCTIONS:
        return getattr(importlib.import_module(f"mopar.pipeline.{FUNCTIONS[name]}"), name)
    raise AttributeError(f"module 'mopar.pipeline' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *FUNCTIONS})
