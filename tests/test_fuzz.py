"""Fuzzing: generated inputs at every interface a client, a peer function or a user reaches.

Each interface gets `EXAMPLES` generated inputs (10,000; ``MOPAR_FUZZ_EXAMPLES`` changes it):

- frames, as a function receives them (`mopar.runtime.frame.split_frame`, then each payload
  decoded): random bytes, and valid frames with bytes flipped, cut, or lengths overwritten;
- HTTP requests to a real function server process on 127.0.0.1 (waitress, as deployed): raw
  request lines, headers and bodies, sent over a socket;
- Lambda events to the Lambda handler (`mopar.runtime.aws.LambdaFunction`): JSON values of
  every shape, and events that are nearly right;
- ``plan.json`` and ``function.json`` contents, as `mopar run` and a function read them;
- CLI option values, through click's CliRunner: numbers, words, NaN, infinities, huge and
  negative values for every numeric option of ``run``, ``serve``, ``invoke``, ``simulate``.

What must hold for every input: an answer in the interface's own terms (a `MoparError` or a
`PayloadError` with its one line; an HTTP 4xx with one line of JSON; a Lambda answer with a
status; exit 1 or 2 with one line), never a traceback or another exception; no wait past the
interface's stated timeout; no file written outside the folder the test made for it. The
counts are reported in docs/serving.md's reliability section.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mopar.bundle.function import FunctionSpec
from mopar.codec import PayloadError
from mopar.errors import MoparError
from mopar.runner.bundle import read_manifest
from mopar.runner.processes import ServerProcess
from mopar.runtime.aws import LambdaFunction
from mopar.runtime.frame import decode_payloads, encode_frame, split_frame

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLES = int(os.environ.get("MOPAR_FUZZ_EXAMPLES", "10000"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # no .hypothesis folder: nothing written outside the test's own
    suppress_health_check=list(HealthCheck),
)
SOCKET_TIMEOUT_S = 10.0
"""How long a fuzzed HTTP request may take to be answered (the server's read timeout is less)."""


class Counter:
    """How many generated inputs an interface was given, and how each was answered."""

    def __init__(self) -> None:
        self.n = 0
        self.kinds: dict[str, int] = {}

    def saw(self, kind: str) -> None:
        self.n += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


def _report(name: str, counter: Counter) -> None:
    print(f"fuzz {name}: {counter.n} inputs, {dict(sorted(counter.kinds.items()))}")
    assert counter.n >= EXAMPLES


def _valid_frame(rng: np.random.Generator) -> bytes:
    return encode_frame(
        {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)},
        {"x": rng.choice(["none", "zstd", "fp16", "int8"])},
    )


def _mutations(base: bytes) -> st.SearchStrategy[bytes]:
    """``base`` with bytes flipped, cut short, extended, or a length field overwritten."""

    def flip(edits: list[tuple[int, int]]) -> bytes:
        out = bytearray(base)
        for i, value in edits:
            out[i % len(out)] = value
        return bytes(out)

    def cut(k: int) -> bytes:
        return base[: k % (len(base) + 1)]

    def grow(extra: bytes) -> bytes:
        return base + extra

    def length(at: int, value: int) -> bytes:
        out = bytearray(base)
        at %= max(1, len(out) - 8)
        out[at : at + 8] = struct.pack("<Q", value)
        return bytes(out)

    return st.one_of(
        st.lists(
            st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8
        ).map(flip),
        st.integers(0, 1 << 20).map(cut),
        st.binary(max_size=64).map(grow),
        st.builds(length, st.integers(0, 1 << 16), st.integers(0, 2**64 - 1)),
    )


BASE_FRAME = _valid_frame(np.random.default_rng(0))


