"""Third-party architectures with real pretrained weights compile to 3 slices and run matching."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mopar

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "efficientnet_lite0": ["inputs=1x3x224x224:float32"],
    "minilm": ["input_ids=1x64:int64:100..30000", "attention_mask=1x64:int64:1..2"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pretrained_model_compiles_to_three_slices_and_runs_matching(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "bundle"
    bundle = mopar.compile(f"tests.real_models:{name}", CASES[name], out=out, slices=3)
    assert len(bundle.plan.slices) == 3
    assert bundle.max_rel_err <= 1e-4
    run = subprocess.run(
        [sys.executable, "-m", "mopar", "run", str(out), "--check", "--requests", "2"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr

