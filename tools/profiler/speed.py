"""A target's speed: how much slower or faster a CPU runs what the time predictors predict,
measured once by a short probe where the functions will run, and written into a profiles
folder as the target's ``speed`` (``mopar profile calibrate --speed TARGET``).

Plans are priced for the target's CPU, never for the compiling machine's load: the factor is a
stated fact of the target in ``platforms.json`` (`mopar.facts.Platform.time_factor`), and this
module is how one is measured. The time predictors were trained on operator samples measured on
one CPU (``predictors.json``'s ``measured_on``). A probe of a handful of representative ONNX
operators (`PROBE`: gemm, a matmul over a sequence, two convs, attention, batched matmul, layer
norm, GELU, an embedding gather), run through onnxruntime as a slice runs them
(`mopar.runtime.handler.session_options`, at the predictors' thread count; the mean of
back-to-back runs after a warm-up, `_time_ms` says why not the median), is compared with the
predictors' own predictions for the same operators. The geometric mean of the ratios (measured
/ predicted) is the target's ``time_factor``. Each family's own factor is recorded beside it
(`by_family`), not applied: at load averages of 8-12 on the shared 2-core machine, one factor
left ResNet-50's and BERT-mini's unsplit times 0.98-1.30x off in 12 probes, one per family
0.71-1.36x (docs/profiler.md).

Read in this order: `OpTiming` and `Speed` (the result and the ``speed`` entry it writes),
`derive` and `by_family` (the factors from timings), then `measure` and `timings` (the probe).
The probe takes 1-3 s; run it on a quiet machine of the kind the functions run on.

Or measure the functions themselves where they run (`measure_function`, ``--bundle DIR --url
URL``): a bundle's entry function as deployed, at the CPU its plan gives it, sent the bundle's
example request; the factor is the plan's own corrected by each function's own time against
its prediction.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mopar.profile.features import feature_vector
from mopar.profile.store import Predictors, cpu_model, version_of
from tools.profiler.ops import OpSample, build_model, feature_row, make_inputs, make_sample

__all__ = [
    "PROBE",
    "FunctionSpeed",
    "OpTiming",
    "Speed",
    "by_family",
    "derive",
    "measure",
    "measure_function",
    "probe_samples",
    "speed_of",
    "timings",
]

PROBE: tuple[tuple[str, str, dict[str, int]], ...] = (
    ("gemm", "2d", {"batch": 16, "in_features": 1024, "out_features": 1024}),
    ("gemm", "3d", {"batch": 1, "seq": 128, "in_features": 768, "out_features": 768}),
    (
        "conv",
        "regular",
        {"batch": 1, "cin": 64, "cout": 64, "size": 56, "kernel": 3, "stride": 1, "groups": 1},
    ),
    (
        "conv",
        "regular",
        {"batch": 1, "cin": 256, "cout": 128, "size": 28, "kernel": 1, "stride": 1, "groups": 1},
    ),
    ("attention", "sdpa", {"batch": 1, "heads": 12, "seq": 128, "head_dim": 64}),
    ("batched_matmul", "3d", {"batch": 12, "m": 128, "k": 64, "n": 128}),
    ("layer_norm", "last_axis", {"batch": 1, "seq": 128, "channels": 768}),
    ("elementwise", "gelu", {"rank": 3, "batch": 1, "seq": 128, "channels": 3072}),
    ("embedding", "gather", {"batch": 1, "seq": 128, "vocab": 8192, "dim": 512}),
)
"""The probe's operators: (sweep op, variant, config), each 0.1-5 ms on a 2-core server, the
families that dominate the examples' layers."""

_BUDGET_S = 0.15  # timed runs per operator, seconds (at least _MIN_RUNS runs)
_MIN_RUNS = 5
_MAX_RUNS = 200
_WARMUP_RUNS = 3  # the first runs of a fresh session pack weights and fault pages in


@dataclass(frozen=True, kw_only=True)
class OpTiming:
    """One probe operator: what the predictors predict and what it measured here, ms."""

    name: str
    family: str
    predicted_ms: float
    measured_ms: float

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured_ms / self.predicted_ms


