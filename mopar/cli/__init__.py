"""The ``mopar`` command line: a thin click group; one module per command.

Exit codes: 0 ok; 1 a user error (one line on stderr, traceback only with --debug); 2 an internal
error (a bug in mopar). Commands import torch inside their bodies, so ``mopar --help`` stays fast.

mopar's log records reach stderr as ``warning: ...`` lines; ``--verbose`` adds INFO.
A `MoparError` is rendered in the CLI's style: the options it names read as flags (``--slices``).
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable

import click

from mopar import __version__
from mopar.cli.build import build_cmd
from mopar.cli.checkout import LabCommand, LabGroup
from mopar.cli.child import mark_process
from mopar.cli.compile import compile_cmd
from mopar.cli.generate import generate_cmd
from mopar.cli.inspect import inspect_cmd
from mopar.cli.invoke import invoke_cmd
from mopar.cli.plan import plan_cmd
from mopar.cli.profile import profile_group
from mopar.cli.run import load_cmd, max_rate_cmd, run_cmd
from mopar.cli.serve import serve_cmd
from mopar.cli.simulate import simulate_cmd
from mopar.errors import MoparError

__all__ = ["cli", "main"]


class MoparGroup(LabGroup):
    """A click group that turns errors into one line and the documented exit codes."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        level = logging.getLogger("mopar").level  # --debug lowers it for this command only
        try:
            code = super().main(
                args, prog_name or "mopar", complete_var, standalone_mode=False, **extra
            )
        except click.ClickException as exc:  # usage errors are user errors: exit 1, one line
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"error: {' '.join(exc.format_message().split())}{hint}", err=True)
            code = 1
        except click.Abort:
            click.echo("aborted", err=True)
            code = 130
        finally:
            logging.getLogger("mopar").setLevel(level)
        if standalone_mode:
            sys.exit(code if isinstance(code, int) else 0)
        return code

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except MoparError as exc:
            _debug_traceback(ctx)
            click.echo(f"error: {' '.join(exc.render('cli').split())}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:
            _debug_traceback(ctx)
            click.echo(
                f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:500]} -- this "
                "is a bug in mopar; rerun with --debug and report the traceback",
                err=True,
            )
            ctx.exit(2)


def _debug_traceback(ctx: click.Context) -> None:
    if (ctx.obj or {}).get("debug"):
        traceback.print_exc()


class _StderrHandler(logging.Handler):
    """mopar's log records as ``level: message`` lines on the current stderr (click's, so that
    a test runner's or a progress bar's stderr is honoured)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(f"{record.levelname.lower()}: {self.format(record)}", err=True)
        except Exception:  # logging's contract: a failing handler never raises
            self.handleError(record)


def _show_info(handler: logging.Handler) -> None:
    """Let INFO records through ``handler`` (and the ``mopar`` logger) for this command."""
    handler.setLevel(logging.INFO)
    logger = logging.getLogger("mopar")
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # MoparGroup.main puts the level back


def _log_to_stderr(ctx: click.Context) -> None:
    """Show mopar's records at WARNING and above (INFO too with ``--verbose``) for this command;
    the library itself only has a NullHandler."""
    logger = logging.getLogger("mopar")
    handler = _StderrHandler(logging.WARNING)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > handler.level:
        logger.setLevel(handler.level)  # MoparGroup.main puts the level back
    state = ctx.ensure_object(dict)
    state["log_handler"] = handler
    if state.get("verbose"):
        _show_info(handler)
    ctx.call_on_close(lambda: logger.removeHandler(handler))


# --- options every command takes, before or after its name ---------------------------------------
# The group's callback runs after its own options are parsed and before the subcommand's, so an
# option given after the subcommand finds the stderr handler in place and adjusts it.


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.find_root().ensure_object(dict)["debug"] = True
        logging.getLogger("mopar").setLevel(logging.DEBUG)  # lets library output through (_quiet)
    return value


def _set_verbose(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        state = ctx.find_root().ensure_object(dict)
        state["verbose"] = True
        if "log_handler" in state:  # given after the subcommand: the group already logs
            _show_info(state["log_handler"])
    return value


_GLOBAL_OPTIONS: tuple[Callable[[], click.Option], ...] = (
    lambda: click.Option(
        ["--debug"],
        is_flag=True,
        expose_value=False,
        callback=_set_debug,
        help="Show tracebacks for errors.",
    ),
    lambda: click.Option(
        ["-v", "--verbose"],
        is_flag=True,
        expose_value=False,
        callback=_set_verbose,
        help="Show what mopar is doing: its INFO log lines on stderr.",
    ),
)


def _add_global_options(command: click.Command) -> None:
    """Give ``command`` and every command under it the options of `_GLOBAL_OPTIONS` it lacks, so
    that ``mopar compile -v`` works as ``mopar -v compile`` does."""
    taken = {name for param in command.params for name in getattr(param, "opts", ())}
    for make in _GLOBAL_OPTIONS:
        option = make()
        if not taken & set(option.opts):
            command.params.append(option)
    for sub in getattr(command, "commands", {}).values():
        _add_global_options(sub)


@click.group(
    cls=MoparGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 ok, 1 user error, 2 internal error (a bug). --debug and --verbose "
    "go before or after the command's name.",
)
@click.version_option(__version__, prog_name="mopar")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Cut a trained PyTorch model into serverless functions."""
    _log_to_stderr(ctx)


for _cmd in (
    compile_cmd,
    plan_cmd,
    build_cmd,
    run_cmd,
    load_cmd,
    max_rate_cmd,
    serve_cmd,
    invoke_cmd,
    generate_cmd,
    simulate_cmd,
    inspect_cmd,
    profile_group,
    LabCommand(
        "bench",
        "benchmarks.cli",
        "bench_cmd",
        "Compile every model with every strategy, run them interleaved, and compare.",
    ),
):
    cli.add_command(_cmd)
_add_global_options(cli)


def main() -> None:
    from mopar.profile import store

    store.WITHOUT_SKLEARN = True  # this process is mopar's own: no second lost to scikit-learn
    mark_process()  # and `mopar compile` may run its torch part in a child
    cli()
