"""Rewrite: sharding a slice into η parameter-sharded sub-slices, a join and a tail.

Every sharded slice is compared with the unsharded one (sub-slices + join + tail against the
slice module, within 1e-5 relative error). The tiny models live here: they are built for these
tests alone and passed to `api.analyze` as modules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from torch import nn

from mopar import api
from mopar.emit.onnx_export import run_slices_torch, try_export_slice
from mopar.errors import InternalError
from mopar.ir.shard_rules import map_split_through_reshape
from mopar.ir.sharding import Join, Unshardable, analyze_sharding, analyze_stages
from mopar.ir.subgraph import SliceModule
from mopar.rewrite import split_by_plan
from mopar.rewrite.shard import ShardedSlice, apply_sharding, build_stages
from mopar.runner.check import compare_outputs
from tests.conftest import plan_of


def shard_slice(sm: SliceModule, eta: int) -> ShardedSlice | Unshardable:
    """Shard ``sm`` into ``eta`` sub-slices, or say why it cannot be."""
    decision = analyze_sharding(sm, eta)
    return decision if isinstance(decision, Unshardable) else apply_sharding(sm, decision)


# --- the reference: a sharded slice run in torch -------------------------------------------------


def join_parts(join: Join, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Aggregate the sub-slices' parts of one tensor."""
    if join.kind == "sum":
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total
    if join.kind == "concat":
        return torch.cat(list(parts), dim=join.dim)
    if join.kind == "replicated":
        return parts[0]
    raise InternalError(f"unknown join kind {join.kind!r} for {join.name}")


def run_sharded(
    sharded: ShardedSlice | Sequence[ShardedSlice], inputs: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Run a sharded slice on ``inputs`` (by public name); return its outputs by public name.

    ``sharded`` is one `ShardedSlice` (sub-slices, join, tail), or the stages of `build_stages`,
    where each stage stands in for the previous stage's tail.
    """
    stages = (sharded,) if isinstance(sharded, ShardedSlice) else tuple(sharded)
    values = dict(inputs)
    with torch.no_grad():
        for stage in stages:
            parts = [s.gm(*[values[t.name] for t in s.inputs]) for s in stage.shards]
            for i, join in enumerate(stage.joins):
                values[join.name] = join_parts(join, [p[i] for p in parts])
        tail = stages[-1].tail
        if tail is not None:
            values.update(
                zip((t.name for t in tail.outputs), tail.gm(*[values[t.name] for t in tail.inputs]))
            )
    return {t.name: values[t.name] for t in stages[0].outputs}


TOLERANCE = 1e-5  # relative to the largest reference magnitude, as `mopar run --check` measures


# --- tiny models ----------------------------------------------------------------------------------


class Chain(nn.Module):
    """Linear -> GELU -> Linear: one column-parallel and one row-parallel Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with a padding mask, written as BERT's eager attention is."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split_heads(f(x)) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores + (1.0 - mask[:, None, None, :]) * -1e4
        ctx = torch.softmax(scores, dim=-1) @ v
        b, _, n, _ = ctx.shape
        return self.out(ctx.transpose(1, 2).contiguous().reshape(b, n, -1))


class ConvBlock(nn.Module):
    """conv -> BN -> ReLU -> depthwise conv -> conv -> BN -> ReLU, Gillis's channel sharding."""

    def __init__(self, mid: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, mid, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(mid)
        self.relu1 = nn.ReLU()
        self.dw = nn.Conv2d(mid, mid, 3, padding=1, groups=mid)
        self.conv2 = nn.Conv2d(mid, 4, 1)
        self.bn2 = nn.BatchNorm2d(4)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(self.dw(y))))


class FusedQKV(nn.Module):
    """GPT-2's Conv1D attention input: one addmm for q, k and v, split in three afterwards."""

    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.weight = nn.Parameter(torch.randn(hidden, 3 * hidden) / hidden**0.5)
        self.bias = nn.Parameter(torch.randn(3 * hidden) / 10)
        self.proj_w = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.proj_b = nn.Parameter(torch.randn(hidden) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        qkv = torch.addmm(self.bias, x.view(-1, e), self.weight).view(b, n, 3 * e)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in qkv.split(e, dim=2))
        ctx = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        flat = ctx.transpose(1, 2).reshape(-1, e)
        return torch.addmm(self.proj_b, flat, self.proj_w).view(b, n, e)


