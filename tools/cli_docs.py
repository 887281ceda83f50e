"""docs/cli.md's tables of options, written from the options' specs (`mopar.cli.options`): a
tool of the checkout, which holds the docs.

Each table sits between ``<!-- options: COMMAND -->`` and ``<!-- end options -->`` (COMMAND as
typed after ``mopar``, e.g. ``max-rate`` or ``profile train``; or a group of
`mopar.cli.options` by its name, e.g. ``INPUTS``) and has one row per option the
command takes from a `Spec`, in ``--help``'s order; ``<!-- options: COMMAND (others as OTHER)
-->`` leaves out the options OTHER's table has already described. A row's meaning is the
option's ``--help`` line, then the docs' detail, `tools.cli_more.MORE`'s under ``"COMMAND
FLAG"``; a key there that names no row is refused. ``python -m tools.cli_docs`` rewrites them;
tests/test_cli_docs.py fails when the file differs from what this writes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path

import click

from mopar.cli.options import Spec, SpecOption, options
from tools import CHECKOUT
from tools.cli_more import MORE

__all__ = ["DOCS", "REGENERATE", "doc_table", "render_docs", "row", "write_docs"]

DOCS = CHECKOUT / "docs" / "cli.md"
"""The reference whose option tables `write_docs` keeps."""

REGENERATE = "python -m tools.cli_docs"
"""The command that rewrites them."""

_TABLE = re.compile(
    r"(<!-- options: (?P<command>[A-Za-z -]+?)(?: \(others as (?P<other>[A-Za-z -]+)\))? -->\n)"
    r"(?P<table>.*?)(<!-- end options -->)",
    re.S,
)


def _specs(command: click.Command, beside: click.Command | None = None) -> list[Spec]:
    """``command``'s shown specs, in order, but for those of ``beside`` (the same objects: two
    specs alike but for their docs' detail are two rows)."""
    known = {id(p.spec) for p in beside.params if isinstance(p, SpecOption)} if beside else set()
    return [
        p.spec
        for p in command.params
        if isinstance(p, SpecOption) and not p.hidden and id(p.spec) not in known
    ]


def row(spec: Spec, more: str = "") -> tuple[str, str, str]:
    """``spec``'s row: the option with its value's name, the default, the meaning (``help``,
    then ``more``)."""
    arg = spec.arg or spec.metavar
    name = (f"`{spec.flag} {arg}`" if arg else f"`{spec.flag}`").replace("|", "\\|")
    if spec.shown is not None:
        shown = spec.shown
    elif spec.extra.get("is_flag"):
        shown = "off"
    elif "/" in spec.flag:
        shown = "on" if spec.default else "off"
    elif spec.default is None:
        shown = "none"
    elif isinstance(spec.default, str):
        shown = f"`{spec.default}`"
    else:
        shown = f"{spec.default:g}" if isinstance(spec.default, float) else str(spec.default)
    meaning = spec.help + (f" {more}" if more else "")
    return name, shown, meaning.replace("|", "\\|")


def doc_table(
    command: click.Command, beside: click.Command | None = None, more: Mapping[str, str] = {}
) -> str:
    """The markdown table of ``command``'s options: one row per `SpecOption`, in order, but
    for those of ``beside``; ``more`` is the detail of a row, by the option's first flag."""
    lines = ["| option | default | meaning |", "| --- | --- | --- |"]
    rows = [row(s, more.get(s.flag, "")) for s in _specs(command, beside)]
    return "\n".join(lines + ["| {} | {} | {} |".format(*r) for r in rows]) + "\n"


def _command(path: str) -> click.Command:
    """The command typed as ``path`` after ``mopar``; or, for the name of a group of
    `mopar.cli.options` (``INPUTS``), a command that takes that group alone."""
    from mopar.cli import cli
    from mopar.cli import options as groups

    if path.isupper():
        return click.command(path.lower())(options(getattr(groups, path))(lambda **_: None))
    command: click.Command = cli
    for name in path.split():
        command = command.commands[name]  # type: ignore[attr-defined]
    return command


def render_docs(text: str, more: Mapping[str, str] = MORE) -> str:
    """``text`` (docs/cli.md) with every marked table rebuilt from the commands' specs and
    ``more`` (keyed ``"COMMAND FLAG"``).

    Raises:
        ValueError: a key of ``more`` names no row of ``text``'s tables.
    """
    used: set[str] = set()

    def table(m: re.Match) -> str:
        path, other = m.group("command"), m.group("other")
        command, beside = _command(path), other and _command(other)
        flags = {f"{path} {s.flag}": s.flag for s in _specs(command, beside)}
        used.update(flags.keys() & more.keys())
        mine = {flag: more[key] for key, flag in flags.items() if key in more}
        return m.group(1) + doc_table(command, beside, mine) + m.group(5)

    rendered = _TABLE.sub(table, text)
    if stale := sorted(more.keys() - used):
        raise ValueError(f"tools/cli_more.py: no row of docs/cli.md is {', '.join(stale)}")
    return rendered


def write_docs(path: Path = DOCS) -> bool:
    """Rewrite ``path``'s option tables; True when that changed the file."""
    before = path.read_text()
    after = render_docs(before)
    if after != before:
        path.write_text(after)
    return after != before


if __name__ == "__main__":
    changed = write_docs()
    print(f"{DOCS}: {'rewritten' if changed else 'up to date'}", file=sys.stderr)
