"""Compiling is a pipeline of named stages: ``--verbose`` shows each one's seconds, ``plan.json``
records them, and ``mopar compile --until STAGE`` stops after a stage and keeps what it made,
a bundle that ``mopar run`` refuses in one line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import mopar
from mopar.cli import cli
from mopar.errors import OptionError
from mopar.facts import Link, Platform
from mopar.pipeline import STAGES, Stopwatch
from mopar.plan.notes import Replanned
from tests import models
from tests.conftest import SKIPNET_INPUT, nonblank_lines
from tests.conftest import mopar as run_mopar

COMPILE = (
    "compile",
    "tests.models:skipnet",
    "--input",
    SKIPNET_INPUT,
    "--slices",
    "2",
    "--strategy",
    "uniform",
)


def _compile(out: Path, *extra: str, verbose: bool = False):
    result = CliRunner().invoke(
        cli, [*(["-v"] if verbose else []), *COMPILE, "--out", str(out), *extra]
    )
    assert result.exit_code == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A whole bundle, compiled with --verbose; the CliRunner result and the bundle."""
    out = tmp_path_factory.mktemp("whole") / "bundle"
    return _compile(out, verbose=True), out


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """The bundle of each --until, by stage."""
    root = tmp_path_factory.mktemp("partial")
    for until in ("plan", "rewrite", "export"):
        _compile(root / until, "--until", until)
    return {until: root / until for until in ("plan", "rewrite", "export")}


def _doc(bundle: Path) -> dict:
    return json.loads((bundle / "plan.json").read_text())


# --- the stages and their times -------------------------------------------------------------------


def test_a_whole_compile_records_every_stage_in_order(whole):
    _, out = whole
    stages = _doc(out)["stages"]
    assert [s["stage"] for s in stages] == [
        "capture",
        "profile",
        "plan",
        "rewrite",
        "export",
        "verify",
        "measure",
        "emit",
    ]
    assert all(s["seconds"] >= 0 for s in stages)
    assert "until" not in _doc(out)


def test_verbose_prints_each_stage_seconds(whole):
    result, _ = whole
    shown = re.findall(r"^info: stage (\w+): (\d+\.\d+) s$", result.stderr, re.M)
    assert [name for name, _ in shown] == [
        "capture",
        "profile",
        "plan",
        "rewrite",
        "export",
        "verify",
        "measure",
        "emit",
    ]


def test_stage_seconds_are_each_stage_own_and_in_pipeline_order():
    watch = Stopwatch()
    with watch.stage("export"):
        time.sleep(0.02)
        with watch.stage("rewrite"):  # the export driver realising a plan
            time.sleep(0.2)
        time.sleep(0.02)
    watch.add("capture", 1.5)
    times = {t.stage: t.seconds for t in watch.times()}
    assert [t.stage for t in watch.times()] == ["capture", "rewrite", "export"]
    assert times["capture"] == 1.5
    assert times["rewrite"] >= 0.2
    assert 0.04 <= times["export"] < 0.2  # 0.24 and more, were rewrite's time counted in it
    assert set(times) <= set(STAGES)


# --- --until --------------------------------------------------------------------------------------


def test_until_plan_writes_the_plan_and_no_onnx(partial):
    out = partial["plan"]
    doc = _doc(out)
    assert doc["until"] == "plan"
    assert [s["stage"] for s in doc["stages"]] == ["capture", "profile", "plan"]
    assert len(doc["plan"]["functions"]) == 2 and doc["layers"]
    assert sorted(p.name for p in out.iterdir()) == [".mopar-files.json", "plan.json"]


def test_until_rewrite_writes_each_unit_fx_code(partial):
    out = partial["rewrite"]
    doc = _doc(out)
    assert doc["until"] == "rewrite"
    assert [s["stage"] for s in doc["stages"]][-1] == "rewrite"
    for unit in doc["io"]["functions"]:
        code = (out / unit["graph"]).read_text()
        assert "def forward(self, " in code
    assert not list(out.rglob("*.onnx"))


def test_until_export_writes_onnx_and_no_deployment_files(partial):
    out = partial["export"]
    doc = _doc(out)
    assert doc["until"] == "export"
    assert [s["stage"] for s in doc["stages"]][-1] == "export"
    assert sorted(p.parent.name for p in out.glob("functions/*/model.onnx")) == ["s0", "s1"]
    for name in ("stack.yml", "template.yaml", "reference.npz"):
        assert not (out / name).exists(), name
    assert "verification" not in doc and "sizing" not in doc


def test_until_export_onnx_is_byte_identical_to_a_whole_compile(partial, whole):
    _, out = whole
    for path in sorted(partial["export"].glob("functions/*/model.onnx")):
        assert (
            path.read_bytes() == (out / "functions" / path.parent.name / "model.onnx").read_bytes()
        )


@pytest.mark.parametrize("until", ["plan", "export"])
def test_run_refuses_a_partial_bundle_in_one_line(partial, until):
    proc = run_mopar("run", partial[until])
    assert proc.returncode == 1
    assert nonblank_lines(proc.stderr) == [
        f"error: bundle {str(partial[until])!r} stops after stage {until!r} (mopar compile "
        f"--until {until}); compile it without --until to run it"
    ]


