"""The Python API as torch users call it: `mopar.analyze`, `mopar.partition`, `mopar.compile`.

They take what `torch.export.export` takes (a model, a tuple of example args, a dict of example
kwargs) and mopar's own forms; they stay functions whatever was imported or called before; each
failure is a `MoparError` naming the Python argument; library use writes nothing to stderr, and
the CLI keeps its own flag names and log lines. docs/api.md's examples run here too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mopar
from mopar.config import Tolerance
from mopar.errors import InputSpecError, ModelLoadError, MoparError, OptionError, PlanError
from tests import models
from tests.conftest import ROOT, nonblank_lines
from tests.conftest import mopar as run_mopar

PUBLIC = ("analyze", "partition", "compile")


class TwoInputs(nn.Module):
    """forward(x, y=None, *, z=None): a default, and a keyword-only parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, *, z: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = x if y is None else x + y
        return self.fc(out if z is None else out * z)


@pytest.fixture(scope="module")
def mlp() -> nn.Module:
    return models.mlp()


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(1, 16, generator=torch.Generator().manual_seed(3))


def _assert_public_are_functions() -> None:
    for name in PUBLIC:
        assert isinstance(getattr(mopar, name), types.FunctionType), name


# --- names ---------------------------------------------------------------------------------------


def test_no_submodule_takes_a_public_function_name():
    # Importing mopar.<name> would bind the submodule over the function of that name.
    import importlib.util

    for name in PUBLIC:
        assert importlib.util.find_spec(f"mopar.{name}") is None, name


_EVERY_MODULE = (
    "import importlib, pkgutil, mopar\n"
    "for m in pkgutil.walk_packages(mopar.__path__, 'mopar.'):\n"
    "    if not m.name.endswith('__main__'):\n"
    "        importlib.import_module(m.name)\n"
)


