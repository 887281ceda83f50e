"""The stages after export, from the staged folder and without torch: verify, measure and emit.

Once its functions are exported, a compile needs torch no more. What the rest needs is written
into the staged bundle (`hand_off`, by the driver): the ONNX functions with their
``function.json``, ``reference.npz``, a ``plan.json`` of the estimate, and `HANDOFF_FILE`, the
few figures that are not in a bundle. `finish_staged` then verifies the chain in onnxruntime,
serves the functions as they deploy, sizes them to cover their peaks and writes the final
``plan.json`` and deployment files, reading nothing but that folder.

`mopar compile` runs the torch part in a child process and this one in itself: the child exits
before the functions are served, so that the compiler's libraries and heap (0.4-0.6 GB with
torch) are not held beside a function while it is measured (`finish`). The Python API runs
both in its caller's process. This module and the ones it imports import no torch
(``tests/test_finish.py`` checks).

It carries out a plan of one function, or one that the latency check does not serve beside the
unsplit model, of a model without dynamic dimensions, expert functions or ``--generate``,
measured on the host (`apart`); the driver measures the others itself.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mopar.bill import prewarms
from mopar.bundle.document import Sizing, StageSeconds, Verification, read_document
from mopar.bundle.layout import FUNCTIONS_DIR, MODEL_FILE, REFERENCE_FILE
from mopar.config import CompileConfig, Tolerance
from mopar.emit.bundle import staging_dir
from mopar.emit.functions import write_function_specs
from mopar.emit.session import half_note
from mopar.pipeline.latency import default_objective, recorded
from mopar.pipeline.serving import fitted, serve
from mopar.pipeline.values import Bundle, Measured, Progress, StageTime, Stopwatch, tell_progress
from mopar.plan import Plan
from mopar.plan.notes import as_notes, note_of
from mopar.runner.bundle import manifest_of, read_reference
from mopar.runner.inprocess import verify_chain
from mopar.runner.worker import trim_heap
from mopar.target import target_or_default

if TYPE_CHECKING:
    from mopar.facts import Facts
    from mopar.runner.check import Comparison

__all__ = ["HANDOFF_FILE", "Handoff", "apart", "finish", "finish_staged", "finished_sections"]

log = logging.getLogger(__name__)

HANDOFF_FILE = ".handoff.json"
"""The staged folder's record of what `finish_staged` needs beyond the bundle's own files; it
is removed before the bundle is put in place."""


@dataclass(frozen=True, kw_only=True)
class Handoff:
    """What the torch part of a compile hands to `finish_staged`, beside the staged bundle.

    Attributes:
        out: where the bundle goes.
        force: whether it may replace a bundle there (`mopar.emit.bundle.check_out`).
        requests: requests each function serves before its peak is read
            (`mopar.pipeline.serving.sizing_requests`).
        compute: each slice function's predicted compute at one vCPU and its parallel part,
            ms (`mopar.planner.sizing.cover_peaks`).
        edges: the plan's edges as its units have them (`mopar.pipeline.stages.with_units`),
            as ``plan.json`` writes them: the final plan's.
        notes: the plan's notes as records (`mopar.plan.notes.note_record`): pricing the
            plan again replaces some by kind.
        tolerance: the allclose tolerances the outputs are checked with.
        stages: the seconds of each stage so far.
    """

    out: str
    force: bool
    requests: int
    compute: Mapping[str, tuple[float, float]]
    edges: tuple[Mapping[str, Any], ...]
    notes: tuple[Mapping[str, Any], ...]
    tolerance: Tolerance
    stages: tuple[StageTime, ...]

    def write(self, root: Path) -> None:
        (Path(root) / HANDOFF_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, root: Path) -> Handoff:
        data = json.loads((Path(root) / HANDOFF_FILE).read_text())
        return cls(
            out=data["out"],
            force=data["force"],
            requests=data["requests"],
            compute={k: tuple(v) for k, v in data["compute"].items()},
            edges=tuple(data["edges"]),
            notes=tuple(data["notes"]),
            tolerance=Tolerance(**data["tolerance"]),
            stages=tuple(StageTime(**t) for t in data["stages"]),
        )


def apart(
    *, dynamic: bool, generates: bool, experts: bool, config: CompileConfig, plan: Plan
) -> bool:
    """Whether `finish_staged` carries out the rest of a compile of ``plan``: one of one
    function or not checked beside the unsplit model (`default_objective`), of a model
    without dynamic dimensions, ``--generate`` or expert functions, measured on the host."""
    return (
        not (dynamic or generates or experts)
        and config.measure != "containers"
        and (len(plan.functions) == 1 or not default_objective(config, plan))
    )


def finish(
    staged: Path, *, config: CompileConfig, facts: Facts, progress: Progress | None
) -> Bundle:
    """Carry out the rest of the compile staged at ``staged`` (`finish_staged`) and put the
    bundle in place, in a process that took the folder over from the one that staged it;
    the folder goes on every failure."""
    handoff = Handoff.read(staged)
    out = Path(handoff.out)
    with staging_dir(out, force=handoff.force, adopt=staged) as staging:
        return finish_staged(staging.path, config=config, facts=facts, progress=progress)


def finish_staged(
    root: Path,
    *,
    config: CompileConfig,
    facts: Facts,
    progress: Progress | None,
    held: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Bundle:
    """Verify, measure and emit the bundle staged at ``root`` (`hand_off` wrote it), as the
    driver's stages do; ``held``: the context in which functions are verified and served
    (the driver's takes torch's weights out of memory)."""

    handoff = Handoff.read(root)
    log.info(
        "verify, measure and emit in process %d, %s torch",
        os.getpid(),
        "beside" if "torch" in sys.modules else "without",
    )
    document = read_document(root)
    io = document.io
    assert io is not None  # hand_off writes it
    estimate = replace(
        Plan.from_dict(dict(document.plan)), notes=tuple(note_of(n) for n in handoff.notes)
    )
    inputs, reference = read_reference(root / REFERENCE_FILE)
    tolerance = handoff.tolerance
    watch = Stopwatch()
    for t in handoff.stages:
        watch.add(t.stage, t.seconds)
    paths = [root / FUNCTIONS_DIR / f.name / MODEL_FILE for f in io.functions]
    count = len(paths)
    tell_progress(progress, "verify", count, count)
    with held(), watch.stage("verify"):
        checked = verify_chain(
            paths,
            io.functions,
            inputs,
            reference,
            {o.name: o.value for o in io.outputs},
            tolerance=tolerance,
        )
        half = [
            half_note(f.name, p, max_slowdown=config.max_slowdown)
            for f, p in zip(io.functions, paths)
        ]
        gc.collect()
        trim_heap()  # what their sessions held, back to the kernel before the functions serve
    estimate = replace(estimate, notes=(*estimate.notes, *as_notes(*filter(None, half))))
    tell_progress(progress, "measure", count, count)
    with held(), watch.stage("measure"):
        manifest = manifest_of(root, replace(document, plan=estimate.to_dict()))
        (report,) = serve(
            [manifest],
            [estimate],
            inputs,
            reference,
            tolerance=tolerance,
            settle_to=handoff.requests,
            platform=facts.platform,
        )
    peaks = {s.name: s.peak_rss_mb for s in report.slices}
    fit = fitted(estimate, peaks, facts, dict(handoff.compute))
    edges = Plan.from_dict({**fit.to_dict(), "edges": list(handoff.edges)}).edges
    measured = Measured(
        plan=replace(fit, edges=edges),  # its notes stay records: `recorded` replaces by kind
        peaks_mb=peaks,
        p50_ms={s.name: s.p50_ms for s in report.slices},
        latency_ms=report.latency_p50_ms,
        measured_in=report.served_by,
    )
    if default_objective(config, estimate):  # one function: the check's record says so
        measured = recorded(config, measured, (), (), replanned=False)
    final = measured.plan
    with watch.stage("emit"):
        write_function_specs(root, final, io, None, prewarms(final, facts.platform))
        target_or_default(final.target).emit(root, final, config=config, facts=facts)
        (root / HANDOFF_FILE).unlink()
        replace(
            document,
            plan=final.to_dict(),
            **finished_sections(estimate, final, measured, checked, tolerance),
            stages=tuple(StageSeconds(stage=t.stage, seconds=t.seconds) for t in watch.times()),
        ).write(root)
    return Bundle(
        path=Path(handoff.out),
        plan=final,
        max_abs_err=checked.max_abs_err,
        max_rel_err=checked.max_rel_err,
        tolerance=tolerance,
        stages=watch.times(),
    )


def finished_sections(
    estimate: Plan, final: Plan, measured: Measured, checked: Comparison, tolerance: Tolerance
) -> dict[str, Any]:
    """The sections of ``plan.json`` a finished compile adds: the verification (``checked``
    within ``tolerance``), the latency check's record and each function's sizing, planned
    (``estimate``) against measured (``measured``, the plan written ``final``)."""
    return {
        "verification": Verification(
            max_abs_err=checked.max_abs_err,
            max_rel_err=checked.max_rel_err,
            rtol=tolerance.rtol,
            atol=tolerance.atol,
        ),
        "latency_check": measured.check,
        "sizing": tuple(
            Sizing(
                function=e.name,
                need_mb=e.need_mb,
                planned_mb=e.memory_mb,
                peak_rss_mb=measured.peaks_mb[e.name],
                memory_mb=p.memory_mb,
                planned_time_ms=e.time_ms,
                p50_ms=measured.p50_ms[e.name],
                measured_in=measured.measured_in,
            )
            for e, p in zip(estimate.functions, final.functions)
        ),
    }
