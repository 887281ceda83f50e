"""Emit: the AWS SAM ``template.yaml`` and the Lambda Dockerfile of a bundle."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mopar.plan import Function, Plan
from mopar.targets.aws_lambda.emit import (
    DOCKERFILE,
    LambdaLimits,
    lambda_dockerfile,
    logical_id,
    sam_template,
    write_lambda,
)
from tests.conftest import chain_plan
from tests.sam import sam

MB = 1024 * 1024


def _plan(
    memory_mb=(64, 3008, 20000),
    time_ms=(5.0, 40_000.0, 1e9),
    param_bytes=(0, 0, 0),
    transports=("http", "redis", "response"),
    model="resnet-50",
) -> Plan:
    """A hand-made three-slice plan with the numbers the template is derived from."""
    return chain_plan(
        [
            Function(name=f"s{i}", layers=(f"l{i}",), memory_mb=mb, param_bytes=pb, time_ms=t)
            for i, (mb, t, pb) in enumerate(zip(memory_mb, time_ms, param_bytes))
        ],
        model=model,
        strategy="hand",
        target="lambda",
        transport=transports,
    )


def lambda_template_of(bundle: Path, out: Path) -> dict:
    """The SAM template of a compiled bundle's functions, as the Lambda emitter writes it for
    their plan made for Lambda (a bundle holds its own target's files alone): the graph, calls,
    warm-ups and policies of the bundle's own functions, their sizes as planned there. Written
    to ``out`` too, for cfn-lint."""
    from mopar.bundle.function import FunctionSpec
    from mopar.config import PROFILES_DIR
    from mopar.emit.functions import deployed
    from mopar.facts import load_platform
    from mopar.runner.bundle import read_manifest

    document = read_manifest(bundle).document
    made = replace(Plan.from_dict(document.plan), target="lambda", chain="")
    plan = deployed(made, document.generation, load_platform(PROFILES_DIR, "lambda"))
    entry = FunctionSpec.load(bundle / "functions" / plan.path()[0].name)
    template = sam_template(plan, prewarms=entry.prewarms)
    out.write_text(yaml.safe_dump(template, sort_keys=False))
    return template


def _functions(template):
    return {
        k: v for k, v in template["Resources"].items() if v["Type"] == "AWS::Serverless::Function"
    }


_SEVERITY_BITS = {"informational": 8, "warning": 4, "error": 2}


def _cfn_lint(path: Path) -> subprocess.CompletedProcess:
    """Run the real cfn-lint on ``path`` in this process (its API, which its console script
    runs: no process importing cfn-lint afresh for each template), answering as the script
    does: the exit code ORs 2 (error), 4 (warning) and 8 (informational); stdout holds one
    match a line."""
    try:
        from cfnlint.api import lint_file
    except ImportError:
        pytest.fail(
            f"cfn-lint is missing; run: {Path(sys.executable).parent}/pip install 'cfn-lint>=1.0'"
        )
    matches = lint_file(Path(path))
    code = 0
    for match in matches:
        code |= _SEVERITY_BITS.get(match.rule.severity, 0)
    text = "".join(f"{match}\n" for match in matches)
    return subprocess.CompletedProcess(["cfn-lint", str(path)], code, text, "")


def _lints_clean(path: Path) -> None:
    """No errors or warnings; informational findings (exit code 8) are allowed."""
    proc = _cfn_lint(path)
    assert proc.returncode in (0, 8), (
        f"cfn-lint {path} (rc {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    )


# --- structure -----------------------------------------------------------------------------------


def test_logical_ids_are_alphanumeric_camel_case_and_start_with_a_letter():
    assert logical_id("resnet50", "s0") == "Resnet50S0"
    assert logical_id("resnet-50", "s12") == "Resnet50S12"
    assert logical_id("tests.models:skipnet", "s1") == "TestsModelsSkipnetS1"
    assert logical_id("3dnet", "s0") == "Fn3dnetS0"


def test_template_is_a_sam_template_with_architecture_and_redis_parameters():
    t = sam_template(_plan(), arch="arm64")
    assert t["Transform"] == "AWS::Serverless-2016-10-31"
    assert t["Parameters"]["Architecture"]["Default"] == "arm64"
    assert t["Parameters"]["Architecture"]["AllowedValues"] == ["x86_64", "arm64"]
    assert t["Parameters"]["RedisUrl"]["Default"] == ""
    globals_ = t["Globals"]["Function"]
    assert globals_["Architectures"] == [{"Ref": "Architecture"}]
    assert globals_["Environment"]["Variables"]["REDIS_URL"] == {"Ref": "RedisUrl"}


def test_one_image_function_per_slice_in_plan_order():
    fns = _functions(sam_template(_plan()))
    assert list(fns) == ["Resnet50S0", "Resnet50S1", "Resnet50S2"]
    assert all(f["Properties"]["PackageType"] == "Image" for f in fns.values())


def test_memory_is_the_plans_clamped_to_lambdas_range():
    fns = _functions(sam_template(_plan(memory_mb=(64, 3008, 20000))))
    assert [f["Properties"]["MemorySize"] for f in fns.values()] == [128, 3008, 10240]


def test_memory_range_comes_from_the_limits_given():
    limits = dataclasses.replace(LambdaLimits(), min_mb=256, max_mb=4096)
    fns = _functions(sam_template(_plan(memory_mb=(64, 3008, 20000)), limits=limits))
    assert [f["Properties"]["MemorySize"] for f in fns.values()] == [256, 3008, 4096]


def test_timeout_is_generous_over_the_predicted_time_and_at_most_15_minutes():
    fns = _functions(sam_template(_plan(time_ms=(5.0, 40_000.0, 1e9))))
    timeouts = [f["Properties"]["Timeout"] for f in fns.values()]
    assert timeouts == [900, 900, 900]
    fns = _functions(sam_template(_plan(time_ms=(5.0, 4_000.0, 1.0))))
    # each waits for the rest of the chain: own (10x, at least 30 s) plus the later ones'
    assert [f["Properties"]["Timeout"] for f in fns.values()] == [30 + 40 + 30, 40 + 30, 30]


def test_ephemeral_storage_is_512_mb_unless_the_weights_need_more():
    fns = _functions(sam_template(_plan(param_bytes=(10 * MB, 400 * MB, 50_000 * MB))))
    sizes = [f["Properties"]["EphemeralStorage"]["Size"] for f in fns.values()]
    assert sizes == [512, 800, 10240]


def test_each_function_names_its_slice_next_hop_and_transport():
    fns = _functions(sam_template(_plan()))
    env = [f["Properties"]["Environment"]["Variables"] for f in fns.values()]
    assert [e["MOPAR_SLICE"] for e in env] == ["s0", "s1", "s2"]
    assert [e["MOPAR_NEXT"] for e in env] == [{"Ref": "Resnet50S1"}, {"Ref": "Resnet50S2"}, ""]
    assert [e["MOPAR_TRANSPORT"] for e in env] == ["http", "redis", "response"]


def test_each_functions_onnxruntime_threads_follow_the_cpu_its_memory_buys():
    plan = _plan(memory_mb=(128, 3538, 10240))
    vcpus = [mb / 1769 for mb in (128, 3538, 10240)]  # Lambda's CPU grows with memory
    plan = replace(
        plan, functions=tuple(replace(f, vcpus=v) for f, v in zip(plan.functions, vcpus))
    )
    env = [
        f["Properties"]["Environment"]["Variables"] for f in _functions(sam_template(plan)).values()
    ]
    assert [e["MOPAR_INTRA_OP"] for e in env] == ["1", "2", "5"]


def test_each_function_may_invoke_the_next_the_entry_the_rest_and_the_last_nothing():
    fns = list(_functions(sam_template(_plan(), prewarms=("s1", "s2"))).values())
    assert fns[0]["Properties"]["Policies"] == [  # the next, and the one after to warm up
        {"LambdaInvokePolicy": {"FunctionName": {"Ref": "Resnet50S1"}}},
        {"LambdaInvokePolicy": {"FunctionName": {"Ref": "Resnet50S2"}}},
    ]
    assert fns[1]["Properties"]["Policies"] == [
        {"LambdaInvokePolicy": {"FunctionName": {"Ref": "Resnet50S2"}}}
    ]
    assert "Policies" not in fns[2]["Properties"]


def test_image_metadata_builds_each_slice_from_the_bundle_root_with_the_build_parameters():
    t = sam_template(_plan())
    for i, f in enumerate(_functions(t).values()):
        assert f["Metadata"] == {
            "Dockerfile": DOCKERFILE,
            "DockerContext": ".",
            "DockerTag": f"s{i}",
            "DockerBuildArgs": {
                "SLICE": f"s{i}",
                "BASE_IMAGE": {"Ref": "BaseImage"},
                "PIP_OFFLINE": {"Ref": "PipOffline"},
            },
        }
        # sam build builds the image, and sam deploy pushes it: no ImageUri of the bundle's own
        assert "ImageUri" not in f["Properties"]
    assert t["Parameters"]["BaseImage"]["Default"] == "python:3.11-slim"
    assert t["Parameters"]["PipOffline"]["Default"] == "false"


def test_every_function_invokes_through_the_lambda_endpoint_parameter_aws_own_by_default():
    t = sam_template(_plan())
    assert t["Parameters"]["LambdaEndpoint"]["Default"] == ""
    env = t["Globals"]["Function"]["Environment"]["Variables"]
    assert env["AWS_ENDPOINT_URL_LAMBDA"] == {"Ref": "LambdaEndpoint"}  # what boto3 reads


def test_outputs_give_every_functions_arn():
    t = sam_template(_plan())
    ids = ["Resnet50S0", "Resnet50S1", "Resnet50S2"]
    assert {k: v for k, v in t["Outputs"].items() if k in {f"{x}Arn" for x in ids}} == {
        f"{fid}Arn": {"Description": f"ARN of function s{i}", "Value": {"Fn::GetAtt": [fid, "Arn"]}}
        for i, fid in enumerate(ids)
    }
    assert t["Outputs"]["EntryFunction"]["Value"] == {"Ref": "Resnet50S0"}


def test_yaml_text_loads_back_to_the_same_template_with_a_safe_loader(tmp_path):
    plan = _plan()
    write_lambda(tmp_path, plan, arch="x86_64", limits=LambdaLimits())
    assert yaml.safe_load((tmp_path / "template.yaml").read_text()) == sam_template(plan)


def test_dockerfile_installs_in_a_stage_of_its_own_and_runs_the_lambda_runtime_client():
    lines = lambda_dockerfile().splitlines()
    assert lines[2] == "ARG BASE_IMAGE=python:3.11-slim"
    assert lines[3] == "FROM ${BASE_IMAGE} AS install" and "FROM ${BASE_IMAGE}" in lines[4:]
    final = lines[lines.index("FROM ${BASE_IMAGE}") :]
    install = next(ln for ln in lines if ln.startswith("RUN") and "install.sh" in ln)
    assert "awslambdaric==" in install and "boto3==" in install  # pinned
    # no bind mount (Docker's classic builder, which sam build drives, has none): the wheels
    # are copied into the install stage alone, so none reaches the image
    assert not any("--mount" in ln for ln in lines)
    assert "COPY template/mopar-onnx/wheels/ /tmp/wheels/" in lines[: len(lines) - len(final)]
    assert "COPY --from=install /opt/venv /opt/venv" in final
    assert "COPY template/mopar-onnx/mopar ./mopar" in final  # the runtime, torch-free
    assert "COPY functions/${SLICE}/ ./slice/" in final
    assert any(ln.endswith("install.sh -r /tmp/mopar/slice-requirements.txt") for ln in lines)
    # no USER: Lambda picks its own; SAM's emulator layer needs root to build
    assert not any(ln.startswith("USER") for ln in lines)
    assert final[-2:] == [
        'ENTRYPOINT ["python", "-m", "awslambdaric"]',
        'CMD ["mopar.runtime.aws.lambda_handler"]',
    ]


def test_step_functions_state_machine_is_optional_and_passes_keys_in_slice_order():
    t = sam_template(_plan())
    machine = t["Resources"]["Pipeline"]
    assert machine["Condition"] == "UseStepFunctions"
    states = machine["Properties"]["Definition"]["States"]
    assert machine["Properties"]["Definition"]["StartAt"] == "s0"
    assert [states[s].get("Next") for s in ("s0", "s1", "s2")] == ["s1", "s2", None]
    assert states["s2"]["End"] is True
    env = t["Globals"]["Function"]["Environment"]["Variables"]
    assert env["MOPAR_CHAIN"] == {"Ref": "Chain"}


@pytest.mark.parametrize("chain", ["", "invoke", "stepfunctions", "event"])
def test_the_chain_parameter_defaults_to_the_plans_mode(chain):
    t = sam_template(dataclasses.replace(_plan(), chain=chain))
    assert t["Parameters"]["Chain"]["Default"] == (chain or "invoke")
    assert t["Parameters"]["Chain"]["AllowedValues"] == ["invoke", "stepfunctions", "event"]


def test_the_event_chain_requires_redis_and_never_retries_a_handed_on_invoke():
    t = sam_template(dataclasses.replace(_plan(), chain="event"))
    rule = t["Rules"]["EventChainNeedsRedis"]
    assert rule["RuleCondition"] == {"Fn::Equals": [{"Ref": "Chain"}, "event"]}
    assert rule["Assertions"][0]["Assert"] == {
        "Fn::Not": [{"Fn::Equals": [{"Ref": "RedisUrl"}, ""]}]
    }
    for f in _functions(t).values():  # a failed function already told the rendezvous
        assert f["Properties"]["EventInvokeConfig"] == {"MaximumRetryAttempts": 0}
    fns = list(_functions(t).values())  # each hands on by an Event invoke of the next
    assert fns[0]["Properties"]["Policies"] == [
        {"LambdaInvokePolicy": {"FunctionName": {"Ref": "Resnet50S1"}}}
    ]


def test_a_plan_made_for_openfaas_gets_no_lambda_template_in_one_line():
    from mopar.errors import BundleError

    plan = dataclasses.replace(_plan(), target="openfaas", chain="callback")
    with pytest.raises(BundleError) as err:
        sam_template(plan)  # its sizes are OpenFaaS's: MemorySize would buy a CPU share unpriced
    assert "\n" not in str(err.value)
    assert "planned and sized for openfaas" in str(err.value) and "--target lambda" in str(
        err.value
    )


def test_a_lambda_plan_with_an_shm_cut_is_refused_in_one_line():
    from mopar.errors import BundleError

    with pytest.raises(BundleError) as err:
        sam_template(_plan(transports=("shm", "http", "response")))
    assert "\n" not in str(err.value) and "'s0'" in str(err.value)
    assert "hands on by 'shm'" in str(err.value) and "--target lambda" in str(err.value)


def test_the_description_says_the_template_was_sized_for_lambda():
    described = sam_template(_plan(), arch="arm64")["Description"]
    assert "planned and sized for AWS Lambda (arm64)" in described and "resnet-50" in described


def test_the_entry_alone_has_a_function_url_whose_auth_type_is_a_parameter_default_iam():
    t = sam_template(_plan())
    auth = t["Parameters"]["FunctionUrlAuthType"]
    assert auth["Default"] == "AWS_IAM" and auth["AllowedValues"] == ["AWS_IAM", "NONE"]
    urls = {k: f["Properties"].get("FunctionUrlConfig") for k, f in _functions(t).items()}
    assert urls == {
        "Resnet50S0": {"AuthType": {"Ref": "FunctionUrlAuthType"}, "InvokeMode": "BUFFERED"},
        "Resnet50S1": None,
        "Resnet50S2": None,
    }
    assert t["Outputs"]["EntryFunctionUrl"]["Value"] == {
        "Fn::GetAtt": ["Resnet50S0Url", "FunctionUrl"]
    }
    # SAM grants a public URL's permissions only for a literal NONE: the template does, when
    # the parameter is NONE
    public = t["Conditions"]["PublicFunctionUrl"]
    assert public == {"Fn::Equals": [{"Ref": "FunctionUrlAuthType"}, "NONE"]}
    granted = {
        k: (v["Condition"], v["Properties"])
        for k, v in t["Resources"].items()
        if v["Type"] == "AWS::Lambda::Permission"
    }
    assert granted == {
        "Resnet50S0UrlPublicAccess": (
            "PublicFunctionUrl",
            {
                "Action": "lambda:InvokeFunctionUrl",
                "FunctionName": {"Ref": "Resnet50S0"},
                "Principal": "*",
                "FunctionUrlAuthType": "NONE",
            },
        ),
        "Resnet50S0UrlPublicInvoke": (
            "PublicFunctionUrl",
            {
                "Action": "lambda:InvokeFunction",
                "FunctionName": {"Ref": "Resnet50S0"},
                "Principal": "*",
                "InvokedViaFunctionUrl": True,
            },
        ),
    }


def test_a_lambda_plan_in_a_mode_lambda_does_not_offer_is_refused_in_one_line():
    from mopar.errors import BundleError

    with pytest.raises(BundleError) as err:
        sam_template(dataclasses.replace(_plan(), chain="callback"))
    assert "\n" not in str(err.value)
    assert "lambda does not offer" in str(err.value) and "re-plan" in str(err.value)


# --- the real cfn-lint ---------------------------------------------------------------------------


@pytest.mark.parametrize("chain", ["invoke", "stepfunctions", "event"])
def test_cfn_lint_passes_on_the_template_of_each_lambda_mode(tmp_path, chain):
    write_lambda(
        tmp_path, dataclasses.replace(_plan(), chain=chain), arch="x86_64", limits=LambdaLimits()
    )
    _lints_clean(tmp_path / "template.yaml")


def test_cfn_lint_passes_on_a_hand_made_plans_template(tmp_path):
    write_lambda(tmp_path, _plan(), arch="x86_64", limits=LambdaLimits())
    assert (tmp_path / DOCKERFILE).is_file()
    _lints_clean(tmp_path / "template.yaml")


def test_cfn_lint_catches_a_broken_template(tmp_path):
    """The linter is really looking: an unknown property is an error (exit code bit 2)."""
    t = sam_template(_plan())
    t["Resources"]["Resnet50S0"]["Properties"]["MemorySizeMb"] = 128
    (tmp_path / "template.yaml").write_text(yaml.safe_dump(t, sort_keys=False))
    proc = _cfn_lint(tmp_path / "template.yaml")
    assert proc.returncode != 1 and proc.returncode & 2, proc.stdout + proc.stderr
    assert "MemorySizeMb" in proc.stdout


def test_compiled_bundle_has_a_template_that_cfn_lint_accepts(skipnet_lambda_bundle):
    bundle = skipnet_lambda_bundle
    path = bundle / "template.yaml"
    fns = _functions(yaml.safe_load(path.read_text()))
    assert [f["Metadata"]["DockerTag"] for f in fns.values()] == ["s0", "s1", "s2"]
    assert (bundle / DOCKERFILE).is_file() and not (bundle / "stack.yml").exists()
    for f in fns.values():
        slice_dir = bundle / "functions" / f["Metadata"]["DockerTag"]
        files = {p.name for p in slice_dir.iterdir()}
        assert {"model.onnx", "handler.py", "requirements.txt"} <= files
    _lints_clean(path)


@pytest.mark.parametrize("chain", ["invoke", "stepfunctions", "event"])
def test_sam_validate_lint_accepts_the_template_of_each_lambda_mode_offline(tmp_path, chain):
    """The real SAM CLI (build/sam-venv, `make setup`): SAM's own translation and its cfn-lint."""
    write_lambda(
        tmp_path, dataclasses.replace(_plan(), chain=chain), arch="x86_64", limits=LambdaLimits()
    )
    proc = sam("validate", "--lint", "-t", "template.yaml", cwd=tmp_path, env={}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is a valid SAM Template" in proc.stdout + proc.stderr


def test_sam_validate_lint_catches_a_broken_template(tmp_path):
    """SAM's validation is really looking: an unknown property fails it."""
    t = sam_template(_plan())
    t["Resources"]["Resnet50S0"]["Properties"]["MemorySizeMb"] = 128
    (tmp_path / "template.yaml").write_text(yaml.safe_dump(t, sort_keys=False))
    proc = sam("validate", "--lint", "-t", "template.yaml", cwd=tmp_path, env={}, timeout=120)
    assert proc.returncode != 0 and "MemorySizeMb" in proc.stdout + proc.stderr


def test_every_bundle_has_the_wheel_folder_its_dockerfiles_copy(skipnet_bundle):
    """Every builder fails on a missing COPY source: the folder ships, with its README."""
    assert (skipnet_bundle / "template" / "mopar-onnx" / "wheels" / "README.md").is_file()


def test_the_entry_warms_up_the_rest_of_the_chain_unless_pre_warm_is_off(tmp_path):
    doc = sam_template(_plan(), prewarms=("s1", "s2"))
    (tmp_path / "template.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    _lints_clean(tmp_path / "template.yaml")
    env = [f["Properties"]["Environment"]["Variables"] for f in _functions(doc).values()]
    assert env[0]["MOPAR_PREWARM"] == {
        "Fn::If": [
            "PreWarmOn",
            {"Fn::Join": [",", [{"Ref": "Resnet50S1"}, {"Ref": "Resnet50S2"}]]},
            "",
        ]
    }
    assert all("MOPAR_PREWARM" not in e for e in env[1:])
    assert doc["Parameters"]["PreWarm"]["Default"] == "true"
    assert doc["Conditions"]["PreWarmOn"] == {"Fn::Equals": [{"Ref": "PreWarm"}, "true"]}
    # none where the entry warms up none (its function.json's prewarms)
    plain = [f["Properties"] for f in _functions(sam_template(_plan())).values()]
    assert "MOPAR_PREWARM" not in plain[0]["Environment"]["Variables"]
    assert plain[0]["Policies"] == [{"LambdaInvokePolicy": {"FunctionName": {"Ref": "Resnet50S1"}}}]
