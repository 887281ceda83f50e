"""Loading files saved in ANOTHER process: .pt2 archives that name third-party pytree types and
custom operators (transformers, tiny hand-made packages), TorchScript, and factories.

Every file is written by a separate Python process, and every load that matters runs in a fresh
one (``mopar inspect`` as a subprocess), so nothing the saving side imported is around when
mopar reads the file. The saved files are made once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, mopar, nonblank_lines

PYTHON = sys.executable

# Lines torch's own logging or a traceback would leave on stderr.
_NOISE = ("Traceback", "torch/export", "W1", "Warning", "warn(")

_SAVE_TRANSFORMERS = """
import sys, torch
from transformers import BertConfig, BertForPreTraining, BertModel, MixtralConfig, MixtralModel
torch.manual_seed(0)
out = sys.argv[1]
ids = {"input_ids": torch.randint(0, 100, (1, 16))}
bert = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64)
for name, model in [
    ("bert", BertModel(BertConfig(**bert))),
    ("bert_pretraining", BertForPreTraining(BertConfig(**bert))),
    ("mixtral", MixtralModel(MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False))),
]:
    ep = torch.export.export(model.eval(), (), ids, strict=False)
    torch.export.save(ep, f"{out}/{name}.pt2")
"""

# Two tiny packages: one whose output type is a registered pytree node, one whose custom
# operator is registered by a submodule (its __init__ registers nothing), and a factory module.
_PACKAGES = {
    "moparfake_out/__init__.py": """
        from dataclasses import dataclass
        import torch

        @dataclass
        class Pair:
            left: torch.Tensor
            right: torch.Tensor

        torch.export.register_dataclass(Pair, serialized_type_name="moparfake_out.Pair")

        class Split(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(8, 8)

            def forward(self, x):
                y = self.fc(x)
                return Pair(left=y.relu(), right=y.sigmoid())
    """,
    "moparfake_ops/__init__.py": "",
    "moparfake_ops/kernels.py": """
        import torch

        @torch.library.custom_op("moparfake_ops::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)
    """,
    "moparfake_factory.py": """
        import logging, warnings
        import torch

        def noisy():
            print("factory noise on stdout")
            warnings.warn("factory noise as a warning")
            logging.getLogger("torch.export").warning("factory noise in torch's log")
            return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())

        def broken():
            raise ValueError("the weights folder is empty")
    """,
    "moparfake_needs_dep.py": """
        import moparfake_absent_dependency

        def model():
            return None
    """,
}

_SAVE_FAKES = """
import sys, torch
import moparfake_out, moparfake_ops.kernels
out = sys.argv[1]
x = torch.randn(2, 8)

class Doubler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.moparfake_ops.twice(self.fc(x))

class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

torch.export.save(torch.export.export(moparfake_out.Split().eval(), (x,)), f"{out}/pair.pt2")
torch.export.save(torch.export.export(Doubler().eval(), (x,)), f"{out}/twice.pt2")
torch.jit.save(torch.jit.script(Doubler().eval()), f"{out}/twice_script.pt")
torch.jit.save(torch.jit.script(Plain().eval()), f"{out}/plain_script.pt")
"""


def _run_python(
    code: str, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def _saved_ok(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"saving {what} failed:\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def transformers_files(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf")
    _saved_ok(_run_python(_SAVE_TRANSFORMERS, str(out)), "transformers models")
    return out


@pytest.fixture(scope="module")
def fake_packages(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pkgs")
    for rel, text in _PACKAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def fake_files(tmp_path_factory, fake_packages) -> Path:
    out = tmp_path_factory.mktemp("fake")
    script = out / "save_fakes.py"  # a file: torch.jit.script reads the classes' source
    script.write_text(_SAVE_FAKES)
    result = subprocess.run(
        [PYTHON, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(fake_packages)},
    )
    _saved_ok(result, "models of the fake packages")
    return out


def _with(packages: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(packages)}


def _assert_quiet(stderr: str) -> None:
    noisy = [line for line in stderr.splitlines() if any(n in line for n in _NOISE)]
    assert not noisy, f"library noise reached stderr:\n{stderr[-3000:]}"


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    lines = nonblank_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def _edit_program(src: Path, dst: Path, edit) -> Path:
    """Copy the .pt2 ``src`` to ``dst`` with ``edit(json_text) -> json_text`` applied to its
    serialized program."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("models/model.json"):
                data = edit(data.decode()).encode()
            zout.writestr(info.filename, data)
    return dst


# --- transformers, loaded by a process that never imported it -------------------------------------


@pytest.mark.slow  # the default zoo's bert is a .pt2 saved by another process, compiled and run
def test_bert_pt2_from_another_process_inspects_quietly(transformers_files):
    # a wide screen, so the layer table shows whole names (80 columns, piped, folds them)
    result = mopar("inspect", transformers_files / "bert.pt2", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "encoder.layer.1.output.dense" in result.stdout and "pooler.dense" in result.stdout
    _assert_quiet(result.stderr)


@pytest.mark.slow  # the default zoo's mixtral compiles from its .pt2
def test_mixtral_pt2_with_transformers_moe_operator_inspects(transformers_files):
    # Names transformers.modeling_outputs.MoeModelOutputWithPast and calls
    # torch.ops.transformers.grouped_mm_fallback, registered by transformers.integrations.moe.
    result = mopar("inspect", transformers_files / "mixtral.pt2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    layers = [la["name"] for la in json.loads(result.stdout)["layers"]]
    assert "layers.0.mlp.gate" in layers
    assert any(n.startswith("layers.0.mlp.experts") for n in layers)
    _assert_quiet(result.stderr)


@pytest.mark.slow  # the default zoo's bert .pt2 imports its own output class to load
def test_model_specific_output_class_is_imported_from_its_module(transformers_files):
    # BertForPreTraining returns transformers.models.bert.modeling_bert.BertForPreTrainingOutput.
    code = textwrap.dedent("""
        import sys
        from mopar.frontend import load_model
        assert "transformers" not in sys.modules
        loaded = load_model(sys.argv[1])
        print(loaded.kind, loaded.exported.call_spec.out_spec.type.__qualname__)
    """)
    result = _run_python(code, str(transformers_files / "bert_pretraining.pt2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["pt2", "BertForPreTrainingOutput"]
    _assert_quiet(result.stderr)


@pytest.mark.slow  # the installed-transformers-lacks test covers these one-line errors
def test_missing_transformers_is_one_line_naming_the_package(transformers_files):
    code = "import sys; sys.modules['transformers'] = None\nfrom mopar.cli import main; main()"
    result = _run_python(code, "inspect", str(transformers_files / "mixtral.pt2"))
    line = _one_error_line(result)
    assert "exported from transformers" in line
    assert "pip install transformers (or mopar[models])" in line
    assert "grouped_mm_fallback" in line and "torch version" not in line and "re-save" not in line


ZOO_MODELS = ("mixtral",)  # saved by conftest's `zoo_files`, once per run for every file


def test_operator_the_installed_transformers_lacks_names_it_and_the_fix(zoo_files, tmp_path):
    from examples import zoo

    assert zoo.saved_error(zoo.ZOO["mixtral"], zoo_files) is None
    # the zoo's MixtralForCausalLM, saved by another process, calls
    # torch.ops.transformers.grouped_mm_fallback as `transformers_files`' MixtralModel does
    edited = _edit_program(
        zoo_files / "mixtral.pt2",
        tmp_path / "renamed_op.pt2",
        lambda text: text.replace("grouped_mm_fallback.default", "grouped_mm_nosuch.default"),
    )
    line = _one_error_line(mopar("inspect", edited))
    assert "torch.ops.transformers.grouped_mm_nosuch" in line
    assert 'experts_implementation="batched_mm"' in line


# --- any installed package: pytree types and custom operators -------------------------------------


def test_pytree_type_of_an_installed_package_is_imported(fake_files, fake_packages):
    result = mopar("inspect", fake_files / "pair.pt2", env=_with(fake_packages))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fc" in result.stdout
    _assert_quiet(result.stderr)


def test_custom_operator_registered_by_a_submodule_is_found(fake_files, fake_packages):
    # moparfake_ops/__init__.py registers nothing: the op is found in kernels.py's source.
    result = mopar("inspect", fake_files / "twice.pt2", env=_with(fake_packages))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "twice" in result.stdout
    _assert_quiet(result.stderr)


@pytest.mark.parametrize(
    "file, package",
    [
        ("pair.pt2", "moparfake_out"),
        # a .pt2's missing operator package: the pair's .pt2 path and the TorchScript one's
        # package cover it by default
        pytest.param("twice.pt2", "moparfake_ops", marks=pytest.mark.slow),
        ("twice_script.pt", "moparfake_ops"),
    ],
)
def test_package_that_is_not_installed_is_named_with_pip_install(fake_files, file, package):
    line = _one_error_line(mopar("inspect", fake_files / file, "--input", "x=2x8:float32"))
    assert f"exported from {package}" in line and f"pip install {package}" in line
    assert "torch version" not in line


def test_type_defined_in_the_exporting_script_says_to_move_it(fake_files, tmp_path):
    edited = _edit_program(
        fake_files / "pair.pt2",
        tmp_path / "main_type.pt2",
        lambda text: text.replace("moparfake_out.Pair", "__main__.Pair"),
    )
    line = _one_error_line(mopar("inspect", edited))
    assert "__main__.Pair" in line and "importable module" in line


def test_another_schema_version_is_blamed_only_when_the_archive_says_so(
    fake_files, fake_packages, tmp_path
):
    def older(text: str) -> str:
        doc = json.loads(text)
        doc["schema_version"], doc["torch_version"] = {"major": 99, "minor": 0}, "9.9.0"
        return json.dumps(doc)

    line = _one_error_line(
        mopar(
            "inspect",
            _edit_program(fake_files / "twice.pt2", tmp_path / "v99.pt2", older),
            env=_with(fake_packages),
        )
    )
    assert "saved by torch 9.9.0" in line and "schema 99.x" in line


@pytest.mark.slow  # test_cli's --debug tests cover the flag
def test_debug_lets_torch_log_through(fake_files, fake_packages, tmp_path):
    edited = _edit_program(
        fake_files / "twice.pt2",
        tmp_path / "bad_op.pt2",
        lambda text: text.replace(
            "torch.ops.aten.linear.default", "torch.ops.aten.linear_nosuch.default"
        ),
    )
    quiet = mopar("inspect", edited, env=_with(fake_packages))
    assert "linear_nosuch" in _one_error_line(quiet) and "another torch version" in quiet.stderr
    loud = mopar("--debug", "inspect", edited, env=_with(fake_packages))
    assert loud.returncode == 1 and "torch/export" in loud.stderr


# --- TorchScript and factories --------------------------------------------------------------------


@pytest.mark.slow  # the custom-operator TorchScript test below inspects one from another process
def test_torchscript_from_another_process_inspects(fake_files):
    result = mopar("inspect", fake_files / "plain_script.pt", "--input", "x=2x8:float32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plain_script: 2 layers" in result.stdout
    _assert_quiet(result.stderr)


def test_torchscript_custom_operator_loads_with_its_package(fake_files, fake_packages):
    result = mopar(
        "inspect",
        fake_files / "twice_script.pt",
        "--input",
        "x=2x8:float32",
        env=_with(fake_packages),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_quiet(result.stderr)


def test_factory_noise_stays_off_the_terminal(fake_packages):
    result = mopar(
        "inspect",
        "moparfake_factory:noisy",
        "--input",
        "input=2x8:float32",
        env=_with(fake_packages),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the factory's own print is its author's output: kept, on stderr (mopar never swallows what
    # the host's code prints); the libraries' warnings and log records are mopar's to quiet
    assert "noise" not in result.stdout
    assert "factory noise as a warning" not in result.stderr
    assert "factory noise in torch's log" not in result.stderr


@pytest.mark.parametrize(
    "factory, expected",
    [
        ("moparfake_factory:broken", "raised ValueError: the weights folder is empty"),
        ("moparfake_needs_dep:model", "pip install moparfake_absent_dependency"),
    ],
)
def test_factory_errors_are_one_line_with_the_fix(fake_packages, factory, expected):
    line = _one_error_line(mopar("inspect", factory, env=_with(fake_packages)))
    assert expected in line


# --- in-process sources ---------------------------------------------------------------------------


def test_exported_program_and_path_objects_are_accepted(tmp_path):
    import torch

    from mopar.frontend import load_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ep = torch.export.export(model, (torch.randn(1, 4),))
    loaded = load_model(ep)
    assert (loaded.kind, loaded.name, loaded.exported) == ("exported", "sequential", ep)
    assert loaded.stored_inputs is not None
    torch.export.save(ep, tmp_path / "seq.pt2")
    from_path = load_model(tmp_path / "seq.pt2")
    assert (from_path.kind, from_path.name) == ("pt2", "seq")


def test_weights_that_do_not_fit_the_machine_are_refused_before_loading(monkeypatch, tmp_path):
    """A model whose weights x COMPILE_PEAK are over the memory available is refused at the
    start of compile, in one line with the numbers and mopar plan; a config still plans."""
    import torch
    from click.testing import CliRunner

    from mopar.cli import cli
    from mopar.errors import MachineMemoryError
    from mopar.frontend import load

    model = tmp_path / "m.pt2"
    lin = torch.nn.Linear(1024, 1024)  # 4 MB
    torch.export.save(torch.export.export(lin, (torch.zeros(1, 1024),)), model)
    size = model.stat().st_size
    monkeypatch.setattr(load, "available_bytes", lambda: size)  # less than 1.5x the file
    loads = []
    monkeypatch.setattr(load, "_load_pt2", loads.append)
    result = CliRunner().invoke(cli, ["compile", str(model), "--out", str(tmp_path / "b")])
    assert result.exit_code == 1 and not loads  # refused before torch read the file
    (line,) = nonblank_lines(result.stderr)
    mb = lambda n: f"{n / 2**20:,.0f} MB"  # noqa: E731
    assert f"has {mb(size)} of weights" in line and f"1.5x its weights, {mb(1.5 * size)}" in line
    assert f"this machine has {mb(size)} available" in line and "mopar plan" in line
    monkeypatch.setattr(load, "available_bytes", lambda: 2**20)
    with pytest.raises(MachineMemoryError) as held:  # a module in memory needs the rest
        load.load_model(lin)
    assert held.value.weights_bytes == 4 * (1024 * 1024 + 1024) and "2 MB more" in str(held.value)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}))
    assert load.load_model(str(config), weightless=True).weightless  # mopar plan's way
