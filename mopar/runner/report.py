"""What a local run measured: per slice (`SliceStats`), per request (`Served`) and end to end
(`RunReport`).

Both runners fill them in: the shm scheduler (`mopar.runner.shm_session`) and the chain of function
servers (`mopar.runner.chain`); the CLI and the benchmark read them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from mopar.config import Tolerance
from mopar.errors import Option, OptionError
from mopar.runner.check import Comparison
from mopar.runtime.chains import Span

__all__ = ["RunReport", "Served", "SliceStats", "Span", "read_run"]


@dataclass(frozen=True, kw_only=True)
class Served:
    """One measured request, each function's part of it, for the bill: own time is always
    billed, the wait where the chain mode makes a caller wait (`RunReport.chain` names the mode
    emulated), INIT where the platform bills it (`mopar.bill`). The shm runner fills it from its
    workers' replies (a caller's wait emulated from the chain mode: in ``invoke`` and ``http`` a
    function on the path waits from its own answer to the request's, its instance busy
    meanwhile); the chain of function servers and Lambda handlers from the spans each function
    measured and handed on with the answer (``X-Mopar-Invocations``).

    Attributes:
        arrival_s: when it arrived, s since the measured window began.
        latency_ms: from its arrival to its answer, ms (None: it failed).
        invocations: each function invocation it made, in the order they ran (a failed
            request: those the runner heard of).
        answered_ms: when each of ``invocations`` answered, ms after the arrival, as the runner
            saw it (the shm runner; empty where functions hand their spans on themselves).
    """

    arrival_s: float
    latency_ms: float | None
    invocations: tuple[Span, ...] = ()
    answered_ms: tuple[float, ...] = ()

    @property
    def cold_starts(self) -> int:
        """Invocations that found their instance cold (and waited for its INIT)."""
        return sum(1 for s in self.invocations if s.init_ms > 0)


@dataclass(frozen=True, kw_only=True)
class SliceStats:
    """Measurements of one slice process over the measured requests.

    Attributes:
        name: the slice's name.
        peak_rss_mb: the process's peak resident set size, MB (includes the runtime baseline).
        allocated_mb: the memory size the plan gave the slice, MB.
        p50_ms: median time to read inputs, run and write outputs, ms (None: no request served).
        p95_ms: 95th percentile of the same, ms (None: no request served).
        load_ms: time to import the handler and create the onnxruntime session, ms.
        calls: measured requests it served (an expert function serves only the requests whose
            tokens reached it).
        billed_ms: the sum over those calls of each one's ms rounded up to a whole ms (Lambda's
            billing increment).
        cold_starts: instances started while measuring (by a request or a pre-warm-up).
        cold_start_ms: their median time from process start to a loaded session, ms.
        init_ms: the sum of those times, ms (what Lambda bills as INIT).
        instances: the most instances it ran at once.
        instance_s: instance-seconds it ran while measuring (what replicas reserve).
        oom_kills: instances killed for going over their allocation (``enforce_memory``).
        samples_ms: each measured call's time, ms, to 0.01 ms (the distribution `mopar
            simulate --profile` draws from).
    """

    name: str
    peak_rss_mb: float
    allocated_mb: int
    p50_ms: float | None
    p95_ms: float | None
    load_ms: float
    calls: int = 0
    billed_ms: float = 0.0
    cold_starts: int = 0
    cold_start_ms: float | None = None
    init_ms: float = 0.0
    instances: int = 1
    instance_s: float = 0.0
    oom_kills: int = 0
    samples_ms: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """The result of one bundle's run (`mopar.runner.local.run_bundles`); `to_dict` follows
    the ``mopar run --json`` schema."""

    slices: tuple[SliceStats, ...]
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    requests: int
    errors: int
    comparison: Comparison | None  # None: outputs were not checked
    tolerance: Tolerance = Tolerance()
    error_messages: tuple[str, ...] = ()
    transport: str = "shm"
    cold: dict | None = None  # where functions can be cold: their starts and pre-warm-ups
    latency_p99_ms: float | None = None
    load: dict | None = None  # an open loop's rate, throughput and latency over time
    chain: str = ""  # the chain mode emulated (`mopar.runtime.chains`)
    served: tuple[Served, ...] = ()  # each measured request's invocations
    # the process each function ran in, which its peak_rss_mb measured: ``worker`` (the shm
    # runner's), ``server`` (the function server), ``lambda-handler`` (the Lambda handler
    # behind `mopar.targets.aws_lambda.emulate.LambdaHost`) or ``container`` (its image; a cgroup's peak)
    served_by: str = "worker"

    @property
    def oom_kills(self) -> int:
        return sum(s.oom_kills for s in self.slices)

    def invocations(self) -> float:
        """Function invocations per measured request."""
        return sum(s.calls for s in self.slices) / max(self.requests, 1)

    def mc_gb_s(self) -> float:
        """MC per request: allocated GB x median seconds of each function, weighted by the
        share of requests that invoked it."""
        n = max(self.requests, 1)
        return sum(
            s.allocated_mb / 1024 * (s.p50_ms or 0.0) / 1e3 * s.calls / n for s in self.slices
        )

    @property
    def passed(self) -> bool:
        """Every request answered, and every answer within the tolerance (False also when
        outputs were not checked)."""
        return self.comparison is not None and self.comparison.passed and not self.errors

    def verdict(self, tolerance: Tolerance) -> str | None:
        """The check's one line (None: outputs were not checked). A request that failed gave
        no output to compare, so a run with failures never reads as matching."""
        check = self.comparison
        if check is None:
            return None
        if not self.errors:
            return check.describe(tolerance)
        answered = self.requests - self.errors
        head = f"failed: {self.errors} of {self.requests} requests got no answer to compare"
        if answered <= 0:
            return head
        if check.passed:
            return (
                f"{head}; the {answered} answers received are within tolerance "
                f"({check.figures(tolerance)})"
            )
        return f"{head}; and of the {answered} answers received, {check.describe(tolerance)}"

    @property
    def max_abs_err(self) -> float | None:
        return None if self.comparison is None else self.comparison.max_abs_err

    @property
    def max_rel_err(self) -> float | None:
        return None if self.comparison is None else self.comparison.max_rel_err

    def to_dict(self) -> dict:
        check = self.comparison
        return {
            "slices": [asdict(s) for s in self.slices],
            "latency_ms": {
                "p50": self.latency_p50_ms,
                "p95": self.latency_p95_ms,
                "p99": self.latency_p99_ms,
            },
            "requests": self.requests,
            "errors": self.errors,
            "max_abs_err": self.max_abs_err,
            "max_rel_err": self.max_rel_err,
            "check": None
            if check is None
            else {
                "passed": self.passed,
                "rtol": self.tolerance.rtol,
                "atol": self.tolerance.atol,
                "worst_output": check.output,
                "worst_ratio": check.ratio,
            },
            "transport": self.transport,
            "served_by": self.served_by,
            "invocations_per_request": round(self.invocations(), 3),
            "mc_gb_s": self.mc_gb_s(),
            "oom_kills": self.oom_kills,
            **({"cold": self.cold} if self.cold is not None else {}),
            **({"load": self.load} if self.load is not None else {}),
        }


def read_run(path: Path) -> dict[str, SliceStats]:
    """The slices of a ``mopar run --json`` or ``mopar load --json`` report (or of ``mopar
    max-rate``'s best step), by name: the one reader of that file.

    Raises:
        OptionError: the file is missing, not JSON, or not such a report.
    """
    fix = "save one with `mopar load BUNDLE --rate R --json > RUN.json`"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OptionError(
            Option("profile", value=str(path), quoted=True),
            f" cannot be read as JSON ({type(exc).__name__}); {fix}",
        ) from None
    if isinstance(data, dict) and isinstance(data.get("report"), dict):
        data = data["report"]  # mopar max-rate: its best step
    slices = data.get("slices") if isinstance(data, dict) else None
    known = {f.name for f in fields(SliceStats)}
    try:
        stats = [
            SliceStats(
                **{
                    **{k: v for k, v in s.items() if k in known},
                    "samples_ms": tuple(float(v) for v in s.get("samples_ms") or ()),
                }
            )
            for s in slices
        ]
    except (TypeError, ValueError, AttributeError) as exc:
        raise OptionError(
            Option("profile", value=str(path), quoted=True),
            f" is not a `mopar run --json` report ({type(exc).__name__}: {exc}); {fix}",
        ) from None
    return {s.name: s for s in stats}
