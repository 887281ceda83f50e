"""The served functions and their handoffs, through real servers on 127.0.0.1 and a real
redis-server: every transport reproduces the model, concurrent requests never mix, bad requests
get a 4xx and leave the server up, and unreachable hops fail with a clear message."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mopar.bundle.document import Io
from mopar.bundle.function import FunctionSpec
from mopar.config import RunConfig
from mopar.emit.functions import function_specs
from mopar.plan import RESPONSE, Function, Plan
from mopar.runner.bundle import read_manifest, read_reference
from mopar.runner.chain import ChainSession
from mopar.runner.check import compare_outputs
from mopar.runner.local import run_bundles
from mopar.runner.processes import ServerProcess, free_port, listening_socket
from mopar.runtime import wire
from mopar.runtime.core import RequestError
from mopar.runtime.frame import decode_payloads, encode_frame, join_frame, split_frame
from mopar.runtime.server import read_body
from mopar.runtime.transports import Hop, HopError, HttpClient
from tests import models
from tests.conftest import chain_plan, eager, needs_redis


def _server(bundle: Path, slice_name: str, **env: str) -> ServerProcess:
    base = dict(
        os.environ,
        PORT="0",
        MOPAR_HOST="127.0.0.1",
        MOPAR_THREADS="4",
        MOPAR_FUNCTION_DIR=str(bundle / "functions" / slice_name),
    )
    return ServerProcess(
        [sys.executable, "-m", "mopar.runtime.server"], {**base, **env}, slice_name, timeout_s=60
    )


def _inputs(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)}


# --- function.json ------------------------------------------------------------------------------


def test_function_specs_chain_the_bundle_slices(skipnet_bundle):
    specs = [FunctionSpec.load(skipnet_bundle / "functions" / f"s{i}") for i in range(3)]
    assert [s.index for s in specs] == [0, 1, 2] and specs[-1].last
    assert [t.name for t in specs[0].receives] == ["x"]
    # every tensor a slice receives was sent by the one before, and nothing else is sent
    for before, after in zip(specs, specs[1:]):
        assert list(before.sends) == [t.name for t in after.receives]
    assert list(specs[-1].returns.values()) == ["output_0"]


def test_function_specs_carry_a_skip_tensor_through_a_slice_that_does_not_read_it():
    t = lambda name: {"name": name, "shape": [2], "dtype": "float32", "nbytes": 8}  # noqa: E731
    plan = chain_plan([Function(name=n, memory_mb=128) for n in "abc"])
    doc = {
        "io": {
            "inputs": [t("x")],
            "outputs": [{"name": "out", "value": "r", "shape": [2], "dtype": "float32"}],
            "functions": [
                {"name": "a", "inputs": [t("x")], "outputs": [t("p")], "codecs": {"p": "fp16"}},
                {"name": "b", "inputs": [t("p")], "outputs": [t("q")]},
                {"name": "c", "inputs": [t("p"), t("q")], "outputs": [t("r")]},
            ],
        }
    }
    a, b, c = function_specs(plan, Io.from_dict(doc["io"]))
    assert [x.name for x in b.receives] == ["p"] and b.sends == ("p", "q")
    assert b.receives[0].codec == "fp16"  # carried as a sent it: fp16, never re-encoded
    assert [x.name for x in c.receives] == ["p", "q"] and c.sends == ("r",)
    assert c.returns == {"r": "out"} and c.transport is None and a.transport == "http"
    # an answer over the payload limit: the last function hands it on through the store
    answer = [replace(e, transport="redis") if e.dst == RESPONSE else e for e in plan.edges]
    stored = Plan.from_dict(json.loads(replace(plan, edges=tuple(answer)).to_json()))
    assert stored.answer == "redis" and plan.answer == "response"
    assert function_specs(stored, Io.from_dict(doc["io"]))[-1].transport == "redis"


# --- chains through each transport ---------------------------------------------------------------


@pytest.mark.parametrize("transport", ["http", pytest.param("redis", marks=needs_redis)])
def test_chain_reproduces_the_model_through_real_servers(skipnet_bundle, transport):
    manifest = read_manifest(skipnet_bundle)
    inputs, expected = read_reference(skipnet_bundle / "reference.npz")
    report = run_bundles(
        [manifest],
        inputs,
        config=RunConfig(requests=4, concurrency=2),
        expected=expected,
        transport=transport,
    )[0]
    assert report.errors == 0, report.error_messages
    assert report.requests == 4 and report.transport == transport
    assert report.max_rel_err <= 1e-5
    assert all(s.p50_ms is not None and s.peak_rss_mb > 0 for s in report.slices)


@pytest.mark.parametrize("transport", ["http", pytest.param("redis", marks=needs_redis), "shm"])
def test_200_distinct_requests_at_concurrency_16_all_get_their_own_answer(
    skipnet_bundle, transport, request, tmp_path
):
    redis_url = request.getfixturevalue("redis_url") if transport == "redis" else ""
    model = models.skipnet()
    session = ChainSession(
        read_manifest(skipnet_bundle),
        RunConfig(concurrency=16),
        transport=transport,
        redis_url=redis_url,
        shm_dir=str(tmp_path),
    )
    try:
        session.start()
        client = HttpClient(session.servers[0].url, timeout_s=60)

        def one(seed: int) -> float:
            inputs = _inputs(seed)
            answer = client.post(encode_frame(inputs), {})
            assert answer.status == 200, answer.error()
            got = decode_payloads(split_frame(answer.body))
            want = {"output_0": eager(model, inputs).numpy()}
            return compare_outputs(got, want).max_rel_err

        with ThreadPoolExecutor(max_workers=16) as pool:
            errors = list(pool.map(one, range(200)))
    finally:
        session.stop()
    assert len(errors) == 200 and max(errors) <= 1e-5
    assert list(tmp_path.iterdir()) == [], "every shm frame was consumed"


def test_cli_run_transport_http_checks_against_the_reference(skipnet_bundle):
    from tests.conftest import mopar

    proc = mopar(
        "run", skipnet_bundle, "--transport", "http", "--check", "--requests", "3", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["transport"] == "http" and report["errors"] == 0
    assert report["max_rel_err"] <= 1e-4


# --- ports -------------------------------------------------------------------------------------


def test_a_server_listens_on_the_socket_it_inherits_and_the_runner_keeps_no_copy(skipnet_bundle):
    """The port is bound before the spawn and never freed, so no other process can take it."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    server = ServerProcess(
        [sys.executable, "-m", "mopar.runtime.server"],
        dict(os.environ, MOPAR_FUNCTION_DIR=str(skipnet_bundle / "functions" / "s0")),
        "s0",
        timeout_s=60,
        sock=sock,
    )
    try:
        assert sock.fileno() == -1  # handed over, and closed here
        assert server.url == f"http://127.0.0.1:{port}/"
        answer = HttpClient(server.url, timeout_s=30).post(encode_frame(_inputs(0)), {})
        assert answer.status == 200, answer.error()
    finally:
        server.stop()


