"""Transformer encoder examples: Hugging Face ``BertModel`` and ``DistilBertModel``, randomly
initialised from a seed (no download; ``transformers`` is imported inside the factories).

==============  ============================================================  ===========
factory         model                                                         parameters
==============  ============================================================  ===========
``bert_mini``   BERT-Mini: 4 layers, hidden 256, 4 heads, FFN 1024, pooler     11,170,560
``bert_small``  BERT-Small: 4 layers, hidden 512, 8 heads, FFN 2048, pooler    28,763,648
``distilbert``  DistilBERT-base: 6 layers, hidden 768, 12 heads, FFN 3072      66,362,880
``bert``        BERT-base: 12 layers, hidden 768, 12 heads, FFN 3072, pooler  109,482,240
==============  ============================================================  ===========

BERT-Mini and BERT-Small are the shapes of Turc et al.'s compact BERTs ("Well-Read Students
Learn Better", 2019), here with BERT-base's vocabulary; with DistilBERT and BERT-base they make the
four transformers of increasing size of the paper's suite.

Inputs: ``input_ids`` 1x128 int64 (token ids below the vocabulary size, 30522) and
``attention_mask`` 1x128 int64 (1 = real token, 0 = padding). The models return the Hugging Face
output object (``last_hidden_state``, plus ``pooler_output`` for BERT); torch.export flattens it
to a tuple of tensors. The ``<name>_tiny`` companions have hidden size 64, 2 layers, 2 heads and a
1000-token vocabulary (``bert_mini_tiny`` and ``bert_small_tiny``: hidden 32 and 48).

Attention uses ``attn_implementation="eager"`` (explicit matmul + softmax). ``"sdpa"`` exports and
matches too, but leaves a larger ONNX graph (extra IsNaN/Where nodes from its masking).
"""

from __future__ import annotations

from torch import nn

from examples._common import build

__all__ = [
    "bert",
    "bert_tiny",
    "bert_mini",
    "bert_mini_tiny",
    "bert_small",
    "bert_small_tiny",
    "distilbert",
    "distilbert_tiny",
]


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
    return bert(
        hidden=64, num_layers=2, num_heads=2, intermediate=128, vocab_size=1000, max_positions=128
    )


def bert_mini(*, seed: int = 0) -> nn.Module:
    """BERT-Mini: 4 layers, hidden 256, 4 heads (11.2M parameters)."""
    return bert(hidden=256, num_layers=4, num_heads=4, intermediate=1024, seed=seed)


def bert_mini_tiny() -> nn.Module:
    """2-layer BERT of hidden size 32 (a 1000-token vocabulary); inputs 1x128."""
    return bert(
        hidden=32, num_layers=2, num_heads=2, intermediate=64, vocab_size=1000, max_positions=128
    )


def bert_small(*, seed: int = 0) -> nn.Module:
    """BERT-Small: 4 layers, hidden 512, 8 heads (28.8M parameters)."""
    return bert(hidden=512, num_layers=4, num_heads=8, intermediate=2048, seed=seed)


def bert_small_tiny() -> nn.Module:
    """2-layer BERT of hidden size 48 (a 1000-token vocabulary); inputs 1x128."""
    return bert(
        hidden=48, num_layers=2, num_heads=2, intermediate=96, vocab_size=1000, max_positions=128
    )


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
    return distilbert(
        hidden=64, num_layers=2, num_heads=2, intermediate=128, vocab_size=1000, max_positions=128
    )
