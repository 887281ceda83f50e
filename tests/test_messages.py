"""Messages that say what is wrong, and no silent changes (issue 33, points 9 and 10).

Each case once got a misleading message, a plain Python exception, or a change nobody was told
of: a .pt2 exported in training mode, a model without weights, a path that is no file, a .pt2 of
another torch, a run whose requests failed, a caller's module left in eval mode, a payload of a
codec the function never declared, and an embedding index onnxruntime would have answered.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import mopar
from mopar.bundle.document import IoTensor
from mopar.bundle.function import FunctionSpec, TensorSpec
from mopar.errors import CaptureError, InputSpecError, ModelLoadError, OptionError
from mopar.frontend import capture, load_model
from mopar.runner.check import Comparison
from mopar.runner.report import RunReport
from mopar.runtime import wire
from mopar.runtime.core import RequestError
from mopar.runtime.frame import join_frame

X = torch.randn(2, 8)


class _Norm(nn.Module):
    """A layer with BatchNorm and Dropout, which behave differently in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


def trained_factory() -> nn.Module:
    """A factory that returns its model in training mode, as nn.Module() makes it."""
    return _Norm()


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.words, self.kinds = nn.Embedding(30, 4), nn.Embedding(2, 4)

    def forward(self, ids, kinds):
        return self.words(ids.view(-1)) + self.kinds(kinds)


# --- training mode ---------------------------------------------------------------------------


def test_a_pt2_exported_in_training_mode_says_so_and_to_call_eval(tmp_path):
    path = tmp_path / "trained.pt2"
    torch.export.save(torch.export.export(_Norm().train(), (X,)), path)
    with pytest.raises(CaptureError, match="exported in training mode") as caught:
        capture(load_model(path), None)
    text = str(caught.value)
    assert "BatchNorm1d 'bn'" in text and "Dropout 'drop'" in text
    assert "model.eval() before torch.export.export" in text and "tolerance" not in text


def test_the_callers_module_keeps_every_submodules_training_flag_and_the_plan_says_so():
    model = _Norm().train()
    model.drop.eval()  # a mix: each flag must come back as it was
    analysis = mopar.analyze(model, (X,))
    assert [m.training for m in (model, model.fc, model.bn, model.drop)] == [1, 1, 1, 0]
    assert any("training mode" in n and "eval mode" in n for n in analysis.captured.notes)


def test_a_factorys_training_mode_model_is_compiled_in_eval_mode_with_a_note():
    captured = capture(
        load_model("tests.test_messages:trained_factory"), {"x": X.numpy()}, notes=()
    )
    (note,) = [n for n in captured.notes if "training mode" in n]
    assert "factory 'trained_factory'" in note and "eval mode" in note


def test_a_long_list_of_training_layers_is_cut_to_the_first_few_and_a_count(tmp_path):
    model = nn.Sequential(*[_Norm() for _ in range(5)]).train()
    path = tmp_path / "trained.pt2"
    torch.export.save(torch.export.export(model, (X,)), path)
    with pytest.raises(CaptureError, match="exported in training mode") as caught:
        capture(load_model(path), None)
    assert " and 7 more run as in training" in str(caught.value)  # 10 layers: 3 shown


class _Optional(nn.Module):
    def forward(self, x, labels=None, use_cache=False):
        return x * 2


def test_a_missing_input_error_names_only_what_forward_needs():
    from mopar.arguments import _check_names

    with pytest.raises(InputSpecError) as caught:
        _check_names(load_model(_Optional()), {}, "test")
    said = str(caught.value)
    assert "needs example inputs: x;" in said and "labels" not in said and "use_cache" not in said


# --- the model and its inputs ----------------------------------------------------------------


def test_a_meta_device_model_is_told_it_has_no_weights_not_to_fix_its_shapes():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ModelLoadError, match="has no weights") as caught:
        mopar.analyze(model, (X,))
    assert "meta device" in str(caught.value) and "shape" not in str(caught.value).split(";")[1]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(2, 8, device="meta"),
        # a CUDA tensor on a machine without CUDA: a fake one, which holds no values either
        lambda: _fake_cuda(2, 8),
    ],
    ids=["meta", "cuda"],
)
def test_an_input_on_another_device_is_a_mopar_error_naming_the_device(make):
    with pytest.raises(InputSpecError) as caught:
        mopar.analyze(nn.Linear(8, 8), (make(),))
    device = "meta device" if "meta" in str(caught.value) else "cuda:0"
    assert device in str(caught.value) and str(caught.value).startswith("example_args[0]")


