"""``template.yaml`` (AWS SAM) and ``Dockerfile.lambda``: one container Lambda per slice.

Read in this order: `LambdaLimits` (the platform numbers the template obeys, from Lambda's
facts), `sam_template` (the document), what it adds to say which target it was sized for and
the entry's Function URL (`_description`, `FUNCTION_URL_CONFIG`, `_public_url`), then the
per-slice helpers it calls, `lambda_dockerfile`, and last the emitter (`emit`) and the README's
Lambda part (`guide`). A plan made for another target, or a cut over shm, is refused: the sizes
and transports in ``template.yaml`` are a Lambda plan's.

Everything here is a pure function over a frozen `Plan`: nothing is decided, only written.
CloudFormation intrinsics use their long JSON form (``{"Ref": ...}``, ``{"Fn::GetAtt": [...]}``)
so the template is plain YAML that `yaml.safe_dump` writes and any YAML reader loads.

The image is built from the bundle root (``DockerContext: .``) with the slice as a build
argument, so ``functions/<slice>/`` holds only what the OpenFaaS build copies into its image.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mopar._text import counted
from mopar.bill import prewarms
from mopar.bundle.function import FunctionSpec
from mopar.bundle.layout import FUNCTIONS_DIR
from mopar.config import CompileConfig
from mopar.emit.functions import chain_mode, check_target
from mopar.emit.readme import Guide, Step, write_readme
from mopar.emit.runtime import write_runtime
from mopar.errors import BundleError, Option
from mopar.facts import Facts
from mopar.plan import Function, Plan
from mopar.runtime.handler import threads_for
from mopar.runtime.transports import handing_on
from mopar.targets.aws_lambda import NAME
from mopar.targets.aws_lambda.chains import MODES
from mopar.targets.aws_lambda.entry import HANDLER
from mopar.targets.aws_lambda.image import RECIPE

__all__ = [
    "DOCKERFILE",
    "FUNCTION_URL_AUTH",
    "LAMBDA_RUNTIME",
    "LambdaLimits",
    "lambda_dockerfile",
    "logical_id",
    "sam_template",
    "emit",
    "guide",
    "write_lambda",
]


@dataclass(frozen=True, kw_only=True)
class LambdaLimits:
    """The Lambda limits a template must stay within.

    Attributes:
        min_mb: smallest function memory, MB (``platforms.json``).
        max_mb: largest function memory, MB (``platforms.json``).
        max_timeout_s: longest function timeout, s (Lambda quota: 15 minutes).
        min_timeout_s: the timeout given to a slice however fast it is predicted, s; covers
            a cold start's model load and a slow handoff.
        timeout_factor: headroom over the predicted time, a multiplier.
        min_ephemeral_mb: ``/tmp`` size Lambda gives for free, MB.
        max_ephemeral_mb: largest ``/tmp``, MB.
    """

    min_mb: int = 128
    max_mb: int = 10240
    max_timeout_s: int = 900
    min_timeout_s: int = 30
    timeout_factor: float = 10.0
    min_ephemeral_mb: int = 512
    max_ephemeral_mb: int = 10240

    @classmethod
    def of(cls, facts: Facts) -> LambdaLimits:
        """The limits in Lambda's facts (its ``platforms.json`` entry, ``facts.targets``); the
        defaults where it has none."""
        entry = facts.targets.get(NAME)
        if entry is None:
            return cls()
        memory = entry["memory_mb"]
        return cls(min_mb=int(memory["min"]), max_mb=int(memory["max"]))


PRE_WARM = {
    "Type": "String",
    "Default": "true",
    "AllowedValues": ["true", "false"],
    "Description": "true: at a cold start the entry function warms up the functions its "
    "function.json names (prewarms) with Event invokes, so their INITs overlap its own (the "
    "bill assumes it); false: each starts when the request reaches it",
}
"""The template's ``PreWarm`` parameter, where the entry warms up any function."""

