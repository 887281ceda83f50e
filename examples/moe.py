"""Mixture-of-experts decoder examples: two tiny causal language models in plain torch (no
``transformers``), one Mixtral-style and one Qwen2-MoE-style, with seeded random weights.

=========================  ===========================================================  ==========
factory                    model                                                        parameters
=========================  ===========================================================  ==========
``mixtral_tiny``           Mixtral-style: 8 experts, top-2 (renormalised), expert FFN     460,096
                           128 as stacked ``gate_up_proj``/``down_proj`` tensors
``mixtral_tiny_zipf``      the same with a Zipf-skewed router (router bias)               460,112
``qwen2_moe_tiny``         Qwen2-MoE-style: 8 experts, top-2 (not renormalised), expert   312,768
                           FFN 64 as one ``ExpertMLP`` per expert, + gated shared expert
                           of FFN 128
``qwen2_moe_tiny_zipf``    the same with a Zipf-skewed router (router bias)               312,784
=========================  ===========================================================  ==========

Common shape: vocabulary 256, hidden 64, 2 decoder layers, 4 heads, RMSNorm, causal
``scaled_dot_product_attention``, untied ``lm_head``. Each layer is
``h = x + attn(norm1(x)); out = h + moe(norm2(h))``. Inputs: ``input_ids`` [B, S] int64 (ids below
256) and ``attention_mask`` [B, S] int64 of ones (accepted and ignored: attention is causal only).
The models return the logits tensor [B, S, 256]. Every expert runs densely on every token and is
weighted by its (mostly zero) routing weight, so ``forward`` has no data-dependent control flow
and ``torch.export.export(..., strict=False)`` captures it at any batch and sequence length.

Routing skew: an untrained router spreads tokens fairly evenly over the experts (what unevenness
remains comes from the Zipf-distributed calibration tokens). Real MoE routers do not, so
``router="zipf"`` gives the router a bias ``ZIPF_ALPHA * log(p_e)`` (alpha 2.0, router weights of
std 0.25) with ``p_e ∝ 1 / (e + 1) ** 1.1``: expert 0 is the most popular and expert 7 the least.
**That skew is synthetic** (a hand-set bias, not learnt), so any figure measured on the ``*_zipf``
variants must say so. Layer-0 top-2 hits per expert on the shipped calibration tokens
(`CALIBRATION`, [256, 32], written by ``python -m examples.moe --write-calibration``), most / least
popular expert: ``mixtral_tiny`` 3.7x, ``mixtral_tiny_zipf`` 14.1x, ``qwen2_moe_tiny`` 3.4x,
``qwen2_moe_tiny_zipf`` 35.7x, with every expert chosen at least 170 times in each.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from examples._common import build

__all__ = [
    "NUM_EXPERTS",
    "TOP_K",
    "VOCAB",
    "HIDDEN",
    "CALIBRATION",
    "ROUTERS",
    "ZIPF_ALPHA",
    "RMSNorm",
    "CausalSelfAttention",
    "ExpertMLP",
    "MixtralStyleExperts",
    "MixtralStyleSparseMoeBlock",
    "Qwen2StyleSparseMoeBlock",
    "DecoderLayer",
    "MoeForCausalLM",
    "mixtral_tiny",
    "mixtral_tiny_zipf",
    "qwen2_moe_tiny",
    "qwen2_moe_tiny_zipf",
    "mixtral_small",
    "mixtral_small_uniform",
    "qwen2_moe_small",
    "qwen2_moe_small_uniform",
    "zipf_router_bias",
    "calibration_tokens",
    "load_calibration",
]

NUM_EXPERTS = 8
TOP_K = 2
VOCAB = 256
HIDDEN = 64
NUM_LAYERS = 2
NUM_HEADS = 4
ROUTERS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.1
ZIPF_ALPHA = 2.0
INIT_STD = 0.05
"""Standard deviation of the attention, expert and ``lm_head`` weights."""
ROUTER_STD = 0.25
"""Standard deviation of the router weights: router logits of std ~2 on RMS-normalised tokens."""
EMBED_STD = 1.0
"""Standard deviation of the token embeddings: an O(1) residual stream led by the token."""
CALIBRATION = Path(__file__).parent / "data" / "moe_calibration.npz"


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learnt scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (no positional encoding, no biases)."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (
            p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class ExpertMLP(nn.Module):
    """One SwiGLU expert: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MixtralStyleExperts(nn.Module):
    """All experts of a Mixtral-style block as stacked tensors (the ``transformers`` 5 layout):
    ``gate_up_proj`` [E, 2*I, H] and ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act_fn = nn.SiLU()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """[T, H] tokens, [T, k] chosen experts and their weights -> [T, H] weighted sum."""
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            gate, up = (hidden_states @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].T
            w = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + y * w.to(y.dtype)
        return out


def _route(gate: nn.Linear, t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: float32 probabilities of the ``k`` best experts and their indices."""
    probs = torch.softmax(gate(t).float(), dim=-1)
    top_k_weights, top_k_index = torch.topk(probs, k, dim=-1)
    return top_k_weights, top_k_index


