"""docs/cli.md's option tables are written from the options' specs (`tools.cli_docs`)."""

from __future__ import annotations

import click
import pytest

from mopar.cli import cli
from mopar.cli.options import Spec, SpecOption, options
from tools.cli_docs import DOCS, REGENERATE, doc_table, render_docs
from tools.cli_more import MORE


def test_docs_cli_md_tables_are_those_the_option_specs_write():
    text = DOCS.read_text()
    assert "<!-- options: run -->" in text
    assert render_docs(text) == text, (
        f"docs/cli.md is out of date: run `{REGENERATE}` (make cli-doc)"
    )


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
    )

    @click.command()
    @options([spec])
    def widgets(widgets):
        click.echo(widgets)

    assert "Widgets per request." in widgets.get_help(click.Context(widgets))
    more = {"--widgets": "A | in the docs is escaped."}
    assert doc_table(widgets, more=more).splitlines()[2] == (
        "| `--widgets N` | 3 | Widgets per request. A \\| in the docs is escaped. |"
    )


def test_docs_detail_naming_no_row_is_refused():
    """A key of tools/cli_more.py left behind by a removed or renamed option fails the docs."""
    with pytest.raises(ValueError, match="run --no-such-option"):
        render_docs(DOCS.read_text(), {**MORE, "run --no-such-option": "Stale."})


def test_each_compile_config_field_is_the_compile_option_of_its_name_and_default():
    """CompileConfig's docstring refers to the options for each field's meaning; so each field
    is one, whose value when not given is the field's default."""
    from dataclasses import MISSING, fields

    from mopar.config import CompileConfig

    unset = cli.commands["compile"].make_context("compile", ["model.pt2"]).params
    own = {"simplify_threshold", "opset", "tolerance"}  # the docstring's own (no option)
    for f in fields(CompileConfig):
        if f.name in own:
            assert f.name not in unset
            continue
        assert f.name in unset, f"CompileConfig.{f.name} is no option of mopar compile"
        default = f.default if f.default is not MISSING else f.default_factory()
        if f.name == "profiles_dir":  # None: the shipped folder (`compile_config`)
            assert unset[f.name] is None
        else:
            assert unset[f.name] == default, f.name
    assert unset["rtol"] is None and unset["atol"] is None