LAMBDA_ENDPOINT = {
    "Type": "String",
    "Default": "",
    "Description": "the Lambda API each function invokes the next through "
    "(AWS_ENDPOINT_URL_LAMBDA): empty for AWS's own; for a local run, sam local "
    "start-lambda's as its containers reach it (e.g. http://10.88.0.1:3001 on podman's bridge)",
}
"""The template's ``LambdaEndpoint`` parameter: where a function's invokes go."""

BUILD_PARAMETERS = {
    "BaseImage": {
        "Type": "String",
        "Default": "python:3.11-slim",
        "Description": "sam build only: the image Dockerfile.lambda starts from (any "
        "Debian-like image with python3 and its venv module)",
    },
    "PipOffline": {
        "Type": "String",
        "Default": "false",
        "AllowedValues": ["true", "false"],
        "Description": "sam build only: true installs the images' Python packages from the "
        "wheels in template/mopar-onnx/wheels alone, reaching no index",
    },
}
"""The template's parameters of ``sam build`` (``DockerBuildArgs``): unused by a deploy."""

STATE_MACHINE = "Pipeline"
"""Logical id of the optional Step Functions state machine (parameter ``Chain``)."""

DOCKERFILE = RECIPE.dockerfile
"""The Lambda image's Dockerfile, at the bundle root (an OpenFaaS build never reads it)."""

_MB = 1024 * 1024


def logical_id(model: str, slice_name: str) -> str:
    """A CloudFormation logical id, alphanumeric CamelCase.

    ``resnet50``, ``s0`` -> ``Resnet50S0``; one starting with a digit gets an ``Fn`` prefix.
    """
    words = re.split(r"[^A-Za-z0-9]+", f"{model} {slice_name}")
    text = "".join(w[:1].upper() + w[1:] for w in words if w)
    return text if text[:1].isalpha() else f"Fn{text}"


