"""Planning models without their weights (`mopar.frontend.weightless`): from a transformers
config, or from a .pt2 another process saved of a model on the meta device; priced from
shapes and byte counts, never from values; refused by compile, naming the fix; and the plan
file `mopar plan --json` writes, simulated without a bundle."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from mopar.cli import cli

pytest.importorskip("transformers")

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
"""The tiny shape of both configs: 2 layers, hidden 64."""

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    **TINY,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "dtype": "float32",
}
MIXTRAL = {
    **LLAMA,
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "dtype": "bfloat16",
}


def _params(config: dict) -> int:
    """The parameters a Llama-shaped config describes: embeddings, per layer attention,
    MLP (or each expert's and the router) and two norms, the final norm and the head."""
    h, i, v, n = (
        config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers")
    )
    experts = config.get("num_local_experts")
    mlp = experts * 3 * h * i + experts * h if experts else 3 * h * i
    return v * h + n * (4 * h * h + mlp + 2 * h) + h + v * h


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("configs")
    (root / "llama.json").write_text(json.dumps(LLAMA))
    folder = root / "tiny-mixtral"  # a model folder with its config and no weights
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MIXTRAL))
    return root


def _plan(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["plan", *args, "--input", "input_ids=1x16:int64", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def llama_plan(configs) -> dict:
    """What `mopar plan llama.json --json` printed for the tiny Llama config."""
    return _plan(str(configs / "llama.json"), "--target", "lambda")


def test_a_config_json_plans_with_its_weights_counted_from_shapes(llama_plan):
    plan = llama_plan
    weights = sum(f["param_bytes"] for f in plan["functions"])
    # float32: 4 bytes per parameter, and the rotary table's few buffers
    assert _params(LLAMA) * 4 <= weights < _params(LLAMA) * 4 + 1024
    assert any("has no weights" in note for note in plan["notes"])


@pytest.mark.slow  # the config test plans from a file by default; this one adds a folder, bfloat16
# bytes and the experts recognised by shape (2.4 s of CPU once warm)
def test_a_model_folder_of_a_bfloat16_moe_config_plans_its_experts_on_uniform_routing(configs):
    plan = _plan(str(configs / "tiny-mixtral"))
    weights = sum(f["param_bytes"] for f in plan["functions"])
    # planned as compile holds them: every weight bfloat16, cast where used
    held = 2 * _params(MIXTRAL)
    assert held <= weights < 2 * held
    notes = " ".join(plan["notes"])
    assert "bfloat16 model computed in float32" in notes
    assert "recognised by their shapes alone" in notes
    assert "uniform routing" in notes


def test_a_meta_model_is_captured_without_values():
    """Every tensor of the captured graph is on the meta device: nothing was computed, and
    the model has no reference outputs."""
    import numpy as np
    import torch
    from torch import nn

    from mopar.frontend import capture, load_model

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    loaded = load_model(model, weightless=True)
    cm = capture(loaded, {"input": np.zeros((1, 4), dtype=np.int64)})
    assert cm.reference == {} and cm.output_names
    vals = [n.meta.get("val") for n in cm.gm.graph.nodes]
    assert all(v.is_meta for v in vals if isinstance(v, torch.Tensor))
    assert all(p.is_meta for p in cm.gm.parameters())


SAVE_META = textwrap.dedent(
    """
    import sys, torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, 64)
            self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
            self.head = nn.Linear(64, 256)

        def forward(self, input_ids):
            return self.head(self.body(self.embed(input_ids)))

    with torch.device("meta"):
        model = LM().eval()
    ids = torch.zeros(1, 16, dtype=torch.int64, device="meta")
    torch.export.save(torch.export.export(model, (ids,)), sys.argv[1])
    """
)
META_PARAMS = 256 * 64 + (64 * 128 + 128) + (128 * 64 + 64) + (64 * 256 + 256)


@pytest.fixture(scope="module")
def meta_pt2(tmp_path_factory) -> Path:
    """A .pt2 another process saved of a model on the meta device."""
    path = tmp_path_factory.mktemp("meta") / "lm.pt2"
    subprocess.run([sys.executable, "-c", SAVE_META, str(path)], check=True, timeout=120)
    return path


@pytest.mark.slow  # the subprocess imports torch (3 s of CPU); a config plans without weights by
# default, and the loader takes a meta module (test_a_meta_module_is_refused_by_the_loader...)
def test_a_pt2_saved_on_the_meta_device_by_another_process_plans(meta_pt2):
    result = CliRunner().invoke(cli, ["plan", str(meta_pt2), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert sum(f["param_bytes"] for f in plan["functions"]) == META_PARAMS * 4


def test_compile_of_a_config_is_refused_in_one_line(configs, tmp_path):
    args = ["compile", str(configs / "llama.json"), "--input", "input_ids=1x16:int64", "--out"]
    _refused(CliRunner().invoke(cli, [*args, str(tmp_path / "b")]), tmp_path)


@pytest.mark.slow  # the loader refuses a meta module by default (test_a_meta_module_is_refused...)
def test_compile_of_a_meta_pt2_is_refused_in_one_line(meta_pt2, tmp_path):
    args = ["compile", str(meta_pt2), "--out", str(tmp_path / "b")]
    _refused(CliRunner().invoke(cli, args), tmp_path)


def test_a_meta_module_is_refused_by_the_loader_unless_planned():
    import torch
    from torch import nn

    from mopar.errors import ModelLoadError
    from mopar.frontend import load_model

    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ModelLoadError, match="give the weights") as info:
        load_model(model)
    assert "\n" not in str(info.value)
    assert load_model(model, weightless=True).weightless


def _refused(result, tmp_path: Path) -> None:
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "give the weights" in lines[0]
    assert not (tmp_path / "b").exists()


def test_a_plan_file_is_simulated_without_a_bundle(llama_plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(llama_plan))
    args = ["simulate", str(path), "--rate", "10", "--requests", "200", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cost_per_1m_usd"] > 0


def test_a_config_builds_the_architecture_it_names(tmp_path):
    from mopar.frontend.weightless import load_config

    bert = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1}
    bert |= {"num_attention_heads": 2, "intermediate_size": 64}
    named, unnamed = tmp_path / "named.json", tmp_path / "unnamed.json"
    named.write_text(json.dumps({**bert, "architectures": ["BertModel"]}))
    unnamed.write_text(json.dumps(bert))
    assert type(load_config(named)).__name__ == "BertModel"  # not a BERT with an LM head
    assert type(load_config(unnamed)).__name__ == "BertLMHeadModel"  # a causal LM first
