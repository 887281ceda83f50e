"""Balanced contiguous splits, for the ``params`` and ``latency`` strategies.

Pure functions over lists of numbers: exactly N contiguous slices minimising the heaviest (the
classic linear partition problem), found exactly by binary search on the bound with a greedy
feasibility check.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_split"]


def balanced_split(weights: Sequence[int], n: int) -> tuple[int, ...]:
    """Split ``weights`` into exactly ``n`` contiguous non-empty groups minimising the max sum.

    Args:
        weights: non-negative integer weight of each item (bytes).
        n: number of groups, 1 <= n <= len(weights).

    Returns:
        The start index of every group after the first (``n - 1`` increasing cut positions).
    """
    if not 1 <= n <= len(weights):
        raise ValueError(f"n must be in [1, {len(weights)}], got {n}")
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(weights, mid)) + 1 <= n:
            hi = mid
        else:
            lo = mid + 1
    cuts = _greedy(weights, lo)
    # Fewer groups than asked: split further; splitting a group never raises the maximum.
    free = [i for i in range(1, len(weights)) if i not in set(cuts)]
    while len(cuts) + 1 < n:
        cuts.append(free.pop())
    return tuple(sorted(cuts))


def _greedy(weights: Sequence[int], bound: int) -> list[int]:
    """Cut positions of the greedy packing of ``weights`` into groups of sum <= ``bound``."""
    cuts: list[int] = []
    acc = 0
    for i, w in enumerate(weights):
        if acc + w > bound and i > 0 and acc > 0:
            cuts.append(i)
            acc = 0
        acc += w
    return cuts
