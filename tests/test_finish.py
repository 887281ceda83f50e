"""The stages after export, carried out from the staged folder (`mopar.pipeline.finish`), by
`mopar compile`'s parent process while its torch part runs, and exits, in a child
(`mopar.cli.child`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mopar.bundle.layout import PLAN_FILE
from mopar.config import Tolerance
from mopar.emit.bundle import staging_dir
from mopar.pipeline.finish import HANDOFF_FILE, Handoff
from mopar.pipeline.serving import RELEASE_FROM_MB
from mopar.pipeline.values import StageTime
from mopar.plan.notes import (
    BillIncludes,
    ChainMode,
    CheckAhead,
    GenerationCost,
    ModeBest,
    Remark,
    Replanned,
    Traffic,
    note_of,
    note_record,
)
from tests.conftest import ROOT, SKIPNET_INPUT, mopar


def test_what_measures_and_emits_imports_no_torch():
    code = (
        "import sys\n"
        "from mopar import api, cli\n"
        "from mopar.cli import child, compile\n"
        "from mopar.config import CompileConfig\n"
        "from mopar.pipeline import finish\n"
        "api.facts_for(CompileConfig(target='lambda'), predictors=False)\n"
        "heavy = [m for m in ('torch', 'xgboost', 'scipy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def wide_pt2(tmp_path_factory) -> Path:
    """A `.pt2` of one 8192 x 8256 Linear (270 MB), saved by another process: over
    `RELEASE_FROM_MB`, so `mopar compile` runs its torch part in a child."""
    path = tmp_path_factory.mktemp("wide") / "wide.pt2"
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(8192, 8256).eval()\n"
        "torch.export.save(torch.export.export(m, (torch.randn(1, 8192),)), sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=300)
    assert path.stat().st_size >= RELEASE_FROM_MB * (1 << 20)
    return path


def _finished_by(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "verify, measure and emit" in line]


def test_a_compile_is_verified_measured_and_emitted_by_a_process_without_torch(tmp_path, wide_pt2):
    out = tmp_path / "bundle"
    proc = mopar("-v", "compile", wide_pt2, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = _finished_by(proc.stderr)
    assert len(said) == 1 and said[0].endswith("without torch"), said
    doc = json.loads((out / PLAN_FILE).read_text())
    assert doc["verification"]["max_abs_err"] < 1e-4
    assert [s["function"] for s in doc["sizing"]] == [f["name"] for f in doc["plan"]["functions"]]
    stages = [s["stage"] for s in doc["stages"]]
    assert stages[0] == "capture" and stages[-3:] == ["verify", "measure", "emit"]
    assert not (out / HANDOFF_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no staged folder left
    assert "wrote" in proc.stdout and proc.stdout.count("verified:") == 1


def test_a_failure_in_the_child_is_said_once_and_leaves_nothing(tmp_path):
    proc = mopar("compile", tmp_path / "missing.pt2", "--out", tmp_path / "bundle")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not exist" in errors[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_small_model_compiles_in_one_process(tmp_path):
    proc = mopar(
        "-v", "compile", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--out", tmp_path / "b"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = _finished_by(proc.stderr)
    assert len(said) == 1 and said[0].endswith("beside torch"), said


def test_a_failure_in_the_parent_is_one_line_and_removes_the_staged_folder(tmp_path, wide_pt2):
    out = tmp_path / "bundle"
    proc = mopar("compile", wide_pt2, "--out", out, "--rtol", "1e-12", "--atol", "1e-12")
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the chained ONNX slices" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_kind_of_note_survives_its_record():
    notes = [
        Remark("a sentence"),
        ChainMode(
            chain="http",
            best=(ModeBest(chain="http", cost_per_1m_usd=1.5, within_bound=True),),
            skipped=("shm: needs co-located functions",),
        ),
        BillIncludes(cost_per_1m_usd=2.25, includes="idle replicas 10%", rate_rps=1.0),
        Traffic(traffic="1 request/s, Poisson"),
        CheckAhead(max_slowdown=1.05, confidence=0.9),
        Replanned(functions=2, served="3 functions", max_slowdown=1.05, scale=1.1, extra_ms=2.0),
        GenerationCost(prompt_tokens=8, new_tokens=4, generation_ms=12.5, usd=1e-6, timed="x"),
    ]
    for note in notes:
        back = note_of(json.loads(json.dumps(note_record(note))))
        assert type(back) is type(note) and back == note and str(back) == str(note)


def test_a_handoff_survives_its_file(tmp_path):
    handoff = Handoff(
        out=str(tmp_path / "b"),
        force=True,
        requests=10,
        compute={"s0": (1.5, 0.5)},
        edges=({"src": "input", "dst": "s0", "tensors": ["x"]},),
        notes=(note_record(Remark("r")),),
        tolerance=Tolerance(rtol=1e-3, atol=1e-4),
        stages=(StageTime(stage="capture", seconds=1.25),),
    )
    handoff.write(tmp_path)
    assert Handoff.read(tmp_path) == handoff


def test_a_staged_folder_handed_over_is_kept_and_its_adopter_puts_it_in_place(tmp_path):
    out = tmp_path / "bundle"
    with staging_dir(out, force=False) as staging:
        (staging.path / "made.txt").write_text("by the child")
        staging.hand_over()
    staged = staging.path
    assert staged.is_dir() and not out.exists()
    with staging_dir(out, force=False, adopt=staged) as adopted:
        assert adopted.path == staged
    assert (out / "made.txt").read_text() == "by the child" and not staged.exists()


def test_an_adopted_folder_goes_when_its_adopter_fails(tmp_path):
    out = tmp_path / "bundle"
    with staging_dir(out, force=False) as staging:
        staging.hand_over()
    with pytest.raises(RuntimeError), staging_dir(out, force=False, adopt=staging.path):
        raise RuntimeError("measuring failed")
    assert list(tmp_path.iterdir()) == []


def test_a_released_folder_is_not_removed_by_its_old_owner(tmp_path):
    from mopar._files import owned_folder

    with owned_folder(tmp_path, ".x.", ".partial") as owned:
        owned.release()
    assert owned.path.is_dir() and not Path(owned.path, ".mopar-owner").exists()
