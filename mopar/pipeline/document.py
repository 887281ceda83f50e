"""``plan.json`` as the pipeline builds it: the `mopar.bundle.document.BundleDocument` of a compile."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mopar.bundle.document import (
    BundleDocument,
    Io,
    IoFunction,
    IoOutput,
    IoTensor,
    LayerSummary,
    StageSeconds,
)
from mopar.bundle.generation import CachePair, GenerationSpec
from mopar.bundle.layout import FUNCTIONS_DIR, MODEL_FILE, WEIGHTS_FILE
from mopar.config import CompileConfig
from mopar.emit.bundle import stamp
from mopar.ir.dynamic import extents
from mopar.pipeline.values import Analysis, Stopwatch
from mopar.rewrite import output_values

if TYPE_CHECKING:
    from mopar.profile.experts import Experts

log = logging.getLogger(__name__)

# --- plan.json ------------------------------------------------------------------------------------


def io_section(analysis: Analysis, units, codecs: dict[str, str], *, root: Path | None):
    """The ``io`` section (an `mopar.bundle.document.Io`): the model's inputs and outputs, and
    what each unit takes and gives (with its ONNX file, its weights file if it has one, and
    codecs once exported to ``root``; else, ``root`` None, its FX code); a model input that
    indexes an embedding with the values it may hold."""

    lg = analysis.layers
    extents = _extents(analysis)
    indices = analysis.captured.index_ranges  # model inputs, by the same name in every unit
    tensors = lambda ts: tuple(  # noqa: E731
        IoTensor(
            name=t.name,
            shape=tuple(t.shape),
            dtype=t.dtype,
            nbytes=t.nbytes,
            min_shape=extents.get(t.name, (None, None))[0],
            max_shape=extents.get(t.name, (None, None))[1],
            value_range=indices.get(t.name),
        )
        for t in ts
    )

    most = _most_tokens(analysis, extents)

    def rows(ts):  # an expert function of a dynamic model: up to the most tokens a layer gets
        return tuple(replace(t, max_shape=(most, *t.shape[1:])) for t in tensors(ts))

    def unit(s) -> IoFunction:
        folder = f"{FUNCTIONS_DIR}/{s.name}"
        exported = root is not None
        weights = exported and (root / folder / WEIGHTS_FILE).is_file()
        sized = rows if s.rows and most is not None else tensors
        return IoFunction(
            name=s.name,
            inputs=sized(s.inputs),
            outputs=sized(s.outputs),
            graph=None if exported else f"{folder}/graph.py",
            onnx=f"{folder}/{MODEL_FILE}" if exported else None,
            weights=f"{folder}/{WEIGHTS_FILE}" if weights else None,
            dispatch=s.dispatch.spec if exported and s.dispatch is not None else None,
            rows=bool(s.rows),
            codecs={t.name: codecs[t.name] for t in s.outputs if t.name in codecs},
        )

    outputs = {t.name: t for t in lg.outputs}
    return Io(
        inputs=tensors(lg.inputs),
        outputs=tuple(
            IoOutput(name=pub, value=v, shape=tuple(outputs[pub].shape), dtype=outputs[pub].dtype)
            for pub, v in public_outputs(analysis).items()
        ),
        functions=tuple(unit(s) for s in units),
    )


def _most_tokens(analysis: Analysis, extents: dict) -> int | None:
    """The most tokens a mixture-of-experts layer of a model with dynamic dimensions receives
    (its hidden states at their largest, over the hidden size); None: no such layer."""
    public = analysis.layers.value_names
    most = [
        math.prod(extents[public[b.hidden]][1]) // b.hidden_size
        for b in analysis.moe
        if public.get(b.hidden) in extents
    ]
    return max(most) if most else None


def _extents(analysis: Analysis) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The smallest and largest shape of every tensor with a dynamic dimension, by public
    name (none for a model without dynamic dimensions)."""
    cm = analysis.captured
    if cm.program is None:
        return {}

    public = analysis.layers.value_names
    found = extents(cm.program, public, cm.ranges)
    return {public[name]: bounds for name, bounds in found.items()}


def experts_section(moe: Experts, config: CompileConfig) -> dict:
    """``plan.json``'s ``experts``: each MoE layer found, and the activation trace planned with."""
    return {
        "mode": config.experts,
        "layers": [{"layer": b.name, **b.describe()} for b in moe.blocks],
        "trace": moe.trace.to_dict(),
    }


def generation_section(analysis: Analysis, plan):
    """``plan.json``'s ``generation`` (a `mopar.bundle.generation.GenerationSpec`; None: not
    ``--generate``): the step's names; the main function, the first of ``plan``'s path, runs
    the whole path and calls the functions its dispatches call (the expert functions)."""

    names = analysis.generation
    if names is None:
        return None
    path = [f.name for f in plan.path()]
    return GenerationSpec(
        function=path[0],
        path=tuple(path),
        callees=tuple(c.name for name in path for c in plan.callees(name)),
        input_ids=names.input_ids,
        logits=names.logits,
        cache=tuple(CachePair(past=p, present=o, axis=names.axis) for p, o in names.cache),
        max_seq_len=names.max_seq_len,
        vocab_size=names.vocab_size,
        eos_token_ids=names.eos_token_ids,
    )


def bundle_document(analysis: Analysis, planned, watch: Stopwatch, **sections):
    """``plan.json`` (a `mopar.bundle.document.BundleDocument`): the plan, the given sections,
    the layers and the stages' seconds so far, stamped with the versions that made it."""

    return BundleDocument(
        **stamp(),
        plan=planned.to_dict(),
        **sections,
        layers=tuple(
            LayerSummary(
                name=la.name,
                type=la.module_type,
                param_bytes=la.param_bytes,
                flops=la.flops,
                output_bytes=la.output_bytes,
            )
            for la in analysis.layers.layers
        ),
        stages=tuple(StageSeconds(stage=t.stage, seconds=t.seconds) for t in watch.times()),
    )


def write_partial(
    root: Path, analysis: Analysis, planned, until: str, watch: Stopwatch, **sections
) -> None:
    """The ``plan.json`` of a compile stopped after stage ``until``."""
    bundle_document(analysis, planned, watch, until=until, **sections).write(root)


def write_graphs(root: Path, units) -> None:
    """Each unit's FX code, ``functions/<unit>/graph.py``, to read (not to run)."""
    for s in units:
        folder = root / "functions" / s.name
        folder.mkdir(parents=True, exist_ok=True)
        args = ", ".join(t.name for t in s.inputs)
        head = (
            f"# {s.name}: the FX code of this unit's forward({args}), as `mopar compile "
            "--until rewrite` left it; it returns " + ", ".join(t.name for t in s.outputs)
        )
        (folder / "graph.py").write_text(f"{head}\n{s.gm.code.strip()}\n")


def public_outputs(analysis: Analysis) -> dict[str, str]:
    """The model's public output names and the layer-graph value of each."""

    return dict(zip(analysis.captured.output_names, output_values(analysis.layers)))
