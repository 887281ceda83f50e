"""float16 and bfloat16 models as they come: bfloat16 computes in float32 with its embedding
tables kept (`mopar.frontend.dtypes`), and the default check tolerance follows each output's
type (`mopar.config.Tolerance.following`).

The slow test at the end compiles a float16 and a bfloat16 transformers model, saved by another
process, at the defaults and with a forced split, and checks each bundle with ``mopar run``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from mopar.arguments import COMPILE_OPTIONS, compile_config
from mopar.config import CompileConfig, Tolerance, spacing
from mopar.emit.onnx_export import try_export_slice
from mopar.frontend import capture, load_model
from mopar.frontend.dtypes import default_tolerance
from mopar.ir.graph import TensorInfo
from mopar.ir.subgraph import SliceModule
from mopar.runtime.handler import SESSION_FILE, SliceHandler, saved_settings
from tests.conftest import mopar

# --- the tolerance rule ---------------------------------------------------------------------------


def test_float32_outputs_keep_the_default_tolerance_exactly():
    assert Tolerance.following({"y": ("float32", 123.0), "i": ("int64", 7.0)}) == Tolerance()
    assert default_tolerance({"y": np.full(3, 50.0, np.float32)}, {}) == Tolerance()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("magnitude", [0.0, 1e-6, 3e-3, 0.65, 1.0, 3.0, 1000.0])
def test_spacing_is_the_distance_to_the_next_value_of_the_type(dtype, magnitude):
    value = torch.tensor(magnitude, dtype=getattr(torch, dtype))
    step = torch.nextafter(value, torch.tensor(float("inf"), dtype=value.dtype)) - value
    assert spacing(dtype, float(value)) == float(step)
    if dtype == "float16":
        assert spacing(dtype, float(value)) == float(np.spacing(np.float16(magnitude)))


def test_float16_and_bfloat16_outputs_pass_within_four_steps_of_their_type():
    half = Tolerance.following({"logits": ("float16", 0.57)})
    assert half == Tolerance(rtol=4 * 2.0**-10, atol=4 * 2.0**-11)  # steps of 2^-11 at 0.57
    brain = Tolerance.following({"a": ("bfloat16", 3.0), "b": ("float32", 9.0)})
    assert brain == Tolerance(rtol=4 * 2.0**-7, atol=4 * 2.0**-6)  # steps of 2^-6 at 3
    tiny = Tolerance.following({"p": ("float16", 1e-3)})  # never stricter than float32's
    assert tiny.atol == Tolerance().atol


def test_a_bfloat16_output_kept_as_float32_is_judged_at_bfloat16s_steps():
    reference = {"logits": np.array([-3.0, 0.5], np.float32)}
    assert default_tolerance(reference, {"logits": "bfloat16"}).atol == 4 * 2.0**-6


def test_a_given_tolerance_wins_and_one_given_alone_keeps_the_other_default():
    assert CompileConfig().tolerance is None  # the outputs' types decide
    assert Tolerance.given(None, None) is None
    assert Tolerance.given(1e-2, None) == Tolerance(rtol=1e-2, atol=Tolerance().atol)
    config = compile_config("compile", COMPILE_OPTIONS, depth=None, options={"atol": 0.5})
    assert config.tolerance == Tolerance(rtol=Tolerance().rtol, atol=0.5)


# --- capture ---------------------------------------------------------------------------------------


class _Bf16(nn.Module):
    """A float32 model in, float32 out, computing in bfloat16 (``model.to(torch.bfloat16)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.to(torch.bfloat16)).float()


