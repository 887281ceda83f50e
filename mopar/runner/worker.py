"""One slice process: ``python -m mopar.runner.worker FUNCTION_DIR SHM_DIR [THREADS [DISPATCH
PREWARM]]``: the shm door of a function.

It loads the function's model with mopar's own installed handler (`mopar.runtime.handler`,
the code a bundle ships as ``handler.py`` for its images; the bundle's copy is data here and
never runs) into the function's core (`mopar.runtime.core.FunctionCore`, the same work as a served or Lambda
function's), then serves requests announced on stdin, one JSON line each, through `_ShmDoor`::

    {"id": 3, "inputs": {"x": "r0x1-v0.t"}, "outputs": {"relu_7": "r0x1-v9.t"},
     "codecs": {"relu_7": "int8+zstd"}}

Each named file lives in SHM_DIR and is a reusable buffer (`mopar.runner.shmbuf`) of one value
in one request slot (``x1``): mapped once, overwritten in place by the next request in that
slot. Inputs are read as views over the mapping (each buffer's header names its codec), the
slice runs, and every output is written in place, encoded with its codec from ``codecs``
(absent: none), before the reply line goes out on stdout::

    {"event": "done", "id": 3, "ms": 4.1}
    {"event": "error", "id": 3, "message": "..."}

A dispatch function (a mixture-of-experts layer) has a fourth argument, its `DispatchSpec` as
JSON. Its model is the rest of its layer, run on the experts' summed answers. Its message also
names, for each expert function it may call, the buffers of that function's tokens, gates and
answer (``"calls": {"s1.e3": {"tokens": ..., "gates": ..., "out": ...}}``), and a fifth, ``1`` when the
runner wants pre-warm predictions (``0``: its predictor is not even loaded). It routes the tokens
(`mopar.runtime.dispatch`), writes what each reached expert function is sent, and asks the
runner to run those functions::

    {"event": "call", "id": 3, "calls": ["s1.e0", "s1.e3"]}

runs the experts it holds itself (its hot ones) meanwhile, waits for ``{"id": 3, "resume": true}``
(``"abort": true`` when one failed), adds all the answers, runs its model on the sum and replies
as any slice does. Other requests that arrive meanwhile wait their turn. A dispatch that
predicts the next layer's experts tells the runner, before it asks for its own calls, which of
those functions to pre-warm::

    {"event": "warm", "id": 3, "functions": ["s3.e1", "s3.e2"]}

Nothing else is on a request's path: the runner reads each worker's peak RSS from /proc itself
(`peak_rss_mb`) when it reports, not per request (reading it here cost 0.17 ms per slice).

File names are checked against the internal pattern, so a message can never point outside SHM_DIR.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import re
import resource
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from mopar.bundle.dispatch import DispatchSpec
from mopar.runner.shmbuf import BufferPool
from mopar.runtime.core import FunctionCore, Load
from mopar.runtime.dispatch import Call

__all__ = ["main", "load_core", "serve", "FILE_RE", "peak_rss_mb", "trim_heap"]

FILE_RE = re.compile(r"^r\d+x\d+-v\d+\.t$")


def peak_rss_mb(pid: int | str = "self") -> float:
    """The peak resident set size of process ``pid`` (default: this one), MB.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a slice started by a large
    parent (the compiler) would report the parent's peak. For another process that has gone,
    0.0.
    """
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    if pid != "self":
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def trim_heap() -> None:
    """Hand what glibc keeps of this process's freed memory back to the kernel."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _loader(threads: int) -> Load:
    """mopar's installed handler, as a loader of the model of a folder: a bundle is data to
    `mopar run`, so its own ``handler.py`` is never imported."""
    from mopar.runtime.handler import handler_class

    handler = handler_class()  # MOPAR_HANDLER, the hook for fault injection, where it is set
    return lambda model_dir: handler(model_dir, intra_op_threads=threads)


def load_core(
    function_dir: Path, threads: int, dispatch: dict | None, *, prewarm: bool
) -> FunctionCore:
    """The function's core, with mopar's installed handler.

    Args:
        dispatch: a dispatch function's layer (`DispatchSpec` as a dict, from ``plan.json``).
        prewarm: whether the runner wants pre-warm predictions (else the predictor is not even
            loaded).
    """
    return FunctionCore(
        function_dir,
        name=function_dir.name,
        load=_loader(threads),
        dispatch=DispatchSpec.from_dict(dispatch) if dispatch else None,
        predict=prewarm,
    )


def _name(name: str) -> str:
    if not FILE_RE.match(name):
        raise ValueError(f"refusing tensor file name {name!r}")
    return name


class _Aborted(Exception):
    """The runner aborted a dispatch's request: one of its expert functions failed."""