class LinearNorm(nn.Module):
    """A Linear then a LayerNorm over its features: the region ends at the LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class SkipIntoSplit(nn.Module):
    """A replicated input added to a column-parallel output, and a replicated tensor the tail
    reads: each sub-slice adds its chunk of ``skip``, and the tail gets ``h`` from shard 0."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.out_norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = self.fc2(torch.relu(self.fc1(h) + skip))
        return self.out_norm(y) * h


class ResidualInput(nn.Module):
    """An MLP plus a residual that only the final add reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) + residual


class Zoo(nn.Module):
    """Less common ops along a split and a partial sum: cat, select, mean, amax, embedding,
    pooling and flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(8, 6)
        self.emb = nn.Embedding(10, 8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        y = torch.relu(self.conv1(x))
        y = torch.cat([y, y * 2], dim=3)
        features = y[:, :, 0].mean(dim=-1) + self.emb(ids).sum(dim=1)
        z = self.fc(features).unsqueeze(1) / 2.0
        p = nn.functional.avg_pool2d(self.conv2(y), 2).flatten(1)
        return z, p, torch.sigmoid(y).amax(dim=(2, 3))


class NoWeights(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.tanh(x), dim=-1)


def _seeded(cls, **kwargs) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(**kwargs)
        for m in model.modules():  # non-trivial BatchNorm statistics
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.data.uniform_(0.5, 1.5)
                m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def _inputs(**shapes) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def whole_slice(model: nn.Module, inputs: dict[str, np.ndarray]):
    """The model as one slice (split the way `split_by_plan` splits a Plan), and its inputs."""
    analysis = api.analyze(model, inputs)
    lg = analysis.layers
    (sm,) = split_by_plan(lg, plan_of([[layer.name for layer in lg.layers]]))
    return sm, analysis.captured.inputs


def _torch(inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in inputs.items()}


def assert_matches_unsharded(sm, sharded, values: dict[str, torch.Tensor]) -> None:
    want = run_slices_torch((sm,), {t.name: values[t.name].numpy() for t in sm.inputs})
    got = run_sharded(sharded, {t.name: values[t.name] for t in sm.inputs})
    max_rel = compare_outputs(
        {k: v.numpy() for k, v in got.items()}, {t.name: want[t.name].numpy() for t in sm.outputs}
    ).max_rel_err
    assert max_rel <= TOLERANCE, f"sharded {sm.name} differs by {max_rel:.3g} (relative)"


def _joined(sharded: ShardedSlice, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The joined tensors, as the runtime's fork-join makes them for the tail."""
    with torch.no_grad():
        parts = [s.gm(*[values[t.name] for t in s.inputs]) for s in sharded.shards]
    return {j.name: join_parts(j, [p[i] for p in parts]) for i, j in enumerate(sharded.joins)}


def _rules(sharded: ShardedSlice) -> dict[str, str]:
    return {r.node: r.rule for r in sharded.decision.region}


def _param_shapes(shard) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in shard.gm.state_dict().items()}


@pytest.fixture(scope="module")
def chain():
    return whole_slice(_seeded(Chain), _inputs(x=(2, 5, 16)))


@pytest.fixture(scope="module")
def attention():
    mask = np.ones((2, 6), np.float32)
    mask[1, 4:] = 0  # the second sequence is padded
    return whole_slice(_seeded(Attention), {**_inputs(x=(2, 6, 32)), "mask": mask})


@pytest.fixture(scope="module")
def conv_block():
    return whole_slice(_seeded(ConvBlock), _inputs(x=(1, 3, 6, 6)))


# --- Linear chains --------------------------------------------------------------------------------


@pytest.mark.parametrize("eta", [2, 4])
def test_linear_gelu_linear_is_column_then_row_parallel_and_summed(chain, eta):
    sm, inputs = chain
    sharded = shard_slice(sm, eta)
    assert isinstance(sharded, ShardedSlice) and len(sharded.shards) == eta
    assert list(_rules(sharded).values()) == [
        "column-parallel linear",
        "elementwise follows the split",
        "row-parallel linear",
    ]
    assert [(j.kind, j.shape) for j in sharded.joins] == [("sum", (2, 5, 16))]
    assert sharded.tail is None
    assert_matches_unsharded(sm, sharded, _torch(inputs))


@pytest.mark.parametrize("eta", [2, 4])
def test_each_sub_slice_holds_one_eta_th_of_the_weights_as_smaller_tensors(chain, eta):
    sm, _ = chain
    sharded = shard_slice(sm, eta)
    shapes = [_param_shapes(s) for s in sharded.shards]
    assert sorted(shapes[1].values()) == sorted([(32 // eta, 16), (32 // eta,), (16, 32 // eta)])
    # The row-parallel Linear's bias is added once, by shard 0.
    assert len(shapes[0]) == len(shapes[1]) + 1 and (16,) in shapes[0].values()
    total = sum(p.numel() * 4 for p in _seeded(Chain).parameters())
    bias2 = 16 * 4
    assert sharded.shard_param_bytes == ((total - bias2) // eta + bias2,) + (
        (total - bias2) // eta,
    ) * (eta - 1)
    assert sharded.decision.sharded_params == ("fc1.weight", "fc1.bias", "fc2.weight")


def test_parts_are_aggregated_as_the_join_says():
    parts = [torch.ones(2, 3), 2 * torch.ones(2, 3)]
    from mopar.ir.sharding import Join

    assert join_parts(Join(name="a", kind="sum", shape=(2, 3)), parts).tolist() == [[3.0] * 3] * 2
    assert join_parts(Join(name="a", kind="concat", dim=1, shape=(2, 6)), parts).shape == (2, 6)
    assert join_parts(Join(name="a", kind="replicated", shape=(2, 3)), parts) is parts[0]
    assert parts[0].tolist() == [[1.0] * 3] * 2  # a sum does not write into a part


# --- attention ------------------------------------------------------------------------------------


def test_attention_is_sharded_by_whole_heads(attention):
    sm, inputs = attention
    sharded = shard_slice(sm, 2)
    assert isinstance(sharded, ShardedSlice) and sharded.tail is None
    rules = _rules(sharded)
    assert list(rules.values()).count("column-parallel linear") == 3  # q, k and v
    assert list(rules.values())[-1] == "row-parallel linear"  # the output projection
    assert "batched matmul follows the split" in rules.values()
    assert [j.kind for j in sharded.joins] == ["sum"]
    # Each sub-slice reshapes into 4 / 2 = 2 heads of 8 features.
    views = [
        n.args[1]
        for n in sharded.shards[1].gm.graph.nodes
        if n.target is torch.ops.aten.reshape.default
    ]
    assert (2, 6, 2, 8) in views
    assert_matches_unsharded(sm, sharded, _torch(inputs))


def test_attention_sub_slices_hold_half_the_projection_weights(attention):
    sm, _ = attention
    sharded = shard_slice(sm, 2)
    weights = 4 * (32 * 32 + 32) * 4  # q, k, v, out: weights and biases, float32
    out_bias = 32 * 4
    assert sharded.shard_param_bytes == (
        (weights - out_bias) // 2 + out_bias,
        (weights - out_bias) // 2,
    )


def test_eta_that_does_not_divide_the_heads_is_refused(attention):
    sm, _ = attention
    result = shard_slice(sm, 8)  # 32 features split 8 ways, but only 4 heads
    assert isinstance(result, Unshardable)
    assert "η = 8 does not divide dimension 2 of size 4" in result.reason
    assert "number of heads" in result.reason and "\n" not in result.reason


def test_fused_qkv_projection_is_sharded_per_q_k_v_block():
    sm, inputs = whole_slice(_seeded(FusedQKV), _inputs(x=(1, 5, 16)))
    sharded = shard_slice(sm, 2)
    assert isinstance(sharded, ShardedSlice)
    rules = _rules(sharded)
    assert "column-parallel addmm" in rules.values() and "row-parallel addmm" in rules.values()
    assert "split of a fused projection" in rules.values()
    # Shard 1 holds the second half of each of q, k and v, not the middle third of the weight.
    full = dict(_seeded(FusedQKV).named_parameters())["weight"]
    held = next(v for k, v in sharded.shards[1].gm.state_dict().items() if v.shape == (16, 24))
    torch.testing.assert_close(held, torch.cat([full[:, 8:16], full[:, 24:32], full[:, 40:48]], 1))
    assert_matches_unsharded(sm, sharded, _torch(inputs))


# --- convolutions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("eta", [2, 4])
def test_conv_bn_relu_then_conv_is_channel_sharded_and_summed(conv_block, eta):
    sm, inputs = conv_block
    sharded = shard_slice(sm, eta)
    assert isinstance(sharded, ShardedSlice)
    rules = list(_rules(sharded).values())
    assert rules[:5] == [
        "output-channel conv",
        "BatchNorm follows the channel split",
        "elementwise follows the split",
        "grouped conv follows the channel split",
        "input-channel conv",
    ]
    assert rules[5] == "BatchNorm of a partial sum (shift added by shard 0 only)"
    # The last ReLU cannot run on a partial sum: the join sums, then the tail runs it once.
    assert [j.kind for j in sharded.joins] == ["sum"]
    assert "relu" in sharded.decision.region_end and sharded.tail is not None
    assert [n.target for n in sharded.tail.gm.graph.nodes if n.op == "call_function"] == [
        torch.ops.aten.relu.default
    ]
    convs = [_param_shapes(s) for s in sharded.shards]
    assert (8 // eta, 3, 3, 3) in convs[0].values() and (4, 8 // eta, 1, 1) in convs[0].values()
    assert_matches_unsharded(sm, sharded, _torch(inputs))


def test_split_result_is_concatenated_when_a_rule_ends_the_region():
    sm, inputs = whole_slice(_seeded(LinearNorm), _inputs(x=(3, 8)))
    sharded = shard_slice(sm, 2)
    assert [(j.kind, j.dim, j.shape) for j in sharded.joins] == [("concat", 1, (3, 16))]
    assert sharded.shards[0].outputs[0].shape == (3, 8)
    assert "LayerNorm over the split dimension" in sharded.decision.region_end
    assert sharded.tail is not None and sharded.tail.inputs[0].name == sharded.joins[0].name
    assert_matches_unsharded(sm, sharded, _torch(inputs))


def test_replicated_operands_are_narrowed_and_replicated_tensors_joined_from_shard_0():
    sm, inputs = whole_slice(_seeded(SkipIntoSplit), _inputs(x=(2, 3, 8), skip=(2, 3, 16)))
    sharded = shard_slice(sm, 2)
    assert isinstance(sharded, ShardedSlice)
    # Each sub-slice slices its half of `skip` (a computed operand, not a parameter).
    slices = [
        n.args[1:]
        for n in sharded.shards[1].gm.graph.nodes
        if n.target is torch.ops.aten.slice.Tensor
    ]
    assert slices == [(2, 8, 16)]
    assert sorted(j.kind for j in sharded.joins) == ["replicated", "sum"]
    assert {t.name for t in sharded.tail.inputs} == {j.name for j in sharded.joins}
    assert_matches_unsharded(sm, sharded, _torch(inputs))


def test_residual_added_once_is_an_input_of_shard_0_only():
    sm, inputs = whole_slice(_seeded(ResidualInput), _inputs(x=(2, 8), residual=(2, 8)))
    sharded = shard_slice(sm, 2)
    assert [[t.name for t in s.inputs] for s in sharded.shards] == [["x", "residual"], ["x"]]
    assert_matches_unsharded(sm, sharded, _torch(inputs))


def test_channels_that_eta_does_not_divide_are_refused():
    sm, _ = whole_slice(_seeded(ConvBlock, mid=6), _inputs(x=(1, 3, 6, 6)))
    result = shard_slice(sm, 4)
    assert isinstance(result, Unshardable)
    assert "η = 4 does not divide the 6 output channels" in result.reason
    assert "conv1" in result.reason  # it names the module


# --- a whole transformer block --------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_block():
    """Encoder layer 0 of a 1-layer, 4-head BERT of hidden size 32 (examples.transformer)."""
    from examples.transformer import bert

    model = bert(
        hidden=32, num_layers=1, num_heads=4, intermediate=64, vocab_size=100, max_positions=16
    )
    analysis = api.analyze(model, ["input_ids=1x8:int64:0..100", "attention_mask=1x8:int64:0..2"])
    lg = analysis.layers
    names = [layer.name for layer in lg.layers]
    block = [n for n in names if n.startswith("encoder.layer.0")]
    groups = [names[: names.index(block[0])], block, names[names.index(block[-1]) + 1 :]]
    slices = split_by_plan(lg, plan_of(groups))
    return slices[1], run_slices_torch(slices, analysis.captured.inputs)


def test_transformer_block_shards_attention_then_its_tail_shards_the_mlp(bert_block):
    sm, values = bert_block
    first = shard_slice(sm, 2)
    assert isinstance(first, ShardedSlice)
    rules = _rules(first)
    assert "replicated term added by shard 0 only" in rules.values()  # the residual
    assert "LayerNorm over a partial sum" in first.decision.region_end
    assert_matches_unsharded(sm, first, values)
    # The tail is a slice module too: LayerNorm, then the MLP sharded again, then LayerNorm.
    second = shard_slice(first.tail, 2)
    assert isinstance(second, ShardedSlice)
    assert {"column-parallel linear", "row-parallel linear"} <= set(_rules(second).values())
    assert_matches_unsharded(first.tail, second, {**values, **_joined(first, values)})
    assert isinstance(shard_slice(second.tail, 2), Unshardable)  # the last LayerNorm


def test_transformer_block_in_stages_matches_and_holds_half_the_block_weights(bert_block):
    sm, values = bert_block
    stages = build_stages(analyze_stages(sm, 2))
    assert len(stages) == 2 and stages[-1].tail is not None  # the last LayerNorm runs once
    assert_matches_unsharded(sm, stages, values)
    block_weights = (4 * 32 * 32 + 2 * 32 * 64) * 4
    held = sum(stage.shard_param_bytes[1] for stage in stages)
    assert block_weights // 2 <= held <= block_weights // 2 + 2048  # plus biases and norms


@pytest.mark.parametrize("eta", [2, 4])
def test_less_common_ops_follow_the_split_or_carry_the_partial_sum(eta):
    inputs = {**_inputs(x=(2, 3, 4, 4)), "ids": np.array([[1, 2, 3], [4, 5, 6]], np.int64)}
    sm, inputs = whole_slice(_seeded(Zoo), inputs)
    sharded = shard_slice(sm, eta)
    assert isinstance(sharded, ShardedSlice) and sharded.tail is None
    expected = {
        "column-parallel embedding",
        "concatenation follows the split",
        "select follows the split",
        "reduction follows the split",
        "average pool of a partial sum",
        "view of a partial sum",
    }
    assert expected <= set(_rules(sharded).values())
    assert [(j.kind, j.dim) for j in sharded.joins] == [("sum", -1), ("sum", -1), ("concat", 1)]
    assert_matches_unsharded(sm, sharded, _torch(inputs))


# --- unshardable slices and contracts -------------------------------------------------------------


def test_slice_without_weights_is_unshardable_with_a_one_line_reason():
    sm, _ = whole_slice(NoWeights(), _inputs(x=(2, 4)))
    result = shard_slice(sm, 2)
    assert isinstance(result, Unshardable) and result.eta == 2
    assert result.reason == "no Linear, Conv, Embedding or MatMul with a weight to shard"


def test_eta_below_two_is_an_internal_error(chain):
    with pytest.raises(InternalError, match="η >= 2"):
        shard_slice(chain[0], 1)


def test_deciding_changes_no_graph_and_the_decision_is_frozen_data(chain):
    sm, _ = chain
    before = sm.gm.code
    decision = analyze_sharding(sm, 2)
    assert sm.gm.code == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.eta = 4  # type: ignore[misc]
    assert apply_sharding(sm, decision).shard_param_bytes == shard_slice(sm, 2).shard_param_bytes


@pytest.mark.parametrize("which", ["attention", "conv_block"])
def test_sub_slice_exports_to_onnx_and_runs_in_onnxruntime(request, which, tmp_path):
    import onnxruntime as ort

    sm, inputs = request.getfixturevalue(which)
    shard = shard_slice(sm, 2).shards[1]  # no bias, zeroed BatchNorm shift, narrowed groups
    values = _torch(inputs)
    path = tmp_path / "shard.onnx"
    assert try_export_slice(shard, values, path, opset=None) is None  # onnx.checker's full check
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(
        [t.name for t in shard.outputs], {t.name: inputs[t.name] for t in shard.inputs}
    )
    with torch.no_grad():
        (want,) = shard.gm(*[values[t.name] for t in shard.inputs])
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    assert got.shape == shard.outputs[0].shape


# --- the reshape rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dim, dst, eta, want",
    [
        ((1, 8, 32), 2, (1, 8, 4, 8), 2, 2),  # split heads: the split moves to the head dim
        ((1, 8, 4, 8), 2, (1, 8, 32), 2, 2),  # merge heads
        ((2, 16, 3, 3), 1, (2, 144), 4, 1),  # flatten channels with their pixels
        ((1, 8, 4, 8), 3, (1, 8, 32), 2, "mixed"),  # a split inside a head cannot survive a merge
        ((1, 8, 32), 2, (1, 8, 2, 16), 4, "η = 4 does not divide"),
    ],
)
def test_a_split_maps_through_a_reshape_only_when_chunks_stay_contiguous(src, dim, dst, eta, want):
    got = map_split_through_reshape(src, dim, dst, eta)
    if isinstance(want, int):
        assert got == want
    else:
        assert isinstance(got, str) and want in got
