"""AWS's own Lambda tools as the tests run them: the SAM CLI, its Lambda Runtime Interface
Emulator, and podman behind Docker's API. Each finder skips the test, naming what is missing.

- `sam_cli`, `rie_binary`, `sam_python`: the SAM CLI that ``make setup`` installs into
  ``build/sam-venv`` (from ``requirements-sam.lock``: it pins click 8.1.8, mopar another), the
  emulator binary its package ships, and that venv's Python (with boto3), which `boto3_invoke`
  runs.
- `container_engine`: podman, ready for the local base image (`make base-image`), with this
  host's work-arounds (`mopar.container.engine.Engine.ready_for`: runc, no rlimits).
- `docker_api`: ``podman system service`` on a socket of its own, as ``DOCKER_HOST`` for SAM.
- `bridge_gateway`: the host's address on podman's default bridge, where a function in a
  container reaches what the test serves (the SAM endpoint, redis-server); a container of the
  test's own keeps the bridge up meanwhile. Nothing listens beyond this machine.
- `fill_wheels`: the wheels an offline ``sam build`` of a bundle's Lambda images installs,
  put in the bundle's ``template/mopar-onnx/wheels`` (where docs/deploy-lambda.md says).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mopar.container.build import LOCAL_BASE, plan_images, requirements_of
from mopar.container.engine import Engine, cache_dir, find_engine
from mopar.container.wheels import Target, ensure_wheels
from mopar.errors import ContainerError
from mopar.runner.bundle import read_manifest

ROOT = Path(__file__).resolve().parents[1]
SAM_VENV = ROOT / "build" / "sam-venv"
LABEL = "com.mopar.test=sam"
"""The label of every container these tests start themselves (and remove)."""
SAM_ENV = {"SAM_CLI_TELEMETRY": "0", "AWS_DEFAULT_REGION": "us-east-1"}
"""What every ``sam`` command runs with: no telemetry sent, a region of its own."""


def sam_cli() -> Path:
    """``build/sam-venv/bin/sam``, or skip."""
    exe = SAM_VENV / "bin" / "sam"
    if not exe.is_file():
        pytest.skip(f"the AWS SAM CLI is not installed in {SAM_VENV}; run `make setup`")
    return exe


def sam_python() -> Path:
    """The SAM venv's Python (boto3 is there: SAM's own dependency), or skip."""
    sam_cli()
    return SAM_VENV / "bin" / "python"


def rie_binary() -> Path:
    """The Lambda Runtime Interface Emulator for this machine from the SAM CLI's package."""
    sam_cli()
    arch = {"x86_64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    found = sorted(
        SAM_VENV.glob(f"lib/python3*/site-packages/samcli/local/rapid/aws-lambda-rie-{arch}")
    )
    if not found:
        pytest.skip(f"no aws-lambda-rie-{arch} in the SAM CLI's package under {SAM_VENV}")
    return found[0]


def sam(*args: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``sam ARGS`` to the end, in ``cwd``."""
    return subprocess.run(
        [str(sam_cli()), *args],
        cwd=cwd,
        env={**os.environ, **SAM_ENV, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def container_engine(name: str | None = "podman") -> Engine:
    """The engine ``name`` (None: podman or docker), ready for `LOCAL_BASE` (made with ``make
    base-image`` if missing), or skip."""
    try:
        found = find_engine(name)
    except ContainerError as exc:
        pytest.skip(f"no container engine: {exc}")
    if found.image_id(LOCAL_BASE) is None:
        made = subprocess.run(["make", "base-image"], cwd=ROOT, capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"could not make {LOCAL_BASE}: {made.stderr.strip().splitlines()[-1:]}")
    try:
        return found.ready_for(LOCAL_BASE)
    except ContainerError as exc:
        pytest.skip(f"containers cannot run here: {exc}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until something accepts connections at ``host:port`` (``proc``: fail if it exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{proc.args[0]} exited ({proc.returncode}) before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    pytest.fail(f"nothing listened on {host}:{port} within {timeout_s:g} s")


@contextlib.contextmanager
def docker_api(engine: Engine, folder: Path) -> Iterator[str]:
    """``podman system service`` on ``folder/podman.sock``, called as ``engine`` must be on
    this host; yields the ``DOCKER_HOST`` to give SAM. Stopped on exit."""
    sock = folder / "podman.sock"
    proc = subprocess.Popen(
        engine.command("system", "service", "--time=0", f"unix://{sock}"),
        env=engine.environ(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not _pings(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"podman system service did not answer on {sock}")
            time.sleep(0.2)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _pings(sock: Path) -> bool:
    """Whether Docker's API answers ``GET /_ping`` on the unix socket ``sock``."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(str(sock))
        s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
        return b" 200 " in s.recv(256)
    return False


@contextlib.contextmanager
def bridge_gateway(engine: Engine) -> Iterator[str]:
    """The host's address on podman's default network (``podman``), held up for the block by
    a container of the test's own (podman takes the bridge down with its last container)."""
    name = f"mopar-sam-keeper-{secrets.token_hex(4)}"
    engine.run(
        "run", "-d", "--rm", "--name", name, "--label", LABEL, "--network", "podman",
        LOCAL_BASE, "sleep", "3600",
    )  # fmt: skip
    try:
        doc = json.loads(engine.run("network", "inspect", "podman").stdout)
        yield str(doc[0]["subnets"][0]["gateway"])
    finally:
        engine.run("rm", "-f", "-t", "0", name, check=False)


def fill_wheels(bundle: Path, engine: Engine) -> Path:
    """Put in ``bundle``'s ``template/mopar-onnx/wheels`` every wheel its Lambda images
    install, for the base's Python (`mopar.container.wheels.ensure_wheels`, as `mopar build`
    fetches them: from mopar's wheelhouse, or PyPI where a wheel is missing)."""
    folder = bundle / "template" / "mopar-onnx" / "wheels"
    builds = plan_images(
        read_manifest(bundle), kinds=("lambda",), base_image=LOCAL_BASE, base_id=""
    )
    target = Target.of_image(engine, LOCAL_BASE)
    cache = cache_dir() / "wheels"
    ensure_wheels(sorted({r for b in builds for r in requirements_of(b)}), cache, target)
    ensure_wheels(requirements_of(builds[0], in_dockerfile=True), cache, target, pin_to_host=False)
    for wheel in cache.glob("*.whl"):
        if not (folder / wheel.name).exists():
            try:
                os.link(wheel, folder / wheel.name)
            except OSError:  # another file system
                shutil.copy2(wheel, folder / wheel.name)
    return folder


_BOTO3 = """
import json, sys
import boto3
from botocore.config import Config
endpoint, name, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = boto3.client(
    "lambda", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
    aws_secret_access_key="test",
    config=Config(read_timeout=timeout, connect_timeout=10, retries={"max_attempts": 0}),
)
got = client.invoke(FunctionName=name, InvocationType="RequestResponse", Payload=sys.stdin.buffer.read())
json.dump({"FunctionError": got.get("FunctionError"), "Payload": json.loads(got["Payload"].read())}, sys.stdout)
"""


def boto3_invoke(endpoint: str, function: str, event: dict, *, timeout_s: float = 240) -> dict:
    """A synchronous ``lambda:Invoke`` of ``function`` at ``endpoint`` by the real boto3 (the
    SAM venv's); ``{"FunctionError", "Payload"}``."""
    done = subprocess.run(
        [str(sam_python()), "-c", _BOTO3, endpoint, function, str(timeout_s)],
        input=json.dumps(event).encode(),
        capture_output=True,
        timeout=timeout_s + 30,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout)
