"""Compare served outputs with the original model's, as ``numpy.allclose`` does.

An element passes when |got - want| <= atol + rtol * |want|. A relative error alone is unfair to
outputs that hold values near zero (a mask, a softmax tail), and an absolute one to outputs of a
large scale; the two together are what numpy, torch.testing and ONNX's own tests use.

Besides pass or fail, a `Comparison` keeps the largest absolute error, the largest error relative
to its output's scale (max |diff| / max |want|), and the output that came closest to failing, so
that a report can name it. Comparisons over many requests are merged with `Comparison.merge`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mopar.config import Tolerance

__all__ = ["Tolerance", "Comparison", "compare_outputs"]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """How far outputs were from the expected ones.

    Attributes:
        max_abs_err: the largest |got - want| of any element.
        max_rel_err: the largest max |got - want| / max |want| of any output (0 when all agree).
        ratio: the largest |got - want| / (atol + rtol * |want|) of any element; <= 1 passes.
        output: the output ``ratio`` was seen in (None when nothing was compared).
        reason: why the comparison could not be made elementwise (a missing output, a shape).
    """

    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    ratio: float = 0.0
    output: str | None = None
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0

    def merge(self, other: Comparison) -> Comparison:
        """The worst of both (``self``'s output and reason when tied)."""
        worse = other if other.ratio > self.ratio else self
        return Comparison(
            max_abs_err=max(self.max_abs_err, other.max_abs_err),
            max_rel_err=max(self.max_rel_err, other.max_rel_err),
            ratio=worse.ratio,
            output=worse.output,
            reason=worse.reason,
        )

    def figures(self, tolerance: Tolerance) -> str:
        """The largest errors and the tolerances, without a verdict."""
        return (
            f"max abs error {self.max_abs_err:.3g}, max relative error "
            f"{self.max_rel_err:.3g}; allclose with {tolerance}"
        )

    def describe(self, tolerance: Tolerance) -> str:
        """One line: the verdict, the figures and the tolerances."""
        figures = self.figures(tolerance)
        if self.passed:
            return f"outputs match the model ({figures})"
        why = self.reason or f"|a - b| reaches {self.ratio:.3g}x atol + rtol*|b|"
        return f"output {self.output!r} differs from the model: {why} ({figures})"


def compare_outputs(
    got: dict[str, np.ndarray], expected: dict[str, np.ndarray], tolerance: Tolerance = Tolerance()
) -> Comparison:
    """Compare every expected output with ``got``; see `Comparison`."""
    result = Comparison()
    for name, want in expected.items():
        have = got.get(name)
        if have is None or np.shape(have) != np.shape(want):
            shape = "missing" if have is None else f"shape {tuple(np.shape(have))}"
            return Comparison(
                max_abs_err=math.inf,
                max_rel_err=math.inf,
                ratio=math.inf,
                output=name,
                reason=f"{shape}, expected shape {tuple(np.shape(want))}",
            )
        result = result.merge(_compare_one(name, np.asarray(have), np.asarray(want), tolerance))
    return result


def _compare_one(name: str, have: np.ndarray, want: np.ndarray, tolerance: Tolerance) -> Comparison:
    if want.size == 0:
        return Comparison(output=name)
    have, want = have.astype(np.float64), want.astype(np.float64)
    # NaN where the model gives NaN too counts as equal, like allclose(equal_nan=True); a NaN
    # on one side only never passes.
    same_nan = np.isnan(have) & np.isnan(want)
    want = np.where(same_nan, 0.0, want)
    with np.errstate(divide="ignore", invalid="ignore"):
        diff = np.where(same_nan, 0.0, np.abs(have - want))
        diff = np.where(np.isnan(diff), math.inf, diff)
        allowed = tolerance.atol + tolerance.rtol * np.abs(want)
        ratios = np.where(diff == 0, 0.0, diff / allowed)  # x/0 -> inf: nothing was allowed
        ratios = np.where(np.isnan(ratios), math.inf, ratios)  # want NaN, got a number
    max_abs, scale = float(np.max(diff)), float(np.max(np.abs(want)))
    return Comparison(
        max_abs_err=max_abs,
        max_rel_err=max_abs / scale if scale > 0 else max_abs,
        ratio=float(np.max(ratios)),
        output=name,
    )
