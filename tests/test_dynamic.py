"""Dynamic shapes: a bundle that takes its dynamic dimensions at any size in their range.

A Hugging Face BERT is exported by another process with its sequence length dynamic (2..32) and
its batch dynamic without a bound, and compiled in a fresh one with ``--dynamic`` for the batch.
The bundle must then answer at other sizes as the model does, refuse sizes out of range, carry
ONNX with dynamic axes and functions sized at the largest shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mopar.bundle.document import IoTensor
from mopar.bundle.function import TensorSpec
from mopar.config import DynamicDim, parse_dynamic
from mopar.errors import InputSpecError, OptionError
from tests.conftest import ROOT, mopar

SAVE = """
import sys
import torch
from tests.models import bert

ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
kwargs = dict(input_ids=ids, attention_mask=torch.ones(2, 16, dtype=torch.int64))
seq = torch.export.Dim("seq", min=2, max=32)
batch = torch.export.Dim("batch")
shapes = {k: {0: batch, 1: seq} for k in kwargs}
torch.export.save(torch.export.export(bert(), (), kwargs, dynamic_shapes=shapes), sys.argv[1])
"""
"""Saves the model in another process, the sequence bounded and the batch not."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dynamic") / "bert.pt2"
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, str(path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture(scope="module")
def bundle(saved, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dynamic-bundle") / "b"
    proc = mopar(
        "compile", saved, "--out", out, "--slices", "2",
        "--dynamic", "input_ids:0=1..3", "--dynamic", "attention_mask:0=1..3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


def _inputs(path: Path, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    arrays = {
        "input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
    }
    np.savez(path, **arrays)
    return arrays


def _model_outputs(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch

    from tests.models import bert

    with torch.no_grad():
        out = bert()(**{k: torch.from_numpy(v) for k, v in arrays.items()})
    return {
        "last_hidden_state": out.last_hidden_state.numpy(),
        "pooler_output": out.pooler_output.numpy(),
    }


@pytest.mark.parametrize(
    ("batch", "seq", "transport"),
    # http: the same shape checks in the function server (tests/test_bodies.py covers its door)
    [(1, 5, "shm"), pytest.param(3, 32, "http", marks=pytest.mark.slow)],
)
def test_the_bundle_answers_at_any_size_in_range_as_the_model_does(
    bundle, tmp_path, batch, seq, transport
):
    arrays = _inputs(tmp_path / "in.npz", batch, seq)
    proc = mopar(
        "invoke", bundle, "--input", tmp_path / "in.npz", "--output", tmp_path / "out.npz",
        "--transport", transport,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = dict(np.load(tmp_path / "out.npz"))
    for name, want in _model_outputs(arrays).items():
        assert got[name].shape == want.shape
        np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-4)


def test_a_size_outside_the_range_is_refused_in_one_line(bundle, tmp_path):
    _inputs(tmp_path / "in.npz", 1, 33)
    proc = mopar("invoke", bundle, "--input", tmp_path / "in.npz")
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "[1, 33]" in line and "[1..3, 2..32]" in line


def test_the_functions_take_dynamic_axes_and_are_sized_at_the_largest(bundle):
    import onnx

    document = json.loads((bundle / "plan.json").read_text())
    ids = next(t for t in document["io"]["inputs"] if t["name"] == "input_ids")
    assert (ids["shape"], ids["min_shape"], ids["max_shape"]) == ([2, 16], [1, 2], [3, 32])
    assert any(
        "dynamic dimensions" in n and "sized at the largest" in n for n in document["plan"]["notes"]
    )
    first = json.loads((bundle / "functions" / "s0" / "function.json").read_text())
    spec = next(t for t in first["receives"] if t["name"] == "input_ids")
    assert (spec["shape"], spec["min_shape"]) == ([3, 32], [1, 2])
    for function in ("s0", "s1"):
        model = onnx.load(
            str(bundle / "functions" / function / "model.onnx"), load_external_data=False
        )
        dims = model.graph.input[0].type.tensor_type.shape.dim
        assert dims[0].dim_param and dims[1].dim_param  # batch and sequence, symbolic


def test_a_dimension_without_a_bound_is_frozen_with_a_note(saved):
    from mopar import api

    analysis = api.analyze(saved)
    cm = analysis.captured
    assert {(d.input, d.axis, d.min, d.max) for d in cm.dims} == {
        ("input_ids", 1, 2, 32),
        ("attention_mask", 1, 2, 32),
    }
    frozen = [n for n in cm.notes if "frozen" in n]
    assert len(frozen) == 2 and "dynamic dimension, input_ids:0=MIN..MAX" in frozen[0]


def test_a_range_past_the_exported_one_is_refused(saved):
    from mopar import api

    with pytest.raises(InputSpecError, match=r"past the range 2\.\.32"):
        api.analyze(saved, dynamic=["input_ids:1=2..64"])


# --- the option and the specs, without a model ----------------------------------------------------


def test_parse_dynamic_reads_the_form_and_refuses_others():
    assert parse_dynamic("input_ids:1=1..512") == DynamicDim(
        input="input_ids", axis=1, min=1, max=512
    )
    for bad in ("input_ids:1=512", "input_ids=1..4", "x:0=4..2", "x:0=0..4", "x:0=3..3"):
        with pytest.raises(OptionError, match="dynamic"):
            parse_dynamic(bad)


def test_dynamic_does_not_go_with_codecs_or_sub_slices():
    from mopar.arguments import check_choices
    from mopar.config import CompileConfig

    for more in ({"codec": "zstd"}, {"parallel": 2}):
        with pytest.raises(OptionError, match="do not go together"):
            check_choices(CompileConfig(dynamic=("x:0=1..4",), **more))


def test_the_specs_take_every_shape_in_range_and_no_other():
    spec = TensorSpec(name="x", shape=(4, 64, 8), dtype="float32", min_shape=(1, 2, 8))
    assert spec.fits((1, 2, 8)) and spec.fits((4, 64, 8)) and spec.fits((2, 30, 8))
    assert not spec.fits((5, 2, 8)) and not spec.fits((1, 1, 8)) and not spec.fits((1, 2, 9))
    assert not spec.fits((1, 2))
    assert spec.describe() == "float32[1..4, 2..64, 8]"
    assert (
        TensorSpec.from_dict(
            {"name": "x", "shape": [4, 64, 8], "dtype": "float32", "min_shape": [1, 2, 8]}
        )
        == spec
    )
    with pytest.raises(ValueError, match="min_shape"):
        TensorSpec.from_dict({"name": "x", "shape": [4], "dtype": "float32", "min_shape": [5]})
    rows = TensorSpec(name="t", shape=(6, 8), dtype="float32", rows=True)
    assert rows.fits((1, 8)) and not rows.fits((7, 8)) and rows.describe() == "float32[1..6, 8]"
    io = IoTensor(
        name="x", shape=(2, 16), dtype="int64", nbytes=256, min_shape=(1, 2), max_shape=(3, 32)
    )
    assert IoTensor.from_dict(io.to_dict()) == io
    assert io.fits((3, 32)) and not io.fits((3, 33)) and io.describe() == "int64 [1..3, 2..32]"
