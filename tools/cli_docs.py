"""docs/cli.md's tables of options, written from the options' specs (`mopar.cli.options`): a
tool of the checkout, which holds the docs.

Each table sits between ``<!-- options: COMMAND -->`` and ``<!-- end options -->`` (COMMAND as
typed after ``mopar``, e.g. ``max-rate`` or ``profile train``; or a group of
`mopar.cli.options` by its name, e.g. ``INPUTS``) and has one row per option the
command takes from a `Spec`, in ``--help``'s order; ``<!-- options: COMMAND (others as OTHER)
-->`` leaves out the options OTHER's table has already described. ``python -m tools.cli_docs``
rewrites them; tests/test_cli_docs.py fails when the file differs from what this writes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from mopar.cli.options import SpecOption, options
from tools import CHECKOUT

__all__ = ["DOCS", "REGENERATE", "doc_table", "render_docs", "write_docs"]

DOCS = CHECKOUT / "docs" / "cli.md"
"""The reference whose option tables `write_docs` keeps."""

REGENERATE = "python -m tools.cli_docs"
"""The command that rewrites them."""

_TABLE = re.compile(
    r"(<!-- options: (?P<command>[A-Za-z -]+?)(?: \(others as (?P<other>[A-Za-z -]+)\))? -->\n)"
    r"(?P<table>.*?)(<!-- end options -->)",
    re.S,
)


def _specs(command: click.Command) -> list:
    return [p.spec for p in command.params if isinstance(p, SpecOption) and not p.hidden]


def doc_table(command: click.Command, beside: click.Command | None = None) -> str:
    """The markdown table of ``command``'s options: one row per `SpecOption`, in order, but
    for those of ``beside``."""
    known = _specs(beside) if beside is not None else []
    lines = ["| option | default | meaning |", "| --- | --- | --- |"]
    lines += ["| {} | {} | {} |".format(*s.row()) for s in _specs(command) if s not in known]
    return "\n".join(lines) + "\n"


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


def render_docs(text: str) -> str:
    """``text`` (docs/cli.md) with every marked table rebuilt from the commands' specs."""

    def table(m: re.Match) -> str:
        other = m.group("other")
        rows = doc_table(_command(m.group("command")), other and _command(other))
        return m.group(1) + rows + m.group(5)

    return _TABLE.sub(table, text)


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
