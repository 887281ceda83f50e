"""docs/cli.md's option tables are written from the options' specs (`mopar.cli.docs`)."""

from __future__ import annotations

import click
import pytest

from mopar.cli import cli
from mopar.cli.docs import DOCS, REGENERATE, doc_table, render_docs
from mopar.cli.options import Spec, SpecOption, options


def test_docs_cli_md_tables_are_those_the_option_specs_write():
    text = DOCS.read_text()
    assert "<!-- options: run -->" in text
    assert render_docs(text) == text, f"docs/cli.md is out of date: run `{REGENERATE}`"


@pytest.mark.parametrize("command", ["run", "load", "max-rate"])
def test_every_option_of_a_serving_command_has_a_row(command):
    table = doc_table(cli.commands[command])
    flags = [p.opts[0] for p in cli.commands[command].params if isinstance(p, SpecOption)]
    assert flags and all(f"| `{flag}" in table for flag in flags)


def test_a_spec_is_the_help_and_the_row():
    spec = Spec(
        decls=("--widgets",),
        help="Widgets per request.",
        type=click.IntRange(min=1),
        default=3,
        show_default=True,
        arg="N",
        more="A | in the docs is escaped.",
    )

    @click.command()
    @options([spec])
    def widgets(widgets):
        click.echo(widgets)

    assert "Widgets per request." in widgets.get_help(click.Context(widgets))
    assert doc_table(widgets).splitlines()[2] == (
        "| `--widgets N` | 3 | Widgets per request. A \\| in the docs is escaped. |"
    )
