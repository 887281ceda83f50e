"""How much memory and time ``mopar compile`` takes, per stage, against the model's weights.

    python -m benchmarks.compile_memory MODEL [compile args...] [--json OUT] [--work DIR]
        [--interval 0.1] [--no-pss] [--kill-above-mb MB] [--cap-search [--caps-only]]

Runs ``mopar compile`` in a process of its own and samples, every ``--interval`` s, the summed
RSS and PSS of its whole process tree (the compiler, the child it runs torch in for a large
model, the slice servers it measures, the unsplit model beside them; RSS counts a shared
library once per process, PSS splits it). Issue 35's goal (at most 1.5x the weights) is in
summed RSS. Each sample belongs to the stage running then: the compile runs under `_child`
(its child too, run as it was: `mopar.cli.child`), which records when ``mopar.pipeline.capture`` and each
``Stopwatch.stage`` block start and end, and every INFO record of the ``mopar`` logger
(`stage_timeline` says how they become labels). The weights are ``plan.json``'s (or a ``.pt2``'s,
when no bundle was written); the largest measured function peak is its ``sizing`` section's.
``--cap-search`` first finds the smallest ``--max-memory-mb`` planning accepts
(`benchmarks.caps.smallest_cap`),
then compiles at it. docs/scale-measured.md explains the figures and quotes them.

Read in this order: `Sample` and `tree_sample` (one sample), `stage_timeline` and `by_stage`
(attribution), `measure_compile` (one measured compile), `table`, `main`; the cap search: `benchmarks.caps`.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.caps import CapSearch, cap_search_in_subprocess, environment

__all__ = [
    "Sample",
    "StageMemory",
    "CompileMemory",
    "tree_sample",
    "sample_until_exit",
    "stage_timeline",
    "by_stage",
    "measure_compile",
    "table",
    "main",
]

MB = 1e6
"""Bytes per MB in every figure here, as `mopar.facts.MB` (decimal)."""

STARTUP = "startup"
"""The label of the time before capture starts."""

UNSPLIT = "export-unsplit"
"""The label of the latency check's export of the unsplit model."""

EXIT = "exit"
"""The label of the time after the last stage ends: the bundle moved into place, the result
printed, the interpreter's exit."""


# --- one sample ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Sample:
    """The memory of a process tree at one moment.

    Attributes:
        t: ``time.monotonic()`` when taken, s (the clock is system-wide on Linux, so the
            compile's stage events compare with it).
        rss_bytes: the sum of every process's RSS.
        pss_bytes: the sum of every process's PSS (None: not read).
        root_rss_bytes: the root process's own RSS (the compiler alone).
        processes: how many processes the tree had.
    """

    t: float
    rss_bytes: int
    pss_bytes: int | None
    root_rss_bytes: int
    processes: int


def tree_sample(pid: int, *, pss: bool = True) -> Sample | None:
    """The memory of process ``pid`` and all its descendants now (None: ``pid`` is gone).

    A descendant that exits between being listed and being read counts as zero.
    """
    import psutil

    t = time.monotonic()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    rss = pss_sum = root_rss = 0
    counted = 0
    for proc in procs:
        try:
            if pss:
                info = proc.memory_full_info()
                pss_sum += info.pss
            else:
                info = proc.memory_info()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        counted += 1
        rss += info.rss
        if proc.pid == pid:
            root_rss = info.rss
    return Sample(
        t=t,
        rss_bytes=rss,
        pss_bytes=pss_sum if pss else None,
        root_rss_bytes=root_rss,
        processes=counted,
    )


@dataclass(frozen=True, kw_only=True)
class Exit:
    """How the sampled process ended: its exit code, the kernel's peak RSS of the largest
    single process among it and the descendants it waited for (``ru_maxrss``), bytes, and
    whether the sampler killed the tree for passing its limit."""

    returncode: int
    max_rss_bytes: int
    killed: bool = False


