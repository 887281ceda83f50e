"""Emit: the OpenFaaS side of a bundle -- ``stack.yml``, the ``mopar-onnx`` template, ``k8s/``.

Nothing here needs faas-cli, Docker or a cluster: ``stack.yml`` is checked key by key against the
Go structs faas-cli parses it into, the Kubernetes objects against the fields their schemas
define, and the shm patch is merged into a Deployment by the real ``kubectl patch --local`` when
kubectl is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
import yaml

import mopar
from mopar.emit.runtime import RUNTIME_REQUIREMENTS, TEMPLATE_LANG, template_source
from mopar.errors import BundleError
from mopar.plan import Function, Plan
from mopar.targets.openfaas.emit import (
    FUNCTION_NAMESPACE,
    IN_CLUSTER_GATEWAY,
    SHM_DIR,
    Timeouts,
    apply_script,
    function_names,
    next_urls,
    profile,
    profile_name,
    shm_functions,
    shm_patch,
    stack,
    write_openfaas,
)
from tests.conftest import chain_plan

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "templates" / "openfaas" / TEMPLATE_LANG


def _plan(
    transports=("shm", "http", "redis", "response"),
    memory_mb=(256, 1769, 3008, 128),
    vcpus=(0.25, 1.0, 0.0, 1.7),
    time_ms=(5.0, 4_000.0, 20.0, 1.0),
    model="ResNet_50",
) -> Plan:
    """A hand-made plan: one slice per transport, with the numbers the stack is derived from."""
    return chain_plan(
        [
            Function(
                name=f"s{i}",
                layers=(f"l{i}a", f"l{i}b"),
                memory_mb=mb,
                param_bytes=1000 * i,
                time_ms=t,
                vcpus=v,
            )
            for i, (mb, v, t) in enumerate(zip(memory_mb, vcpus, time_ms))
        ],
        model=model,
        strategy="hand",
        target="openfaas",
        transport=transports,
    )


# --- the stack schema ----------------------------------------------------------------------------

# The yaml tags and Go types of the structs faas-cli parses stack.yml and template.yml into:
# openfaas/go-sdk stack/schema.go (read as vendored in openfaas/faas-cli at
# vendor/github.com/openfaas/go-sdk/stack/schema.go, commit bda863db). Pointer types (*T) are
# written as T. Rules beyond the types are in go-sdk stack/stack.go: provider.name must be
# "openfaas", version (when present) one of ["1.0"], and the whole file goes through envsubst.
GO_SDK_STACK_SCHEMA: dict[str, dict[str, str]] = {
    "Services": {
        "version": "string",
        "functions": "map[string]Function",
        "provider": "Provider",
        "configuration": "StackConfiguration",
    },
    "Provider": {"name": "string", "gateway": "string"},
    "Function": {
        "lang": "string",
        "handler": "string",
        "image": "string",
        "fprocess": "string",
        "environment": "map[string]string",
        "secrets": "[]string",
        "skip_build": "bool",
        "constraints": "[]string",
        "environment_file": "[]string",
        "labels": "map[string]string",
        "limits": "FunctionResources",
        "requests": "FunctionResources",
        "readonly_root_filesystem": "bool",
        "build_options": "[]string",
        "annotations": "map[string]string",
        "namespace": "string",
        "build_args": "map[string]string",
        "platforms": "string",
        "build_secrets": "map[string]string",
    },
    "StackConfiguration": {"templates": "[]TemplateSource", "copy": "[]string"},
    "TemplateSource": {"name": "string", "source": "string"},
    "FunctionResources": {"memory": "string", "cpu": "string"},
    "LanguageTemplate": {
        "language": "string",
        "fprocess": "string",
        "build_options": "[]BuildOption",
        "welcome_message": "string",
        "handler_folder": "string",
        "mount_ssh": "bool",
    },
    "BuildOption": {"name": "string", "packages": "[]string"},
}


def _check(value, go_type: str, path: str) -> list[str]:
    """Where ``value`` (parsed YAML) does not fit ``go_type``: one message per mismatch."""
    if go_type == "string":
        return [] if isinstance(value, str) else [f"{path}: {value!r} is not a string"]
    if go_type == "bool":
        return [] if isinstance(value, bool) else [f"{path}: {value!r} is not a bool"]
    if go_type.startswith("[]"):
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [e for i, v in enumerate(value) for e in _check(v, go_type[2:], f"{path}[{i}]")]
    if go_type.startswith("map[string]"):
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not a mapping"]
        errors = [f"{path}: key {k!r} is not a string" for k in value if not isinstance(k, str)]
        return errors + [
            e
            for k, v in value.items()
            for e in _check(v, go_type[len("map[string]") :], f"{path}.{k}")
        ]
    fields = GO_SDK_STACK_SCHEMA[go_type]
    if not isinstance(value, dict):
        return [f"{path}: {value!r} is not a {go_type} mapping"]
    errors = [
        f"{path}.{k}: not a field of {go_type} (fields: {sorted(fields)})"
        for k in value
        if k not in fields
    ]
    return errors + [
        e for k, v in value.items() if k in fields for e in _check(v, fields[k], f"{path}.{k}")
    ]


def _stack_errors(doc: dict) -> list[str]:
    # version is a Go string; an unquoted 1.0 is a YAML float whose text yaml.v3 stores as "1.0".
    version = doc.get("version")
    errors = [] if version in (None, "1.0", 1.0) else [f"version: {version!r} is not 1.0"]
    body = {k: v for k, v in doc.items() if k != "version"}
    return errors + _check(body, "Services", "stack")


def test_the_schema_check_rejects_unknown_keys_and_wrong_types():
    doc = stack(_plan())
    fn = next(iter(doc["functions"].values()))
    fn["limits"]["memroy"] = "1Mi"
    fn["labels"]["n"] = 3
    fn["replicas"] = 2
    errors = _stack_errors(doc)
    assert any("memroy" in e for e in errors)
    assert any("labels.n" in e for e in errors)
    assert any("replicas" in e for e in errors)


@pytest.mark.parametrize(
    "transports",
    [
        ("shm", "http", "redis", "response"),
        ("http", "http", "http", ""),
        ("redis", "shm", "shm", "response"),
    ],
)
def test_every_key_of_stack_yml_is_in_the_go_sdk_schema(transports):
    doc = stack(_plan(transports=transports), redis_url="redis://r:6379/0")
    assert _stack_errors(doc) == []


def test_stack_names_the_provider_version_and_the_bundled_template():
    doc = stack(_plan(), gateway="http://gw.example:31112")
    assert doc["version"] == 1.0
    assert doc["provider"] == {"name": "openfaas", "gateway": "http://gw.example:31112"}
    assert doc["configuration"]["templates"] == [
        {"name": TEMPLATE_LANG, "source": f"./template/{TEMPLATE_LANG}"}
    ]
    assert {f["lang"] for f in doc["functions"].values()} == {TEMPLATE_LANG}


def test_stack_yml_has_nothing_for_envsubst_to_replace(written):
    # faas-cli runs the whole file through envsubst before parsing it.
    assert "$" not in (written[0] / "stack.yml").read_text()


# --- names, sizes, labels ------------------------------------------------------------------------

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_KEY_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# Kubernetes resource.Quantity: a decimal number with an optional binary or decimal suffix.
QUANTITY = re.compile(r"^\+?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def test_function_names_are_dns1123_labels_in_slice_order():
    plan = _plan(model="A Very_Long.Model/Name " * 5)
    names = list(stack(plan)["functions"])
    assert names == function_names(plan)
    assert all(DNS1123_LABEL.match(n) and len(n) <= 63 for n in names)
    assert [n.rsplit("-", 1)[1] for n in names] == ["s0", "s1", "s2", "s3"]


def test_each_function_builds_its_slice_folder_into_its_own_image():
    fns = stack(_plan(), image_prefix="registry.example.com/team/")["functions"]
    assert [f["handler"] for f in fns.values()] == [f"./functions/s{i}" for i in range(4)]
    assert [f["image"] for f in fns.values()] == [
        f"registry.example.com/team/{n}:latest" for n in fns
    ]
    assert all(f["build_args"]["TEST_ENABLED"] == "false" for f in fns.values())
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert all(f["build_args"]["PYTHON_VERSION"] == python for f in fns.values())


def test_memory_and_cpu_come_from_the_plan_as_kubernetes_quantities():
    fns = list(stack(_plan())["functions"].values())
    assert [f["limits"]["memory"] for f in fns] == ["256Mi", "1769Mi", "3008Mi", "128Mi"]
    assert [f["limits"].get("cpu") for f in fns] == ["250m", "1000m", None, "1700m"]
    for f in fns:
        assert f["requests"] == f["limits"]
        assert all(QUANTITY.match(q) for q in f["limits"].values())


def test_onnxruntime_threads_follow_each_functions_cpu_limit():
    fns = list(stack(_plan())["functions"].values())
    # 0.25 and 1.0 vCPU: one thread; no CPU set: onnxruntime's own choice; 1.7: one per whole
    assert [f["environment"].get("MOPAR_INTRA_OP") for f in fns] == ["1", "1", None, "1"]
    wide = list(stack(_plan(vcpus=(2.0, 3.0, 0.1, 0.5)))["functions"].values())
    assert [f["environment"]["MOPAR_INTRA_OP"] for f in wide] == ["2", "3", "1", "1"]


def test_labels_and_annotations_name_model_slice_and_transport():
    fns = list(stack(_plan())["functions"].values())
    assert [f["labels"]["com.mopar.transport"] for f in fns] == ["shm", "http", "redis", "response"]
    assert [f["labels"]["com.mopar.slice"] for f in fns] == ["0", "1", "2", "3"]
    assert {f["labels"]["com.mopar.model"] for f in fns} == {"resnet-50"}
    assert [f["annotations"]["com.mopar.slice"] for f in fns] == ["s0", "s1", "s2", "s3"]
    assert {f["annotations"]["com.mopar.model"] for f in fns} == {"ResNet_50"}
    for f in fns:
        for key, value in f["labels"].items():
            name = key.rpartition("/")[2]
            assert LABEL_KEY_NAME.match(name) and len(name) <= 63, key
            assert LABEL_VALUE.match(value) and len(value) <= 63, (key, value)


def test_the_last_slice_answers_and_an_unset_cut_is_http():
    fns = list(stack(_plan(transports=("", None, "shm", "response")))["functions"].values())
    assert [f["environment"]["MOPAR_TRANSPORT"] for f in fns] == ["http", "http", "shm", ""]
    assert fns[-1]["environment"]["MOPAR_NEXT"] == ""


def test_a_transport_openfaas_has_not_is_a_bundle_error():
    with pytest.raises(BundleError, match=r"function 's0'.*'invoke'.*--target openfaas"):
        stack(_plan(transports=("invoke", "http", "http", "response")))


# --- next hop, redis, timeouts -------------------------------------------------------------------


def test_next_hop_is_the_gateway_except_across_shm_where_it_is_the_service():
    plan = _plan()
    names = function_names(plan)
    assert next_urls(plan) == [
        f"http://{names[1]}.{FUNCTION_NAMESPACE}:8080",
        f"{IN_CLUSTER_GATEWAY}/function/{names[2]}",
        f"{IN_CLUSTER_GATEWAY}/function/{names[3]}",
        "",
    ]
    env = [f["environment"] for f in stack(plan)["functions"].values()]
    assert [e["MOPAR_NEXT"] for e in env] == next_urls(plan)


def test_redis_url_is_set_on_every_function_only_when_a_cut_uses_redis():
    env = [
        f["environment"] for f in stack(_plan(), redis_url="redis://r:6379/0")["functions"].values()
    ]
    assert {e["REDIS_URL"] for e in env} == {"redis://r:6379/0"}
    no_redis = stack(_plan(transports=("http", "shm", "http", "response")))
    assert all("REDIS_URL" not in f["environment"] for f in no_redis["functions"].values())


def test_default_redis_url_is_empty_for_the_deployer_to_fill():
    env = [f["environment"] for f in stack(_plan())["functions"].values()]
    assert {e["REDIS_URL"] for e in env} == {""}


def _seconds(duration: str) -> int:
    assert re.fullmatch(r"\d+s", duration), duration
    return int(duration[:-1])


def test_watchdog_timeouts_cover_the_rest_of_the_chain_and_are_at_least_30_s():
    fns = list(stack(_plan(time_ms=(5.0, 4_000.0, 20.0, 1.0)))["functions"].values())
    execs = [_seconds(f["environment"]["exec_timeout"]) for f in fns]
    # per slice: max(30, ceil(10 x predicted s)) = 30, 40, 30, 30; each adds the rest's
    assert execs == [130, 100, 60, 30]
    for f, e in zip(fns, execs):
        env = f["environment"]
        assert _seconds(env["read_timeout"]) == _seconds(env["write_timeout"]) == e + 5
    waits = [f["environment"].get("MOPAR_TIMEOUT_S") for f in fns]
    assert waits == ["100", "60", "30", None]


def test_timeouts_follow_the_policy_given():
    fns = stack(_plan(), timeouts=Timeouts(min_s=60, factor=2.0, margin_s=1))["functions"]
    execs = [_seconds(f["environment"]["exec_timeout"]) for f in fns.values()]
    assert execs == [240, 180, 120, 60]


# --- chain modes ---------------------------------------------------------------------------------


def test_the_callback_chain_hands_on_through_the_gateways_queue():
    import dataclasses

    plan = dataclasses.replace(
        _plan(transports=("http", "http", "redis", "response")), chain="callback"
    )
    names = function_names(plan)
    fns = list(stack(plan)["functions"].values())
    assert [f["environment"]["MOPAR_NEXT"] for f in fns] == [
        f"{IN_CLUSTER_GATEWAY}/async-function/{n}" for n in names[1:]
    ] + [""]
    assert {f["environment"]["MOPAR_CHAIN"] for f in fns} == {"callback"}
    assert {f["labels"]["com.mopar.chain"] for f in fns} == {"callback"}
    assert {f["annotations"]["com.mopar.chain"] for f in fns} == {"callback"}
    # only the entry may wait (its synchronous facade), so only its budget covers the chain
    execs = [_seconds(f["environment"]["exec_timeout"]) for f in fns]
    assert execs == [130, 40, 30, 30]
    assert [f["environment"].get("MOPAR_CALLBACK_PORT") for f in fns] == ["8080", None, None, None]
    assert _stack_errors(stack(plan)) == []


def test_the_http_chain_is_the_default_and_says_so():
    fns = list(stack(_plan())["functions"].values())
    assert {f["environment"]["MOPAR_CHAIN"] for f in fns} == {"http"}
    assert "/async-function/" not in "".join(f["environment"]["MOPAR_NEXT"] for f in fns)


def test_the_shm_chain_co_locates_every_function():
    import dataclasses

    plan = dataclasses.replace(_plan(transports=("http", "http", "redis", "response")), chain="shm")
    fns = list(stack(plan)["functions"].values())
    assert [f["environment"]["MOPAR_TRANSPORT"] for f in fns] == ["shm", "shm", "shm", ""]
    assert shm_functions(plan) == function_names(plan)
    assert profile(plan) is not None


def test_an_openfaas_plan_in_a_mode_openfaas_does_not_offer_is_refused_in_one_line():
    import dataclasses

    with pytest.raises(BundleError) as err:
        stack(dataclasses.replace(_plan(), chain="event"))
    assert "\n" not in str(err.value) and "openfaas does not offer" in str(err.value)


# --- co-location for shm: Profile, patch, script -------------------------------------------------


def test_the_shm_functions_are_both_ends_of_every_shm_cut():
    plan = _plan(transports=("shm", "http", "shm", "response"))
    names = function_names(plan)
    assert shm_functions(plan) == [names[0], names[1], names[2], names[3]]
    assert shm_functions(_plan(transports=("http", "shm", "http", ""))) == function_names(plan)[1:3]
    assert shm_functions(_plan(transports=("http", "redis", "http", ""))) == []


def test_only_the_shm_functions_name_the_profile_and_the_shm_folder():
    plan = _plan()
    fns = stack(plan)["functions"]
    shm = set(shm_functions(plan))
    for name, f in fns.items():
        assert (f["annotations"].get("com.openfaas.profile") == profile_name(plan)) == (name in shm)
        assert (f["environment"].get("MOPAR_SHM_DIR") == SHM_DIR) == (name in shm)


# Fields of the Profile CRD that mopar writes: openfaas/faas-netes yaml/profile-crd.yml
# (spec.affinity is a core/v1 Affinity).
PROFILE_SPEC_FIELDS = {
    "tolerations",
    "runtimeClassName",
    "podSecurityContext",
    "affinity",
    "topologySpreadConstraints",
    "dnsPolicy",
    "dnsConfig",
    "resources",
    "strategy",
    "priorityClassName",
}


def test_profile_prefers_one_node_for_the_shm_functions():
    plan = _plan()
    doc = yaml.safe_load(yaml.safe_dump(profile(plan)))
    assert doc["apiVersion"] == "openfaas.com/v1" and doc["kind"] == "Profile"
    assert doc["metadata"] == {
        "name": profile_name(plan),
        "namespace": "openfaas",
        "labels": {"com.mopar.model": "resnet-50"},
    }
    assert DNS1123_LABEL.match(doc["metadata"]["name"])
    assert set(doc["spec"]) <= PROFILE_SPEC_FIELDS
    assert set(doc["spec"]["affinity"]) == {"podAffinity"}
    (term,) = doc["spec"]["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert set(term) == {"weight", "podAffinityTerm"} and 1 <= term["weight"] <= 100
    assert term["podAffinityTerm"] == {
        "labelSelector": {
            "matchExpressions": [
                {"key": "faas_function", "operator": "In", "values": shm_functions(plan)}
            ]
        },
        "topologyKey": "kubernetes.io/hostname",
    }


def test_no_profile_without_an_shm_cut():
    assert profile(_plan(transports=("http", "redis", "http", ""))) is None


def test_shm_patch_mounts_a_hostpath_folder_into_the_function_container():
    doc = yaml.safe_load(yaml.safe_dump(shm_patch("resnet-50-s0")))
    pod = doc["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["hostPath"] == {"path": SHM_DIR, "type": "DirectoryOrCreate"}
    (container,) = pod["containers"]
    assert container == {
        "name": "resnet-50-s0",
        "volumeMounts": [{"name": volume["name"], "mountPath": SHM_DIR}],
    }
    (init,) = pod["initContainers"]
    assert init["command"] == ["chmod", "1777", SHM_DIR]
    assert init["volumeMounts"] == container["volumeMounts"]


def _faas_netes_deployment(name: str) -> dict:
    """A Deployment shaped as faas-netes writes one: the container is named after the function."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": FUNCTION_NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"faas_function": name}},
            "template": {
                "metadata": {"labels": {"faas_function": name}},
                "spec": {
                    "containers": [
                        {
                            "name": name,
                            "image": f"{name}:latest",
                            "volumeMounts": [
                                {
                                    "name": f"{name}-projected-secrets",
                                    "mountPath": "/var/openfaas/secrets",
                                }
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": f"{name}-projected-secrets", "projected": {"sources": []}}
                    ],
                },
            },
        },
    }


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_merges_the_shm_patch_into_a_function_deployment(tmp_path):
    name = "resnet-50-s0"
    deployment = tmp_path / "deployment.yaml"
    deployment.write_text(yaml.safe_dump(_faas_netes_deployment(name)))
    patch = tmp_path / "patch.yaml"
    patch.write_text(yaml.safe_dump(shm_patch(name)))
    proc = subprocess.run(
        [
            "kubectl",
            "patch",
            "--local",
            "-f",
            str(deployment),
            "--patch-file",
            str(patch),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    pod = json.loads(proc.stdout)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {SHM_DIR, "/var/openfaas/secrets"}
    assert container["image"] == f"{name}:latest"
    assert {v["name"] for v in pod["volumes"]} == {"mopar-shm", f"{name}-projected-secrets"}
    assert [c["name"] for c in pod["initContainers"]] == ["mopar-shm-perms"]


def test_apply_script_patches_every_shm_function_and_is_valid_shell(tmp_path):
    plan = _plan()
    script = apply_script(plan)
    for fn in shm_functions(plan):
        assert f'kubectl patch deployment -n "$NS" {fn} --patch-file shm-patch-{fn}.yaml' in script
    path = tmp_path / "apply.sh"
    path.write_text(script)
    proc = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- the template --------------------------------------------------------------------------------


def test_template_source_is_the_checkouts_templates_folder():
    assert template_source() == TEMPLATE
    for name in ("template.yml", "Dockerfile", "index.py", "requirements.txt"):
        assert (TEMPLATE / name).is_file(), name


def test_template_yml_fits_the_language_template_schema():
    doc = yaml.safe_load((TEMPLATE / "template.yml").read_text())
    assert _check(doc, "LanguageTemplate", "template.yml") == []
    assert doc["language"] == TEMPLATE_LANG
    assert doc["fprocess"] == "python index.py"
    assert doc["welcome_message"].strip()


def _dockerfile() -> str:
    # Join continuation lines, drop comments: one instruction per line.
    text = re.sub(r"\\\n", " ", (TEMPLATE / "Dockerfile").read_text())
    return "\n".join(
        ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    )


def test_dockerfile_runs_the_watchdog_in_http_mode_as_a_non_root_user():
    text = _dockerfile()
    froms = re.findall(r"^FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", text, re.M)
    assert froms == [
        ("${WATCHDOG_IMAGE}", "watchdog"),
        ("${BASE_IMAGE}", "function"),
        ("function", "ship"),
    ]  # ship, the last stage, is what faas-cli builds
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    assert re.fullmatch(r"ghcr\.io/openfaas/of-watchdog:\d+\.\d+\.\d+", args["WATCHDOG_IMAGE"])
    assert args["BASE_IMAGE"].startswith("python:") and "slim" in args["BASE_IMAGE"]
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"useradd .*\bapp\b", text)
    env = " ".join(re.findall(r"^ENV\s+(.*)$", text, re.M))
    assert 'mode="http"' in env
    assert 'upstream_url="http://127.0.0.1:5000"' in env
    assert 'fprocess="python index.py"' in env
    for timeout in ("read_timeout", "write_timeout", "exec_timeout"):
        assert re.search(rf'{timeout}="\d+s"', env), timeout
    assert re.search(r"^ARG TEST_ENABLED", text, re.M)
    install = re.search(
        r"^RUN\s+(--mount=\S+\s+)+sh /usr/local/lib/mopar-install.sh (.*)$", text, re.M
    )
    assert install and "source=wheels" in install.group(0)  # mounted: in no layer
    assert install.group(2).split() == ["-r", "requirements.txt", "-r", "function/requirements.txt"]
    copies = " ".join(re.findall(r"^COPY\s+(.*)$", text, re.M))
    for src in ("index.py", "mopar/", "function/"):
        assert src in copies, src
    assert re.search(r"^CMD \[\"fwatchdog\"\]", text, re.M)


def test_index_py_serves_the_function_folder_next_to_it():
    text = (TEMPLATE / "index.py").read_text()
    assert "from mopar.runtime.server import main" in text
    assert '"function"' in text and "MOPAR_FUNCTION_DIR" in text


def test_a_missing_template_is_a_bundle_error_that_says_where_it_looked(monkeypatch, tmp_path):
    import mopar.emit.runtime as module

    monkeypatch.setattr(module, "TEMPLATES_DIR", tmp_path / "site" / "mopar" / "templates")
    with pytest.raises(
        BundleError,
        match=r"missing from '.*/templates/openfaas/mopar-onnx'.*reinstall mopar with pip",
    ):
        template_source()


# --- write_openfaas -----------------------------------------------------------------------------


def _bundle(tmp_path: Path, plan: Plan) -> Path:
    bundle = tmp_path / "bundle"
    for s in plan.functions:
        folder = bundle / "functions" / s.name
        folder.mkdir(parents=True)
        for name in ("model.onnx", "handler.py", "function.json", "requirements.txt"):
            (folder / name).write_text("")
    return bundle


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Plan]:
    plan = _plan()
    bundle = _bundle(tmp_path_factory.mktemp("openfaas"), plan)
    write_openfaas(bundle, plan, gateway="http://gw:8080", redis_url="redis://r:6379/0")
    return bundle, plan


