"""One function core: the shm worker, the function server and the Lambda handler all serve a
request through `mopar.runtime.core.FunctionCore.run`; only the door around it differs.

Each door is driven in this process, so that a spy on `FunctionCore.run` sees every request: the
server's WSGI app (`app_from_env`), the Lambda handler (`LambdaFunction`, its invoke played by a
function call) and the shm worker's loop (`mopar.runner.worker.serve`, fed the runner's messages
through a pipe, with the runner's side of a dispatch's ``call``/``resume`` played here).
"""

from __future__ import annotations

import base64
import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mopar.runner import worker
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.check import compare_outputs
from mopar.runner.local import shm_root
from mopar.runner.shmbuf import BufferPool
from mopar.runtime.aws import LambdaFunction
from mopar.runtime.core import FunctionCore
from mopar.runtime.dispatch import expert_tensors
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame
from mopar.runtime.server import TIMING_HEADER, app_from_env

DOORS = ["server", "lambda", "shm"]


@pytest.fixture
def runs(monkeypatch) -> list[tuple[str, str]]:
    """(function, door class) of every `FunctionCore.run`, in order."""
    seen: list[tuple[str, str]] = []
    run = FunctionCore.run

    def spy(self, door):
        seen.append((self.name, type(door).__name__))
        return run(self, door)

    monkeypatch.setattr(FunctionCore, "run", spy)
    return seen


# --- the doors, driven in this process --------------------------------------------------------


def _through_servers(bundle: Path, path: list[str], inputs: dict) -> dict[str, np.ndarray]:
    """Each function's WSGI app, no MOPAR_NEXT: each answers its outgoing frame, which is
    posted to the next by hand."""
    apps = {}

    def app(name: str):
        if name not in apps:
            spec = json.loads((bundle / "functions" / name / "function.json").read_text())
            apps[name] = app_from_env(
                {
                    "MOPAR_FUNCTION_DIR": str(bundle / "functions" / name),
                    "MOPAR_CALLS": ",".join(f"http://{c['slice']}" for c in spec["calls"]),
                }
            )
        return apps[name]

    def post(name: str, frame: bytes) -> bytes:
        status = []
        environ = {
            "REQUEST_METHOD": "POST",
            "CONTENT_TYPE": "application/octet-stream",
            "HTTP_ACCEPT": "application/octet-stream",  # a hop asks for a frame
            "CONTENT_LENGTH": str(len(frame)),
            "wsgi.input": io.BytesIO(frame),
        }
        body = b"".join(app(name)(environ, lambda s, h: status.append((s, dict(h)))))
        assert status[0][0].startswith("200"), body
        assert status[0][1][TIMING_HEADER].split(",")[-1].startswith(f"{name}=")
        return body

    for name in path:  # the called ones are reached through the app's own fork: by hand here
        fn = app(name)
        if fn.calls:
            fn.calls = tuple(_LocalHop(c.slice, post) for c in fn.function.spec.calls)
    frame = _first_frame(bundle, path, inputs)
    for name in path:
        frame = post(name, frame)
    return decode_payloads(split_frame(frame))


def _first_frame(bundle: Path, path: list[str], inputs: dict) -> bytes:
    """The model inputs the first function receives (a model may have inputs no slice reads)."""
    spec = json.loads((bundle / "functions" / path[0] / "function.json").read_text())
    return encode_frame({t["name"]: inputs[t["name"]] for t in spec["receives"]})


class _LocalHop:
    """A `mopar.runtime.transports.Hop` that posts to an app in this process."""

    def __init__(self, name: str, post) -> None:
        self.name, self.post, self.url = name, post, f"local:{name}"

    def send(self, frame: bytes):
        body = self.post(self.name, frame)
        return type("Answer", (), {"status": 200, "body": body, "headers": {}})()


def _through_lambdas(bundle: Path, path: list[str], inputs: dict) -> dict[str, np.ndarray]:
    """The Lambda handlers, each invoking the next (or its called ones) through a call here."""
    fns: dict[str, LambdaFunction] = {}

    def invoke(name: str, event: dict) -> dict:
        return json.loads(json.dumps(fns[name](json.loads(json.dumps(event)), None)))

    names = sorted(p.name for p in (bundle / "functions").iterdir() if p.is_dir())
    for name in names:
        spec = json.loads((bundle / "functions" / name / "function.json").read_text())
        env = {"MOPAR_CALLS": ",".join(c["slice"] for c in spec["calls"])}
        if name in path and path.index(name) < len(path) - 1:
            env["MOPAR_NEXT"] = path[path.index(name) + 1]
        fns[name] = LambdaFunction(bundle / "functions" / name, env, invoke=invoke)
    answer = fns[path[0]](
        {"mopar": 1, "frame": base64.b64encode(_first_frame(bundle, path, inputs)).decode()}, None
    )
    assert "error" not in answer, answer
    return decode_payloads(split_frame(base64.b64decode(answer["frame"])))