def sample_until_exit(
    proc: subprocess.Popen,
    *,
    interval: float = 0.1,
    pss: bool = True,
    limit_bytes: int | None = None,
) -> tuple[list[Sample], Exit]:
    """Sample ``proc``'s tree every ``interval`` s until it exits; reaps it with ``wait4`` so
    that its ``ru_maxrss`` is known. A tree whose summed RSS passes ``limit_bytes`` (or a
    sampler interrupted) is killed, descendants first, so that a compile too big for the
    machine stops before the machine's other work does."""
    samples: list[Sample] = []
    killed = False
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            began = time.monotonic()
            if (s := tree_sample(proc.pid, pss=pss)) is not None:
                samples.append(s)
                if not killed and limit_bytes is not None and s.rss_bytes > limit_bytes:
                    _kill_tree(proc.pid)
                    killed = True
            time.sleep(max(0.0, interval - (time.monotonic() - began)))
    except BaseException:
        _kill_tree(proc.pid)
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return samples, Exit(
        returncode=proc.returncode, max_rss_bytes=usage.ru_maxrss * 1024, killed=killed
    )


def _kill_tree(pid: int) -> None:
    """SIGKILL process ``pid`` (one this module started) and its descendants, by their ids."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for proc in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


# --- which stage each sample belongs to --------------------------------------------------------

_STAGE_LOG = re.compile(r"^stage (?P<stage>[\w-]+): (?P<seconds>[0-9.]+) s$")
_STAGE_START = re.compile(r"^stage (?P<stage>[\w-]+): start$")


def stage_timeline(
    events: Iterable[Mapping[str, Any]], *, t0: float
) -> tuple[tuple[float, str], ...]:
    """The stage running from each moment on: ``(t, label)`` change points, in time order,
    the first ``(t0, "startup")``.

    ``events`` are what `_child` records: ``{"t", "start": STAGE}``, ``{"t", "end": STAGE}``
    and ``{"t", "log": MESSAGE}``. Stages nest (rewrite inside export): the innermost one is the
    label. Between stages the label stays the last one's; before capture it is `STARTUP`
    (the interpreter, imports, options); after the last stage ends, `EXIT`. An ``export``
    that starts after the log line ``export unsplit`` is `UNSPLIT`. Without start and end
    events (a pipeline without the hooks `_child` sets), the stage log records give the spans
    (`_spans_from_logs`).
    """
    events = sorted(events, key=lambda e: e["t"])
    if not any("start" in e for e in events):
        events = sorted(_spans_from_logs(events), key=lambda e: e["t"])
    points: list[tuple[float, str]] = [(t0, STARTUP)]
    running: list[str] = []
    unsplit_next = False
    last_end = None
    for e in events:
        if "log" in e:
            unsplit_next = unsplit_next or str(e["log"]).startswith("export unsplit")
            continue
        if "start" in e:
            label = e["start"]
            if label == "export" and unsplit_next:
                label, unsplit_next = UNSPLIT, False
            running.append(label)
        elif "end" in e and running:
            ended = running.pop()
            label = running[-1] if running else ended
            last_end = e["t"]
        else:
            continue
        if label != points[-1][1]:
            points.append((max(e["t"], points[-1][0]), label))
    if last_end is not None and not running:
        points.append((max(last_end, points[-1][0]), EXIT))
    return tuple(points)


def _spans_from_logs(events: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Start and end events from the stage log records: ``stage NAME: start`` where the
    pipeline logs it (exact, nesting kept), else each span ended by its ``stage NAME: SECONDS
    s`` record (the stage's own seconds, so an outer stage appears to start late)."""
    events = list(events)
    explicit = any(_STAGE_START.match(str(e.get("log", ""))) for e in events)
    for e in events:
        text = str(e.get("log", ""))
        if m := _STAGE_START.match(text):
            yield {"t": e["t"], "start": m["stage"]}
        elif m := _STAGE_LOG.match(text):
            if not explicit:
                yield {"t": e["t"] - float(m["seconds"]), "start": m["stage"]}
            yield {"t": e["t"], "end": m["stage"]}
        elif "log" in e:
            yield dict(e)


