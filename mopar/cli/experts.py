"""``mopar profile experts``: the expert activation matrix of a mixture-of-experts model."""

from __future__ import annotations

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import emit_json, parse_inputs, stdout, stdout_to_stderr
from mopar.cli.options import INPUTS, options

__all__ = ["experts_cmd"]


@click.command("experts")
@click.argument("model")
@options(INPUTS)
@click.option(
    "--calibration",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="Token data: an .npz of sequences by input name, cut into requests of the "
    "example inputs' shape.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the heat map (layers x experts, share of tokens) to this .png.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the trace as JSON.")
def experts_cmd(
    model, input_specs, example_npz, trust_pickle, depth, calibration, plot_path, as_json
) -> None:
    """Count the tokens each expert of each MoE layer of MODEL receives on calibration data."""
    from pathlib import Path

    from rich.table import Table

    from mopar import api
    from mopar.errors import InputSpecError
    from mopar.profile.experts import request_samples, trace_experts

    if plot_path:
        need_checkout("profile experts --plot", "tools")
    with stdout_to_stderr():
        analysis = api.analyze(
            model, parse_inputs(input_specs, example_npz), depth=depth, trust_pickle=trust_pickle
        )
    if not analysis.moe:
        raise InputSpecError(
            f"{analysis.captured.name} has no mixture-of-experts layer that "
            "mopar recognises (`mopar inspect` lists its layers); nothing to trace"
        )
    samples, notes = request_samples(Path(calibration), analysis.captured.inputs)
    trace = trace_experts(
        analysis.captured.gm,
        analysis.moe,
        samples,
        source=f"{len(samples)} requests of {Path(calibration).name}",
    )
    if plot_path:
        from tools.plot import plot_trace

        plot_trace(trace, Path(plot_path), title=f"{analysis.captured.name}: {trace.source}")
    if as_json:
        emit_json({"model": analysis.captured.name, **trace.to_dict(), "notes": list(notes)})
        return
    width = max(len(t) for t in trace.tokens)
    table = Table(
        title=f"expert activations of {analysis.captured.name} ({trace.source}): "
        "share of the layer's routed tokens, and of requests invoking it"
    )
    table.add_column("layer")
    for e in range(width):
        table.add_column(f"e{e}", justify="right")
    table.add_column("max / min", justify="right")
    for name, tokens, invoked in zip(trace.layers, trace.tokens, trace.invoked):
        total = sum(tokens) or 1.0
        cells = [f"{t / total:.0%} ({p:.0%})" for t, p in zip(tokens, invoked)]
        low = min(tokens)
        skew = f"{max(tokens) / low:.1f}" if low else "inf"
        table.add_row(name, *cells, *[""] * (width - len(cells)), skew)
    stdout.print(table)
    if any(trace.prewarm):
        ahead = Table(
            title="pre-warm prediction: each layer's experts from the layer before "
            "(its router on the previous layer's hidden states)"
        )
        for col in ("layer", "precision", "recall", "token hit rate"):
            ahead.add_column(col, justify="left" if col == "layer" else "right")
        for name, w in zip(trace.layers, trace.prewarm):
            ahead.add_row(name, *(f"{x:.1%}" for x in w) if w else ("-", "-", "-"))
        ahead.caption = (
            "per request: precision = predicted experts that tokens reached, "
            "recall = reached experts that were predicted"
        )
        stdout.print(ahead)
    for note in notes:
        stdout.print(f"note: {note}")
    if plot_path:
        stdout.print(f"wrote {plot_path}", soft_wrap=True)