def test_compile_until_in_python(tmp_path):
    bundle = mopar.compile(
        models.skipnet(), [SKIPNET_INPUT], out=tmp_path / "b", slices=2, until="plan"
    )
    assert bundle.until == "plan" and bundle.max_abs_err is None
    assert [t.stage for t in bundle.stages] == ["capture", "profile", "plan"]
    with pytest.raises(OptionError, match="until='emit' is not a stage compile can stop after"):
        mopar.compile(models.skipnet(), [SKIPNET_INPUT], out=tmp_path / "c", until="emit")


# --- the latency check: the plan served beside the unsplit model before it is written ---------

FREE_CUTS = Platform(
    target="freecuts",
    usd_per_gb_s=1e-5,
    usd_per_request=0.0,
    billing_ms=0,
    min_mb=1,
    max_mb=4096,
    step_mb=1,
    mb_per_vcpu=0,
    max_vcpus=0,
    vcpus=1.0,
    links=(Link(name="shm", latency_ms=0.0, mb_per_s=1e9),),
    hop_ms=0.0,
    baseline_mb=0.0,
)
"""A platform where every cut is predicted free and memory is billed by the MB from nothing,
so the default objective splits a model of 1 MB layers as far as it can; serving it says
otherwise (every hop costs a process wake-up)."""


def _layers_of_1mb() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(6))
    )


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("checked") / "b"
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    return mopar.compile(_layers_of_1mb(), (x,), out=out, platform=FREE_CUTS), x


def test_a_plan_slower_than_the_bound_is_planned_again_from_what_serving_measured(checked):
    bundle, _ = checked
    doc = _doc(bundle.path)
    first = next(n for n in bundle.plan.notes if isinstance(n, Replanned))
    planned = first.functions
    assert planned > len(bundle.plan.functions)  # the hops the prediction called free cost time
    assert str(first).startswith(f"measured: a plan of {planned} functions served at ")
    check = doc["latency_check"]
    first_check = check["comparisons"][0]
    assert first_check["slowdown"] > 1.05
    assert (first_check["functions"], first_check["verdict"]) == (planned, "over")
    assert first_check["low"] > 1.05  # over beyond the noise, not by a noisy median
    if len(bundle.plan.functions) == 1:  # the unsplit model itself: no ratio of it with itself
        assert check["slowdown"] is None
        assert str(bundle.plan.notes[-1]).startswith("latency check: ")
    else:
        last = check["comparisons"][-1]
        assert last["low"] <= check["slowdown"] == last["slowdown"] <= last["high"]
        assert any(n.startswith("measured before writing: ") for n in map(str, bundle.plan.notes))
    # the scratch export of the unsplit model is gone, and the bundle is the new plan's
    assert not list(bundle.path.parent.glob("*.unsplit"))
    assert sorted(p.parent.name for p in bundle.path.glob("functions/*/model.onnx")) == sorted(
        f.name for f in bundle.plan.functions
    )
    assert {"measure", "verify"} <= {t.stage for t in bundle.stages}


def test_the_checked_bundle_serves_the_model(checked):
    bundle, _ = checked
    proc = run_mopar("run", bundle.path, "--check", "--requests", "2")
    assert proc.returncode == 0, proc.stderr


def test_without_the_check_the_predicted_plan_is_written(checked, tmp_path):
    bundle, x = checked
    planned = next(n.functions for n in bundle.plan.notes if isinstance(n, Replanned))
    unchecked = mopar.compile(
        _layers_of_1mb(),
        (x,),
        out=tmp_path / "b",
        platform=FREE_CUTS,
        check_latency=False,
        until="plan",  # the plan is what differs; the export is the checked bundle's
    )
    assert len(unchecked.plan.functions) == planned
    assert "latency_check" not in _doc(unchecked.path)
    assert not any(isinstance(n, Replanned) for n in unchecked.plan.notes)
    assert not any(str(n).startswith("measured before writing") for n in unchecked.plan.notes)


@pytest.mark.parametrize(
    ("options", "checks"),
    [
        ({}, True),
        ({"check_latency": False}, False),
        ({"slices": 3}, False),
        ({"slo_ms": 50.0}, False),
        ({"strategy": "uniform"}, False),
        ({"codec": "zstd"}, False),
    ],
)
def test_only_the_default_objective_is_checked(options, checks):
    from mopar.config import CompileConfig
    from mopar.pipeline.latency import checks_latency

    class Planned:
        def __init__(self, functions: int, bound_ms: float | None, kind: str = "slice") -> None:
            self.functions = tuple(SimpleNamespace(kind=kind) for _ in range(functions))
            self.bound_ms = bound_ms

        def dispatches(self) -> tuple:
            return tuple(f for f in self.functions if f.kind == "dispatch")

    config = CompileConfig(**options)
    assert checks_latency(config, Planned(2, 10.0)) is checks
    assert checks_latency(config, Planned(1, 10.0)) is False
    assert checks_latency(config, Planned(2, float("inf"))) is False  # fits no one function
    assert checks_latency(config, Planned(2, 10.0, "dispatch")) is False  # placed experts
