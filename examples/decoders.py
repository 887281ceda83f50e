"""transformers mixtures of experts for text generation, handed over as ``save_pretrained``
folders: the shapes of `examples.moe`'s ``mixtral_small`` and ``qwen2_moe_small``, built as
``transformers`` models (which carry a key-value cache, so ``mopar compile --generate`` takes
them).

==================  ==============================================================  ==========
name                shape                                                           parameters
==================  ==============================================================  ==========
``mixtral_small``   ``MixtralForCausalLM``: hidden 512, 2 layers, 8 heads, 8 experts     52.7M
                    top-2 of expert FFN 2048, vocabulary 256
``qwen2_moe_small`` ``Qwen2MoeForCausalLM``: hidden 512, 2 layers, 8 heads, 8 experts    33.8M
                    top-2 of expert FFN 1024, a gated shared expert of FFN 2048,
                    vocabulary 256
``mixtral_wide``    ``MixtralForCausalLM``: hidden 1024, 2 layers, 16 heads, 8 experts   210M
                    top-2 of expert FFN 4096, vocabulary 256: experts 96% of the
                    weights, each token's step some ten times ``mixtral_small``'s
==================  ==============================================================  ==========

Random weights under a fixed seed (transformers' own initialisation: no download); routers are
transformers' own, without `examples.moe`'s synthetic Zipf bias. ``python -m examples.decoders
save NAME DIR`` writes the folder in a process of its own, with ``expected.json``: a 16-token
prompt and the 32 tokens ``model.generate(do_sample=False)`` gives after it. Importing this
module imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

SEED = 0
PROMPT = 16
NEW_TOKENS = 32
NAMES = ("mixtral_small", "qwen2_moe_small", "mixtral_wide")


def config(name: str):
    """The transformers config of ``name``."""
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        num_experts_per_tok=2,
    )
    if name == "mixtral_small":
        return transformers.MixtralConfig(intermediate_size=2048, num_local_experts=8, **common)
    if name == "mixtral_wide":
        wide = {**common, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16}
        return transformers.MixtralConfig(intermediate_size=4096, num_local_experts=8, **wide)
    if name == "qwen2_moe_small":
        return transformers.Qwen2MoeConfig(
            intermediate_size=2048,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=2048,
            num_experts=8,
            norm_topk_prob=False,
            **common,
        )
    raise KeyError(f"no model {name!r}; examples.decoders has {', '.join(NAMES)}")


def save(name: str, folder: Path) -> Path:
    """Build ``name`` and ``save_pretrained`` it at ``folder`` with ``expected.json``."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config(name)).eval()
    model.save_pretrained(folder)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT))
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = {"prompt": prompt[0].tolist(), "tokens": tokens[0, PROMPT:].tolist()}
    (folder / "expected.json").write_text(json.dumps(expected))
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.decoders",
        description="Save a transformers MoE decoder as a save_pretrained folder.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save", help="build NAME and save_pretrained it at DIR")
    saving.add_argument("name", choices=NAMES, metavar="NAME")
    saving.add_argument("out", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    save(args.name, args.out)
    print(f"wrote {args.out}: {args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
