"""``mopar bench``: compile the suite with every strategy, serve it, measure, compare.

The command is the lab's: the wheel lists its name and help (`mopar.cli.checkout.LabCommand`)
and loads it from here, in a checkout, when it is invoked.
"""

from __future__ import annotations

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import (
    Number,
    emit_json,
    progress_bar,
    stderr,
    stdout,
    stdout_to_stderr,
)
from mopar.facts import target_names

__all__ = ["bench_cmd"]


def _names(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(n.strip() for n in value.split(",") if n.strip())


@click.command(
    "bench",
    epilog="Exit codes: 0 ok; 1 a user error, a failed model, a failed "
    "request or an output beyond the tolerance (results are still "
    "written); 2 an internal error.",
)
@click.option(
    "--models",
    default=None,
    metavar="NAME,NAME",
    help="Suite models to run (default: all 12; --quick: resnet50,gcn).",
)
@click.option(
    "--strategies",
    default=None,
    metavar="NAME,NAME",
    help="Strategies and ablations (mopar+min-memory, mopar+no-codec, mopar+http, "
    "mopar+horizontal). Default: all; --quick: unsplit,mopar,uniform,mopar+http.",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=None,
    help="Measured requests per bundle, after one warm-up (default 20; --quick 5).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Requests in flight at once, per bundle.",
)
@click.option(
    "--quick",
    is_flag=True,
    help="The tiny variants of 2 models x 3 strategies, baselines at 3 slices (< 3 min).",
)
@click.option(
    "--slo-factor",
    type=Number(min=0, min_open=True),
    default=1.05,
    show_default=True,
    help="mopar's latency bound as a multiple of the unsplit plan's predicted latency "
    "(compile's --max-slowdown; the default is compile's).",
)
@click.option(
    "--baseline-slices",
    type=click.IntRange(min=1),
    default=None,
    help="Slices of uniform, params and latency (default: mopar's count; --quick: 3).",
)
@click.option(
    "--target",
    type=click.Choice(target_names()),
    default="openfaas",
    show_default=True,
    help="Platform every strategy plans for.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default="bench-results",
    show_default=True,
    help="Folder for results.json, results.md and the charts.",
)
@click.option("--json", "as_json", is_flag=True, help="Print results.json to stdout.")
@click.option(
    "--hops",
    is_flag=True,
    help="Instead: time handing a tensor of 16 KB, 1 MB, 10 MB and 100 MB from one "
    "process to another through shm, the function servers' http and a local "
    "redis-server, against a memcpy of the same bytes (~1 min).",
)
@click.option(
    "--moe",
    is_flag=True,
    help="Instead: the mixture-of-experts placement policies (unsplit with sparse "
    "experts, the baseline; unsplit with dense experts; every expert remote, hot/cold, "
    "hot/cold with replicas) on both MoE example families; --models names families "
    "(mixtral,qwen2_moe; mixtral_tiny,qwen2_moe_tiny).",
)
@click.option(
    "--tokens",
    default="16,128",
    show_default=True,
    metavar="N,N",
    help="With --moe: tokens per request.",
)
@click.option(
    "--routers",
    default="zipf,uniform",
    show_default=True,
    metavar="NAME,NAME",
    help="With --moe: the routers (zipf: the synthetic skew; uniform).",
)
@click.option(
    "--rate",
    "rates",
    default=None,
    metavar="RPS,RPS",
    help="Instead: serve each strategy's bundle with an open loop at each rate "
    "(Lambda-like autoscaler, memory enforced) and price it on Lambda and "
    "OpenFaaS; writes serving.md, serving.json and a throughput/latency chart per "
    "model.",
)
@click.option(
    "--duration",
    "duration_s",
    type=Number(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="With --rate: seconds of arrivals per rate.",
)
@click.option(
    "--instances",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="With --rate: the most instances per function.",
)
@click.option(
    "--idle-s",
    type=Number(min=0),
    default=2.0,
    show_default=True,
    help="With --rate: an instance idle this long is stopped (scale to zero).",
)
@click.option(
    "--enforce-memory/--no-enforce-memory",
    default=True,
    show_default=True,
    help="With --rate: kill an instance over its allocation, as the platform would.",
)
@click.option(
    "--cold-repeats",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="With --rate: cold first requests per bundle with the chain pre-warm and as many without.",
)
@click.option(
    "--traffic",
    "traffic_rates",
    default=None,
    metavar="RPS,RPS",
    help="Instead: plan each model (the 12 and mixtral_small) unsplit, at the default "
    "traffic and for each rate, on Lambda and OpenFaaS, and simulate every plan at every rate "
    "(mopar simulate's model; nothing compiled); writes traffic.md, traffic.json and "
    "traffic.png. Use 0.1,1,10,100,1000 for the published table.",
)
@click.option(
    "--containers",
    is_flag=True,
    help="Instead: serve each strategy's bundle by host processes and by containers "
    "(memory and CPU limits enforced by the kernel) with the same closed loop; "
    "writes containers.md and containers.json (default models: resnet50, "
    "bert_mini, gcn).",
)
@click.option(
    "--base-image",
    envvar="MOPAR_BASE_IMAGE",
    default=None,
    metavar="IMAGE",
    help="With --containers: the images' base (see `mopar build`).",
)
@click.option(
    "--hop-sizes",
    default=None,
    hidden=True,
    metavar="BYTES,BYTES",
    help="With --hops: the sizes, in bytes (for tests).",
)
@click.option(
    "--hop-budget-s",
    type=Number(min=0.01),
    default=2.0,
    hidden=True,
    help="With --hops: seconds of timing per transport and size.",
)
def bench_cmd(
    models,
    strategies,
    requests,
    concurrency,
    quick,
    slo_factor,
    baseline_slices,
    target,
    out,
    as_json,
    hops,
    moe,
    tokens,
    routers,
    rates,
    duration_s,
    instances,
    idle_s,
    enforce_memory,
    cold_repeats,
    traffic_rates,
    containers,
    base_image,
    hop_sizes,
    hop_budget_s,
) -> None:
    """Compile every model with every strategy, run them interleaved, and compare.

    Each model's bundles are served by the local runtime (one process per slice, /dev/shm) with
    their requests interleaved A B C A B C; MC, cost on OpenFaaS and Lambda, latency, memory
    utilisation and OOMs are computed from the measurements (docs/benchmarks.md).

    With --hops, it measures the cost of one handoff per transport instead (benchmarks.hops).
    """
    if hops:
        _hops(hop_sizes, hop_budget_s, as_json)
        return
    from pathlib import Path

    need_checkout("bench", "examples")  # every other mode runs the example models

    if moe:
        _moe(_names(models), _names(routers), _names(tokens), requests or 20, Path(out), as_json)
        return
    if traffic_rates:
        _traffic(_names(models), _rates(traffic_rates, "--traffic"), quick, Path(out), as_json)
        return
    if containers:
        _containers(
            _names(models) or (("resnet50", "gcn") if quick else ("resnet50", "bert_mini", "gcn")),
            _names(strategies) or ("unsplit", "mopar", "uniform"),
            requests or 20,
            concurrency,
            quick,
            target,
            baseline_slices or (3 if quick else None),
            base_image,
            Path(out),
            as_json,
        )
        return
    if rates:
        from benchmarks.serving import ServingConfig
        from mopar.runner.load import check_rate

        parsed = _rates(rates, "--rate")
        for rate in parsed:  # served by the local runner: at most what it can generate
            check_rate(rate)
        defaults = ServingConfig(models=())
        _serving(
            ServingConfig(
                models=_names(models)
                or (("resnet50", "gcn") if quick else ("resnet50", "bert_mini", "gcn")),
                variants=_names(strategies) or defaults.variants,
                rates=parsed,
                duration_s=duration_s,
                instances=instances,
                idle_s=idle_s,
                enforce_memory=enforce_memory,
                quick=quick,
                target=target,
                cold_repeats=cold_repeats,
                baseline_slices=baseline_slices or (3 if quick else None),
            ),
            Path(out),
            as_json,
        )
        return

    from benchmarks import DEFAULT_VARIANTS, QUICK, BenchConfig, write_results
    from benchmarks.suite import SUITE

    config = BenchConfig(
        models=_names(models) or (QUICK.models if quick else tuple(SUITE)),
        variants=_names(strategies) or (QUICK.variants if quick else DEFAULT_VARIANTS),
        requests=requests or (QUICK.requests if quick else 20),
        concurrency=concurrency,
        quick=quick,
        slo_factor=slo_factor,
        baseline_slices=baseline_slices or (QUICK.baseline_slices if quick else None),
        target=target,
    )
    with stdout_to_stderr():
        results = _run(config, quiet=as_json)
        doc, paths = write_results(results, Path(out))
    if as_json:
        emit_json(doc)
    else:
        _render(doc, paths)
    _check(doc, config)


def _rates(text: str, flag: str) -> tuple[float, ...]:
    try:
        parsed = tuple(float(r) for r in _names(text))
    except ValueError:
        parsed = ()
    if not parsed or not all(r > 0 and r < float("inf") for r in parsed):
        raise click.BadParameter(
            f"rates must be positive numbers of requests per second, got {text!r}",
            param_hint=flag,
        )
    return parsed


def _traffic(models, rates, quick: bool, out, as_json: bool) -> None:
    import json
    import tempfile
    from pathlib import Path

    from rich.table import Table

    from benchmarks.traffic import (
        TrafficConfig,
        cells,
        run_traffic_bench,
        traffic_markdown,
        write_traffic_chart,
    )

    config = TrafficConfig(rates=rates, quick=quick, **({"models": models} if models else {}))
    out.mkdir(parents=True, exist_ok=True)
    with stdout_to_stderr(), tempfile.TemporaryDirectory(prefix="mopar-bench-") as work:
        with stderr.status("planning", spinner="dots") as status:
            rows = run_traffic_bench(config, Path(work), progress=lambda what: status.update(what))
    doc = {"traffic": [r.to_dict() for r in rows]}
    (out / "traffic.md").write_text(traffic_markdown(rows))
    (out / "traffic.json").write_text(json.dumps(doc, indent=1))
    chart = write_traffic_chart(rows, out / "traffic.png")
    if as_json:
        emit_json(doc)
        return
    table = Table(
        title="simulated $ per 1M requests: each plan / unsplit at the rate",
        title_justify="left",
        padding=(0, 1),
    )
    for col in ("model", "target", "req/s", "unsplit $", "plan for it", "ratio", "default"):
        table.add_column(col, justify="left" if col in ("model", "target") else "right")
    for c in cells(rows):
        u = c.unsplit
        table.add_row(
            u.model,
            u.target,
            f"{u.rate_rps:g}",
            "-" if u.sim_usd_per_m is None else f"{u.sim_usd_per_m:.4g}",
            f"{c.rate.functions} fn",
            _x(c.ratio("rate")),
            _x(c.ratio("default")),
        )
    stdout.print(table)
    stdout.print(f"wrote {out / 'traffic.md'}, {out / 'traffic.json'} and {chart.name}")


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _hops(sizes: str | None, budget_s: float, as_json: bool) -> None:
    import dataclasses

    from rich.table import Table

    from benchmarks.hops import DEFAULT_SIZES, measure_hops, within_goal
    from mopar.plan.draw import human_bytes

    try:
        parsed = tuple(int(n) for n in _names(sizes)) if sizes else DEFAULT_SIZES
    except ValueError:
        raise click.BadParameter(
            f"sizes must be integers of bytes, got {sizes!r}", param_hint="--hop-sizes"
        ) from None
    with stdout_to_stderr():
        results = measure_hops(sizes=parsed, budget_s=budget_s)
    if as_json:
        emit_json({"hops": [dataclasses.asdict(r) for r in results]})
        return
    floor = {r.bytes: r.p50_us for r in results if r.transport == "memcpy"}
    table = Table(
        title="handoff cost, p50 of one handoff (us); ratio to memcpy; goal 2x memcpy + 100 us"
    )
    for col in ("size", "transport", "p50 us", "/ memcpy", "goal met", "handoffs", "note"):
        table.add_column(
            col, justify="right" if col in ("p50 us", "/ memcpy", "handoffs") else "left"
        )
    for r in results:
        if r.p50_us is None:
            table.add_row(human_bytes(r.bytes), r.transport, "-", "-", "-", "0", r.note)
            continue
        base = floor[r.bytes]
        met = "" if r.transport == "memcpy" else ("yes" if within_goal(r.p50_us, base) else "no")
        table.add_row(
            human_bytes(r.bytes),
            r.transport,
            f"{r.p50_us:,.1f}",
            f"{r.p50_us / base:.1f}x" if base else "-",
            met,
            str(r.handoffs),
            r.note,
        )
    stdout.print(table)


def _moe(families, routers, tokens, requests: int, out, as_json: bool) -> None:
    from benchmarks.moe import FAMILIES, moe_markdown, run_moe_bench
    from mopar.errors import VerificationError

    try:
        counts = tuple(int(t) for t in tokens)
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise click.BadParameter(
            f"tokens must be counts of at least 1, got {','.join(tokens)!r}",
            param_hint="--tokens",
        )
    with stdout_to_stderr():
        rows = run_moe_bench(
            families=families or FAMILIES,
            routers=routers,
            tokens=counts,
            requests=requests,
            out=out,
            progress=lambda what: stderr.print(what) if not as_json else None,
        )
    table = moe_markdown(rows)
    (out / "moe.md").write_text(table)
    if as_json:
        emit_json({"moe": [r.to_dict() for r in rows]})
    else:
        stdout.print(table)
        stdout.print(f"wrote {out / 'moe.json'} and {out / 'moe.md'}")
    bad = [r for r in rows if r.max_abs_err is None or r.max_abs_err > 1e-3]
    if bad:
        raise VerificationError(
            f"{bad[0].family} {bad[0].policy}: outputs differ from the "
            f"model (max abs error {bad[0].max_abs_err}); results are written"
        )


def _serving(config, out, as_json: bool) -> None:
    import json
    import tempfile
    from pathlib import Path

    from benchmarks.serving import (
        cold_markdown,
        run_serving_bench,
        serving_markdown,
        write_curves,
    )
    from mopar.errors import VerificationError

    out.mkdir(parents=True, exist_ok=True)
    with stdout_to_stderr(), tempfile.TemporaryDirectory(prefix="mopar-bench-") as work:
        rows, colds = run_serving_bench(
            config, Path(work), progress=lambda what: stderr.print(what) if not as_json else None
        )
    table = serving_markdown(rows) + "\n" + cold_markdown(colds)
    doc = {"serving": [r.to_dict() for r in rows], "cold": [r.to_dict() for r in colds]}
    (out / "serving.md").write_text(table)
    (out / "serving.json").write_text(json.dumps(doc, indent=1))
    charts = write_curves(rows, out)
    if as_json:
        emit_json(doc)
    else:
        stdout.print(table)
        stdout.print(
            f"wrote {out / 'serving.md'}, {out / 'serving.json'} and "
            f"{', '.join(p.name for p in charts)}"
        )
    bad = [r for r in rows if r.max_abs_err is not None and r.max_abs_err > 1e-3]
    if bad:
        raise VerificationError(
            f"{bad[0].model} {bad[0].variant}: outputs differ from the model "
            f"(max abs error {bad[0].max_abs_err}); results are written"
        )


def _containers(
    models,
    variants,
    requests: int,
    concurrency: int,
    quick: bool,
    target: str,
    baseline_slices,
    base_image,
    out,
    as_json: bool,
) -> None:
    import json
    import tempfile
    from pathlib import Path

    from benchmarks.containers import containers_markdown, run_container_bench
    from mopar.errors import VerificationError

    out.mkdir(parents=True, exist_ok=True)
    with stdout_to_stderr(), tempfile.TemporaryDirectory(prefix="mopar-bench-") as work:
        rows, starts, notes = run_container_bench(
            models,
            variants,
            requests=requests,
            concurrency=concurrency,
            quick=quick,
            target=target,
            baseline_slices=baseline_slices,
            base_image=base_image,
            workdir=Path(work),
            progress=lambda what: stderr.print(what) if not as_json else None,
        )
    for note in notes:
        click.echo(note, err=True)
    table = containers_markdown(rows, starts)
    doc = {
        "runs": [r.to_dict() for r in rows],
        "starts": [s.to_dict() for s in starts],
        "notes": list(notes),
    }
    (out / "containers.md").write_text(table)
    (out / "containers.json").write_text(json.dumps(doc, indent=1))
    if as_json:
        emit_json(doc)
    else:
        stdout.print(table)
        stdout.print(f"wrote {out / 'containers.md'} and {out / 'containers.json'}")
    bad = [r for r in rows if r.max_abs_err is not None and r.max_abs_err > 1e-3]
    if bad:
        raise VerificationError(
            f"{bad[0].model} {bad[0].variant}: outputs differ from the model "
            f"(max abs error {bad[0].max_abs_err}); results are written"
        )


def _run(config, *, quiet: bool):
    from benchmarks import run_bench

    with progress_bar(quiet=quiet, count=False) as progress:
        task = progress.add_task("bench", total=None)

        def tell(what: str, done: float, total: float) -> None:
            progress.update(task, description=what, completed=done, total=total)

        return run_bench(config, progress=tell)


def _render(doc, paths) -> None:
    from rich.table import Table

    base = {r["model"]: r for r in doc["runs"] if r["strategy"] == "unsplit"}

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    table = Table(title="mopar bench (measured; ratios to the same model's unsplit run)")
    for col in (
        "model",
        "strategy",
        "slices",
        "MC\nGB-s",
        "MC /\nunsplit",
        "MC /\nideal",
        "OpenFaaS\n$/1M",
        "Lambda\n$/1M",
        "p95\nms",
        "p95 /\nunsplit",
        "mem\nutil",
        "OOM",
        "max rel\nerr",
    ):
        table.add_column(col, justify="left" if col in ("model", "strategy") else "right")
    for r in doc["runs"]:
        b = base.get(r["model"], {})
        table.add_row(
            r["model"],
            r["strategy"],
            str(r["slices"]),
            f"{r['mc_gb_s']:.3g}",
            ratio(r["mc_gb_s"], b.get("mc_gb_s")),
            ratio(r["mc_gb_s"], r["ideal_mc_gb_s"]),
            f"{r['cost_per_1m_openfaas_usd']:.3g}",
            f"{r['cost_per_1m_lambda_usd']:.3g}",
            f"{r['p95_ms']:.1f}",
            ratio(r["p95_ms"], b.get("p95_ms")),
            f"{r['mem_util']:.2f}",
            f"[red]{r['oom']}[/red]" if r["oom"] else "0",
            "-" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}",
        )
    stdout.print(table)
    goals = Table(title="goals (mopar)")
    for col in ("goal", "measured", "met"):
        goals.add_column(col, justify="left" if col == "goal" else "right")
    for g in doc["goals"]:
        goals.add_row(
            g["goal"],
            "-" if g["value"] is None else f"{g['value']:.3g}",
            {True: "yes", False: "[red]no[/red]", None: "not measured"}[g["met"]],
        )
    stdout.print(goals)
    for s in doc["skipped"]:
        stdout.print(f"skipped {s['label']}: {s['reason']}")
    for f in doc["failures"]:
        stdout.print(f"[red]failed[/red] {f['model']}: {f['error']}")
    stdout.print(f"wrote {', '.join(str(p) for p in paths)} in {doc['wall_s']:.0f} s")


def _check(doc, config) -> None:
    from mopar.errors import RuntimeFailure, VerificationError

    if doc["failures"]:
        f = doc["failures"][0]
        raise RuntimeFailure(
            f"{len(doc['failures'])} model(s) failed, first {f['model']}: "
            f"{f['error']} (the others' results are written)"
        )
    bad = [
        r
        for r in doc["runs"]
        if r["errors"] or r["max_rel_err"] is None or r["max_rel_err"] > config.tolerance
    ]
    if bad:
        r = bad[0]
        raise VerificationError(
            f"{r['model']} {r['strategy']}: {r['errors']} failed requests, max relative error "
            f"{r['max_rel_err']} (tolerance {config.tolerance:g}); results are written, rerun "
            "that model with `mopar compile` and `mopar run --check` to investigate"
        )
