"""Limits that hold under abuse (issue 33): the function server's bodies, read timeouts and
connections; the open-loop load generator; numeric options of the CLI and the API."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

import mopar
from mopar.cli import cli
from mopar.config import RunConfig
from mopar.errors import InputSpecError, OptionError
from mopar.frontend.inputs import InputSpec, make_example_arrays, parse_input_spec
from mopar.runner import shm_session
from mopar.runner.load import MAX_RATE_RPS, Drops, find_max_rate, load_summary
from mopar.runner.processes import ServerProcess
from mopar.runtime.bodies import Limits
from mopar.runtime.httpd import HEAD_BYTES, PEEK_BYTES, ServerLimits
from mopar.runtime.transports import HttpClient
from mopar.runtime.wire import encode

# --- the function server --------------------------------------------------------------------------

MAX_BODY = 16 << 10
"""The largest frame of the test function, bytes (a slice that takes ~16 KB)."""
LIMIT = Limits.of((), frame_bytes=MAX_BODY).of_format(None)
"""Its limit of an ``application/octet-stream`` body (a frame, .npy or .npz), bytes."""

_SERVE = """
import json, os
from benchmarks.hops import _Sink
from mopar.runtime.server import FunctionApp, create_function_server
from mopar.runtime.transports import Receiver

app = FunctionApp(_Sink({max_body}), None, Receiver())
server = create_function_server(
    app, host="127.0.0.1", port=0, threads=2, max_body=app.max_body, env=os.environ
)
print(json.dumps({{"event": "ready", "port": server.effective_port}}), flush=True)
server.run()
"""


def _server(**env: str) -> ServerProcess:
    """A function server process of a stand-in slice that takes frames of `MAX_BODY`."""
    cmd = [sys.executable, "-c", _SERVE.format(max_body=MAX_BODY)]
    return ServerProcess(cmd, {**os.environ, **env}, "limits", timeout_s=30)


@pytest.fixture(scope="module")
def server():
    """Sized as it sizes itself (read timeout ~10 s)."""
    proc = _server()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def quick_server():
    """With a read timeout of 1 s."""
    proc = _server(MOPAR_READ_TIMEOUT_S="1")
    yield proc
    proc.stop()


def _valid(server: ServerProcess) -> int:
    body = encode(np.ones(16, np.float32))
    return HttpClient(server.url, timeout_s=5, retries=0).post(body, {}).status


def _connect(server: ServerProcess, head: bytes, timeout_s: float = 8.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s)
    sock.sendall(head)
    return sock


def _head(length: int | None, **headers: str) -> bytes:
    lines = ["POST / HTTP/1.1", "Host: x", "Content-Type: application/octet-stream"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    lines += [] if length is None else [f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on ``sock`` (read to its close)."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_over_the_limit_is_refused_once_its_head_is_in_before_the_rest_is_sent(server):
    # its first PEEK_BYTES, no tensor header there: the 413 of its size, and no more is read
    sock = _connect(server, _head(1_090_000) + b"\0" * PEEK_BYTES)
    with sock:
        status, body = _answer(sock)
    assert status == 413
    assert "body of 1090000 bytes exceeds the" in body["error"]
    assert _valid(server) == 200


def test_a_client_that_expects_100_continue_is_told_to_send_the_head_then_refused(server):
    sock = _connect(server, _head(1_090_000, Expect="100-continue"))
    with sock:
        assert sock.recv(1 << 10).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"\0" * PEEK_BYTES)
        status, body = _answer(sock)
    assert status == 413, body
    assert _valid(server) == 200


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(server):
    sock = _connect(server, _head(None, Transfer_Encoding="chunked"))
    with sock:
        piece = b"x" * 4096
        for _ in range(LIMIT // len(piece) + 2):  # past the limit; never its last chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, body = _answer(sock)
    assert status == 413 and "exceeds the" in body["error"]
    assert _valid(server) == 200


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (within the socket's timeout)."""
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_requests_that_do_not_arrive_within_the_read_timeout_are_closed(quick_server):
    stalled = _connect(quick_server, _head(1000) + b"x" * 10)
    trickling = _connect(quick_server, _head(1000) + b"x" * 10)
    with stalled, trickling:
        try:
            for _ in range(10):  # a byte now and then: active, and still too slow
                time.sleep(0.3)
                trickling.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed
        assert _closed(stalled) and _closed(trickling)
    assert _valid(quick_server) == 200


def test_more_slow_clients_than_waitress_default_cap_do_not_stop_a_valid_request(server):
    hostile = [_connect(server, _head(MAX_BODY) + b"x" * 100) for _ in range(150)]
    try:
        assert _valid(server) == 200  # within its 5 s, while all 150 wait for their bodies
    finally:
        for sock in hostile:
            sock.close()


def test_the_connection_cap_follows_the_function_memory_and_the_read_timeout_its_body():
    small = ServerLimits.sized(1 << 20, threads=2, memory_bytes=64 << 20)
    assert small.connections == (16 << 20) // ((1 << 20) + HEAD_BYTES)  # a quarter of 64 MB
    tiny = ServerLimits.sized(100 << 20, threads=2, memory_bytes=128 << 20)
    assert tiny.connections == 4  # never under twice its threads
    large = ServerLimits.sized(1 << 20, threads=2, memory_bytes=64 << 30)
    assert small.connections < large.connections
    assert small.read_timeout_s < ServerLimits.sized(1 << 30, threads=2).read_timeout_s


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
def test_server_limits_from_the_environment_refuse_what_is_not_a_positive_number(value):
    with pytest.raises(ValueError, match="MOPAR_READ_TIMEOUT_S="):
        ServerLimits.from_env({"MOPAR_READ_TIMEOUT_S": value}, 1000, threads=2)
    limits = ServerLimits.from_env({"MOPAR_READ_TIMEOUT_S": "2.5"}, 1000, threads=2)
    assert limits.read_timeout_s == 2.5