def test_frames(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    counter = Counter()

    @SETTINGS
    @given(st.one_of(st.binary(max_size=256), _mutations(BASE_FRAME)))
    def fuzz(data: bytes) -> None:
        try:
            decode_payloads(split_frame(data))
            counter.saw("decoded")
        except PayloadError as exc:
            assert "\n" not in str(exc)
            counter.saw("refused")

    fuzz()
    _report("frames", counter)
    assert not list(tmp_path.iterdir())


# --- HTTP, to a real function server -------------------------------------------------------------

_METHODS = st.sampled_from(["POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "X" * 300])
_PATHS = st.one_of(
    st.sampled_from(["/", "/_/health", "/_/callback/x", "//", "/%00", "/" + "a" * 5000]),
    st.text(max_size=40).map(lambda t: "/" + t.replace("\r", "").replace("\n", "")),
)
_HEADERS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "Content-Type", "Content-Length", "Accept", "Transfer-Encoding", "X-Mopar-Ref",
                "X-Mopar-Handshake", "X-Mopar-Warm", "X-Mopar-Async", "X-Mopar-Callback",
                "Expect", "Connection", "X-Junk",
            ]
        ),
        st.one_of(
            st.sampled_from(
                [
                    "application/octet-stream", "application/json", "application/x-npy",
                    "application/x-npz", "chunked", "0", "-1", "99999999999999999999", "1",
                    "redis:abc", "shm:../../etc/passwd", "100-continue", "close", "*/*", "",
                ]
            ),
            st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
        ),
    ),
    max_size=6,
)  # fmt: skip
_BODIES = st.one_of(
    st.binary(max_size=512),
    _mutations(BASE_FRAME),
    st.just(BASE_FRAME),
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        ),
        max_leaves=20,
    ).map(lambda v: json.dumps({"inputs": {"x": v}}).encode()),
)


def _request(method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers]
    if not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body


