"""``mopar inspect``: the layer table of a model."""

from __future__ import annotations

import click

from mopar.cli.common import emit_json, parse_inputs, stdout, stdout_to_stderr
from mopar.cli.options import INPUTS, options

__all__ = ["inspect_cmd"]


@click.command("inspect")
@click.argument("model")
@options(INPUTS)
@click.option("--json", "as_json", is_flag=True, help="Print the layers as JSON.")
def inspect_cmd(model, input_specs, example_npz, trust_pickle, depth, as_json) -> None:
    """Print the layer table of MODEL: type, ops, parameter bytes, FLOPs, output bytes."""
    from dataclasses import asdict

    from mopar import api
    from mopar.cli.render import layer_table, moe_table

    with stdout_to_stderr():
        analysis = api.analyze(
            model, parse_inputs(input_specs, example_npz), depth=depth, trust_pickle=trust_pickle
        )
    lg = analysis.layers
    roles = {k: v for b in analysis.moe for k, v in b.roles([la.name for la in lg.layers]).items()}
    if as_json:
        emit_json(
            {
                "model": analysis.captured.name,
                "param_bytes": lg.param_bytes,
                "inputs": [asdict(t) for t in lg.inputs],
                "outputs": [asdict(t) for t in lg.outputs],
                "layers": [
                    {
                        **{k: v for k, v in asdict(la).items() if k != "nodes"},
                        **({"role": roles[la.name]} if la.name in roles else {}),
                    }
                    for la in lg.layers
                ],
                "edges": [
                    {"src": u, "dst": v, "bytes": d["bytes"]}
                    for u, v, d in lg.graph.edges(data=True)
                ],
                "moe": [{"layer": b.name, **b.describe()} for b in analysis.moe],
                "notes": list(analysis.captured.notes),
            }
        )
    else:
        stdout.print(layer_table(lg, analysis.captured.name, roles or None))
        if analysis.moe:
            stdout.print(moe_table(analysis.moe, analysis.captured.name))
        for note in analysis.captured.notes:
            stdout.print(f"note: {note}")
