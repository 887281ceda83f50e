"""``mopar bench --containers``: each bundle served by host processes and by containers.

For each model it compiles the strategies asked for (`benchmarks.serving.compiled_bundles`),
builds each bundle's images (`mopar.container.build`), and serves the bundle twice with the same
closed loop:

- **host**: the shm runner's worker processes, the plan's memory enforced by the runner's
  VmHWM guard (`RunConfig.enforce_memory`);
- **containers**: one container per function (`mopar.container.session`), the plan's memory
  and vCPU share enforced by the kernel, co-located functions on a shared tmpfs.

Each run gives MC (allocated GB x p50 seconds per request; none when a request failed), p50/p95
and OOM kills; each
container, its cold start (container start to a loaded session) and the session load alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mopar.config import RunConfig
from mopar.errors import MoparError

__all__ = ["ContainerRow", "StartRow", "run_container_bench", "containers_markdown"]


@dataclass(frozen=True, kw_only=True)
class ContainerRow:
    """One bundle served one way (``host`` or ``containers``)."""

    model: str
    variant: str
    runner: str
    functions: int
    requests: int
    errors: int
    oom_kills: int
    p50_ms: float | None
    p95_ms: float | None
    mc_gb_s: float | None
    peak_mb: float
    allocated_mb: int
    max_abs_err: float | None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class StartRow:
    """One function's container: its image above the base, and its cold start."""

    model: str
    variant: str
    function: str
    memory_mb: int
    vcpus: float
    image_mb: float
    weights_mb: float
    start_ms: float | None
    session_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def run_container_bench(
    models: Sequence[str],
    variants: Sequence[str],
    *,
    requests: int,
    concurrency: int,
    quick: bool,
    target: str,
    baseline_slices: int | None,
    base_image: str | None,
    workdir: Path,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[ContainerRow], list[StartRow], tuple[str, ...]]:
    """Serve every bundle on the host and in containers (see the module); return the runs,
    the containers' starts, and the engine's notes on this host."""
    from benchmarks.serving import compiled_bundles
    from mopar.container.build import images_for
    from mopar.container.session import ContainerSession
    from mopar.runner.local import run_bundles

    tell = progress or (lambda _: None)
    rows: list[ContainerRow] = []
    starts: list[StartRow] = []
    notes: tuple[str, ...] = ()
    run = RunConfig(requests=requests, concurrency=concurrency, timeout_s=60.0)
    for model, label, manifest, analysis in compiled_bundles(
        models,
        variants,
        target=target,
        baseline_slices=baseline_slices,
        quick=quick,
        workdir=workdir,
        tell=tell,
    ):
        inputs, expected = analysis.captured.inputs, analysis.captured.reference
        tell(f"{model}: {label} on the host")
        host = run_bundles(
            [manifest], inputs, expected=expected, config=replace(run, enforce_memory=True)
        )[0]
        rows.append(_row(model, label, "host", manifest, host))
        tell(f"{model}: {label}, images")
        engine, images = images_for(manifest, base_image=base_image)
        notes = engine.notes
        tell(f"{model}: {label} in containers")
        sessions: list[ContainerSession] = []

        def session_for(m, i, redis_url, engine=engine, images=images, sessions=sessions):
            sessions.append(
                ContainerSession(m, run, engine=engine, images={b.function: b.tag for b in images})
            )
            return sessions[-1]

        try:
            (report,) = run_bundles(
                [manifest], inputs, config=run, expected=expected, session_for=session_for
            )
        except MoparError as exc:  # e.g. a function killed for memory as it starts
            rows.append(
                ContainerRow(
                    model=model,
                    variant=label,
                    runner="containers",
                    functions=len(manifest.slices),
                    requests=0,
                    errors=requests,
                    oom_kills=int("exit 137" in str(exc)),
                    p50_ms=None,
                    p95_ms=None,
                    mc_gb_s=None,
                    peak_mb=0.0,
                    allocated_mb=sum(s.memory_mb for s in manifest.slices),
                    max_abs_err=None,
                    note=" ".join(str(exc).split())[:160],
                )
            )
            continue
        rows.append(_row(model, label, "containers", manifest, report))
        session = sessions[0]
        for image, s in zip(images, report.slices):
            starts.append(
                StartRow(
                    model=model,
                    variant=label,
                    function=s.name,
                    memory_mb=s.allocated_mb,
                    vcpus=session.vcpus.get(s.name, 1.0),
                    image_mb=image.above_base_mb,
                    weights_mb=image.weights_mb,
                    start_ms=session.starts[s.name][0] if session.starts[s.name] else None,
                    session_ms=s.load_ms,
                )
            )
    if not rows:
        raise MoparError("no bundle could be served; see the messages above")
    return rows, starts, notes


def _row(model: str, label: str, runner: str, manifest, report) -> ContainerRow:
    return ContainerRow(
        model=model,
        variant=label,
        runner=runner,
        functions=len(manifest.slices),
        requests=report.requests,
        errors=report.errors,
        oom_kills=report.oom_kills,
        p50_ms=report.latency_p50_ms,
        p95_ms=report.latency_p95_ms,
        mc_gb_s=report.mc_gb_s()
        if report.latency_p50_ms is not None and not report.errors
        else None,  # failed requests would make it look cheaper
        peak_mb=round(sum(s.peak_rss_mb for s in report.slices), 1),
        allocated_mb=sum(s.allocated_mb for s in report.slices),
        max_abs_err=report.max_abs_err,
        note=report.error_messages[0][:160] if report.error_messages else "",
    )


def containers_markdown(rows: Sequence[ContainerRow], starts: Sequence[StartRow]) -> str:
    """The runs, containers next to host processes (ratios container / host), then each
    container's image and cold start."""
    host = {(r.model, r.variant): r for r in rows if r.runner == "host"}

    def val(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def ratio(r: ContainerRow, field: str) -> str:
        ours = getattr(r, field)
        base = getattr(host.get((r.model, r.variant)), field, None)
        if r.runner == "host" or ours is None or not base:
            return ""
        return f" ({ours / base:.2f}x)"

    lines = [
        "| model | plan | functions | runner | p50 ms | p95 ms | MC GB-s/request | "
        "peak / allocated MB | OOM kills | failed / requests |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.variant} | {r.functions} | {r.runner} | "
            f"{val(r.p50_ms, '.1f')}{ratio(r, 'p50_ms')} | {val(r.p95_ms, '.1f')}"
            f"{ratio(r, 'p95_ms')} | {val(r.mc_gb_s, '.3g')}{ratio(r, 'mc_gb_s')} | "
            f"{r.peak_mb:.0f} / {r.allocated_mb} | {r.oom_kills} | {r.errors} / {r.requests} |"
        )
    notes = [f"- {r.model} {r.variant}, {r.runner}: {r.note}" for r in rows if r.note]
    lines += [
        "",
        *notes,
        *([""] if notes else []),
        "| model | plan | function | memory MB | vCPU | image above base MB | weights MB | "
        "cold start ms (container + session) | session load ms |",
        "|" + "---|" * 9,
    ]
    for s in starts:
        lines.append(
            f"| {s.model} | {s.variant} | {s.function} | {s.memory_mb} | "
            f"{s.vcpus:g} | {s.image_mb:.0f} | {s.weights_mb:.1f} | "
            f"{val(s.start_ms, '.0f')} | {s.session_ms:.0f} |"
        )
    return "\n".join(lines) + "\n"