def _fake_cuda(*shape: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


@pytest.mark.parametrize("model", [nn.Identity(), nn.Sequential()], ids=["identity", "empty"])
def test_a_model_that_computes_nothing_is_a_capture_error(model):
    with pytest.raises(CaptureError, match="computes nothing"):
        mopar.analyze(model, (X,))


@pytest.mark.parametrize("out", [".", "..", "/"])
def test_compile_into_the_working_directory_or_above_is_an_option_error(out, tmp_path, monkeypatch):
    (tmp_path / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptionError, match="give a new folder"):
        mopar.compile(nn.Linear(8, 8), (X,), out=out, force=True)
    assert (tmp_path / "keep.txt").read_text() == "mine"


# --- model files -----------------------------------------------------------------------------


def test_dev_null_and_a_fifo_are_named_for_what_they_are(tmp_path):
    with pytest.raises(ModelLoadError, match="'/dev/null' is a character device, not a file"):
        load_model("/dev/null")
    fifo = tmp_path / "model.pt2"
    os.mkfifo(fifo)
    with pytest.raises(ModelLoadError, match="is a named pipe"):
        load_model(fifo)


@pytest.fixture(scope="module")
def saved_pt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pt2") / "small.pt2"
    torch.export.save(torch.export.export(nn.Linear(8, 8).eval(), (X,)), path)
    return path


def _rewritten(path: Path, out: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path) as zi, zipfile.ZipFile(out, "w") as zo:
        for item in zi.infolist():
            zo.writestr(item, data if item.filename.endswith(member) else zi.read(item))
    return out


@pytest.mark.parametrize("member", ["/archive_version", "/.data/version"])
def test_a_pt2_of_a_newer_torch_is_called_another_torchs_not_damaged(saved_pt2, tmp_path, member):
    newer = _rewritten(saved_pt2, tmp_path / "newer.pt2", member, b"99")
    with pytest.raises(ModelLoadError) as caught:
        load_model(newer)
    text = str(caught.value)
    assert "damaged" not in text and "saved by another torch version" in text
    assert "99" in text and f"this torch {torch.__version__.split('+')[0]}" in text
    assert "re-export the model with this torch" in text


# --- the run's verdict -----------------------------------------------------------------------


def test_a_run_with_failed_requests_never_says_outputs_match(tmp_path, monkeypatch):
    from mopar.cli import cli

    report = RunReport(
        slices=(),
        latency_p50_ms=1.0,
        latency_p95_ms=1.0,
        requests=10,
        errors=3,
        comparison=Comparison(),  # the 7 that answered matched
        error_messages=("function s1 answered 500",),
        transport="http",
    )
    manifest = SimpleNamespace(
        model="m",
        slices=(),
        document=SimpleNamespace(verification=None, plan={}, generation=None),
    )
    arrays = {"x": np.zeros(2, np.float32)}
    monkeypatch.setattr("mopar.runner.bundle.read_manifest", lambda path: manifest)
    monkeypatch.setattr("mopar.runner.bundle.read_reference", lambda path: (arrays, arrays))
    monkeypatch.setattr("mopar.cli.run._run", lambda *a, **k: [report])
    result = CliRunner().invoke(
        cli, ["run", str(tmp_path), "--check", "--transport", "http"], catch_exceptions=False
    )
    assert result.exit_code == 1
    assert "match" not in result.output and "3 of 10 requests" in result.output
    assert report.to_dict()["check"]["passed"] is False


# --- what a function receives ----------------------------------------------------------------


def _function(tmp_path: Path, receives: TensorSpec, onnx_node: str):
    """A one-node function folder (``onnx_node``: Relu of x, or Gather of a 30-row table by
    ids), served as `mopar.runtime.framed.SliceFunction` serves it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from mopar.runtime.framed import SliceFunction

    kind = TensorProto.FLOAT if receives.dtype == "float32" else TensorProto.INT64
    inputs = [helper.make_tensor_value_info(receives.name, kind, list(receives.shape))]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    table = [numpy_helper.from_array(np.arange(120, dtype=np.float32).reshape(30, 4), "table")]
    node = (
        helper.make_node("Relu", [receives.name], ["y"])
        if onnx_node == "Relu"
        else helper.make_node("Gather", ["table", receives.name], ["y"])
    )
    graph = helper.make_graph([node], "g", inputs, [out], table if onnx_node != "Relu" else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    folder = tmp_path / "s0"
    folder.mkdir()
    onnx.save(model, folder / "model.onnx")
    FunctionSpec(
        model="m",
        slice="s0",
        index=0,
        count=1,
        receives=(receives,),
        outputs=("y",),
        sends=("y",),
        returns={"y": "y"},
    ).write(folder)
    return SliceFunction(folder)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_server_refuses_a_payload_of_a_codec_function_json_does_not_declare(tmp_path, codec):
    function = _function(tmp_path, TensorSpec(name="x", shape=(2, 8), dtype="float32"), "Relu")
    x = np.ones((2, 8), np.float32)
    with pytest.raises(RequestError, match=f"encoded with codec {codec}.*declares codec none"):
        function.process(join_frame({"x": wire.encode(x, codec)}))
    function.process(join_frame({"x": wire.encode(x, "none")}))  # the declared one serves


def test_a_zstd_level_is_no_codec_of_its_own(tmp_path):
    spec = TensorSpec(name="x", shape=(2, 8), dtype="float32", codec="zstd:9")
    function = _function(tmp_path, spec, "Relu")
    function.process(join_frame({"x": wire.encode(np.ones((2, 8), np.float32), "zstd:1")}))


def test_an_embedding_index_out_of_range_is_recorded_and_refused_where_onnxruntime_answers(
    tmp_path,
):
    ids, kinds = np.array([[1, 29]]), np.array([0, 1])
    captured = capture(load_model(_Tokens()), {"ids": ids, "kinds": kinds})
    assert captured.index_ranges == {"ids": (0, 29), "kinds": (0, 1)}

    spec = TensorSpec(name="ids", shape=(1, 2), dtype="int64", value_range=(0, 29))
    assert TensorSpec.from_dict(FunctionSpec.to_dict(_spec_of(spec))["receives"][0]) == spec
    function = _function(tmp_path, spec, "Gather")
    with pytest.raises(RequestError, match="holds -1.*embedding of 30 rows.*from 0 to 29"):
        function.process(join_frame({"ids": wire.encode(np.array([[-1, 3]]))}))
    function.process(join_frame({"ids": wire.encode(np.array([[0, 29]]))}))


def test_run_and_invoke_refuse_an_embedding_index_out_of_range_before_any_function_starts():
    from mopar.runner.bundle import BundleManifest

    t = IoTensor(name="ids", shape=(1, 2), dtype="int64", nbytes=16, value_range=(0, 29))
    assert IoTensor.from_dict(t.to_dict()) == t
    manifest = BundleManifest(
        root=Path("."),
        model="m",
        inputs=("ids",),
        outputs=(),
        slices=(),
        input_types={"ids": t},
        document=None,
    )
    manifest.check_inputs({"ids": np.array([[0, 29]])})
    for bad in (-1, 30):
        with pytest.raises(InputSpecError, match=f"holds {bad}.*from 0 to 29"):
            manifest.check_inputs({"ids": np.array([[bad, 1]])})


def _spec_of(t: TensorSpec) -> FunctionSpec:
    return FunctionSpec(
        model="m", slice="s0", index=0, count=1, receives=(t,), outputs=(), sends=()
    )


@pytest.mark.slow
def test_a_compiled_bundle_carries_the_embedding_range_to_run_and_its_first_function(tmp_path):
    import json

    from mopar.cli import cli
    from mopar.runner.bundle import read_manifest

    ids, kinds = np.array([[1, 29]]), np.array([0, 1])
    bundle = mopar.compile(_Tokens().eval(), (), {"ids": ids, "kinds": kinds}, out=tmp_path / "b")
    manifest = read_manifest(bundle.path)
    assert manifest.input_types["ids"].value_range == (0, 29)
    first = manifest.slices[0].name
    spec = json.loads((bundle.path / "functions" / first / "function.json").read_text())
    assert {t["name"]: t.get("value_range") for t in spec["receives"]}["ids"] == [0, 29]
    np.savez(tmp_path / "bad.npz", ids=np.array([[-1, 3]]), kinds=kinds)
    result = CliRunner().invoke(
        cli, ["run", str(bundle.path), "--input", str(tmp_path / "bad.npz")]
    )
    assert result.exit_code == 1 and "holds -1" in result.output