def sam_template(
    plan: Plan,
    *,
    arch: str = "x86_64",
    limits: LambdaLimits = LambdaLimits(),
    redis_url: str = "",
    prewarms: Sequence[str] = (),
) -> dict[str, Any]:
    """The SAM template of ``plan``: one image function per slice, each invoking the next.

    Args:
        plan: the bundle's plan.
        arch: the default of the ``Architecture`` parameter (``x86_64`` or ``arm64``).
        limits: the Lambda limits memory, timeout and ``/tmp`` are clamped to.
        redis_url: the default of the ``RedisUrl`` parameter (empty: given at deploy time).
        prewarms: the functions the entry warms up at a cold start (`mopar.bill.prewarms`,
            as its ``function.json`` names them).
    """
    check_target(plan, NAME)  # its sizes and transports are Lambda's alone
    _check_transports(plan)
    mode = chain_mode(plan, NAME, MODES)
    ids = {f.name: logical_id(plan.model, f.name) for f in plan.functions}
    # a function on the path invokes the next and waits for the rest of the path: its timeout
    # covers it; a called function answers its caller, whose predicted time includes the wait
    waits = {f.name: _timeout_s(f.time_ms, limits) for f in plan.functions}
    path = [f.name for f in plan.path()]
    rest = 0
    for name in reversed(path):
        rest += waits[name]
        waits[name] = min(rest, limits.max_timeout_s)
    after = dict(zip(path, path[1:]))
    chain_warm = [ids[name] for name in prewarms]
    resources = {
        ids[f.name]: _function(
            plan,
            f,
            ids[after[f.name]] if f.name in after else None,
            [ids[c.name] for c in plan.callees(f.name)],
            limits,
            waits[f.name],
            [ids[w.name] for w in plan.prewarms(f.name)],
            chain_warm if f.name == path[0] else [],
        )
        for f in plan.functions
    }
    resources[ids[path[0]]]["Properties"]["FunctionUrlConfig"] = FUNCTION_URL_CONFIG
    return {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Transform": "AWS::Serverless-2016-10-31",
        "Description": _description(plan, arch),
        "Parameters": {
            "Architecture": {
                "Type": "String",
                "Default": arch,
                "AllowedValues": ["x86_64", "arm64"],
                "Description": "CPU architecture of every function image",
            },
            "RedisUrl": {
                "Type": "String",
                "Default": redis_url,
                "Description": "redis:// URL (e.g. ElastiCache) for handoffs over the "
                "invoke limits, for Chain=stepfunctions, and the answers' rendezvous of "
                "Chain=event (required there)",
            },
            "Chain": {
                "Type": "String",
                "Default": mode.name,
                "AllowedValues": [m.name for m in MODES],
                "Description": "invoke: each function invokes the next and waits; "
                "stepfunctions: a state machine calls them in turn; event: each hands on "
                "with an Event invoke and the last leaves the answer in Redis (RedisUrl)",
            },
            **({"PreWarm": PRE_WARM} if chain_warm else {}),
            "LambdaEndpoint": LAMBDA_ENDPOINT,
            **BUILD_PARAMETERS,
            FUNCTION_URL_AUTH: FUNCTION_URL_PARAMETER,
        },
        "Rules": {
            "EventChainNeedsRedis": {
                "RuleCondition": {"Fn::Equals": [{"Ref": "Chain"}, "event"]},
                "Assertions": [
                    {
                        "Assert": {"Fn::Not": [{"Fn::Equals": [{"Ref": "RedisUrl"}, ""]}]},
                        "AssertDescription": "Chain=event delivers each answer through "
                        "Redis: set RedisUrl",
                    }
                ],
            }
        },
        "Conditions": {
            "UseStepFunctions": {"Fn::Equals": [{"Ref": "Chain"}, "stepfunctions"]},
            **({"PreWarmOn": {"Fn::Equals": [{"Ref": "PreWarm"}, "true"]}} if chain_warm else {}),
            PUBLIC_URL: {"Fn::Equals": [{"Ref": FUNCTION_URL_AUTH}, "NONE"]},
        },
        "Globals": {
            "Function": {
                "Architectures": [{"Ref": "Architecture"}],
                "Environment": {
                    "Variables": {
                        "MOPAR_MODEL": plan.model,
                        "REDIS_URL": {"Ref": "RedisUrl"},
                        "MOPAR_CHAIN": {"Ref": "Chain"},
                        # boto3 reads it; empty (the default) is AWS's own endpoint
                        "AWS_ENDPOINT_URL_LAMBDA": {"Ref": "LambdaEndpoint"},
                    }
                },
            }
        },
        "Resources": {
            **resources,
            STATE_MACHINE: _state_machine(plan, ids),
            **_public_url(ids[path[0]]),
        },
        "Outputs": {
            **{
                f"{fid}Arn": {
                    "Description": f"ARN of function {name}",
                    "Value": {"Fn::GetAtt": [fid, "Arn"]},
                }
                for name, fid in ids.items()
            },
            "EntryFunction": {
                "Description": "invoke this function with the model inputs",
                "Value": {"Ref": ids[path[0]]},
            },
            f"{STATE_MACHINE}Arn": {
                "Condition": "UseStepFunctions",
                "Description": "the state machine (Chain=stepfunctions)",
                "Value": {"Ref": STATE_MACHINE},
            },
            "EntryFunctionUrl": _url_output(ids[path[0]]),
        },
    }


# --- the target it was sized for, and the entry's HTTPS endpoint ----------------------------------


def _check_transports(plan: Plan) -> None:
    """Refuse a cut that needs co-located functions (shm): Lambda has none.

    Raises:
        BundleError: a function hands on by such a transport.
    """
    for f in plan.functions:
        transport = plan.handoff(f.name)
        if handing_on(transport).colocated:
            raise BundleError(
                f"function {f.name!r} of {plan.model!r} hands on by {transport!r}, which needs "
                "co-located functions, and Lambda functions share no folder; re-plan with ",
                Option("target", value=NAME),
            )


def _description(plan: Plan, arch: str) -> str:
    """The template's ``Description``: the model, and that the plan was made for Lambda (its
    memory sizes buy Lambda's CPU share) and for no other target."""
    return (
        f"mopar: {plan.model} in {counted(len(plan.functions), 'function')} ({plan.strategy}), planned "
        f"and sized for AWS Lambda ({arch}): each MemorySize buys the CPU share the plan "
        "priced; another target's bundle is compiled with its own --target"
    )