@dataclass(frozen=True, kw_only=True)
class Speed:
    """A CPU's times against the predictors', as the probe measured them.

    Attributes:
        machine: the CPU it ran on, in words.
        trained_on: the CPU the predictors' samples were measured on, in words.
        factor: every predicted time is multiplied by it: the geometric mean of the probe's
            ratios (measured / predicted).
        families: each probed family's own factor, for the record (not applied).
        spread: the geometric standard deviation of the operators' ratios (1: all alike).
        measured_at: when the probe ran (ISO 8601, UTC).
        load: the 1-minute load average when the probe ran (None: unknown).
        ops: the probe's operators.
    """

    machine: str
    trained_on: str
    factor: float
    families: Mapping[str, float] = field(default_factory=dict)
    spread: float = 1.0
    measured_at: str = ""
    load: float | None = None
    ops: tuple[OpTiming, ...] = ()

    def entry(self) -> dict[str, Any]:
        """The target's ``speed`` entry of ``platforms.json``: the factor, where it comes from
        and what was measured."""
        load = f", load average {self.load:.2f}" if self.load is not None else ""
        return {
            "time_factor": round(self.factor, 4),
            "source": (
                f"measured by `mopar profile calibrate --speed` on {self.machine}, "
                f"{self.measured_at}{load}: {len(self.ops)} operators against the predictors "
                f"trained on {self.trained_on}"
            ),
            "measured": {
                "family_factors": {f: round(v, 4) for f, v in sorted(self.families.items())},
                "spread": round(self.spread, 4),
                "ops": [asdict(o) for o in self.ops],
            },
        }


def derive(timings: Sequence[OpTiming]) -> tuple[float, float]:
    """The factor (the geometric mean of measured / predicted) and the spread of the ratios
    (their geometric standard deviation) of ``timings``.

    A geometric mean, because the predictors' errors are multiplicative: an operator twice as
    slow and one twice as fast as predicted cancel.

    Raises:
        ValueError: no timing, or one that is not a positive, finite time.
    """
    if not timings:
        raise ValueError("no probe timings to derive a speed from")
    for t in timings:
        if not (t.predicted_ms > 0 and t.measured_ms > 0) or not math.isfinite(t.ratio):
            raise ValueError(f"probe operator {t.name}: times must be positive, got {t}")
    logs = [math.log(t.ratio) for t in timings]
    spread = math.exp(statistics.pstdev(logs)) if len(logs) > 1 else 1.0
    return math.exp(statistics.fmean(logs)), spread


def by_family(timings: Sequence[OpTiming]) -> dict[str, float]:
    """Each family's factor: the geometric mean of its operators' ratios."""
    logs: dict[str, list[float]] = {}
    for t in timings:
        logs.setdefault(t.family, []).append(math.log(t.ratio))
    return {f: math.exp(statistics.fmean(v)) for f, v in logs.items()}


def probe_samples() -> dict[str, OpSample]:
    """The `PROBE` operators by name: ``op/variant``, and ``op/variant/2`` for a second one."""
    out: dict[str, OpSample] = {}
    for op, variant, config in PROBE:
        name = f"{op}/{variant}"
        n = sum(1 for k in out if k.startswith(name))
        out[f"{name}/{n + 1}" if n else name] = make_sample(op, variant, config)
    return out


def _time_ms(session: Any, feed: dict[str, np.ndarray]) -> float:
    """The mean time of back-to-back runs after `_WARMUP_RUNS` untimed.

    The mean, not the median `tools.profiler.probe` takes: on a loaded machine a run of a few
    ms mostly fits between two preemptions, and their median misses the time other processes
    take, which a slice's run of 100s of ms pays in full. On a quiet machine the two agree.
    """
    for _ in range(_WARMUP_RUNS):
        session.run(None, feed)
    runs = 0
    start = time.perf_counter()
    while runs < _MIN_RUNS or (time.perf_counter() - start < _BUDGET_S and runs < _MAX_RUNS):
        session.run(None, feed)
        runs += 1
    return (time.perf_counter() - start) * 1e3 / runs


def measure(threads: int) -> dict[str, float]:
    """Time every `PROBE` operator here, ms by name (``conv/regular``), under the slices'
    session options at ``threads`` intra-op threads."""
    import onnx
    import onnxruntime as ort

    from mopar.runtime.handler import session_options

    measured: dict[str, float] = {}
    samples = list(probe_samples().items())
    with tempfile.TemporaryDirectory(prefix="mopar-speed-") as folder:
        # the first operator once more, untimed, ahead of the others: a process's first session
        # starts onnxruntime's thread pools, and a CPU idle until then runs slowly at first
        for k, (name, sample) in enumerate([samples[0], *samples]):
            path = Path(folder) / "op.onnx"
            onnx.save(build_model(sample), str(path))
            session = ort.InferenceSession(
                str(path), session_options(threads), providers=["CPUExecutionProvider"]
            )
            ms = _time_ms(session, make_inputs(sample))
            if k:
                measured[name] = ms
            del session
    return measured


def timings(predictors: Predictors, measured: Mapping[str, float]) -> tuple[OpTiming, ...]:
    """The probe's operators with their predictions (as trained) beside ``measured`` (ms by
    name, as `measure` gives them); operators ``measured`` lacks are left out."""
    samples = {n: s for n, s in probe_samples().items() if n in measured}
    if not samples:
        return ()
    x = np.stack([feature_vector(feature_row(s)) for s in samples.values()])
    predicted = replace(predictors, time_factor=1.0).predict_time_ms(x)
    return tuple(
        OpTiming(name=n, family=s.family, predicted_ms=float(p), measured_ms=float(measured[n]))
        for (n, s), p in zip(samples.items(), predicted, strict=True)
    )


