"""``mopar plan``: plan without building anything; compare strategies, draw them."""

from __future__ import annotations

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import compile_config, emit_json, parse_inputs, stdout, stdout_to_stderr
from mopar.cli.options import BUDGET, INPUTS, Spec, json_output, options, planning

__all__ = ["plan_cmd"]


VIEWS: tuple[Spec, ...] = (
    Spec(
        decls=("--compare",),
        help="Plan every strategy and show them side by side.",
        extra={"is_flag": True},
    ),
    Spec(decls=("--pareto",), help="Show mopar's cost/latency frontier.", extra={"is_flag": True}),
    Spec(
        decls=("--plot", "plot_path"),
        help="Draw per-layer predicted memory with the slices as boxes (a .png).",
        type=click.Path(dir_okay=False),
        arg="FILE.png",
    ),
    Spec(
        decls=("--graph", "graph_path"),
        help="Draw the plan graph as SVG: functions with memory and time, edges with bytes "
        "and transport.",
        type=click.Path(dir_okay=False),
        arg="PATH",
    ),
    json_output("Print the plan as JSON."),
)


@click.command("plan")
@click.argument("model")
@options(INPUTS, planning())
@click.option(
    "--calibration",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Token data (.npz by input name) to measure a mixture-of-experts model's "
    "expert activations on (default: uniform routing is assumed).",
)
@options(BUDGET, VIEWS)
def plan_cmd(
    model,
    input_specs,
    example_npz,
    trust_pickle,
    calibration,
    compare,
    pareto,
    plot_path,
    graph_path,
    as_json,
    **given,  # the options CompileConfig takes as they are
) -> None:
    """Plan how to cut MODEL, without writing a bundle.

    MODEL may come without weights: a transformers config.json (or a model folder holding
    one), or a .pt2 saved from a model on the meta device; it is planned from its shapes
    and byte counts alone."""
    from dataclasses import replace
    from pathlib import Path

    from mopar import api, pipeline
    from mopar.cli.render import (
        bill_lines,
        bill_summary,
        compare_plans_table,
        edge_table,
        experts_table,
        pareto_table,
        plan_table,
    )
    from mopar.plan.notes import GenerationCost

    if plot_path:  # at once, before the model loads: the plots are the repository's
        need_checkout("plan --plot", "tools")
    rates = given.pop("rate") or ()
    given["rate"] = rates[0] if rates else None
    config = compile_config(given, calibration=Path(calibration) if calibration else None)
    facts = api.facts_for(config)
    with stdout_to_stderr():
        loaded = _load(model, trust_pickle=trust_pickle, calibration=calibration)
        inputs = parse_inputs(input_specs, example_npz)
        analysis = api.analyze_for(config, loaded, inputs, trust_pickle=trust_pickle)
    if len(rates) > 1:
        across = _across_rates(analysis, config, rates, compare=compare)
        if as_json:
            emit_json(across)
        else:
            from mopar.cli.render import rates_table

            stdout.print(rates_table(across, model=analysis.captured.name, target=config.target))
            stdout.print(across["says"])
        return
    with stdout_to_stderr():
        profiled = pipeline.profile(analysis, config, facts)
        prediction = profiled.layers
        if compare:
            plans = pipeline.plans(analysis, config, facts, profiled)
        else:
            plans = {config.strategy: pipeline.plan(analysis, config, facts, profiled).plan}
    plan = plans[config.strategy]
    whole = plans.get("unsplit") or _unsplit(analysis, config, facts, profiled)
    if pareto and not plan.frontier:
        mopar = replace(config, strategy="mopar")
        plan = pipeline.plan(analysis, mopar, facts, profiled).plan
    if plot_path:
        from tools.plot import plot_plans

        panels = {name: _boxes(p) for name, p in plans.items()}
        plot_plans(
            plot_path,
            [la.name for la in analysis.layers.layers],
            prediction.memory_mb,
            panels,
            title=f"{analysis.captured.name}: predicted memory per layer, slices as boxes "
            f"({config.target})",
        )
    if graph_path:
        from mopar.plan.draw import write_graph_svg

        write_graph_svg(plan, graph_path)
    estimate = _quantize_estimate(analysis, plan, config, facts)
    if as_json:
        doc = plan.to_dict()
        doc["bill"] = bill_summary(plan, whole, facts.platform)
        for note in plan.notes:  # a --generate plan's bill of a whole generation
            if isinstance(note, GenerationCost):
                doc["bill"]["generation"] = note.to_dict()
        if estimate is not None:
            doc["quantize_estimate"] = estimate
        if compare:
            doc["compare"] = {name: _summary(p, plans) for name, p in plans.items()}
        emit_json(doc)
        return
    stdout.print(plan_table(plan))
    if (experts := experts_table(plan)) is not None:
        stdout.print(experts)
    stdout.print(edge_table(plan))
    for note in plan.notes:
        stdout.print(f"note: {note}")
    for line in bill_lines(plan, whole, facts.platform):
        stdout.print(line)
    if estimate is not None:
        from mopar.cli.render import quantize_estimate_table

        stdout.print(quantize_estimate_table(estimate))
        stdout.print(f"quantize: {estimate['says']}")
    if compare:
        stdout.print(compare_plans_table(plans))
    if pareto:
        stdout.print(pareto_table(plan))
    if plot_path:
        stdout.print(f"wrote {plot_path}", soft_wrap=True)
    if graph_path:
        stdout.print(f"wrote {graph_path}", soft_wrap=True)


