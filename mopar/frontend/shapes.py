"""Capture a model without weights from its shapes alone (`mopar.frontend.weightless`).

`capture` is the frontend's one entry: a model with weights is captured on its values
(`mopar.frontend.capture.capture`: exported, run for its reference outputs); one without
(`LoadedModel.weightless`) is exported on its example inputs moved to the meta device
(`capture_shapes`), where torch computes every tensor's shape and dtype and no value. Its
captured model has no reference outputs (``reference`` is empty): only planning takes it.

Read in this order: `capture`, `capture_shapes`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import fx
from torch.utils import _pytree as pytree

from mopar.config import DynamicDim
from mopar.errors import CaptureError, InputSpecError, Option
from mopar.frontend import dtypes
from mopar.frontend.capture import (
    CapturedModel,
    bind_module,
    bind_pt2,
    check_computes,
    check_inference,
    eval_mode,
    export_program,
    index_ranges_of,
    leaf_name,
    output_paths,
    program_inputs,
    tensor_inputs_only,
    trained_note,
    user_input_values,
)
from mopar.frontend.capture import capture as capture_values
from mopar.frontend.load import LoadedModel

__all__ = ["capture", "capture_shapes"]


def capture(
    model: LoadedModel,
    arrays: dict[str, np.ndarray] | None,
    *,
    notes: tuple[str, ...] = (),
    dims: tuple[DynamicDim, ...] = (),
) -> CapturedModel:
    """``model`` captured: on its values (`mopar.frontend.capture.capture`), or from its shapes
    where it has no weights (`capture_shapes`)."""
    if model.weightless:
        return capture_shapes(model, arrays, notes=notes, dims=dims)
    return capture_values(model, arrays, notes=notes, dims=dims)


def capture_shapes(
    model: LoadedModel,
    arrays: dict[str, np.ndarray] | None,
    *,
    notes: tuple[str, ...] = (),
    dims: tuple[DynamicDim, ...] = (),
) -> CapturedModel:
    """Export ``model`` (without weights) on ``arrays`` moved to the meta device: the graph
    with every tensor's shape and dtype, computed without a value.

    Raises:
        InputSpecError: ``dims`` were given: such a model is planned at its example's sizes.
        CaptureError: as `mopar.frontend.capture.capture` would.
    """
    if dims:
        raise InputSpecError(
            f"model {model.name!r} has no weights, and is planned at its example inputs' "
            "sizes only; leave out ",
            Option("dynamic"),
        )
    if model.exported is not None:
        check_inference(model.exported, model)
        if not arrays and model.stored_inputs is not None:
            arrays = _stored_shapes(model.exported, model.stored_inputs)
        ep, inputs = model.exported, bind_pt2(model, arrays)
    else:
        with eval_mode(model.module) as trained:
            kwargs = bind_module(model.module, arrays, model.name)
            inputs = {k: v.numpy() for k, v in kwargs.items()}
            meta = {k: v.to("meta") for k, v in kwargs.items()}
            ep = export_program(model.module, meta, is_script=model.kind == "torchscript")
        if trained:
            notes = (*notes, trained_note(model, trained))
    # bfloat16 weights are planned as compile holds them (`mopar.frontend.dtypes`)
    gm, widened = dtypes.float32_compute(tensor_inputs_only(ep.module(check_guards=False)))
    _check_static(gm, model.name)
    out_names = _output_names(ep, gm)
    check_computes(gm, model.name, list(inputs))
    notes = (
        *notes,
        f"{model.name} has no weights (meta device): planned from its shapes and byte counts "
        "alone; compile needs the weights",
        *((widened.note,) if widened.note else ()),
    )
    return CapturedModel(
        name=model.name,
        gm=gm,
        input_names=tuple(inputs),
        output_names=out_names,
        inputs=inputs,
        reference={},
        notes=notes,
        index_ranges=index_ranges_of(gm, inputs),
    )


def _stored_shapes(ep: torch.export.ExportedProgram, stored: Any) -> dict[str, np.ndarray]:
    """The example inputs a .pt2 stores, by input name: as stored, or zeros of their shape and
    dtype where they are on the meta device (a model exported there has no values to keep)."""
    leaves = dict(zip(user_input_values(ep), pytree.tree_leaves(stored)))
    return {
        name: np.zeros(tuple(t.shape), dtype=torch.empty(0, dtype=t.dtype).numpy().dtype)
        if t.is_meta
        else t.detach().numpy()
        for name, t in ((n, leaves[n]) for n in program_inputs(ep))
    }


def _check_static(gm: fx.GraphModule, name: str) -> None:
    """Refuse a graph that computes sizes (exported with dynamic shapes): fixing them at the
    example's would run the graph."""
    sizes = [
        n
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
    ]
    if sizes:
        raise CaptureError(
            f"model {name!r} has no weights and was exported with dynamic dimensions "
            f"({sizes[0].name} is a size computed from its inputs); export it again without "
            "dynamic_shapes, on example inputs of the size to plan for"
        )


def _output_names(ep: torch.export.ExportedProgram, gm: fx.GraphModule) -> tuple[str, ...]:
    """The names of ``gm``'s tensor outputs, as `mopar.frontend.capture` names a model's
    outputs (by their key path in the output tree, else by position), read from the traced
    values of its output node."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = [
        a.meta.get("val") if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(out.args[0])
    ]
    paths = output_paths(ep, flat) or [()] * len(flat)
    names: dict[str, None] = {}
    for path, leaf in zip(paths, flat, strict=True):
        if isinstance(leaf, torch.Tensor):
            names[leaf_name(path, len(names), names)] = None
    return tuple(names)