def test_write_openfaas_lays_out_what_faas_cli_build_reads(written):
    bundle, plan = written
    doc = yaml.safe_load((bundle / "stack.yml").read_text())
    assert _stack_errors(doc) == []
    assert doc == stack(plan, gateway="http://gw:8080", redis_url="redis://r:6379/0")
    for f in doc["functions"].values():
        assert (bundle / f["handler"]).is_dir()
        assert (bundle / "template" / f["lang"] / "template.yml").is_file()
    source = doc["configuration"]["templates"][0]["source"]
    assert (bundle / source / "Dockerfile").is_file()
    copied = {
        p.relative_to(bundle / source).as_posix()
        for p in (bundle / source).rglob("*")
        if p.is_file()
    }
    assert {"template.yml", "Dockerfile", "index.py", "requirements.txt"} <= copied


def test_template_requirements_are_pinned_to_the_installed_versions(written):
    bundle, _ = written
    lines = [
        ln
        for ln in (bundle / "template" / TEMPLATE_LANG / "requirements.txt")
        .read_text()
        .splitlines()
        if ln and not ln.startswith("#")
    ]
    assert [re.split(r"==", ln)[0] for ln in lines] == list(RUNTIME_REQUIREMENTS)
    for ln in lines:
        dist, _, version = ln.partition("==")
        try:
            assert version == metadata.version(dist)
        except metadata.PackageNotFoundError:
            assert version == ""  # not installed here: left unpinned