def _send(port: int, raw: bytes) -> bytes:
    """``raw`` over a new connection; what the server answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def test_http_requests(skipnet_bundle, tmp_path):
    bundle = Path(shutil.copytree(skipnet_bundle, tmp_path / "b"))
    before = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    env = {
        **os.environ,
        "MOPAR_FUNCTION_DIR": str(bundle / "functions" / "s2"),
        "PORT": "0",
        "MOPAR_HOST": "127.0.0.1",
        "MOPAR_SHM_DIR": str(tmp_path / "shm"),
        "MALLOC_ARENA_MAX": "1",
    }
    server = ServerProcess(
        [sys.executable, "-m", "mopar.runtime.server"], env, "s2", 60, cwd=tmp_path
    )
    counter = Counter()
    try:

        @SETTINGS
        @given(_METHODS, _PATHS, _HEADERS, _BODIES)
        def fuzz(method, path, headers, body) -> None:
            started = time.monotonic()
            try:
                answer = _send(server.port, _request(method, path, headers, body))
            except TimeoutError:
                pytest.fail(
                    f"no answer within {SOCKET_TIMEOUT_S} s to {method} {path[:40]} {headers}"
                )
            assert time.monotonic() - started < SOCKET_TIMEOUT_S + 1
            assert server.proc.poll() is None, "the server died"
            status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b"none"
            assert not status.startswith(b"5") or status in (b"501", b"505"), answer[:300]
            assert b"Traceback" not in answer
            counter.saw(status.decode("latin-1"))

        fuzz()
        frame = _frame_for(bundle / "functions" / "s2")
        good = _send(
            server.port,
            _request("POST", "/", [("Content-Type", "application/octet-stream")], frame),
        )
        assert good.startswith(b"HTTP/1.1 200"), good[:200]
    finally:
        server.stop()
    _report("http", counter)
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if p.name not in ("b", "shm")]
    assert not list((tmp_path / "shm").glob("*")) if (tmp_path / "shm").exists() else True


def _frame_for(function_dir: Path) -> bytes:
    """A frame of what the function receives (its function.json), zeros."""
    spec = FunctionSpec.load(function_dir)
    return encode_frame({t.name: np.zeros(t.shape, t.dtype) for t in spec.receives})


# --- Lambda events ---------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


_KEYS = [
    "mopar",
    "frame",
    "ref",
    "warm",
    "inputs",
    "body",
    "isBase64Encoded",
    "headers",
    "async",
    "request",
]
_EVENTS = st.one_of(
    _JSON,
    st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=5),
    st.builds(
        lambda frame, extra: {"mopar": 1, "frame": frame, **extra},
        st.one_of(st.text(max_size=40), st.binary(max_size=64).map(_b64)),
        st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=2),
    ),
    st.builds(
        lambda body, b64, ctype: {
            "version": "2.0",
            "body": body,
            "isBase64Encoded": b64,
            "headers": {"content-type": ctype},
        },
        st.text(max_size=60),
        st.booleans(),
        st.sampled_from(["application/json", "application/octet-stream", "application/x-npz", "text/plain", ""]),
    ),
)  # fmt: skip


def test_lambda_events(skipnet_bundle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fn = LambdaFunction(skipnet_bundle / "functions" / "s2", {})
    counter = Counter()

    @SETTINGS
    @given(_EVENTS)
    def fuzz(event) -> None:
        answer = fn(event, None)
        assert isinstance(answer, dict)
        status = answer.get("status") or answer.get("statusCode") or 200
        assert status < 500, answer  # a slice that works fails no request
        counter.saw(str(status))

    fuzz()
    _report("lambda", counter)
    assert not list(tmp_path.iterdir())


# --- plan.json and function.json ------------------------------------------------------------------


def _mutated_json(original: dict) -> st.SearchStrategy[object]:
    """``original`` with one field replaced, removed, or the whole document another value."""
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node[:3]):
                walk(v, (*path, i))

    walk(original, ())

    def replace(path, value, remove):
        doc = json.loads(json.dumps(original))
        if not path:
            return value
        node = doc
        for key in path[:-1]:
            node = node[key]
        if remove and isinstance(node, dict):
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
        return doc

    return st.one_of(st.builds(replace, st.sampled_from(paths), _JSON, st.booleans()), _JSON)


def test_plan_and_function_json(skipnet_bundle, tmp_path):
    bundle = Path(shutil.copytree(skipnet_bundle, tmp_path / "b"))
    plan_file, spec_dir = bundle / "plan.json", bundle / "functions" / "s1"
    plan, spec = (
        json.loads(plan_file.read_text()),
        json.loads((spec_dir / "function.json").read_text()),
    )
    counter = Counter()

    @SETTINGS
    @given(st.booleans(), st.data())
    def fuzz(which_plan: bool, data) -> None:
        doc = data.draw(_mutated_json(plan if which_plan else spec))
        target = plan_file if which_plan else spec_dir / "function.json"
        target.write_text(json.dumps(doc))
        try:
            read_manifest(bundle) if which_plan else FunctionSpec.load(spec_dir)
            counter.saw("read")
        except MoparError as exc:
            assert "\n" not in str(exc).strip()
            counter.saw("refused")

    fuzz()
    _report("plan.json and function.json", counter)
    assert not [p for p in tmp_path.iterdir() if p.name != "b"]
    shutil.rmtree(bundle)


# --- CLI option values ----------------------------------------------------------------------------

_NUMBERS = st.one_of(
    st.sampled_from(["nan", "NaN", "inf", "-inf", "0", "-1", "1e309", "1e-320", "", " ", "1,5", "0x10", "1_000"]),
    st.floats().map(repr),
    st.integers(-(2**70), 2**70).map(str),
    st.text(max_size=8),
)  # fmt: skip
_OPTIONS = {
    "run": ["--timeout", "--requests", "--concurrency", "--instances", "--idle-s", "--rtol", "--atol"],
    "load": ["--rate", "--duration", "--max-in-flight"],
    "max-rate": ["--slo-ms", "--rate", "--duration"],
    "simulate": ["--rate", "--duration", "--requests", "--instances", "--idle-s", "--seed"],
    "invoke": ["--timeout"],
    "serve": ["--port", "--timeout"],
}  # fmt: skip


def test_cli_option_values(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mopar.cli import cli

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    counter = Counter()
    missing = str(tmp_path / "no-bundle")

    @SETTINGS
    @given(st.sampled_from(sorted(_OPTIONS)), st.data())
    def fuzz(command: str, data) -> None:
        option = data.draw(st.sampled_from(_OPTIONS[command]))
        value = data.draw(_NUMBERS)
        args = [command, missing, option, value]
        if command == "invoke":
            args += ["--input", str(tmp_path / "none.npz")]
        if command in ("load", "max-rate"):  # what each requires, valid: the option is the fuzzed
            args = [*args, "--rate", "1"] if option != "--rate" else args
            args = (
                [*args, "--slo-ms", "1"] if command == "max-rate" and option != "--slo-ms" else args
            )
        result = runner.invoke(cli, args)
        assert result.exit_code == 1, (args, result.output, result.exception)
        assert "Traceback" not in result.output and "internal error" not in result.output
        assert not isinstance(result.exception, Exception) or isinstance(
            result.exception, SystemExit
        )
        counter.saw(f"{command} exit {result.exit_code}")

    fuzz()
    _report("cli", counter)
    assert not list(tmp_path.iterdir())
