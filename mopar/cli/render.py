"""Rich tables for plans, layers and run reports."""

from __future__ import annotations

from collections.abc import Container, Iterable

from rich import box
from rich.table import Table

from mopar.plan.draw import format_usd, human_bytes

__all__ = [
    "describe",
    "moe_table",
    "experts_table",
    "plan_table",
    "edge_table",
    "codec_table",
    "bill_lines",
    "rates_table",
    "bill_summary",
    "compare_plans_table",
    "fits",
    "within_bound",
    "pareto_table",
    "layer_table",
    "run_table",
    "compare_table",
]


def _table(title: str, columns: Iterable[str], left: Container[str]) -> Table:
    """A table titled ``title`` with ``columns``: those in ``left`` justified left, the rest
    right."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def _flops(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def describe(plan, f) -> str:
    """What function ``f`` of ``plan`` runs: its layers' span, or its kind's label."""
    k = (
        [c.name for c in plan.callees(plan.caller(f.name).name)].index(f.name)
        if f.spec.called
        else 0
    )
    label = f.label(k)
    if not f.layers:
        return label
    span = f.layers[0] if len(f.layers) == 1 else f"{f.layers[0]} .. {f.layers[-1]}"
    return span if label == f.name else f"{span} ({label.removeprefix(f.name).strip(' ()')})"


def moe_table(blocks, model: str) -> Table:
    """The mixture-of-experts blocks of a model: each layer's router, experts and top-k."""
    cols = ("experts layer", "router", "experts", "top-k", "routing", "params / expert", "form")
    table = _table(
        f"mixture-of-experts layers of {model}",
        (*cols, "shared expert"),
        ("experts layer", "router", "routing", "form", "shared expert"),
    )
    for b in blocks:
        table.add_row(
            b.name,
            b.router,
            str(b.num_experts),
            str(b.top_k),
            b.routing,
            f"{b.params_per_expert:,}",
            b.form,
            b.shared or "-",
        )
    return table


def experts_table(plan) -> Table | None:
    """The expert functions of a plan: what each holds, how often a request invokes it, and
    what it is expected to cost per million requests (only the requests that invoke it); and
    the hot experts each dispatch function holds and runs itself."""
    held = [f for f in plan.functions if f.experts]
    if not held:
        return None
    dispatches = {d.name for d in plan.dispatches()}
    left = ("function", "dispatch", "experts")
    table = _table(
        "expert functions (called by their dispatch only when tokens reach them)",
        (*left, "params", "memory", "time", "invoked", "expected cost / 1M requests"),
        left,
    )
    for f in held:
        p = plan.invocation_probability(f.name)
        table.add_row(
            f.name,
            "itself (hot)" if f.name in dispatches else f.group,
            f.expert_span,
            human_bytes(f.param_bytes),
            f"{f.memory_mb} MB",
            _ms(f.time_ms),
            f"{p:.0%}",
            f"${p * f.cost_per_1m_usd:.3g}",
        )
    called = [f for f in held if f.name not in dispatches]
    invoked = sum(plan.invocation_probability(f.name) for f in called)
    table.caption = (
        f"{invoked:.1f} expert function invocations expected per request, of {len(called)}"
    )
    return table


# The plan table fits an 80-column terminal: units sit in the two-line headers, numbers never
# wrap or shorten, and only the layer span gives way (folded onto more lines).
_PLAN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("function", "left"),
    ("layers", "left"),
    ("params", "right"),
    ("need\nMB", "right"),
    ("memory\nMB", "right"),
    ("vCPU", "right"),
    ("time\nms", "right"),
    ("hands\non by", "left"),
    ("cost\n$/1M", "right"),
)


def _handoff(plan, name: str) -> str:
    """The transport ``name`` hands its outputs on by; "-" where it answers the request."""
    how = plan.handoff(name)
    return "-" if how == "response" else how


