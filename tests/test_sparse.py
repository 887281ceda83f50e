"""Sparse inline experts: each expert on the tokens routed to it, as the model runs them.

The unsplit baseline of a mixture-of-experts model, and every slice that keeps its experts
inline, runs `mopar.ir.moe.SparseExperts` (NonZero, Gather, the expert, ScatterND per expert)
in place of the dense translation the analysis works on. Checked here: the module against the
dense translation and per-token experts; the ONNX export of both example forms (stacked, and a
module list beside a shared expert) against the model at several token counts and batch
shapes; the pipeline putting it in the slices; and the planner pricing it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from mopar import api
from mopar.config import CompileConfig
from mopar.emit.onnx_export import run_slices_torch, try_export_slice
from mopar.ir.experts import dense_translation
from mopar.ir.moe import SparseExperts
from mopar.ir.subgraph import extract_slices
from mopar.plan import Function, Plan
from mopar.planner.experts import SPARSE_EXPERT_MS, as_sparse, inline_sparse, sparse_ms
from mopar.planner.problem import Problem
from mopar.rewrite.experts import sparse_inline, sparse_unit

TOKENS = ("input_ids={b}x{s}:int64:0..256", "attention_mask={b}x{s}:int64:1..2")


def _inputs(b: int, s: int) -> list[str]:
    return [t.format(b=b, s=s) for t in TOKENS]


def test_sparse_experts_equal_the_dense_translation_and_per_token_experts():
    """Expert 3 gets no token (it runs on zero rows); every token reaches two experts."""
    torch.manual_seed(0)
    experts = [torch.nn.Linear(4, 4) for _ in range(4)]
    x = torch.randn(5, 4)
    index = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        got = SparseExperts(experts)(x, index, weights)
        dense = dense_translation(experts, x, index, weights)
        want = torch.stack(
            [
                sum(weights[t, j] * experts[int(index[t, j])](x[t]) for j in range(2))
                for t in range(5)
            ]
        )
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _whole(analysis):
    """The model as one unit, dense (as the layer graph holds it) and sparse."""
    lg = analysis.layers
    (dense,) = extract_slices(
        lg, [SimpleNamespace(name="s0", layers=[la.name for la in lg.layers])]
    )
    sparse = dense
    for block in analysis.moe:
        assert block.sparse and block.describe()["sparse"] is True
        sparse = sparse_unit(sparse, block, analysis.experts[block.name])
    return dense, sparse


CASES = [
    ("mixtral_tiny", 1, 16),
    # qwen2's shared expert beside its routed ones: test_moe recognises it from a saved .pt2
    pytest.param("qwen2_moe_tiny", 1, 1, marks=pytest.mark.slow),
    pytest.param("mixtral_tiny", 1, 1, marks=pytest.mark.slow),
    pytest.param("mixtral_tiny", 1, 128, marks=pytest.mark.slow),
    pytest.param("mixtral_tiny", 3, 16, marks=pytest.mark.slow),
    pytest.param("qwen2_moe_tiny", 1, 16, marks=pytest.mark.slow),
    pytest.param("qwen2_moe_tiny", 1, 128, marks=pytest.mark.slow),
    pytest.param("qwen2_moe_tiny", 3, 16, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, b, s", CASES)
def test_sparse_experts_export_to_onnx_and_equal_the_model(tmp_path, name, b, s):
    """Per layer, one NonZero and one ScatterND per expert, each expert's weights once, and
    outputs within the bundle's default tolerance of the model's."""
    analysis = api.analyze(f"examples.moe:{name}", _inputs(b, s))
    dense, sparse = _whole(analysis)
    values = run_slices_torch((dense,), analysis.captured.inputs)
    path = tmp_path / "model.onnx"
    assert try_export_slice(sparse, values, path, opset=None) is None
    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("NonZero") == ops.count("ScatterND") == 2 * 8
    weights = path.with_name("model.onnx.data").stat().st_size
    lg = analysis.layers
    experts = sum(lg.graph.nodes[b.name]["layer"].param_bytes for b in analysis.moe)
    assert weights < lg.param_bytes + experts / 2  # each expert's weights once (and constants)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {t.name: np.asarray(values[t.name]) for t in sparse.inputs})[0]
    want = next(iter(analysis.captured.reference.values()))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    assert np.abs(got - want).max() <= 1e-5


def test_the_rewrite_runs_sparse_the_experts_layers_the_plan_names(tmp_path):
    """`Function.sparse_experts` decides: the named layer's dense translation and its weights
    leave the slice, which calls the sparse experts instead; the other layer stays dense."""
    analysis = api.analyze("examples.moe:qwen2_moe_tiny", _inputs(1, 4))
    first, second = (b.name for b in analysis.moe)
    layers = tuple(la.name for la in analysis.layers.layers)
    f = Function(name="s0", layers=layers, memory_mb=512, sparse_experts=(first,))
    plan = Plan(model="m", strategy="mopar", functions=(f,))
    units = extract_slices(analysis.layers, plan.functions)
    (unit,) = sparse_inline(units, plan, analysis.moe, analysis.experts)
    code = unit.gm.code
    assert code.count("self.moe_sparse_") == 1 and "moe_sparse_layers_0" in code
    assert "_layers_0_moe_experts_e0_" not in code and "_layers_1_moe_experts_e0_" in code
    values = run_slices_torch((unit,), analysis.captured.inputs)
    want = next(iter(analysis.captured.reference.values()))
    got = values[unit.outputs[0].name].numpy()
    assert np.abs(got - want).max() <= 1e-5
    assert Plan.from_dict(plan.to_dict()) == plan


def test_tiny_experts_on_one_token_stay_dense_inline_and_the_plan_says_why():
    """With one token, the tiny example's experts are so small that selecting each one's
    tokens costs more than running all of them (measured, docs/moe.md): the planner keeps
    them dense (at 16 tokens it runs them sparse)."""
    analysis = api.analyze("examples.moe:mixtral_tiny", _inputs(1, 1))
    config = CompileConfig(experts="inline")
    facts = api.facts_for(config)
    plan = api.plan_from(
        analysis, config, api.predict(analysis.layers, config, facts=facts), facts=facts
    )
    assert all(not f.sparse_experts for f in plan.functions)
    assert any("dense translation: predicted" in n for n in map(str, plan.notes))


def _problem(t1: tuple[float, ...]) -> Problem:
    n = len(t1)
    return Problem(
        names=tuple(f"l{k}" for k in range(n)),
        spans=tuple((k, k + 1) for k in range(n)),
        weight_mb=(1.0,) * n,
        transient_mb=(8.0,) * n,
        t1_ms=t1,
        par_ms=tuple(0.5 * t for t in t1),
        param_bytes=(1 << 20,) * n,
        cut_bytes=(4096,) * (n + 1),
        baseline_mb=54.0,
    )


def test_sparse_experts_are_priced_k_over_e_of_the_dense_layer_plus_their_selection():
    """Layer 1 is slow enough to run sparse; layer 2's sparse translation was not exact; layer
    3's experts are too fast for the selection to pay."""
    small = 8 * SPARSE_EXPERT_MS
    problem = _problem((1.0, 40.0, 40.0, small))
    blocks = [
        SimpleNamespace(name=f"l{k}", top_k=2, num_experts=8, sparse=k != 2) for k in (1, 2, 3)
    ]
    index = {f"l{k}": k for k in range(4)}
    assert inline_sparse(problem, blocks, index) == ("l1",)
    got = as_sparse(problem, blocks, index)
    assert got.t1_ms == pytest.approx((1.0, 10.0 + small, 40.0, small))
    assert sparse_ms(blocks[0], 40.0) == pytest.approx(10.0 + small)
    assert got.par_ms == pytest.approx((0.5, 5.0, 20.0, small / 2))
    assert got.transient_mb == pytest.approx((8.0, 2.0, 8.0, 8.0))
    assert (got.weight_mb, got.cut_bytes) == (problem.weight_mb, problem.cut_bytes)
    assert as_sparse(problem, [], {}) is problem