def test_the_runtime_copy_holds_mopars_torch_free_sources(written):
    bundle, _ = written
    copy = bundle / "template" / TEMPLATE_LANG / "mopar"
    package = Path(mopar.__file__).resolve().parent
    expected = {"__init__.py", "errors.py"}  # and what runtime/ imports: codec/ and bundle/
    expected |= {
        p.relative_to(package).as_posix()
        for sub in ("codec", "bundle", "runtime")
        for p in (package / sub).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    copied = {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()}
    assert copied == expected
    assert "runtime/handler.py" in copied and "codec/zstd.py" in copied
    assert "bundle/function.py" in copied


# Imports the runtime copy alone (the checkout is not importable: the copy comes first on
# sys.path), with the compiler's dependencies blocked, and reports which imports of a
# forbidden module came from mopar's own files.
_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, pathlib, sys
    copy = pathlib.Path(sys.argv[1])
    FORBIDDEN = {"torch", "onnx", "onnxscript", "networkx", "xgboost", "click", "yaml", "rich",
                 "matplotlib", "transformers", "psutil"}
    attempts = []

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in FORBIDDEN:
                return None
            frame = sys._getframe(1)
            while frame and frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back
            attempts.append([name, frame.f_code.co_filename if frame else "?"])
            raise ModuleNotFoundError(f"blocked: {name}", name=name)

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, str(copy.parent))
    modules = sorted(".".join(("mopar",) + p.relative_to(copy).with_suffix("").parts)
                     .removesuffix(".__init__") for p in copy.rglob("*.py"))
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    import mopar
    print(json.dumps({"modules": modules, "failed": failed, "attempts": attempts,
                      "mopar": mopar.__file__, "torch": "torch" in sys.modules}))
