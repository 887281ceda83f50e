"""OpenFaaS artefacts of a bundle: ``stack.yml``, the ``mopar-onnx`` template, and ``k8s/``.

Read in this order: the names (`dns1123`, `function_names`), the per-function pieces
(`Timeouts`, `next_urls`, `shm_functions`), the stack document (`stack`), the
co-location objects for shm cuts (`profile`, `shm_patch`, `apply_script`), then
`write_openfaas`, which writes all of them with the template and the runtime copy
(`mopar.emit.runtime`), and last the emitter (`emit`), its `stack_header` and the README's
OpenFaaS part (`guide`). A plan made for another target is refused
(`mopar.emit.functions.check_target`): the sizes in ``stack.yml`` are its plan's.

``stack.yml`` follows the stack schema of ``openfaas/go-sdk`` (``stack/schema.go``). Everything
here but `write_openfaas` is a pure function over a frozen `Plan`:
nothing is decided, only written.

How a request flows: the client calls the first function; each function runs its slice and
POSTs its frame to the next one (``MOPAR_NEXT``), waiting for its answer, so a function's timeout
covers the rest of the chain.

The next hop is reached through the gateway inside the cluster
(``http://gateway.openfaas:8080/function/<next>``), which keeps OpenFaaS's metrics and
scaling, except across an shm cut: there the sender calls the next function's Kubernetes service
directly (``http://<next>.openfaas-fn:8080``), a hop shorter: the tensor itself does not travel
over HTTP there, only a file name. docs/deploy-openfaas.md gives the trade-offs.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mopar._text import counted
from mopar.bundle.function import FunctionSpec
from mopar.bundle.layout import FUNCTIONS_DIR
from mopar.config import DEFAULT_GATEWAY
from mopar.emit.functions import chain_mode, check_target
from mopar.emit.readme import Guide, Step, write_readme
from mopar.emit.runtime import TEMPLATE_DIR, TEMPLATE_LANG, write_runtime
from mopar.errors import BundleError, Option
from mopar.plan import Function, Plan
from mopar.runtime.chains import ChainMode
from mopar.runtime.handler import threads_for
from mopar.runtime.transports import inline, names, shared, transport_named
from mopar.targets.openfaas import NAME
from mopar.targets.openfaas.chains import MODES

if TYPE_CHECKING:
    from mopar.config import CompileConfig
    from mopar.facts import Facts

__all__ = [
    "DEFAULT_GATEWAY",
    "FUNCTION_NAMESPACE",
    "IN_CLUSTER_GATEWAY",
    "SHM_DIR",
    "emit",
    "guide",
    "stack_header",
    "Timeouts",
    "apply_script",
    "dns1123",
    "function_names",
    "next_urls",
    "call_urls",
    "profile",
    "profile_name",
    "shm_functions",
    "shm_patch",
    "stack",
    "write_openfaas",
]

IN_CLUSTER_GATEWAY = "http://gateway.openfaas:8080"
"""The gateway as functions reach it from inside the cluster."""
FUNCTION_NAMESPACE = "openfaas-fn"
OPENFAAS_NAMESPACE = "openfaas"
"""Where OpenFaaS (and its Profiles) live."""
SHM_DIR = "/dev/shm/mopar"
"""The tmpfs folder shm cuts hand frames through: a hostPath on the node, the same path inside."""
_SHM_VOLUME = "mopar-shm"
_PERMS_IMAGE = "busybox:1.36.1"


# --- names ---------------------------------------------------------------------------------------


def dns1123(text: str, *, max_len: int = 63) -> str:
    """Lower-case ``text`` into a DNS-1123 label: [a-z0-9-], alphanumeric at both ends."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    label = re.sub(r"-{2,}", "-", label)[:max_len].strip("-")
    return label or "model"


def function_names(plan: Plan) -> list[str]:
    """The OpenFaaS name of each function: ``<model>-<function>``, DNS-1123, <= 63 chars."""
    suffixes = [f"-{dns1123(f.name)}" for f in plan.functions]
    base = dns1123(plan.model, max_len=63 - max(len(x) for x in suffixes))
    return [base + x for x in suffixes]


def profile_name(plan: Plan) -> str:
    """The OpenFaaS Profile that co-locates the shm functions of ``plan``: ``<model>-colocate``."""
    suffix = "-colocate"
    return dns1123(plan.model, max_len=63 - len(suffix)) + suffix


