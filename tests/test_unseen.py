"""Architectures outside the model zoo, handed over the ways users hand them over: what broke on
them, reduced to tiny models (dynamic-shape exports, TorchScript traces of models that read a
size, a key-value cache returned from forward()). bfloat16 weights, once refused, compile:
tests/test_dtypes.py.

Three of the unseen Hugging Face models themselves (Phi-3 exported with a dynamic sequence
length, OLMoE, SegFormer) are in the slow test at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from examples import zoo
from mopar import api
from mopar.errors import CaptureError, InputSpecError
from mopar.ir.graph import build_layer_graph
from tests.conftest import mopar


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return self.fc(x).view(1, n, 2, 4).flatten(2)


class _Stack(nn.Module):
    """Three blocks that each reshape by the sequence length read once at the start, as
    transformers' decoders read it for their positions and masks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        for block in self.blocks:
            x = block(x, n)
        return x


def _symbolic(gm: torch.fx.GraphModule) -> list[str]:
    return [
        n.name
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
    ]


def test_a_pt2_exported_with_a_dynamic_dimension_keeps_one_layer_per_block(tmp_path):
    model, x = _Stack().eval(), torch.randn(1, 6, 8)
    seq = torch.export.Dim("seq", max=32)
    ep = torch.export.export(model, (x,), dynamic_shapes=({1: seq},))
    torch.export.save(ep, tmp_path / "dyn.pt2")
    analysis = api.analyze(str(tmp_path / "dyn.pt2"))
    # the size is the example's, a constant: it no longer ties every block into one layer
    assert not _symbolic(analysis.captured.gm)
    assert [la.name for la in analysis.layers] == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    (ref,) = analysis.captured.reference.values()
    torch.testing.assert_close(torch.from_numpy(ref), model(x))
    assert len(api.partition(str(tmp_path / "dyn.pt2"), slices=3).functions) == 3
    # its bounded dimension stays dynamic: another example inside the range is taken, one
    # outside it refused
    assert [(d.input, d.axis, d.max) for d in analysis.captured.dims] == [("x", 1, 32)]
    assert api.analyze(str(tmp_path / "dyn.pt2"), ["x=1x9x8:float32"]).captured.dims
    with pytest.raises(InputSpecError, match="outside 1..32"):
        api.analyze(str(tmp_path / "dyn.pt2"), ["x=1x40x8:float32"])


class _Flattening(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        return self.c(h.reshape(x.size(0), -1))


def test_a_torchscript_trace_that_reads_a_size_is_cut_at_its_anchor_ops(tmp_path):
    model, x = _Flattening().eval(), torch.randn(3, 2, 8)
    torch.jit.save(torch.jit.trace(model, (x,)), tmp_path / "ts.pt")
    analysis = api.analyze(str(tmp_path / "ts.pt"), ["x=3x2x8:float32"])
    assert not _symbolic(analysis.captured.gm)
    assert len(analysis.layers) == 3  # the three linear maps
    assert len(api.partition(str(tmp_path / "ts.pt"), ["x=3x2x8:float32"], slices=3).functions) == 3


def test_a_node_torch_export_gave_an_empty_module_stack_joins_its_neighbours():
    model, x = _Stack().eval(), torch.randn(1, 6, 8)
    gm = torch.export.export(model, (x,)).module()
    key = "_empty_nn_module_stack_from_metadata_hook"
    view = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.view.default)
    view.meta["nn_module_stack"] = {key: (key, key)}
    lg = build_layer_graph(gm, input_names=("x",), output_names=("y",))
    assert [la.name for la in lg.layers] == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]


class KVCache:
    """Stands for transformers' DynamicCache: an object torch.export cannot flatten."""

    def __init__(self, key: torch.Tensor) -> None:
        self.key = key


class _Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        y = self.fc(x)
        return y, KVCache(y)


def test_a_model_returning_its_key_value_cache_is_told_to_set_use_cache_false():
    with pytest.raises(CaptureError) as info:
        api.analyze(_Cached().eval(), {"x": torch.randn(1, 4)})
    message = str(info.value)
    assert "use_cache = False" in message and "KVCache" in message
    assert ".." not in message and "If this type holds tensors" not in message


# --- the unseen Hugging Face architectures themselves ---------------------------------------

_SAVE = r"""
import sys, torch, transformers as T
from examples.zoo import _seeded, _DECODER_SIZE, example_inputs, ZooModel
folder = sys.argv[1]
def inputs(*specs):
    return example_inputs(ZooModel(name="x", family="", architecture="", handover="pt2",
                                   inputs=specs))
decoder = inputs("input_ids=1x16:int64:0..128", "attention_mask=1x16:int64:1..2")
seq = torch.export.Dim("seq", min=2, max=64)
models = {
    # a decoder exported with a dynamic sequence length
    "phi3_dynamic": (T.Phi3ForCausalLM, T.Phi3Config(**_DECODER_SIZE, pad_token_id=0), decoder,
                     {"input_ids": {1: seq}, "attention_mask": {1: seq}}),
    "olmoe": (T.OlmoeForCausalLM, T.OlmoeConfig(**_DECODER_SIZE, num_experts=4,
                                                 num_experts_per_tok=2), decoder, None),
    "segformer": (T.SegformerModel, T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
        inputs("pixel_values=1x3x32x32:float32"), None),
}
for name, (cls, config, kwargs, dynamic) in models.items():
    model = _seeded(lambda: cls(config))
    with torch.no_grad():
        ep = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)
    torch.export.save(ep, f"{folder}/{name}.pt2")
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi3_dynamic", "olmoe", "segformer"])
def test_an_unseen_hugging_face_model_compiles_into_three_slices_and_runs_matching(
    name, tmp_path_factory, tmp_path
):
    folder = tmp_path_factory.getbasetemp() / "unseen"
    if not (folder / f"{name}.pt2").exists():
        folder.mkdir(exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-c", _SAVE, str(folder)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=zoo._ROOT,
            env=zoo._env(),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "bundle"
    built = mopar("compile", folder / f"{name}.pt2", "--slices", "3", "--out", out, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert len(json.loads((out / "plan.json").read_text())["plan"]["functions"]) == 3
    run = mopar("run", out, "--check", "--requests", "2", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