""")


def test_the_runtime_copy_imports_alone_without_torch_or_the_compiler(written, tmp_path):
    bundle, _ = written
    copy = bundle / "template" / TEMPLATE_LANG / "mopar"
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _IMPORT_ALL, str(copy)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert Path(report["mopar"]).resolve() == (copy / "__init__.py").resolve()
    assert "mopar.runtime.handler" in report["modules"]
    ours = [a for a in report["attempts"] if Path(a[1]).resolve().is_relative_to(copy.resolve())]
    assert ours == [], f"mopar's runtime imports compiler-only modules: {ours}"
    assert not report["torch"]
    missing = {
        name: why
        for name, why in report["failed"].items()
        if not any(f"No module named '{d}'" in why for d in RUNTIME_REQUIREMENTS)
    }
    assert missing == {}, f"runtime modules that do not import from the copy: {missing}"
    if report["failed"]:
        pytest.skip(f"a run-time requirement is not installed here: {report['failed']}")


def test_k8s_folder_holds_the_profile_a_patch_per_shm_function_and_the_script(written):
    bundle, plan = written
    k8s = bundle / "k8s"
    assert yaml.safe_load((k8s / "profile.yaml").read_text()) == profile(plan)
    patches = sorted(p.name for p in k8s.glob("shm-patch-*.yaml"))
    assert patches == sorted(f"shm-patch-{fn}.yaml" for fn in shm_functions(plan))
    for fn in shm_functions(plan):
        assert yaml.safe_load((k8s / f"shm-patch-{fn}.yaml").read_text()) == shm_patch(fn)
    script = k8s / "apply.sh"
    assert script.read_text() == apply_script(plan)
    assert script.stat().st_mode & 0o111


def test_no_k8s_folder_without_an_shm_cut(tmp_path):
    plan = _plan(transports=("http", "redis", "http", "response"))
    bundle = _bundle(tmp_path, plan)
    write_openfaas(bundle, plan)
    assert (bundle / "stack.yml").is_file()
    assert not (bundle / "k8s").exists()


def test_rewriting_replaces_the_template_copy(written, tmp_path):
    bundle = tmp_path / "again"
    shutil.copytree(written[0], bundle)
    stale = bundle / "template" / TEMPLATE_LANG / "stale.txt"
    stale.write_text("old")
    write_openfaas(bundle, written[1])
    assert not stale.exists()


# --- the template serving a real bundle ----------------------------------------------------------


def _start(context: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """Run ``python index.py`` in a build context as the image would; wait for its ready line."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "index.py"],
        cwd=context,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("event") == "ready":
            return proc, int(json.loads(line)["port"])
    proc.wait(10)
    raise AssertionError(f"index.py in {context} exited with {proc.returncode} before serving")


