"""``mopar bench --hops``: what handing a tensor from one process to the next costs, per transport.

Read `measure_hops` first. For each size, one tensor of that many bytes (float32) is handed
over again and again, and each figure is the median of one handoff's wall time:

- ``memcpy``: `np.copyto` of the same bytes in one process, the floor;
- ``shm``: the local runner's path (`mopar.runner.shmbuf`): the sender writes the tensor into a
  reusable mapped buffer and writes one byte on a pipe; a second process wakes, takes a view of
  the tensor, sums its first and last element (so its pages are touched) and answers with one
  byte. Two real processes, real pipes;
- ``http``: the wire payload POSTed over one persistent connection to a server in a second
  process on 127.0.0.1, which reads it whole and decodes it before answering 204;
- ``redis``: listed, not measured yet (the row says whether ``redis-server`` is on PATH).

Every transport is timed for at most ``budget_s`` seconds per size (at least 3 handoffs).
Child processes are this module run as a script (``python -m mopar.bench.hops shm|http``).
"""

from __future__ import annotations

import http.client
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopar.runner.local import shm_root
from mopar.runner.shmbuf import BufferPool
from mopar.runtime.wire import decode, encode

__all__ = ["DEFAULT_SIZES", "HopResult", "measure_hops", "within_goal"]

DEFAULT_SIZES = (16 << 10, 1 << 20, 10 << 20, 100 << 20)
"""Bytes handed over: 16 KB, 1 MB, 10 MB, 100 MB."""
_NAME = "r0x0-v0.t"


@dataclass(frozen=True, kw_only=True)
class HopResult:
    """One transport at one size. Times in microseconds; None where it was not measured."""

    transport: str
    bytes: int
    p50_us: float | None
    handoffs: int
    note: str = ""


def _timed(step: Callable[[], None], budget_s: float, max_n: int = 2000) -> tuple[float, int]:
    for _ in range(2):  # warm: fault the buffers in, open the connection
        step()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_n and (len(times) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6, len(times)


def _child(kind: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mopar.bench.hops", kind, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)


def _memcpy(array: np.ndarray, budget_s: float) -> tuple[float, int]:
    dest = np.empty_like(array)
    return _timed(lambda: np.copyto(dest, array), budget_s)


def _shm(array: np.ndarray, budget_s: float) -> tuple[float, int]:
    folder = Path(tempfile.mkdtemp(prefix="mopar-hops-", dir=shm_root()))
    proc = _child("shm", str(folder))
    pool = BufferPool(folder)
    wake, ack = proc.stdin.fileno(), proc.stdout.fileno()

    def step() -> None:
        pool.write(_NAME, array)
        os.write(wake, b"\n")
        if os.read(ack, 1) != b"\n":
            raise RuntimeError("the shm reader process failed")

    try:
        return _timed(step, budget_s)
    finally:
        pool.close()
        proc.stdin.close()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def _http(array: np.ndarray, budget_s: float) -> tuple[float, int]:
    proc = _child("http")
    try:
        port = int(proc.stdout.readline())
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def step() -> None:
            body = encode(array)
            conn.request("POST", "/", body=body, headers={"Content-Type": "application/octet-stream"})
            resp = conn.getresponse()
            resp.read()
            if resp.status != 204:
                raise RuntimeError(f"the http reader answered {resp.status}")

        return _timed(step, budget_s)
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait(timeout=10)


def measure_hops(*, sizes: tuple[int, ...] = DEFAULT_SIZES, budget_s: float = 2.0) -> list[HopResult]:
    """Time one handoff of each size through every transport, and a memcpy of it.

    Args:
        sizes: bytes per tensor (rounded down to whole float32 elements, at least one).
        budget_s: seconds of timing per transport and size (each also runs at least 3 times).
    """
    results = []
    for size in sizes:
        array = np.random.default_rng(0).standard_normal(max(1, size // 4)).astype(np.float32)
        for name, fn in (("memcpy", _memcpy), ("shm", _shm), ("http", _http)):
            p50, n = fn(array, budget_s)
            results.append(HopResult(transport=name, bytes=array.nbytes, p50_us=round(p50, 1),
                                     handoffs=n))
        note = ("redis-server is not on PATH: not measured" if shutil.which("redis-server") is None
                else "not measured yet by mopar bench --hops")
        results.append(HopResult(transport="redis", bytes=array.nbytes, p50_us=None, handoffs=0,
                                 note=note))
    return results


def within_goal(p50_us: float, memcpy_us: float) -> bool:
    """Issue 16's goal for one handoff: at most 2x a memcpy of the same bytes plus 100 us."""
    return p50_us <= 2 * memcpy_us + 100


# -- the second process ---------------------------------------------------------------------------


def _shm_reader(folder: str) -> None:
    pool = BufferPool(Path(folder))
    while os.read(0, 1) == b"\n":
        x = pool.read(_NAME)
        float(x[0]) + float(x[-1])
        os.write(1, b"\n")


class _Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        length = int(self.headers["Content-Length"])
        body = bytearray(length)
        view, got = memoryview(body), 0
        while got < length:
            n = self.rfile.readinto(view[got:])
            if not n:
                return
            got += n
        decode(body)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _http_sink() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Sink)
    os.write(1, f"{server.server_address[1]}\n".encode())
    server.serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "shm":
        _shm_reader(sys.argv[2])
    else:
        _http_sink()
