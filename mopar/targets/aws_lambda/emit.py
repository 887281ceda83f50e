"""``template.yaml`` (AWS SAM) and ``Dockerfile.lambda``: one container Lambda per slice.

Read in this order: `LambdaLimits` (the platform numbers the template obeys, from Lambda's
facts), `sam_template` (the document), then the per-slice helpers
it calls, then `lambda_dockerfile`.

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

from mopar.bill import prewarms
from mopar.config import CompileConfig
from mopar.emit.functions import chain_mode
from mopar.facts import Facts
from mopar.plan import Function, Plan
from mopar.runtime.handler import threads_for
from mopar.targets.aws_lambda import NAME
from mopar.targets.aws_lambda.chains import MODES
from mopar.targets.aws_lambda.entry import HANDLER
from mopar.targets.aws_lambda.image import RECIPE

__all__ = [
    "DOCKERFILE",
    "LAMBDA_RUNTIME",
    "LambdaLimits",
    "lambda_dockerfile",
    "logical_id",
    "sam_template",
    "emit",
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
    return {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Transform": "AWS::Serverless-2016-10-31",
        "Description": f"mopar: {plan.model} in {len(plan.functions)} functions ({plan.strategy})",
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
        "Resources": {**resources, STATE_MACHINE: _state_machine(plan, ids)},
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
        },
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
    """The ``lambda`` target's emitter (`mopar.facts.Emitter`): `write_lambda` within the
    limits of Lambda's facts (`LambdaLimits.of`), with the compile's ``arch`` and ``redis_url``. (``sam deploy``
    names the images' ECR repositories: ``image_prefix`` is OpenFaaS's.)"""
    write_lambda(
        bundle,
        plan,
        arch=config.arch,
        limits=LambdaLimits.of(facts),
        redis_url=config.redis_url,
        prewarms=prewarms(plan, facts.platform),  # as the entry's function.json names them
    )