def test_the_templates_index_py_serves_a_compiled_chain_from_faas_cli_build_contexts(
    bundle_copy, tmp_path
):
    import dataclasses
    import os
    import urllib.request

    import numpy as np

    from mopar.runtime.frame import decode_payloads, encode_frame, split_frame

    doc = json.loads((bundle_copy / "plan.json").read_text())
    plan = Plan.from_dict(doc["plan"])
    transport = {"s0": "shm", "s1": "http"}
    plan = dataclasses.replace(
        plan,
        edges=tuple(
            dataclasses.replace(e, transport=transport[e.src]) if e.src in transport else e
            for e in plan.edges
        ),
    )
    write_openfaas(bundle_copy, plan)
    functions = yaml.safe_load((bundle_copy / "stack.yml").read_text())["functions"]
    shm = tmp_path / "shm"
    shm.mkdir()
    procs, ports = [], {}
    try:
        # Start from the last: each function's MOPAR_NEXT is the one started before it. A
        # context is what faas-cli build assembles: the template plus the handler as function/.
        for name in reversed(list(functions)):
            fn = functions[name]
            context = tmp_path / "build" / name
            shutil.copytree(bundle_copy / "template" / fn["lang"], context)
            shutil.copytree(bundle_copy / fn["handler"], context / "function")
            env = {k: v for k, v in os.environ.items() if not k.startswith("MOPAR_")}
            env.update(fn["environment"], PORT="0", MOPAR_SHM_DIR=str(shm))
            if fn["environment"]["MOPAR_NEXT"]:
                env["MOPAR_NEXT"] = f"http://127.0.0.1:{ports[len(ports) - 1]}/"
            proc, ports[len(ports)] = _start(context, env)
            procs.append(proc)
        reference = np.load(bundle_copy / "reference.npz")
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports[len(ports) - 1]}/",
            data=encode_frame({"x": reference["input.x"]}),
            headers={
                "Content-Type": "application/octet-stream",
                "Accept": "application/octet-stream",
            },
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            outputs = decode_payloads(split_frame(answer.read()))
        assert set(outputs) == {"output_0"}
        np.testing.assert_allclose(
            outputs["output_0"], reference["output.output_0"], rtol=1e-4, atol=1e-5
        )
        assert list(shm.iterdir()) == []  # the shm handoff left nothing behind
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.communicate(timeout=30)
