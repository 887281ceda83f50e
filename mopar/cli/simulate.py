"""``mopar simulate``: a bundle's functions under traffic on a platform, simulated and billed."""

from __future__ import annotations

import click

from mopar.bundle.generation import NEW_TOKENS
from mopar.cli.common import Number, emit_json, stderr, stdout
from mopar.cli.options import Spec, json_output, options
from mopar.config import DEFAULT_TARGET

__all__ = ["simulate_cmd"]

MAX_ARRIVALS = 200_000
"""The most arrivals one simulation takes: about a minute on a busy 2-core machine."""

SHAPES = ("poisson", "bursty", "diurnal")


TRAFFIC: tuple[Spec, ...] = (
    Spec(
        decls=("--rate",),
        help="Mean requests per second.",
        type=Number(min=0, min_open=True),
        metavar="RPS",
        shown="this or `--trace`",
    ),
    Spec(
        decls=("--trace", "trace_file"),
        help="Arrival times instead of --rate: one number of seconds per line.",
        type=click.Path(dir_okay=False),
        metavar="FILE",
        shown="this or `--rate`",
    ),
    Spec(
        decls=("--traffic",),
        help="With --rate: Poisson arrivals; bursty on/off (--on-s, --off-s); or diurnal, a "
        "sine around the rate (--period-s, --amplitude).",
        type=click.Choice(SHAPES),
        default="poisson",
    ),
    Spec(
        decls=("--duration", "duration_s"),
        help="Simulated seconds of arrivals (default: --requests / --rate).",
        type=Number(min=0, min_open=True),
        arg="S",
        shown="`--requests` / `--rate`",
    ),
    Spec(
        decls=("--requests",),
        help="Expected requests, when --duration is not given.",
        type=click.IntRange(min=1, max=MAX_ARRIVALS),
        default=20_000,
        arg="N",
    ),
    Spec(
        decls=("--on-s",),
        help="Bursty: seconds of arrivals in each cycle.",
        type=Number(min=0, min_open=True),
        default=30.0,
        arg="S",
    ),
    Spec(
        decls=("--off-s",),
        help="Bursty: seconds without arrivals in each cycle.",
        type=Number(min=0),
        default=270.0,
        arg="S",
    ),
    Spec(
        decls=("--period-s",),
        help="Diurnal: seconds of one cycle (default: the simulated span).",
        type=Number(min=0, min_open=True),
        arg="S",
        shown="the span",
    ),
    Spec(
        decls=("--amplitude",),
        help="Diurnal: the sine's amplitude, a share of the rate.",
        type=Number(0, 1),
        default=0.8,
        arg="A",
    ),
)