def test_a_port_for_a_server_that_binds_its_own_is_below_the_ephemeral_range_at_random():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    top = low if low > 11000 else 65536  # no room below a range that starts low
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < top for p in ports) and len(ports) > 1


@needs_redis
def test_a_private_redis_takes_another_port_where_its_first_is_taken(monkeypatch):
    """Another run's server on the port is never taken for ours: ours exits, and the next
    port is tried."""
    from mopar.runner import processes

    with socket.socket() as taken:  # what holds the first port: a listener that hangs up
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken.settimeout(0.05)
        first = taken.getsockname()[1]
        ports = iter([first, free_port()])
        monkeypatch.setattr(processes, "free_port", lambda: next(ports))
        done = threading.Event()

        def hang_up() -> None:
            # (one that never answers gives the same refusal a socket timeout later)
            while not done.is_set():
                with contextlib.suppress(OSError):
                    taken.accept()[0].close()

        listener = threading.Thread(target=hang_up, daemon=True)
        listener.start()
        try:
            with processes.local_redis() as url:
                import redis

                assert not url.startswith(f"redis://127.0.0.1:{first}/")
                assert redis.Redis.from_url(url).ping()
        finally:
            done.set()
            listener.join()


@needs_redis
def test_a_silent_listener_on_the_port_is_given_up_on_within_the_timeout():
    """A listener that accepts and never answers, while the server is still up, holds the
    check no longer than its timeout (redis-py's own retries once held it some 15 s)."""
    from mopar.runner import processes

    with socket.socket() as silent, subprocess.Popen(["sleep", "30"]) as alive:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        began = time.monotonic()
        try:
            assert not processes._answers(alive, silent.getsockname()[1], timeout_s=2.0)
        finally:
            alive.kill()
        assert time.monotonic() - began < 4.0


# --- shm handshake -------------------------------------------------------------------------------


def test_shm_hop_uses_the_shared_folder_and_falls_back_to_http_when_not_shared(
    skipnet_bundle, tmp_path
):
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    server = _server(skipnet_bundle, "s0", MOPAR_SHM_DIR=str(shared))
    frame = encode_frame(_inputs(0))
    try:
        for folder, expect in ((shared, "shm"), (elsewhere, "http")):
            hop = Hop(server.url, "shm", shm_dir=str(folder))
            answer = hop.send(frame)  # s0 alone answers with its outgoing frame
            assert answer.status == 200, answer.error()
            assert hop.transport == expect
            assert list(folder.iterdir()) == []  # handshake file and frame both gone
    finally:
        server.stop()


# --- bad requests: 4xx, clear, and the server stays up -------------------------------------------


@pytest.fixture(scope="module")
def last_server(skipnet_bundle):
    server = _server(skipnet_bundle, "s2")
    yield server
    server.stop()


def _post(server, body: bytes, headers: dict | None = None):
    return HttpClient(server.url, timeout_s=30).post(body, headers or {})


def _good_frame(bundle: Path) -> bytes:
    spec = FunctionSpec.load(bundle / "functions" / "s2")
    rng = np.random.default_rng(0)
    return encode_frame(
        {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in spec.receives}
    )


