"""Move a cut when a slice will not export: the decision, as pure functions over layer indices.

A slice can fail to export to ONNX because of where it was cut (the exporter cannot take a value
that crosses there) while the same layers cut one layer earlier or later export fine. The export
stage (`mopar.pipeline.export`) asks `next_recut` for another set of cuts whenever a slice
fails, plans at them, and gives up when there is none.

A plan's cuts are layer indices: cut k is where slice k + 1 of its vertical cut starts. Read in
this order: `plan_cuts`, `Recut`, `next_recut`, then `recut_note`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mopar.plan import Plan

__all__ = ["MAX_MOVES", "Recut", "plan_cuts", "next_recut", "recut_note"]

MAX_MOVES = 3
"""How many times a cut may move, and how far (in layers) from where the planner put it."""


def plan_cuts(plan: Plan) -> tuple[int, ...]:
    """The layer index at which each slice of ``plan``'s vertical cut, after the first, starts."""
    cuts, start = [], 0
    for s in plan.vertical()[:-1]:
        start += len(s.layers)
        cuts.append(start)
    return tuple(cuts)


@dataclass(frozen=True, kw_only=True)
class Recut:
    """One cut moved.

    Attributes:
        cuts: every cut afterwards (layer indices).
        cut: which cut moved (0: the one between the first two slices).
        before: the layer index it was at.
        after: the layer index it is at now.
    """

    cuts: tuple[int, ...]
    cut: int
    before: int
    after: int


def next_recut(
    original: Sequence[int],
    history: Sequence[Recut],
    failing: int,
    *,
    num_layers: int,
    max_moves: int = MAX_MOVES,
) -> Recut | None:
    """The next cuts to try after slice ``failing`` did not export, or None to give up.

    The slice was cut at ``original`` moved by ``history``. A candidate moves one of the two
    cuts around it, away from where the planner put it, to another layer boundary: the nearest
    to that first; at equal distance the slice's start before its end, and the earlier layer
    first. A cut moves at most ``max_moves`` times and stays within ``max_moves`` layers of
    where the planner put it, every slice keeps at least one layer, and no set of cuts comes
    twice. So both neighbours of a cut are tried, and a slice that fails wherever it is cut gives
    up after ``2 * max_moves`` tries.

    Args:
        original: the planner's cuts (layer indices, increasing).
        history: the moves made so far, in order (the cuts that failed are the last one's).
        failing: the index of the slice that did not export.
        num_layers: the model's layer count.
        max_moves: how often, and how far in layers, a cut may move.
    """
    current = history[-1].cuts if history else tuple(original)
    if len(current) != len(original) or not 0 <= failing <= len(current):
        raise ValueError(
            f"slice {failing} of {len(current) + 1} with cuts {tuple(current)}, "
            f"planned as {tuple(original)}"
        )
    tried = {tuple(original), *(h.cuts for h in history)}
    own = [
        k
        for k in (failing - 1, failing)
        if 0 <= k < len(current) and sum(h.cut == k for h in history) < max_moves
    ]
    candidates = []
    for k in own:
        lo = max(original[k] - max_moves, current[k - 1] + 1 if k > 0 else 1)
        hi = min(
            original[k] + max_moves, current[k + 1] - 1 if k + 1 < len(current) else num_layers - 1
        )
        for position in range(lo, hi + 1):
            if position not in (current[k], original[k]):
                candidates.append((abs(position - original[k]), k != failing - 1, position, k))
    for _, _, position, k in sorted(candidates):
        cuts = (*current[:k], position, *current[k + 1 :])
        if cuts not in tried:
            return Recut(cuts=cuts, cut=k, before=current[k], after=position)
    return None


def recut_note(move: Recut, layer_names: Sequence[str], *, failed_slice: str, why: str) -> str:
    """The plan note that says a cut was moved, and why."""

    def boundary(i: int) -> str:
        return f"{layer_names[i - 1]} | {layer_names[i]}"

    return (
        f"cut {move.cut + 1} moved from {boundary(move.before)} to {boundary(move.after)}: "
        f"slice {failed_slice} did not export to ONNX ({why})"
    )
