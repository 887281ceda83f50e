"""Llama-shaped decoders at the sizes that need partitioning most, handed over as users do.

==================  ====================================================  ==========  =========
name                shape                                                 parameters  float32
==================  ====================================================  ==========  =========
``llama374m``       hidden 1024, 24 layers, 16 heads, FFN 2816             373,867,520  1.50 GB
``tinyllama1b``     TinyLlama-1.1B: hidden 2048, 22 layers, 32 heads,    1,100,048,384  4.40 GB
                    4 KV heads, FFN 5632
``llama2g``         hidden 2048, 8 layers, 16 heads, FFN 5632             542,148,608  2.17 GB
``llama_tiny``      hidden 32, 2 layers, 4 heads, 2 KV heads, FFN 64,          26,784  0.11 MB
                    vocabulary 128
==================  ====================================================  ==========  =========

Each is a ``transformers`` ``LlamaForCausalLM`` from a ``LlamaConfig`` (vocabulary 32,000 for
the two big ones, untied input and output embeddings), with seeded random weights (transformers'
own initialisation under a fixed seed: no download) and ``use_cache=False``, in ``eval()`` mode.
It takes ``input_ids`` (1xSEQ int64) and returns the logits (1xSEQxVOCAB float32; the output
object holds nothing else, so torch.export flattens it to that one tensor).

Handing over: ``python -m examples.llm save NAME OUT.pt2 [--seq 64]`` builds the model and
saves ``torch.export.export(model, (), {"input_ids": ...})`` with ``torch.export.save`` in that
process of its own; ``mopar compile OUT.pt2`` later meets the file as a user's fresh process
does (the .pt2 carries its example input). `save_in_subprocess` runs that command.

Building needs the model's float32 bytes and as much again for exporting and writing: about
3.5 GB of memory for ``llama374m`` and 9 GB for ``tinyllama1b``; the files are 1.5 and 4.4 GB.
Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "LlmShape",
    "SHAPES",
    "llama",
    "llama374m",
    "tinyllama1b",
    "llama2g",
    "llama_tiny",
    "save",
]

SEED = 0
SEQ = 64
"""The example input's sequence length, tokens."""


@dataclass(frozen=True, kw_only=True)
class LlmShape:
    """One Llama shape (a ``LlamaConfig``'s size fields).

    Attributes:
        hidden: hidden size.
        layers: decoder layers.
        heads: attention heads.
        kv_heads: key/value heads (grouped-query attention when fewer than ``heads``).
        intermediate: the MLP's inner size.
        vocab: vocabulary size (the embedding's and the logits' rows).
        max_positions: the longest sequence the rotary embedding is set up for, tokens.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000
    max_positions: int = 2048

    def parameters(self) -> int:
        """The parameter count of ``LlamaForCausalLM`` at this shape (untied embeddings)."""
        head = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


SHAPES: dict[str, LlmShape] = {
    "llama374m": LlmShape(hidden=1024, layers=24, heads=16, kv_heads=16, intermediate=2816),
    "tinyllama1b": LlmShape(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632),
    "llama2g": LlmShape(hidden=2048, layers=8, heads=16, kv_heads=16, intermediate=5632),
    "llama_tiny": LlmShape(
        hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128, max_positions=64
    ),
}


def llama(shape: LlmShape, *, seed: int = SEED, attn_implementation: str = "sdpa") -> nn.Module:
    """``LlamaForCausalLM`` of ``shape`` with seeded random weights, ``use_cache=False``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples._common import build

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return build(lambda: LlamaForCausalLM(config), seed=seed)


def llama374m() -> nn.Module:
    """The 374M-parameter Llama (1.5 GB of float32 weights)."""
    return llama(SHAPES["llama374m"])


def tinyllama1b() -> nn.Module:
    """TinyLlama-1.1B's shape (4.4 GB of float32 weights)."""
    return llama(SHAPES["tinyllama1b"])


def llama2g() -> nn.Module:
    """A 542M-parameter Llama (2.17 GB of float32 weights; ``--dtype bfloat16``: 1.08 GB)."""
    return llama(SHAPES["llama2g"])


def llama_tiny() -> nn.Module:
    """A 2-layer Llama of hidden size 32 and a 128-token vocabulary, for tests."""
    return llama(SHAPES["llama_tiny"])


def input_spec(name: str, seq: int = SEQ) -> str:
    """The ``--input`` spec of model ``name``'s example input (token ids below its vocabulary)."""
    return f"input_ids=1x{seq}:int64:0..{SHAPES[name].vocab}"


def save(name: str, path: Path, *, seq: int = SEQ, dtype: str = "float32") -> Path:
    """Build model ``name`` (its weights cast to ``dtype``), export it on a 1x``seq`` example
    input and ``torch.export.save`` it at ``path``; returns ``path``. Call it in a process of
    its own (see the module docstring)."""
    import torch

    from mopar.frontend.inputs import make_example_arrays, parse_input_spec

    if name not in SHAPES:
        raise KeyError(f"no model {name!r}; examples.llm has {', '.join(SHAPES)}")
    module = globals()[name]().to(getattr(torch, dtype))
    arrays = make_example_arrays((parse_input_spec(input_spec(name, seq)),), seed=SEED)
    kwargs = {k: torch.from_numpy(v) for k, v in arrays.items()}
    with torch.no_grad():
        exported = torch.export.export(module, (), kwargs, strict=False)
    del module  # the exported program holds the weights; the module's are the same tensors
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(exported, str(path))
    return path


_ROOT = Path(__file__).resolve().parent.parent


def save_in_subprocess(
    name: str, path: Path, *, seq: int = SEQ, timeout: float = 1800
) -> subprocess.CompletedProcess:
    """``python -m examples.llm save NAME PATH --seq SEQ`` in a fresh process."""
    pythonpath = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run(
        [sys.executable, "-m", "examples.llm", "save", name, str(path), "--seq", str(seq)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=_ROOT,
        env={**env, "PYTHONPATH": pythonpath},
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.llm",
        description="Save a Llama-shaped model as a .pt2 (save), or list the shapes (list).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save", help="build NAME and torch.export.save it at OUT")
    saving.add_argument("name", choices=list(SHAPES), metavar="NAME")
    saving.add_argument("out", type=Path, metavar="OUT.pt2")
    saving.add_argument("--seq", type=int, default=SEQ, help=f"tokens (default {SEQ})")
    saving.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    commands.add_parser("list", help="print each shape's parameters and float32 bytes")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, shape in SHAPES.items():
            n = shape.parameters()
            print(f"{name:12} {n:>14,} parameters {4 * n / 1e9:8.3f} GB float32")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    save(args.name, args.out, seq=args.seq, dtype=args.dtype)
    n = SHAPES[args.name].parameters()
    print(
        f"wrote {args.out}: {args.name}, {n:,} parameters, input {input_spec(args.name, args.seq)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