# --- per-function pieces -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long each function may take, from the plan's predicted times.

    A function on the request path waits for the next one's answer, so its budget covers its
    own time and the rest of the path after it: ``budget_i = max(min_s, ceil(factor *
    time_ms_i / 1000)) + budget_next``, seconds. A called function's budget is its own (its
    caller's predicted time already includes the wait).

    Attributes:
        min_s: the budget of one slice however fast it is predicted, s; covers a cold start's
            model load and a slow handoff.
        factor: headroom over a slice's predicted time, a multiplier.
        margin_s: how much longer the watchdog's HTTP read and write timeouts are than its
            ``exec_timeout``, s, so an answer that arrives in time can still be written.
    """

    min_s: int = 30
    factor: float = 10.0
    margin_s: int = 5

    def own_s(self, f: Function) -> int:
        return max(self.min_s, math.ceil(self.factor * f.time_ms / 1000.0))

    def budgets_s(self, plan: Plan, *, waits: bool = True) -> dict[str, int]:
        """Each function's ``exec_timeout``, seconds, by name. With ``waits`` False (a chain
        mode where no function waits for the next: ``callback``), only the entry, which may
        wait for the answer (its facade), covers the rest of the path."""
        out = {f.name: self.own_s(f) for f in plan.functions}
        rest = 0
        path = plan.path()
        for f in reversed(path):
            rest += out[f.name]
            if waits or f is path[0]:
                out[f.name] = rest
        return out


def _transports(plan: Plan) -> list[str]:
    """How each function hands on its outputs; ``""`` for the last on the path (it answers the
    client).

    A cut the plan left unset is the inline transport (``http``): it works wherever the
    functions run. In the ``shm`` chain mode (the co-located pipeline) every cut is the shared
    folder's transport; in the ``callback`` mode none is (the queue between sees no folder).

    Raises:
        BundleError: a cut names a transport OpenFaaS functions do not have.
    """
    last = plan.path()[-1].name
    mode = _mode(plan)
    out = []
    for f in plan.functions:
        transport = "" if f.name == last else plan.handoff(f.name) or inline().name
        if transport and mode.name == shared().name:
            transport = shared().name
        elif transport in names() and mode.rendezvous and transport_named(transport).colocated:
            transport = inline().name  # a queued call reaches no shared folder
        if transport and transport not in names():
            raise BundleError(
                f"function {f.name!r} of {plan.model!r} hands on by {transport!r}, expected one "
                f"of {list(names())} for an OpenFaaS function; re-plan with ",
                Option("target", value=NAME),
            )
        out.append(transport)
    return out


def _mode(plan: Plan) -> ChainMode:
    """The chain mode the stack deploys (`mopar.emit.functions.chain_mode`)."""
    return chain_mode(plan, NAME, MODES)


def next_urls(plan: Plan) -> list[str]:
    """Each function's ``MOPAR_NEXT``: the in-cluster URL of the next function on the path,
    ``""`` for the last and for called functions (they answer their caller).

    Through the gateway, except across an shm cut, where it is the next function's service
    (see the module docstring); in the ``callback`` mode, the gateway's queue
    (``/async-function/<next>``).
    """
    names = dict(zip((f.name for f in plan.functions), function_names(plan)))
    transports = dict(zip(names, _transports(plan)))
    path = [f.name for f in plan.path()]
    after = dict(zip(path, path[1:]))
    queued = bool(_mode(plan).rendezvous)
    return [
        _url(names[after[n]], transports[n], queued=queued) if n in after else "" for n in names
    ]


def call_urls(plan: Plan, of: Callable[[str], tuple[Function, ...]] | None = None) -> list[str]:
    """Each function's ``MOPAR_CALLS``: the URLs of the functions it calls, comma-separated;
    else ``""``. With ``of=plan.prewarms``, its ``MOPAR_WARM``: those it may pre-warm."""
    names = dict(zip((f.name for f in plan.functions), function_names(plan)))
    transports = dict(zip(names, _transports(plan)))
    of = of or plan.callees
    return [",".join(_url(names[c.name], transports[c.name]) for c in of(n)) for n in names]


def _colocated(transport: str) -> bool:
    """Whether ``transport`` (``""``: none) hands over through a folder shared on the node."""
    return bool(transport) and transport_named(transport).colocated


def _url(name: str, transport: str, *, queued: bool = False) -> str:
    if _colocated(transport):
        return f"http://{name}.{FUNCTION_NAMESPACE}:8080"
    route = "async-function" if queued else "function"
    return f"{IN_CLUSTER_GATEWAY}/{route}/{name}"


def shm_functions(plan: Plan) -> list[str]:
    """The functions on either side of an shm handoff, in plan order: those that share the
    tmpfs. A function on the path hands its frame to the next one; a called one answers its
    caller."""
    order = [f.name for f in plan.functions]
    path = [f.name for f in plan.path()]
    after = dict(zip(path, path[1:]))
    members: set[str] = set()
    for f, transport in zip(plan.functions, _transports(plan)):
        if _colocated(transport):
            receiver = plan.caller(f.name).name if f.spec.called else after[f.name]
            members.update((f.name, receiver))
    names = function_names(plan)
    return [names[k] for k, n in enumerate(order) if n in members]


# --- stack.yml -----------------------------------------------------------------------------------


def stack(
    plan: Plan,
    *,
    gateway: str = DEFAULT_GATEWAY,
    redis_url: str = "",
    image_prefix: str = "",
    timeouts: Timeouts = Timeouts(),
) -> dict[str, Any]:
    """The faas-cli stack of ``plan``: one function per slice, built from the bundled template.

    Args:
        plan: the bundle's plan.
        gateway: ``provider.gateway``, the gateway URL faas-cli talks to.
        redis_url: ``REDIS_URL`` of every function (``redis://host:port/db``) when a cut uses
            Redis (empty there: set it at deploy time), or when given.
        image_prefix: the registry and namespace of the images, e.g.
            ``registry.example.com/team``: ``<prefix>/<function>:latest``; empty: local images
            (``<function>:latest``).
        timeouts: how each function's watchdog timeouts follow from the plan.
    """
    check_target(plan, NAME)  # its memory and CPU are OpenFaaS's alone
    mode = _mode(plan)
    names = function_names(plan)
    transports = _transports(plan)
    urls = next_urls(plan)
    calls, warm = call_urls(plan), call_urls(plan, plan.prewarms)
    budgets = timeouts.budgets_s(plan, waits=not mode.rendezvous)
    rest = timeouts.budgets_s(plan)  # how long the rest of the path may take after each
    path = [f.name for f in plan.path()]
    after = dict(zip(path, path[1:]))
    colocated = set(shm_functions(plan))
    any_redis = any(transport_named(t).needs_redis for t in transports if t)
    prefix = f"{image_prefix.removesuffix('/')}/" if image_prefix else ""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    functions: dict[str, Any] = {}
    for i, (name, s) in enumerate(zip(names, plan.functions)):
        environment = {
            "MOPAR_SLICE": s.name,
            "MOPAR_NEXT": urls[i],
            "MOPAR_TRANSPORT": transports[i],
            "MOPAR_CHAIN": mode.name,
        }
        if s.vcpus > 0:  # onnxruntime's threads follow the CPU it is limited to
            environment["MOPAR_INTRA_OP"] = str(threads_for(s.vcpus))
        if mode.rendezvous and s.name == path[0]:
            # its facade's answers reach it at this pod's IP, through the of-watchdog's port
            environment["MOPAR_CALLBACK_PORT"] = "8080"
        if calls[i]:
            environment["MOPAR_CALLS"] = calls[i]
        if warm[i]:
            environment["MOPAR_WARM"] = warm[i]
        waits = [rest[after[s.name]]] if s.name in after else []
        waits += [budgets[c.name] for c in plan.callees(s.name)]
        if waits:
            # How long to wait for an answer: the rest of the path's, or a called one's, budget.
            environment["MOPAR_TIMEOUT_S"] = str(max(waits))
        if name in colocated:
            environment["MOPAR_SHM_DIR"] = SHM_DIR
        if any_redis or redis_url:
            environment["REDIS_URL"] = redis_url
        # of-watchdog: how long this slice and the rest of the chain may take.
        environment["exec_timeout"] = f"{budgets[s.name]}s"
        environment["read_timeout"] = environment["write_timeout"] = (
            f"{budgets[s.name] + timeouts.margin_s}s"
        )
        functions[name] = {
            "lang": TEMPLATE_LANG,
            "handler": f"./functions/{s.name}",
            "image": f"{prefix}{name}:latest",
            "labels": {**_labels(plan, i, transports[i]), "com.mopar.chain": mode.name},
            "annotations": {
                **_annotations(
                    plan, s, i, transports[i], profile_name(plan) if name in colocated else ""
                ),
                "com.mopar.chain": mode.name,
            },
            "environment": environment,
            "limits": _resources(s),
            "requests": _resources(s),
            "build_args": {"TEST_ENABLED": "false", "PYTHON_VERSION": python},
        }
    return {
        "version": 1.0,
        "provider": {"name": "openfaas", "gateway": gateway},
        "configuration": {"templates": [{"name": TEMPLATE_LANG, "source": f"./{TEMPLATE_DIR}"}]},
        "functions": functions,
    }


def _labels(plan: Plan, index: int, transport: str) -> dict[str, str]:
    # Label values are Kubernetes label values: <= 63 chars of [A-Za-z0-9_.-].
    return {
        "com.mopar.model": dns1123(plan.model),
        "com.mopar.slice": str(index),
        "com.mopar.transport": transport or "response",
    }


def _annotations(
    plan: Plan, s: Function, index: int, transport: str, profile_ref: str
) -> dict[str, str]:
    notes = {
        "com.mopar.model": plan.model,
        "com.mopar.slice": s.name,
        "com.mopar.slice-index": str(index),
        "com.mopar.transport": transport or "response",
        "com.mopar.layers": f"{s.layers[0]} .. {s.layers[-1]}" if s.layers else "",
        "com.mopar.param-bytes": str(s.param_bytes),
        "com.mopar.predicted-ms": f"{s.time_ms:.3f}",
    }
    if profile_ref:
        # OpenFaaS Standard/Enterprise apply this Profile (k8s/profile.yaml) to the Deployment.
        notes["com.openfaas.profile"] = profile_ref
    return notes


def _resources(s: Function) -> dict[str, str]:
    """Kubernetes quantities: its memory, and its CPU in millicores (``"1500m"``) where the
    plan sets one."""
    res = {"memory": f"{s.memory_mb}Mi"}
    if s.vcpus > 0:
        res["cpu"] = f"{max(1, round(s.vcpus * 1000))}m"
    return res


# --- co-location for shm: k8s/ -------------------------------------------------------------------


def profile(plan: Plan) -> dict[str, Any] | None:
    """The OpenFaaS Profile (Standard/Enterprise) that prefers one node for the shm functions.

    Each annotated function's pods prefer nodes already running a pod of any of the model's shm
    functions (``faas_function`` is the label OpenFaaS gives every function pod). Preferred,
    not required: a function still schedules when the node is full, and its sender then falls
    back to HTTP. None when no cut uses shm.
    """
    members = shm_functions(plan)
    if not members:
        return None
    term = {
        "labelSelector": {
            "matchExpressions": [{"key": "faas_function", "operator": "In", "values": members}]
        },
        "topologyKey": "kubernetes.io/hostname",
    }
    return {
        "apiVersion": "openfaas.com/v1",
        "kind": "Profile",
        "metadata": {
            "name": profile_name(plan),
            "namespace": OPENFAAS_NAMESPACE,
            "labels": {"com.mopar.model": dns1123(plan.model)},
        },
        "spec": {
            "affinity": {
                "podAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "podAffinityTerm": term}
                    ]
                }
            }
        },
    }


def shm_patch(function: str) -> dict[str, Any]:
    """A strategic-merge patch that mounts the node's ``SHM_DIR`` into ``function``'s container.

    For ``kubectl patch deployment -n openfaas-fn <function> --patch-file ...``: a hostPath
    volume (``DirectoryOrCreate``), mounted at the same path in the function container (whose
    name is the function's), and an init container that opens the folder to the function's
    non-root user (the kubelet creates it root-owned, mode 0755).
    """

    def mount() -> dict[str, str]:  # a fresh dict each time: PyYAML would write an anchor
        return {"name": _SHM_VOLUME, "mountPath": SHM_DIR}

    return {
        "spec": {
            "template": {
                "spec": {
                    "volumes": [
                        {
                            "name": _SHM_VOLUME,
                            "hostPath": {"path": SHM_DIR, "type": "DirectoryOrCreate"},
                        }
                    ],
                    "initContainers": [
                        {
                            "name": "mopar-shm-perms",
                            "image": _PERMS_IMAGE,
                            "command": ["chmod", "1777", SHM_DIR],
                            "securityContext": {"runAsUser": 0},
                            "volumeMounts": [mount()],
                        }
                    ],
                    "containers": [{"name": function, "volumeMounts": [mount()]}],
                }
            }
        }
    }


def _patch_file(function: str) -> str:
    return f"shm-patch-{function}.yaml"


def apply_script(plan: Plan) -> str:
    """``k8s/apply.sh``: patch the shm functions' Deployments after ``faas-cli deploy``."""
    members = shm_functions(plan)
    lines = [
        "#!/bin/sh",
        f"# mopar: share {SHM_DIR} between the shm functions of {plan.model}.",
        "# See docs/deploy-openfaas.md. Before `faas-cli deploy` (OpenFaaS Standard/Enterprise",
        "# only; the functions name the Profile in com.openfaas.profile):",
        "#   kubectl apply -f k8s/profile.yaml",
        "# After every `faas-cli deploy` (any edition), from the bundle root:",
        "#   sh k8s/apply.sh",
        "set -eu",
        'cd "$(dirname "$0")"',
        f'NS="${{OPENFAAS_FN_NAMESPACE:-{FUNCTION_NAMESPACE}}}"',
    ]
    for fn in members:
        lines.append(
            f'kubectl patch deployment -n "$NS" {shlex.quote(fn)} '
            f"--patch-file {shlex.quote(_patch_file(fn))}"
        )
    for fn in members:
        lines.append(f'kubectl rollout status deployment -n "$NS" {shlex.quote(fn)} --timeout=300s')
    return "\n".join(lines) + "\n"


# --- writing -------------------------------------------------------------------------------------


def write_openfaas(
    bundle: Path,
    plan: Plan,
    *,
    gateway: str = DEFAULT_GATEWAY,
    redis_url: str = "",
    image_prefix: str = "",
    timeouts: Timeouts = Timeouts(),
) -> None:
    """Write the OpenFaaS side of ``bundle``: all faas-cli needs but base images.

    - ``stack.yml`` (`stack`, as YAML);
    - ``template/mopar-onnx/``: the template, its ``requirements.txt`` pinned to the versions
      installed here, and ``mopar/``, the runtime's copy;
    - ``k8s/`` when a cut uses shm: ``profile.yaml``, ``shm-patch-<function>.yaml``, ``apply.sh``.

    The handler folders (``functions/<slice>/``) must already be written.

    Raises:
        BundleError: the template source is missing (`template_source`).
    """
    bundle = Path(bundle)
    write_runtime(bundle)
    doc = stack(
        plan, gateway=gateway, redis_url=redis_url, image_prefix=image_prefix, timeouts=timeouts
    )
    (bundle / "stack.yml").write_text(stack_header(plan) + yaml.safe_dump(doc, sort_keys=False))
    _write_k8s(bundle / "k8s", plan)


def emit(bundle: Path, plan: Plan, *, config: CompileConfig, facts: Facts) -> None:
    """The ``openfaas`` target's emitter (`mopar.facts.Emitter`): `write_openfaas` with the
    compile's ``gateway``, ``redis_url`` and ``image_prefix`` (OpenFaaS images are built for
    the cluster's architecture, not ``config.arch``), and the README (`guide`)."""
    write_openfaas(
        bundle,
        plan,
        gateway=config.gateway,
        redis_url=config.redis_url,
        image_prefix=config.image_prefix,
    )
    entry = FunctionSpec.load(Path(bundle) / FUNCTIONS_DIR / plan.path()[0].name)
    made = guide(plan, image_prefix=config.image_prefix, redis_url=config.redis_url)
    write_readme(bundle, plan, made, inputs=[t.name for t in entry.receives])


def stack_header(plan: Plan) -> str:
    """The comment ``stack.yml`` starts with: the plan it was sized by, and what it needs."""
    colocated = bool(shm_functions(plan))
    lines = [
        f"mopar: {plan.model} on OpenFaaS, {counted(len(plan.functions), 'function')} in chain mode "
        f"{_mode(plan).name},",
        f"planned and sized for {plan.target}: the memory and cpu below are that plan's.",
        "The bundle holds one target's files; README.md says how to deploy it.",
        "Needs OpenFaaS Standard or Enterprise and k8s/ (co-located functions, --colocate)."
        if colocated
        else "Deploys on OpenFaaS Community Edition as written: faas-cli up -f stack.yml",
    ]
    return "".join(f"# {line}\n" for line in lines)


# --- README.md: what deploying needs, and the commands -------------------------------------------


def guide(plan: Plan, *, image_prefix: str = "", redis_url: str = "") -> Guide:
    """The OpenFaaS part of the bundle's README (`mopar.emit.readme`): faas-cli's commands,
    and what the plan needs: a registry, a Redis where a cut uses one, OpenFaaS Pro and
    kubectl where its functions are co-located (``k8s/``)."""
    names = dict(zip((f.name for f in plan.functions), function_names(plan)))
    entry = names[plan.path()[0].name]
    colocated = bool(shm_functions(plan))
    mode = _mode(plan)
    needs = [
        "faas-cli, logged in to your gateway (`faas-cli login`; `OPENFAAS_URL` or "
        "`--gateway` picks it), and Docker or another builder faas-cli drives;",
        f"a registry your cluster pulls from: the images are `{image_prefix}/<function>:latest`;"
        if image_prefix
        else "a registry your cluster pulls from: the images are named `<function>:latest`, "
        "so compile with `--image-prefix REGISTRY/TEAM` to push them (a kind or k3d cluster "
        "that loads local images needs none: `faas-cli up --skip-push`);",
    ]
    if colocated:
        needs.append(
            "co-located functions (`--colocate`): OpenFaaS Standard or Enterprise for the "
            "Profile, kubectl, and a namespace that admits a hostPath volume and a root init "
            "container (`k8s/`); Community Edition cannot deploy this bundle as written;"
        )
    else:
        needs.append("nothing beyond OpenFaaS Community Edition: no Profile, no volume;")
    if any(transport_named(t).needs_redis for t in _transports(plan) if t):
        given = f" (compiled with `{redis_url}`)" if redis_url else " (fill it in first)"
        needs.append(f"a Redis the functions reach: `REDIS_URL` in `stack.yml`{given};")
    if mode.rendezvous:
        needs.append(
            "the gateway's asynchronous path (NATS and the queue-worker, which the Helm chart "
            "installs by default)."
        )
    deploy = [
        *(
            [Step(command="kubectl apply -f k8s/profile.yaml", does="Pro: once, first")]
            if colocated
            else []
        ),
        Step(command="faas-cli up -f stack.yml", does="build, push and deploy every function"),
        Step(command="faas-cli build -f stack.yml", does="or one step at a time"),
        Step(command="faas-cli push -f stack.yml"),
        Step(command="faas-cli deploy -f stack.yml"),
        *(
            [Step(command="sh k8s/apply.sh", does="after every deploy: the shared tmpfs")]
            if colocated
            else []
        ),
    ]
    url = f'"$OPENFAAS_URL/function/{entry}"'
    files = [
        (
            "stack.yml",
            "faas-cli's stack: one function per function of the plan, its "
            "memory and CPU the plan's",
        )
    ]
    if colocated:
        files.append(("k8s/", "the Profile and hostPath patches that co-locate the functions"))
    return Guide(
        platform="OpenFaaS",
        files=tuple(files),
        needs=tuple(needs),
        deploy=tuple(deploy),
        call=(
            Step(command=f"mopar invoke {url} --input reference.npz", does="the model's answer"),
            Step(
                command=f"curl -s {url} -H 'Content-Type: application/json' "
                "-H 'Accept: application/json' --data @request.json",
                does="the same with curl",
            ),
        ),
        notes=(
            f"Chain mode `{mode.name}`: the entry is `{entry}`, and the functions hand on "
            + ("through a shared tmpfs on one node." if colocated else "through the gateway."),
        ),
    )


def _write_k8s(folder: Path, plan: Plan) -> None:
    doc = profile(plan)
    if doc is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "profile.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for fn in shm_functions(plan):
        (folder / _patch_file(fn)).write_text(yaml.safe_dump(shm_patch(fn), sort_keys=False))
    script = folder / "apply.sh"
    script.write_text(apply_script(plan))
    script.chmod(0o755)