def plan_table(plan) -> Table:
    """Per function: the layers it runs, its parameters, predicted and chosen memory, vCPU,
    predicted time, the transport it hands on by and its cost per 1M invocations."""
    bound = f", bound {plan.bound_ms:.1f} ms" if plan.bound_ms is not None else ""
    n = len(plan.functions)
    table = Table(
        title=f"plan for {plan.model} ({plan.strategy} on {plan.target}, {n} "
        f"function{'s' if n != 1 else ''}, {plan.num_layers} layers{bound})",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for header, justify in _PLAN_COLUMNS:
        flexible = header == "layers"
        table.add_column(
            header,
            justify=justify,
            no_wrap=not flexible,
            overflow="ellipsis",  # wraps between words; a name longer than the column is cut
            min_width=8 if flexible else None,
        )
    for f in plan.functions:
        span = describe(plan, f)
        table.add_row(
            f.name,
            f"{len(f.layers)}: {span}" if f.layers else span,
            human_bytes(f.param_bytes),
            f"{f.need_mb:.0f}",
            f"{f.memory_mb}",
            f"{f.vcpus:g}",
            f"{f.time_ms:.2f}",
            _handoff(plan, f.name),
            format_usd(f.cost_per_1m_usd),
        )
    table.add_section()
    table.add_row(
        "total",
        str(plan.num_layers),
        human_bytes(sum(f.param_bytes for f in plan.functions)),
        "",
        f"{sum(f.memory_mb for f in plan.functions)}",
        "",
        f"{plan.latency_ms:.2f}",
        "",
        format_usd(plan.cost_per_1m_usd),
    )
    table.caption = (
        f"need: predicted memory; time: predicted billed time per invocation (total: the "
        f"predicted latency, {plan.latency_ms:.1f} ms, the path's functions, handoffs and "
        f"hops); MC {plan.mc_gb_s:.4f} GB-s per request; {plan.memory_source}"
    )
    return table


def edge_table(plan) -> Table:
    """The tensors each function hands another."""
    cols = ("from", "to", "tensors", "bytes", "transport", "taken")
    table = _table("edges: tensors between functions", cols, ("from", "to", "tensors", "transport"))
    for e in plan.edges:
        names = ", ".join(e.tensors[:3]) + (f" +{len(e.tensors) - 3}" if len(e.tensors) > 3 else "")
        taken = (
            "always"
            if e.probability_source == "always"
            else f"{e.probability:.0%} ({e.probability_source})"
        )
        table.add_row(e.src, e.dst, names, human_bytes(e.bytes), e.transport, taken)
    return table


def codec_table(plan) -> Table:
    """The codec of every cut tensor, as measured on held-out calibration samples."""
    left = ("slice", "tensor", "codec")
    table = _table(
        "codecs at the cuts (held-out calibration samples)",
        (*left, "raw", "sent", "ratio", "output error", "top-1 change", "encode + decode"),
        left,
    )
    for s in plan.functions:
        for c in s.codecs:
            top1 = "-" if c["top1_change"] is None else f"{100 * c['top1_change']:.1f}%"
            table.add_row(
                s.name,
                c["tensor"],
                c["codec"],
                human_bytes(c["raw_bytes"]),
                human_bytes(c["bytes"]),
                f"{c['ratio']:.1f}x",
                f"{c['error']:.2e}",
                top1,
                _ms(c["encode_ms"] + c["decode_ms"]),
            )
    return table


def quantize_table(plan) -> Table:
    """The form of every function's weights, with what it measured alone on held-out
    calibration samples (``mopar compile --quantize``)."""
    table = _table(
        "weights (each form alone, held-out calibration samples)",
        ("function", "form", "float", "now", "ratio", "error", "top-1", "cosine", "time"),
        ("function", "form"),
    )
    for f in plan.functions:
        q = f.quantized or {}
        rows = [(f.name, q)] if "form" in q else []
        rows += [(f"{f.name} hot", q["hot"])] if "hot" in q else []
        for name, r in rows:
            table.add_row(
                name,
                r["form"],
                human_bytes(r["float_bytes"]),
                human_bytes(r["bytes"]),
                f"{r['ratio']:.1f}x",
                f"{r['error']:.1e}",
                "-" if r["top1_change"] is None else f"{100 * r['top1_change']:.1f}%",
                "-" if r["cosine"] is None else f"{r['cosine']:.4f}",
                f"{r['ms'] / r['float_ms']:.2f}x" if r["float_ms"] else "-",
            )
    return table


def fits(plan) -> bool:
    """Whether every function of ``plan`` has the memory mopar's sizing rule says it needs."""
    return all(f.memory_mb >= f.need_mb - 0.5 for f in plan.functions)


def within_bound(plan, plans) -> bool:
    """Whether ``plan`` meets the latency bound mopar's plan among ``plans`` was held to."""
    mopar = plans.get("mopar")
    bound = mopar.bound_ms if mopar is not None else plan.bound_ms
    return bound is None or plan.latency_ms <= bound * (1 + 1e-9) + 5e-4  # rounded to the µs


def compare_plans_table(plans) -> Table:
    """Strategies side by side (predicted), each sized by mopar's rule and priced by the same
    bill in its cheapest chain mode, with the cost ratio to unsplit where it is among them; a
    row that would not run, or misses mopar's latency bound, says so."""
    base = plans.get("unsplit")
    table = _table(
        "strategies (predicted: same sizing rule, same bill, same traffic)",
        ("strategy", "funcs", "chain", "$/1M (x unsplit)", "latency", "runs"),
        ("strategy", "chain", "runs"),
    )
    for name, p in plans.items():
        ratio = (
            f" ({p.cost_per_1m_usd / base.cost_per_1m_usd:.2f}x)"
            if base and base.cost_per_1m_usd
            else ""
        )
        runs = "yes" if fits(p) else "small"
        if runs == "yes" and not within_bound(p, plans):
            runs = "slow"
        table.add_row(
            name,
            str(len(p.functions)),
            p.chain or "-",
            format_usd(p.cost_per_1m_usd) + ratio,
            _ms(p.latency_ms),
            runs,
        )
    table.caption = (
        "runs: small = a slice has less memory than mopar's rule says it needs (the paper's "
        "sizing kept); slow = over mopar's latency bound"
    )
    return table


def bill_summary(plan, whole, platform) -> dict:
    """``plan``'s bill against the unsplit plan's (``whole``), for ``--json``: per 1M requests,
    with what it includes."""
    from mopar.bill import BILL_PARTS, per_month
    from mopar.planner.cost import price_plan

    bill = price_plan(plan, platform).bill
    base = None if whole is None else price_plan(whole, platform).bill
    per_1m = {key: getattr(bill, key) * 1e6 for key, _ in BILL_PARTS}
    rate = platform.traffic.rate_rps
    return {
        "chain": bill.chain,
        "traffic": bill.traffic,
        "rate_rps": rate,
        "cost_per_1m_usd": bill.usd * 1e6,
        "usd_per_month": per_month(bill.usd, rate),
        "latency_ms": bill.latency_ms,
        "includes_per_1m_usd": per_1m,
        "unsplit": None
        if base is None
        else {
            "chain": base.chain,
            "cost_per_1m_usd": base.usd * 1e6,
            "usd_per_month": per_month(base.usd, rate),
            "latency_ms": base.latency_ms,
        },
        "vs_unsplit": bill.usd / base.usd if base is not None and base.usd else None,
    }


def bill_lines(plan, whole, platform) -> list[str]:
    """``plan``'s bill against the unsplit plan's, in words: what it includes, and the traffic."""
    s = bill_summary(plan, whole, platform)
    u = s["unsplit"]
    ratio = f"{s['vs_unsplit']:.2f}x" if s["vs_unsplit"] is not None else "-"
    parts = [
        f"{k.removesuffix('_usd')} {format_usd(v)}"
        for k, v in s["includes_per_1m_usd"].items()
        if v
    ]
    against = (
        "the model fits no single function: no unsplit plan to compare with"
        if u is None
        else f"{ratio} the unsplit plan's {format_usd(u['cost_per_1m_usd'])} (one function, chain "
        f"mode {u['chain'] or '-'}, {_ms(u['latency_ms'])})"
    )
    month = (
        f"{format_usd(s['usd_per_month'])} a month at {s['rate_rps']:g} request"
        f"{'' if s['rate_rps'] == 1 else 's'}/s"
    )
    if u is not None:
        month += f", against {format_usd(u['usd_per_month'])} unsplit"
    return [
        f"bill: {format_usd(s['cost_per_1m_usd'])} per 1M requests in chain mode "
        f"{s['chain'] or '-'}, {against}",
        f"bill a month (30 days): {month}",
        f"bill includes (per 1M requests): {', '.join(parts) or 'nothing'}",
        f"bill traffic: {s['traffic']}",
    ]


def rates_table(across: dict, *, model: str, target: str) -> Table:
    """``mopar plan --rate A,B,...``: at each rate, the plan and its bill against unsplit's,
    per 1M requests and a month (30 days)."""
    strategies = len({r["strategy"] for r in across["rates"]}) > 1
    cols = ("req/s", *(("strategy",) if strategies else ()), "funcs", "$/1M", "$/month")
    table = _table(
        f"{model} on {target} across rates", (*cols, "x unsplit", "latency"), ("strategy",)
    )
    for r in across["rates"]:
        ratio = f"{r['vs_unsplit']:.2f}x" if r["vs_unsplit"] is not None else "-"
        table.add_row(
            f"{r['rate_rps']:g}",
            *((r["strategy"],) if strategies else ()),
            str(r["functions"]),
            format_usd(r["cost_per_1m_usd"]),
            format_usd(r["usd_per_month"]),
            ratio,
            _ms(r["latency_ms"]),
        )
    return table


def quantize_estimate_table(estimate: dict) -> Table:
    """``mopar plan`` with a budget: each deploy target's bill with float and with quantised
    weights, estimated from the weights' bytes, and the int8 kernels compile judges them on."""
    form = estimate["form"]
    table = _table(
        f"{form} weights on each target (estimated from their bytes)",
        ("target", "funcs", "weights MB", "$/1M float", f"$/1M {form}", "x lower", "kernels"),
        (),
    )
    for r in estimate["targets"]:
        lower = r["cost_per_1m_usd"] / max(r["quantized_cost_per_1m_usd"], 1e-30)
        table.add_row(
            r["target"],
            str(r["functions"]),
            f"{r['weights_mb']:.3g}->{r['quantized_weights_mb']:.3g}",
            format_usd(r["cost_per_1m_usd"]),
            format_usd(r["quantized_cost_per_1m_usd"]),
            f"{lower:.2f}x",
            r["int8_kernels"],
        )
    return table


def pareto_table(plan) -> Table:
    table = _table(
        f"cost/latency frontier of {plan.model} on {plan.target} (mopar's DP)",
        ("slices", "cost / 1M", "latency", "within bound"),
        (),
    )
    for point in plan.frontier:
        ok = plan.bound_ms is None or point["latency_ms"] <= plan.bound_ms * (1 + 1e-9) + 5e-4
        table.add_row(
            str(point["slices"]),
            format_usd(point["cost_per_1m_usd"]),
            _ms(point["latency_ms"]),
            "yes" if ok else "no",
        )
    return table


def layer_table(lg, name: str, roles: dict[str, str] | None = None) -> Table:
    """The layers; ``roles`` (a mixture-of-experts model's) adds a column naming each part."""
    cols = ("#", "layer", "type", *(("role",) if roles else ()), "ops", "params", "FLOPs", "out")
    title = f"{name}: {len(lg)} layers, {human_bytes(lg.param_bytes)} of parameters"
    table = _table(title, cols, ("layer", "type", "role", "ops"))
    for layer in lg.layers:
        ops = ", ".join(layer.ops[:4]) + (" ..." if len(layer.ops) > 4 else "")
        role = (roles.get(layer.name, ""),) if roles else ()
        table.add_row(
            str(layer.index),
            layer.name,
            layer.module_type,
            *role,
            ops,
            human_bytes(layer.param_bytes),
            _flops(layer.flops),
            human_bytes(layer.output_bytes),
        )
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def run_table(report, title: str) -> Table:
    """Per slice: memory, time and load; with several instances, cold starts or OOM kills, those
    too."""
    serving = any(s.instances > 1 or s.cold_starts or s.oom_kills for s in report.slices)
    cols = ["slice", "peak RSS", "allocated", "p50", "p95", "load"]
    if serving:
        cols += ["instances", "cold starts", "cold start p50", "OOM kills"]
    table = _table(title, cols, ("slice",))
    for s in report.slices:
        over = " [red](over)[/red]" if s.peak_rss_mb > s.allocated_mb else ""
        extra = (
            [str(s.instances), str(s.cold_starts), _ms(s.cold_start_ms), str(s.oom_kills)]
            if serving
            else []
        )
        table.add_row(
            s.name,
            f"{s.peak_rss_mb:.1f} MB{over}",
            f"{s.allocated_mb} MB",
            _ms(s.p50_ms),
            _ms(s.p95_ms),
            f"{s.load_ms:.0f} ms",
            *extra,
        )
    table.add_section()
    table.add_row(
        "end to end",
        f"{sum(s.peak_rss_mb for s in report.slices):.1f} MB",
        f"{sum(s.allocated_mb for s in report.slices)} MB",
        _ms(report.latency_p50_ms),
        _ms(report.latency_p95_ms),
        "",
        *(
            [
                str(sum(s.instances for s in report.slices)),
                str(sum(s.cold_starts for s in report.slices)),
                "",
                str(report.oom_kills),
            ]
            if serving
            else []
        ),
    )
    return table


def load_lines(report) -> list[str]:
    """An open loop's figures and a cold run's first request, in words."""
    lines = []
    if report.load is not None:
        ld = report.load
        lines.append(
            f"open loop: {ld['rate_rps']:g} req/s offered for {ld['duration_s']:g} s: "
            f"{ld['offered']} arrived, {ld['completed']} served ({ld['throughput_rps']:g} req/s), "
            f"{report.errors} failed; latency p50 {_ms(report.latency_p50_ms)}, p95 "
            f"{_ms(report.latency_p95_ms)}, p99 {_ms(report.latency_p99_ms)}"
        )
    if report.cold is not None and report.cold.get("first_request_ms") is not None:
        lines.append(f"first request (cold): {_ms(report.cold['first_request_ms'])}")
    return lines


def rate_table(steps, slo_ms: float, best: float | None) -> Table:
    """The rates `mopar max-rate` tried."""
    title = f"highest rate with p95 <= {slo_ms:g} ms and no error: " + (
        f"{best:g} req/s" if best is not None else "none"
    )
    table = _table(title, ("rate (req/s)", "p95", "errors", "met"), ())
    for step in steps:
        table.add_row(
            f"{step.rate:g}", _ms(step.p95_ms), str(step.errors), "yes" if step.met else "no"
        )
    return table


def label_of(functions: int) -> str:
    """A bundle as a comparison's column names it: ``unsplit`` or ``N slices``."""
    return "unsplit" if functions == 1 else f"{functions} slices"


def compare_table(report, baseline) -> Table:
    """This bundle against a baseline bundle (e.g. unsplit), as ratios (bundle / baseline)."""

    rows = [
        ("latency p50 (ms)", baseline.latency_p50_ms, report.latency_p50_ms),
        ("latency p95 (ms)", baseline.latency_p95_ms, report.latency_p95_ms),
        (
            "largest function peak RSS (MB)",
            max(s.peak_rss_mb for s in baseline.slices),
            max(s.peak_rss_mb for s in report.slices),
        ),
        (
            "sum of peak RSS (MB)",
            sum(s.peak_rss_mb for s in baseline.slices),
            sum(s.peak_rss_mb for s in report.slices),
        ),
        ("MC, the paper's metric: GB x s per request", baseline.mc_gb_s(), report.mc_gb_s()),
        ("functions invoked per request", baseline.invocations(), report.invocations()),
    ]
    a, b = label_of(len(baseline.slices)), label_of(len(report.slices))
    table = _table(
        f"{b} vs {a} (measured, requests interleaved)", ("metric", a, b, "ratio"), ("metric",)
    )
    for name, base, ours in rows:
        base, ours = base or 0.0, ours or 0.0
        fmt = "{:.4f}" if base < 1 else "{:.1f}"
        table.add_row(
            name, fmt.format(base), fmt.format(ours), f"{ours / base:.2f}x" if base else "-"
        )
    return table


def bill_table(bill, baseline, *, labels: tuple[str, str], target: str) -> Table:
    """Two plans' bills (`mopar.bill.PlanBill`: ``bill`` against ``baseline``), per 1M requests,
    part by part, as the platform charges them at the stated traffic."""
    from mopar.bill import BILL_PARTS

    a, b = labels
    table = Table(title=f"the bill on {target}, $ per 1M requests, {bill.traffic}")
    for col in ("", a, b, "ratio"):
        table.add_column(col, justify="left" if not col else "right")
    for key, what in BILL_PARTS:
        base, ours = getattr(baseline, key) * 1e6, getattr(bill, key) * 1e6
        if base or ours:
            table.add_row(
                what, f"{base:.4g}", f"{ours:.4g}", f"{ours / base:.2f}x" if base else "-"
            )
    base, ours = baseline.usd * 1e6, bill.usd * 1e6
    table.add_row(
        f"all (chain {bill.chain} / {baseline.chain})",
        f"{base:.4g}",
        f"{ours:.4g}",
        f"{ours / base:.2f}x" if base else "-",
        style="bold",
    )
    return table


def images_table(images, title: str) -> Table:
    """`mopar build`'s images: size above the base, split into weights and runtime."""
    left = ("function", "kind", "image")
    table = _table(title, (*left, "above base", "weights", "runtime", "built"), left)
    for i in images:
        table.add_row(
            i.function,
            i.kind,
            i.tag,
            f"{i.above_base_mb:.1f} MB",
            f"{i.weights_mb:.1f} MB",
            f"{i.runtime_mb:.1f} MB",
            "cached" if i.cached else f"{i.seconds:.0f} s",
        )
    return table
