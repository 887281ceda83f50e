"""Careless and concurrent use (issue 33): ``force`` never deletes what mopar did not write, the
output folder is checked before any work, leftovers of killed processes are swept, and the API
may be called from several threads without touching the host's streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import mopar
from mopar import api
from mopar._files import owned_folder, sweep_leftovers
from mopar._quiet import quiet_libraries
from mopar.bundle.document import BundleDocument
from mopar.cli import cli
from mopar.emit.bundle import check_out, staging_dir
from mopar.errors import CaptureError, OptionError
from mopar.runner.local import RUN_PREFIX, run_folder, shm_root

ROOT = Path(__file__).resolve().parents[1]
MLP = ("tests.models:mlp", ["x=1x16:float32"])


@pytest.fixture
def no_work(monkeypatch):
    """Make any capture fail the test: a refusal must come before the work."""

    def analyze(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(api, "analyze", analyze)


def _bundle(out: Path, *, force: bool = False) -> Path:
    """A small bundle written the way a compile writes one (a plan stopped after ``plan``)."""
    with staging_dir(out, force=force) as staged:
        tmp = staged.path
        BundleDocument(plan={"functions": []}, until="plan").write(tmp)
        (tmp / "functions").mkdir()
    return out


# --- force deletes nothing mopar did not write ----------------------------------------------------


@pytest.mark.parametrize(
    "files",
    [
        {"notes.txt": "x"},
        {"plan.json": "{}", "notes.txt": "x"},  # a plan.json alone is no bundle
    ],
)
def test_force_never_deletes_a_folder_that_is_not_a_bundle(tmp_path, files, no_work):
    keep = tmp_path / "keep"
    keep.mkdir()
    for name, text in files.items():
        (keep / name).write_text(text)
    with pytest.raises(OptionError, match=r"out='.*keep' .* force=True would delete it"):
        mopar.compile(*MLP, out=keep, force=True)
    assert {p.name: p.read_text() for p in keep.iterdir()} == files


def test_force_never_deletes_a_file_nor_leaves_a_hidden_copy(tmp_path, no_work):
    keep = tmp_path / "keep"
    keep.write_text("mine")
    with pytest.raises(OptionError, match="is a file, not a folder"):
        mopar.compile(*MLP, out=keep, force=True)
    assert keep.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]


def test_force_keeps_a_bundle_that_holds_a_file_mopar_did_not_write(tmp_path, no_work):
    out = _bundle(tmp_path / "b")
    (out / "functions" / "notes.txt").write_text("x")
    result = CliRunner().invoke(cli, ["compile", "tests.models:mlp", "--out", str(out), "--force"])
    assert result.exit_code == 1, result.output
    assert "bundle that holds files mopar did not write: 'functions/notes.txt'" in result.output
    assert (out / "functions" / "notes.txt").read_text() == "x"


def test_force_replaces_a_bundle_mopar_wrote_and_leaves_nothing_beside_it(tmp_path):
    out = _bundle(tmp_path / "b")
    check_out(out, force=True)  # a bundle mopar wrote, whole: replaceable
    with staging_dir(out, force=True) as staged:
        tmp = staged.path
        BundleDocument(plan={"functions": []}, until="plan").write(tmp)
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == [".mopar-files.json", "new", "plan.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_file_written_into_the_old_bundle_during_the_compile_stops_the_swap(tmp_path):
    out = _bundle(tmp_path / "b")
    with pytest.raises(OptionError, match="'late.txt'"):
        with staging_dir(out, force=True) as staged:
            tmp = staged.path
            (out / "late.txt").write_text("written while the compile ran")
            BundleDocument(plan={"functions": []}, until="plan").write(tmp)
    assert (out / "late.txt").exists() and (out / "plan.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


# --- the output folder is checked before any work ------------------------------------------------


def test_existing_out_without_force_is_refused_before_any_work(tmp_path, no_work):
    out = tmp_path / "b"
    out.mkdir()
    result = CliRunner().invoke(cli, ["compile", "tests.models:mlp", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "already exists; pass --force to replace it" in result.output


def test_an_out_that_cannot_be_written_is_refused_before_any_work(no_work):
    # /proc/self takes no new folder, even from root (whom no permission bit stops)
    with pytest.raises(OptionError, match="out='/proc/self/b' cannot be written"):
        mopar.compile(*MLP, out="/proc/self/b")
    result = CliRunner().invoke(cli, ["compile", "tests.models:mlp", "--out", "/proc/self/b"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: --out '/proc/self/b' cannot")


# --- leftovers of killed processes ---------------------------------------------------------------

_OWN = """
import sys, time
from mopar._files import owned_folder
with owned_folder(sys.argv[1], sys.argv[2], sys.argv[3]) as folder:
    (folder.path / "half").write_text("x")
    print(folder.path, flush=True)
    time.sleep(60)