@pytest.mark.parametrize(
    "prelude",
    [
        "import mopar.planner\nimport mopar",
        # a function first: the planner-first and api-first orders cover the question by default
        pytest.param(
            "import mopar\nmopar.partition, mopar.compile\nimport mopar.planner, mopar.api, mopar.frontend",
            marks=pytest.mark.slow,
        ),
        "import mopar.api\nfrom mopar import partition, compile, analyze\nimport mopar.plan",
        # every module imported first: the three orders above cover the question by default
        pytest.param(_EVERY_MODULE, marks=pytest.mark.slow),
    ],
    ids=["planner-first", "function-first", "api-first", "every-module"],
)
def test_public_functions_stay_functions_whatever_was_imported_first(prelude):
    check = (
        "import types, mopar, mopar.api\n"
        "for n in ('analyze', 'partition', 'compile'):\n"
        "    f = getattr(mopar, n)\n"
        "    assert isinstance(f, types.FunctionType) and f is getattr(mopar.api, n), (n, f)\n"
        "    assert n in dir(mopar)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + "\n" + check],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""


# --- argument forms ------------------------------------------------------------------------------


def _npz(tmp_path: Path, x: torch.Tensor) -> Path:
    path = tmp_path / "inputs.npz"
    np.savez(path, x=x.numpy())
    return path


def _pt2(tmp_path: Path, model: nn.Module, x: torch.Tensor) -> Path:
    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    return path


FORMS = {
    "tuple of tensors": lambda m, x, tmp: (m, (x,)),
    "tuple of arrays": lambda m, x, tmp: (m, (x.numpy(),)),
    "empty tuple and kwargs": lambda m, x, tmp: (m, (), {"x": x}),
    "None and kwargs": lambda m, x, tmp: (m, None, {"x": x}),
    "dict": lambda m, x, tmp: (m, {"x": x}),
    "npz str": lambda m, x, tmp: (m, str(_npz(tmp, x))),
    "npz Path": lambda m, x, tmp: (m, _npz(tmp, x)),
    "ExportedProgram, own inputs": lambda m, x, tmp: (torch.export.export(m, (x,)),),
    "ExportedProgram with args": lambda m, x, tmp: (
        torch.export.export(m, (torch.zeros(1, 16),)),
        (x,),
    ),
    "pt2 Path, own inputs": lambda m, x, tmp: (_pt2(tmp, m, x),),
    "pt2 str with kwargs": lambda m, x, tmp: (str(_pt2(tmp, m, torch.zeros(1, 16))), (), {"x": x}),
    "factory with tuple": lambda m, x, tmp: ("tests.models:mlp", (x,)),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_argument_form_binds_the_same_input(form, mlp, x, tmp_path):
    args = FORMS[form](mlp, x, tmp_path)
    for _ in range(2):  # twice: nothing is left behind by the first call
        captured = mopar.analyze(*args).captured
        assert captured.input_names == ("x",)
        np.testing.assert_array_equal(captured.inputs["x"], x.numpy())
        np.testing.assert_allclose(
            next(iter(captured.reference.values())), mlp(x).detach().numpy(), rtol=1e-6, atol=1e-6
        )
    _assert_public_are_functions()


def test_spec_strings_in_a_list_or_a_tuple(mlp):
    for specs in (["x=1x16:float32"], ("x=1x16:float32",)):
        plan = mopar.partition(mlp, specs, slices=2)
        assert len(plan.functions) == 2
        assert mopar.analyze(mlp, specs).captured.inputs["x"].shape == (1, 16)


def test_positional_args_bind_by_name_with_defaults_and_keyword_only():
    model, x = TwoInputs().eval(), torch.randn(1, 16)
    assert mopar.analyze(model, (x,)).captured.input_names == ("x",)
    assert mopar.analyze(model, (x, None), {"z": x}).captured.input_names == ("x", "z")
    both = mopar.analyze(model, (x,), {"y": x, "z": x}).captured
    assert both.input_names == ("x", "y", "z")
    np.testing.assert_allclose(
        next(iter(both.reference.values())), model(x, x, z=x).detach().numpy(), rtol=1e-6
    )


def test_a_tensor_is_copied_not_shared(mlp):
    x = torch.randn(1, 16)
    captured = mopar.analyze(mlp, (x,)).captured
    x.add_(1.0)
    assert not np.array_equal(captured.inputs["x"], x.numpy())


def test_progress_hears_each_phase(mlp, x):
    phases: list[str] = []
    mopar.partition(mlp, (x,), progress=lambda phase, done, total: phases.append(phase))
    assert phases == ["load", "export", "layers"]


# --- each function, twice, in both orders --------------------------------------------------------


def test_partition_compile_and_analyze_twice_each_in_both_orders(mlp, x, tmp_path, capfd):
    p1 = mopar.partition(mlp, (x,), slices=2)
    b1 = mopar.compile(mlp, (x,), out=tmp_path / "one", slices=2)
    a1 = mopar.analyze(mlp, (x,))
    b2 = mopar.compile(mlp, (), {"x": x}, out=str(tmp_path / "two"), slices=2, strategy="uniform")
    a2 = mopar.analyze("tests.models:mlp", ["x=1x16:float32"])
    p2 = mopar.partition(mlp, {"x": x}, slices=2)
    _assert_public_are_functions()
    assert p1 == p2
    assert [s.layers for s in b1.plan.functions] == [s.layers for s in p1.functions]
    assert len(b2.plan.functions) == 2 and b2.path == tmp_path / "two"
    for bundle in (b1, b2):
        assert json.loads((bundle.path / "plan.json").read_text())["plan"]["functions"]
    assert [la.name for la in a1.layers.layers] == [la.name for la in a2.layers.layers]
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), "library calls wrote to stdout/stderr"


# --- failures ------------------------------------------------------------------------------------

# (call, error class, what the message must say). Each call fails before any compile work.
FAILURES = {
    "no inputs": (lambda m, x, t: mopar.partition(m), InputSpecError, "example_args is empty"),
    "bare tensor": (
        lambda m, x, t: mopar.partition(m, x),
        InputSpecError,
        "example_args is a Tensor",
    ),
    "list of tensors": (lambda m, x, t: mopar.analyze(m, [x]), InputSpecError, "as a tuple"),
    "too many": (lambda m, x, t: mopar.partition(m, (x, x)), InputSpecError, "example_args has 2"),
    "given twice": (
        lambda m, x, t: mopar.analyze(m, (x,), {"x": x}),
        InputSpecError,
        "example_kwargs['x']",
    ),
    "unknown kwarg": (
        lambda m, x, t: mopar.partition(m, (), {"y": x}),
        InputSpecError,
        "example_kwargs: input 'y' is not an argument of mlp.forward(x)",
    ),
    "unknown dict key": (
        lambda m, x, t: mopar.compile(m, {"y": x}, out=t / "b"),
        InputSpecError,
        "example_args: input 'y' is not an argument",
    ),
    "kwargs not a dict": (
        lambda m, x, t: mopar.partition(m, (), [x]),
        InputSpecError,
        "example_kwargs is a list",
    ),
    "dict and kwargs": (
        lambda m, x, t: mopar.partition(m, {"x": x}, {"x": x}),
        InputSpecError,
        "example_kwargs goes with a tuple",
    ),
    "non-tensor arg": (
        lambda m, x, t: mopar.partition(m, (3,)),
        InputSpecError,
        "example_args[0] is an int",
    ),
    "nested arg": (lambda m, x, t: mopar.partition(m, ([x],)), InputSpecError, "nested inputs"),
    "bfloat16": (
        lambda m, x, t: mopar.analyze(m, (x.bfloat16(),)),
        InputSpecError,
        "example_args[0] is a torch.bfloat16 tensor",
    ),
    "bad spec": (
        lambda m, x, t: mopar.partition(m, ["x=1x16:float99"]),
        InputSpecError,
        "bad example_args spec",
    ),
    "spec not in a list": (
        lambda m, x, t: mopar.partition(m, "x=1x16:float32"),
        InputSpecError,
        "['x=1x16:float32']",
    ),
    "missing npz": (
        lambda m, x, t: mopar.partition(m, t / "none.npz"),
        InputSpecError,
        "example_args file",
    ),
    "wrong shape": (
        lambda m, x, t: mopar.partition(m, (torch.randn(1, 5),)),
        InputSpecError,
        "example_args shapes",
    ),
    "pt2 shape": (
        lambda m, x, t: mopar.partition(torch.export.export(m, (x,)), (torch.randn(2, 16),)),
        InputSpecError,
        "example_args=['x=1x16:float32']",
    ),
    "model type": (lambda m, x, t: mopar.partition(3, (x,)), ModelLoadError, "int"),
    "missing model": (
        lambda m, x, t: mopar.compile("none.pt2", (x,), out=t / "b"),
        ModelLoadError,
        "'none.pt2' does not exist",
    ),
    "unknown option": (
        lambda m, x, t: mopar.partition(m, (x,), slice=2),
        OptionError,
        "unknown option slice=2 (did you mean slices=?); valid options: arch=",
    ),
    "compile option in partition": (
        lambda m, x, t: mopar.partition(m, (x,), codec="zstd"),
        OptionError,
        "partition() got an unknown option codec='zstd'",
    ),
    "unknown compile option": (
        lambda m, x, t: mopar.compile(m, (x,), out=t / "b", tolerence=1),
        OptionError,
        "(did you mean tolerance=?)",
    ),
    "option type": (
        lambda m, x, t: mopar.partition(m, (x,), slices="2"),
        OptionError,
        "slices='2' is a str; expected int or None",
    ),
    "option range": (
        lambda m, x, t: mopar.compile(m, (x,), out=t / "b", parallel=0),
        OptionError,
        "parallel=0 is out of range",
    ),
    "depth": (lambda m, x, t: mopar.analyze(m, (x,), depth=0), OptionError, "depth=0"),
    "progress": (lambda m, x, t: mopar.analyze(m, (x,), progress="yes"), OptionError, "progress="),
    "no out": (lambda m, x, t: mopar.compile(m, (x,)), OptionError, "compile() needs out="),
    "rtol with tolerance": (
        lambda m, x, t: mopar.compile(m, (x,), out=t / "b", rtol=1e-3, tolerance=Tolerance()),
        OptionError,
        "tolerance= or rtol=",
    ),
    "strategy": (
        lambda m, x, t: mopar.partition(m, (x,), strategy="best"),
        PlanError,
        "unknown strategy='best'; choose one of mopar",
    ),
    "target": (
        lambda m, x, t: mopar.compile(m, (x,), out=t / "b", target="gcp"),
        PlanError,
        "unknown target='gcp'",
    ),
    "transport": (
        lambda m, x, t: mopar.partition(m, (x,), target="lambda", transport="shm"),
        PlanError,
        "transport='shm' is not available on lambda",
    ),
    "slices range": (
        lambda m, x, t: mopar.partition(m, (x,), slices=60),
        PlanError,
        "slices= must be between 1 and 4",
    ),
    "out exists": (
        lambda m, x, t: mopar.compile(m, (x,), out=t, slices=1),
        MoparError,
        "pass force=True to replace it",
    ),
}


@pytest.mark.parametrize("case", FAILURES)
def test_each_failure_is_a_mopar_error_naming_the_python_argument(case, mlp, x, tmp_path, capfd):
    call, kind, says = FAILURES[case]
    with pytest.raises(kind) as info:
        call(mlp, x, tmp_path)
    message = str(info.value)
    assert says in message
    assert not re.search(r"(?<![\w`])--[a-z]", message), f"a CLI flag in an API message: {message}"
    assert capfd.readouterr() == ("", ""), "a failing call wrote to stdout/stderr"
    _assert_public_are_functions()


def test_a_caught_error_keeps_the_cli_wording_for_the_cli(mlp, x):
    with pytest.raises(PlanError) as info:
        mopar.partition(mlp, (x,), slices=60)
    assert str(info.value).startswith("slices= must be")
    assert info.value.render("cli").startswith("--slices must be")


# --- logging and stderr ---------------------------------------------------------------------------


def test_the_mopar_logger_has_a_null_handler():
    import logging

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("mopar").handlers)


