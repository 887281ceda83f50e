"""Instances of a function under the local runner: worker processes, their memory guard.

A function may run several instances, as it would on a platform under load (Lambda runs one
request per instance; OpenFaaS runs replicas). Each `Instance` is one worker process
(`mopar.runner.worker`) whose stdout pipe the session's selector reads; it keeps, in order, the
requests sent to it and not yet answered, and when it took up the one it works on now (a worker
serves its requests one at a time, in order), so that the session can tell a hung instance from a
busy one.

`MemoryGuard` is what the platform's memory limit is: a thread that reads every instance's peak
resident set (VmHWM) a few dozen times a second and kills, with SIGKILL, one that has gone over
its function's allocation, as the kernel's OOM killer would in the function's cgroup. VmHWM is the
peak since the process started, so a spike between two reads is not missed: it is caught late,
not never.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mopar.bundle.dispatch import DispatchSpec
from mopar.runner.worker import peak_rss_mb

__all__ = ["Instance", "MemoryGuard"]


class Instance:
    """One worker process of function ``index``; messages wait in ``queue`` until it is ready.

    Attributes:
        index: the function's slice index in the manifest.
        inflight: request id -> when it was sent (perf_counter s), in the order sent.
        head_since: when it took up its oldest request (None: idle, or a dispatch waiting on its
            expert functions, which is not its own work).
        spawned, ready_at: when its process was started and when it said it was ready.
        killed: why the session killed it (``"oom"``, ``"timeout"``, ``"start"``), else None.
        peak_mb: its peak RSS when the guard killed it, MB.
        alive: False once stopped or lost.
    """

    def __init__(
        self,
        index: int,
        function_dir: Path,
        shm: Path,
        threads: int,
        dispatch: DispatchSpec | None = None,
        *,
        prewarm: bool = True,
    ) -> None:
        self.index = index
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        extra = [json.dumps(dispatch.to_dict()), "1" if prewarm else "0"] if dispatch else []
        self.spawned = time.perf_counter()
        argv = [sys.executable, "-m", "mopar.runner.worker", str(function_dir), str(shm)]
        self.proc = subprocess.Popen(
            [*argv, str(threads), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        self.stdout_fd = self.proc.stdout.fileno()
        self.pending = b""
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=30)
        self.err_pump = threading.Thread(target=self._pump_err, daemon=True)
        self.err_pump.start()
        self.queue: list[dict] | None = []  # None once ready
        self.inflight: dict[int, float] = {}
        self.head_since: float | None = None
        self.ready_at: float | None = None
        self.idle_since = time.perf_counter()
        self.killed: str | None = None
        self.peak_mb = 0.0
        self.alive = True
        self.counted = False  # its start is one of a report's cold starts
        self.held: set[int] = set()  # done, but its caller waits for the rest of the chain
        self.served_any = False  # its first request pays its INIT

    @property
    def load(self) -> int:
        """Requests sent to it and not answered, and those it holds (`hold`)."""
        return len(self.inflight) + len(self.held)

    def init_ms(self) -> float:
        """Its start (INIT), ms, to bill with its first request; 0 for any other."""
        if self.served_any or self.ready_at is None:
            return 0.0
        self.served_any = True
        return (self.ready_at - self.spawned) * 1e3

    def hold(self, rid: int) -> None:
        """Request ``rid``'s own work is done here, but the instance stays busy with it: its
        caller waits for the rest of the chain (``invoke``, ``http``) until `release`."""
        self.held.add(rid)
        self.answered(rid)

    def release(self, rid: int) -> None:
        """The request ``rid`` it held has finished."""
        if rid in self.held:
            self.held.discard(rid)
            if not self.inflight and not self.held:
                self.idle_since = time.perf_counter()

    def send(self, rid: int, msg: dict) -> None:
        """Send a request (queued until the process is ready)."""
        if not self.inflight:
            self.head_since = time.perf_counter()
        self.inflight[rid] = time.perf_counter()
        self.post(msg)

    def post(self, msg: dict) -> None:
        """Send a message that is not a new request (a dispatch's ``resume``)."""
        if self.queue is not None:
            self.queue.append(msg)
        elif self.alive:
            with contextlib.suppress(BrokenPipeError):  # it died; its exit event is on the way
                os.write(self.proc.stdin.fileno(), json.dumps(msg).encode() + b"\n")

    def ready(self) -> None:
        self.ready_at = time.perf_counter()
        # Idle from now, not from its spawn: a pre-warmed instance that took longer than
        # ``idle_s`` to start would otherwise be stopped before the request it was started for.
        self.idle_since = self.ready_at
        queued, self.queue = self.queue or [], None
        for msg in queued:
            self.post(msg)
        if self.inflight:
            self.head_since = self.ready_at

    def answered(self, rid: int) -> None:
        """Request ``rid`` is done here; the next one in order is taken up now."""
        if self.inflight.pop(rid, None) is None:
            return
        now = time.perf_counter()
        self.head_since = now if self.inflight else None
        if not self.inflight and not self.held:
            self.idle_since = now

    def read_events(self) -> list[dict]:
        """What one read of stdout brings: whole reply lines, or ``exit`` at end of file."""
        data = os.read(self.stdout_fd, 1 << 16)
        if not data:
            return [{"event": "exit"}]
        *lines, self.pending = (self.pending + data).split(b"\n")
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                self.stderr_tail.append(line.decode(errors="replace").rstrip())
        return events

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr_tail.append(line.decode(errors="replace").rstrip())

    def last_words(self) -> str:
        """Its exit code and the last line it wrote to stderr, after it has exited."""
        code = self.proc.wait()
        self.err_pump.join(timeout=5)
        tail = next((line for line in reversed(self.stderr_tail) if line.strip()), "no output")
        return f"exited with code {code}: {tail}"

    def kill(self, why: str) -> None:
        """Kill it now (SIGKILL), as a platform does; its exit reaches the session as an event."""
        if self.killed is None:
            self.killed = why
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    def stop(self) -> None:
        """Close its stdin and wait for it to end (kill it after 5 s)."""
        self.alive = False
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class MemoryGuard:
    """Kill an instance whose peak RSS goes over its allocation (``--enforce-memory``).

    Args:
        interval_s: seconds between two reads of every instance's VmHWM.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self._watched: dict[Instance, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def watch(self, instance: Instance, allocated_mb: float) -> None:
        with self._lock:
            self._watched[instance] = allocated_mb

    def forget(self, instance: Instance) -> None:
        with self._lock:
            self._watched.pop(instance, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                watched = list(self._watched.items())
            for instance, allocated in watched:
                peak = peak_rss_mb(instance.proc.pid)
                if peak > allocated and instance.killed is None:
                    instance.peak_mb = peak
                    instance.kill("oom")
                    self.forget(instance)
