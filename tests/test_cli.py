"""The command line: every model source, user errors as one line with exit 1, internal errors
with exit 2, and a --help that stays light. Each error is checked twice: through the real
``mopar`` executable in a subprocess, and in-process through click's CliRunner."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

from mopar import api as mopar_api
from mopar.cli import cli
from mopar.planner import Plan
from tests.conftest import ROOT, SKIPNET_INPUT, mopar, nonblank_lines


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Model files for the error cases and the source formats."""
    import torch

    from tests import models

    d = tmp_path_factory.mktemp("cli-files")
    model = models.skipnet()
    example = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    torch.export.save(torch.export.export(model, (example,)), d / "skipnet.pt2")
    torch.jit.save(torch.jit.trace(model, (example,)), d / "skipnet_ts.pt")
    torch.save(model, d / "skipnet_pickle.pt")
    torch.save(model.state_dict(), d / "weights.pt")
    (d / "random.pt2").write_bytes(np.random.default_rng(0).bytes(4096))
    with zipfile.ZipFile(d / "foreign.pt", "w") as zf:
        zf.writestr("hello.txt", "a zip, but not one torch writes")
    (d / "not-a-bundle").mkdir()
    return {"dir": d, "example": example}


# --- user errors: exit 1, one line, no traceback --------------------------------------------------


# id -> (args, substrings the error line must contain). "{d}" is the folder of `files`.
ERRORS = {
    "missing file": (["compile", "{d}/nope.pt2"], ["model file", "nope.pt2", "does not exist"]),
    "random bytes": (["compile", "{d}/random.pt2"], ["not a zip file"]),
    "zip torch does not write": (["compile", "{d}/foreign.pt"], ["not one torch writes"]),
    "bad input spec": (
        ["compile", "tests.models:skipnet", "--input", "x=1x3x8x8:float99"],
        ["bad --input spec", "float99"],
    ),
    "input shape the model rejects": (
        ["compile", "tests.models:skipnet", "--input", "x=1x5x8x8:float32"],
        ["x=(1, 5, 8, 8):float32", "3 channels"],
    ),
    "data-dependent branch": (
        ["compile", "tests.models:branchy", "--input", SKIPNET_INPUT],
        ["torch.export cannot capture", "in module 'stage.gate'"],
    ),
    "numpy call": (
        ["compile", "tests.models:numpy_call", "--input", SKIPNET_INPUT],
        ["torch.export cannot capture", "in module 'bridge'"],
    ),
    "pickle without --trust-pickle": (
        ["compile", "{d}/skipnet_pickle.pt", "--input", SKIPNET_INPUT],
        ["arbitrary code", "--trust-pickle"],
    ),
    "state_dict file": (
        ["compile", "{d}/weights.pt", "--input", SKIPNET_INPUT],
        ["weights only", "not a model"],
    ),
    "slices 0": (
        ["compile", "tests.models:mlp", "--input", "x=1x16:float32", "--slices", "0"],
        ["--slices must be between 1 and 4 (the model has 4 layers), got 0"],
    ),
    "slices 999": (
        ["compile", "tests.models:mlp", "--input", "x=1x16:float32", "--slices", "999"],
        ["--slices must be between 1 and 4 (the model has 4 layers), got 999"],
    ),
    "unimportable factory": (["compile", "tests.nosuch:fn"], ["cannot import 'tests.nosuch'"]),
    "run: missing bundle": (["run", "{d}/nope"], ["does not exist", "mopar compile"]),
    "run: not a bundle": (["run", "{d}/not-a-bundle"], ["no plan.json"]),
}


# The cases whose run through the real executable stays in the default suite: its own wrapping of
# an error (exit 1, one line on its stderr, no traceback, no torch warning) for a failed export
# and `run`; a missing file's is test_compile_error_output_is_exactly_the_error_line's. Every
# case's CliRunner twin runs by default; the other cases' runs through the executable (seconds
# apiece: each imports torch) run with -m slow.
SUBPROCESS_DEFAULT = (
    "data-dependent branch",
    "run: missing bundle",
    "run: not a bundle",
)


def _error_params(*, via_subprocess: bool = False):
    for name, (args, expect) in ERRORS.items():
        slow = via_subprocess and name not in SUBPROCESS_DEFAULT
        yield pytest.param(args, expect, id=name, marks=[pytest.mark.slow] if slow else [])


