"""Keep torch's and the ONNX exporter's chatter off the user's terminal while they work.

torch.export prints partial graphs on failure and the ONNX exporter narrates every step; mopar's
own errors carry the reason, so during those calls stdout and stderr writes are captured and
the libraries' loggers raised to ERROR, then everything is put back.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator

__all__ = ["quiet_libraries"]

_ROOTS = ("torch", "onnx_ir", "onnxscript", "onnx")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[io.StringIO]:
    """Yield the captured output; restore logger levels afterwards."""
    names = {n for n in logging.root.manager.loggerDict if n.split(".")[0] in _ROOTS} | set(_ROOTS)
    loggers = [logging.getLogger(n) for n in sorted(names)]
    levels = [lg.level for lg in loggers]
    captured = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured), \
                contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            yield captured
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
