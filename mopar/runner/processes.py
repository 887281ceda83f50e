"""The local processes a runner starts: function servers (`ServerProcess`, each on a socket
bound here and inherited, `listening_socket`) and a private redis-server (`local_redis`, on a
port chosen below the kernel's ephemeral range, `free_port`).

A server told ``MOPAR_LISTEN_FD`` listens on the socket it inherited: no port is chosen, freed
and bound again, where another process could take it in between. What must bind its own port
(a container on the host's network, redis-server) gets one below the ephemeral range, which no
outgoing connection takes.

Read in this order: `listening_socket`, `free_port`, `ServerProcess`, `local_redis`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mopar.errors import RuntimeFailure
from mopar.runtime.httpd import LISTEN_FD
from mopar.runtime.server import die_with_parent

__all__ = ["ServerProcess", "free_port", "listening_socket", "local_redis", "start_redis"]


def listening_socket() -> socket.socket:
    """A socket bound to a free 127.0.0.1 port and listening, for a `ServerProcess` to
    inherit: the port is never freed between its choice and the server's bind."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def free_port() -> int:
    """A free 127.0.0.1 port below the kernel's ephemeral range (from 10000; anywhere above
    10000 where that range starts lower), for a server that binds its own (a container,
    redis-server). The port is free only when checked; being below that range, no outgoing
    connection takes it before the server binds it, and a random choice makes two runs that
    pick at once unlikely to pick the same.

    Raises:
        RuntimeFailure: none was free in 200 tries.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = low if low > 11000 else 65536  # a range that starts low leaves no room below it
    chance = random.SystemRandom()  # not the seedable global one, which tests may seed alike
    for _ in range(200):
        port = chance.randrange(10000, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeFailure(
        f"no free 127.0.0.1 port between 10000 and {top} in 200 tries; stop servers that hold "
        "them, or run fewer at once"
    )


class ServerProcess:
    """One function server process and the tail of its stderr.

    Args:
        wait: wait for its ``ready`` line here; else `wait_ready` does, so that several start
            at once. Spawn from a thread that outlives the process: ``die_with_parent``'s
            signal comes when the thread that spawned it ends.
        fork_safe: spawn with no Python run in the child before exec (safe from any thread of
            a busy process); the server ends itself with this process (``MOPAR_PARENT_PID``).
        sock: a bound socket (`listening_socket`) the server inherits and listens on
            (``MOPAR_LISTEN_FD``); closed here once handed over.
    """

    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        name: str,
        timeout_s: float,
        *,
        cwd: Path | None = None,
        wait: bool = True,
        fork_safe: bool = False,
        sock: socket.socket | None = None,
    ) -> None:
        self.name = name
        self._started = time.perf_counter()
        self._timeout_s = timeout_s
        if fork_safe:
            env = {**env, "MOPAR_PARENT_PID": str(os.getpid())}
        if sock is not None:
            env = {**env, LISTEN_FD: str(sock.fileno())}
        try:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                pass_fds=() if sock is None else (sock.fileno(),),
                # fork_safe: no Python in the child before exec, which can deadlock where other
                # threads hold locks; the server ends itself with its parent (MOPAR_PARENT_PID)
                preexec_fn=None if fork_safe else die_with_parent,
            )
        finally:
            if sock is not None:
                sock.close()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=30)
        threading.Thread(target=self._pump_err, daemon=True).start()
        self._ready: dict = {}
        self._reader = threading.Thread(
            target=lambda: self._ready.update(self._ready_line()), daemon=True
        )
        self._reader.start()
        self.url = ""
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for its ``ready`` line, up to ``timeout_s`` from its spawn (at once if seen).

        Raises:
            RuntimeFailure: it did not start; the message ends with its last line of stderr.
        """
        if self.url:
            return
        self._reader.join(max(0.0, self._timeout_s - (time.perf_counter() - self._started)))
        if "port" not in self._ready:
            self.stop()
            tail = next((x for x in reversed(self.stderr_tail) if x.strip()), "no output")
            failure = RuntimeFailure(
                f"the function server of slice {self.name} did not start: {tail}"
            )
            failure.exit_code = self.proc.returncode  # type: ignore[attr-defined]
            raise failure
        self.port = int(self._ready["port"])
        self.load_ms = (time.perf_counter() - self._started) * 1e3  # process start to ready
        self.session_ms = float(self._ready.get("load_ms") or 0.0)  # the server's own: session
        self.url = f"http://127.0.0.1:{self.port}/"

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM), not waiting: `stop` waits."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def _ready_line(self) -> dict:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "ready":
                return msg
        return {}

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip())

    def stop(self) -> None:
        """Stop it (SIGTERM; SIGKILL after 5 s) and wait for it."""
        _end(self.proc)


@contextlib.contextmanager
def local_redis(timeout_s: float = 15.0) -> Iterator[str]:
    """A private redis-server on a free 127.0.0.1 port, no persistence; yield its URL.

    The port is checked free, then bound by redis-server: where another process took it in
    between, that server exits and another port is tried (3 in all). A server is known as
    ours by its process id, so another run's redis-server on the port is never taken for it.
    """
    if shutil.which("redis-server") is None:
        raise RuntimeFailure(
            "redis-server is not on PATH; install it (apt-get install "
            "redis-server) or pass --redis-url redis://host:port/0"
        )
    work = Path(tempfile.mkdtemp(prefix="mopar-redis-"))
    proc = None
    try:
        for _ in range(3):
            port = free_port()
            proc = start_redis(port, work, timeout_s)
            if proc is not None:
                break
        else:
            raise RuntimeFailure(
                f"redis-server did not start on 127.0.0.1 (3 ports tried, the last {port}); "
                f"see {work / 'redis.log'} and `redis-server --version`"
            )
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc is not None:
            _end(proc)
        shutil.rmtree(work, ignore_errors=True)


def start_redis(port: int, work: Path, timeout_s: float = 15.0) -> subprocess.Popen | None:
    """A redis-server on 127.0.0.1:``port`` (no persistence, its log in ``work``), once it
    answers; None where it did not within ``timeout_s`` (the port taken), and it is gone."""
    proc = subprocess.Popen(
        # no persistence: a run's frames live no longer than the run
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
        + ["--appendonly", "no", "--dir", str(work), "--logfile", str(work / "redis.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    if _answers(proc, port, timeout_s):
        return proc
    _end(proc)
    return None


def _answers(proc: subprocess.Popen, port: int, timeout_s: float) -> bool:
    """Whether ``proc`` serves 127.0.0.1:``port`` within ``timeout_s`` (False: it exited, or
    another process answers there)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # a listener that is not redis may accept and never answer: each try gives up within 1 s,
    # and is not retried by the client itself (its default retries stalled for 15 s)
    wait_s = min(1.0, timeout_s)
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=wait_s,
        socket_connect_timeout=wait_s,
        retry=Retry(NoBackoff(), 0),
    )
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                return int(client.info("server")["process_id"]) == proc.pid
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.05)
            except redis.RedisError:  # something else answers there
                return False
        return False
    finally:
        client.close()


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()  # nothing where it has ended
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
