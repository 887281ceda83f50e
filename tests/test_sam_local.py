"""A ``--target lambda`` bundle under AWS's own tools, from the bundle as written.

AWS itself is out of reach here; its local tools are not (tests/sam.py finds them):

- default: each function's image (`mopar build --kind lambda`) runs under AWS's Lambda Runtime
  Interface Emulator, the binary the SAM CLI's package ships, as a non-root user on a read-only
  root as Lambda runs it, and answers each event as mopar's own emulation of the Invoke API
  (`mopar.targets.aws_lambda.emulate`, what `mopar run` starts) does; two emulated functions
  chain through the Invoke API (``AWS_ENDPOINT_URL_LAMBDA``), and ``mopar invoke`` calls the
  entry at the emulator's invocations URL.
- slow: ``sam build`` builds the images through podman's Docker API, offline, from the
  template's ``Metadata`` and documented parameters (``BaseImage``, ``PipOffline``, the wheels
  in ``template/mopar-onnx/wheels``); ``sam local start-lambda`` serves the functions, and the
  entry is invoked with boto3 and with ``mopar invoke``, its chain running through that
  endpoint (template parameter ``LambdaEndpoint``) in ``invoke`` mode, in ``event`` mode with a
  real redis-server as the rendezvous, and in ``stepfunctions`` mode with the state machine's
  definition walked by the test (SAM cannot run a state machine locally).

Every answer is compared with the bundle's ``reference.npz`` (the model's own outputs).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from mopar.bundle.function import FunctionSpec
from mopar.container.build import LOCAL_BASE
from mopar.runner.bundle import read_reference
from mopar.runner.check import compare_outputs
from mopar.runtime import bodies
from mopar.runtime.frame import decode_payloads, split_frame
from mopar.targets.aws_lambda.client import invocations_url
from tests import sam as tools
from tests.conftest import SKIPNET_INPUT, mopar, mopar_in_process

ENV = {"MOPAR_BASE_IMAGE": LOCAL_BASE}
HANDLER_CMD = ("/opt/venv/bin/python", "-m", "awslambdaric", "mopar.runtime.aws.lambda_handler")
"""What the image's ENTRYPOINT and CMD run, given to the emulator to start."""
RIE_PATH = "/2015-03-31/functions/function/invocations"
"""The emulator's invocations URL path: its one function is always named ``function``."""


