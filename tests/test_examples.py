"""Every example model (its tiny variant) compiles into 3 slices and `mopar run --check` passes."""

from __future__ import annotations

import onnx
import pytest

from examples import EXAMPLES
from mopar import api
from tests.conftest import mopar


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_tiny_example_compiles_into_three_slices_and_runs_matching(name, tmp_path):
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
