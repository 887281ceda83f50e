"""The mixture-of-experts examples (`examples.moe`): deterministic, exportable with torch.export,
shape-generic, and routed as documented (the zipf routers skewed, the uniform ones less so)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from examples import moe

FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "mixtral_tiny": moe.mixtral_tiny,
    "mixtral_tiny_zipf": moe.mixtral_tiny_zipf,
    "qwen2_moe_tiny": moe.qwen2_moe_tiny,
    "qwen2_moe_tiny_zipf": moe.qwen2_moe_tiny_zipf,
}


def _inputs(batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, moe.VOCAB, (batch, seq), generator=g, dtype=torch.int64)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)


def layer0_expert_hits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Top-k hits per expert of layer 0's router over ``input_ids`` ([E] int64)."""
    counts = torch.zeros(moe.NUM_EXPERTS, dtype=torch.int64)

    def hook(_module: nn.Module, _inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        index = torch.topk(torch.softmax(out.float(), dim=-1), moe.TOP_K, dim=-1).indices
        counts.add_(torch.bincount(index.flatten(), minlength=moe.NUM_EXPERTS))

    handle = model.layers[0].moe.gate.register_forward_hook(hook)
    try:
        _run(model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
    finally:
        handle.remove()
    return counts


@pytest.fixture(scope="module")
def hits() -> dict[str, torch.Tensor]:
    """Layer-0 expert hits of every variant on the shipped calibration tokens."""
    ids = torch.from_numpy(moe.load_calibration())
    return {name: layer0_expert_hits(make(), ids) for name, make in FACTORIES.items()}


def _ratio(counts: torch.Tensor) -> float:
    return counts.max().item() / max(counts.min().item(), 1)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factory_is_deterministic_eval_mode_and_returns_logits(name):
    a, b = FACTORIES[name](), FACTORIES[name]()
    assert not a.training
    x = _inputs(2, 16)
    ya, yb = _run(a, x), _run(b, x)
    assert isinstance(ya, torch.Tensor) and ya.shape == (2, 16, moe.VOCAB)
    assert torch.equal(ya, yb)
    assert torch.isfinite(ya).all() and 0.05 < ya.std().item() < 5.0


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_exports_with_torch_export_and_matches_eager(name):
    model = FACTORIES[name]()
    x = _inputs(1, 16, seed=1)
    ep = torch.export.export(model, (), x, strict=False)
    got, want = _run(ep.module(), x), _run(model, x)
    assert got.shape == (1, 16, moe.VOCAB)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (1, 128), (3, 16), (3, 1)])
def test_forward_at_other_shapes(name, batch, seq):
    y = _run(FACTORIES[name](), _inputs(batch, seq))
    assert y.shape == (batch, seq, moe.VOCAB) and torch.isfinite(y).all()


def test_seed_changes_the_weights():
    x = _inputs(1, 16)
    assert not torch.equal(_run(moe.mixtral_tiny(seed=0), x), _run(moe.mixtral_tiny(seed=1), x))


def test_block_layouts():
    mix = moe.mixtral_tiny().layers[0].moe
    assert isinstance(mix, moe.MixtralStyleSparseMoeBlock) and mix.gate.bias is None
    assert mix.experts.gate_up_proj.shape == (moe.NUM_EXPERTS, 2 * 128, moe.HIDDEN)
    assert mix.experts.down_proj.shape == (moe.NUM_EXPERTS, moe.HIDDEN, 128)
    qwen = moe.qwen2_moe_tiny_zipf().layers[0].moe
    assert isinstance(qwen, moe.Qwen2StyleSparseMoeBlock) and qwen.gate.bias is not None
    assert len(qwen.experts) == moe.NUM_EXPERTS
    assert qwen.experts[0].gate_proj.weight.shape == (64, moe.HIDDEN)
    assert qwen.shared_expert.gate_proj.weight.shape == (128, moe.HIDDEN)
    torch.testing.assert_close(qwen.gate.bias, moe.zipf_router_bias())


def test_mixtral_experts_match_a_per_token_reference():
    block = moe.mixtral_tiny().layers[0].moe
    t = torch.randn(5, moe.HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = block(t.view(1, 5, moe.HIDDEN)).view(5, moe.HIDDEN)
        probs = torch.softmax(block.gate(t), dim=-1)
        w, idx = torch.topk(probs, moe.TOP_K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        want = torch.zeros_like(t)
        for i in range(5):
            for slot in range(moe.TOP_K):
                e = int(idx[i, slot])
                gate, up = (t[i] @ block.experts.gate_up_proj[e].T).chunk(2, dim=-1)
                y = (torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[e].T
                want[i] += w[i, slot] * y
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixtral_tiny_zipf", "qwen2_moe_tiny_zipf"])
def test_zipf_router_is_skewed_but_uses_every_expert(hits, name):
    counts = hits[name]
    assert (counts > 0).all(), counts.tolist()
    assert _ratio(counts) > 5, counts.tolist()
    assert counts.sum().item() == moe.TOP_K * 256 * 32


@pytest.mark.parametrize("family", ["mixtral_tiny", "qwen2_moe_tiny"])
def test_uniform_router_is_less_skewed_than_zipf(hits, family):
    uniform, zipf = hits[family], hits[f"{family}_zipf"]
    assert (uniform > 0).all(), uniform.tolist()
    assert _ratio(uniform) < _ratio(zipf), (uniform.tolist(), zipf.tolist())


def test_shipped_calibration_equals_calibration_tokens():
    shipped = moe.load_calibration()
    want = moe.calibration_tokens()
    assert shipped.dtype == np.int64 and shipped.shape == (256, 32)
    np.testing.assert_array_equal(shipped, want)
    with np.load(moe.CALIBRATION) as data:
        assert list(data.files) == ["input_ids"]
    assert 0 <= want.min() and want.max() < moe.VOCAB
    np.testing.assert_array_equal(moe.calibration_tokens(), want)
    assert not np.array_equal(moe.calibration_tokens(seed=1), want)


def test_bad_router_name_raises():
    for make in (moe.mixtral_tiny, moe.qwen2_moe_tiny):
        with pytest.raises(ValueError, match="uniform.*zipf"):
            make(router="skewed")
