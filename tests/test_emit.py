"""Emit: ONNX slices, the bundle layout, and writing a bundle atomically."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml

from mopar import api
from mopar._files import RECORD_FILE
from mopar.bundle.document import BundleDocument
from mopar.emit.bundle import staging_dir
from mopar.emit.onnx_export import run_slices_torch, try_export_slice
from mopar.errors import BundleError
from mopar.rewrite import split_by_plan
from mopar.runtime import handler as handler_module
from mopar.targets.openfaas.emit import dns1123
from tests.conftest import SKIPNET_INPUT, plan_of

SLICES = ("s0", "s1", "s2")


@pytest.fixture(scope="module")
def manifest(skipnet_bundle):
    return json.loads((skipnet_bundle / "plan.json").read_text())


@pytest.mark.parametrize("name", SLICES)
def test_every_slice_onnx_passes_the_full_checker(skipnet_bundle, name):
    path = skipnet_bundle / "functions" / name / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)


@pytest.mark.parametrize("index", range(3))
def test_onnx_slice_inputs_and_outputs_are_named_as_in_the_manifest(
    skipnet_bundle, manifest, index
):
    io = manifest["io"]["functions"][index]
    model = onnx.load(str(skipnet_bundle / io["onnx"]))
    assert [i.name for i in model.graph.input] == [t["name"] for t in io["inputs"]]
    assert [o.name for o in model.graph.output] == [t["name"] for t in io["outputs"]]
    # The weights are embedded: no external data files next to the model.
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def test_the_skip_tensor_is_an_input_of_the_last_slice(manifest):
    first, _, last = manifest["io"]["functions"]
    skip = {t["name"] for t in first["outputs"]} & {t["name"] for t in last["inputs"]}
    assert skip == {"t:relu"}


def test_chaining_the_onnx_files_reproduces_the_reference_output(skipnet_bundle, manifest):
    ref = np.load(skipnet_bundle / "reference.npz")
    values = {
        name.removeprefix("input."): ref[name] for name in ref.files if name.startswith("input.")
    }
    for io in manifest["io"]["functions"]:
        session = ort.InferenceSession(
            str(skipnet_bundle / io["onnx"]), providers=["CPUExecutionProvider"]
        )
        names = [t["name"] for t in io["outputs"]]
        feed = {t["name"]: values[t["name"]] for t in io["inputs"]}
        values.update(zip(names, session.run(names, feed)))
    for out in manifest["io"]["outputs"]:
        np.testing.assert_allclose(
            values[out["value"]], ref[f"output.{out['name']}"], rtol=1e-5, atol=1e-5
        )


def test_reference_output_is_the_eager_model_on_the_reference_input(skipnet_bundle):
    from tests import models

    ref = np.load(skipnet_bundle / "reference.npz")
    assert sorted(ref.files) == ["input.x", "output.output_0"]
    with torch.no_grad():
        want = models.skipnet()(torch.from_numpy(ref["input.x"]))
    torch.testing.assert_close(torch.from_numpy(ref["output.output_0"]), want)


def test_bundle_layout(skipnet_bundle, manifest):
    # planned for OpenFaaS (the default): its files alone, and a README saying how to deploy
    assert {p.name for p in skipnet_bundle.iterdir()} - {".mopar-files.json"} == {
        "plan.json",
        "reference.npz",
        "stack.yml",
        "functions",
        "template",
        "README.md",
    }
    assert sorted(p.name for p in (skipnet_bundle / "functions").iterdir()) == list(SLICES)
    weighted = {f["name"] for f in manifest["io"]["functions"] if "weights" in f}
    assert weighted, "skipnet's convolutions have weights"
    for name in SLICES:
        folder = skipnet_bundle / "functions" / name
        weights = ["model.onnx.data"] if name in weighted else []
        assert sorted(p.name for p in folder.iterdir()) == [
            "function.json",
            "handler.py",
            "model.onnx",
            *weights,
            "requirements.txt",
        ]
        # The function runs the very handler `mopar run` runs, and needs no torch.
        assert filecmp.cmp(folder / "handler.py", handler_module.__file__, shallow=False)
        reqs = (folder / "requirements.txt").read_text().split()
        assert {r.split("==")[0] for r in reqs} == {"onnxruntime", "numpy", "zstandard"}
    assert not list(skipnet_bundle.parent.glob(".bundle.*"))  # no staging leftovers


def test_manifest_records_plan_io_and_verification(manifest):
    assert manifest["bundle_format_version"] == 2
    assert [s["name"] for s in manifest["plan"]["functions"]] == list(SLICES)
    assert [la["name"] for la in manifest["layers"]] == ["stem", "act", "mid1", "mid2", "head"]
    assert [t["name"] for t in manifest["io"]["inputs"]] == ["x"]
    assert manifest["io"]["outputs"] == [
        {"name": "output_0", "value": "t:conv2d_3", "shape": [1, 4, 8, 8], "dtype": "float32"}
    ]
    verification = manifest["verification"]
    assert verification["max_rel_err"] <= 1e-5
    assert (verification["rtol"], verification["atol"]) == (1e-3, 1e-4)


def test_stack_yml_has_one_sized_function_per_slice(skipnet_bundle, manifest):
    stack = yaml.safe_load((skipnet_bundle / "stack.yml").read_text())
    assert stack["version"] == 1.0 and stack["provider"]["name"] == "openfaas"
    functions = stack["functions"]
    assert list(functions) == ["skipnet-s0", "skipnet-s1", "skipnet-s2"]
    for (fname, fn), plan_slice in zip(functions.items(), manifest["plan"]["functions"]):
        assert dns1123(fname) == fname and len(fname) <= 63
        assert fn["handler"] == f"./functions/{plan_slice['name']}"
        assert fn["limits"]["memory"] == fn["requests"]["memory"] == f"{plan_slice['memory_mb']}Mi"
    nexts = [f["environment"]["MOPAR_NEXT"] for f in functions.values()]
    assert nexts[-1] == ""
    assert all(
        url.startswith("http://") and name in url for name, url in zip(list(functions)[1:], nexts)
    )


@pytest.mark.parametrize(
    "text, label",
    [
        ("ResNet_50", "resnet-50"),
        ("--a..b--", "a-b"),
        ("x" * 80, "x" * 63),
        ("!!!", "model"),
    ],
)
def test_dns1123_labels(text, label):
    assert dns1123(text) == label


# --- writing atomically ---------------------------------------------------------------------------


def test_staging_refuses_an_existing_output_without_force(tmp_path):
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(BundleError, match="--force"):
        with staging_dir(out, force=False):
            pass
    assert (out / "keep").read_text() == "old"


def _old_bundle(out: Path) -> None:
    """A bundle as a compile writes one (stopped after its plan), holding a file ``old``."""
    with staging_dir(out, force=False) as staged:
        tmp = staged.path
        BundleDocument(plan={"functions": []}, until="plan").write(tmp)
        (tmp / "old").write_text("old")


def test_staging_replaces_with_force_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "bundle"
    _old_bundle(out)
    with staging_dir(out, force=True) as staged:
        tmp = staged.path
        (tmp / "new").write_text("new")
        assert not (out / "new").exists()  # nothing is visible before the end
    assert sorted(p.name for p in out.iterdir()) == [RECORD_FILE, "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_a_failed_build_leaves_the_old_bundle_and_no_partial_folder(tmp_path):
    out = tmp_path / "bundle"
    _old_bundle(out)
    with pytest.raises(RuntimeError):
        with staging_dir(out, force=True) as staged:
            tmp = staged.path
            (tmp / "half").write_text("half")
            raise RuntimeError("export failed")
    assert sorted(p.name for p in out.iterdir()) == [RECORD_FILE, "old", "plan.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_compile_refuses_an_existing_output_before_any_work(tmp_path):
    out = tmp_path / "bundle"
    out.mkdir()
    with pytest.raises(BundleError, match="already exists"):
        api.compile("tests.models:mlp", ["x=1x16:float32"], out=out, slices=2)
    assert list(out.iterdir()) == []


# --- bugs -----------------------------------------------------------------------------------------


def test_slice_output_named_like_an_internal_value_of_the_retraced_slice_exports(tmp_path):
    analysis = api.analyze("tests.models:relu_rename", [SKIPNET_INPUT])
    lg = analysis.layers
    names = [la.name for la in lg.layers]
    cut1, cut2 = names.index("act#2"), names.index("merge")
    slices = split_by_plan(lg, plan_of([names[:cut1], names[cut1:cut2], names[cut2:]]))
    assert [t.name for t in slices[1].outputs] == ["t:relu_2", "t:conv2d_5"]
    values = run_slices_torch(slices, analysis.captured.inputs)
    assert try_export_slice(slices[1], values, tmp_path / "s1.onnx", opset=None) is None
    onnx.checker.check_model(str(tmp_path / "s1.onnx"), full_check=True)


def test_a_model_with_a_scalar_output_compiles(tmp_path):
    bundle = api.compile(
        "tests.models:scalar_out", ["x=1x16:float32"], out=tmp_path / "b", slices=2
    )
    assert bundle.max_rel_err <= 1e-4