@pytest.mark.parametrize(
    "case",
    [
        "garbage",
        "truncated",
        "wrong dtype",
        "wrong shape",
        "missing tensor",
        "bad ref",
        "consumed ref",
        "oversized",
        "content type",
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_server_stays_up(skipnet_bundle, last_server, case):
    good = _good_frame(skipnet_bundle)
    payloads = split_frame(good)
    name = next(iter(payloads))
    array = wire.decode(payloads[name])
    body, headers, status, words = {
        "garbage": (b"not a frame at all", {}, 400, "malformed frame"),
        "truncated": (good[:-10], {}, 400, "malformed frame"),
        "wrong dtype": (
            join_frame({**payloads, name: wire.encode(array.astype(np.int32))}),
            {},
            400,
            "expected float32",
        ),
        "wrong shape": (
            join_frame({**payloads, name: wire.encode(array[..., :-1])}),
            {},
            400,
            "expected float32",
        ),
        "missing tensor": (join_frame({}), {}, 400, "missing"),
        "bad ref": (b"", {"X-Mopar-Ref": "shm:../../etc/passwd"}, 400, "not a mopar frame"),
        "consumed ref": (b"", {"X-Mopar-Ref": "shm:f-" + "0" * 32}, 410, "already consumed"),
        "oversized": (good + b"\0" * len(good) * 2, {}, 413, "exceeds"),
        "content type": (good, {"Content-Type": "text/csv"}, 415, "octet-stream"),
    }[case]
    answer = _post(last_server, body, headers)
    assert answer.status == status, answer.body
    assert words in answer.error()
    assert _post(last_server, good).status == 200  # still up, still right


# --- keep-alive, parts, bodies --------------------------------------------------------------------


def test_the_client_reuses_one_connection_to_the_real_server_across_requests(
    skipnet_bundle, last_server
):
    client = HttpClient(last_server.url, timeout_s=30)
    good, ports = _good_frame(skipnet_bundle), set()
    for _ in range(5):
        answer = client.post(good, {})
        assert answer.status == 200, answer.error()
        # http.client drops its socket when an answer says Connection: close
        ports.add(client._local.conn.sock.getsockname()[1])
    assert len(ports) == 1, "one kept-alive connection, one local port"


def test_a_body_sent_as_parts_is_the_body_joined(skipnet_bundle, last_server):
    good = _good_frame(skipnet_bundle)
    client = HttpClient(last_server.url, timeout_s=30)
    whole = client.post(good, {})
    parts = client.post([good[:7], memoryview(good)[7:100], bytearray(good[100:])], {})
    assert whole.status == parts.status == 200
    assert parts.body == whole.body


class _Stream:
    """A wsgi.input that is not waitress's BytesIO: readinto only, a few bytes at a time."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def readinto(self, view) -> int:
        n = min(len(view), 3, len(self.data) - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


@pytest.mark.parametrize("stream", [io.BytesIO, _Stream])
def test_read_body_reads_exactly_content_length_from_any_input_stream(stream):
    env = {"CONTENT_LENGTH": "10", "wsgi.input": stream(b"0123456789")}
    assert bytes(read_body(env, max_body=10)) == b"0123456789"


@pytest.mark.parametrize(
    "length, data, status", [("", b"x", 411), ("11", b"x" * 11, 413), ("10", b"x" * 4, 400)]
)
@pytest.mark.parametrize("stream", [io.BytesIO, _Stream])
def test_read_body_refuses_no_length_too_long_and_short_bodies(length, data, status, stream):
    with pytest.raises(RequestError) as info:
        read_body({"CONTENT_LENGTH": length, "wsgi.input": stream(data)}, max_body=10)
    assert info.value.status == status


# --- failing hops ---------------------------------------------------------------------------------


def test_an_unreachable_next_hop_is_a_502_that_names_it(skipnet_bundle):
    dead = "http://127.0.0.1:9/"  # discard port: nothing listens
    server = _server(skipnet_bundle, "s1", MOPAR_NEXT=dead, MOPAR_TRANSPORT="http")
    try:
        spec = FunctionSpec.load(skipnet_bundle / "functions" / "s1")
        frame = encode_frame({t.name: np.zeros(t.shape, t.dtype) for t in spec.receives})
        answer = _post(server, frame)
    finally:
        server.stop()
    assert answer.status == 502
    assert "127.0.0.1:9" in answer.error() and "unreachable" in answer.error()


def test_an_unreachable_redis_is_a_503_and_leaves_no_key(skipnet_bundle):
    pytest.importorskip("redis")
    server = _server(
        skipnet_bundle,
        "s0",
        MOPAR_NEXT="http://127.0.0.1:9/",
        MOPAR_TRANSPORT="redis",
        REDIS_URL="redis://127.0.0.1:9/0",
    )
    try:
        answer = _post(server, encode_frame(_inputs(0)))
    finally:
        server.stop()
    assert answer.status == 503
    assert "redis at redis://127.0.0.1:9/0 is unreachable" in answer.error()


def test_hop_client_gives_up_after_bounded_retries():
    client = HttpClient("http://127.0.0.1:9/", timeout_s=2, retries=2)
    with pytest.raises(HopError, match="after 3 attempts"):
        client.post(b"x", {})
