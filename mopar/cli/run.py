"""``mopar run``: serve a bundle locally, one process per slice, and measure it."""

from __future__ import annotations

import click

from mopar.cli.build import container_options
from mopar.cli.common import (
    Number,
    emit_json,
    redis_url_option,
    stderr,
    stdout,
    timeout_option,
    tolerance_options,
    transport_option,
)
from mopar.runner.load import GRACE_S, MAX_RATE_RPS
from mopar.runtime.transports import transport_named

__all__ = ["run_cmd"]


@click.command("run")
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option(
    "--input",
    "input_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="An .npz of inputs (default: the bundle's reference.npz).",
)
@click.option(
    "--check", is_flag=True, help="Compare outputs with the reference; exit 1 on mismatch."
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Measured requests (after one warm-up request).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Requests in flight at once.",
)
@transport_option(
    help="How slices hand tensors over: shm (pipe-driven workers, /dev/shm), http (each "
    "slice's function server on 127.0.0.1, chained) or redis (the same servers, "
    "frames handed over through Redis)."
)
@redis_url_option
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="onnxruntime intra-op threads per slice (0: onnxruntime's default).",
)
@tolerance_options(decided="the bundle's, from compile")
@timeout_option(default=300.0, help="Seconds to wait for a slice before failing.")
@click.option(
    "--baseline",
    type=click.Path(file_okay=False),
    default=None,
    help="Also run this bundle (e.g. the model compiled with --slices 1), requests "
    "interleaved A B A B, and print the ratios of the two.",
)
@click.option(
    "--cold-experts",
    is_flag=True,
    help="Expert functions start cold, as scaled to zero: each is started when first "
    "called or pre-warmed, and all stop after every request (shm only).",
)
@click.option(
    "--prewarm/--no-prewarm",
    default=True,
    show_default=True,
    help="With --cold-experts: start the expert functions a dispatch predicts for the "
    "next layer as soon as it predicts them.",
)
@click.option(
    "--rate",
    type=Number(min=0, min_open=True),
    default=None,
    metavar="RPS",
    help="An open loop instead: Poisson arrivals at RPS requests per second for "
    f"--duration, latency counted from each arrival; at most {MAX_RATE_RPS:g}. With "
    "--find-max-rate: the first rate tried (default 1).",
)
@click.option(
    "--duration",
    "duration_s",
    type=Number(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help=f"Seconds of open-loop arrivals (per step); requests still in flight {GRACE_S:g} s after "
    "the last arrival count as failed.",
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Open loop: arrivals while this many requests are in flight are dropped "
    "(throttled), never queued, and count as errors.",
)
@click.option(
    "--slo-ms",
    type=Number(min=0, min_open=True),
    default=None,
    help="Latency objective for --find-max-rate, ms (p95).",
)
@click.option(
    "--find-max-rate",
    is_flag=True,
    help="Search (doubling, then bisection) for the highest open-loop rate whose p95 "
    "stays within --slo-ms with no failed request.",
)
@click.option(
    "--instances",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="The most instances (worker processes) each function may run; another starts "
    "(a cold start) when the running ones are busy.",
)
@click.option(
    "--instance-concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Requests in flight per instance before another starts (1: as Lambda).",
)
@click.option(
    "--idle-s",
    type=Number(min=0),
    default=None,
    help="Stop an instance idle this many seconds, down to none (scale to zero; default: never).",
)
@click.option(
    "--cold",
    "start_cold",
    is_flag=True,
    help="Start with every function scaled to zero: no warm-up request; the first "
    "request starts them and its latency is reported.",
)
@click.option(
    "--enforce-memory",
    is_flag=True,
    help="Kill an instance whose peak RSS goes over its allocation, as the platform "
    "would; its requests fail and the kill is counted.",
)
@click.option(
    "--containers",
    is_flag=True,
    help="Run each function as a container of its image (built first if missing, as "
    "`mopar build` does), with the plan's memory and CPU as its limits; "
    "co-located functions share a tmpfs, the others talk HTTP on loopback.",
)
@click.option(
    "--target",
    "bill_target",
    default=None,
    help="With --rate: the platform whose bill of what was served is reported (default: the "
    "one the bundle was planned for).",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the open loop's arrivals."
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="A --generate bundle: after the steps, --requests generations of this many tokens "
    "after the reference's prompt, timed (first token, per token, tokens per second).",
)
@container_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def run_cmd(
    bundle,
    input_file,
    check,
    requests,
    concurrency,
    transport,
    redis_url,
    threads,
    rtol,
    atol,
    timeout_s,
    baseline,
    cold_experts,
    prewarm,
    rate,
    duration_s,
    max_in_flight,
    slo_ms,
    find_max_rate,
    instances,
    instance_concurrency,
    idle_s,
    start_cold,
    enforce_memory,
    containers,
    engine,
    base_image,
    wheelhouse,
    offline,
    bill_target,
    seed,
    max_new_tokens,
    as_json,
) -> None:
    """Run BUNDLE locally: one OS process per slice instance, tensors handed over by
    --transport; a closed loop (--requests, --concurrency) or an open one (--rate, --duration)."""
    import signal
    from dataclasses import replace
    from pathlib import Path

    from mopar.cli.render import compare_table, load_lines, run_table
    from mopar.config import RunConfig
    from mopar.errors import BundleError, OptionError, VerificationError
    from mopar.runner.bundle import read_manifest, read_reference
    from mopar.runner.generation import generation_figures
    from mopar.runner.load import check_rate
    from mopar.sim import bill_run

    # A plain `kill` must clean up like Ctrl-C does: unwind through the runner's finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C too, even when started with SIGINT ignored (a background job of a script): an
    # interrupt sent on purpose must not leave slice processes and /dev/shm files behind.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    serving = {
        "--cold-experts": cold_experts,
        "--instances": instances > 1,
        "--instance-concurrency": instance_concurrency > 1,
        "--idle-s": idle_s is not None,
        "--cold": start_cold,
        "--enforce-memory": enforce_memory,
    }
    if (not transport_named(transport).colocated or containers) and any(serving.values()):
        flag = next(k for k, v in serving.items() if v)
        raise OptionError(
            f"{flag} runs with --transport shm only, without --containers (where "
            "the kernel enforces memory); drop one of them"
        )
    if rate is not None:
        check_rate(rate)  # before anything starts
    if find_max_rate and (slo_ms is None or baseline):
        raise OptionError(
            "--find-max-rate needs --slo-ms and no --baseline; e.g. --find-max-rate --slo-ms 200"
        )
    manifest = read_manifest(Path(bundle))
    # the bill of an open loop: its platform read before anything runs (a bad --target fails)
    billed_on = _billed_on(manifest, bill_target) if rate is not None else None
    tolerance = _tolerance(manifest, rtol, atol)
    config = RunConfig(
        requests=requests,
        concurrency=concurrency,
        timeout_s=timeout_s,
        intra_op_threads=threads,
        tolerance=tolerance,
        cold_experts=cold_experts,
        prewarm=prewarm,
        rate=None if find_max_rate else rate,
        duration_s=duration_s,
        max_in_flight=max_in_flight,
        instances=instances,
        instance_concurrency=instance_concurrency,
        idle_s=idle_s,
        start_cold=start_cold,
        enforce_memory=enforce_memory,
        seed=seed,
    )
    inputs, expected = read_reference(Path(input_file or Path(bundle) / "reference.npz"))
    if check and not expected:
        raise BundleError(
            f"--check needs expected outputs, and {input_file} has no output.* "
            "arrays; drop --input to check against reference.npz"
        )
    manifests = [manifest] + ([read_manifest(Path(baseline))] if baseline else [])
    session_for = None
    if containers:
        session_for = _container_sessions(
            manifests, config, transport, engine, base_image, wheelhouse, offline, as_json
        )
    if find_max_rate:
        _max_rate(
            manifest,
            inputs,
            replace(config, rate=rate),
            slo_ms,
            expected if check else None,
            as_json,
            transport,
            redis_url,
            session_for,
        )
        return
    reports = _run(
        manifests,
        inputs,
        config,
        expected if check else None,
        as_json,
        transport=transport,
        redis_url=redis_url,
        session_for=session_for,
    )
    report, whole = reports[0], (reports[1] if baseline else None)
    bill = bill_run(report, manifest.document, *billed_on) if billed_on is not None else None
    generated = (
        generation_figures(
            manifest,
            inputs,
            max_new_tokens,
            requests,
            timeout_s,
            transport="shm" if transport_named(transport).colocated else "http",
        )
        if manifest.document.generation is not None
        else None
    )
    if as_json:
        data = report.to_dict()
        if generated is not None:
            data["generation"] = generated.to_dict()
        if bill is not None:
            data["cost_per_1m_usd"] = bill.cost_per_1m_usd
            data["bill"] = bill.to_dict()
        if whole is not None:
            data["baseline"] = whole.to_dict()
        emit_json(data)
    else:
        load = f"open loop {rate:g} req/s" if rate is not None else f"concurrency {concurrency}"
        stdout.print(
            run_table(
                report,
                f"{manifest.model}: {len(manifest.slices)} slices, "
                f"{report.requests} requests, {load}, "
                f"{report.transport}",
            )
        )
        if whole is not None:
            stdout.print(compare_table(report, whole))
        for line in load_lines(report):
            stdout.print(line)
        if bill is not None:
            per = "-" if bill.cost_per_1m_usd is None else f"${bill.cost_per_1m_usd:.4g}"
            stdout.print(
                f"bill on {bill.target} (chain {bill.chain}): {per} per 1M requests; "
                f"includes {bill.includes}",
                highlight=False,
            )
        if report.cold is not None:
            c = report.cold
            stdout.print(
                f"cold starts: {c['cold_starts']} started by a request, "
                f"{c['prewarmed']} pre-warmed ({c['prewarm_used']} then used); "
                f"median start {c['start_ms_p50'] or 0:.0f} ms"
            )
        if check:
            stdout.print(f"check: {report.verdict(tolerance)}")
        if generated is not None:
            stdout.print(f"generation: {generated.describe()}", highlight=False)
    if report.errors:
        raise VerificationError(
            f"{report.errors} of {report.requests} requests failed; first: "
            f"{report.error_messages[0]}"
        )
    if check and not report.comparison.passed:
        raise VerificationError(
            f"{report.comparison.describe(tolerance)}; pass a wider --rtol or "
            "--atol if that is expected"
        )


