"""``mopar run``, ``mopar load`` and ``mopar max-rate``: serve a bundle locally, one process per
slice, and measure it.

Read in order: the three commands, which differ in their traffic (`run`: a closed loop of
``--requests``; `load`: open-loop arrivals at ``--rate``, and the bill of what was served;
`max-rate`: the highest open-loop rate within ``--slo-ms``), then `_serve`, the body they share,
and its helpers. ``mopar run``'s options of the open loop moved to the other two commands; given
to ``mopar run`` they are refused in one line that names where they went (`MOVED`).
"""

from __future__ import annotations

from typing import Any

import click

from mopar.cli.common import emit_json, progress_bar, stderr, stdout
from mopar.cli.options import (
    AUTOSCALER,
    BASELINE,
    BILLING,
    CONTAINERS,
    SERVING,
    TRAFFIC,
    Number,
    Spec,
    json_output,
    options,
)
from mopar.config import DEFAULT_TARGET
from mopar.runner.load import MAX_RATE_RPS
from mopar.runtime.transports import transport_named

__all__ = ["MOVED", "load_cmd", "max_rate_cmd", "run_cmd"]

_BUNDLE = click.argument("bundle", type=click.Path(file_okay=False))

CLOSED_LOOP: tuple[Spec, ...] = (
    Spec(
        decls=("--requests",),
        help="Measured requests (after one warm-up request).",
        type=click.IntRange(min=1),
        default=10,
        arg="N",
    ),
    Spec(
        decls=("--concurrency",),
        help="Requests in flight at once.",
        type=click.IntRange(min=1),
        default=1,
        arg="C",
    ),
    BASELINE,
)

GENERATION = Spec(
    decls=("--max-new-tokens",),
    help="A --generate bundle: after the steps, --requests generations of this many tokens "
    "after the reference's prompt, timed (first token, per token, tokens per second).",
    type=click.IntRange(min=1),
    default=32,
    arg="N",
)

RATE = Spec(
    decls=("--rate",),
    help="Poisson arrivals at RPS requests per second for --duration, latency counted from "
    f"each arrival; at most {MAX_RATE_RPS:g}.",
    type=Number(min=0, min_open=True),
    metavar="RPS",
    extra={"required": True},
    shown="required",
)

FIRST_RATE = Spec(
    decls=("--rate",),
    help=f"The first rate tried, requests per second; at most {MAX_RATE_RPS:g}.",
    type=Number(min=0, min_open=True),
    default=1.0,
    metavar="RPS",
)

SLO = Spec(
    decls=("--slo-ms",),
    help="Latency objective, ms (p95): the highest rate whose p95 stays within it with no "
    "failed request.",
    type=Number(min=0, min_open=True),
    metavar="MS",
    extra={"required": True},
    shown="required",
)

MOVED: dict[str, str] = {
    "--find-max-rate": "use `mopar max-rate BUNDLE --slo-ms MS`",
    "--slo-ms": "use `mopar max-rate BUNDLE --slo-ms MS`",
    "--rate": "use `mopar load BUNDLE --rate RPS` (an open loop)",
    "--duration": "use `mopar load BUNDLE --rate RPS --duration S`",
    "--max-in-flight": "use `mopar load BUNDLE --rate RPS --max-in-flight N`",
    "--seed": "use `mopar load BUNDLE --rate RPS --seed N`",
    "--target": "use `mopar load BUNDLE --rate RPS --target T` (the bill of an open loop)",
}
"""``mopar run``'s former options, and where each went (of several given, the first here is
named)."""


def _moved(fn):
    """``mopar run``'s former options, hidden: one given is refused, naming where it went."""
    for flag in reversed(MOVED):
        flag_only = flag == "--find-max-rate"
        fn = click.option(
            flag,
            f"moved_{flag[2:].replace('-', '_')}",
            is_flag=flag_only,
            default=False if flag_only else None,
            hidden=True,
        )(fn)
    return fn