class _Tokens(nn.Module):
    """Token ids in, bfloat16 logits out: an embedding table and a linear head."""

    def __init__(self, classes: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_a_bfloat16_model_is_captured_computing_in_float32_and_the_plan_says_so():
    torch.manual_seed(0)
    model, x = _Bf16().eval(), torch.randn(1, 4)
    cm = capture(load_model(model), {"x": x.numpy()})
    with torch.no_grad():
        own = model(x)
    np.testing.assert_array_equal(cm.reference["output_0"], own.numpy())  # the model's own
    assert cm.output_dtypes == {"output_0": "bfloat16"}  # float32 out, rounded in bfloat16
    assert {p.dtype for p in cm.gm.parameters()} == {torch.bfloat16}  # held at 2 bytes
    casts = [n for n in cm.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert {n.args[0].target for n in casts} >= {"fc.weight", "fc.bias"}  # cast where used
    assert any("bfloat16 model computed in float32" in n for n in cm.notes)
    with torch.no_grad():
        ours = torch.fx.Interpreter(cm.gm).run(x)[0]
    np.testing.assert_allclose(ours.numpy(), own.numpy(), rtol=2**-6, atol=2**-6)


def test_a_float32_model_is_untouched_and_keeps_the_float32_tolerance():
    model, ids = _Tokens().eval(), np.zeros((1, 5), np.int64)
    cm = capture(load_model(model), {"ids": ids})
    assert cm.output_dtypes == {} and not any("computed in float32" in n for n in cm.notes)
    assert default_tolerance(cm.reference, cm.output_dtypes) == Tolerance()


def test_a_float8_model_is_still_refused_naming_the_weight():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(4).to(torch.float8_e4m3fn))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale.float()

    with pytest.raises(Exception, match=r"buffer scale is float8_e4m3fn.*\.bfloat16\(\)"):
        capture(load_model(Scaled().eval()), {"x": np.ones((1, 4), np.float32)})


# --- one small ONNX graph --------------------------------------------------------------------------


def test_a_bfloat16_slice_exports_with_its_weights_in_bfloat16_and_float32_at_its_edges(tmp_path):
    torch.manual_seed(0)
    # a head of 9,600 weights: the exporter folds the casts of those of at most 8,192 itself
    model, ids = _Tokens(1200).to(torch.bfloat16).eval(), torch.randint(0, 50, (1, 5))
    cm = capture(load_model(model), {"ids": ids.numpy()})
    out = next(n for n in cm.gm.graph.nodes if n.op == "output").args[0][0]
    unit = SliceModule(
        name="s0",
        gm=cm.gm,
        inputs=(TensorInfo(name="ids", shape=(1, 5), dtype="int64", nbytes=40),),
        outputs=(TensorInfo(name=out.name, shape=(1, 5, 1200), dtype="float32", nbytes=24000),),
    )
    path = tmp_path / "s0" / "model.onnx"
    path.parent.mkdir()
    assert try_export_slice(unit, {"ids": ids}, path, opset=None) is None
    proto = onnx.load(str(path))
    kinds = {i.name: onnx.TensorProto.DataType.Name(i.data_type) for i in proto.graph.initializer}
    assert kinds["embed.weight"] == kinds["head.weight"] == "BFLOAT16", kinds  # at 2 bytes
    assert [o.type.tensor_type.elem_type for o in proto.graph.output] == [onnx.TensorProto.FLOAT]
    # the session keeps them so: no folding of the casts at load
    assert saved_settings(path.with_name(SESSION_FILE)) == {"folding": False, "layouts": False}
    (got,) = SliceHandler(path.parent, intra_op_threads=1).handle({"ids": ids.numpy()}).values()
    want = cm.reference[cm.output_names[0]]
    assert got.dtype == np.float32 and want.dtype == np.float32
    tolerance = default_tolerance(cm.reference, cm.output_dtypes)
    np.testing.assert_allclose(got, want, rtol=tolerance.rtol, atol=tolerance.atol)


# --- transformers models, saved by another process --------------------------------------------------

_SAVE = """
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, use_cache=False,
)
for dtype in ("float16", "bfloat16"):
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    ids = torch.randint(0, 1000, (1, 16))
    ep = torch.export.export(model, (), {"input_ids": ids}, strict=False)
    torch.export.save(ep, f"{sys.argv[1]}/llama-{dtype}.pt2")
"""


@pytest.mark.slow
@pytest.mark.parametrize("split", [(), ("--slices", "2")], ids=["defaults", "two-slices"])
def test_float16_and_bfloat16_llamas_compile_and_pass_their_check(tmp_path, split):
    subprocess.run([sys.executable, "-c", _SAVE, str(tmp_path)], check=True, timeout=300)
    for dtype in ("float16", "bfloat16"):
        out = tmp_path / f"{dtype}-bundle"
        proc = mopar(
            "compile",
            tmp_path / f"llama-{dtype}.pt2",
            "--input",
            "input_ids=1x16:int64",
            *split,
            "--out",
            out,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        plan = json.loads((out / "plan.json").read_text())
        cuts = [t for f in plan["io"]["functions"] for t in f["outputs"]]
        assert {t["dtype"] for t in cuts} == {"float32"}, cuts  # computed in float32
        if split:
            assert len(plan["io"]["functions"]) == 2
        assert f"{dtype} model computed in float32" in proc.stdout
        assert "stay " + dtype in proc.stdout  # its weights, at 2 bytes
        # what the casts cost, measured on each function's session
        assert "holds its 16-bit weights at 2 bytes and casts them" in " ".join(proc.stdout.split())
        check = mopar("run", out, "--check", "--json", timeout=300)
        assert check.returncode == 0, check.stdout + check.stderr


_SAVE_MIXTRAL = """
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.MixtralConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
    use_cache=False,
)
model = transformers.MixtralForCausalLM(config).to(torch.bfloat16).eval()
ids = torch.randint(0, 256, (1, 16))
torch.export.save(torch.export.export(model, (), {"input_ids": ids}), sys.argv[1])
"""


@pytest.mark.slow
def test_a_bfloat16_mixtral_computes_its_grouped_matmuls_in_float32(tmp_path):
    """transformers runs a bfloat16 MoE's experts through aten._grouped_mm, whose kernel takes
    bfloat16 only; in float32 its own fallback computes the same product."""
    saved = tmp_path / "mixtral-bfloat16.pt2"
    subprocess.run([sys.executable, "-c", _SAVE_MIXTRAL, str(saved)], check=True, timeout=300)
    out = tmp_path / "bundle"
    proc = mopar("compile", saved, "--input", "input_ids=1x16:int64", "--out", out, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "bfloat16 model computed in float32" in proc.stdout
    check = mopar("run", out, "--check", "--json", timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