def _tolerance(manifest, rtol: float | None, atol: float | None):
    """The given tolerances, else those the bundle was verified with at compile (which lossy
    codecs may have widened)."""
    from mopar.config import Tolerance

    verified = manifest.document.verification or Tolerance()
    return Tolerance(
        rtol=rtol if rtol is not None else verified.rtol,
        atol=atol if atol is not None else verified.atol,
    )


def _max_rate(
    manifest,
    inputs,
    config,
    slo_ms: float,
    expected,
    as_json: bool,
    transport: str,
    redis_url: str,
    session_for,
) -> None:
    """``--find-max-rate``: print the rates tried and the best one's report."""
    import contextlib

    from mopar.cli.render import load_lines, rate_table, run_table
    from mopar.errors import VerificationError
    from mopar.runner.chain import ChainSession
    from mopar.runner.local import max_rate
    from mopar.runner.processes import local_redis

    def tell(rate: float, report) -> None:
        if not as_json:
            stderr.print(
                f"{rate:g} req/s: p95 {report.latency_p95_ms or 0:.1f} ms, {report.errors} failed"
            )

    with contextlib.ExitStack() as stack:
        if transport_named(transport).needs_redis and not redis_url:
            redis_url = stack.enter_context(local_redis())
        session = (
            session_for(manifest, 0, redis_url)
            if session_for is not None
            else None
            if transport_named(transport).colocated
            else ChainSession(manifest, config, transport=transport, redis_url=redis_url)
        )
        best, steps, report = max_rate(
            manifest,
            inputs,
            config=config,
            slo_ms=slo_ms,
            expected=expected,
            on_step=tell,
            session=session,
        )
    if as_json:
        emit_json(
            {
                "slo_ms": slo_ms,
                "max_rate_rps": best,
                "steps": [
                    {"rate_rps": s.rate, "p95_ms": s.p95_ms, "errors": s.errors, "met": s.met}
                    for s in steps
                ],
                "report": None if report is None else report.to_dict(),
            }
        )
    else:
        stdout.print(rate_table(steps, slo_ms, best))
        if report is not None:
            stdout.print(run_table(report, f"{manifest.model} at {best:g} req/s"))
            for line in load_lines(report):
                stdout.print(line)
    if report is not None and expected is not None and not report.comparison.passed:
        raise VerificationError(
            f"{report.comparison.describe(config.tolerance)}; pass a wider "
            "--rtol or --atol if that is expected"
        )