FUNCTION_URL_AUTH = "FunctionUrlAuthType"
"""The template parameter of the entry's Function URL's auth type."""
FUNCTION_URL_PARAMETER = {
    "Type": "String",
    "Default": "AWS_IAM",
    "AllowedValues": ["AWS_IAM", "NONE"],
    "Description": "who may call the entry function's HTTPS endpoint (Function URL): AWS_IAM, "
    "callers that sign with SigV4 and hold lambda:InvokeFunctionUrl; NONE, anyone (public)",
}
FUNCTION_URL_CONFIG = {"AuthType": {"Ref": FUNCTION_URL_AUTH}, "InvokeMode": "BUFFERED"}
"""The entry's ``FunctionUrlConfig``: an HTTPS endpoint that takes the model's inputs (an HTTP
event: `mopar.runtime.aws`) and answers when the chain has."""


PUBLIC_URL = "PublicFunctionUrl"
"""The condition ``FunctionUrlAuthType`` is ``NONE``."""


def _public_url(entry_id: str) -> dict[str, Any]:
    """The permissions a public URL needs (with `PUBLIC_URL`): anyone may call it, and through
    it invoke the entry. SAM adds them itself only for a literal ``AuthType: NONE``, not for
    one given as a parameter."""

    def permission(action: str, **more: Any) -> dict[str, Any]:
        return {
            "Type": "AWS::Lambda::Permission",
            "Condition": PUBLIC_URL,
            "Properties": {
                "Action": action,
                "FunctionName": {"Ref": entry_id},
                "Principal": "*",
                **more,
            },
        }

    return {
        f"{entry_id}UrlPublicAccess": permission(
            "lambda:InvokeFunctionUrl", FunctionUrlAuthType="NONE"
        ),
        f"{entry_id}UrlPublicInvoke": permission(
            "lambda:InvokeFunction", InvokedViaFunctionUrl=True
        ),
    }


def _url_output(entry_id: str) -> dict[str, Any]:
    """The output naming the entry's URL (SAM names the ``AWS::Lambda::Url`` it makes
    ``<function id>Url``)."""
    return {
        "Description": "the entry function's HTTPS endpoint: POST the model inputs to it",
        "Value": {"Fn::GetAtt": [f"{entry_id}Url", "FunctionUrl"]},
    }


def _state_machine(plan: Plan, ids: dict[str, str]) -> dict[str, Any]:
    """Step Functions, one Task per function on the path, in order (a function calls the
    functions it calls itself); states pass small frames or Redis keys, never large tensors."""
    states = {}
    entries = plan.path()
    for k, s in enumerate(entries):
        fid = ids[s.name]
        state: dict[str, Any] = {
            "Type": "Task",
            "Resource": "arn:aws:states:::lambda:invoke",
            "Parameters": {"FunctionName": f"${{{fid}}}", "Payload.$": "$"},
            "OutputPath": "$.Payload",
            "Retry": [
                {
                    "ErrorEquals": ["Lambda.ServiceException", "Lambda.TooManyRequestsException"],
                    "IntervalSeconds": 1,
                    "MaxAttempts": 3,
                    "BackoffRate": 2,
                }
            ],
        }
        if k + 1 < len(entries):
            state["Next"] = entries[k + 1].name
        else:
            state["End"] = True
        states[s.name] = state
    return {
        "Type": "AWS::Serverless::StateMachine",
        "Condition": "UseStepFunctions",
        "Properties": {
            "Type": "EXPRESS",
            "Definition": {
                "Comment": f"mopar: {plan.model}, keys passed from slice to slice",
                "StartAt": entries[0].name,
                "States": states,
            },
            "DefinitionSubstitutions": {fid: {"Fn::GetAtt": [fid, "Arn"]} for fid in ids.values()},
            "Policies": [
                {"LambdaInvokePolicy": {"FunctionName": {"Ref": fid}}} for fid in ids.values()
            ],
        },
    }