PLATFORM: tuple[Spec, ...] = (
    Spec(
        decls=("--target",),
        help="The platform to simulate and bill (default: the one the bundle was planned for).",
        arg="T",
        shown="the plan's",
    ),
    Spec(decls=("--arch",), help="Lambda architecture.", default="x86_64"),
    Spec(
        decls=("--chain",),
        help="Chain mode (default: the plan's, else the target's: invoke on Lambda, http on "
        "OpenFaaS).",
        arg="C",
        shown="the plan's, else the target's",
    ),
    Spec(
        decls=("--profile", "profile_file"),
        help="Measured times and starts from `mopar load BUNDLE --rate R --json` (default: "
        "plan.json's, with --spread).",
        type=click.Path(dir_okay=False),
        metavar="RUN.json",
    ),
    Spec(
        decls=("--keep-alive-s",),
        help="Stop an instance idle this long (default: the platform's; Lambda 600).",
        type=Number(min=0),
        arg="S",
        shown="Lambda 600; OpenFaaS never",
    ),
    Spec(
        decls=("--no-keep-alive-limit",),
        help="Never stop an idle instance (OpenFaaS CE's default).",
        extra={"is_flag": True},
    ),
    Spec(
        decls=("--min-instances",),
        help="Instances each function keeps (default: Lambda 0, OpenFaaS 1).",
        type=click.IntRange(min=0),
        arg="N",
        shown="Lambda 0; OpenFaaS 1",
    ),
    Spec(
        decls=("--max-instances",),
        help="Instances each function may run at most (default: Lambda 1000, OpenFaaS 20).",
        type=click.IntRange(min=1),
        arg="N",
        shown="Lambda 1000; OpenFaaS 20",
    ),
    Spec(
        decls=("--concurrency",),
        help="Requests in flight per instance (default: Lambda 1, OpenFaaS 4).",
        type=click.IntRange(min=1),
        arg="C",
        shown="Lambda 1; OpenFaaS 4",
    ),
    Spec(
        decls=("--initial-instances",),
        help="Warm instances of each function at the start (0: cold).",
        type=click.IntRange(min=0),
        default=1,
        arg="N",
    ),
    Spec(
        decls=("--host-cores",),
        help="Instances share this many cores of one machine at the CPU the times were "
        "measured with (to compare with `mopar run` on it).",
        type=click.IntRange(min=1),
        arg="N",
    ),
    Spec(
        decls=("--parallel-share",),
        help="Share of a function's time that speeds up with more vCPUs.",
        type=Number(0, 1),
        default=0.5,
        arg="F",
    ),
    Spec(
        decls=("--spread",),
        help="Log-normal shape of a time known only by its median.",
        type=Number(min=0),
        default=0.25,
        arg="S",
    ),
    Spec(
        decls=("--new-tokens",),
        help="A --generate bundle: the tokens each request generates; the main function is busy "
        "for the whole generation, and the bill is also given per 1,000 tokens.",
        type=click.IntRange(min=1),
        default=NEW_TOKENS,
        arg="N",
    ),
    Spec(
        decls=("--prompt-tokens",),
        help="A --generate bundle: each request's prompt, in tokens (default: the prompt compile "
        "timed its generation with); its step's time scales with it.",
        type=click.IntRange(min=1),
        arg="N",
        shown="compile's timed prompt",
    ),
    Spec(
        decls=("--seed",),
        help="Seed of the arrivals, the service times and the calls of called functions.",
        type=int,
        default=0,
        arg="N",
    ),
    json_output("Print the figures as JSON."),
)


@click.command("simulate")
@click.argument("bundle", type=click.Path())
@options(TRAFFIC, PLATFORM)
def simulate_cmd(
    bundle,
    rate,
    trace_file,
    traffic,
    duration_s,
    requests,
    on_s,
    off_s,
    period_s,
    amplitude,
    target,
    arch,
    chain,
    profile_file,
    keep_alive_s,
    no_keep_alive_limit,
    min_instances,
    max_instances,
    concurrency,
    initial_instances,
    host_cores,
    parallel_share,
    spread,
    new_tokens,
    prompt_tokens,
    seed,
    as_json,
) -> None:
    """Simulate BUNDLE's functions under traffic (--rate or --trace) on a platform: instance
    pools with cold starts and keep-alive, each instance at the platform's CPU, the chain
    mode's waits, billed as the platform bills. Prints, per function and in total, $ per 1M
    requests, p50/p95/p99, the cold-start share and instances.

    BUNDLE may also be a plan file that `mopar plan --json` wrote: a plan not built, whose
    functions run at their predicted times."""
    from contextlib import nullcontext
    from dataclasses import replace
    from pathlib import Path

    from mopar.bill import chain_on
    from mopar.bundle.document import read_document
    from mopar.config import PROFILES_DIR
    from mopar.errors import OptionError
    from mopar.facts import load_platform
    from mopar.runner.report import read_run
    from mopar.sim import SimConfig, Traffic, pool_rules, read_trace, simulate_bundle

    if (rate is None) == (trace_file is None):
        raise OptionError("give one of --rate RPS and --trace FILE, e.g. --rate 10")
    if keep_alive_s is not None and no_keep_alive_limit:
        raise OptionError("--keep-alive-s and --no-keep-alive-limit contradict; drop one")
    document = (
        plan_document(Path(bundle)) if Path(bundle).is_file() else read_document(Path(bundle))
    )
    platform = load_platform(
        PROFILES_DIR, target or document.plan.get("target", DEFAULT_TARGET), arch=arch
    )
    if trace_file is not None:
        times = read_trace(Path(trace_file))
        span = max(times[-1], 1e-9)
        shape = Traffic(shape="trace", rate=len(times) / span, duration_s=span, times=times)
    else:
        span = duration_s if duration_s is not None else requests / rate
        if rate * span > MAX_ARRIVALS:
            raise OptionError(
                f"--rate {rate:g} for {span:g} s brings about {rate * span:,.0f} requests, over "
                f"the {MAX_ARRIVALS:,} one simulation takes; shorten --duration"
            )
        shape = Traffic(
            shape=traffic,
            rate=rate,
            duration_s=span,
            on_s=on_s,
            off_s=off_s,
            period_s=period_s or span,
            amplitude=amplitude,
        )
    rules = pool_rules(platform)
    keep_alive_s = rules.keep_alive_s if keep_alive_s is None else keep_alive_s
    rules = replace(
        rules,
        keep_alive_s=None if no_keep_alive_limit else keep_alive_s,
        min_instances=rules.min_instances if min_instances is None else min_instances,
        max_instances=max_instances or rules.max_instances,
        concurrency=concurrency or rules.concurrency,
    )
    config = SimConfig(
        rules=rules,
        chain=chain or chain_on(platform, document.plan.get("chain") or ""),
        seed=seed,
        initial_instances=initial_instances,
        host_cores=host_cores,
        parallel_share=parallel_share,
    )
    profile = read_run(Path(profile_file)) if profile_file else None
    with stderr.status("simulating", spinner="dots") if not as_json else nullcontext():
        result = simulate_bundle(
            document,
            platform,
            shape,
            config,
            profile=profile,
            spread=spread,
            new_tokens=new_tokens,
            prompt_tokens=prompt_tokens,
        )
    if as_json:
        emit_json(result.to_dict())
        return
    stdout.print(simulate_table(result, f"{document.plan['model']} on {platform.target}"))
    if result.cost_per_1k_tokens_usd is not None:
        stdout.print(
            f"${result.cost_per_1k_tokens_usd:.4g} per 1,000 generated tokens "
            f"({result.new_tokens} a request)",
            highlight=False,
        )
    for note in result.notes:
        stdout.print(f"- {note}", highlight=False)


