"""Keep torch's, transformers' and the ONNX exporter's chatter off the user's terminal.

torch.export prints partial graphs on failure, logs whole tracebacks as warnings when it cannot
deserialize a file, and the ONNX exporter narrates every step; mopar's own errors carry the
reason. So during those calls stdout and stderr writes are captured, the libraries' log records
are kept (not shown) and their warnings ignored; afterwards everything is put back.

When the ``mopar`` logger is enabled for DEBUG (``mopar --debug``), nothing is hidden: records
are still kept, for the error message, but also reach the libraries' own handlers.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Quieted", "quiet_libraries"]

_ROOTS = ("torch", "onnx_ir", "onnxscript", "onnx", "transformers")


@dataclass(frozen=True)
class Quieted:
    """What the libraries said inside `quiet_libraries`.

    Attributes:
        output: their stdout and stderr writes (empty when passed through).
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
    block) propagates to a root here, or writes to the redirected stderr."""
    found = logging.root.manager.loggerDict.items()
    return [
        lg
        for name, lg in sorted(found)
        if name.split(".")[0] in _ROOTS and isinstance(lg, logging.Logger)
    ]


@contextlib.contextmanager
def quiet_libraries() -> Iterator[Quieted]:
    """Yield what the libraries said; restore loggers, warnings and streams afterwards."""
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
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(quieted.output),
            contextlib.redirect_stderr(quieted.output),
        ):
            warnings.simplefilter("ignore")
            yield quieted
    finally:
        _restore(saved, keep, quieted.output)


def _restore(saved, keep: logging.Handler, captured: io.StringIO) -> None:
    for lg, level, handlers, propagate in saved:
        # Handlers a library added meanwhile (transformers adds its own on first import) stay.
        added = [h for h in lg.handlers if h is not keep and h not in handlers]
        lg.handlers = handlers + added
        lg.setLevel(level)
        lg.propagate = propagate
    # A StreamHandler made while stderr was redirected would write to the capture forever.
    for lg in [logging.root, *_library_loggers()]:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is captured:
                handler.setStream(sys.stderr)