"""


def _killed_owner(parent: Path, prefix: str, suffix: str = "") -> Path:
    """The folder of a process that made it with `owned_folder` and was killed (SIGKILL)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWN, str(parent), prefix, suffix],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    line = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert line, "the owner did not make its folder"
    assert Path(line).is_dir()
    return Path(line)


def test_a_killed_compiles_partial_folder_is_removed_by_the_next_compile(tmp_path):
    left = _killed_owner(tmp_path, ".b.", ".partial")
    _bundle(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"], left


def test_a_killed_runs_shm_folder_is_removed_by_the_next_run():
    left = _killed_owner(shm_root(), RUN_PREFIX)
    with run_folder() as mine:
        assert not left.exists()
        assert mine.is_dir()
    assert not mine.exists()


def test_sweeping_spares_live_owners_and_folders_mopar_did_not_make(tmp_path):
    dead = _killed_owner(tmp_path, "x-", ".partial")
    unmarked = tmp_path / "x-1-abc.partial"  # named like one, but no owner's marker
    unmarked.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "x-2-link.partial").symlink_to(tmp_path / "elsewhere")
    with owned_folder(tmp_path, "x-", ".partial") as live:
        assert sweep_leftovers(tmp_path, "x-", ".partial") == [dead]
        assert live.path.is_dir() and unmarked.is_dir() and (tmp_path / "elsewhere").is_dir()
    assert (tmp_path / "x-2-link.partial").is_symlink()


# --- threads --------------------------------------------------------------------------------------


def test_quieting_never_replaces_the_hosts_streams():
    before = (sys.stdout, sys.stderr)
    with quiet_libraries():
        assert (sys.stdout, sys.stderr) == before


def test_quieted_blocks_of_two_threads_run_one_after_the_other():
    inside, entered, overlapped = threading.Event(), threading.Event(), []

    def second() -> None:
        entered.set()
        with quiet_libraries():
            overlapped.append(inside.is_set())

    with quiet_libraries():
        inside.set()
        other = threading.Thread(target=second)
        other.start()
        entered.wait()
        other.join(0.2)  # it waits for this block to end, however long that is
        inside.clear()
    other.join()
    assert overlapped == [False]


@pytest.mark.slow  # torch.export's first failure costs seconds; the unit above shows the lock
def test_a_failed_export_prints_nothing(capfd):
    # torch.export prints a partial graph to sys.stderr itself: kept, not shown (_PRINTERS)
    import torch

    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(CaptureError):
        mopar.analyze(DataDependent(), (torch.ones(3),))
    assert capfd.readouterr().err == ""


@pytest.mark.slow  # four captures and plans of a small model, in four threads at once
def test_four_threads_partition_at_once():
    before = (sys.stdout, sys.stderr)
    plans, errors = [], []

    def one() -> None:
        try:
            plans.append(mopar.partition(*MLP, slices=2))
        except Exception as exc:  # noqa: BLE001 - the test reports every thread's failure
            errors.append(repr(exc))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({len(p.functions) for p in plans}) == 1 and len(plans) == 4
    assert (sys.stdout, sys.stderr) == before
