"""Limits that hold under abuse (issue 33): the function server's bodies, read timeouts and
connections; the open-loop load generator; numeric options of the CLI and the API."""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np
import pytest

from mopar.runner.chain import ServerProcess
from mopar.runtime.bodies import Limits
from mopar.runtime.httpd import HEAD_BYTES, ServerLimits
from mopar.runtime.transports import HttpClient
from mopar.runtime.wire import encode

# --- the function server --------------------------------------------------------------------------

MAX_BODY = 16 << 10
"""The largest frame of the test function, bytes (a slice that takes ~16 KB)."""
LIMIT = Limits.of((), frame_bytes=MAX_BODY).of_format(None)
"""Its limit of an ``application/octet-stream`` body (a frame, .npy or .npz), bytes."""

_SERVE = """
import json, os
from mopar.bench.hops import _Sink
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
    import os

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


def test_a_body_over_the_limit_is_refused_from_its_content_length_before_it_is_sent(server):
    sock = _connect(server, _head(1_090_000))  # the head alone: no byte of the body
    with sock:
        status, body = _answer(sock)
    assert status == 413
    assert "body of 1090000 bytes exceeds the" in body["error"]
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
