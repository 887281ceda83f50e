"""The measuring process: ``python -m tools.profiler.probe WARMUP_MODEL``.

It imports what a slice process imports -- numpy, onnxruntime and the runtime's own handler
module for its session options -- and never torch, so that its baseline is a slice's. After a
warm-up session (onnxruntime initialises process-wide state on its first session, which must not
be charged to the first sample), it says on stdout::

    {"event": "ready", "clear_refs": true, "torch": false, "ort": "1.31.1", "rss_bytes": 61000000}

then measures one model per JSON line on stdin::

    {"id": 4, "model": "/tmp/x/m.onnx", "inputs": {"x": "/tmp/x/x.t"}, "threads": [0, 1],
     "min_runs": 5, "max_runs": 30, "budget_s": 0.2, "memory_runs": 10}

and answers each on one line (``memory_bytes`` is measured under the first thread count, over
the warm-up run and ``memory_runs`` timed runs)::

    {"event": "done", "id": 4, "memory_bytes": ..., "load_bytes": ..., "session_bytes": ...,
     "run_bytes": ..., "load_ms": ...,
     "time_ms": [2.1, 3.4], "runs": [50, 31], "peak_reset": true}
    {"event": "error", "id": 4, "message": "..."}

See `tools.profiler.measure` for the method.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import onnxruntime as ort

from mopar.runtime.handler import session_options
from tools.profiler.tensorfile import read_tensor

__all__ = ["main", "status_kb", "reset_peak"]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to trim
    _LIBC = None


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` figure in kB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release() -> None:
    """Return freed memory to the kernel, so the next sample starts from a true baseline."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _reset_works() -> bool:
    """Whether `reset_peak` really lowers VmHWM: raise the peak by 64 MB, free, reset, compare."""
    block = bytearray(64 << 20)
    block[::4096] = b"\1" * len(block[::4096])  # touch every page
    del block
    _release()
    return reset_peak() and status_kb("VmHWM") < status_kb("VmRSS") + (32 << 10)


def _time_runs(
    session: ort.InferenceSession, feed: dict, msg: dict, peak_after: int = 0
) -> tuple[float, int, int]:
    """One untimed warm-up run, then timed runs.

    Returns the median run in ms, the number of timed runs, and VmHWM in kB read right after
    timed run ``peak_after`` (0: not read). The runs continue past ``peak_after`` if the time
    budget asks for more, but do not count towards the peak: a slice's peak creeps up over its
    first requests (allocator thresholds), so the memory figure is pinned to a fixed count.
    """
    session.run(None, feed)  # the result is dropped at once, as a slice drops each request's
    times: list[float] = []
    spent = 0.0
    peak_kb = 0
    least = max(msg["min_runs"], peak_after)
    while len(times) < least or (spent < msg["budget_s"] and len(times) < msg["max_runs"]):
        start = time.perf_counter()
        session.run(None, feed)
        times.append((time.perf_counter() - start) * 1e3)
        spent += times[-1] / 1e3
        if len(times) == peak_after:
            peak_kb = status_kb("VmHWM")
    return statistics.median(times), len(times), peak_kb


def _session(model: str, threads: int) -> ort.InferenceSession:
    return ort.InferenceSession(model, session_options(threads), providers=["CPUExecutionProvider"])


def measure(msg: dict) -> dict:
    """Measure one model: memory under ``threads[0]`` (load, held, run peaks), then each timing."""
    _release()
    reset = reset_peak()
    rss0 = status_kb("VmRSS")
    feed = {name: read_tensor(Path(p)) for name, p in msg["inputs"].items()}
    start = time.perf_counter()
    session = _session(msg["model"], msg["threads"][0])
    load_ms = (time.perf_counter() - start) * 1e3
    load_kb = status_kb("VmHWM") - rss0
    _release()  # what the session holds, without what loading freed but glibc kept
    session_kb = status_kb("VmRSS") - rss0
    reset = reset and reset_peak()  # where it cannot reset, the run's peak includes the load's
    times, runs = [], []
    ms, n, peak_kb = _time_runs(session, feed, msg, peak_after=msg["memory_runs"])
    run_kb = peak_kb - rss0
    times.append(ms)
    runs.append(n)
    del session
    for threads in msg["threads"][1:]:
        _release()
        session = _session(msg["model"], threads)
        ms, n, _ = _time_runs(session, feed, msg)
        del session
        times.append(ms)
        runs.append(n)
    del feed
    _release()
    return {
        "event": "done",
        "id": msg["id"],
        "memory_bytes": max(load_kb, run_kb) * 1024,
        "load_bytes": load_kb * 1024,
        "session_bytes": session_kb * 1024,
        "run_bytes": run_kb * 1024,
        "load_ms": load_ms,
        "time_ms": times,
        "runs": runs,
        "peak_reset": reset,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # The protocol owns stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        clear_refs = _reset_works()
        warm = _session(args[0], 0)
        warm.run(None, {i.name: read_tensor(Path(args[1])) for i in warm.get_inputs()})
        del warm
        _release()
        ready = {
            "event": "ready",
            "clear_refs": clear_refs,
            "torch": "torch" in sys.modules,
            "ort": ort.__version__,
            "rss_bytes": status_kb("VmRSS") * 1024,
        }
        proto.write(json.dumps(ready) + "\n")
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                reply = measure(msg)
            except Exception as exc:  # report, keep serving: one bad model is not a dead probe
                reply = {
                    "event": "error",
                    "id": msg.get("id"),
                    "message": f"{type(exc).__name__}: {exc}",
                }
            proto.write(json.dumps(reply) + "\n")
    except (KeyboardInterrupt, BrokenPipeError):
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