def _load(model: str, *, trust_pickle: bool, calibration: str | None):
    """``model`` loaded as plan takes it: with its weights, or without (a transformers config,
    weights on the meta device), whose plan comes from shapes alone.

    Raises:
        InputSpecError: a model without weights and ``--calibration``: tracing its experts
            would run it.
    """
    from mopar.errors import InputSpecError, Option
    from mopar.frontend import load_model

    loaded = load_model(model, trust_pickle=trust_pickle, weightless=True)
    if loaded.weightless and calibration:
        raise InputSpecError(
            f"model {loaded.name!r} has no weights, so its experts cannot be traced on ",
            Option("calibration", value=calibration, quoted=True),
            "; leave it out to plan with uniform routing, or give the model with its weights",
        )
    return loaded


def _quantize_estimate(analysis, plan, config, facts) -> dict | None:
    """What quantised weights would save, on ``plan`` and on each other deploy target's plan
    of the model, estimated from their weight bytes (`mopar.planner.cost.lighter_weights`),
    where a budget or ``--quantize`` was given; the budget itself is measured only by compile,
    for the target's int8 kernels."""
    from mopar.compress.kernels import describe
    from mopar.planner.cost import lighter_weights
    from mopar.target import deploy_targets

    budget = (config.max_output_error, config.max_top1_change, config.min_cosine)
    if config.quantize == "none" and all(b is None for b in budget):
        return None
    form = config.quantize if config.quantize in ("int8", "int4") else "int8"
    rows = []
    for target in (config.target, *(t.name for t in deploy_targets() if t.name != config.target)):
        there, at = (
            (plan, facts) if target == config.target else _planned_on(analysis, config, target)
        )
        light = lighter_weights(there, at.platform, form)
        rows.append(
            {
                "target": target,
                "functions": len(there.functions),
                "weights_mb": round(sum(f.param_bytes for f in there.functions) / 1e6, 3),
                "quantized_weights_mb": round(sum(f.param_bytes for f in light.functions) / 1e6, 3),
                "cost_per_1m_usd": there.cost_per_1m_usd,
                "quantized_cost_per_1m_usd": light.cost_per_1m_usd,
                "mc_gb_s": there.mc_gb_s,
                "quantized_mc_gb_s": light.mc_gb_s,
                "int8_kernels": at.platform.int8_kernels,
                "compile": f"mopar compile MODEL --target {target} --quantize auto "
                + _budget_flags(config),
            }
        )
    mine = rows[0]
    ratio = mine["cost_per_1m_usd"] / max(mine["quantized_cost_per_1m_usd"], 1e-30)
    says = (
        f"{form} weights would bill {ratio:.2f}x lower on {config.target}, estimated from the "
        "weights' bytes at the predicted times (int8 also changes the time, by what compile "
        "measures); compile measures the budget on the target's int8 kernels "
        f"({describe(facts.platform.int8_kernels)}): `{mine['compile']}`"
    )
    return {
        "form": form,
        "targets": rows,
        "says": says,
        **{k: mine[k] for k in mine if k != "target"},
    }


def _budget_flags(config) -> str:
    """The budget options ``config`` was given, as the command line writes them."""
    given = (
        ("--max-top1-change", config.max_top1_change),
        ("--min-cosine", config.min_cosine),
        ("--max-output-error", config.max_output_error),
    )
    return " ".join(f"{flag} {value:g}" for flag, value in given if value is not None)


