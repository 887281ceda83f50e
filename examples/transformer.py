"""Transformer encoder examples: Hugging Face ``BertModel`` and ``DistilBertModel``, randomly
initialised from a seed (no download; ``transformers`` is imported inside the factories).

==============  ============================================================  ===========
factory         model                                                         parameters
==============  ============================================================  ===========
``bert``        BERT-base: 12 layers, hidden 768, 12 heads, FFN 3072, pooler  109,482,240
``distilbert``  DistilBERT-base: 6 layers, hidden 768, 12 heads, FFN 3072      66,362,880
==============  ============================================================  ===========

Inputs: ``input_ids`` 1x128 int64 (token ids below the vocabulary size, 30522) and
``attention_mask`` 1x128 int64 (1 = real token, 0 = padding). The models return the Hugging Face
output object (``last_hidden_state``, plus ``pooler_output`` for BERT); torch.export flattens it
to a tuple of tensors. The ``<name>_tiny`` companions have hidden size 64, 2 layers, 2 heads and a
1000-token vocabulary.

Attention uses ``attn_implementation="eager"`` (explicit matmul + softmax). ``"sdpa"`` exports and
matches too, but leaves a larger ONNX graph (extra IsNaN/Where nodes from its masking).
"""

from __future__ import annotations

from torch import nn

from examples._common import build

__all__ = ["bert", "bert_tiny", "distilbert", "distilbert_tiny"]


def bert(
    *,
    hidden: int = 768,
    num_layers: int = 12,
    num_heads: int = 12,
    intermediate: int = 3072,
    vocab_size: int = 30522,
    max_positions: int = 512,
    attn_implementation: str = "eager",
    seed: int = 0,
) -> nn.Module:
    """BERT-base ``BertModel`` (109.5M parameters at the defaults); inputs ``input_ids`` and
    ``attention_mask``."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        attn_implementation=attn_implementation,
    )
    return build(lambda: BertModel(config), seed=seed)


def bert_tiny() -> nn.Module:
    """2-layer BERT of hidden size 64 (~0.14M parameters); inputs 1x128."""
    return bert(hidden=64, num_layers=2, num_heads=2, intermediate=128, vocab_size=1000,
                max_positions=128)


def distilbert(
    *,
    hidden: int = 768,
    num_layers: int = 6,
    num_heads: int = 12,
    intermediate: int = 3072,
    vocab_size: int = 30522,
    max_positions: int = 512,
    attn_implementation: str = "eager",
    seed: int = 0,
) -> nn.Module:
    """DistilBERT-base ``DistilBertModel`` (66.4M parameters at the defaults)."""
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(
        vocab_size=vocab_size,
        dim=hidden,
        n_layers=num_layers,
        n_heads=num_heads,
        hidden_dim=intermediate,
        max_position_embeddings=max_positions,
        attn_implementation=attn_implementation,
    )
    return build(lambda: DistilBertModel(config), seed=seed)


def distilbert_tiny() -> nn.Module:
    """2-layer DistilBERT of hidden size 64 (~0.14M parameters); inputs 1x128."""
    return distilbert(hidden=64, num_layers=2, num_heads=2, intermediate=128, vocab_size=1000,
                      max_positions=128)
