"""The model zoo (examples/zoo.py) compiles into 3 slices and `mopar run --check` passes, with every
model handed over the way a user hands it over: built and saved (.pt2, TorchScript) in a process
of its own, then compiled and run by the real ``mopar`` command in fresh processes.

One subprocess saves every model this session selects (`zoo_files`); entries marked ``slow`` run
with ``pytest -m slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples import zoo
from tests.conftest import mopar

TEST_NAME = "test_zoo_model_compiles_into_three_slices_and_runs_matching"


def _params() -> list:
    return [
        pytest.param(z.name, id=z.name, marks=[pytest.mark.slow] if z.slow else [])
        for z in zoo.ZOO.values()
    ]


@pytest.fixture(scope="session")
def zoo_files(request, tmp_path_factory) -> Path:
    """A folder holding the saved models of every zoo test this session runs, written by one
    ``python -m examples.zoo --save`` subprocess (so no test process ever imported what the models'
    modules register)."""
    names = sorted(
        {
            item.callspec.params["name"]
            for item in request.session.items
            if getattr(item, "originalname", None) == TEST_NAME
        }
    )
    folder = tmp_path_factory.mktemp("zoo")
    proc = zoo.save_in_subprocess(folder, names)
    # Exit status 1 means some models failed to save: each test reports its own.
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return folder


@pytest.mark.parametrize("name", _params())
def test_zoo_model_compiles_into_three_slices_and_runs_matching(name, zoo_files, tmp_path):
    model = zoo.ZOO[name]
    if (error := zoo.saved_error(model, zoo_files)) is not None:
        pytest.fail(f"saving {name} ({model.handover}) failed in its own process: {error}")
    out = tmp_path / "bundle"
    built = mopar(*zoo.compile_args(model, zoo_files, out), timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads((out / "plan.json").read_text())
    assert len(manifest["plan"]["functions"]) == zoo.SLICES
    if model.handover == "factory":  # an eager module's outputs keep their field names
        assert not manifest["io"]["outputs"][0]["name"].startswith("output_")
    run = mopar("run", out, "--check", "--requests", "2", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "check: " in run.stdout


def test_zoo_covers_the_families_and_handovers_with_well_formed_entries():
    from mopar.frontend import parse_input_spec

    for name, z in zoo.ZOO.items():
        assert z.name == name and callable(getattr(zoo, name))
        assert z.family in zoo.FAMILIES and z.handover in zoo.HANDOVERS
        assert z.weights in ("random", "pretrained")
        for spec in z.inputs:
            parse_input_spec(spec)
    assert set(zoo.FAMILIES) == {z.family for z in zoo.ZOO.values()}
    assert set(zoo.HANDOVERS) == {z.handover for z in zoo.ZOO.values()}
    from_configs = [z for z in zoo.ZOO.values() if z.weights == "random" and z.family != "cnn"]
    assert len(from_configs) >= 14


def test_models_doc_has_a_row_for_every_zoo_model():
    doc = Path(__file__).resolve().parent.parent / "docs" / "models.md"
    rows = {
        line.split("|")[1].strip()
        for line in doc.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| model ")
    }
    assert rows == set(zoo.ZOO), (
        f"docs/models.md is out of date with examples/zoo.py (rows {sorted(rows)}); regenerate "
        f"it with `make models-doc` ({zoo.DOC_COMMAND})"
    )
