"""Keep torch's, transformers' and the ONNX exporter's chatter off the user's terminal, and
serialise the library calls that are not thread-safe.

torch.export prints partial graphs on failure, logs whole tracebacks as warnings when it cannot
deserialize a file, and the ONNX exporter narrates every step; mopar's own errors carry the
reason. So during those calls the libraries' log records are kept (not shown), their warnings
ignored and the prints of the modules that print themselves (`_PRINTERS`) kept; afterwards
everything is put back. The host's ``sys.stdout`` and ``sys.stderr`` are never touched: a
program that calls mopar from several threads keeps its own output.

torch.export, the ONNX exporter and model loading keep process-wide state (fake modes, the
exporter's registries), and so do the logger and warnings settings changed here: one block runs
at a time in a process (`LIBRARIES`); the rest of a compile runs in parallel.

When the ``mopar`` logger is enabled for DEBUG (``mopar --debug``), nothing is hidden: records
are still kept, for the error message, but also reach the libraries' own handlers.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

__all__ = ["LIBRARIES", "Quieted", "quiet_libraries"]

_ROOTS = ("torch", "onnx_ir", "onnxscript", "onnx", "transformers")

_PRINTERS = ("torch.export._trace",)
"""Modules that ``print`` to ``sys.stderr`` themselves (a partial graph when export fails):
their ``print`` is shadowed by one that keeps the text, inside the block only."""

LIBRARIES = threading.RLock()
"""Held by `quiet_libraries` for its whole block: one library call at a time per process."""


@dataclass(frozen=True)
class Quieted:
    """What the libraries said inside `quiet_libraries`.

    Attributes:
        output: what the modules of `_PRINTERS` printed (empty when passed through).
        records: their log records at WARNING and above, in order.
    """

    output: io.StringIO = field(default_factory=io.StringIO)
    records: list[logging.LogRecord] = field(default_factory=list)

    def last_exception(self) -> BaseException | None:
        """The exception of the last record logged with ``exc_info``, if any."""
        for record in reversed(self.records):
            if record.exc_info and record.exc_info[1] is not None:
                return record.exc_info[1]
        return None


class _Keep(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        # A record seen by a child logger and again by its parent is kept once.
        if not self.records or self.records[-1] is not record:
            self.records.append(record)


def _library_loggers() -> list[logging.Logger]:
    """The libraries' loggers that exist now. One made later (a library imported inside the
    block) propagates to a root here."""
    found = logging.root.manager.loggerDict.items()
    return [
        lg
        for name, lg in sorted(found)
        if name.split(".")[0] in _ROOTS and isinstance(lg, logging.Logger)
    ]


@contextlib.contextmanager
def quiet_libraries() -> Iterator[Quieted]:
    """Yield what the libraries said; restore loggers, warnings and prints afterwards. Blocks
    of several threads run one after the other (`LIBRARIES`)."""
    with LIBRARIES:
        quieted = Quieted()
        keep = _Keep(quieted.records)
        loggers = _library_loggers()
        saved = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
        passthrough = logging.getLogger("mopar").isEnabledFor(logging.DEBUG)
        try:
            for lg in loggers:
                if passthrough:
                    lg.addHandler(keep)
                    continue
                lg.handlers = [keep]
                lg.propagate = False
                lg.setLevel(logging.WARNING)
            if passthrough:
                yield quieted
                return
            with warnings.catch_warnings(), _prints_kept(quieted.output):
                warnings.simplefilter("ignore")
                yield quieted
        finally:
            _restore(saved, keep)


@contextlib.contextmanager
def _prints_kept(output: io.StringIO) -> Iterator[None]:
    """Shadow ``print`` in the `_PRINTERS` modules (when torch is loaded) by one that writes to
    ``output``; module globals come before builtins, so nothing else is affected."""

    def kept(*args: object, sep: str | None = " ", end: str | None = "\n", **_: object) -> None:
        print(*args, sep=sep, end=end, file=output)

    modules = _printers()
    for module in modules:
        module.print = kept  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            vars(module).pop("print", None)


def _printers() -> list[ModuleType]:
    if "torch" not in sys.modules:  # nothing of torch's can print in a block that loads none
        return []
    found = []
    for name in _PRINTERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another torch version: moved or gone
            continue
        if "print" not in vars(module):
            found.append(module)
    return found


def _restore(saved, keep: logging.Handler) -> None:
    for lg, level, handlers, propagate in saved:
        # Handlers a library added meanwhile (transformers adds its own on first import) stay.
        added = [h for h in lg.handlers if h is not keep and h not in handlers]
        lg.handlers = handlers + added
        lg.setLevel(level)
        lg.propagate = propagate