def _fill(args, files, tmp_path):
    out = [a.format(d=files["dir"]) for a in args]
    if out[0] == "compile":  # never write into the working directory, even by mistake
        out += ["--out", str(tmp_path / "out")]
    return out


def _assert_one_error_line(code: int, stderr: str, expect: list[str]) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr
    lines = nonblank_lines(stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    for text in expect:
        assert text in lines[0]


@pytest.mark.parametrize("args, expect", _error_params(via_subprocess=True))
def test_user_error_via_subprocess_is_one_line_and_exit_1(files, tmp_path, args, expect):
    proc = mopar(*_fill(args, files, tmp_path))
    _assert_one_error_line(proc.returncode, proc.stderr, expect)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, expect", _error_params())
def test_user_error_via_cli_runner_is_one_line_and_exit_1(files, tmp_path, args, expect):
    result = CliRunner().invoke(cli, _fill(args, files, tmp_path))
    _assert_one_error_line(result.exit_code, result.stderr, expect)
    assert not (tmp_path / "out").exists()


def test_compile_error_output_is_exactly_the_error_line(files, tmp_path):
    proc = mopar(*_fill(["compile", "{d}/nope.pt2"], files, tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, repr(proc.stderr)


@pytest.mark.slow  # test_compile_error_output_is_exactly_the_error_line: the same wrapping
def test_plan_error_output_is_exactly_the_error_line(files):
    proc = mopar("plan", f"{files['dir']}/nope.pt2")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, repr(proc.stderr)


@pytest.mark.parametrize(
    "where",
    # --debug before the subcommand: the group's option, the same flag as after it
    [pytest.param("group", marks=pytest.mark.slow), "command"],
)
def test_debug_adds_the_traceback(files, where):
    target = f"{files['dir']}/nope.pt2"
    args = ["--debug", "compile", target] if where == "group" else ["compile", target, "--debug"]
    proc = mopar(*args)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ModelLoadError" in proc.stderr
    assert nonblank_lines(proc.stderr)[-1].startswith("error: model file")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "Traceback (most recent call last)" in result.stderr


def test_internal_error_exits_2_with_one_line(monkeypatch, tmp_path):
    def boom(*args, **kwargs):
        raise RuntimeError("kaboom in the emitter")

    monkeypatch.setattr(mopar_api, "build_bundle", boom)
    args = [
        "compile",
        "tests.models:mlp",
        "--input",
        "x=1x16:float32",
        "--out",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr
    (line,) = nonblank_lines(result.stderr)
    assert line.startswith("internal error: RuntimeError: kaboom in the emitter")
    assert "bug in mopar" in line and "--debug" in line
    debug = CliRunner().invoke(cli, ["--debug", *args])
    assert debug.exit_code == 2
    assert "Traceback (most recent call last)" in debug.stderr and "kaboom" in debug.stderr


def test_usage_errors_exit_1(tmp_path):
    result = CliRunner().invoke(cli, ["compile"])
    assert result.exit_code == 1
    assert "Missing argument 'MODEL'" in result.stderr
    proc = mopar("run", str(tmp_path), "--requests", "0")
    assert proc.returncode == 1 and "--requests" in proc.stderr


def test_input_and_example_inputs_together_are_refused(skipnet_bundle):
    result = CliRunner().invoke(
        cli,
        [
            "inspect",
            "tests.models:skipnet",
            "--input",
            SKIPNET_INPUT,
            "--example-inputs",
            str(skipnet_bundle / "reference.npz"),
        ],
    )
    assert result.exit_code == 1
    assert nonblank_lines(result.stderr) == [
        "error: give either --input or --example-inputs, not both"
    ]


# --- help -----------------------------------------------------------------------------------------


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from mopar.cli import cli\n"
        "for args in (['--help'], ['compile', '--help'], ['run', '--help']):\n"
        "    cli(args, standalone_mode=False)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "TORCH False"


def test_option_errors_and_a_missing_bundle_do_not_import_torch(tmp_path):
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from mopar.cli import cli\n"
        f"out, nope = {str(tmp_path / 'out')!r}, {str(tmp_path / 'nope')!r}\n"
        "for args in (\n"
        "    ['compile', 'tests.models:mlp', '--slices', 'abc', '--out', out],\n"
        "    ['compile', 'tests.models:mlp', '--target', 'gcp', '--out', out],\n"
        "    ['run', nope],\n"
        "    ['run', sys.argv[1]],\n"
        "    ['run', sys.argv[1], '--transport', 'bogus'],\n"
        "):\n"
        "    print('EXIT', CliRunner().invoke(cli, args).exit_code)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[:-1] == ["EXIT 1"] * 5, proc.stdout
    assert lines[-1] == "TORCH False"


def test_help_lists_the_commands_and_the_exit_codes():
    proc = mopar("--help")
    assert proc.returncode == 0
    for command in ("compile", "plan", "run", "inspect"):
        assert command in proc.stdout
    assert "Exit codes: 0 ok, 1 user error, 2 internal error" in proc.stdout


# --- every source format --------------------------------------------------------------------------


@pytest.mark.slow  # the default zoo's .pt2 files compile from their stored inputs
def test_pt2_compiles_from_its_stored_inputs_without_input_options(files, tmp_path):
    out = tmp_path / "pt2-bundle"
    proc = mopar("compile", files["dir"] / "skipnet.pt2", "--slices", "2", "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {
        "bundle",
        "plan",
        "max_abs_err",
        "max_rel_err",
        "rtol",
        "atol",
        "until",
        "stages",
    }
    assert len(Plan.from_dict(result["plan"]).functions) == 2
    assert result["max_rel_err"] <= 1e-4
    ref = np.load(out / "reference.npz")
    np.testing.assert_array_equal(ref["input.x"], files["example"].numpy())
    run = mopar("run", out, "--check", "--requests", "1")
    assert run.returncode == 0, run.stderr


@pytest.mark.slow  # test_frontend captures a TorchScript file and matches eager; past capture
# compile is the same for every format
def test_torchscript_compiles_and_runs(files, tmp_path):
    out = tmp_path / "ts-bundle"
    proc = mopar(
        "compile",
        files["dir"] / "skipnet_ts.pt",
        "--input",
        SKIPNET_INPUT,
        "--slices",
        "2",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "plan.json").read_text())
    assert manifest["plan"]["model"] == "skipnet_ts"
    assert len(manifest["plan"]["functions"]) == 2
    run = mopar("run", out, "--check", "--requests", "1")
    assert run.returncode == 0, run.stderr


def test_factory_compiles_through_the_cli(skipnet_bundle):
    manifest = json.loads((skipnet_bundle / "plan.json").read_text())
    assert manifest["plan"]["model"] == "skipnet"
    assert [s["layers"] for s in manifest["plan"]["functions"]] == [
        ["stem", "act"],
        ["mid1"],
        ["mid2", "head"],
    ]


@pytest.mark.slow  # the in-process test below covers --trust-pickle; test_frontend the loading
def test_pickle_is_accepted_with_trust_pickle(files):
    # Unpickling needs the module's class importable: tests.models, from the repository root.
    proc = mopar(
        "inspect",
        files["dir"] / "skipnet_pickle.pt",
        "--input",
        SKIPNET_INPUT,
        "--trust-pickle",
        "--json",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert [la["name"] for la in json.loads(proc.stdout)["layers"]] == [
        "stem",
        "act",
        "mid1",
        "mid2",
        "head",
    ]


def test_pickle_is_accepted_with_trust_pickle_in_process(files):
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(files["dir"] / "skipnet_pickle.pt"),
            "--input",
            SKIPNET_INPUT,
            "--trust-pickle",
            "--slices",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert len(json.loads(result.stdout)["functions"]) == 2


# --- other commands -------------------------------------------------------------------------------


def test_inspect_json_lists_layers_tensors_and_edges():
    result = CliRunner().invoke(
        cli, ["inspect", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--json"]
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) == {
        "model",
        "param_bytes",
        "inputs",
        "outputs",
        "layers",
        "edges",
        "moe",
        "notes",
    }
    assert doc["moe"] == []
    assert doc["model"] == "skipnet"
    assert doc["inputs"] == [
        {"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32", "nbytes": 768}
    ]
    stem = doc["layers"][0]
    assert (stem["name"], stem["module_type"], stem["param_bytes"]) == ("stem", "Conv2d", 896)
    assert {"src": "act", "dst": "mid2", "bytes": 2048} in doc["edges"]


def test_inspect_reads_example_inputs_from_a_bundle_reference(skipnet_bundle):
    result = CliRunner().invoke(
        cli,
        [
            "inspect",
            "tests.models:skipnet",
            "--example-inputs",
            str(skipnet_bundle / "reference.npz"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"][0]["shape"] == [1, 3, 8, 8]


def test_plan_json_is_a_plan_with_the_requested_slices():
    result = CliRunner().invoke(
        cli, ["plan", "tests.models:mlp", "--input", "x=1x16:float32", "--slices", "4", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    plan = Plan.from_dict(json.loads(result.stdout))
    assert [s.layers for s in plan.functions] == [("fc1",), ("fc2",), ("fc3",), ("fc4",)]


def test_plan_table_names_the_model_and_its_slices():
    result = CliRunner().invoke(
        cli, ["plan", "tests.models:mlp", "--input", "x=1x16:float32", "--slices", "2"]
    )
    assert result.exit_code == 0, result.stderr
    assert "plan for mlp (mopar on openfaas, 2 functions, 4 layers)" in result.stdout


@pytest.mark.parametrize(
    "options, message",
    [
        (["--max-slowdown", "0.9"], "Invalid value for '--max-slowdown'"),
        (["--cold-start-rate", "2"], "Invalid value for '--cold-start-rate'"),
        (
            ["--target", "lambda", "--max-memory-mb", "100"],
            "error: --max-memory-mb 100 is below the smallest lambda function (128 MB); raise it",
        ),
    ],
)
def test_plan_refuses_a_bad_workload_option_in_one_line(options, message):
    result = CliRunner().invoke(
        cli, ["plan", "tests.models:mlp", "--input", "x=1x16:float32", *options]
    )
    assert result.exit_code == 1
    (line,) = nonblank_lines(result.stderr)
    assert message in line and line.startswith("error: ")


def test_plan_json_records_the_default_bound_and_its_notes():
    result = CliRunner().invoke(
        cli, ["plan", "tests.models:mlp", "--input", "x=1x16:float32", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert "1.05 x the unsplit plan's predicted" in plan["notes"][0]
    assert plan["latency_ms"] <= plan["bound_ms"] * (1 + 1e-9)


def test_compile_refuses_an_existing_out_without_force(skipnet_bundle):
    result = CliRunner().invoke(
        cli,
        ["compile", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--out", str(skipnet_bundle)],
    )
    assert result.exit_code == 1
    (line,) = nonblank_lines(result.stderr)
    assert line.startswith("error: output") and "--force" in line


def test_run_check_with_an_input_file_lacking_outputs_is_a_user_error(skipnet_bundle, tmp_path):
    only_inputs = tmp_path / "in.npz"
    np.savez(only_inputs, x=np.zeros((1, 3, 8, 8), np.float32))
    proc = mopar("run", skipnet_bundle, "--input", only_inputs, "--check", "--requests", "1")
    assert proc.returncode == 1
    (line,) = nonblank_lines(proc.stderr)
    assert line.startswith("error: --check needs expected outputs")


def test_run_says_when_it_hands_over_otherwise_than_the_plan(skipnet_bundle):
    # planned for OpenFaaS Community Edition: its cuts hand over by http
    plan = json.loads((skipnet_bundle / "plan.json").read_text())["plan"]
    cuts = {e["transport"] for e in plan["edges"] if e["src"] != "<request>"}
    assert cuts - {"response", "request"} == {"http"}
    default = mopar("run", skipnet_bundle, "--requests", "1")  # the fastest here: /dev/shm
    assert default.returncode == 0, default.stderr
    said = " ".join(default.stdout.split())
    assert (
        "plan hands its cuts over by http, as it deploys; this run hands them over by shm" in said
    )
    assert "--transport http runs them as planned" in said
    planned = mopar("run", skipnet_bundle, "--requests", "1", "--transport", "http")
    assert planned.returncode == 0, planned.stderr
    assert "as it deploys" not in planned.stdout


def test_mopar_serve_does_not_default_to_the_openfaas_gateways_port():
    from mopar.cli.serve import SERVER

    (port,) = [s for s in SERVER if s.decls == ("--port",)]
    assert port.default == 8000 and "8080" in port.help