def label_at(points: Sequence[tuple[float, str]], t: float) -> str:
    """The label of ``points`` (from `stage_timeline`) at time ``t``."""
    i = bisect.bisect_right([p[0] for p in points], t) - 1
    return points[max(i, 0)][1]


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """One stage's share of a compile.

    Attributes:
        stage: the stage's label (`stage_timeline`).
        seconds: wall-clock time it ran, all its runs together, s.
        peak_rss_mb: the largest summed RSS of the process tree while it ran, MB (None: no
            sample fell in it).
        peak_pss_mb: the same in PSS, MB (None: not read, or no sample).
        peak_root_rss_mb: the compiler process's own largest RSS, MB.
        processes: the most processes the tree had.
        samples: how many samples fell in it.
    """

    stage: str
    seconds: float
    peak_rss_mb: float | None
    peak_pss_mb: float | None
    peak_root_rss_mb: float | None
    processes: int
    samples: int


def by_stage(
    samples: Sequence[Sample], points: Sequence[tuple[float, str]], *, t_end: float
) -> tuple[StageMemory, ...]:
    """Each stage's seconds and peaks, in the order the stages first ran."""
    seconds: dict[str, float] = {}
    for (t, label), (t_next, _) in zip(points, [*points[1:], (t_end, "")], strict=True):
        seconds[label] = seconds.get(label, 0.0) + max(0.0, t_next - t)
    groups: dict[str, list[Sample]] = {label: [] for label in seconds}
    for s in samples:
        groups.setdefault(label_at(points, s.t), []).append(s)
    rows = []
    for label, group in groups.items():
        pss = [s.pss_bytes for s in group if s.pss_bytes is not None]
        rows.append(
            StageMemory(
                stage=label,
                seconds=round(seconds.get(label, 0.0), 3),
                peak_rss_mb=_mb(max((s.rss_bytes for s in group), default=None)),
                peak_pss_mb=_mb(max(pss, default=None)),
                peak_root_rss_mb=_mb(max((s.root_rss_bytes for s in group), default=None)),
                processes=max((s.processes for s in group), default=0),
                samples=len(group),
            )
        )
    return tuple(rows)


def _mb(n: float | None) -> float | None:
    return None if n is None else round(n / MB, 1)


# --- one measured compile ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CompileMemory:
    """One measured compile.

    Attributes:
        command: the ``mopar`` arguments it ran with.
        returncode: its exit code; error: the last line of its stderr when not 0.
        seconds: wall-clock time from start to exit, s.
        weights_bytes: the model's parameter bytes (None: no bundle was written).
        stages: each stage's seconds and peaks (`StageMemory`).
        peak_rss_mb, peak_pss_mb: the largest summed RSS and PSS of the tree, MB.
        peak_root_rss_mb: the largest sampled RSS of the compiler process alone, MB.
        kernel_max_rss_mb: the kernel's peak RSS of the largest single process of the tree
            (``ru_maxrss``: exact, where the sampled figures may miss a short peak), MB.
        functions: the written plan's functions; memory_mb: their sizes, MB.
        largest_function_peak_mb: the largest peak RSS measured of a function (``plan.json``
            ``sizing``), MB.
        cap: the cap search, when made (`CapSearch`).
        interval_s: the sampling interval asked; samples: taken; sample_ms: their mean cost.
        machine: CPUs and memory of the machine measured on.
    """

    command: tuple[str, ...]
    returncode: int
    seconds: float
    weights_bytes: int | None
    stages: tuple[StageMemory, ...]
    peak_rss_mb: float | None
    peak_pss_mb: float | None
    peak_root_rss_mb: float | None
    kernel_max_rss_mb: float
    functions: int | None = None
    memory_mb: tuple[int, ...] = ()
    largest_function_peak_mb: float | None = None
    cap: CapSearch | None = None
    error: str = ""
    interval_s: float = 0.1
    samples: int = 0
    sample_ms: float | None = None
    machine: Mapping[str, Any] = field(default_factory=dict)

    @property
    def weights_mb(self) -> float | None:
        return _mb(self.weights_bytes)

    def ratio(self, mb: float | None) -> float | None:
        """``mb`` over the weights (None where either is unknown)."""
        if mb is None or not self.weights_bytes:
            return None
        return round(mb * MB / self.weights_bytes, 3)

    @property
    def seconds_per_gb(self) -> float | None:
        """Compile seconds per GB of weights."""
        return round(self.seconds / (self.weights_bytes / 1e9), 1) if self.weights_bytes else None

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["weights_mb"] = self.weights_mb
        doc["seconds_per_gb"] = self.seconds_per_gb
        doc["ratios"] = {
            "peak_rss": self.ratio(self.peak_rss_mb),
            "peak_pss": self.ratio(self.peak_pss_mb),
            "peak_root_rss": self.ratio(self.peak_root_rss_mb),
            "kernel_max_rss": self.ratio(self.kernel_max_rss_mb),
        }
        for row in doc["stages"]:
            row["rss_x_weights"] = self.ratio(row["peak_rss_mb"])
            row["pss_x_weights"] = self.ratio(row["peak_pss_mb"])
        if self.cap is not None and self.cap.cap_mb and self.largest_function_peak_mb:
            doc["cap"]["cap_over_largest_peak"] = round(
                self.cap.cap_mb / self.largest_function_peak_mb, 3
            )
        return doc


