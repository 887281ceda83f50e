"""A decoder's generation step, as one exportable module with its key-value cache as tensors.

``mopar compile MODEL --generate`` compiles a step, not the model's forward: the token ids of
this step (a prompt, or one token) and the cache of the tokens before it, in; the next token's
logits and the cache grown by this step, out. The main function feeds the cache it gets back
into the next step (`mopar.runtime.generate`), so the cache is plain tensors in and out of
every function, as onnxruntime needs: it keeps no state between runs.

transformers' own export helpers (``transformers.integrations.executorch``) export either a
static cache held in buffers that each step mutates (which an ONNX model cannot carry from one
run to the next) or a prefill with an empty ``DynamicCache``. The step here builds transformers'
own ``DynamicCache`` from its cache inputs inside ``forward``, so that the model's attention and
masks are transformers' own, and one program serves both the prefill (the cache 0 tokens long)
and every decoding step: both the step's tokens and the cache's length are dynamic.

Read in this order: `DecoderStep`, `decoder_step`.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mopar._quiet import quiet_libraries
from mopar.bundle.layout import TOKENIZER_FILE
from mopar.config import DynamicDim
from mopar.errors import ModelLoadError, Option, OptionError
from mopar.frontend.dtypes import numpy_dtype

if TYPE_CHECKING:
    from mopar.frontend.load import LoadedModel

__all__ = [
    "DecoderStep",
    "StepNames",
    "decoder_step",
    "generation_step",
    "DEFAULT_MAX_SEQ_LEN",
    "PROMPT_TOKENS",
]

DEFAULT_MAX_SEQ_LEN = 256
"""Prompt and generated tokens together, where neither ``--max-seq-len`` nor a smaller
``max_position_embeddings`` of the model bounds them."""

PROMPT_TOKENS = 8
"""The example step's tokens: the plan is priced on a step of this many tokens after a cache
of half the sequence."""

INPUT_IDS = "input_ids"
SEQ_AXIS = 2
"""The sequence axis of a cache tensor: transformers' ``[batch, kv heads, tokens, head dim]``."""


@dataclass(frozen=True, kw_only=True)
class StepNames:
    """The step's tensors by their model-level names: the token ids input, the logits output,
    and each cache input with the output that replaces it (``past_0`` -> ``output_1``), along
    ``axis``."""

    input_ids: str
    logits: str
    cache: tuple[tuple[str, str], ...]
    axis: int
    max_seq_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Path | None = None


@dataclass(frozen=True, kw_only=True)
class DecoderStep:
    """A step module, its example inputs, the dimensions that stay dynamic, and its names."""

    module: nn.Module
    example: dict[str, np.ndarray]
    dims: tuple[DynamicDim, ...]
    names: StepNames


