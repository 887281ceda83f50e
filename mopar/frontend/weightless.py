"""Models without weights: planned from their shapes, never from their values.

A model the size of the ones that most need cutting (7B parameters, 8x7B experts) does not fit
the machine that plans it, and planning needs none of its values: each layer's parameter count
and bytes, its FLOPs and the sizes of what it hands on are all in its shapes. Two sources give
such a model:

* a transformers config (a ``config.json`` file, or a model folder that holds one): the model
  is built on the meta device (`load_config`), in the dtype the config names;
* a ``.pt2`` that ``torch.export.save`` wrote of a model on the meta device (torch 2.13 saves
  and loads its weights as shapes alone).

`mopar.frontend.load` takes such a model only where its caller asks (``mopar plan``), and
compile refuses it as it loads, naming the fix: it would verify and measure values.
`mopar.frontend.shapes` captures it on the meta device.

The same config, in a folder ``save_pretrained`` wrote with its safetensors weights, is a model
with weights (`load_pretrained`): compile loads it, and plans it from its config alone.

Read in this order: `is_weightless`, `config_path`, `load_config`, `load_pretrained`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mopar._quiet import quiet_libraries
from mopar.errors import ModelLoadError

__all__ = [
    "CONFIG_FILE",
    "config_path",
    "config_name",
    "is_weightless",
    "load_config",
    "load_pretrained",
    "pretrained_weights",
]

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


def config_name(path: Path) -> str:
    """A config's model name: its folder's for a ``config.json``, else the file's stem."""
    return (path.parent.name if path.name == CONFIG_FILE else path.stem) or "model"


def load_config(path: Path) -> nn.Module:
    """The model a transformers config describes, built on the meta device in the dtype the
    config names (``dtype``, formerly ``torch_dtype``; float32 where it names none), in eval
    mode and without its key-value cache.

    Raises:
        ModelLoadError: transformers is not installed, the file is no config it reads, or it
            describes no model transformers can build; the message says what to do.
    """
    config = _read_config(path)
    dtype = _dtype(config, path)
    with quiet_libraries():
        import transformers

        config.use_cache = False  # a cache is no tensor a slice could hand on
        model = None
        for auto in _classes(config, transformers):
            build = auto.from_config if auto.__name__.startswith("Auto") else auto._from_config
            try:
                with torch.device("meta"):
                    model = build(config, dtype=dtype)
                break
            except (ValueError, KeyError):  # no causal-LM head for this architecture
                continue
    if model is None:
        raise ModelLoadError(
            f"transformers builds no model of type {config.model_type!r} from {str(path)!r}; "
            "give a config of a model transformers knows, or export the model with "
            "torch.export.save and give the .pt2"
        )
    return model.eval()


def _classes(config: Any, transformers: ModuleType) -> list[Any]:
    """What to build ``config`` with, in turn: the architecture it names (``architectures``, as
    ``save_pretrained`` writes it: ``BertModel``, not a BERT with a language-model head), where
    transformers has it; then a causal language model; then the base model."""
    named = [getattr(transformers, a, None) for a in (config.architectures or [])[:1]]
    return [
        *(c for c in named if c is not None),
        transformers.AutoModelForCausalLM,
        transformers.AutoModel,
    ]


def pretrained_weights(folder: Path) -> list[Path]:
    """The safetensors weight files of a model folder (none: it holds a config alone)."""
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def load_pretrained(folder: Path) -> nn.Module:
    """The model a ``save_pretrained`` folder holds (the architecture its config names, else a
    causal language model, else the base model), with
    its weights, in the dtype they were saved in, in eval mode.

    Raises:
        ModelLoadError: transformers cannot build or load it; the message says what to do.
    """
    config = _read_config(folder / CONFIG_FILE)
    dtype = _dtype(config, folder)
    with quiet_libraries():
        import transformers

        transformers.utils.logging.disable_progress_bar()  # mopar shows its own progress
        for auto in _classes(config, transformers):
            try:
                model = auto.from_pretrained(folder, dtype=dtype, use_safetensors=True)
                return model.eval()
            except (ValueError, KeyError):  # no causal-LM head for this architecture
                continue
            except (OSError, RuntimeError) as exc:
                raise ModelLoadError(
                    f"transformers cannot load the model in {str(folder)!r} "
                    f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); save it again "
                    "with model.save_pretrained(folder)"
                ) from None
    raise ModelLoadError(
        f"transformers builds no model of type {config.model_type!r} from {str(folder)!r}; "
        "give a folder of a model transformers knows, or a .pt2 that torch.export.save wrote"
    )


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