_CHILD = "import sys; from benchmarks.compile_memory import _child; _child(sys.argv[1:])"


def measure_compile(
    model: str,
    args: Sequence[str],
    *,
    work: Path,
    interval: float = 0.1,
    pss: bool = True,
    cap: CapSearch | None = None,
    limit_mb: float | None = None,
) -> CompileMemory:
    """Run ``mopar compile MODEL *args`` (writing its bundle under ``work`` unless ``args``
    name ``--out``) in a process of its own, sampling its tree every ``interval`` s; killed
    where the tree's summed RSS passes ``limit_mb``."""
    work.mkdir(parents=True, exist_ok=True)
    args = list(args)
    if "--out" not in args:
        args += ["--out", str(work / "bundle"), "--force"]
    bundle = Path(args[args.index("--out") + 1])
    events = work / "events.jsonl"
    events.unlink(missing_ok=True)
    command = ("compile", model, *args)
    log = work / "compile.log"
    available = _available_gb()
    with log.open("w") as sink:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(events), *command],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=environment(),
        )
        limit = None if limit_mb is None else int(limit_mb * MB)
        samples, ended = sample_until_exit(proc, interval=interval, pss=pss, limit_bytes=limit)
        t_end = time.monotonic()
    points = stage_timeline(_read_events(events), t0=t0)
    doc = _document(bundle) if ended.returncode == 0 else None
    cost = [b.t - a.t for a, b in zip(samples, samples[1:], strict=False)]
    return CompileMemory(
        command=command,
        returncode=ended.returncode,
        error=(
            f"killed: the tree passed {limit_mb:,.0f} MB of RSS"
            if ended.killed
            else ("" if ended.returncode == 0 else _last_line(log))
        ),
        seconds=round(t_end - t0, 2),
        weights_bytes=sum(la.param_bytes for la in doc.layers) if doc else _pt2_weights(model),
        stages=by_stage(samples, points, t_end=t_end),
        peak_rss_mb=_mb(max((s.rss_bytes for s in samples), default=None)),
        peak_pss_mb=_mb(max((s.pss_bytes or 0 for s in samples), default=None) if pss else None),
        peak_root_rss_mb=_mb(max((s.root_rss_bytes for s in samples), default=None)),
        kernel_max_rss_mb=_mb(ended.max_rss_bytes) or 0.0,
        functions=len(doc.plan["functions"]) if doc else None,
        memory_mb=tuple(doc.memory_mb().values()) if doc else (),
        largest_function_peak_mb=(
            max((s.peak_rss_mb for s in doc.sizing), default=None) if doc and doc.sizing else None
        ),
        cap=cap,
        interval_s=interval,
        samples=len(samples),
        sample_ms=round(1000 * sum(cost) / len(cost), 1) if cost else None,
        machine={**_machine(), "available_gb_at_start": available},
    )


