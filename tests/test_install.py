"""mopar as a user installs it: a wheel built from the repository, installed into a fresh virtual
environment, run from another folder on a model saved by another process.

The wheel is built offline from a copy of the repository (a build writes ``build/`` and
``*.egg-info`` beside the sources, and a stale ``build/lib`` would leak into it). The fresh
environment sees the dependencies already installed for this interpreter through a ``.pth``
file, so nothing is downloaded; mopar itself comes only from the wheel.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import click
import pytest
import tomllib
import yaml
from click.testing import CliRunner

from mopar import config as mopar_config
from mopar.cli import cli
from mopar.cli.checkout import LabCommand, need_checkout
from mopar.config import PROFILES_DIR, load_profile
from mopar.errors import MoparError
from tests.conftest import ROOT

PREFIX = "registry.example.com/team"
GATEWAY = "https://gateway.example.com"
REDIS = "rediss://cache.example.com:6380/0"

SAVE_MLP = """
import sys
import torch

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
torch.export.save(torch.export.export(mlp, (torch.randn(1, 16),)), sys.argv[1])
"""


# --- what the wheel holds ----------------------------------------------------------------------


def test_pyproject_lists_every_package_of_mopar_and_the_two_data_folders():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "mopar").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(found - set(listed))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    assert set(listed) == found | {"mopar.profiles", "mopar.templates", "mopar.templates.openfaas"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a copy of the repository, offline."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "mopar-src"
    junk = shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "*.pyc", ".*_cache", ".hypothesis"
    )
    shutil.copytree(ROOT, source, ignore=junk)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--quiet", "-w", str(work / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (work / "dist").glob("mopar-*.whl")
    return built


def test_the_wheel_holds_mopar_its_profiles_and_templates_and_no_examples(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mopar"}, tops
    for shipped in PROFILES_DIR.iterdir():
        assert f"mopar/profiles/{shipped.name}" in names
    template = "mopar/templates/openfaas/mopar-onnx"
    for name in ("template.yml", "Dockerfile", "index.py", "install.sh", "requirements.txt"):
        assert f"{template}/{name}" in names
    assert "mopar/runtime/transports/__init__.py" in names


# --- installed in a fresh environment ----------------------------------------------------------


def _installed_in_fresh_venv(root: Path, wheel: Path) -> Path:
    """A new virtual environment (no pip) holding ``wheel`` alone, then seeing this
    interpreter's dependencies through a ``.pth`` file; its python.

    The ``.pth`` is written after the install: pip then sees no other mopar (this checkout's
    editable one is among those dependencies), so it neither skips nor uninstalls anything.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
        + ["--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def _user_env() -> dict[str, str]:
    """The environment without what points at this checkout or this virtual environment."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in drop}


# Slow (about 40 s: the wheel, then torch in three processes and a compile): the default suite
# keeps the wheel's contents (the test above), finding the data (tests below) and compile and
# run on a .pt2 from another process (tests/test_cli.py, tests/test_end_to_end.py).
@pytest.mark.slow
def test_installed_wheel_compiles_and_runs_a_saved_model_from_another_folder(wheel, tmp_path):
    python = _installed_in_fresh_venv(tmp_path / "venv", wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _user_env()

    def run(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            list(map(str, args)),
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            umask=0o022,
        )
        assert proc.returncode == 0, f"{args}:\n{proc.stdout}{proc.stderr[-3000:]}"
        return proc

    where = run(
        python,
        "-c",
        "import mopar, mopar.config as c, importlib.util as u; "
        "print(mopar.__file__, c.PROFILES_DIR, c.TEMPLATES_DIR, u.find_spec('examples'))",
    ).stdout.split()
    venv = str((tmp_path / "venv").resolve())
    assert all(p.startswith(venv) for p in where[:3]), where
    assert where[3] == "None"  # examples is no package of the wheel

    run(python, "-c", SAVE_MLP, "mlp.pt2")
    mopar = tmp_path / "venv" / "bin" / "mopar"
    run(
        *(mopar, "compile", "mlp.pt2", "--slices", "2", "--out", "bundle"),
        *("--image-prefix", PREFIX, "--gateway", GATEWAY, "--redis-url", REDIS),
    )
    run(mopar, "run", "bundle", "--check", "--requests", "2")
    lab = subprocess.run(
        [mopar, "bench", "--hops"], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert lab.returncode == 1, lab.stdout + lab.stderr
    (line,) = lab.stderr.strip().splitlines()  # the lab is no part of the wheel: one line
    assert "benchmarks/ folder" in line and "from the root of a mopar checkout" in line, line

    bundle = elsewhere / "bundle"
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o755
    stack = yaml.safe_load((bundle / "stack.yml").read_text())
    assert stack["provider"]["gateway"] == GATEWAY
    assert {f["image"].rsplit("/", 1)[0] for f in stack["functions"].values()} == {PREFIX}
    assert not (bundle / "template.yaml").exists()  # planned for OpenFaaS: its files alone
    assert (bundle / "template" / "mopar-onnx" / "template.yml").is_file()
    assert "faas-cli up -f stack.yml" in (bundle / "README.md").read_text()


# --- finding the shipped data ------------------------------------------------------------------


def test_shipped_data_is_the_packages_when_installed_else_the_checkouts(tmp_path, monkeypatch):
    assert mopar_config.shipped_dir("profiles") == ROOT / "profiles"  # this checkout
    (tmp_path / "profiles").mkdir()
    monkeypatch.setattr(mopar_config.resources, "files", lambda package: tmp_path)
    assert mopar_config.shipped_dir("profiles") == tmp_path / "profiles"  # a wheel's


def test_a_missing_shipped_profile_names_the_folder_once(tmp_path, monkeypatch):
    monkeypatch.setattr(mopar_config, "PROFILES_DIR", tmp_path)
    with pytest.raises(MoparError) as caught:
        load_profile(tmp_path, "nowhere")
    message = str(caught.value)
    assert message.count(str(tmp_path)) == 1, message
    assert "reinstall mopar with pip" in message and "--profiles DIR" in message


def test_a_profile_missing_from_a_users_folder_names_both_folders(tmp_path, monkeypatch):
    shipped, own = tmp_path / "shipped", tmp_path / "own"
    monkeypatch.setattr(mopar_config, "PROFILES_DIR", shipped)
    with pytest.raises(MoparError) as caught:
        load_profile(own, "nowhere")
    message = str(caught.value)
    assert message.count(str(own)) == 1 and message.count(str(shipped)) == 1, message
    assert "put nowhere.json in the folder given as --profiles DIR" in message


# --- the lab beside the package ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, command, package",
    [
        (["bench", "--hops"], "bench", "benchmarks"),
        (["bench", "--quick"], "bench", "benchmarks"),
        (["profile", "collect", "--quick"], "profile collect", "tools"),
        (["profile", "train", "--out", "p"], "profile train", "tools"),
        (["profile", "report"], "profile report", "tools"),
        (["profile", "calibrate", "--quick", "--out", "p"], "profile calibrate", "tools"),
        (["plan", "nowhere.pt2", "--plot", "plan.png"], "plan --plot", "tools"),
        (
            ["profile", "experts", "nowhere.pt2", "--calibration", "tokens.npz", "--plot", "e.png"],
            "profile experts --plot",
            "tools",
        ),
    ],
)
def test_a_command_that_runs_the_lab_says_in_one_line_to_run_it_from_a_checkout(
    args, command, package, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, package, None)  # as from an installed wheel: not importable
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tokens.npz").write_bytes(b"")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: `mopar {command}` runs mopar's "), line
    assert f"{package}/ folder, not in the installed package" in line
    assert "from the root of a mopar checkout" in line
    assert not (tmp_path / "p").exists()  # refused before anything was written


def test_a_package_of_the_labs_name_from_elsewhere_is_not_the_checkouts(tmp_path, monkeypatch):
    stray = tmp_path / "site" / "tools"
    stray.mkdir(parents=True)
    (stray / "__init__.py").write_text("")
    monkeypatch.setitem(sys.modules, "tools", None)  # what was there comes back after the test
    del sys.modules["tools"]
    monkeypatch.syspath_prepend(str(stray.parent))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MoparError, match=r"`mopar plan --plot` runs mopar's profiler and plotting"):
        need_checkout("plan --plot", "tools")
    assert sys.modules["tools"].__file__ == str(stray / "__init__.py")


def test_from_a_checkouts_root_the_lab_is_the_checkouts():
    for package in ("benchmarks", "tools", "examples"):
        module = need_checkout("bench", package)
        assert Path(module.__file__).resolve().parent == ROOT / package


def _lab_commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, LabCommand):
            yield (*path, name), command
        elif isinstance(command, click.Group):
            yield from _lab_commands(command, (*path, name))


def test_the_listing_of_a_lab_command_is_the_first_line_of_its_own_help():
    listed = dict(_lab_commands(cli))
    assert set(listed) == {
        ("bench",),
        *(("profile", n) for n in ("collect", "train", "report", "calibrate")),
    }
    for path, stub in listed.items():
        loaded = stub.load(" ".join(path))
        assert stub.help == loaded.help.split("\n\n")[0].replace("\n", " "), path
        assert "-v, --verbose" in CliRunner().invoke(cli, [*path, "--help"]).stdout


def test_in_a_checkout_a_lab_command_parses_its_own_options():
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    assert "--hop-budget-s" not in result.stdout and "--cold-repeats" in result.stdout
    result = CliRunner().invoke(cli, ["bench", "--no-such-option"])
    assert result.exit_code == 1
    assert "No such option '--no-such-option'" in result.stderr and "bench --help" in result.stderr