def speed_of(predictors: Predictors, measured: Mapping[str, float]) -> Speed:
    """The `Speed` that ``measured`` (`measure`'s timings) shows against ``predictors``."""
    ops = timings(predictors, measured)
    factor, spread = derive(ops)
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:
        load = None
    return Speed(
        machine=f"{cpu_model()}, {len(os.sched_getaffinity(0))} usable cores, "
        f"onnxruntime {version_of('onnxruntime')}",
        trained_on=predictors.trained_on,
        factor=factor,
        families=by_family(ops),
        spread=spread,
        measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        load=load,
        ops=ops,
    )


# --- a bundle's deployed function ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FunctionSpeed:
    """A target's speed from a bundle's functions where they are deployed: each function's own
    time (``X-Mopar-Timing``: decoding, running and encoding, as its answers report it) against
    the time its plan predicted for it there, at its planned CPU (`measure_function`).

    Attributes:
        url: where the requests went (the bundle's entry function as deployed).
        bundle: the bundle's folder.
        requests: measured requests (after the warm-up).
        measured_ms: each function's median own time, ms.
        predicted_ms: the time plan.json predicted for each, ms (at ``old_factor``).
        old_factor: the time factor plan.json was priced with.
        measured_at: when, UTC.
    """

    url: str
    bundle: str
    requests: int
    measured_ms: dict[str, float]
    predicted_ms: dict[str, float]
    old_factor: float
    measured_at: str

    @property
    def ratio(self) -> float:
        """Measured over predicted, summed over the functions the answers named."""
        return sum(self.measured_ms.values()) / sum(self.predicted_ms[n] for n in self.measured_ms)

    @property
    def factor(self) -> float:
        """The target's time factor: the plan's own, corrected by `ratio`."""
        return self.old_factor * self.ratio

    def entry(self) -> dict[str, Any]:
        """The target's ``speed`` entry of ``platforms.json`` (as `Speed.entry`)."""
        names = ", ".join(self.measured_ms)
        return {
            "time_factor": round(self.factor, 4),
            "source": (
                f"measured by `mopar profile calibrate --speed --bundle --url` on "
                f"{self.measured_at}: {self.requests} requests to {self.url}, the own times of "
                f"{names} of {self.bundle} against its plan's predictions at "
                f"x{self.old_factor:g}"
            ),
            "measured": {
                "measured_ms": self.measured_ms,
                "predicted_ms": {n: self.predicted_ms[n] for n in self.measured_ms},
                "ratio": round(self.ratio, 4),
            },
        }


def measure_function(
    bundle: Path, url: str, *, requests: int = 20, warmup: int = 3, timeout_s: float = 300.0
) -> FunctionSpeed:
    """Send the bundle's example inputs (``reference.npz``) to its entry function at ``url``,
    deployed with the CPU its plan gives it, ``warmup`` and then ``requests`` times one after
    another, and compare each function's own time with its plan's prediction.

    Raises:
        MoparError: the bundle or the answers say nothing to compare, in one line.
    """
    import urllib.request

    from mopar.bundle.document import read_document
    from mopar.errors import MoparError
    from mopar.runner.bundle import read_reference
    from mopar.runtime.frame import encode_frame

    document = read_document(bundle)
    plan = document.plan
    predicted = {f["name"]: float(f["time_ms"]) for f in plan["functions"]}
    old = float((plan.get("priced_for") or {}).get("time_factor", 1.0))
    frame = encode_frame(read_reference(bundle / "reference.npz")[0])
    own: dict[str, list[float]] = {}
    for k in range(warmup + requests):
        request = urllib.request.Request(
            url, data=frame, headers={"Content-Type": "application/octet-stream"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                answer.read()
                timing = answer.headers.get("X-Mopar-Timing", "")
        except OSError as exc:
            raise MoparError(
                f"--url {url} did not answer the bundle's example request ({exc}); give the URL "
                "of the bundle's entry function as deployed"
            ) from None
        entries = dict(e.partition("=")[::2] for e in timing.split(",") if "=" in e)
        times = {n: float(ms) for n, ms in entries.items() if n in predicted}
        if not times:
            raise MoparError(
                f"--url {url} answered without the own time of any function of {bundle} "
                f"(X-Mopar-Timing {timing!r}); give the URL of one of its functions as deployed"
            )
        if k >= warmup:
            for name, ms in times.items():
                own.setdefault(name, []).append(ms)
    return FunctionSpeed(
        url=url,
        bundle=str(bundle),
        requests=requests,
        measured_ms={n: round(statistics.median(ms), 3) for n, ms in own.items()},
        predicted_ms=predicted,
        old_factor=old,
        measured_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
