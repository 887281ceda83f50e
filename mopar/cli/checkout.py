"""The lab beside the package: what some commands run from a checkout of mopar's repository.

The wheel holds mopar alone. The repository's root also holds `LAB`: ``examples/`` (the example
models), ``benchmarks/`` (the bench harness and the experiments) and ``tools/`` (the profiler's
collection and training, the plots). ``mopar bench`` and ``mopar profile collect|train|report|
calibrate`` are the lab's own commands (``benchmarks/cli.py``, ``tools/profiler/cli.py``): the
wheel holds only their names and one-line help, as `LabCommand` entries, which a `LabGroup`
loads from the checkout when one is invoked. The ``--plot`` options import ``tools`` inside the
command, after `need_checkout`. No module of mopar imports the lab at its top, and nothing below
the CLI imports it at all (``lint-imports``; tests/test_layers.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import click

from mopar.errors import MoparError

__all__ = ["LAB", "LabCommand", "LabGroup", "need_checkout"]

LAB = {
    "examples": "mopar's example models",
    "benchmarks": "mopar's benchmarks",
    "tools": "mopar's profiler and plotting tools",
}
"""The repository's top-level packages beside ``mopar/``, by name, and what each holds."""


def need_checkout(command: str, package: str) -> ModuleType:
    """The repository's ``package`` (a key of `LAB`), which ``command`` runs; imported here, at once.

    The installed ``mopar`` script does not search the current folder, so a checkout's root is
    added to ``sys.path`` as ``python -m`` would. A package of that name from elsewhere (a
    stray ``tools`` in site-packages) is not the repository's: it needs ``mopar/`` beside it.

    Raises:
        MoparError: ``package`` is not the checkout's, in one line that says where to run from.
    """
    here = Path.cwd()
    if (here / package / "__init__.py").is_file() and str(here) not in sys.path:
        sys.path.insert(0, str(here))
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name != package:
            raise
        module = None
    root = Path(getattr(module, "__file__", None) or "/").resolve().parent.parent
    if module is None or not (root / "mopar" / "__init__.py").is_file():
        raise MoparError(
            f"`mopar {command}` runs {LAB[package]}, which are in its repository's {package}/ "
            "folder, not in the installed package; run it from the root of a mopar checkout "
            "(git clone, then cd into it)"
        )
    return module


class LabCommand(click.Command):
    """A command of the lab, as the wheel lists it: its name and one-line help.

    Invoking it loads the command itself, ``attr`` of the checkout's module ``module`` (whose
    first part is a package of `LAB`), which then parses the arguments: its ``--help`` is the
    full one. Outside a checkout, `need_checkout` refuses in one line.
    """

    def __init__(self, name: str, module: str, attr: str, help: str) -> None:
        super().__init__(name, help=help, short_help=help, add_help_option=False)
        self.module, self.attr = module, attr

    def load(self, command: str) -> click.Command:
        """The lab's command, typed as ``command`` after ``mopar``, with the options the CLI
        gave this one (``--debug``, ``--verbose``) where it lacks them."""
        need_checkout(command, self.module.split(".")[0])
        loaded: click.Command = getattr(importlib.import_module(self.module), self.attr)
        taken = {name for param in loaded.params for name in getattr(param, "opts", ())}
        loaded.params += [p for p in self.params if not taken & set(getattr(p, "opts", ()))]
        return loaded


class LabGroup(click.Group):
    """A click group whose `LabCommand` entries are loaded from the checkout when invoked."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if isinstance(command, LabCommand):
            path = " ".join([*ctx.command_path.split()[1:], command.name or ""])
            command = command.load(path)
        return name, command, rest