def plan_document(path):
    """The plan in ``path``, a file `mopar plan --json` wrote, as a bundle document without
    files: its functions' memory, predicted times and edges are all the simulator reads.

    Raises:
        BundleError: the file is not such a plan; the message says how to make one.
    """
    import json

    from mopar.bundle.document import BundleDocument
    from mopar.errors import BundleError
    from mopar.plan import Plan

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        data = exc
    if not isinstance(data, dict) or "functions" not in data:
        why = f" ({type(data).__name__}: {data})" if isinstance(data, Exception) else ""
        raise BundleError(
            f"{str(path)!r} is neither a bundle folder nor a plan file{why}; give a bundle "
            "`mopar compile` wrote, or the output of `mopar plan MODEL --json`"
        )
    return BundleDocument(plan=Plan.from_dict(data).to_dict())


def simulate_table(result, title: str):
    """Per function and in total: $ per 1M requests, p50/p95/p99, cold starts and instances;
    within 80 columns."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", padding=(0, 1))
    for col in ("function", "MB", "$/1M req", "p50 ms", "p95 ms", "p99 ms", "cold", "inst."):
        table.add_column(col, justify="left" if col == "function" else "right", no_wrap=True)
    for f in result.functions:
        table.add_row(
            f.name,
            str(f.memory_mb),
            _usd(f.cost_per_1m_usd),
            _ms(f.p50_ms),
            _ms(f.p95_ms),
            _ms(f.p99_ms),
            _share(f.cold_share),
            str(f.instances),
        )
    table.add_section()
    table.add_row(
        "end to end",
        str(sum(f.memory_mb for f in result.functions)),
        _usd(result.cost_per_1m_usd),
        _ms(result.p50_ms),
        _ms(result.p95_ms),
        _ms(result.p99_ms),
        _share(result.cold_share),
        str(sum(f.instances for f in result.functions)),
    )
    table.caption = (
        f"{result.requests:,} requests over {result.span_s:,.0f} s, chain {result.chain}; "
        "p50-p99: each function's own time, end to end the request's; cold: the share of "
        "invocations (end to end: of requests) that met a cold start; inst.: the most at once"
    )
    table.caption_justify = "left"
    return table


def _usd(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"
