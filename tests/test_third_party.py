"""Third-party transformers (Hugging Face, tiny configs, random weights) compile into 3 slices
and `mopar run --check` passes. The factories are in tests/models.py."""

from __future__ import annotations

import json

import pytest

from mopar import api
from tests.models import TEXT_INPUTS
from tests.conftest import mopar

CASES = {
    "bert": (list(TEXT_INPUTS), ("last_hidden_state", "pooler_output")),
    "distilbert": (list(TEXT_INPUTS), ("last_hidden_state",)),
    "gpt2": (["input_ids=1x16:int64:0..100"], ("last_hidden_state",)),
    "vit": (["pixel_values=1x3x16x16:float32"], ("last_hidden_state", "pooler_output")),
    "t5_encoder": (list(TEXT_INPUTS), ("last_hidden_state",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_transformer_compiles_into_three_slices_and_runs_matching(name, tmp_path):
    specs, outputs = CASES[name]
    out = tmp_path / "bundle"
    bundle = api.compile(f"tests.models:{name}", specs, out=out, slices=3)
    assert len(bundle.plan.slices) == 3
    assert bundle.max_rel_err <= 1e-4
    manifest = json.loads((out / "plan.json").read_text())
    assert tuple(o["name"] for o in manifest["io"]["outputs"]) == outputs
    assert manifest["io"]["outputs"][0]["shape"][-1] == 32  # hidden size
    run = mopar("run", out, "--check", "--requests", "2")
    assert run.returncode == 0, run.stderr