def _refuse_moved(moved: dict[str, Any]) -> None:
    from mopar.errors import OptionError

    given = [f for f in MOVED if moved[f"moved_{f[2:].replace('-', '_')}"] not in (None, False)]
    if given:
        raise OptionError(f"{given[0]} moved from `mopar run`: {MOVED[given[0]]}")


@click.command("run")
@_BUNDLE
@options(
    SERVING,
    CLOSED_LOOP,
    AUTOSCALER,
    CONTAINERS,
    [GENERATION, json_output("Print the report as JSON.")],
)
@_moved
def run_cmd(bundle, **given) -> None:
    """Run BUNDLE locally: one OS process per slice instance, tensors handed over by
    --transport; a closed loop of --requests, --concurrency at a time (an open loop:
    `mopar load`; the highest rate within an SLO: `mopar max-rate`)."""
    _refuse_moved({k: given.pop(k) for k in list(given) if k.startswith("moved_")})
    _serve(bundle, **given)


@click.command("load")
@_BUNDLE
@options(
    [RATE],
    TRAFFIC,
    SERVING,
    [BASELINE],
    AUTOSCALER,
    CONTAINERS,
    BILLING,
    [json_output("Print the report as JSON.")],
)
def load_cmd(bundle, **given) -> None:
    """Serve BUNDLE locally under open-loop traffic: Poisson arrivals at --rate for --duration,
    each request's latency counted from when it was due; report what it served and what the
    platform would bill for it (--target)."""
    _serve(bundle, **given)


@click.command("max-rate")
@_BUNDLE
@options(
    [SLO, FIRST_RATE],
    TRAFFIC,
    SERVING,
    AUTOSCALER,
    CONTAINERS,
    [json_output("Print the rates tried and the best one's report as JSON.")],
)
def max_rate_cmd(bundle, **given) -> None:
    """Search, doubling then bisecting, for the highest open-loop rate at which BUNDLE's p95
    latency stays within --slo-ms with no failed request; print every rate tried."""
    _serve(bundle, find_max_rate=True, **given)


