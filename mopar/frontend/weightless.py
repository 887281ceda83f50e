"""Models without weights: planned from their shapes, never from their values.

A model the size of the ones that most need cutting (7B parameters, 8x7B experts) does not fit
the machine that plans it, and planning needs none of its values: each layer's parameter count
and bytes, its FLOPs and the sizes of what it hands on are all in its shapes. Two sources give
such a model:

* a transformers config (a ``config.json`` file, or a model folder that holds one): the model
  is built on the meta device (`load_config`), in the dtype the config names;
* a ``.pt2`` that ``torch.export.save`` wrote of a model on the meta device (torch 2.13 saves
  and loads its weights as shapes alone).

`capture_weightless` exports such a model on example inputs on the meta device: torch then
computes every shape and dtype, and no value. The captured model has no reference outputs
(``reference`` is empty): only ``mopar plan`` takes it; compile refuses it as it loads
(`mopar.frontend.load`), naming the fix, because it would verify and measure values.

Read in this order: `is_weightless`, `load_config`, `capture_weightless`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import fx
from torch.utils import _pytree as pytree

from mopar._quiet import quiet_libraries
from mopar.config import DynamicDim
from mopar.errors import CaptureError, InputSpecError, ModelLoadError, Option

if TYPE_CHECKING:
    from mopar.frontend.capture import CapturedModel
    from mopar.frontend.load import LoadedModel

__all__ = ["CONFIG_FILE", "config_path", "is_weightless", "load_config", "capture_weightless"]

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
"""The file a transformers model folder keeps its config in."""


def is_weightless(tensors: list[tuple[str, Any]]) -> bool:
    """Whether any of the named ``tensors`` (a model's parameters and buffers) lies on the meta
    device: it holds shapes but no values."""
    return any(isinstance(t, torch.Tensor) and t.is_meta for _, t in tensors)


# --- transformers configs -------------------------------------------------------------------------


def config_path(path: Path) -> Path | None:
    """The transformers config ``path`` names (a ``.json`` file, or a folder holding
    ``config.json``), else None."""
    if path.is_dir():
        found = path / CONFIG_FILE
        return found if found.is_file() else None
    return path if path.is_file() and path.suffix == ".json" else None


def load_config(path: Path) -> LoadedModel:
    """The model a transformers config describes, built on the meta device in the dtype the
    config names (``dtype``, formerly ``torch_dtype``; float32 where it names none), in eval
    mode and without its key-value cache.

    Raises:
        ModelLoadError: transformers is not installed, the file is no config it reads, or it
            describes no model transformers can build; the message says what to do.
    """
    from mopar.frontend.load import LoadedModel

    config = _read_config(path)
    dtype = _dtype(config, path)
    with quiet_libraries():
        import transformers

        config.use_cache = False  # a cache is no tensor a slice could hand on
        model = None
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                with torch.device("meta"):
                    model = auto.from_config(config, dtype=dtype)
                break
            except (ValueError, KeyError):  # no causal-LM head for this architecture
                continue
    if model is None:
        raise ModelLoadError(
            f"transformers builds no model of type {config.model_type!r} from {str(path)!r}; "
            "give a config of a model transformers knows, or export the model with "
            "torch.export.save and give the .pt2"
        )
    model.eval()
    name = path.parent.name if path.name == CONFIG_FILE else path.stem
    return LoadedModel(name=name or "model", kind="config", module=model, weightless=True)


def _read_config(path: Path):
    try:
        import transformers
    except ImportError:
        raise ModelLoadError(
            f"{str(path)!r} is a transformers config; pip install transformers to read it"
        ) from None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{str(path)!r} is not readable JSON ({type(exc).__name__}: {exc}); give a "
            "transformers config.json"
        ) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelLoadError(
            f"{str(path)!r} has no model_type, so it is not a transformers config; give the "
            "config.json of a transformers model (or its folder)"
        )
    try:
        with quiet_libraries():
            return transformers.AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"transformers cannot read {str(path)!r} ({type(exc).__name__}: {exc}); check "
            "model_type, or upgrade transformers"
        ) from None


def _dtype(config: Any, path: Path) -> torch.dtype:
    """The dtype the config's weights are stored in (float32 where it names none)."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if named is None or isinstance(named, torch.dtype):
        return named or torch.float32
    dtype = getattr(torch, str(named).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(
            f"{str(path)!r} names dtype {named!r}, which is no torch dtype; write float32, "
            "float16 or bfloat16"
        )
    return dtype


# --- capture --------------------------------------------------------------------------------------


def _capture_module():
    """`mopar.frontend.capture`, whose helpers bind and name a model's inputs and outputs here
    as for a model with weights (imported late: it imports this module's caller; and the
    package's ``capture`` names its function)."""
    import importlib

    return importlib.import_module("mopar.frontend.capture")


def capture_weightless(
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
    cap = _capture_module()

    if dims:
        raise InputSpecError(
            f"model {model.name!r} has no weights, and is planned at its example inputs' "
            "sizes only; leave out ",
            Option("dynamic"),
        )
    if model.exported is not None:
        cap._check_inference(model.exported, model)
        ep, inputs = model.exported, cap._bind_pt2(model, arrays)
    else:
        with cap._eval_mode(model.module) as trained:
            kwargs = cap._bind_module(model.module, arrays, model.name)
            inputs = {k: v.numpy() for k, v in kwargs.items()}
            meta = {k: v.to("meta") for k, v in kwargs.items()}
            ep = cap._export(model.module, meta, is_script=model.kind == "torchscript")
        if trained:
            notes = (*notes, cap._trained_note(model, trained))
    gm = cap._tensor_inputs_only(ep.module(check_guards=False))
    _check_static(gm, model.name)
    out_names = _output_names(ep, gm)
    cap._check_computes(gm, model.name, list(inputs))
    notes = (
        *notes,
        f"{model.name} has no weights (meta device): planned from its shapes and byte counts "
        "alone; compile needs the weights",
    )
    return cap.CapturedModel(
        name=model.name,
        gm=gm,
        input_names=tuple(inputs),
        output_names=out_names,
        inputs=inputs,
        reference={},
        notes=notes,
        index_ranges=cap._index_ranges(gm, inputs),
    )


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
    cap = _capture_module()

    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = [
        a.meta.get("val") if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(out.args[0])
    ]
    paths = cap._output_paths(ep, flat) or [()] * len(flat)
    names: dict[str, None] = {}
    for path, leaf in zip(paths, flat, strict=True):
        if isinstance(leaf, torch.Tensor):
            names[cap._leaf_name(path, len(names), names)] = None
    return tuple(names)