@pytest.fixture(scope="module")
def engine():
    return tools.container_engine()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """SkipNet in 2 slices for Lambda (s0 invokes s1). Read-only for tests."""
    out = tmp_path_factory.mktemp("sam") / "bundle"
    proc = mopar_in_process(
        "compile", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--slices", "2",
        "--strategy", "uniform", "--target", "lambda", "--out", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def images(engine, bundle) -> dict[str, str]:
    """Each function's Lambda image, by function (`mopar build`; built once per digest)."""
    proc = mopar("build", bundle, "--kind", "lambda", "--json", env=ENV, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    return {i["function"]: i["tag"] for i in json.loads(proc.stdout)["images"]}


def _functions(bundle: Path) -> dict[str, dict]:
    """The template's functions by slice: their logical id and their plain-text environment
    (the template's, with its parameters' defaults)."""
    doc = yaml.safe_load((bundle / "template.yaml").read_text())
    params = {k: v.get("Default", "") for k, v in doc["Parameters"].items()}
    shared = doc["Globals"]["Function"]["Environment"]["Variables"]
    out = {}
    for fid, res in doc["Resources"].items():
        if res["Type"] != "AWS::Serverless::Function":
            continue
        env = {**shared, **res["Properties"]["Environment"]["Variables"]}
        plain = {
            k: params[v["Ref"]] if isinstance(v, dict) and v.get("Ref") in params else v
            for k, v in env.items()
        }
        plain = {
            k: v for k, v in plain.items() if isinstance(v, str)
        }  # refs to functions: set below
        out[plain["MOPAR_SLICE"]] = {"id": fid, "env": plain}
    return out


def _frame_event(frame: bytes) -> dict:
    return {"mopar": 1, "frame": base64.b64encode(frame).decode()}


def _post(url: str, event: dict, timeout_s: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(event).encode(), headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as got:
        return json.loads(got.read())


@contextlib.contextmanager
def _under_rie(engine, image: str, env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """``image`` run by the emulator as its entry point, as Lambda runs it (a non-root user, a
    read-only root, a writable /tmp); yields its invocations URL on 127.0.0.1 and its address on
    the bridge, where another container reaches its port 8080."""
    port = tools.free_port()
    name = f"mopar-rie-{secrets.token_hex(4)}"
    args = ["run", "-d", "--rm", "--name", name, "--label", tools.LABEL, "--network", "podman"]
    args += [
        "--user",
        "10001:10001",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "-p",
        f"127.0.0.1:{port}:8080",
    ]
    args += ["-v", f"{tools.rie_binary()}:/aws-lambda-rie:ro", "--entrypoint", "/aws-lambda-rie"]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    engine.run(*args, image, *HANDLER_CMD, timeout_s=120)
    try:
        tools.wait_port("127.0.0.1", port, 30)
        ip = engine.run("inspect", "--format", "{{.NetworkSettings.IPAddress}}", name).stdout
        yield f"http://127.0.0.1:{port}{RIE_PATH}", ip.decode().strip()
    finally:
        engine.run("rm", "-f", "-t", "0", name, check=False)


@contextlib.contextmanager
def _mopar_emulation(bundle: Path, name: str, env: dict[str, str]) -> Iterator[str]:
    """The function ``name`` behind mopar's own Invoke API emulation, as `mopar run` starts it;
    yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mopar.targets.aws_lambda.emulate"],
        env={
            **os.environ,
            "MOPAR_LOCAL_FUNCTIONS": "{}",
            **env,
            "MOPAR_FUNCTION_DIR": str(bundle / "functions" / name),
            "PORT": "0",
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", f"the emulation of {name} did not start"
        yield f"http://127.0.0.1:{ready['port']}/"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def _outputs_of(answer: dict) -> dict[str, np.ndarray]:
    assert "frame" in answer, answer
    return decode_payloads(split_frame(base64.b64decode(answer["frame"])))


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    assert compare_outputs(got, want).max_rel_err <= 1e-5


# --- default: mopar invoke speaks the Invoke API ---------------------------------------------------


def test_the_lambda_client_takes_the_invoke_api_urls_and_leaves_others_to_plain_http():
    from mopar.targets.aws_lambda.client import CLIENT

    assert CLIENT.handles("http://127.0.0.1:9000/2015-03-31/functions/function/invocations")
    assert CLIENT.handles("http://10.88.0.1:3001/2015-03-31/functions/SkipnetS0/invocations")
    assert invocations_url("http://127.0.0.1:3001/", "SkipnetS0") == (
        "http://127.0.0.1:3001/2015-03-31/functions/SkipnetS0/invocations"
    )
    assert not CLIENT.handles("https://abc.lambda-url.eu-west-1.on.aws/")  # a Function URL
    assert not CLIENT.handles("http://127.0.0.1:8080/")  # mopar serve


def test_mopar_invoke_calls_a_chain_behind_mopars_invoke_api_emulation(bundle, tmp_path):
    """No container engine needed: the same Invoke API, played by mopar's emulation."""
    _, expected = read_reference(bundle / "reference.npz")
    functions = _functions(bundle)
    with _mopar_emulation(bundle, "s1", functions["s1"]["env"]) as s1:
        env = {
            **functions["s0"]["env"],
            "MOPAR_NEXT": "s1",
            "MOPAR_LOCAL_FUNCTIONS": json.dumps({"s1": s1}),
        }
        with _mopar_emulation(bundle, "s0", env) as s0:
            url = invocations_url(s0.rstrip("/"), "s0")
            out = tmp_path / "out.npz"
            proc = mopar("invoke", url, "--input", bundle / "reference.npz", "--output", out)
            assert proc.returncode == 0, proc.stderr
            got = dict(np.load(out))
    _close(got, expected)
    gone = mopar("invoke", url, "--input", bundle / "reference.npz")  # nothing listens now
    assert gone.returncode == 1 and len(gone.stderr.strip().splitlines()) == 1
    assert "cannot reach" in gone.stderr and "start-lambda" in gone.stderr


# --- default: each image under the emulator --------------------------------------------------------


def test_each_function_image_answers_under_aws_emulator_as_mopars_emulation_does(
    engine, bundle, images
):
    inputs, expected = read_reference(bundle / "reference.npz")
    functions = _functions(bundle)
    entry = FunctionSpec.load(bundle / "functions" / "s0")
    frame = bodies.to_frame({t.name: inputs[t.name] for t in entry.receives}, entry.receives)
    for name in ("s0", "s1"):  # each alone, its answer handed to the next by the test
        env = {**functions[name]["env"], "MOPAR_NEXT": ""}
        event = _frame_event(frame)
        with (
            _under_rie(engine, images[name], env) as (url, _),
            _mopar_emulation(bundle, name, env) as local,
        ):
            real, played = _post(url, event), _post(local, event)
        # the same answer: the same fields, the same tensors (only the timings differ)
        assert set(real) == set(played) and real["from"] == played["from"] == name, (real, played)
        _close(_outputs_of(real), _outputs_of(played))
        frame = base64.b64decode(real["frame"])
    _close(decode_payloads(split_frame(frame)), expected)  # the last one's: the model's outputs


def test_mopar_invoke_calls_the_entry_under_the_emulator_which_invokes_the_next(
    engine, bundle, images, tmp_path
):
    """s0's boto3 reaches s1's emulator through AWS_ENDPOINT_URL_LAMBDA (the template's
    LambdaEndpoint), container to container; the emulator's one function is ``function``."""
    _, expected = read_reference(bundle / "reference.npz")
    functions = _functions(bundle)
    aws = {
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }
    with _under_rie(engine, images["s1"], {**functions["s1"]["env"], **aws}) as (_, s1_ip):
        env = {
            **functions["s0"]["env"],
            **aws,
            "MOPAR_NEXT": "function",
            "AWS_ENDPOINT_URL_LAMBDA": f"http://{s1_ip}:8080",
        }
        with _under_rie(engine, images["s0"], env) as (url, _):
            out = tmp_path / "out.npz"
            proc = mopar("invoke", url, "--input", bundle / "reference.npz", "--output", out)
            assert proc.returncode == 0, proc.stderr
            got = dict(np.load(out))
            # a function that fails answers its error, which mopar invoke says in one line
            bad = tmp_path / "bad.npz"
            np.savez(bad, x=np.zeros((1, 3, 4, 4), np.float32))
            refused = mopar("invoke", url, "--input", bad)
    _close(got, expected)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "failed" in refused.stderr and "x" in refused.stderr, refused.stderr


def test_an_empty_lambda_endpoint_is_aws_own_in_the_image(engine, images):
    """The template's default LambdaEndpoint (empty) leaves boto3 on AWS's own endpoint."""
    probe = "import boto3; print(boto3.client('lambda', region_name='eu-west-1').meta.endpoint_url)"
    done = engine.run(
        "run", "--rm", "--network", "none", "-e", "AWS_ENDPOINT_URL_LAMBDA=", "--entrypoint",
        "/opt/venv/bin/python", images["s0"], "-c", probe,
    )  # fmt: skip
    assert done.stdout.decode().strip() == "https://lambda.eu-west-1.amazonaws.com"


# --- slow: sam build and sam local start-lambda ----------------------------------------------------


@pytest.fixture(scope="module")
def docker_host(engine, tmp_path_factory) -> Iterator[str]:
    """podman's Docker API, for SAM (a socket of this module's own)."""
    tools.sam_cli()
    with tools.docker_api(engine, tmp_path_factory.mktemp("podman-api")) as host:
        yield host


@pytest.fixture(scope="module")
def gateway(engine) -> Iterator[str]:
    """Where SAM's function containers reach the host (the SAM endpoint, redis-server)."""
    with tools.bridge_gateway(engine) as address:
        yield address


@pytest.fixture(scope="module")
def sam_built(engine, bundle, docker_host, tmp_path_factory) -> Iterator[Path]:
    """The bundle as ``sam build`` built it through podman's API: offline, on the local base,
    from the wheels put in the bundle's wheel folder (docs/deploy-lambda.md). Its images are
    removed after."""
    root = tmp_path_factory.mktemp("sam-build") / "bundle"
    shutil.copytree(bundle, root)
    tools.fill_wheels(root, engine)
    built = tools.sam(
        "build", "--parameter-overrides", f"BaseImage={LOCAL_BASE} PipOffline=true",
        cwd=root, env={"DOCKER_HOST": docker_host}, timeout=1200,
    )  # fmt: skip
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    doc = yaml.safe_load((root / ".aws-sam" / "build" / "template.yaml").read_text())
    tags = [
        r["Properties"]["ImageUri"]
        for r in doc["Resources"].values()
        if "ImageUri" in r.get("Properties", {})
    ]
    yield root
    repos = {t.split(":")[0] for t in tags}
    for image in (
        engine.run("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.decode().split()
    ):
        if image.split("/")[-1].split(":")[0] in repos:
            engine.run("rmi", "-f", image, check=False)


@contextlib.contextmanager
def _start_lambda(root: Path, docker_host: str, gateway: str, **parameters: str) -> Iterator[str]:
    """``sam local start-lambda`` on the bridge's host address, each function invoking the
    next through it (``LambdaEndpoint``); yields the endpoint. Its containers go with it."""
    port = tools.free_port(gateway)
    endpoint = f"http://{gateway}:{port}"
    overrides = " ".join(f"{k}={v}" for k, v in {"LambdaEndpoint": endpoint, **parameters}.items())
    proc = subprocess.Popen(
        [
            str(tools.sam_cli()), "local", "start-lambda", "--host", gateway, "--port", str(port),
            "--skip-pull-image", "--warm-containers", "LAZY", "--parameter-overrides", overrides,
        ],
        cwd=root,
        env={**os.environ, **tools.SAM_ENV, "DOCKER_HOST": docker_host},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        tools.wait_port(gateway, port, 60, proc)
        yield endpoint
    finally:
        proc.send_signal(signal.SIGINT)  # SAM stops and removes its containers on Ctrl-C
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _direct_event(bundle: Path) -> dict:
    inputs, _ = read_reference(bundle / "reference.npz")
    return {"inputs": {k: v.tolist() for k, v in inputs.items()}}


def _json_outputs(answer: dict) -> dict[str, np.ndarray]:
    assert answer["FunctionError"] is None and "outputs" in answer["Payload"], answer
    return {k: np.asarray(v) for k, v in answer["Payload"]["outputs"].items()}


@pytest.mark.slow  # ~2 min: sam build's images; the images themselves: the default tests above
def test_sam_builds_and_serves_the_chain_by_invokes_through_its_local_endpoint(
    sam_built, docker_host, gateway, tmp_path
):
    _, expected = read_reference(sam_built / "reference.npz")
    entry = _functions(sam_built)["s0"]["id"]
    with _start_lambda(sam_built, docker_host, gateway, Chain="invoke") as endpoint:
        answer = tools.boto3_invoke(endpoint, entry, _direct_event(sam_built))
        out = tmp_path / "out.npz"
        proc = mopar(
            "invoke",
            invocations_url(endpoint, entry),
            "--input",
            sam_built / "reference.npz",
            "--output",
            out,
        )
    _close(_json_outputs(answer), expected)
    # both ran: s0 invoked s1 through the local endpoint
    assert [t.split("=")[0] for t in answer["Payload"]["timing"].split(",")] == ["s0", "s1"]
    assert proc.returncode == 0, proc.stderr
    _close(dict(np.load(out)), expected)


@pytest.mark.slow  # the event chain's parts run by default in tests/test_chains.py
def test_sam_serves_the_event_chain_with_a_real_redis_rendezvous(
    sam_built, docker_host, gateway, tmp_path
):
    _, expected = read_reference(sam_built / "reference.npz")
    entry = _functions(sam_built)["s0"]["id"]
    port = tools.free_port(gateway)
    redis = subprocess.Popen(
        ["redis-server", "--bind", gateway, "--port", str(port), "--protected-mode", "no",
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        tools.wait_port(gateway, port, 20, redis)
        url = f"redis://{gateway}:{port}/0"
        with _start_lambda(
            sam_built, docker_host, gateway, Chain="event", RedisUrl=url
        ) as endpoint:
            answer = tools.boto3_invoke(endpoint, entry, _direct_event(sam_built))
    finally:
        redis.terminate()
        redis.wait(timeout=20)
    _close(_json_outputs(answer), expected)
    assert [t.split("=")[0] for t in answer["Payload"]["timing"].split(",")] == ["s0", "s1"]


@pytest.mark.slow  # the state machine's definition: tests/test_sam.py; its functions: here
def test_sam_serves_each_state_of_the_step_functions_chain_in_turn(sam_built, docker_host, gateway):
    """SAM runs no state machine locally: the test walks the template's definition, invoking
    each state's function at the local endpoint with the previous state's output."""
    _, expected = read_reference(sam_built / "reference.npz")
    doc = yaml.safe_load((sam_built / "template.yaml").read_text())
    definition = doc["Resources"]["Pipeline"]["Properties"]["Definition"]
    inputs, _ = read_reference(sam_built / "reference.npz")
    entry = FunctionSpec.load(sam_built / "functions" / "s0")
    frame = bodies.to_frame({t.name: inputs[t.name] for t in entry.receives}, entry.receives)
    # what a client starts the execution with (docs/deploy-lambda.md)
    state, payload = definition["StartAt"], _frame_event(frame)
    with _start_lambda(sam_built, docker_host, gateway, Chain="stepfunctions") as endpoint:
        while True:
            task = definition["States"][state]
            fid = task["Parameters"]["FunctionName"].strip("${}")
            answer = tools.boto3_invoke(endpoint, fid, payload)
            assert answer["FunctionError"] is None, answer
            payload = answer["Payload"]  # OutputPath $.Payload
            if task.get("End"):
                break
            state = task["Next"]
    _close(_outputs_of(payload), expected)