def _function(
    plan: Plan,
    s: Function,
    next_id: str | None,
    calls: list[str],
    limits: LambdaLimits,
    timeout_s: int,
    warm: list[str],
    chain_warm: list[str],
) -> dict[str, Any]:
    props: dict[str, Any] = {
        "PackageType": "Image",
        "MemorySize": min(max(s.memory_mb, limits.min_mb), limits.max_mb),
        "Timeout": timeout_s,
        "EphemeralStorage": {"Size": _ephemeral_mb(s.param_bytes, limits)},
        # an Event invoke that failed already told the rendezvous (Chain=event): no retries
        "EventInvokeConfig": {"MaximumRetryAttempts": 0},
        "Environment": {
            "Variables": {
                "MOPAR_SLICE": s.name,
                "MOPAR_NEXT": {"Ref": next_id} if next_id else "",
                "MOPAR_TRANSPORT": plan.handoff(s.name),
                "MOPAR_INTRA_OP": str(threads_for(s.vcpus)),
            }
        },
    }
    if calls:  # invoked side by side, before the function runs
        props["Environment"]["Variables"]["MOPAR_CALLS"] = {
            "Fn::Join": [",", [{"Ref": f} for f in calls]]
        }
    if warm:  # the next MoE layer's expert functions, pre-warmed when predicted
        props["Environment"]["Variables"]["MOPAR_WARM"] = {
            "Fn::Join": [",", [{"Ref": f} for f in warm]]
        }
    if chain_warm:  # the entry: the chain's other functions, warmed up at its cold start
        props["Environment"]["Variables"]["MOPAR_PREWARM"] = {
            "Fn::If": ["PreWarmOn", {"Fn::Join": [",", [{"Ref": f} for f in chain_warm]]}, ""]
        }
    invoked = list(dict.fromkeys([*calls, *([next_id] if next_id else []), *warm, *chain_warm]))
    if invoked:
        props["Policies"] = [{"LambdaInvokePolicy": {"FunctionName": {"Ref": f}}} for f in invoked]
    return {
        "Type": "AWS::Serverless::Function",
        "Properties": props,
        "Metadata": {
            "Dockerfile": DOCKERFILE,
            "DockerContext": ".",
            "DockerTag": s.name,
            "DockerBuildArgs": {
                "SLICE": s.name,
                "BASE_IMAGE": {"Ref": "BaseImage"},
                "PIP_OFFLINE": {"Ref": "PipOffline"},
            },
        },
    }


def _timeout_s(time_ms: float, limits: LambdaLimits) -> int:
    """Generous: ``timeout_factor`` x the predicted time, at least ``min_timeout_s``, seconds."""
    wanted = math.ceil(limits.timeout_factor * time_ms / 1000.0)
    return min(max(wanted, limits.min_timeout_s), limits.max_timeout_s)


def _ephemeral_mb(param_bytes: int, limits: LambdaLimits) -> int:
    """``/tmp`` room for twice the slice's weights (an unpacked copy), at least the free 512 MB."""
    wanted = math.ceil(2 * param_bytes / _MB)
    return min(max(wanted, limits.min_ephemeral_mb), limits.max_ephemeral_mb)


LAMBDA_RUNTIME = ("awslambdaric==4.2.2", "boto3==1.44.8")
"""What a Lambda image installs beside the slice's requirements: the runtime interface client,
and boto3 to invoke the next function. Pinned, so a new release never changes an image."""


