"""One module owns the bundle format: ``plan.json`` and ``function.json`` as typed documents.

- A compiled bundle's ``plan.json`` and every ``function.json`` read back into their dataclasses
  and write out byte for byte; a document made here survives to_json/from_json whole.
- Another format version, older or newer, is refused with one line that names both versions and
  says to recompile with this mopar.
- Nobody outside `mopar.bundle` opens ``plan.json`` or ``function.json`` itself.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import mopar
from mopar.bundle.dispatch import DispatchSpec
from mopar.bundle.document import (
    BundleDocument,
    Io,
    IoFunction,
    IoOutput,
    IoTensor,
    LatencyCheck,
    LayerSummary,
    Sizing,
    StageSeconds,
    Verification,
    read_document,
)
from mopar.bundle.function import FunctionSpec, TensorSpec
from mopar.bundle.layout import FUNCTION_FILE, PLAN_FILE
from mopar.bundle.versions import BUNDLE_FORMAT_VERSION, FUNCTION_FORMAT_VERSION
from mopar.errors import BundleError
from mopar.runner.bundle import manifest_of, read_manifest

# --- round trips ----------------------------------------------------------------------------------


def _tensor(name: str, shape=(1, 4)) -> IoTensor:
    return IoTensor(name=name, shape=shape, dtype="float32", nbytes=16)


def _document() -> BundleDocument:
    """A document with every section, as a finished compile of a two-function chain with a
    dispatch and a latency check would write it."""
    dispatch = DispatchSpec(
        hidden="h",
        index="i",
        weights="w",
        output="s1:experts",
        output_shape=(4, 8),
        tokens=4,
        hidden_size=8,
        top_k=1,
        num_experts=2,
        groups=((1,),),
        callees=("s1.e1",),
        hot=(0,),
        local="s1.hot",
    )
    return BundleDocument(
        plan={
            "model": "m",
            "functions": [{"name": "s0", "memory_mb": 128}, {"name": "s1", "memory_mb": 256}],
        },
        io=Io(
            inputs=(_tensor("x"),),
            outputs=(IoOutput(name="y", value="t:out", shape=(1, 4), dtype="float32"),),
            functions=(
                IoFunction(
                    name="s0",
                    inputs=(_tensor("x"),),
                    outputs=(_tensor("t:mid"),),
                    onnx="functions/s0/model.onnx",
                    weights="functions/s0/model.onnx.data",
                    codecs={"t:mid": "fp16"},
                ),
                IoFunction(
                    name="s1",
                    inputs=(_tensor("t:mid"),),
                    outputs=(_tensor("t:out"),),
                    onnx="functions/s1/model.onnx",
                    dispatch=dispatch,
                    rows=True,
                ),
            ),
        ),
        verification=Verification(max_abs_err=1e-7, max_rel_err=2e-7, rtol=1e-3, atol=1e-4),
        latency_check=LatencyCheck(p50_ms=2.0, unsplit_p50_ms=1.9, slowdown=1.0526),
        experts={"mode": "functions", "layers": [], "trace": {"layers": []}},
        sizing=(
            Sizing(
                function="s0",
                need_mb=50.5,
                planned_mb=64,
                peak_rss_mb=70.1,
                memory_mb=96,
                planned_time_ms=0.2,
                p50_ms=1.0,
            ),
        ),
        layers=(LayerSummary(name="fc", type="Linear", param_bytes=80, flops=64, output_bytes=16),),
        stages=(StageSeconds(stage="capture", seconds=1.5),),
        mopar_version="0.1.0",
        created="2026-01-01T00:00:00+00:00",
        versions={"torch": "2.13.0"},
    )


def test_a_document_with_every_section_survives_to_json_and_from_json():
    doc = _document()
    text = doc.to_json()
    assert BundleDocument.from_json(text) == doc
    data = json.loads(text)
    assert data["bundle_format_version"] == BUNDLE_FORMAT_VERSION
    assert list(data) == [
        "bundle_format_version",
        "mopar_version",
        "created",
        "versions",
        "plan",
        "io",
        "verification",
        "latency_check",
        "experts",
        "sizing",
        "layers",
        "stages",
    ]


def test_a_partial_document_keeps_until_and_has_no_sections_of_a_finished_compile():
    doc = BundleDocument(plan={"model": "m", "functions": []}, until="plan")
    data = json.loads(doc.to_json())
    assert list(data) == [
        "bundle_format_version",
        "mopar_version",
        "created",
        "versions",
        "until",
        "plan",
        "layers",
        "stages",
    ]
    assert BundleDocument.from_json(doc.to_json()) == doc


def test_a_function_spec_survives_to_json_and_from_json():
    inner = FunctionSpec(
        model="m",
        slice="s1.e0",
        index=1,
        count=2,
        receives=(TensorSpec(name="s1.e0:tokens", shape=(4, 8), dtype="float32", rows=True),),
        outputs=("s1.e0:out",),
        sends=("s1.e0:out",),
        answers=True,
    )
    spec = FunctionSpec(
        model="m",
        slice="s1",
        index=1,
        count=2,
        receives=(TensorSpec(name="h", shape=(4, 8), dtype="float32", codec="zstd"),),
        outputs=("y",),
        codecs={"y": "none"},
        sends=("y",),
        returns={"y": "out"},
        calls=(inner,),
        dispatch=_document().io.functions[1].dispatch,
    )
    assert FunctionSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["function_format_version"] == FUNCTION_FORMAT_VERSION


def test_a_compiled_bundle_reads_back_and_writes_out_byte_for_byte(skipnet_bundle):
    doc = read_document(skipnet_bundle)
    assert doc.to_json() == (skipnet_bundle / PLAN_FILE).read_text()
    folders = sorted(p.parent for p in skipnet_bundle.glob(f"functions/*/{FUNCTION_FILE}"))
    assert [f.name for f in folders] == [f.name for f in doc.io.functions]
    for folder in folders:
        assert FunctionSpec.load(folder).to_json() == (folder / FUNCTION_FILE).read_text()


def test_the_runners_view_is_made_one_way_from_the_document(skipnet_bundle):
    manifest = read_manifest(skipnet_bundle)
    assert manifest == manifest_of(skipnet_bundle, read_document(skipnet_bundle))
    assert manifest.document.io.functions[0].name == manifest.slices[0].name


# --- other versions -------------------------------------------------------------------------------


def test_a_malformed_plan_json_quoting_a_line_break_stays_one_line(tmp_path):
    # found by test_fuzz: a key with a line break, quoted in the TypeError
    data = json.loads(_document().to_json())
    data["stages"] = [{"stage": "plan", "seconds": 1.0, "\n": 0}]
    (tmp_path / PLAN_FILE).write_text(json.dumps(data))
    with pytest.raises(BundleError, match="malformed") as err:
        read_document(tmp_path)
    assert "\n" not in str(err.value) and "\\n" in str(err.value)


@pytest.mark.parametrize(
    "version, by",
    [(BUNDLE_FORMAT_VERSION - 1, "an older"), (BUNDLE_FORMAT_VERSION + 1, "a newer")],
)
def test_plan_json_of_another_format_is_one_line_naming_both_versions(tmp_path, version, by):
    data = json.loads(_document().to_json()) | {"bundle_format_version": version}
    (tmp_path / PLAN_FILE).write_text(json.dumps(data))
    with pytest.raises(BundleError) as err:
        read_document(tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert f"bundle format {version} is not supported (expected {BUNDLE_FORMAT_VERSION})" in message
    assert f"written by {by} mopar" in message
    assert message.endswith("recompile the bundle with this mopar")


@pytest.mark.parametrize("version", [FUNCTION_FORMAT_VERSION - 1, FUNCTION_FORMAT_VERSION + 1])
def test_function_json_of_another_format_is_one_line_naming_both_versions(tmp_path, version):
    spec = FunctionSpec(model="m", slice="s0", index=0, count=1, receives=(), outputs=(), sends=())
    data = json.loads(spec.to_json()) | {"function_format_version": version}
    (tmp_path / FUNCTION_FILE).write_text(json.dumps(data))
    with pytest.raises(BundleError) as err:
        FunctionSpec.load(tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert (
        f"function.json format {version} is not supported (expected {FUNCTION_FORMAT_VERSION})"
        in message
    )
    assert "recompile the bundle with this mopar" in message


def test_a_document_without_a_version_is_refused_naming_the_expected_one():
    expected = f"bundle format None is not supported .expected {BUNDLE_FORMAT_VERSION}."
    with pytest.raises(BundleError, match=expected):
        BundleDocument.from_json("{}")


# --- one reader -----------------------------------------------------------------------------------

_NAMES = (PLAN_FILE, FUNCTION_FILE)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (of modules, classes, functions)
    or bare string statements (attribute docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def _reads_of_bundle_files(path: Path) -> list[str]:
    """Where a module names a bundle file as a path, or parses one with json."""
    source = path.read_text()
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if text in _NAMES or any(text.endswith("/" + n) for n in _NAMES):
                found.append(f"{path}:{node.lineno}: the path {text!r}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("load", "loads")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "json"
        ):
            call = ast.get_source_segment(source, node) or ""
            if any(n in call for n in (*_NAMES, "PLAN_FILE", "FUNCTION_FILE")):
                found.append(f"{path}:{node.lineno}: json parses {call!r}")
    return found


def test_no_module_outside_mopar_bundle_reads_plan_json_or_function_json_itself():
    package = Path(mopar.__file__).resolve().parent
    owner = package / "bundle"
    found = [
        hit
        for path in sorted(package.rglob("*.py"))
        if owner not in path.parents
        for hit in _reads_of_bundle_files(path)
    ]
    assert found == [], "read them through mopar.bundle (read_document, FunctionSpec.load)"


def test_the_scan_finds_a_module_that_reads_plan_json_itself(tmp_path):
    rogue = tmp_path / "rogue.py"
    rogue.write_text(
        '"""Reads plan.json (a docstring may say so)."""\n'
        "import json\n"
        "def plan(root):\n"
        '    return json.loads((root / "plan.json").read_text())\n'
        "def spec(folder):\n"
        "    return json.loads((folder / FUNCTION_FILE).read_text())\n"
    )
    found = _reads_of_bundle_files(rogue)
    assert len(found) == 3  # the path, and both json calls