class _Step(nn.Module):
    """``forward(input_ids, past_0, past_1, ...)`` -> ``(logits, present_0, present_1, ...)``:
    past_2i and past_2i+1 are layer i's keys and values. `_step_module` gives ``forward`` its
    signature of named cache tensors: capture and torch.export bind inputs by name.

    A cache of a type numpy lacks (bfloat16) comes in as its carried type (float32, which holds
    each of its values exactly: the step's outputs are the cache grown) and is cast back to
    the model's type here."""

    def __init__(self, model: nn.Module, layers: int, max_seq_len: int, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.layers = layers
        self.last_position = max_seq_len - 1
        self.dtype = dtype

    def step(self, input_ids: torch.Tensor, past: list[torch.Tensor]):
        from transformers import DynamicCache

        past = [p.to(self.dtype) for p in past]
        cache = DynamicCache(config=self.model.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        start = past[0].shape[SEQ_AXIS]
        # Positions past the sequence never come in a request (the runtime refuses them);
        # clamping keeps a model with learned positions defined at the verify's largest sizes.
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        positions = positions.clamp(max=self.last_position)
        out = self.model(
            input_ids=input_ids,
            past_key_values=cache,
            position_ids=positions.unsqueeze(0),
            cache_position=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        grown = []
        for layer in out.past_key_values.layers:
            grown += [layer.keys, layer.values]
        return (out.logits[:, -1, :], *grown)


def _step_module(model: nn.Module, tensors: int, max_seq_len: int, dtype: torch.dtype):
    """A `_Step` whose ``forward`` takes ``input_ids, past_0, ..., past_<tensors - 1>``."""
    names = [f"past_{k}" for k in range(tensors)]

    def forward(self, input_ids, *args, **kwargs):
        return self.step(input_ids, [*args, *(kwargs[n] for n in names[len(args) :])])

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in ("self", INPUT_IDS, *names)]
    )
    step = type("DecoderStep", (_Step,), {"forward": forward})
    return step(model, tensors // 2, max_seq_len, dtype).eval()


def decoder_step(
    model: nn.Module, *, max_seq_len: int | None, name: str, folder: Path | None = None
) -> DecoderStep:
    """The generation step of ``model``, a transformers causal language model (from
    ``folder``, whose tokenizer, where it has one, the bundle carries).

    Raises:
        ModelLoadError: ``model`` is not a transformers causal LM with a key-value cache.
        OptionError: ``max_seq_len`` is more than the model's positions, or below 2.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        raise ModelLoadError(
            f"model {name!r} is not a transformers causal language model, so it has no "
            "generation step to export; give a transformers model (or its save_pretrained "
            "folder), or compile without ",
            Option("generate", value=True),
        )
    limit = _positions(config)
    seq = max_seq_len or min(DEFAULT_MAX_SEQ_LEN, limit or DEFAULT_MAX_SEQ_LEN)
    if seq < 2 or (limit is not None and seq > limit):
        raise OptionError(
            Option("max_seq_len", value=seq),
            f" is outside what {name!r} takes: 2 to "
            f"{limit if limit is not None else 'any'} tokens (max_position_embeddings); "
            "give a length in that range",
        )
    model.eval()
    shapes = _cache_shapes(model, name)
    dtype = shapes[0][1]
    step = _step_module(model, len(shapes), seq, dtype)
    prompt = min(PROMPT_TOKENS, seq // 2)
    cached = max(1, seq // 2 - prompt)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rng = np.random.default_rng(0)
    example = {INPUT_IDS: rng.integers(0, vocab, (1, prompt), dtype=np.int64)}
    dims = [DynamicDim(input=INPUT_IDS, axis=1, min=1, max=seq)]
    cache = []
    for k, (shape, dtype) in enumerate(shapes):
        past = f"past_{k}"
        full = list(shape)
        full[SEQ_AXIS] = cached
        example[past] = (rng.standard_normal(full) * 0.5).astype(numpy_dtype(dtype))
        dims.append(DynamicDim(input=past, axis=SEQ_AXIS, min=0, max=seq - 1))
        cache.append((past, f"output_{k + 1}"))
    names = StepNames(
        input_ids=INPUT_IDS,
        logits="output_0",
        cache=tuple(cache),
        axis=SEQ_AXIS,
        max_seq_len=seq,
        vocab_size=vocab,
        eos_token_ids=_eos(model),
        tokenizer=_tokenizer(folder),
    )
    return DecoderStep(module=step, example=example, dims=tuple(dims), names=names)


def generation_step(
    model: Any,
    loaded: LoadedModel,
    example_args: Any,
    example_kwargs: Any,
    dims: tuple[DynamicDim, ...],
    max_seq_len: int | None,
) -> tuple[LoadedModel, DecoderStep]:
    """``loaded`` (from source ``model``) as its generation step (`decoder_step`): the step
    module, and the step with its example inputs, dynamic dimensions and names.

    Raises:
        OptionError: example inputs or dynamic dimensions were given too (the step makes its
            own), or the model is no module (a ``.pt2`` holds one forward, not the step).
    """
    if example_args is not None or example_kwargs or dims:
        raise OptionError(
            "with ",
            Option("generate"),
            " the step makes its own example inputs and dynamic dimensions; leave out ",
            Option("example_args", cli="input"),
            " and ",
            Option("dynamic"),
            " (give the length with ",
            Option("max_seq_len"),
            ")",
        )
    if loaded.module is None:
        raise OptionError(
            f"{loaded.name!r} is a {loaded.kind} file, which holds one forward pass, not the "
            "model; with ",
            Option("generate"),
            " give the model as transformers holds it: a save_pretrained folder (config.json "
            "and safetensors) or the model object",
        )
    folder = Path(model) if isinstance(model, (str, os.PathLike)) else None
    step = decoder_step(
        loaded.module,
        max_seq_len=max_seq_len,
        name=loaded.name,
        folder=folder if folder is not None and folder.is_dir() else None,
    )
    return replace(loaded, module=step.module), step


def _positions(config) -> int | None:
    for field in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _cache_shapes(model: nn.Module, name: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Each cache tensor's shape (at 2 tokens) and type, keys and values by layer, from
    one eager step of a 2-token prompt; a model without weights (on the meta device), which
    cannot run, from its config."""
    weights = next(model.parameters(), None)
    if weights is not None and weights.is_meta:
        return _config_cache_shapes(model.config, weights.dtype)
    with torch.no_grad(), quiet_libraries():
        try:
            out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True)
        except Exception as exc:  # noqa: BLE001 - any model's own failure, reported as one line
            raise ModelLoadError(
                f"model {name!r} does not run a 2-token prompt with its cache "
                f"({type(exc).__name__}: {exc}); give a transformers causal language model"
            ) from None
    layers = getattr(getattr(out, "past_key_values", None), "layers", None)
    if not layers or any(getattr(la, "keys", None) is None for la in layers):
        raise ModelLoadError(
            f"model {name!r} returns no key-value cache of one tensor pair per layer "
            f"({type(getattr(out, 'past_key_values', None)).__name__}); only decoders with "
            "transformers' DynamicCache are generated yet: compile without ",
            Option("generate", value=True),
        )
    return [(tuple(t.shape), t.dtype) for la in layers for t in (la.keys, la.values)]


def _tokenizer(folder: Path | None) -> Path | None:
    """The model folder's tokenizer file (`TOKENIZER_FILE`), where it has one."""
    found = folder / TOKENIZER_FILE if folder is not None else None
    return found if found is not None and found.is_file() else None


def _config_cache_shapes(config, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The cache a transformers config describes: per layer, keys and values of
    ``[1, kv heads, 2, head dim]``."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return [((1, kv, 2, dim), dtype)] * (2 * config.num_hidden_layers)


def _eos(model: nn.Module) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