# --- the open-loop load generator -----------------------------------------------------------------


class _Unanswered:
    """What `ShmSession.serve_open` uses of a session, with requests that are never answered."""

    def __init__(self, max_in_flight: int) -> None:
        self.config = RunConfig(rate=MAX_RATE_RPS, duration_s=0.2, max_in_flight=max_in_flight)
        self.state: dict[int, dict] = {}
        self.records: list[tuple[float, float | None]] = []
        self.errors: list[str] = []
        self.drops = Drops()
        self.window = [0.0, 0.0]
        self.kept_slots: list[int] = []

    def _begin(self, inputs, t0: float, expected, measure: bool) -> None:
        self.state[len(self.state)] = {"t0": t0}

    def _step(self, *, wake_at: float | None = None) -> None:
        time.sleep(min(0.01, max(0.0, (wake_at or 0) - time.perf_counter())))

    def _fail(self, st: dict, message: str) -> None:
        self.errors.append(message)

    def _finish(self, rid: int, st: dict, *, reuse_slot: bool = True) -> None:
        del self.state[rid]
        self.records.append((st["t0"] - self.window[0], None))
        self.kept_slots += [] if reuse_slot else [rid]


def test_an_open_loop_drops_what_it_cannot_send_and_ends_at_its_duration_plus_the_grace(
    monkeypatch,
):
    monkeypatch.setattr(shm_session, "GRACE_S", 0.2)
    session = _Unanswered(max_in_flight=5)
    serving = threading.Thread(
        target=shm_session.ShmSession.serve_open,
        args=(session, {}),
        kwargs=dict(rate=MAX_RATE_RPS, duration_s=0.2, expected=None),
        daemon=True,
    )
    serving.start()
    serving.join(20)
    assert not serving.is_alive(), "the open loop did not end"
    assert session.state == {} and session.kept_slots == [0, 1, 2, 3, 4]
    assert len(session.records) == len(session.errors) == 5  # the 5 sent, failed at the end
    assert "grace" in session.errors[0]
    assert session.drops.total > 100  # the rest: counted, not kept one by one
    summary = load_summary(session.records, session.config, 0.4, drops=session.drops)
    assert summary["offered"] == 5 + session.drops.total
    assert summary["dropped"] == session.drops.total
    assert sum(b["errors"] for b in summary["series"]) == summary["offered"]


def test_a_rate_the_runner_cannot_generate_is_refused_before_anything_starts(tmp_path):
    result = CliRunner().invoke(cli, ["load", str(tmp_path / "b"), "--rate", "1e9"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    assert "--rate 1e+09 is not a rate the local runner can generate" in result.output
    with pytest.raises(OptionError, match="at most 10000 requests per second"):
        shm_session.ShmSession.serve_open(_Unanswered(1), {}, rate=1e9, duration_s=1, expected=None)


def test_the_max_rate_search_never_asks_for_more_than_the_runner_can_generate():
    best, steps = find_max_rate(lambda rate: (1.0, 0), slo_ms=10, start=100)
    assert max(s.rate for s in steps) == best == MAX_RATE_RPS


# --- numeric options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (["run", "B", "--timeout", "0"], "--timeout"),
        (["run", "B", "--timeout", "-1"], "--timeout"),
        (["run", "B", "--timeout", "inf"], "--timeout"),
        (["run", "B", "--timeout", "nan"], "--timeout"),
        (["load", "B", "--rate", "nan"], "--rate"),
        (["run", "B", "--rtol", "nan"], "--rtol"),
        (["load", "B", "--duration", "inf"], "--duration"),
        (["serve", "B", "--timeout", "nan"], "--timeout"),
        (["invoke", "B", "--input", "x.npz", "--timeout", "inf"], "--timeout"),
        (["plan", "m.pt2", "--max-slowdown", "nan"], "--max-slowdown"),
        (["plan", "m.pt2", "--slo-ms", "nan"], "--slo-ms"),
        (["plan", "m.pt2", "--rate", "inf"], "--rate"),
        (["compile", "m.pt2", "--rtol", "nan"], "--rtol"),
        (["simulate", "B", "--rate", "nan"], "--rate"),
    ],
)
def test_a_numeric_option_refuses_nan_infinities_and_out_of_range_values(args, option):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1, result.output
    assert f"Invalid value for '{option}'" in result.output


@pytest.mark.parametrize("name", ["slo_ms", "max_slowdown", "rate", "cold_start_rate", "rtol"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_an_api_option_refuses_nan_and_infinities(name, value, tmp_path):
    with pytest.raises(OptionError, match=f"{name}={value!r} is not a finite number"):
        mopar.compile(None, None, out=tmp_path / "b", **{name: value})


def test_an_input_larger_than_memory_is_refused_before_it_is_allocated():
    spec = "x=99999999x99999999x99999:float32"
    with pytest.raises(InputSpecError, match="more than this machine's memory"):
        parse_input_spec(spec)
    wide = InputSpec(name="x", shape=(1 << 20, 1 << 20, 1 << 20), dtype="float32")
    with pytest.raises(InputSpecError, match="more than this machine's memory"):
        make_example_arrays((wide,))
