"""The machine factor: how much faster or slower this machine runs what the time predictors
predict, from a short measured probe, cached per machine.

The time predictors were trained on operator samples measured on one CPU (``predictors.json``
says which); a plan priced with them on another machine is off by that machine's speed. A
probe of a handful of representative ONNX operators (`PROBE`: gemm, a matmul over a sequence,
two convs, attention, batched matmul, layer norm, GELU, an embedding gather), run through
onnxruntime as a slice runs them (`mopar.runtime.handler.session_options`, at the predictors'
thread count; the mean of back-to-back runs after a warm-up, `_time_ms` says why not the
median), is compared with the predictors' own predictions for the same operators. The geometric mean of the
ratios (measured / predicted) is the factor every predicted time is multiplied by
(`mopar.profile.store.Predictors.time_factor`). Each family's own factor is recorded and shown
(`by_family`), not applied: at load averages of 8-12 on the shared 2-core machine, one factor
left ResNet-50's and BERT-mini's unsplit times 0.98-1.30x off in 12 probes, one per family
0.71-1.36x (docs/profiler.md).

Read in this order: `MachineKey` (what the cache is keyed on), `OpTiming` and `MachineFactor`
(the result, and the plan note that states it), `derive` and `by_family` (the factors from
timings), `measure` and `timings` (the probe itself), then `machine_factor` (the cache, the
probe, or a given factor) and `calibrated`.

The probe runs in the compiling process and takes 1-3 s. Its result is cached in
``$XDG_CACHE_HOME/mopar/`` (``~/.cache/mopar/``), one file per `MachineKey`; a corrupt or
unreadable entry, or one measured under another load (`LOAD_TOLERANCE`), is measured again.
``MOPAR_MACHINE_FACTOR`` (a positive number) gives the factor instead of measuring it: the test
suite sets it to 1, so that plans do not depend on the speed of the machine that runs the tests.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mopar._files import write_text_atomic
from mopar.errors import MoparError
from mopar.profile.features import feature_vector
from mopar.profile.ops import OpSample, build_model, feature_row, make_inputs, make_sample
from mopar.profile.store import Predictors, cpu_model, version_of

__all__ = [
    "ENV_FACTOR",
    "PROBE",
    "PROBE_FORMAT_VERSION",
    "MachineFactor",
    "MachineFactorError",
    "MachineKey",
    "OpTiming",
    "cache_folder",
    "calibrated",
    "by_family",
    "derive",
    "machine_factor",
    "machine_key",
    "measure",
    "probe_samples",
    "timings",
    "trained_on",
    "uncalibrated",
]

log = logging.getLogger(__name__)

PROBE_FORMAT_VERSION = 2
"""Part of every cache key: bump when `PROBE`, `measure` or `derive` change what they give."""

ENV_FACTOR = "MOPAR_MACHINE_FACTOR"
"""An environment variable that gives the machine factor instead of measuring it (a positive
number; tests set it to 1)."""

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


# --- what a cache entry is keyed on -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MachineKey:
    """What a measured factor holds for: the machine, the runtime, and the predictors.

    Attributes:
        cpu: the CPU model (``/proc/cpuinfo``).
        cores: CPUs this process may run on (its affinity).
        quota: the cgroup's CPU quota, CPUs (0: none).
        onnxruntime: the onnxruntime version the probe ran.
        predictors: a digest of the predictors' ``predictors.json`` (another training: another
            factor).
        threads: the intra-op thread count the probe ran at (the predictors').
        probe: `PROBE_FORMAT_VERSION`.
    """

    cpu: str
    cores: int
    quota: float
    onnxruntime: str
    predictors: str
    threads: int
    probe: int = PROBE_FORMAT_VERSION

    def digest(self) -> str:
        """16 hex digits naming the cache entry."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """The machine in words, as the plan note states it."""
        quota = f", a CPU quota of {self.quota:g}" if self.quota else ""
        return f"{self.cpu}, {self.cores} usable core{'s' * (self.cores != 1)}{quota}"


def _cpu_quota() -> float:
    """The cgroup's CPU quota, CPUs (0: none or unreadable); cgroup v2, else v1."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return 0.0 if quota == "max" else float(quota) / float(period)
    except (OSError, ValueError):
        pass
    try:
        quota = float(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = float(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else 0.0
    except (OSError, ValueError):
        return 0.0


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine_key(predictors: Predictors) -> MachineKey:
    """This machine's `MachineKey` for ``predictors``."""
    meta = json.dumps(predictors.meta, sort_keys=True, default=str)
    return MachineKey(
        cpu=cpu_model(),
        cores=_usable_cores(),
        quota=round(_cpu_quota(), 3),
        onnxruntime=version_of("onnxruntime"),
        predictors=hashlib.sha256(meta.encode()).hexdigest()[:12],
        threads=_threads(predictors),
    )


def _threads(predictors: Predictors) -> int:
    return max(int(round(predictors.threads)), 1)


# --- the result ---------------------------------------------------------------------------------


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
class MachineFactor:
    """How this machine's times compare with the predictors'.

    Attributes:
        machine: this machine, in words (`MachineKey.describe`).
        trained_on: the CPU the predictors' samples were measured on, in words.
        factor: every predicted time is multiplied by it: the geometric mean of the probe's
            ratios (measured / predicted; 1: as trained).
        families: each probed family's own factor, for the record (not applied).
        source: ``probe`` (measured now), ``cache`` (measured earlier, read back), ``given``
            (`ENV_FACTOR`) or ``off`` (not calibrated).
        spread: the geometric standard deviation of the operators' ratios (1: all alike).
        measured_at: when the probe ran (ISO 8601, UTC; empty unless measured).
        load: the 1-minute load average when the probe ran (None: not measured).
        ops: the probe's operators.
    """

    machine: str
    trained_on: str
    factor: float = 1.0
    families: Mapping[str, float] = field(default_factory=dict)
    source: str = "off"
    spread: float = 1.0
    measured_at: str = ""
    load: float | None = None
    ops: tuple[OpTiming, ...] = ()

    def note(self) -> str:
        """The plan note that says which machine the plan was priced for."""
        if self.source == "off":
            return (
                f"priced for the machine the time predictors' samples were measured on "
                f"({self.trained_on}), not this one ({self.machine}): calibration off"
            )
        if self.source == "given":
            how = f"x{self.factor:.3g}, given by {ENV_FACTOR}"
        else:
            when = "measured now" if self.source == "probe" else f"measured {self.measured_at}"
            load = f", load average {self.load:.2f}" if self.load is not None else ""
            probed = ", ".join(f"{f} x{v:.2g}" for f, v in sorted(self.families.items()))
            how = (
                f"x{self.factor:.3g} ({when} on {len(self.ops)} operators{load}; by op family "
                f"{probed})"
            )
        return (
            f"priced for this machine ({self.machine}): predicted times {how}; the predictors' "
            f"samples were measured on {self.trained_on}"
        )

    def summary(self) -> dict[str, Any]:
        """What a plan records of it (`mopar.plan.Plan.priced_for`)."""
        return {
            "machine": self.machine,
            "trained_on": self.trained_on,
            "time_factor": round(self.factor, 4),
            "family_factors": {f: round(v, 4) for f, v in sorted(self.families.items())},
            "source": self.source,
            "spread": round(self.spread, 4),
            "measured_at": self.measured_at,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MachineFactor:
        ops = tuple(OpTiming(**o) for o in data.get("ops", ()))
        found = cls(**{**data, "ops": ops, "families": dict(data.get("families", {}))})
        for value in (found.factor, *found.families.values()):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"factor {value!r} is not a positive number")
        return found


def trained_on(predictors: Predictors) -> str:
    """The CPU the predictors' samples were measured on (``measured_on``; predictors trained
    before it say only the machine that trained them, ``machine``), in words."""
    if measured := predictors.meta.get("measured_on"):
        return str(measured)
    machine = predictors.meta.get("machine", {})
    cpu, cores = machine.get("cpu") or "an unknown CPU", machine.get("cores")
    return f"{cpu}, {cores} cores" if cores else str(cpu)


# --- the factor from timings --------------------------------------------------------------------


def derive(timings: Sequence[OpTiming]) -> tuple[float, float]:
    """The factor (the geometric mean of measured / predicted) and the spread of the ratios
    (their geometric standard deviation) of ``timings``.

    A geometric mean, because the predictors' errors are multiplicative: an operator twice as
    slow and one twice as fast as predicted cancel.

    Raises:
        ValueError: no timing, or one that is not a positive, finite time.
    """
    if not timings:
        raise ValueError("no probe timings to derive a machine factor from")
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


# --- the probe ----------------------------------------------------------------------------------


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
    with tempfile.TemporaryDirectory(prefix="mopar-machine-") as folder:
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
    """The probe's operators with their predictions (uncalibrated) beside ``measured`` (ms by
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


# --- the cache, the probe, or a given factor ----------------------------------------------------


def cache_folder(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/mopar``, else ``~/.cache/mopar``."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mopar"


class MachineFactorError(MoparError):
    """A machine factor given in the environment is not a positive number."""


def machine_factor(
    predictors: Predictors,
    *,
    probe: Callable[[int], Mapping[str, float]] = measure,
    cache: Path | None = None,
    environ: Mapping[str, str] = os.environ,
    loadavg: Callable[[], float | None] = lambda: _load(),
) -> MachineFactor:
    """This machine's factor for ``predictors``: given by `ENV_FACTOR`, else read from the
    cache, else measured by ``probe`` (`measure`; tests pass their own) and cached.

    Args:
        cache: the cache folder (None: `cache_folder`).
        environ: where `ENV_FACTOR` and ``XDG_CACHE_HOME`` are read.
        loadavg: the 1-minute load average now (None: unknown); a cached factor measured
            under another load is measured again (`LOAD_TOLERANCE`).

    Raises:
        MachineFactorError: `ENV_FACTOR` is set to something other than a positive number.
    """
    key = machine_key(predictors)
    base = MachineFactor(machine=key.describe(), trained_on=trained_on(predictors))
    given = environ.get(ENV_FACTOR)
    if given is not None:
        try:
            factor = float(given)
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor > 0):
            raise MachineFactorError(
                f"{ENV_FACTOR}={given!r} is not a positive number; set it to the factor "
                f"predicted times are multiplied by (1: as trained), or unset it to measure "
                f"this machine"
            )
        return replace(base, factor=factor, source="given")
    path = (cache or cache_folder(environ)) / f"machine-{key.digest()}.json"
    cached = _read(path, key)
    load = loadavg()
    if cached is not None and _same_load(cached.load, load, key.cores):
        return replace(cached, machine=base.machine, trained_on=base.trained_on, source="cache")
    ops = timings(predictors, probe(key.threads))
    factor, spread = derive(ops)
    found = replace(
        base,
        factor=factor,
        families=by_family(ops),
        source="probe",
        spread=spread,
        measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        load=load,
        ops=ops,
    )
    log.info("machine factor x%.3g (%s), cached in %s", factor, found.families, path)
    _write(path, key, found)
    return found


LOAD_TOLERANCE = 0.25
"""A cached factor is measured again when the load average per usable core has moved more than
this since: on a shared machine, other processes slow the probe's threads (and the slices')
by up to 2x, so a factor holds for the load it was measured under."""


def _same_load(then: float | None, now: float | None, cores: int) -> bool:
    if then is None or now is None:
        return then is None and now is None
    return abs(now - then) / max(cores, 1) <= LOAD_TOLERANCE


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _read(path: Path, key: MachineKey) -> MachineFactor | None:
    """The cached factor at ``path`` for ``key``; None when absent, corrupt or another key's."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != asdict(key):
            return None
        return MachineFactor.from_dict(data["factor"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning(
            "the machine factor cached in %s is unreadable (%s); measuring again", path, exc
        )
        return None


def _write(path: Path, key: MachineKey, found: MachineFactor) -> None:
    """Cache ``found`` at ``path``; a cache that cannot be written is skipped, with a warning."""
    text = json.dumps({"key": asdict(key), "factor": found.to_dict()}, indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as exc:
        log.warning("could not cache the machine factor in %s (%s)", path, exc)


def calibrated(
    predictors: Predictors, found: MachineFactor | None = None, **probe: Any
) -> tuple[Predictors, MachineFactor]:
    """``predictors`` with their times multiplied by this machine's factor (``found``, else
    `machine_factor` with ``probe``'s keywords), and that factor."""
    found = found or machine_factor(predictors, **probe)
    return replace(predictors, time_factor=found.factor), found


def uncalibrated(predictors: Predictors) -> MachineFactor:
    """The factor of predictors priced as trained (calibration off)."""
    return MachineFactor(
        machine=machine_key(predictors).describe(), trained_on=trained_on(predictors)
    )