def _profiles_from_another_onnxruntime(tmp_path: Path) -> Path:
    folder = tmp_path / "profiles"
    shutil.copytree(ROOT / "profiles", folder)
    meta = json.loads((folder / "predictors.json").read_text())
    meta["machine"]["onnxruntime"] = "0.0.1"
    (folder / "predictors.json").write_text(json.dumps(meta))
    return folder


def test_predictors_from_another_onnxruntime_are_an_info_record(tmp_path, caplog):
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors

    with caplog.at_level("DEBUG", logger="mopar"):
        load_predictors(_profiles_from_another_onnxruntime(tmp_path), feature_names=FEATURE_NAMES)
    notes = [r for r in caplog.records if "onnxruntime 0.0.1" in r.getMessage()]
    assert [r.levelname for r in notes] == ["INFO"]


@pytest.mark.slow  # test_cli's user errors through the executable are one line; test_small_things
# shows --verbose's info lines
def test_cli_user_error_is_one_line_and_verbose_adds_the_info(tmp_path):
    args = (
        "plan",
        "tests.models:mlp",
        "--input",
        "x=1x16:float32",
        "--slices",
        "99",
        "--profiles",
        _profiles_from_another_onnxruntime(tmp_path),
    )
    quiet = run_mopar(*args)
    assert quiet.returncode == 1
    assert nonblank_lines(quiet.stderr) == [
        "error: --slices must be between 1 and 4 (the model has 4 layers), got 99"
    ]
    loud = run_mopar("--verbose", *args)
    assert loud.returncode == 1
    lines = nonblank_lines(loud.stderr)
    assert "info: predictors were measured with onnxruntime 0.0.1, running" in "\n".join(lines)
    assert lines[-1] == quiet.stderr.strip()


# --- docs/api.md ---------------------------------------------------------------------------------


def test_api_doc_examples_run_and_write_nothing_else_to_stderr(tmp_path):
    """The ```python blocks of docs/api.md, in order, in an empty folder. Only the doc's own
    logging handler (its last block, lines starting ``mopar.``) may write to stderr: no
    warnings and no prints from torch or onnxruntime, partition and compile included."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) >= 5
    script = tmp_path / "doc.py"
    script.write_text("\n".join(blocks))
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = nonblank_lines(proc.stderr)
    assert lines and all(line.startswith("mopar.") for line in lines), proc.stderr[-3000:]
    assert (tmp_path / "bundle" / "plan.json").is_file()


def test_every_option_is_a_compile_config_field_or_a_tolerance_field():
    from dataclasses import fields

    from mopar.arguments import COMPILE_OPTIONS, PLAN_OPTIONS
    from mopar.config import CompileConfig

    names = {f.name for f in fields(CompileConfig)}
    assert PLAN_OPTIONS <= COMPILE_OPTIONS <= names | {"rtol", "atol"}
