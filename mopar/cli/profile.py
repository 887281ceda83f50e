"""``mopar profile``: measure operators and layers (``collect``)."""

from __future__ import annotations

import click

from mopar.cli.checkout import need_checkout
from mopar.cli.common import Number, emit_json, need_examples, stderr, stdout

__all__ = ["profile_group"]


@click.group("profile")
def profile_group() -> None:
    """Measure operators and layers under onnxruntime, for the memory and time predictors."""


def _names(
    value: str | None, known: dict, what: str, param: str, aliases: dict | None = None
) -> tuple[str, ...] | None:
    """Comma-separated names, aliases expanded, each checked against ``known`` (None: all)."""
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    out: list[str] = []
    for name in names:
        resolved = (aliases or {}).get(name, (name,))
        for n in resolved:
            if n not in known:
                raise click.BadParameter(
                    f"unknown {what} {name!r}; choose from {', '.join(known)}", param_hint=param
                ) from None
            if n not in out:
                out.append(n)
    return tuple(out)


@profile_group.command("collect")
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    default="dataset.csv",
    show_default=True,
    help="CSV file to write; an existing one is resumed (its samples are skipped).",
)
@click.option(
    "--quick", is_flag=True, help="Two small samples per op variant, and the examples' tiny models."
)
@click.option(
    "--ops",
    default=None,
    metavar="OP,OP",
    help="Sweep only these ops (conv, gemm, batched_matmul, attention, lstm, gru, "
    "layer_norm, batch_norm, pool, embedding, softmax, elementwise; aliases: "
    "matmul, linear, bmm, gather, rnn, norm). Default: all.",
)
@click.option("--no-ops", is_flag=True, help="Measure no operator samples, only model layers.")
@click.option(
    "--models",
    default=None,
    metavar="NAME,NAME",
    help="Measure the layers of only these example models. Default: all.",
)
@click.option("--no-models", is_flag=True, help="Measure no model layers, only operators.")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Measure at most N new samples, then stop (resume later).",
)
@click.option(
    "--scale",
    type=Number(min=0.01),
    default=1.0,
    show_default=True,
    help="Operator samples per variant, as a multiple of the full sweep's count.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="onnxruntime intra-op threads for memory and time_ms_nt (0: its default, as slices run).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
def collect_cmd(out, quick, ops, no_ops, models, no_models, limit, scale, threads, as_json) -> None:
    """Measure memory and time of operators and example layers into a CSV dataset.

    Each sample runs in a separate onnxruntime process with the runtime's session options; rows
    are appended as they are measured, so an interrupted run loses nothing and resumes.
    """
    from pathlib import Path

    need_checkout("profile collect", "tools")
    from tools.profiler.collect import CollectConfig
    from tools.profiler.measure import MeasureConfig
    from tools.profiler.sweep import OP_ALIASES, SWEEP

    examples = need_examples("profile collect")  # collect reads its list, even for none

    config = CollectConfig(
        out=Path(out),
        quick=quick,
        ops=() if no_ops else _names(ops, SWEEP, "op", "--ops", OP_ALIASES),
        models=() if no_models else _names(models, examples.EXAMPLES, "example model", "--models"),
        limit=limit,
        scale=scale,
        measure=MeasureConfig(threads=threads),
    )
    summary = _run(config)
    if as_json:
        emit_json(summary.to_dict())
        return
    stdout.print(_table(summary))
    stdout.print(
        f"wrote {summary.written} rows ({summary.failed} failed), skipped "
        f"{summary.skipped} already in {summary.out}, in {summary.wall_s:.0f} s"
        + (" -- stopped at --limit" if summary.limited else "")
    )


def _run(config):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from mopar.cli.common import stdout_to_stderr
    from tools.profiler.collect import collect

    with (
        stdout_to_stderr(),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
            disable=not stderr.is_terminal,
        ) as progress,
    ):
        task = progress.add_task("starting", total=None)

        def tell(phase: str, done: int, total: int) -> None:
            progress.update(task, description=phase, completed=done, total=total)

        return collect(config, progress=tell)


def _table(summary):
    from rich.table import Table

    table = Table(title=f"mopar profile collect: {summary.out}")
    for col in ("op", "written", "failed", "skipped"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for name, counts in sorted(summary.by_op.items()):
        table.add_row(name, str(counts["written"]), str(counts["failed"]), str(counts["skipped"]))
    return table
