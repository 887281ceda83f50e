"""Run a plan's exported units in this process, chained in onnxruntime, as the runtime would:
expert functions run only on the tokens their dispatch routes to them (`mopar.runtime.dispatch`).

Verification (`verify_chain`) and the choice of quantised weights
(`mopar.compress.quantize`) both run the chain this way. The units are duck-typed: each has a
``name``, ``inputs`` and ``outputs`` (tensors with a ``name``), ``rows`` (true for an expert
function) and ``dispatch`` (None, or one with a ``spec``, a ``hot`` model and a ``tail`` unit).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mopar.bundle.layout import HOT_DIR
from mopar.config import Tolerance
from mopar.errors import Option, VerificationError
from mopar.runner.check import Comparison, compare_outputs

__all__ = [
    "OneAtATime",
    "chain_sessions",
    "streamed_sessions",
    "session",
    "run_chain",
    "verify_chain",
]


def session(path: Path) -> Any:
    """An onnxruntime CPU session of the model at ``path``, under the settings its function
    runs with (`mopar.runtime.handler.open_session`): a bfloat16 model's weights stay 2 bytes
    here too."""
    from mopar.runtime.handler import SESSION_FILE, open_session, saved_settings

    settings = saved_settings(path.with_name(SESSION_FILE))
    settings.pop("mmap_threshold", None)  # the process's own, not this session's
    return open_session(path, 0, settings)


class OneAtATime(Mapping):
    """A session per unit, opened when it is asked for, the one before dropped first: a chain
    of plain units run through it holds one unit's weights at a time, however large the
    model (each unit is asked for once per run, in order)."""

    def __init__(self, paths: Mapping[str, Path]) -> None:
        self._paths = dict(paths)
        self._open: tuple[str, Any] | None = None

    def __getitem__(self, name: str) -> Any:
        if self._open is None or self._open[0] != name:
            self._open = None  # dropped before the next one loads
            self._open = (name, session(self._paths[name]))
        return self._open[1]

    def __iter__(self):
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def streamed_sessions(model_paths: Sequence[Path], units: Sequence[Any]) -> Mapping[str, Any]:
    """`OneAtATime` sessions of a chain of plain units; `chain_sessions` where a dispatch
    calls its expert functions, which it may ask for again and again."""
    if any(u.rows or u.dispatch is not None for u in units):
        return chain_sessions(model_paths, units)
    return OneAtATime({u.name: p for p, u in zip(model_paths, units, strict=True)})


def chain_sessions(model_paths: Sequence[Path], units: Sequence[Any]) -> dict[str, Any]:
    """A session per unit (by its name), and per dispatch's hot experts (by its spec's
    ``local`` name)."""
    sessions = {}
    for path, unit in zip(model_paths, units, strict=True):
        sessions[unit.name] = session(path)
        if unit.dispatch is not None and unit.dispatch.hot is not None:
            sessions[unit.dispatch.spec.local] = session(path.parent / HOT_DIR / "model.onnx")
    return sessions


def run_chain(
    sessions: Mapping[str, Any],
    units: Sequence[Any],
    inputs: Mapping[str, np.ndarray],
    *,
    times_ms: MutableMapping[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """Every tensor the units hand on, the model's inputs and outputs included, from
    ``inputs``; with ``times_ms``, each unit's run time (ms) is added to it by name."""
    values = dict(inputs)

    def run(name: str, unit_session, feeds: dict, outputs: list[str]) -> list:
        start = time.perf_counter()
        got = unit_session.run(outputs, feeds)
        if times_ms is not None:
            times_ms[name] = times_ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return got

    for unit in units:
        if unit.rows:  # an expert function: its dispatch runs it
            continue
        if unit.dispatch is not None:
            spec = unit.dispatch.spec
            values[spec.output] = _dispatch(spec, values, sessions, run)
            tail = unit.dispatch.tail
        else:
            tail = unit
        out = run(
            unit.name,
            sessions[unit.name],
            {t.name: values[t.name] for t in tail.inputs},
            [t.name for t in tail.outputs],
        )
        values.update(zip((t.name for t in tail.outputs), out))
    return values


def _dispatch(spec, values: Mapping, sessions: Mapping, run) -> np.ndarray:
    """A dispatch function's output, as the runtime computes it: only the expert functions its
    tokens reached run, each on its tokens."""
    from mopar.runtime.dispatch import combine, expert_tensors, route

    hidden = np.asarray(values[spec.hidden])
    calls = route(spec, hidden, np.asarray(values[spec.index]), np.asarray(values[spec.weights]))
    answers = []
    for c in calls:
        tokens, gates, out = expert_tensors(c.function)
        feeds = {tokens: c.tokens, gates: c.gates}
        answers.append(run(c.function, sessions[c.function], feeds, [out])[0])
    return combine(spec, calls, answers, hidden.dtype, hidden.size // spec.hidden_size)


def verify_chain(
    model_paths: list[Path],
    slices: Sequence[Any],
    inputs: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    output_values: Mapping[str, str],
    *,
    tolerance: Tolerance,
    where: str = "",
) -> Comparison:
    """Chain the ONNX slices in onnxruntime and compare with the original model's outputs
    (on inputs ``where`` says, for the error). ``slices``: the units (or a bundle's ``io``
    functions), in chain order; ``output_values``: each public output's value name.

    Raises `VerificationError`, naming the output, when they are not within ``tolerance``.
    """
    values = run_chain(streamed_sessions(model_paths, slices), slices, inputs)
    got = {pub: values[value] for pub, value in output_values.items()}
    checked = compare_outputs(got, reference, tolerance)
    if not checked.passed:
        raise VerificationError(
            f"the chained ONNX slices{where}: {checked.describe(tolerance)}; pass a wider ",
            Option("rtol"),
            "/",
            Option("atol"),
            " if that is expected, try another ",
            Option("slices"),
            " count, or report it",
        )
    return checked