def _through_workers(bundle: Path, path: list[str], inputs: dict) -> dict[str, np.ndarray]:
    """The shm workers' loop, one request in one slot, played in the runner's order: each
    function once every tensor it reads is there; a dispatch's calls when it asks for them."""
    manifest = read_manifest(bundle)
    by_name = {s.name: s for s in manifest.slices}
    files: dict[str, str] = {}

    def file(value: str) -> str:
        return files.setdefault(value, f"r0x0-v{len(files)}.t")

    def run_call(name: str) -> None:  # an expert function, as the runner sends it its request
        s = by_name[name]
        msg = {
            "id": 0,
            "inputs": {v: file(v) for v in s.inputs},
            "outputs": {v: file(v) for v in s.outputs},
        }
        assert _serve(bundle, name, None, shm, msg, None)[-1]["event"] == "done"

    shm = Path(tempfile.mkdtemp(prefix="mopar-core-test-", dir=shm_root()))
    try:
        pool = BufferPool(shm)
        for name in manifest.inputs:
            pool.write(file(name), inputs[name])
        for s in manifest.slices:
            if s.called:
                continue
            msg = {
                "id": 0,
                "inputs": {v: file(v) for v in s.inputs},
                "outputs": {v: file(v) for v in s.outputs},
            }
            if s.dispatch is not None:
                msg["calls"] = {
                    c: dict(zip(("tokens", "gates", "out"), map(file, expert_tensors(c))))
                    for c in s.dispatch.callees
                }
            dispatch = s.dispatch.to_dict() if s.dispatch is not None else None
            events = _serve(bundle, s.name, dispatch, shm, msg, run_call)
            assert events[-1]["event"] == "done", events
        return {pub: np.array(pool.read(file(v))) for pub, v in manifest.outputs}
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


def _serve(
    bundle: Path, name: str, dispatch: dict | None, shm: Path, msg: dict, run_call
) -> list[dict]:
    """Serve ``msg`` with ``worker.serve``; answer a ``call`` event by running each named expert
    function (``run_call``) and resuming. The worker's events, in order."""
    core = worker.load_core(bundle / "functions" / name, 1, dispatch, prewarm=True)
    r, w = os.pipe()
    replies = os.fdopen(r, "rb")
    events: list[dict] = []

    def lines():
        yield json.dumps(msg).encode() + b"\n"
        while True:  # play the runner until the worker answers the request
            event = json.loads(replies.readline())
            events.append(event)
            if event["event"] in ("done", "error"):
                return
            if event["event"] == "call":
                for name in event["calls"]:
                    run_call(name)
                yield json.dumps({"id": 0, "resume": True}).encode() + b"\n"

    with pytest.raises(StopIteration):  # the loop ends with its input, as at EOF
        worker.serve(core, BufferPool(shm), lines(), w)
    os.close(w)
    replies.close()
    return events


THROUGH = {"server": _through_servers, "lambda": _through_lambdas, "shm": _through_workers}
CLASS = {"server": "_FrameDoor", "lambda": "_FrameDoor", "shm": "_ShmDoor"}


# --- the tests ----------------------------------------------------------------------------------


def _path(bundle: Path) -> list[str]:
    plan = json.loads((bundle / "plan.json").read_text())["plan"]
    called = {
        c["slice"]
        for d in (bundle / "functions").iterdir()
        if (d / "function.json").is_file()
        for c in json.loads((d / "function.json").read_text())["calls"]
    }
    return [f["name"] for f in plan["functions"] if f["name"] not in called]


@pytest.mark.parametrize("door", DOORS)
def test_every_door_serves_a_chain_through_the_one_core(skipnet_bundle, runs, door):
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    got = THROUGH[door](skipnet_bundle, ["s0", "s1", "s2"], inputs)
    assert compare_outputs(got, expected).max_rel_err <= 1e-5
    assert runs == [(f"s{i}", CLASS[door]) for i in range(3)]


@pytest.mark.parametrize("door", DOORS)
def test_every_door_dispatches_experts_through_the_one_core(moe_bundle, runs, door):
    """The dispatch functions' route, call, combine: the same steps behind every door, calling
    only the expert functions their tokens reached, through the door's own way of calling."""
    inputs, expected = read_reference(moe_bundle / "reference.npz")
    path = _path(moe_bundle)
    got = THROUGH[door](moe_bundle, path, inputs)
    assert compare_outputs(got, expected).max_rel_err <= 1e-4
    assert [name for name, _ in runs if name in path] == path
    assert {cls for _, cls in runs} == {CLASS[door]}
    experts = [name for name, _ in runs if name not in path]
    assert experts and all(".e" in name for name in experts)
    assert len(experts) == len(set(experts))  # each reached expert function called once