def _document(bundle: Path):
    from mopar.bundle.document import read_document
    from mopar.errors import MoparError

    try:
        return read_document(bundle)
    except MoparError:
        return None


def _pt2_weights(model: str) -> int | None:
    """The bytes of a ``.pt2``'s weights, from its archive's table of contents (no torch, no
    loading): for a compile that wrote no bundle. None: not a ``.pt2``."""
    import zipfile

    path = Path(model)
    if path.suffix != ".pt2" or not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        return sum(
            i.file_size
            for i in archive.infolist()
            if "/data/weights/" in i.filename and not i.filename.endswith(".json")
        )


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a kill
            out.append(json.loads(line))
    return out


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _machine() -> dict[str, Any]:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "available_gb_at_end": _available_gb(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _available_gb() -> float:
    import psutil

    return round(psutil.virtual_memory().available / 2**30, 1)


# --- inside the compile process ----------------------------------------------------------------


def _child(argv: Sequence[str]) -> None:
    """``mopar *argv[1:]`` with its stage events recorded in file ``argv[0]``: when
    ``mopar.pipeline.capture`` and each ``Stopwatch.stage`` block start and end, and every INFO
    record of the ``mopar`` logger, one JSON object a line."""
    import logging

    sink = open(argv[0], "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def record(**event: Any) -> None:
        sink.write(json.dumps({"t": time.monotonic(), **event}) + "\n")

    class Events(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            with contextlib.suppress(Exception):  # logging's contract: a handler never raises
                record(log=r.getMessage())

    logger = logging.getLogger("mopar")
    logger.addHandler(Events(logging.INFO))
    logger.setLevel(logging.INFO)
    _hook_stages(record)
    sys.argv = ["mopar", *argv[1:]]
    import runpy

    runpy.run_module("mopar", run_name="__main__", alter_sys=True)  # ``python -m mopar``


def _hook_stages(record) -> None:
    """Record the start and end of capture and of every ``Stopwatch.stage`` block (where the
    pipeline still has them; otherwise the log records alone tell the stages)."""
    import functools

    from mopar import pipeline

    @contextlib.contextmanager
    def timed(name: str) -> Iterator[None]:
        record(start=name)
        try:
            yield
        finally:
            record(end=name)

    stopwatch = getattr(pipeline, "Stopwatch", None)
    if stopwatch is not None and hasattr(stopwatch, "stage"):
        inner = stopwatch.stage

        def stage(self, name: str):
            with timed(name), inner(self, name):
                yield

        stopwatch.stage = contextlib.contextmanager(functools.wraps(inner)(stage))
    if "capture" in getattr(pipeline, "FUNCTIONS", {}):
        # one set on the package, else the stage's, imported when first called: torch is not
        # imported before the compile imports it
        capture = vars(pipeline).get("capture") or capture_stage

        @functools.wraps(capture)
        def captured(*a: Any, **kw: Any) -> Any:
            with timed("capture"):
                return capture(*a, **kw)

        pipeline.capture = captured


def capture_stage(*a: Any, **kw: Any) -> Any:
    """`mopar.pipeline.stages.capture`, imported when called."""
    from mopar.pipeline.stages import capture

    return capture(*a, **kw)


# --- the table ---------------------------------------------------------------------------------


def table(m: CompileMemory) -> str:
    """An 80-column text table of ``m``: per stage, then the totals."""

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def x(mb: float | None) -> str:  # over the weights, in a 6-column cell
        r = m.ratio(mb)
        return ">99" if r is not None and r > 99 else f(r, ".2f")

    lines = [
        f"mopar {' '.join(m.command)}",
        f"exit {m.returncode}{': ' + _short(m.error) if m.error else ''}",
        f"weights {f(m.weights_mb, ',.1f')} MB; {m.samples} samples every {m.interval_s:g} s "
        f"(each {f(m.sample_ms, '.1f')} ms apart on average)",
        "",
        f"{'stage':<15}{'wall s':>8}{'tree RSS MB':>13}{'xW':>6}{'tree PSS MB':>13}{'xW':>6}"
        f"{'compiler MB':>13}{'procs':>6}",
    ]
    for r in m.stages:
        lines.append(
            f"{r.stage:<15}{r.seconds:>8.1f}{f(r.peak_rss_mb, ',.0f'):>13}"
            f"{x(r.peak_rss_mb):>6}{f(r.peak_pss_mb, ',.0f'):>13}"
            f"{x(r.peak_pss_mb):>6}{f(r.peak_root_rss_mb, ',.0f'):>13}"
            f"{r.processes:>6}"
        )
    lines.append(
        f"{'whole compile':<15}{m.seconds:>8.1f}{f(m.peak_rss_mb, ',.0f'):>13}"
        f"{x(m.peak_rss_mb):>6}{f(m.peak_pss_mb, ',.0f'):>13}"
        f"{x(m.peak_pss_mb):>6}{f(m.peak_root_rss_mb, ',.0f'):>13}"
    )
    lines += [
        "",
        f"compile: {m.seconds:.1f} s, {f(m.seconds_per_gb, '.1f')} s per GB of weights; "
        f"largest process (kernel peak) {m.kernel_max_rss_mb:,.0f} MB "
        f"({x(m.kernel_max_rss_mb)}x)",
    ]
    if m.functions is not None:
        lines.append(
            f"plan: {m.functions} functions of {', '.join(map(str, m.memory_mb[:8]))}"
            f"{' ...' if len(m.memory_mb) > 8 else ''} MB; largest measured function peak "
            f"{f(m.largest_function_peak_mb, ',.0f')} MB"
        )
    if (c := m.cap) is not None:
        lines.append(
            f"cap search ({c.target}, {c.probes} plans, {c.seconds:.0f} s): smallest accepted "
            f"{f(c.cap_mb, 'd')} MB, largest refused {f(c.refused_mb, 'd')} MB"
        )
        if c.cap_mb and m.largest_function_peak_mb:
            lines.append(
                f"cap / largest measured function peak under it: "
                f"{c.cap_mb / m.largest_function_peak_mb:.2f}x (goal: at most 1.3x)"
            )
    # the table's rows are 80 columns; the sentences around it wrap there
    return "\n".join(textwrap.fill(ln, 80, subsequent_indent="  ") if ln else ln for ln in lines)


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_memory",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    parser.add_argument("model", help="what `mopar compile` takes: a .pt2, a .pt, a factory")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures here")
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder of the bundle, log and events (default: a temporary one)",
    )
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("--no-pss", action="store_true", help="sum RSS only (cheaper samples)")
    parser.add_argument(
        "--kill-above-mb",
        type=float,
        default=None,
        help="kill the compile when its tree's summed RSS passes this (default: never)",
    )
    parser.add_argument(
        "--cap-search",
        action="store_true",
        help="first find the smallest --max-memory-mb planning accepts, then compile at it",
    )
    parser.add_argument(
        "--caps-only",
        action="store_true",
        help="with --cap-search: search, print and write the cap alone, compile nothing",
    )
    args, compile_args = parser.parse_known_args(argv)
    if "--max-memory-mb" in compile_args and args.cap_search:
        parser.error("--cap-search sets --max-memory-mb itself; leave it out")
    cap = None
    if args.cap_search:
        cap = cap_search_in_subprocess(args.model, compile_args)
        print(f"cap search: smallest accepted {cap.cap_mb} MB ({cap.probes} plans)", flush=True)
        if args.caps_only:
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"model": args.model, **asdict(cap)}) + "\n")
            print(f"largest refused {cap.refused_mb} MB: {cap.refusal}")
            return 0
        if cap.cap_mb is not None:
            compile_args = [*compile_args, "--max-memory-mb", str(cap.cap_mb)]
    with contextlib.ExitStack() as stack:
        work = args.work
        if work is None:
            import tempfile

            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mopar-mem-")))
        measured = measure_compile(
            args.model,
            compile_args,
            work=work,
            interval=args.interval,
            pss=not args.no_pss,
            cap=cap,
            limit_mb=args.kill_above_mb,
        )
    print(table(measured))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(measured.to_dict(), indent=1) + "\n")
    return 0 if measured.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