def _serve(
    bundle,
    *,
    input_file,
    check,
    transport,
    redis_url,
    threads,
    rtol,
    atol,
    timeout_s,
    cold_experts,
    prewarm,
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
    as_json,
    requests=None,
    concurrency=None,
    baseline=None,
    rate=None,
    duration_s=None,
    max_in_flight=None,
    seed=None,
    slo_ms=None,
    find_max_rate=False,
    bill_target=None,
    max_new_tokens=None,
) -> None:
    """The body of the three commands: an option a command does not take is None here, and
    the run's config keeps its default (`RunConfig`)."""
    import signal
    from dataclasses import replace
    from pathlib import Path

    from mopar.cli.render import bill_table, compare_table, label_of, load_lines, run_table
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
    manifest = read_manifest(Path(bundle))
    # the bill of an open loop: its platform read before anything runs (a bad --target fails)
    open_loop = rate is not None and not find_max_rate
    billed_on = _billed_on(manifest, bill_target) if open_loop else None
    tolerance = _tolerance(manifest, rtol, atol)
    given = {
        "requests": requests,
        "concurrency": concurrency,
        "duration_s": duration_s,
        "max_in_flight": max_in_flight,
        "seed": seed,
    }
    config = RunConfig(
        timeout_s=timeout_s,
        intra_op_threads=threads,
        tolerance=tolerance,
        cold_experts=cold_experts,
        prewarm=prewarm,
        rate=rate if open_loop else None,
        instances=instances,
        instance_concurrency=instance_concurrency,
        idle_s=idle_s,
        start_cold=start_cold,
        enforce_memory=enforce_memory,
        **{k: v for k, v in given.items() if v is not None},
    )
    requests, concurrency = config.requests, config.concurrency
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
    planned = _planned_bills(manifests) if baseline else None
    generated = (
        generation_figures(
            manifest,
            inputs,
            max_new_tokens,
            requests,
            timeout_s,
            transport="shm" if transport_named(transport).colocated else "http",
        )
        if max_new_tokens is not None and manifest.document.generation is not None
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
        if planned is not None:
            data["planned_bill"] = {
                "target": planned[2],
                "bundle": planned[0].to_dict(),
                "baseline": planned[1].to_dict(),
            }
        emit_json(data)
    else:
        load = f"open loop {rate:g} req/s" if rate is not None else f"concurrency {concurrency}"
        title = f"{manifest.model}: {len(manifest.slices)} slices, {report.requests} requests"
        stdout.print(run_table(report, f"{title}, {load}, {report.transport}"))
        if not containers:  # a container run hands on as planned across co-located cuts
            for line in _not_as_planned(manifest, transport):
                stdout.print(line, highlight=False)
        if whole is not None:
            stdout.print(compare_table(report, whole))
        if planned is not None:
            labels = tuple(label_of(len(m.slices)) for m in reversed(manifests))
            stdout.print(bill_table(planned[0], planned[1], labels=labels, target=planned[2]))
            stdout.print(_verdict(planned[0].usd, planned[1].usd, labels[1]), highlight=False)
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
    """``mopar max-rate``: print the rates tried and the best one's report."""
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


def _not_as_planned(manifest, transport: str) -> list[str]:
    """A note where the run hands cuts over by ``transport`` and ``manifest``'s plan by
    others (a plan for OpenFaaS Community Edition hands on over HTTP; ``--transport shm``, the
    default, is only the fastest here)."""
    from mopar.plan import REQUEST, RESPONSE

    planned = {
        e.get("transport") or ""
        for e in manifest.document.plan.get("edges", ())
        if e.get("src") != REQUEST and e.get("dst") != RESPONSE
    }
    planned.discard("")
    if not planned or planned == {transport}:
        return []
    return [
        f"note: {manifest.model}'s plan hands its cuts over by {', '.join(sorted(planned))}, "
        f"as it deploys; this run hands them over by {transport} (--transport "
        f"{sorted(planned)[0]} runs them as planned)"
    ]


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
    from mopar.runner.local import run_bundles

    with progress_bar(quiet=quiet) as progress:
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


def _verdict(usd: float, baseline_usd: float, label: str) -> str:
    """One line: how the bundle's planned bill compares with its baseline's."""
    ratio = usd / baseline_usd if baseline_usd else float("inf")
    if ratio > 1.005:
        return (
            f"{label}: {ratio:.2f}x the baseline's bill (dearer); `mopar plan MODEL` "
            "recommends a plan for this traffic (--rate R for yours)"
        )
    if ratio < 0.995:
        return f"{label}: {ratio:.2f}x the baseline's bill, cheaper"
    return f"{label}: the same bill as the baseline's"


def _planned_bills(manifests):
    """The bills of the bundle's plan and its baseline's (`mopar.bill.PlanBill`), each in its
    own chain mode, as the bundle's target charges them at the stated traffic (the default,
    the traffic plans are priced for without ``--rate``), and that target's name."""
    from mopar.bill import bill_plan, chain_on
    from mopar.plan import Plan

    platform, _ = _billed_on(manifests[0], None)
    plans = [Plan.from_dict(dict(m.document.plan)) for m in manifests]
    bills = [bill_plan(p, platform, chain_on(platform, p.chain)) for p in plans]
    return bills[0], bills[1], platform.target


def _billed_on(manifest, target: str | None):
    """The platform and chain mode the run's bill is for (`mopar.sim.bill_run`): ``target``
    (default: the plan's), in the plan's chain mode where it is that platform's, else the
    platform's default."""
    from mopar.bill import chain_on
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform

    plan = manifest.document.plan
    platform = load_platform(PROFILES_DIR, target or plan.get("target", DEFAULT_TARGET))
    return platform, chain_on(platform, plan.get("chain") or "")
