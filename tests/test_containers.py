"""Bundles as real containers: `mopar build` and `mopar run --containers`, with podman.

Images are built once per test run (module fixtures) on the local base `make base-image`
makes from Debian's packages, since no image registry is reachable here; `.ci/run` makes it.
Every run is a real ``mopar`` subprocess starting real containers whose memory and CPU limits
the kernel enforces. The tests skip, saying why in one line, only where no engine can start a
container of the base.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mopar.container.build import LOCAL_BASE
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from tests.conftest import MOPAR, ROOT, mopar, mopar_in_process, nonblank_lines

ENV = {"MOPAR_BASE_IMAGE": LOCAL_BASE}


@pytest.fixture(scope="module")
def engine():
    """podman (or docker), ready for the local base; made with `make base-image` if missing."""
    from tests.sam import container_engine

    return container_engine(None)


@pytest.fixture(scope="module")
def built(engine, skipnet_bundle, skipnet_lambda_bundle):
    """SkipNet's 3 functions, their OpenFaaS images (compiled for OpenFaaS: every image that
    bundle has) and their Lambda images (compiled for Lambda)."""
    images = []
    for bundle, kind in ((skipnet_bundle, "all"), (skipnet_lambda_bundle, "lambda")):
        proc = mopar("build", bundle, "--kind", kind, "--json", env=ENV, timeout=1200)
        assert proc.returncode == 0, proc.stderr
        images += json.loads(proc.stdout)["images"]
    return {"images": images}


def _balloon(tmp_path_factory, *more: str) -> Path:
    out = tmp_path_factory.mktemp("balloon") / "bundle"
    proc = mopar_in_process(
        "compile", "tests.models:balloon", "--input", "x=1x16:float32", "--slices", "1",
        "--out", out, *more,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def balloon(tmp_path_factory, engine) -> Path:
    """One function whose request needs ~130 MB more than it needs idle. Compiled in this
    process: what a fresh process meets in a user's file is tests/test_frontend_load.py's."""
    return _balloon(tmp_path_factory)


@pytest.fixture(scope="module")
def balloon_lambda(tmp_path_factory, engine) -> Path:
    """`balloon` compiled for Lambda: its template.yaml and Dockerfile.lambda."""
    return _balloon(tmp_path_factory, "--target", "lambda")


def _left(engine, run_label: str = "com.mopar.run") -> tuple[list[str], list[str]]:
    """Containers and volumes any mopar run left behind."""
    ps = engine.run("ps", "-aq", "--filter", f"label={run_label}").stdout.decode().split()
    vols = engine.run("volume", "ls", "-q", "--filter", f"label={run_label}").stdout.decode()
    return ps, vols.split()


def _with_memory(bundle: Path, dest: Path, mb: int) -> Path:
    shutil.copytree(bundle, dest)
    plan = json.loads((dest / "plan.json").read_text())
    for f in plan["plan"]["functions"]:
        # a whole vCPU: at the 0.1 the plan may choose for 1 request/s, a restarted container
        # is still starting when the next request comes
        f["memory_mb"], f["vcpus"] = mb, 1.0
    (dest / "plan.json").write_text(json.dumps(plan))
    return dest


# --- mopar build ----------------------------------------------------------------------------------


def test_build_makes_one_small_image_per_function_and_kind(built, skipnet_bundle):
    images = built["images"]
    assert sorted((i["function"], i["kind"]) for i in images) == [
        (f, k) for f in ("s0", "s1", "s2") for k in ("lambda", "openfaas")
    ]
    refused = mopar("build", skipnet_bundle, "--kind", "lambda", env=ENV)  # no Dockerfile.lambda
    assert refused.returncode == 1 and len(nonblank_lines(refused.stderr)) == 1
    assert "compiled for openfaas" in refused.stderr and "--target lambda" in refused.stderr
    for image in images:
        assert image["weights_mb"] < 1 and image["above_base_mb"] > 50  # it holds onnxruntime
        if image["kind"] == "openfaas":
            assert image["runtime_mb"] <= 150, image  # the goal: 150 MB plus the weights
    again = mopar("build", skipnet_bundle, "--kind", "all", "--json", env=ENV)
    assert again.returncode == 0, again.stderr
    assert all(i["cached"] for i in json.loads(again.stdout)["images"])  # same digest: no build


def test_image_holds_the_runtime_and_no_wheel_no_pip_no_torch(engine, built):
    tag = next(i["tag"] for i in built["images"] if i["kind"] == "openfaas")
    probe = (
        "import importlib.util as u, glob; "
        "print([m for m in ('onnxruntime', 'numpy', 'zstandard', 'waitress', 'redis', "
        "'torch', 'pip') if u.find_spec(m)], [f for d in ('/opt', '/tmp', '/home', '/root') "
        "for f in glob.glob(d + '/**/*.whl', recursive=True)])"
    )
    done = engine.run("run", "--rm", "--network", "none", tag, "python", "-c", probe)
    found, wheels = done.stdout.decode().strip().rsplit("] ", 1)
    assert found == "['onnxruntime', 'numpy', 'zstandard', 'waitress', 'redis'"
    assert wheels == "[]"


def test_build_errors_are_one_line(skipnet_bundle, tmp_path):
    missing = mopar("build", skipnet_bundle, "--base-image", "localhost/mopar-no-such:1")
    assert missing.returncode == 1
    assert nonblank_lines(missing.stderr)[-1].startswith("error: image 'localhost/mopar-no-such:1'")
    assert "make base-image" in missing.stderr and "Traceback" not in missing.stderr
    changed = tmp_path / "changed"  # a new handler: a new digest, so an image to build
    shutil.copytree(skipnet_bundle, changed)
    with open(changed / "functions" / "s0" / "handler.py", "a") as f:
        f.write("\n# changed\n")
    offline = mopar(
        "build",
        changed,
        "--offline",
        "--wheelhouse",
        tmp_path / "empty",
        "--function",
        "s0",
        env=ENV,
    )
    assert (
        offline.returncode == 1 and "lacks" in offline.stderr and "pip download" in offline.stderr
    )
    nobundle = mopar("build", tmp_path)
    assert nobundle.returncode == 1 and len(nonblank_lines(nobundle.stderr)) == 1


@pytest.mark.slow  # tests/test_generate.py covers text at the function server on the host
def test_a_main_functions_lambda_image_generates_from_text(engine, tmp_path_factory):
    from tests.test_generate import _compiled

    bundle, expected = _compiled(tmp_path_factory, "llama", "--target", "lambda")
    proc = mopar("build", bundle, "--kind", "lambda", "--json", env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr
    tag = json.loads(proc.stdout)["images"][0]["tag"]
    handler = (
        "import json, sys; from mopar.runtime.aws import lambda_handler; "
        "print(json.dumps(lambda_handler(json.load(sys.stdin), None)))"
    )
    event = {"text": expected["prompt_text"], "max_new_tokens": 32}  # a direct invoke
    done = engine.run("run", "--rm", "-i", "--network", "none", "--entrypoint", "python", tag,
                      "-c", handler, input=json.dumps(event).encode(), timeout_s=300)  # fmt: skip
    answer = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert answer["tokens"] == expected["tokens"]  # tokenized in the image, by its tokenizers
    assert answer["text"] == expected["text"]


def test_lambda_image_runs_the_handler_on_a_sample_event(engine, balloon_lambda):
    balloon = balloon_lambda
    proc = mopar("build", balloon, "--kind", "lambda", "--json", env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr
    tag = json.loads(proc.stdout)["images"][0]["tag"]
    from mopar.runner.bundle import read_reference

    inputs, outputs = read_reference(balloon / "reference.npz")
    event = {
        "version": "2.0",
        "isBase64Encoded": True,
        "headers": {"accept": "application/octet-stream"},  # a frame, asked by name
        "body": base64.b64encode(encode_frame(inputs)).decode(),
    }
    handler = (
        "import json, sys; from mopar.runtime.aws import lambda_handler; "
        "print(json.dumps(lambda_handler(json.load(sys.stdin), None)))"
    )
    done = engine.run(
        "run",
        "--rm",
        "-i",
        "--network",
        "none",
        "--memory",
        "512m",
        "--entrypoint",
        "python",
        tag,
        "-c",
        handler,
        input=json.dumps(event).encode(),
        timeout_s=300,
    )
    answer = json.loads(done.stdout.decode().strip().splitlines()[-1])
    client = (
        "import boto3; c = boto3.client('lambda', region_name='us-east-1'); "
        "print(c.meta.service_model.service_name)"
    )  # what invokes the next function
    made = engine.run(
        "run", "--rm", "--network", "none", "--entrypoint", "python", tag, "-c", client
    )
    assert made.stdout.decode().strip() == "lambda"
    assert answer["statusCode"] == 200, answer
    got = decode_payloads(split_frame(base64.b64decode(answer["body"])))
    (expected,) = outputs.values()
    (value,) = got.values()
    np.testing.assert_allclose(value, expected, rtol=1e-3, atol=1e-4)


# --- mopar run --containers -----------------------------------------------------------------------


def test_run_in_containers_matches_the_model_under_the_plans_limits(engine, built, skipnet_bundle):
    proc = mopar(
        "run",
        skipnet_bundle,
        "--containers",
        "--check",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--json",
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["check"]["passed"] and report["errors"] == 0 and report["requests"] == 6
    assert report["transport"] == "containers (plan)"
    for s in report["slices"]:
        assert 0 < s["peak_rss_mb"] <= s["allocated_mb"], s  # read from the cgroup
        assert s["oom_kills"] == 0 and s["cold_starts"] == 1 and s["cold_start_ms"] > 0
    assert _left(engine) == ([], [])


@pytest.fixture(scope="module")
def colocated_bundle(tmp_path_factory, engine) -> Path:
    """SkipNet compiled with --colocate, every cut over shm (a default bundle co-locates
    nothing: OpenFaaS Community Edition cannot)."""
    from tests.conftest import SHARED_BUNDLES

    out = tmp_path_factory.mktemp("colocated") / "bundle"
    args = (*SHARED_BUNDLES["skipnet_bundle"], "--colocate", "--transport", "shm")
    proc = mopar("compile", *args, "--out", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_colocated_functions_hand_over_through_a_shared_tmpfs(engine, colocated_bundle):
    from mopar.config import RunConfig
    from mopar.container.session import ContainerSession, colocated
    from mopar.runner.bundle import read_manifest, read_reference

    manifest = read_manifest(colocated_bundle)
    assert colocated(manifest) == [{"s0", "s1", "s2"}]  # the plan's shm edges
    proc = mopar("build", colocated_bundle, "--json", env=ENV, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    images = {i["function"]: i["tag"] for i in json.loads(proc.stdout)["images"]}
    inputs, expected = read_reference(colocated_bundle / "reference.npz")
    session = ContainerSession(manifest, RunConfig(timeout_s=60), engine=engine, images=images)
    try:
        session.start()
        volumes = set(session.volumes.values())
        assert len(volumes) == 1
        session.serve(inputs, requests=3, concurrency=1, expected=expected, measure=True)
        logs = "\n".join("\n".join(s.stderr_tail) for s in session.servers)
        assert "handing over by http" not in logs  # the handshake saw the shared folder
        assert session.report(checked=True).comparison.passed
    finally:
        session.stop()
    assert _left(engine) == ([], [])


def test_http_between_containers_and_an_open_loop(engine, built, skipnet_bundle):
    proc = mopar(
        "load",
        skipnet_bundle,
        "--containers",
        "--transport",
        "http",
        "--rate",
        "8",
        "--duration",
        "2",
        "--check",
        "--json",
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["transport"] == "containers (http)" and report["errors"] == 0
    assert report["load"]["offered"] == report["load"]["completed"] > 0


@pytest.mark.slow  # test_serving.py's enforce-memory kill covers the host side
def test_out_of_memory_is_a_real_kill_named_and_counted(engine, balloon, tmp_path):
    small = _with_memory(balloon, tmp_path / "small", 96)  # idle fits, a request does not
    here = tmp_path / "cwd"
    here.mkdir()
    proc = mopar("run", small, "--containers", "--requests", "2", "--json", env=ENV, cwd=here)
    assert proc.returncode == 1
    assert list(here.iterdir()) == []  # conmon's `oom` file stays in the session's own folder
    report = json.loads(proc.stdout) if proc.stdout.strip() else None
    line = nonblank_lines(proc.stderr)[-1]
    assert line.startswith(
        "error: 2 of 2 requests failed; first: s0: killed by the kernel for "
        "memory (exit 137) at its 96 MB limit"
    ), line
    assert "peak was" in line and "Traceback" not in proc.stderr
    assert report is None or report["oom_kills"] >= 2
    tiny = _with_memory(balloon, tmp_path / "tiny", 12)  # not even the runtime fits
    proc = mopar("run", tiny, "--containers", "--requests", "1", env=ENV)
    assert proc.returncode == 1
    assert (
        "function s0 was killed while starting: killed by the kernel for memory (exit 137) "
        "at its 12 MB limit" in proc.stderr
    )
    assert _left(engine) == ([], [])


def test_ctrl_c_removes_the_containers_and_volumes(engine, built, skipnet_bundle):
    run = subprocess.Popen(
        [MOPAR, "run", str(skipnet_bundle), "--containers", "--requests", "100000"],
        cwd=ROOT,
        env={**__import__("os").environ, **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_left(engine)[0]) < 3:  # all three started
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
            time.sleep(0.2)
        time.sleep(1.0)  # serving
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    assert _left(engine) == ([], [])


@pytest.mark.slow  # tests/test_sizing_deployed.py covers the sizing rule on the host path
def test_compile_can_size_each_function_from_its_container(engine, tmp_path):
    out = tmp_path / "bundle"
    proc = mopar(
        "compile",
        "tests.models:skipnet",
        "--input",
        "x=1x3x8x8:float32",
        "--slices",
        "2",
        "--strategy",
        "uniform",
        "--measure",
        "containers",
        "--out",
        out,
        env=ENV,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr
    sizing = json.loads((out / "plan.json").read_text())["sizing"]
    assert {s["measured_in"] for s in sizing} == {"container"}
    # sized from the larger of the cgroup's and the server's peaks, x 1.25, on the grid
    assert all(s["memory_mb"] >= 1.25 * s["peak_rss_mb"] for s in sizing)
