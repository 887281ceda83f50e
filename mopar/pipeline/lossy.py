"""The lossy parts of a compile, within the user's budget (`mopar.compress.budget`): the budget
``config`` makes, the tolerance a bundle with lossy parts is verified at, and the ``quantize``
stage (the form of every function's weights, `mopar.compress.quantize`). Codecs at the cuts are
the ``compress`` stage, in `mopar.pipeline.stages`."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from mopar._files import as_if_made
from mopar._text import few as few_text
from mopar.bundle.layout import WEIGHTS_FILE
from mopar.compress.budget import CONFIDENCE, MIN_TRAIN, Budget, resolving_count
from mopar.compress.calibration import Calibration, load_calibration
from mopar.compress.kernels import SATURATES, describe, this_machine
from mopar.compress.quantize import Price, choose_forms
from mopar.config import CompileConfig, Tolerance
from mopar.emit.session import write_session
from mopar.facts import MB, Facts
from mopar.pipeline.document import public_outputs
from mopar.pipeline.values import Analysis, Exported, Progress
from mopar.plan.notes import as_notes
from mopar.profile.experts import request_samples

__all__ = ["budget_of", "widened", "quantize", "MOE_SAMPLES"]


def budget_of(config: CompileConfig) -> Budget:
    """The budget ``config``'s bounds make (``max_top1_change`` is given in percent)."""

    top1 = None if config.max_top1_change is None else config.max_top1_change / 100.0
    return Budget(
        max_output_error=config.max_output_error, max_top1_change=top1, min_cosine=config.min_cosine
    )


def widened(tolerance: Tolerance, config: CompileConfig, seen: float, reference: dict) -> Tolerance:
    """``tolerance`` for a bundle whose lossy parts changed the held-out outputs by ``seen``
    (relative): the reference input need not be a held-out sample, so allow the budget, or 2x
    what was seen, both relative to the outputs' scale; so the absolute tolerance widens."""

    if seen <= 0:
        return tolerance
    relative = max(config.max_output_error or 0.0, 2 * seen)
    scale = max((float(np.max(np.abs(v))) for v in reference.values() if v.size), default=0.0)
    return replace(tolerance, atol=max(tolerance.atol, relative * scale))


def quantize(
    analysis: Analysis,
    exported: Exported,
    config: CompileConfig,
    facts: Facts,
    progress: Progress | None,
) -> Exported:
    """Choose the form of every unit's weights within the budget (`mopar.compress.quantize`),
    put the chosen ones in place of the float ``model.onnx``, and record them in the plan,
    each function priced with the bytes its form saves."""

    r, cm, platform = exported.realised, analysis.captured, facts.platform
    functions = {f.name: f for f in r.plan.functions}

    def price(name: str, saved: int, ratio: float) -> Price:
        f = functions[name]
        fitted = f.memory_mb <= platform.round_mb(f.need_mb)  # not raised for CPU
        memory = platform.round_mb(max(f.need_mb - saved / MB, 1.0)) if fitted else f.memory_mb
        cost = platform.cost_usd(memory, f.time_ms * ratio, max(f.param_bytes - saved, 0))
        return Price(memory_mb=memory, cost_per_1m_usd=cost * 1e6)

    calibration = _weights_calibration(analysis, config)
    kernels = (platform.int8_kernels, this_machine())
    folder = exported.paths[0].parents[1]
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".quantize-") as scratch:
        chosen = choose_forms(
            exported.paths,
            r.slices,
            list(public_outputs(analysis).values()),
            calibration,
            mode=config.quantize,
            budget=budget_of(config),
            price=price,
            max_slowdown=config.max_slowdown if config.slo_ms is None else None,
            scratch=Path(scratch),
            kernels=kernels,
            progress=progress,
        )
        for form in chosen.forms.values():
            if form.path is None:
                continue
            form.source.with_name(WEIGHTS_FILE).unlink(missing_ok=True)
            for made in form.path.parent.iterdir():
                made.replace(form.source.parent / made.name)
                as_if_made(form.source.parent / made.name)
            write_session(form.source)
    plan = replace(
        r.plan,
        functions=tuple(_quantized(f, chosen, price) for f in r.plan.functions),
        notes=(
            *r.plan.notes,
            *as_notes(*_quantize_notes(chosen, calibration, budget_of(config), kernels, facts)),
        ),
    )
    tolerance = widened(r.tolerance, config, chosen.together.error, cm.reference)
    return replace(exported, realised=replace(r, plan=plan, tolerance=tolerance))


MOE_SAMPLES = 48
"""Requests cut from a mixture-of-experts model's token data that quantised weights are judged
on (a quarter held out): enough to reach every expert, bounded in time."""