def _planned_on(analysis, config, target: str):
    """The plan of ``analysis`` on ``target``, and that target's facts."""
    from dataclasses import replace

    from mopar import api, pipeline

    there = replace(config, target=target)
    facts = api.facts_for(there)
    with stdout_to_stderr():
        profiled = pipeline.profile(analysis, there, facts)
        return pipeline.plan(analysis, there, facts, profiled).plan, facts


def _summary(plan, plans) -> dict:
    from mopar.cli.render import fits, within_bound

    return {
        "slices": len(plan.vertical()),
        "functions": len(plan.functions),
        "chain": plan.chain,
        "cost_per_1m_usd": plan.cost_per_1m_usd,
        "latency_ms": plan.latency_ms,
        "mc_gb_s": plan.mc_gb_s,
        "fits": fits(plan),
        "within_bound": within_bound(plan, plans),
    }


def _boxes(plan) -> list[tuple[int, int, float]]:
    """Each slice of the vertical cut as (first layer, end, memory of all its functions)."""
    memory: dict[str, float] = {}
    for f in plan.functions:
        memory[f.group or f.name] = memory.get(f.group or f.name, 0.0) + f.memory_mb
    boxes, lo = [], 0
    for f in plan.vertical():
        boxes.append((lo, lo + len(f.layers), memory[f.group or f.name]))
        lo += len(f.layers)
    return boxes


def _across_rates(analysis, config, rates, *, compare: bool) -> dict:
    """The plan at each of ``rates`` (each strategy's with ``compare``) against the unsplit
    plan at that rate, as dollars per 1M requests and a month, and the lowest rate where a
    split plan is cheaper than unsplit."""
    from dataclasses import replace

    from mopar import api, pipeline
    from mopar.bill import per_month

    rows = []
    for rate in sorted(rates):
        at = replace(config, rate=rate)
        facts = api.facts_for(at)
        with stdout_to_stderr():
            profiled = pipeline.profile(analysis, at, facts)
            if compare:
                plans = pipeline.plans(analysis, at, facts, profiled)
            else:
                plans = {at.strategy: pipeline.plan(analysis, at, facts, profiled).plan}
        whole = plans.get("unsplit") or _unsplit(analysis, at, facts, profiled)
        for name, p in plans.items():
            usd = p.cost_per_1m_usd / 1e6
            base = whole.cost_per_1m_usd / 1e6 if whole is not None else None
            rows.append(
                {
                    "rate_rps": rate,
                    "strategy": name,
                    "functions": len(p.functions),
                    "chain": p.chain,
                    "cost_per_1m_usd": p.cost_per_1m_usd,
                    "usd_per_month": per_month(usd, rate),
                    "latency_ms": p.latency_ms,
                    "unsplit_usd_per_month": per_month(base, rate) if base is not None else None,
                    "vs_unsplit": usd / base if base else None,
                }
            )
    pays = [
        r for r in rows if r["functions"] > 1 and (r["vs_unsplit"] is None or r["vs_unsplit"] < 1)
    ]
    given = ", ".join(f"{r:g}" for r in sorted(rates))
    if not pays:
        says = f"unsplit is cheapest at every rate given ({given} requests/s)"
    elif pays[0]["vs_unsplit"] is None:
        says = "the model fits no single function: split at every rate"
    else:
        first = pays[0]
        says = (
            f"splitting starts to pay at {first['rate_rps']:g} requests/s ({first['strategy']}: "
            f"{first['functions']} functions at {first['vs_unsplit']:.2f}x unsplit's bill) "
            f"of the rates given ({given})"
        )
    return {
        "model": analysis.captured.name,
        "target": config.target,
        "rates": rows,
        "splitting_pays_from_rps": pays[0]["rate_rps"] if pays else None,
        "says": says,
    }


def _unsplit(analysis, config, facts, profiled):
    """The model in one function, planned by the same rules (sizing, traffic, chain modes);
    None where it fits no function."""
    from dataclasses import replace

    from mopar import pipeline
    from mopar.errors import PartitionInfeasibleError

    whole = replace(config, strategy="unsplit", slices=None, parallel=1)
    try:
        with stdout_to_stderr():
            return pipeline.plan(analysis, whole, facts, profiled).plan
    except PartitionInfeasibleError:  # the model fits no single function: no baseline
        return None
