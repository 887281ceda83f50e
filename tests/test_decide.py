"""The plan carries every decision: what needs the model's graph is measured before planning
and handed to the planner as data; the rewrite builds what was priced and decides nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mopar import api, pipeline
from mopar.config import CompileConfig
from mopar.errors import InternalError
from mopar.ir.sharding import Join
from mopar.plan import Function
from mopar.planner import with_parallel
from mopar.profile.shards import ShardAnalysis, ShardOption, SliceShards, StageFigures
from tests.conftest import chain_plan


class _Mlp(nn.Module):
    """Linear -> GELU -> Linear, then Linear -> GELU -> Linear: two slices, each shardable."""

    def __init__(self) -> None:
        super().__init__()
        self.a1, self.a2 = nn.Linear(16, 64), nn.Linear(64, 16)
        self.b1, self.b2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a2(nn.functional.gelu(self.a1(x)))
        return self.b2(nn.functional.gelu(self.b1(h)))


def _figures(name: str, *, eta_ok: bool) -> SliceShards:
    stage = StageFigures(
        shard_param_bytes=(2048, 2048),
        tail_param_bytes=0,
        region_flops=1000,
        tail_flops=0,
        joins=(Join(name="y", kind="sum", shape=(1, 16)),),
    )
    option = (
        ShardOption(eta=2, stages=(stage,))
        if eta_ok
        else ShardOption(eta=2, reason="no rule shards its first operator")
    )
    return SliceShards(name=name, flops=1000, tensor_bytes={"x": 64, "y": 64}, options=(option,))


def test_the_horizontal_planner_decides_from_figures_alone():
    """No module, no graph: η comes from the numbers the analysis measured."""
    config = CompileConfig(parallel=2, force_parallel=True)
    facts = api.facts_for(config)
    vertical = chain_plan(
        [Function(name="s0", layers=("a",), memory_mb=2048, time_ms=10.0, param_bytes=4096)]
    )
    figures = ShardAnalysis(slices=(_figures("s0", eta_ok=True),), sum_mb_per_s=1000.0)
    sharded = with_parallel(vertical, figures, config, facts=facts)
    assert [(f.name, f.kind, f.parallel) for f in sharded.functions] == [
        ("s0.p0", "shard", 2),
        ("s0.p1", "shard", 2),
        ("s0", "join", 2),
    ]
    assert [f.param_bytes for f in sharded.functions[:2]] == [2048, 2048]
    whole = ShardAnalysis(slices=(_figures("s0", eta_ok=False),), sum_mb_per_s=1000.0)
    kept = with_parallel(vertical, whole, config, facts=facts)
    assert [f.name for f in kept.functions] == ["s0"]
    assert "s0: η = 1 (no rule shards its first operator)" in map(str, kept.notes)


def test_the_rewrite_builds_the_analysed_stages_without_analysing_again(monkeypatch):
    torch.manual_seed(0)
    config = CompileConfig(slices=2, strategy="uniform", parallel=2, force_parallel=True)
    facts = api.facts_for(config)
    analysis = api.analyze(_Mlp().eval(), (torch.randn(1, 16),))
    planned = pipeline.plan(analysis, config, facts, pipeline.profile(analysis, config, facts))
    assert planned.plan.sharded and planned.shards is not None

    def refuse(*_args, **_kwargs):
        raise AssertionError("the rewrite analysed a slice again")

    monkeypatch.setattr("mopar.ir.sharding.analyze_sharding", refuse)
    units = pipeline.rewrite(analysis, planned)
    assert [u.name for u in units] == [f.name for f in planned.plan.functions]
    with pytest.raises(InternalError, match="planned sharded without a sharding analysis"):
        pipeline.rewrite(analysis, pipeline.Planned(plan=planned.plan))


def test_planning_again_reuses_the_expert_trace(monkeypatch):
    """The trace is measured by the profile stage and handed in; planning runs nothing."""
    from examples.moe import mixtral_tiny

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    analysis = api.analyze(mixtral_tiny(), (ids, torch.ones(1, 16, dtype=torch.int64)))
    config = CompileConfig(expert_group=2)
    facts = api.facts_for(config)
    profiled = pipeline.profile(analysis, config, facts)
    assert profiled.experts is not None

    def refuse(*_args, **_kwargs):
        raise AssertionError("planning traced the experts")

    monkeypatch.setattr("mopar.profile.experts.trace_experts", refuse)
    monkeypatch.setattr("mopar.profile.experts.assumed_trace", refuse)
    first = pipeline.plan(analysis, config, facts, profiled).plan
    again = pipeline.plan(analysis, config, facts, profiled).plan
    assert first == again and first.dispatches()
