"""What the commands share besides their options (`mopar.cli.options`): turning option values
into configs, and rendering."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from mopar.cli.options import Number

__all__ = [
    "Number",
    "compile_config",
    "emit_json",
    "parse_inputs",
    "progress_bar",
    "stderr",
    "stdout",
    "stdout_to_stderr",
]

# A terminal's width; COLUMNS where set; 80 when piped (CI logs, `| less`): rich's own rule.
stdout = Console()
stderr = Console(stderr=True)


def compile_config(planning: dict[str, Any], **more: Any):
    """A `CompileConfig` from the values of `mopar.cli.options.planning` (and ``more``
    fields)."""
    from mopar.arguments import check_choices
    from mopar.config import CompileConfig

    folder = planning.pop("profiles_dir", None)
    if planning.get("trace"):
        planning["trace"] = Path(planning["trace"])
    config = CompileConfig(**planning, **more, **({"profiles_dir": Path(folder)} if folder else {}))
    check_choices(config)  # before the model loads: a bad value costs no wait
    return config


def parse_inputs(input_specs: tuple[str, ...], example_npz: str | None) -> Any:
    """Convert the input options to what `mopar.api` takes; both at once is a user error."""
    from mopar.errors import InputSpecError
    from mopar.frontend.inputs import parse_input_spec

    if input_specs and example_npz:
        raise InputSpecError("give either --input or --example-inputs, not both")
    if example_npz:
        return example_npz
    return [parse_input_spec(s) for s in input_specs] or None


def progress_bar(*, quiet: bool = False, count: bool = True, spinner: bool = False):
    """A transient progress bar on stderr, shown on a terminal unless ``quiet``: a spinner (with
    ``spinner``), what is being done, the bar, done of total (with ``count``), the time taken."""
    from rich import progress as rp

    columns = [rp.SpinnerColumn()] if spinner else []
    columns += [rp.TextColumn("{task.description}"), rp.BarColumn()]
    columns += [rp.MofNCompleteColumn()] if count else []
    return rp.Progress(
        *columns,
        rp.TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=quiet or not stderr.is_terminal,
    )


def stdout_to_stderr():
    """Keep stdout for our own output: model code that prints (a factory saying "loaded
    weights") would otherwise corrupt ``--json``."""
    return contextlib.redirect_stdout(sys.stderr)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str, allow_nan=False))
