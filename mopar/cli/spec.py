"""The machinery of the command line's options: `Spec` (one option, described once: its
``--help`` line and its row in docs/cli.md), `options` (a command's options from groups of
specs), `Number` (a float range that names its bounds) and the refusal of a removed option. The
groups themselves are `mopar.cli.options`'s."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import click

__all__ = ["Number", "Spec", "SpecOption", "options", "refuse", "registry"]


class Number(click.FloatRange):
    """A finite number within a range: the type of every real-valued option. (click's
    FloatRange takes ``nan``, which compares false with every bound, and ``inf`` where no
    maximum is set; no option of mopar means either.)"""

    name = "number"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One option, described once: ``help`` is both its ``--help`` line and the start of its
    row in docs/cli.md (whose detail beyond it is the checkout's ``tools/cli_more.py``).

    Attributes:
        decls: click's declarations: the flags, then the parameter's name where it differs.
        help: the description.
        type: a click type, or a callable of no arguments that makes one (for choices read
            from a registry when the option is applied).
        default: the value when not given.
        show_default: ``--help`` shows the default (None: where there is one, not empty, and
            the option is not an ``is_flag``).
        metavar: the value's name in ``--help`` (and in the docs, unless ``arg`` is given).
        arg: the value's name in the docs' option column (default: ``metavar``).
        shown: the docs' default column (default: the default, "off" for a flag, "none").
        instead: a removed option's (``hidden``, with `refuse` as its callback): what to do
            instead, said when it is given.
        extra: further keyword arguments of `click.option` (``is_flag``, ``multiple``, ...).
    """

    decls: tuple[str, ...]
    help: str
    type: Any = None
    default: Any = None
    show_default: bool | None = None
    metavar: str | None = None
    arg: str | None = None
    shown: str | None = None
    instead: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def flag(self) -> str:
        """The option's first spelling, e.g. ``--requests`` or ``--prewarm/--no-prewarm``."""
        return self.decls[0]

    def decorator(self) -> Callable:
        """The `click.option` decorator of this spec."""
        made = not isinstance(self.type, (type, click.ParamType)) and callable(self.type)
        kind = self.type() if made else self.type
        kwargs: dict[str, Any] = dict(self.extra)
        if kind is not None:
            kwargs["type"] = kind
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        if self.default is not None:  # click tells None given from none at all (required)
            kwargs["default"] = self.default
        worth = self.default not in (None, "") and not self.extra.get("is_flag")
        if self.show_default or (self.show_default is None and worth):
            kwargs["show_default"] = True
        return click.option(*self.decls, cls=SpecOption, spec=self, help=self.help, **kwargs)


class SpecOption(click.Option):
    """A click option that keeps the `Spec` it was made from (for docs/cli.md's tables)."""

    def __init__(self, *args: Any, spec: Spec, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec = spec


def options(*groups: Iterable[Spec]) -> Callable:
    """A decorator that gives a command every option of ``groups``, in their order."""
    specs = [s for group in groups for s in group]

    def decorate(fn: Callable) -> Callable:
        for spec in reversed(specs):  # click lists options in the order decorators are written
            fn = spec.decorator()(fn)
        return fn

    return decorate


def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """The callback of a removed option (``hidden``): given, it is refused in one line that
    says what to do instead (the `Spec`'s ``instead``)."""
    given = ctx.get_parameter_source(param.name or "") is click.core.ParameterSource.COMMANDLINE
    if given and isinstance(param, SpecOption):
        flags = "/".join((*param.opts, *param.secondary_opts))
        raise click.UsageError(f"{flags} is removed: {param.spec.help}; {param.spec.instead}")


def registry(module: str, name: str) -> Callable[[], click.Choice]:
    """A choice of the names in ``module``'s registry ``name`` (a collection, or a function that
    returns one), read when the option is applied."""

    def choice() -> click.Choice:
        names = getattr(importlib.import_module(module), name)
        return click.Choice(tuple(names() if callable(names) else names))

    return choice
