"""``mopar bench --hops``: what handing a tensor from one process to the next costs, per transport.

Read `measure_hops` first. For each size, one tensor of that many bytes (float32) is handed
over again and again, and each figure is the median of one handoff's wall time:

- ``memcpy``: `np.copyto` of the same bytes in one process, the floor;
- ``shm``: the local runner's path (`mopar.runner.shmbuf`): the sender writes the tensor into a
  reusable mapped buffer and writes one byte on a pipe; a second process wakes, takes a view of
  the tensor, sums its first and last element (so its pages are touched) and answers with one
  byte. Two real processes, real pipes;
- ``http``: the runtime's sending end (`Hop`, its kept-alive `HttpClient`) POSTs the tensor's wire
  payload, as `wire.encode_parts` gives it (header, then the array's own bytes), to a function
  server in a second process on 127.0.0.1. That server is the runtime's own stack
  (`create_function_server`: waitress with the functions' settings, `FunctionApp`, `read_body`,
  `Receiver`) around a stand-in slice that decodes the payload (`wire.decode`, as a slice does)
  instead of running a model; it answers 200 with an empty frame;
- ``redis``: the same, by the runtime's redis handoff: `Hop` SETs the payload in a private
  ``redis-server`` (started on a free 127.0.0.1 port, no persistence, stopped at the end) and
  POSTs its key; the server's `Receiver` GETs and DELetes it. Without ``redis-server`` on PATH,
  or the ``redis`` package, the row says so.

Every transport is timed for at most ``budget_s`` seconds per size (at least 3 handoffs).
Child processes are this module run as a script (``python -m benchmarks.hops shm|serve``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mopar.errors import MoparError
from mopar.runner.local import shm_root
from mopar.runner.shmbuf import BufferPool
from mopar.runtime.transports import Hop, Receiver
from mopar.runtime.wire import decode, encode_parts
from tools import checkout_env

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
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.hops", kind, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        bufsize=0,
        env=checkout_env(),
    )


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


class _FunctionServer:
    """The function server stack in a child process, serving the stand-in slice `_Sink`."""

    def __init__(self, max_body: int, redis_url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hops", "serve", str(max_body), redis_url],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=checkout_env(),
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(
                "the bench's function server did not start; run "
                "`python -m benchmarks.hops serve 1024 ''` to see why"
            )
        self.url = f"http://127.0.0.1:{int(line)}/"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _hop(hop: Hop) -> Callable[[np.ndarray, float], tuple[float, int]]:
    def measure(array: np.ndarray, budget_s: float) -> tuple[float, int]:
        def step() -> None:
            answer = hop.send(encode_parts(array))
            if answer.status != 200:
                raise RuntimeError(
                    f"the bench's function server answered {answer.status}: {answer.error()}"
                )

        return _timed(step, budget_s)

    return measure


@contextlib.contextmanager
def _redis() -> Iterator[tuple[str, str]]:
    """(a private redis-server's URL, "") or ("", why there is none)."""
    if shutil.which("redis-server") is None:
        yield "", "redis-server is not on PATH: not measured"
        return
    if importlib.util.find_spec("redis") is None:
        yield "", "the redis package is not installed: not measured"
        return
    from mopar.runner.processes import local_redis

    try:
        with local_redis() as url:
            yield url, ""
    except MoparError as exc:  # it did not start; the other rows still count
        yield "", f"not measured: {exc}"


def measure_hops(
    *, sizes: tuple[int, ...] = DEFAULT_SIZES, budget_s: float = 2.0
) -> list[HopResult]:
    """Time one handoff of each size through every transport, and a memcpy of it.

    Args:
        sizes: bytes per tensor (rounded down to whole float32 elements, at least one).
        budget_s: seconds of timing per transport and size (each also runs at least 3 times).
    """
    arrays = [
        np.random.default_rng(0).standard_normal(max(1, size // 4)).astype(np.float32)
        for size in sizes
    ]
    results = []
    with _redis() as (redis_url, redis_note):
        server = _FunctionServer(max(a.nbytes for a in arrays) + 4096, redis_url)
        try:
            transports = [
                ("memcpy", _memcpy),
                ("shm", _shm),
                ("http", _hop(Hop(server.url, "http"))),
            ]
            if redis_url:
                transports.append(("redis", _hop(Hop(server.url, "redis", redis_url=redis_url))))
            for array in arrays:
                for name, fn in transports:
                    p50, n = fn(array, budget_s)
                    results.append(
                        HopResult(
                            transport=name, bytes=array.nbytes, p50_us=round(p50, 1), handoffs=n
                        )
                    )
                if not redis_url:
                    results.append(
                        HopResult(
                            transport="redis",
                            bytes=array.nbytes,
                            p50_us=None,
                            handoffs=0,
                            note=redis_note,
                        )
                    )
        finally:
            server.stop()
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


@dataclass(frozen=True, kw_only=True)
class _SinkSpec:
    """What `FunctionApp` reads of a function's spec."""

    slice: str = "sink"
    index: int = 0
    max_body: int

    def max_body_bytes(self) -> int:
        return self.max_body


class _Sink:
    """A stand-in slice: decodes the one tensor payload it is sent, answers an empty frame."""

    def __init__(self, max_body: int) -> None:
        self.spec = _SinkSpec(max_body=max_body)

    def process(self, data: bytes | memoryview, fork=None, warm=None) -> tuple[bytes, float]:
        start = time.perf_counter()
        x = decode(data)
        float(x.flat[0]) + float(x.flat[-1])
        return b"", (time.perf_counter() - start) * 1e3


def _serve(max_body: int, redis_url: str) -> None:
    from mopar.runtime.server import FunctionApp, create_function_server

    app = FunctionApp(_Sink(max_body), None, Receiver(redis_url=redis_url))
    server = create_function_server(app, host="127.0.0.1", port=0, threads=4, max_body=max_body)
    os.write(1, f"{server.effective_port}\n".encode())
    server.run()


if __name__ == "__main__":
    if sys.argv[1] == "shm":
        _shm_reader(sys.argv[2])
    else:
        _serve(int(sys.argv[2]), sys.argv[3])