def _weights_calibration(analysis: Analysis, config: CompileConfig):
    """The samples quantised weights are chosen on: ``--calibration`` as codecs read it; for a
    mixture-of-experts model, requests cut from its token data as its expert trace is
    (`mopar.profile.experts.request_samples`), at most `MOE_SAMPLES` of them."""

    cm = analysis.captured
    if not analysis.moe or config.calibration is None:
        return load_calibration(config.calibration, cm.inputs, seed=config.seed)
    samples, notes = request_samples(config.calibration, cm.inputs)
    kept = tuple(samples[:: max(1, len(samples) // MOE_SAMPLES)][:MOE_SAMPLES])
    return Calibration(
        samples=kept,
        synthetic=False,
        source=f"{len(kept)} requests of {config.calibration}",
        notes=notes,
    )


def _quantized(f, chosen, price) -> Any:
    """Function ``f`` with the chosen form of its weights recorded (and of its hot experts',
    ``hot``, for a dispatch function), every other form measured (``candidates``), and its
    memory and cost priced with the bytes they all save."""
    parts = [p for p in chosen.forms.values() if p.function == f.name]
    if not parts:
        return f

    def record(form) -> dict[str, Any]:
        others = [c.to_dict() for c in chosen.measured.get(form.key, ()) if c is not form]
        return {**form.to_dict(), "candidates": others}

    main = next((p for p in parts if p.key == f.name), None)
    quantized = record(main) if main is not None else {}
    for hot in (p for p in parts if p.key != f.name):
        quantized["hot"] = record(hot)
    saved = sum(p.float_bytes - p.bytes for p in parts)
    ratio = sum(p.ms for p in parts) / max(sum(p.float_ms for p in parts), 1e-9)
    priced = price(f.name, saved, ratio)
    return replace(
        f,
        quantized=quantized,
        param_bytes=max(f.param_bytes - saved, 0),
        memory_mb=priced.memory_mb,
        cost_per_1m_usd=priced.cost_per_1m_usd,
    )


def _quantize_notes(chosen, calibration, budget: Budget, kernels, facts: Facts) -> list[str]:
    forms = [f for f in chosen.forms.values() if f.form != "none"]
    failed = [f"quantize: onnxruntime could not make {f}" for f in chosen.failed]
    judged = _judged_note(chosen, budget)
    if not forms:
        return [
            *failed,
            "quantize: every function kept its float weights (no form applied, or none was "
            f"within the budget and the latency bound, on {calibration.source})",
            *judged,
        ]
    before = sum(f.float_bytes for f in chosen.forms.values())
    after = sum(f.bytes for f in chosen.forms.values())
    t = chosen.together
    effect = f"max output error {t.error:.2e}"
    if t.top1_change is not None:
        effect += f", top-1 change {t.top1_change * 100:.1f}%"
    if t.pooled_cosine is not None:
        effect += f", pooled embedding cosine >= {t.pooled_cosine:.4f}"
    if t.cosine is not None:
        effect += f", cosine of every row{' the mask keeps' if t.pooled_cosine else ''} "
        effect += f">= {t.cosine:.4f}"
    each = few_text([f"{f.key} {f.form} ({f.scheme.name})" for f in forms])
    notes = [
        *failed,
        f"quantize: {len(forms)} of {len(chosen.forms)} models (functions, and dispatches' hot "
        f"experts) quantised: {each}; weights "
        f"{before / MB:.1f} -> {after / MB:.1f} MB ({before / max(after, 1):.2f}x); together "
        f"{effect} on {chosen.held_out} held-out samples of {calibration.source}",
        *judged,
        _kernels_note(kernels, facts),
    ]
    if calibration.synthetic:
        notes.append(
            "quantised weights were judged on synthetic data (augmented example inputs); "
            "pass --calibration with real samples"
        )
    return notes


def _judged_note(chosen, budget: Budget) -> list[str]:
    """What the held-out samples can tell of a top-1 budget: the interval of the change of
    the forms together (or of the most exact lossy form measured, where all stayed float), and
    whether it resolves the budget."""
    p = budget.max_top1_change
    lossy = [f for found in chosen.measured.values() for f in found if f.form != "none"]
    if p is None or not lossy:
        return []
    kept = any(f.form != "none" for f in chosen.forms.values())
    effect = chosen.together if kept else min(lossy, key=lambda f: f.effect.top1_change or 0).effect
    low_high = effect.top1_interval()
    if low_high is None:
        return []
    low, high = low_high
    what = "together" if kept else "in the most exact int8 scheme measured"
    text = (
        f"quantize: top-1 change {what} {effect.top1_change * 100:.1f}% of {effect.rows} rows "
        f"of {chosen.held_out} held-out samples, {CONFIDENCE:.0%} interval "
        f"{low * 100:.1f}-{high * 100:.1f}%"
    )
    if low <= p < high:
        needed = resolving_count(p)
        text += (
            f": it does not resolve the {p * 100:g}% budget; {needed} held-out samples (a "
            f"calibration file of {needed + MIN_TRAIN}) would"
        )
    return [text]


def _kernels_note(kernels: tuple[str, str], facts: Facts) -> str:
    target, here = kernels
    where = facts.platform.target
    text = (
        f"quantize: int8 schemes measured for {where}'s int8 kernels, {describe(target)} "
        f"({facts.platform.int8_kernels_source.rstrip('.') or 'stated in platforms.json'})"
    )
    if target == here:
        return text + "; this machine runs the same, so its accuracy is the target's"
    return text + (
        f"; this machine runs {describe(here)} instead, so the accuracy was measured on its "
        "kernels: "
        + (
            "they saturate where the target's do not, so the target's can only be as close"
            if here in SATURATES
            else "u8s8 with 8-bit weights was not taken, since the target's may saturate"
        )
    )
