"""What a user deploys with: ``--image-prefix``, ``--gateway`` and ``--redis-url`` fill the
bundle's files, bad values are refused in one line; profile commands write to a folder of the
user's; bundles and charts get the modes the umask gives; the example models' commands say
where to run from."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner

from mopar.bundle.function import FunctionSpec, TensorSpec
from mopar.cli import cli
from mopar.config import DEFAULT_GATEWAY, PROFILES_DIR, CompileConfig
from mopar.errors import OptionError
from mopar.facts import deploy_targets, load_platform, target_named
from mopar.plan import Function
from tests.conftest import chain_plan
from tests.test_sam import _lints_clean

PREFIX = "registry.example.com/team"
GATEWAY = "https://gateway.example.com"
REDIS = "redis://cache.example.com:6379/0"


def _plan(transport: str = "http"):
    """Two functions handing over by ``transport``."""
    return chain_plan(
        [Function(name=f"s{i}", layers=(f"l{i}",), memory_mb=256, time_ms=5.0) for i in range(2)],
        model="tiny-mlp",
        strategy="hand",
        transport=(transport, "response"),
    )


def _write(tmp_path: Path, plan, target, **deploy) -> Path:
    """A bundle of ``plan`` made for ``target`` (its entry's function.json, and what the
    target's emitter writes), in a folder of its own."""
    bundle = tmp_path / target.name
    entry = FunctionSpec(
        model=plan.model,
        slice="s0",
        index=0,
        count=2,
        receives=(TensorSpec(name="x", shape=(1, 4), dtype="float32"),),
        outputs=("h",),
        sends=("h",),
    )
    (bundle / "functions" / "s0").mkdir(parents=True)
    entry.write(bundle / "functions" / "s0")
    made_for = dataclasses.replace(plan, target=target.name)
    config = CompileConfig(**deploy)
    facts = SimpleNamespace(targets={}, platform=load_platform(PROFILES_DIR, target.name))
    target.emit(bundle, made_for, config=config, facts=facts)
    return bundle


def _emit(tmp_path: Path, plan, **deploy) -> tuple[dict, dict]:
    """The stack.yml and template.yaml of ``plan`` made for each target, as that target's
    emitter writes them into a bundle of its own."""
    bundles = [_write(tmp_path, plan, target, **deploy) for target in deploy_targets()]
    files = {p.name: p for b in bundles for p in b.iterdir() if p.suffix in (".yml", ".yaml")}
    stack = yaml.safe_load(files["stack.yml"].read_text())
    template = yaml.safe_load(files["template.yaml"].read_text())
    return stack, template


# --- the files they fill -----------------------------------------------------------------------


def test_deploy_options_fill_stack_yml_and_template_yaml(tmp_path):
    stack, template = _emit(
        tmp_path, _plan("redis"), image_prefix=PREFIX, gateway=GATEWAY, redis_url=REDIS
    )
    functions = stack["functions"]
    assert [f["image"] for f in functions.values()] == [
        f"{PREFIX}/tiny-mlp-s0:latest",
        f"{PREFIX}/tiny-mlp-s1:latest",
    ]
    assert stack["provider"]["gateway"] == GATEWAY
    assert [f["environment"]["REDIS_URL"] for f in functions.values()] == [REDIS, REDIS]
    assert template["Parameters"]["RedisUrl"]["Default"] == REDIS


def test_a_bundle_holds_the_files_of_the_target_its_plan_was_made_for_alone(tmp_path):
    _emit(tmp_path, _plan())
    held = {t: {p.name for p in (tmp_path / t).iterdir()} for t in ("openfaas", "lambda")}
    assert held == {
        "openfaas": {"functions", "template", "stack.yml", "README.md"},
        "lambda": {"functions", "template", "template.yaml", "Dockerfile.lambda", "README.md"},
    }
    header = (tmp_path / "openfaas" / "stack.yml").read_text().splitlines()[:4]
    assert all(line.startswith("# ") for line in header)
    assert "planned and sized for openfaas" in " ".join(header)
    assert "Deploys on OpenFaaS Community Edition as written" in " ".join(header)


def _readme(tmp_path: Path, plan, target: str, **deploy) -> str:
    return (_write(tmp_path, plan, target_named(target), **deploy) / "README.md").read_text()


def test_the_openfaas_readme_names_faas_clis_commands_and_a_stock_install(tmp_path):
    text = _readme(tmp_path, _plan(), "openfaas")
    assert text.startswith("# tiny-mlp: a mopar bundle for OpenFaaS\n")
    for command in (
        "faas-cli up -f stack.yml",
        "faas-cli build -f stack.yml",
        "faas-cli push -f stack.yml",
        "faas-cli deploy -f stack.yml",
        'mopar invoke "$OPENFAAS_URL/function/tiny-mlp-s0" --input reference.npz',
        'curl -s "$OPENFAAS_URL/function/tiny-mlp-s0"',
        "mopar run . --check",
    ):
        assert f"\n{command}" in text, command
    assert "Community Edition" in text and "--image-prefix REGISTRY/TEAM" in text
    assert "sam " not in text and "k8s/" not in text and "REDIS_URL" not in text
    assert '{"inputs": {"x": [...]}}' in text  # the entry's inputs, from its function.json


def test_the_openfaas_readme_of_a_colocated_plan_names_what_it_needs(tmp_path):
    plan = dataclasses.replace(_plan("shm"), chain="shm")
    text = _readme(tmp_path, plan, "openfaas", image_prefix=PREFIX)
    deploy = text[text.index("## Build and deploy") : text.index("## Call it")]
    steps = [line for line in deploy.splitlines() if line and not line.startswith(("#", "`"))]
    assert steps[0] == "kubectl apply -f k8s/profile.yaml" and steps[-1] == "sh k8s/apply.sh"
    assert "OpenFaaS Standard or Enterprise" in text and "hostPath" in text
    assert f"`{PREFIX}/<function>:latest`" in text


def test_the_lambda_readme_names_sams_commands_the_function_url_and_redis(tmp_path):
    text = _readme(tmp_path, _plan("redis"), "lambda", redis_url=REDIS)
    assert text.startswith("# tiny-mlp: a mopar bundle for AWS Lambda\n")
    for command in (
        "sam validate --lint",
        "sam build",
        "sam deploy --guided",
        "sam deploy --stack-name mopar-tiny-mlp --resolve-image-repos "
        "--capabilities CAPABILITY_IAM --parameter-overrides RedisUrl=redis://HOST:6379/0",
        "sam list stack-outputs --stack-name mopar-tiny-mlp",
        'curl -s "$URL" --aws-sigv4',
        "aws lambda invoke --function-name <TinyMlpS0 from the stack>",
    ):
        assert f"\n{command}" in text, command
    assert "EntryFunctionUrl" in text and "FunctionUrlAuthType" in text
    assert f"`RedisUrl` parameter (compiled with `{REDIS}`)" in text
    assert "faas-cli" not in text and "stack.yml" not in text


# Slow (cfn-lint starts in 7 s): tests/test_sam.py's default cfn-lint tests cover the template's
# structure, and the test above the default this adds.
@pytest.mark.slow
def test_cfn_lint_passes_with_a_redis_url_default(tmp_path):
    _emit(tmp_path, _plan("redis"), redis_url=REDIS)
    _lints_clean(tmp_path / "lambda" / "template.yaml")


def test_without_deploy_options_images_are_local_and_redis_is_left_to_deploy_time(tmp_path):
    stack, template = _emit(tmp_path, _plan("redis"))
    functions = stack["functions"]
    assert [f["image"] for f in functions.values()] == [
        "tiny-mlp-s0:latest",
        "tiny-mlp-s1:latest",
    ]
    assert stack["provider"]["gateway"] == DEFAULT_GATEWAY
    assert [f["environment"]["REDIS_URL"] for f in functions.values()] == ["", ""]
    assert template["Parameters"]["RedisUrl"]["Default"] == ""


def test_redis_url_is_set_where_no_cut_needs_it_only_when_given(tmp_path):
    stack, _ = _emit(tmp_path / "a", _plan("http"))
    assert all("REDIS_URL" not in f["environment"] for f in stack["functions"].values())
    stack, _ = _emit(tmp_path / "b", _plan("http"), redis_url=REDIS)
    assert {f["environment"]["REDIS_URL"] for f in stack["functions"].values()} == {REDIS}


def test_a_trailing_slash_on_the_prefix_gives_one_slash_in_the_image(tmp_path):
    stack, _ = _emit(tmp_path, _plan(), image_prefix=f"{PREFIX}/")
    assert next(iter(stack["functions"].values()))["image"] == f"{PREFIX}/tiny-mlp-s0:latest"


# --- bad values --------------------------------------------------------------------------------

BAD = [
    ("image_prefix", "https://registry.example.com/team", "not an image registry and namespace"),
    ("image_prefix", "Team/Models", "not an image registry and namespace"),
    ("gateway", "gateway.example.com:8080", "not an http(s) URL"),
    ("gateway", "ftp://gateway.example.com", "not an http(s) URL"),
    ("redis_url", "http://cache:6379", "not a Redis URL"),
    ("redis_url", "redis://", "not a Redis URL"),
]


@pytest.mark.parametrize("name, value, problem", BAD)
def test_the_api_refuses_a_bad_deploy_value_naming_the_argument(tmp_path, name, value, problem):
    import mopar

    with pytest.raises(OptionError) as caught:  # before the model is even looked for
        mopar.compile(str(tmp_path / "no-such.pt2"), out=tmp_path / "out", **{name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r} is {problem}")
    assert "e.g." in message and "\n" not in message


@pytest.mark.parametrize("name, value, problem", BAD[::2])
def test_the_cli_refuses_a_bad_deploy_value_in_one_line_exit_1(tmp_path, name, value, problem):
    flag = "--" + name.replace("_", "-")
    result = CliRunner().invoke(cli, ["compile", str(tmp_path / "no-such.pt2"), flag, value])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: {flag} {value!r} is {problem}")


def test_compile_refuses_target_all_in_one_line_naming_the_fix(tmp_path):
    result = CliRunner().invoke(cli, ["compile", str(tmp_path / "no-such.pt2"), "--target", "all"])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert "'all' is not a target" in line and "compile once per target" in line
    assert "--target openfaas --out bundle-openfaas, --target lambda --out bundle-lambda" in line
    help_text = CliRunner().invoke(cli, ["compile", "--help"]).stdout
    assert "[openfaas|lambda]" in help_text and "all:" not in help_text


# --- profile commands write to the user's folder -----------------------------------------------


def test_calibrate_writes_to_a_folder_of_the_users_by_default(tmp_path, monkeypatch):
    import tools.profiler.cli as calibrate

    measured = {
        "hop_ms": 1.0,
        "runtime_baseline_mb": 40.0,
        "measured": {"machine": "test"},
        "transports": {},
    }
    monkeypatch.setattr(calibrate, "_calibrate", lambda config: measured)  # test_calibrate measures
    shipped = (PROFILES_DIR / "transports.json").read_bytes()
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        result = CliRunner().invoke(cli, ["profile", "calibrate"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    written = tmp_path / "mopar-profiles" / "transports.json"
    assert json.loads(written.read_text()) == measured
    assert stat.S_IMODE(written.stat().st_mode) == 0o644
    assert "--profiles mopar-profiles" in result.stdout
    assert (PROFILES_DIR / "transports.json").read_bytes() == shipped


@pytest.mark.parametrize("command", ["calibrate", "train"])
def test_profile_commands_refuse_to_write_into_the_mopar_package(command):
    import mopar

    inside = Path(mopar.__file__).resolve().parent / "profiles"
    result = CliRunner().invoke(cli, ["profile", command, "--out", str(inside)])
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert "inside the installed mopar package" in line and "--profiles DIR" in line


# --- modes under the umask -----------------------------------------------------------------------


@pytest.mark.parametrize("mask, mode", [(0o022, 0o755), (0o077, 0o700)])
def test_a_bundle_folder_gets_the_mode_mkdir_gives(tmp_path, mask, mode):
    from mopar.emit.bundle import staging_dir

    old = os.umask(mask)
    try:
        with staging_dir(tmp_path / "bundle", force=False) as staged:
            tmp = staged.path
            (tmp / "plan.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "bundle").stat().st_mode) == mode


def test_a_saved_chart_gets_the_mode_open_gives(tmp_path):
    from matplotlib.figure import Figure

    from tools.plot import save_png

    old = os.umask(0o022)
    try:
        path = save_png(Figure(figsize=(1, 1)), tmp_path / "plan.png", dpi=10)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# --- commands that run the example models ------------------------------------------------------


@pytest.mark.parametrize(
    "args, command", [(["bench", "--quick"], "bench"), (["profile", "collect"], "profile collect")]
)
def test_a_command_that_runs_the_examples_says_where_to_run_it_when_they_are_missing(
    args, command, tmp_path, monkeypatch
):
    import sys

    monkeypatch.setitem(sys.modules, "examples", None)  # as in an installed wheel: not importable
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert f"`mopar {command}` runs mopar's example models" in line
    assert "from the root of a mopar checkout" in line
    assert not (tmp_path / "dataset.csv").exists()


def test_one_function_is_one_function_in_the_files_people_read(tmp_path):
    from mopar._text import counted

    assert [counted(n, "function") for n in (0, 1, 2)] == [
        "0 functions",
        "1 function",
        "2 functions",
    ]
    whole = chain_plan([Function(name="s0", layers=("l0",), memory_mb=256, time_ms=5.0)])
    _emit(tmp_path, whole)
    header = (tmp_path / "openfaas" / "stack.yml").read_text().splitlines()[0]
    assert "1 function in chain mode" in header
    described = yaml.safe_load((tmp_path / "lambda" / "template.yaml").read_text())["Description"]
    assert " in 1 function (" in described
    assert "cut into 1 function by mopar" in (tmp_path / "openfaas" / "README.md").read_text()