def lambda_dockerfile(*, python: str = "3.11") -> str:
    """The Dockerfile every slice's Lambda image is built from (build argument ``SLICE``).

    Two stages, so that it builds the same under any builder (Docker's classic one, which
    ``sam build`` drives through Docker's API, BuildKit, podman's): ``install`` makes
    ``/opt/venv`` on a slim Python base (``BASE_IMAGE``: any Debian-like image with python3 and
    its venv module) from `LAMBDA_RUNTIME`, the template's pinned requirements and what the
    slice's own ``requirements.txt`` adds (``tokenizers``, for a main function that reads text),
    with the template's ``install.sh``; with ``PIP_OFFLINE=true`` pip installs from the wheels
    in ``template/mopar-onnx/wheels`` alone (copied into that stage only, so no wheel reaches
    the image). The image itself is the base, that venv, the torch-free runtime the bundle
    ships (``template/mopar-onnx/mopar``) and the slice's folder, all root-owned and readable
    by anyone; the handler is `mopar.targets.aws_lambda.entry.HANDLER`
    (``mopar.runtime.aws.lambda_handler``).

    It sets no ``USER``: Lambda runs an image as a least-privileged user of its own, whatever
    the image says, on a read-only file system but ``/tmp``; and the layer ``sam local`` adds
    for the emulator must be built as root (its ``RUN mv`` fails under a non-root ``USER``).
    The tests run each image as a non-root user on a read-only root, as Lambda does.
    """
    install = f"sh /tmp/mopar/install.sh -r /tmp/mopar/requirements.txt {' '.join(LAMBDA_RUNTIME)}"
    lines = [
        "# mopar: the Lambda image of one slice. Build context: the bundle root.",
        "# sam build passes SLICE, BASE_IMAGE and PIP_OFFLINE (template.yaml, Metadata).",
        f"ARG BASE_IMAGE=python:{python}-slim",
        "FROM ${BASE_IMAGE} AS install",
        "ARG PIP_OFFLINE=false",
        "ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1",
        "COPY template/mopar-onnx/requirements.txt template/mopar-onnx/install.sh /tmp/mopar/",
        "COPY template/mopar-onnx/wheels/ /tmp/wheels/",  # this stage only: in no layer shipped
        f"RUN {install}",
        "ARG SLICE",  # after the install: every slice's image shares its layers
        "COPY functions/${SLICE}/requirements.txt /tmp/mopar/slice-requirements.txt",
        # what this slice needs beyond the template's (a main function's tokenizers)
        "RUN sh /tmp/mopar/install.sh -r /tmp/mopar/slice-requirements.txt",
        "",
        "FROM ${BASE_IMAGE}",
        "ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MOPAR_FUNCTION_DIR=/function/slice "
        "PATH=/opt/venv/bin:$PATH MALLOC_ARENA_MAX=1",  # one heap: see the template's
        "WORKDIR /function",
        "COPY --from=install /opt/venv /opt/venv",
        "COPY template/mopar-onnx/mopar ./mopar",
        "ARG SLICE",
        "COPY functions/${SLICE}/ ./slice/",
        # no USER: Lambda runs the image as its own least-privileged user (see above)
        'ENTRYPOINT ["python", "-m", "awslambdaric"]',
        f'CMD ["{HANDLER}"]',
    ]
    return "\n".join(lines) + "\n"