class MixtralStyleSparseMoeBlock(nn.Module):
    """Mixtral-style sparse MoE: top-k routing with renormalised weights, no shared expert."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, intermediate: int, router_bias: bool
    ) -> None:
        super().__init__()
        self.hidden, self.top_k = hidden, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts = MixtralStyleExperts(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.reshape(-1, self.hidden)
        top_k_weights, top_k_index = _route(self.gate, t, self.top_k)
        top_k_weights = top_k_weights / top_k_weights.sum(-1, keepdim=True)
        return self.experts(t, top_k_index, top_k_weights).reshape(x.shape)


class Qwen2StyleSparseMoeBlock(nn.Module):
    """Qwen2-MoE-style sparse MoE: top-k routing without renormalisation, one `ExpertMLP` per
    expert, plus a shared expert scaled by a sigmoid gate."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        router_bias: bool,
    ) -> None:
        super().__init__()
        self.hidden, self.top_k = hidden, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(ExpertMLP(hidden, intermediate) for _ in range(num_experts))
        self.shared_expert = ExpertMLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.reshape(-1, self.hidden)
        top_k_weights, top_k_index = _route(self.gate, t, self.top_k)
        out = torch.zeros_like(t)
        for e, expert in enumerate(self.experts):
            w = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + expert(t) * w.to(t.dtype)
        out = out + torch.sigmoid(self.shared_expert_gate(t)) * self.shared_expert(t)
        return out.reshape(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h = x + attn(norm1(x)); out = h + moe(norm2(h))``."""

    def __init__(self, hidden: int, num_heads: int, moe: nn.Module) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.attn = CausalSelfAttention(hidden, num_heads)
        self.norm2 = RMSNorm(hidden)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.moe(self.norm2(h))


class MoeForCausalLM(nn.Module):
    """Token embedding -> decoder layers -> final RMSNorm -> ``lm_head``; returns the logits."""

    def __init__(
        self,
        make_moe: Callable[[], nn.Module],
        *,
        vocab: int = VOCAB,
        hidden: int = HIDDEN,
        num_layers: int = NUM_LAYERS,
        num_heads: int = NUM_HEADS,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, num_heads, make_moe()) for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, S] int64 ids (and an ignored [B, S] mask of ones) -> [B, S, vocab] logits."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def zipf_router_bias(
    num_experts: int = NUM_EXPERTS, *, alpha: float = ZIPF_ALPHA, exponent: float = ZIPF_EXPONENT
) -> torch.Tensor:
    """``alpha * log(p_e)`` with ``p_e ∝ 1 / (e + 1) ** exponent`` (normalised), shape [E]."""
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    return (alpha * torch.log(p / p.sum())).float()


def _router_has_bias(router: str) -> bool:
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(map(repr, ROUTERS))}; got {router!r}")
    return router == "zipf"


def _init(model: nn.Module) -> None:
    """Normal(0, `INIT_STD`) weights, Normal(0, `EMBED_STD`) embeddings, unit norms, and
    Normal(0, `ROUTER_STD`) routers with the Zipf bias on every biased one."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, INIT_STD)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, EMBED_STD)
        elif isinstance(m, MixtralStyleExperts):
            nn.init.normal_(m.gate_up_proj, 0.0, INIT_STD)
            nn.init.normal_(m.down_proj, 0.0, INIT_STD)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    for m in model.modules():  # second pass: modules() visits a block before its gate
        if isinstance(m, (MixtralStyleSparseMoeBlock, Qwen2StyleSparseMoeBlock)):
            nn.init.normal_(m.gate.weight, 0.0, ROUTER_STD)
            if m.gate.bias is not None:
                with torch.no_grad():
                    m.gate.bias.copy_(zipf_router_bias(m.gate.out_features))


def mixtral_tiny(*, router: str = "uniform", seed: int = 0) -> nn.Module:
    """Mixtral-style MoE LM: 8 experts, top-2, expert FFN 128 (460,096 parameters, +16 with
    ``router="zipf"``); ``router`` is ``"uniform"`` or ``"zipf"`` (synthetic skew)."""
    bias = _router_has_bias(router)
    return build(
        lambda: MoeForCausalLM(
            lambda: MixtralStyleSparseMoeBlock(HIDDEN, NUM_EXPERTS, TOP_K, 128, bias)
        ),
        seed=seed,
        init=_init,
    )


def qwen2_moe_tiny(*, router: str = "uniform", seed: int = 0) -> nn.Module:
    """Qwen2-MoE-style LM: 8 experts, top-2 unnormalised, expert FFN 64, shared expert FFN 128
    (312,768 parameters, +16 with ``router="zipf"``)."""
    bias = _router_has_bias(router)
    return build(
        lambda: MoeForCausalLM(
            lambda: Qwen2StyleSparseMoeBlock(HIDDEN, NUM_EXPERTS, TOP_K, 64, 128, bias)
        ),
        seed=seed,
        init=_init,
    )


def mixtral_small(
    *, router: str = "zipf", hidden: int = 512, ffn: int = 2048, seed: int = 0
) -> nn.Module:
    """Mixtral-style at a size where experts outweigh a function's runtime: hidden 512, expert
    FFN 2048 (3.1M parameters, 12.6 MB, per expert; 52.7M in all), the synthetic Zipf router
    by default. For measurements, not tests."""
    bias = _router_has_bias(router)
    return build(
        lambda: MoeForCausalLM(
            lambda: MixtralStyleSparseMoeBlock(hidden, NUM_EXPERTS, TOP_K, ffn, bias),
            hidden=hidden,
            num_heads=8,
        ),
        seed=seed,
        init=_init,
    )


def mixtral_small_uniform() -> nn.Module:
    """`mixtral_small` with a uniform router."""
    return mixtral_small(router="uniform")


def qwen2_moe_small(
    *,
    router: str = "zipf",
    hidden: int = 512,
    ffn: int = 1024,
    shared_ffn: int = 2048,
    seed: int = 0,
) -> nn.Module:
    """Qwen2-MoE-style at a size where experts outweigh a function's runtime: hidden 512,
    expert FFN 1024 (1.6M parameters, 6.3 MB, per expert), a gated shared expert of FFN 2048,
    the synthetic Zipf router by default. For measurements, not tests."""
    bias = _router_has_bias(router)
    return build(
        lambda: MoeForCausalLM(
            lambda: Qwen2StyleSparseMoeBlock(hidden, NUM_EXPERTS, TOP_K, ffn, shared_ffn, bias),
            hidden=hidden,
            num_heads=8,
        ),
        seed=seed,
        init=_init,
    )


def qwen2_moe_small_uniform() -> nn.Module:
    """`qwen2_moe_small` with a uniform router."""
    return qwen2_moe_small(router="uniform")


def mixtral_tiny_zipf() -> nn.Module:
    """`mixtral_tiny` with the synthetic Zipf-skewed router."""
    return mixtral_tiny(router="zipf")


def qwen2_moe_tiny_zipf() -> nn.Module:
    """`qwen2_moe_tiny` with the synthetic Zipf-skewed router."""
    return qwen2_moe_tiny(router="zipf")


def calibration_tokens(n: int = 256, seq_len: int = 32, seed: int = 0) -> np.ndarray:
    """[n, seq_len] int64 token ids, i.i.d. with ``p(token) ∝ 1 / (rank + 1)`` over the
    vocabulary, the ranks a seeded permutation of the ids (``numpy.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    ranked = rng.permutation(VOCAB)
    p = 1.0 / np.arange(1, VOCAB + 1, dtype=np.float64)
    ranks = rng.choice(VOCAB, size=(n, seq_len), p=p / p.sum())
    return ranked[ranks].astype(np.int64)


def load_calibration(path: Path = CALIBRATION) -> np.ndarray:
    """The shipped calibration ``input_ids`` ([256, 32] int64)."""
    with np.load(path) as data:
        return data["input_ids"]


def main(argv: list[str] | None = None) -> None:
    """``python -m examples.moe --write-calibration [--out PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write-calibration",
        action="store_true",
        help="write calibration_tokens() as input_ids to --out",
    )
    parser.add_argument("--out", type=Path, default=CALIBRATION)
    args = parser.parse_args(argv)
    if not args.write_calibration:
        parser.error("nothing to do (pass --write-calibration)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, input_ids=calibration_tokens())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