class _ShmDoor:
    """One request's buffers in and out, the runner's pipes to its callees
    (`mopar.runtime.core.Door`).

    The inputs are numpy views over the mapped buffers, read once, which onnxruntime reads in
    place. They are the slice's own inputs, written by the slices before it: the core checks
    an expert function's rows, the slice their dtypes and shapes.
    """

    prewarms = True  # the predictor is loaded only when the runner wants pre-warm predictions

    def __init__(
        self, pool: BufferPool, msg: dict, proto: int, wait: Callable[[int], bool]
    ) -> None:
        self.pool, self.msg, self.proto, self.wait = pool, msg, proto, wait
        self.inputs = {k: pool.read(_name(f)) for k, f in msg["inputs"].items()}

    def received(self) -> dict[str, np.ndarray]:
        return self.inputs

    def describe(self, item: np.ndarray) -> tuple[np.dtype, tuple[int, ...], str]:
        return item.dtype, item.shape, "none"  # decoded already

    def gather(self, calls: Sequence) -> None:
        """Never asked: the runner runs a join's parts as slices of their own, before it."""
        raise RuntimeError(f"the local runner runs {[c.slice for c in calls]} itself")

    def decode(self, names: Collection[str]) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.inputs.items() if k in names}

    def call(self, calls: Sequence[Call]) -> list[np.ndarray]:
        """Write each expert function's tokens and gates into its buffers, ask the runner to
        run them, wait until it says they have, and read their answers."""
        files = self.msg["calls"]
        for c in calls:
            self.pool.write(_name(files[c.function]["tokens"]), c.tokens)
            self.pool.write(_name(files[c.function]["gates"]), c.gates)
        _reply(
            self.proto,
            {"event": "call", "id": self.msg["id"], "calls": [c.function for c in calls]},
        )
        if not self.wait(self.msg["id"]):
            raise _Aborted
        return [self.pool.read(_name(files[c.function]["out"])) for c in calls]

    def warm(self, names: list[str]) -> None:
        _reply(self.proto, {"event": "warm", "id": self.msg["id"], "functions": names})

    def send(self, results: Mapping[str, np.ndarray]) -> None:
        """Each output into its buffer, encoded with its codec from the message (absent: none)."""
        codecs = self.msg.get("codecs", {})
        for name, fname in self.msg["outputs"].items():
            self.pool.write(_name(fname), results[name], codec=codecs.get(name, "none"))


def _files_of(msg: dict) -> set[str]:
    """The buffer names a request message uses."""
    names = {*msg.get("inputs", {}).values(), *msg.get("outputs", {}).values()}
    for files in msg.get("calls", {}).values():
        names.update(files.values())
    return names


def _reply(fd: int, msg: dict) -> None:
    os.write(fd, json.dumps(msg).encode() + b"\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    function_dir, shm = Path(args[0]), Path(args[1])
    threads = int(args[2]) if len(args) > 2 else 0
    # The protocol owns stdout; anything a library prints goes to stderr instead.
    proto = os.dup(1)
    os.dup2(2, 1)
    try:
        start = time.perf_counter()
        dispatch = json.loads(args[3]) if len(args) > 3 else None  # its layer, from plan.json
        core = load_core(function_dir, threads, dispatch, prewarm=len(args) <= 4 or args[4] == "1")
        load_ms = (time.perf_counter() - start) * 1e3
        _reply(proto, {"event": "ready", "load_ms": load_ms, "peak_rss_mb": peak_rss_mb()})
        serve(core, BufferPool(shm), iter(sys.stdin.buffer), proto)
    except (StopIteration, BrokenPipeError):  # the runner closed our stdin, or our stdout
        return 0
    except KeyboardInterrupt:
        return 130
    return 0


def serve(core: FunctionCore, pool: BufferPool, lines: Iterator[bytes], proto: int) -> None:
    """Serve the requests announced on ``lines`` (bytes: no text decoding on the request's
    path) until they end, replying on ``proto``."""
    backlog: collections.deque[dict] = collections.deque()

    def wait(rid: int) -> bool:
        """Wait until the runner says the expert functions asked for ran (False: aborted)."""
        for raw in lines:
            msg = json.loads(raw)
            if msg.get("resume") and msg.get("id") == rid:
                return not msg.get("abort")
            backlog.append(msg)
        raise BrokenPipeError

    while True:
        if backlog:
            msg = backlog.popleft()
        else:
            raw = next(lines)
            if not raw.strip():
                continue
            msg = json.loads(raw)
        rid = msg.get("id")
        try:
            door = _ShmDoor(pool, msg, proto, wait)
            reply = {"event": "done", "id": rid, "ms": core.run(door)}
        except _Aborted:
            reply = {"event": "done", "id": rid, "ms": 0.0, "aborted": True}
        except Exception as exc:  # report, keep serving: one bad request is not a dead slice
            reply = {"event": "error", "id": rid, "message": f"{type(exc).__name__}: {exc}"}
        pool.keep_only(_files_of(msg))
        _reply(proto, reply)


if __name__ == "__main__":
    sys.exit(main())
