"""One slice process: ``python -m mopar.runner.worker FUNCTION_DIR SHM_DIR [THREADS [DISPATCH
PREWARM]]``.

It loads the bundle's own ``handler.py`` (the code that ships in the function), then serves
requests announced on stdin, one JSON line each::

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
answer
(``"calls": {"s1.e3": {"tokens": ..., "gates": ..., "out": ...}}``), and a fifth, ``1`` when the
runner wants pre-warm predictions (``0``: its predictor is not even loaded). It routes the tokens
(`mopar.runtime.dispatch`), writes what each reached expert function is sent, and asks the
runner to run those functions::

    {"event": "call", "id": 3, "calls": ["s1.e0", "s1.e3"]}

then runs the experts it holds itself (its hot ones), waits for ``{"id": 3, "resume": true}``
(``"abort": true`` when one failed), adds all the answers, runs its model on the sum and replies
as any slice does. Other requests that arrive meanwhile wait their turn. A dispatch that
predicts the next layer's experts first tells the runner which of its expert functions to
pre-warm::

    {"event": "warm", "id": 3, "functions": ["s3.e1", "s3.e2"]}

Nothing else is on a request's path: the runner reads each worker's peak RSS from /proc itself
(`peak_rss_mb`) when it reports, not per request (reading it here cost 0.17 ms per slice).

File names are checked against the internal pattern, so a message can never point outside SHM_DIR.
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import json
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mopar.runner.shmbuf import BufferPool

__all__ = ["main", "FILE_RE", "peak_rss_mb"]

FILE_RE = re.compile(r"^r\d+x\d+-v\d+\.t$")


def peak_rss_mb(pid: int | str = "self") -> float:
    """The peak resident set size of process ``pid`` (default: this one), MB.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a slice started by a large
    parent (the compiler) would report the parent's peak. For another process that has gone,
    0.0.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    if pid != "self":
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _load_handler(function_dir: Path, threads: int, model_dir: Path | None = None):
    """The function's own ``handler.py``, running the model of ``model_dir`` (default: the
    function's folder)."""
    spec = importlib.util.spec_from_file_location(
        "mopar_slice_handler", function_dir / "handler.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SliceHandler(model_dir or function_dir, intra_op_threads=threads)


def _name(name: str) -> str:
    if not FILE_RE.match(name):
        raise ValueError(f"refusing tensor file name {name!r}")
    return name


class _Dispatch:
    """A dispatch function's per-request work over the run's buffers."""

    def __init__(self, function_dir: Path, threads: int, spec: dict, prewarm: bool) -> None:
        from mopar.bundle.dispatch import DispatchSpec
        from mopar.bundle.layout import HOT_DIR, WARM_DIR

        self.spec = DispatchSpec.from_dict(spec)
        self.tail = _load_handler(function_dir, threads)  # what its layer computes after
        self.hot = (
            _load_handler(function_dir, threads, function_dir / HOT_DIR) if self.spec.hot else None
        )  # the experts it runs itself
        self.warm = (
            _load_handler(function_dir, threads, function_dir / WARM_DIR)
            if self.spec.warm and prewarm
            else None
        )  # the next layer's router
        self.requests = itertools.count()

    def serve(
        self,
        pool: BufferPool,
        msg: dict,
        ask: Callable[[list[str]], None],
        wait: Callable[[], bool],
        warm: Callable[[list[str]], None],
    ) -> dict:
        """Predict the next layer's expert functions and ``warm`` them; route, ``ask`` the
        runner for the expert functions tokens reached, run the hot experts meanwhile, ``wait``
        for the others' answers, combine, run the tail."""
        from mopar.runtime.dispatch import combine, route, run_local, to_warm

        start = time.perf_counter()
        spec, files = self.spec, msg["inputs"]
        hidden = pool.read(_name(files[spec.hidden]))
        if self.warm is not None:
            predicted = self.warm.handle({spec.hidden: hidden})[self.warm.output_names[0]]
            warm(to_warm(spec, predicted))
        calls = route(
            spec,
            hidden,
            pool.read(_name(files[spec.index])),
            pool.read(_name(files[spec.weights])),
            next(self.requests),
        )
        remote = [c for c in calls if not c.local]
        for c in remote:
            pool.write(_name(msg["calls"][c.function]["tokens"]), c.tokens)
            pool.write(_name(msg["calls"][c.function]["gates"]), c.gates)
        if remote:
            ask([c.function for c in remote])
        answers = {c.function: run_local(self.hot, c) for c in calls if c.local}
        if remote and not wait():
            return {"event": "done", "id": msg["id"], "ms": 0.0, "aborted": True}
        answers.update(
            (c.function, pool.read(_name(msg["calls"][c.function]["out"]))) for c in remote
        )
        inputs = {k: pool.read(_name(f)) for k, f in files.items() if k in self.tail.inputs}
        combined = combine(spec, calls, [answers[c.function] for c in calls], hidden.dtype)
        results = self.tail.handle({**inputs, spec.output: combined})
        _write_outputs(pool, msg, results)
        return {"event": "done", "id": msg["id"], "ms": (time.perf_counter() - start) * 1e3}


def _serve_one(handler, pool: BufferPool, msg: dict) -> dict:
    start = time.perf_counter()
    # Views over the mapped buffers: onnxruntime reads them in place.
    inputs = {k: pool.read(_name(f)) for k, f in msg["inputs"].items()}
    _write_outputs(pool, msg, handler.handle(inputs))
    ms = (time.perf_counter() - start) * 1e3
    return {"event": "done", "id": msg["id"], "ms": ms}


def _write_outputs(pool: BufferPool, msg: dict, results: dict) -> None:
    """Each output into its buffer, encoded with its codec from the message (absent: none)."""
    codecs = msg.get("codecs", {})
    for name, fname in msg["outputs"].items():
        pool.write(_name(fname), results[name], codec=codecs.get(name, "none"))


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
        prewarm = len(args) <= 4 or args[4] == "1"
        handler = (
            _Dispatch(function_dir, threads, dispatch, prewarm)
            if dispatch
            else _load_handler(function_dir, threads)
        )
        load_ms = (time.perf_counter() - start) * 1e3
        _reply(proto, {"event": "ready", "load_ms": load_ms, "peak_rss_mb": peak_rss_mb()})
        pool = BufferPool(shm)
        lines = iter(sys.stdin.buffer)  # bytes: no text decoding on the request's path
        backlog: collections.deque[dict] = collections.deque()

        def ask(rid: int, names: list[str]) -> None:
            """Ask the runner to run these expert functions."""
            _reply(proto, {"event": "call", "id": rid, "calls": names})

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
            try:
                if dispatch:
                    rid = msg["id"]
                    reply = handler.serve(
                        pool,
                        msg,
                        lambda names, rid=rid: ask(rid, names),
                        lambda rid=rid: wait(rid),
                        lambda names, rid=rid: _reply(
                            proto, {"event": "warm", "id": rid, "functions": names}
                        ),
                    )
                else:
                    reply = _serve_one(handler, pool, msg)
            except Exception as exc:  # report, keep serving: one bad request is not a dead slice
                reply = {
                    "event": "error",
                    "id": msg.get("id"),
                    "message": f"{type(exc).__name__}: {exc}",
                }
            pool.keep_only(_files_of(msg))
            _reply(proto, reply)
    except StopIteration:
        return 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