def write_lambda(
    bundle: Path,
    plan: Plan,
    *,
    arch: str,
    limits: LambdaLimits,
    redis_url: str = "",
    prewarms: Sequence[str] = (),
) -> None:
    """Write ``template.yaml`` and ``Dockerfile.lambda`` at the root of ``bundle``."""
    doc = sam_template(plan, arch=arch, limits=limits, redis_url=redis_url, prewarms=prewarms)
    (bundle / "template.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (bundle / DOCKERFILE).write_text(lambda_dockerfile())


def emit(bundle: Path, plan: Plan, *, config: CompileConfig, facts: Facts) -> None:
    """The ``lambda`` target's emitter (`mopar.facts.Emitter`): the runtime its images copy
    (`mopar.emit.runtime.write_runtime`), `write_lambda` within the limits of Lambda's facts
    (`LambdaLimits.of`), with the compile's ``arch`` and ``redis_url``, and the README
    (`guide`). (``sam deploy`` names the images' ECR repositories: ``image_prefix`` is
    OpenFaaS's.)"""
    entry = FunctionSpec.load(Path(bundle) / FUNCTIONS_DIR / plan.path()[0].name)
    write_runtime(bundle)
    write_lambda(
        bundle,
        plan,
        arch=config.arch,
        limits=LambdaLimits.of(facts),
        redis_url=config.redis_url,
        prewarms=prewarms(plan, facts.platform),  # as the entry's function.json names them
    )
    inputs = [t.name for t in entry.receives]
    write_readme(bundle, plan, guide(plan, redis_url=config.redis_url), inputs=inputs)


# --- README.md: what deploying needs, and the commands -------------------------------------------


def guide(plan: Plan, *, redis_url: str = "") -> Guide:
    """The Lambda part of the bundle's README (`mopar.emit.readme`): SAM CLI's commands, the
    entry's Function URL, and what the plan needs (a Redis where a cut or the chain mode uses
    one)."""
    mode = chain_mode(plan, NAME, MODES)
    entry = logical_id(plan.model, plan.path()[0].name)
    stack = re.sub(r"[^A-Za-z0-9-]+", "-", f"mopar-{plan.model}").strip("-")[:128]
    handoffs = [plan.handoff(f.name) for f in plan.functions] + [plan.answer]
    redis = any(handing_on(t).needs_redis for t in handoffs) or bool(mode.rendezvous)
    overrides = " --parameter-overrides RedisUrl=redis://HOST:6379/0" if redis else ""
    needs = [
        "AWS SAM CLI, and Docker or podman (podman: its socket as `DOCKER_HOST`) to build "
        "the images (`Dockerfile.lambda`, one per function, `SLICE` its build argument);",
        "an AWS account and credentials: `sam deploy` pushes the images to ECR "
        "(`--resolve-image-repos`) and creates each function's role (`CAPABILITY_IAM`);",
        f"callers of the entry's Function URL (`{FUNCTION_URL_AUTH}`, default `AWS_IAM`) "
        "sign with SigV4 and need `lambda:InvokeFunctionUrl`; `NONE` makes it public;",
    ]
    if redis:
        given = f" (compiled with `{redis_url}`)" if redis_url else ""
        needs.append(
            "a Redis the functions reach (ElastiCache): the plan hands over or answers through "
            f"it; set the `RedisUrl` parameter{given}."
        )
    return Guide(
        platform="AWS Lambda",
        files=(
            (
                "template.yaml",
                "the AWS SAM template: one image function per function, sized by "
                "the plan for Lambda, the entry with an HTTPS endpoint (Function URL)",
            ),
            (DOCKERFILE, "the image of every function (`sam build` passes `SLICE`)"),
        ),
        needs=tuple(needs),
        deploy=(
            Step(command="sam validate --lint", does="check the template"),
            Step(command="sam build", does="one image per function"),
            Step(command="sam deploy --guided", does="the first time: asks, then saves"),
            Step(
                command=f"sam deploy --stack-name {stack} --resolve-image-repos "
                f"--capabilities CAPABILITY_IAM{overrides}",
                does="or all at once",
            ),
            Step(
                command=f"sam list stack-outputs --stack-name {stack}",
                does="EntryFunctionUrl, the endpoint",
            ),
        ),
        call=(
            Step(
                command='curl -s "$URL" --aws-sigv4 "aws:amz:$AWS_REGION:lambda" '
                '--user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" '
                '-H "x-amz-security-token: $AWS_SESSION_TOKEN" '
                "-H 'Content-Type: application/json' -H 'Accept: application/json' "
                "--data @request.json",
                does="AWS_IAM (URL: EntryFunctionUrl)",
            ),
            Step(
                command='mopar invoke "$URL" --input reference.npz',
                does=f"{FUNCTION_URL_AUTH}=NONE",
            ),
            Step(
                command=f"aws lambda invoke --function-name <{entry} from the stack> "
                "--cli-binary-format raw-in-base64-out --payload file://request.json out.json",
                does="the entry itself, its JSON event",
            ),
        ),
        notes=(
            f"Chain mode `{mode.name}` (template parameter `Chain`); every function's "
            "`MemorySize` is the plan's, which buys the CPU share the plan was priced with.",
        ),
    )