def _container_sessions(
    manifests, config, transport, engine, base_image, wheelhouse, offline, quiet: bool
):
    """``--containers``: each bundle's images (built if missing), and a session maker."""
    from contextlib import nullcontext
    from pathlib import Path

    from mopar.container.build import images_for
    from mopar.container.session import ContainerSession

    images = []
    with stderr.status("building images", spinner="dots") if not quiet else nullcontext():
        for m in manifests:
            ready, built = images_for(
                m,
                engine=engine,
                base_image=base_image,
                wheelhouse=Path(wheelhouse) if wheelhouse else None,
                offline=offline,
            )
            images.append({b.function: b.tag for b in built})
    for note in ready.notes:
        click.echo(note, err=True)
    kind = "plan" if transport_named(transport).colocated else transport
    return lambda m, i, redis_url: ContainerSession(
        m, config, engine=ready, images=images[i], transport=kind, redis_url=redis_url
    )


def _run(
    manifests,
    inputs,
    config,
    expected,
    quiet: bool,
    *,
    transport: str,
    redis_url: str,
    session_for=None,
):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mopar.runner.local import run_bundles

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=quiet or not stderr.is_terminal,
    ) as progress:
        total = len(manifests) if config.rate is not None else config.requests
        task = progress.add_task(f"running {manifests[0].model}", total=total)
        return run_bundles(
            manifests,
            inputs,
            config=config,
            expected=expected,
            on_request=lambda n: progress.update(task, completed=n),
            transport=transport,
            redis_url=redis_url,
            session_for=session_for,
        )


def _billed_on(manifest, target: str | None):
    """The platform and chain mode the run's bill is for (`mopar.sim.bill_run`): ``target``
    (default: the plan's), in the plan's chain mode where it is that platform's, else the
    platform's default."""
    from mopar.bill import chain_on
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform

    plan = manifest.document.plan
    platform = load_platform(PROFILES_DIR, target or plan.get("target", "openfaas"))
    return platform, chain_on(platform, plan.get("chain") or "")
