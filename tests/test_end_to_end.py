"""One end-to-end matrix: every model compiles into 3 slices and `mopar run --check` passes.

Its models come from two places, each handed over its own way:

- the paper's example models (`examples.EXAMPLES`, their tiny variants), compiled in this process
  by `mopar.compile` from their factories; every ONNX slice passes the full checker;
- the model zoo (`examples/zoo.py`): third-party architectures handed over the way a user hands
  them over, built and saved (.pt2, TorchScript) in a process of their own (the session's
  `zoo_files`), then compiled and run by the real ``mopar`` command in fresh processes.

The default run compiles and runs each model family once: the examples of `DEFAULT_EXAMPLES` and
the zoo's entries not marked ``slow``. The other models of a family run with ``pytest -m slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples import EXAMPLES, zoo
from tests.conftest import mopar

# One example of each family that no default zoo entry covers: resnet50 is the default run's cnn
# (the zoo's efficientnet_lite0, with its real weights, runs with the slow ones) and the zoo's
# bert the default run's (encoder) transformer.
DEFAULT_EXAMPLES = ("resnet50", "lstm_cnn", "gcn")


def _example_params() -> list:
    return [
        pytest.param(name, id=name, marks=[] if name in DEFAULT_EXAMPLES else [pytest.mark.slow])
        for name in sorted(EXAMPLES)
    ]


def _zoo_params() -> list:
    return [
        pytest.param(z.name, id=z.name, marks=[pytest.mark.slow] if z.slow else [])
        for z in zoo.ZOO.values()
    ]


# --- the examples ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _example_params())
def test_tiny_example_compiles_into_three_slices_and_runs_matching(name, tmp_path):
    import onnx

    from mopar import api

    example = EXAMPLES[name]
    out = tmp_path / "bundle"
    bundle = api.compile(example.tiny_factory, list(example.tiny_inputs), out=out, slices=3)
    assert len(bundle.plan.functions) == 3
    assert bundle.max_rel_err <= 1e-4
    for s in bundle.plan.functions:
        onnx.checker.check_model(str(out / "functions" / s.name / "model.onnx"), full_check=True)
    run = mopar("run", out, "--check", "--requests", "2")
    assert run.returncode == 0, run.stderr
    assert "check: outputs match the model" in run.stdout


def test_every_example_names_importable_factories_and_valid_inputs():
    from mopar.frontend import parse_input_spec
    from mopar.frontend.load import FACTORY_RE

    assert EXAMPLES
    for name, ex in EXAMPLES.items():
        assert ex.name == name
        assert FACTORY_RE.match(ex.factory) and FACTORY_RE.match(ex.tiny_factory)
        assert ex.tiny_factory == ex.factory + "_tiny"
        for spec in (*ex.inputs, *ex.tiny_inputs):
            parse_input_spec(spec)


def test_the_default_examples_are_one_per_family_the_default_zoo_leaves_out():
    default_zoo = {z.family for z in zoo.ZOO.values() if not z.slow}
    families = [EXAMPLES[name].family for name in DEFAULT_EXAMPLES]
    assert len(families) == len(set(families))
    assert "encoder" in default_zoo and "cnn" not in default_zoo  # the examples' transformer
    assert {e.family for e in EXAMPLES.values()} - {"transformer"} == set(families)


# --- the zoo --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _zoo_params())
def test_zoo_model_compiles_into_three_slices_and_runs_matching(name, zoo_files, tmp_path):
    model = zoo.ZOO[name]
    if (error := zoo.saved_error(model, zoo_files)) is not None:
        pytest.fail(f"saving {name} ({model.handover}) failed in its own process: {error}")
    out = tmp_path / "bundle"
    built = mopar(*zoo.compile_args(model, zoo_files, out), timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    manifest = json.loads((out / "plan.json").read_text())
    assert len(manifest["plan"]["functions"]) == zoo.SLICES
    if model.handover in ("factory", "pt2"):  # a module's and a saved program's outputs keep
        # their field names (a .pt2's from its out_spec); a TorchScript file's tensor: output_0
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
