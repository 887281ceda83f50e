"""Outputs are named by the model's own keys, whatever the source: a module given directly and
the same module saved by `torch.export.save` in another process give the same names."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mopar
from mopar.api import analyze
from tests.conftest import ROOT


class Keyed(torch.nn.Module):
    """Returns a dict, one of whose values is a dict: ``logits`` and ``hidden``'s
    ``last_hidden_state``, and a tuple under ``pair``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {
            "logits": self.head(h),
            "hidden": {"last_hidden_state": h},
            "pair": (h + 1, h * 2),
        }


NAMES = ("logits", "hidden_last_hidden_state", "pair_0", "pair_1")

SAVE = (
    "import sys\nimport torch\n\n"
    + textwrap.dedent(inspect.getsource(Keyed))
    + "\ntorch.export.save(torch.export.export(Keyed(), (torch.ones(2, 8),)), sys.argv[1])\n"
)
"""The script that saves ``Keyed`` in another process: torch alone, the class's own source."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """``Keyed`` exported and saved as a .pt2 by another Python process (which never imports
    mopar or this module)."""
    path = tmp_path_factory.mktemp("names") / "keyed.pt2"
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return path


def test_a_saved_program_names_its_outputs_as_the_module_does(saved):
    x = torch.ones(2, 8)
    direct = analyze(Keyed(), (x,)).captured
    loaded = analyze(str(saved), (x,)).captured
    assert direct.output_names == NAMES
    assert loaded.output_names == direct.output_names
    assert list(loaded.reference) == list(NAMES)
    for name in NAMES:
        torch.testing.assert_close(
            torch.from_numpy(loaded.reference[name]), torch.from_numpy(direct.reference[name])
        )


def test_a_bundle_of_a_saved_program_names_its_outputs_by_key(saved, tmp_path):
    bundle = mopar.compile(str(saved), out=tmp_path / "b", slices=2, until="rewrite")
    doc = json.loads((bundle.path / "plan.json").read_text())
    assert [o["name"] for o in doc["io"]["outputs"]] == list(NAMES)


def test_a_single_tensor_output_is_still_output_0(tmp_path):
    program = torch.export.export(torch.nn.Linear(4, 2), (torch.ones(1, 4),))
    path = tmp_path / "one.pt2"
    torch.export.save(program, path)
    assert analyze(str(path)).captured.output_names == ("output_0",)


BERT = textwrap.dedent(
    """
    import sys
    import torch
    from tests import models
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones(1, 16, dtype=torch.int64)}
    program = torch.export.export(models.bert(), (), kwargs, strict=False)
    torch.export.save(program, sys.argv[1])
    """
)


@pytest.mark.slow  # the default suite's case: test_a_saved_program_names_its_outputs_as_the_module_does
def test_a_saved_hugging_face_model_names_its_outputs_by_its_model_output_fields(tmp_path):
    from tests import models

    path = tmp_path / "bert.pt2"
    proc = subprocess.run(
        [sys.executable, "-c", BERT, str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    direct = analyze("tests.models:bert", list(models.TEXT_INPUTS)).captured
    loaded = analyze(str(path)).captured
    assert loaded.output_names == direct.output_names == ("last_hidden_state", "pooler_output")
