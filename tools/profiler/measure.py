"""Measure the memory and time of one ONNX model under the runtime's onnxruntime options.

Method. Each model is measured in a long-lived child process, `tools.profiler.probe`, that imports
what a slice process imports (numpy, onnxruntime, the runtime's handler for `session_options`)
and never torch. It speaks JSON lines over stdin/stdout, like `mopar.runner.worker`. Per model:

1. The parent writes the model to a temporary ``.onnx`` file and its inputs as runtime tensor
   files (`mopar.runtime.wire`), exactly what a slice reads.
2. The child collects garbage and calls ``malloc_trim(0)``, so memory freed by the previous
   sample goes back to the kernel; then it resets its peak RSS by writing ``5`` to
   ``/proc/self/clear_refs`` (VmHWM := VmRSS) and reads VmRSS: the baseline.
3. It reads the inputs, creates an ``InferenceSession`` with ``session_options(threads)``
   (the options every slice runs under), runs once untimed (warm-up), then times runs until it has
   at least ``min_runs`` and either ``budget_s`` seconds or ``max_runs`` runs; the median is the
   time. Each run's outputs are dropped at once, as a slice drops a request's.
4. Memory, all over the baseline and under the first thread count (the runtime's):
   ``load_bytes`` is VmHWM right after the session was created (a peak: it includes the model
   file's transient copies); then the child trims the heap again and reads VmRSS:
   ``session_bytes``, what the session holds (weights as onnxruntime keeps them, pre-packed
   copies included) plus the inputs; then it resets the peak once more, and ``run_bytes`` is
   VmHWM right after timed run ``memory_runs`` (10: the warm-up plus 10 requests of a default
   ``mopar run``): the held memory plus the activations, scratch buffers and outputs at their
   peak, plus what glibc keeps of freed buffers. **memory_bytes = max(load_bytes, run_bytes)**:
   the whole cost of the model on top of the runtime. The run count is fixed because the last
   part creeps up over the first runs: glibc raises its mmap threshold after a large free (up
   to 32 MB), so later buffers of that size come from the heap and freed ones are kept; a 3 MB
   Relu measures 6 MB after one run and 28 MB after ten, then stays there (6 MB at any count
   with ``MALLOC_MMAP_THRESHOLD_=131072``).
5. The session is dropped and the model timed again under each further thread count (1 thread,
   for ``time_ms_1t``), each time after a warm-up run.

The child checks at start that ``clear_refs`` really lowers VmHWM (it raises the peak by 64 MB,
frees it, resets and compares); where it does not, every model gets a fresh child, whose peak
then starts at its post-import baseline. The child is also restarted every ``restart_every``
models, so allocator fragmentation cannot build up, and after any failure or timeout. Its first
session (a tiny warm-up model) absorbs onnxruntime's process-wide initialisation, which a slice
pays once and is part of the runtime baseline, not of any model.

Checked against `mopar run` (peak VmHWM of each slice process, baseline B = 54 MB, the probe's
RSS after its warm-up): a slice of one layer measures B + memory_bytes within 4% (VGG-16 fc1:
842 vs 838 MB; GCN layers: 390 vs 390 and 89 vs 88 MB). Over 12 slices of many layers, B plus
the sum of memory_bytes is 1.0-9.9x the measured peak, and B plus the max is 0.42-1.16x of it:
low for weight-heavy slices (ResNet-50's last third: 103 vs 248 MB), because a slice keeps what
glibc retained from loading all its weights at once (2-3x the weights), while each layer's
activations come and go. Combining layers is `tools.profiler.aggregate`'s business.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools import checkout_env
from tools.profiler.tensorfile import write_tensor

__all__ = ["MeasureConfig", "Measurement", "MeasureError", "Prober"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """How models are measured.

    Attributes:
        threads: intra-op threads of the session whose memory and ``time_ms_nt`` are measured
            (0: onnxruntime's default, which is what slices run with).
        min_runs: timed runs at least, per thread count.
        max_runs: timed runs at most, per thread count.
        budget_s: seconds of timed runs to aim for, per thread count (between the two bounds).
        memory_runs: timed runs (after the warm-up) over which the peak memory is taken.
        restart_every: models measured by one child before it is replaced.
        timeout_s: seconds one model may take before its child is killed.
    """

    threads: int = 0
    min_runs: int = 5
    max_runs: int = 30
    budget_s: float = 0.2
    memory_runs: int = 10
    restart_every: int = 50
    timeout_s: float = 300.0


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one model cost.

    Attributes:
        memory_bytes: peak RSS over the baseline while loading and running, bytes
            (the larger of ``load_bytes`` and ``run_bytes``).
        load_bytes: peak RSS over the baseline after creating the session, bytes.
        session_bytes: RSS over the baseline once the session is created and the heap trimmed
            (the session's resident weights and the inputs), bytes.
        run_bytes: peak RSS over the baseline while running (held memory included), bytes.
        load_ms: time to create the session, ms.
        time_ms_nt: median run time at ``MeasureConfig.threads`` intra-op threads, ms.
        time_ms_1t: median run time at 1 intra-op thread, ms.
        runs_nt: timed runs behind ``time_ms_nt``.
        runs_1t: timed runs behind ``time_ms_1t``.
        method: ``clear_refs`` (peak reset in a long-lived child) or ``fresh_process``.
    """

    memory_bytes: int
    load_bytes: int
    session_bytes: int
    run_bytes: int
    load_ms: float
    time_ms_nt: float
    time_ms_1t: float
    runs_nt: int
    runs_1t: int
    method: str


class MeasureError(RuntimeError):
    """One model could not be measured (the message says why); the next one may well be."""


class _Child:
    """One probe process and a thread that turns its stdout lines into queue items."""

    def __init__(self, warmup: tuple[Path, Path], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.profiler.probe", str(warmup[0]), str(warmup[1])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
                env=checkout_env({**os.environ, "PYTHONUNBUFFERED": "1"}),
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.served = 0

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, msg: dict | None, timeout_s: float) -> dict:
        """Send ``msg`` (None: send nothing) and wait for the next line; MeasureError if none."""
        if msg is not None:
            try:
                self.proc.stdin.write(json.dumps(msg) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise MeasureError(f"the probe process died: {self.stderr_tail()}") from None
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise MeasureError(f"timed out after {timeout_s:g} s") from None
        if line is None:
            code = self.proc.wait()
            raise MeasureError(f"the probe process died (exit {code}): {self.stderr_tail()}")
        return json.loads(line)

    def stderr_tail(self) -> str:
        try:
            lines = deque(self.log_path.read_text(errors="replace").splitlines(), maxlen=3)
        except OSError:
            return ""
        return " | ".join(lines)[-400:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class Prober:
    """Measures models in a probe child process; use as a context manager.

    ``ready`` holds the child's first message (``clear_refs``, ``torch``, ``ort``, ``rss_bytes``).
    """

    def __init__(self, config: MeasureConfig = MeasureConfig()) -> None:
        self.config = config
        self._dir = Path(tempfile.mkdtemp(prefix="mopar-probe-"))
        self._warmup = _warmup_model(self._dir)
        self._child: _Child | None = None
        self._next_id = 0
        self.ready: dict[str, Any] = {}

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def method(self) -> str:
        return "clear_refs" if self.ready.get("clear_refs", True) else "fresh_process"

    def _ensure_child(self) -> _Child:
        limit = self.config.restart_every if self.method == "clear_refs" else 1
        child = self._child
        if child is not None and (child.served >= limit or child.proc.poll() is not None):
            self._child.stop()
            self._child = None
        if self._child is None:
            child = _Child(self._warmup, self._dir / "probe.log")
            ready = child.ask(None, self.config.timeout_s)
            if ready.get("event") != "ready":
                child.stop()
                raise MeasureError(f"the probe process did not start: {ready}")
            if ready.get("torch"):
                log.warning("the probe process imported torch; memory baselines include it")
            self.ready = ready
            self._child = child
        return self._child

    def measure_arrays(self, model: Path, inputs: dict[str, np.ndarray]) -> Measurement:
        """Write ``inputs`` as runtime tensor files in the prober's folder, then `measure`."""
        paths = {}
        for i, (name, array) in enumerate(inputs.items()):
            paths[name] = self._dir / f"in{i}.t"
            write_tensor(paths[name], np.asarray(array))
        try:
            return self.measure(model, paths)
        finally:
            for p in paths.values():
                p.unlink(missing_ok=True)

    def measure(self, model: Path, inputs: dict[str, Path]) -> Measurement:
        """Measure ``model`` fed from the tensor files ``inputs`` (name -> path).

        Raises:
            MeasureError: the model failed to load or run, its child died, or it timed out.
        """
        cfg = self.config
        child = self._ensure_child()
        self._next_id += 1
        msg = {
            "id": self._next_id,
            "model": str(model),
            "inputs": {k: str(v) for k, v in inputs.items()},
            "threads": [cfg.threads, 1],
            "min_runs": cfg.min_runs,
            "max_runs": cfg.max_runs,
            "budget_s": cfg.budget_s,
            "memory_runs": cfg.memory_runs,
        }
        try:
            reply = child.ask(msg, cfg.timeout_s)
        except MeasureError:
            child.stop()
            self._child = None
            raise
        child.served += 1
        if reply.get("event") != "done":
            child.served = 1 << 30  # a failed session may leave state behind: start afresh
            raise MeasureError(reply.get("message", str(reply)))
        return Measurement(
            memory_bytes=int(reply["memory_bytes"]),
            load_bytes=int(reply["load_bytes"]),
            session_bytes=int(reply["session_bytes"]),
            run_bytes=int(reply["run_bytes"]),
            load_ms=float(reply["load_ms"]),
            time_ms_nt=float(reply["time_ms"][0]),
            time_ms_1t=float(reply["time_ms"][1]),
            runs_nt=int(reply["runs"][0]),
            runs_1t=int(reply["runs"][1]),
            method=self.method if reply.get("peak_reset", True) else "fresh_process",
        )


def _warmup_model(folder: Path) -> tuple[Path, Path]:
    """A tiny Relu model and its input, for the child's first session."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "warmup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path, x = folder / "warmup.onnx", folder / "warmup.t"
    onnx.save(model, str(path))
    write_tensor(x, np.ones((1, 8), np.float32))
    return path, x
