"""Simplify a layer DAG before solving: the paper's node and edge elimination.

Pure functions over numbers: no torch, no networkx. Layers are indexed 0..n-1 in topological order,
the model inputs come from the pseudo-node -1 and the outputs go to the pseudo-node n. Slices will
be contiguous ranges of that order, so a merge only ever joins two neighbouring contiguous groups,
and the result is a coarser chain of groups that the split solvers can take in place of layers.

- *Node elimination.* A group with exactly one incoming and one outgoing edge is merged with the
  group at the other end of one of those edges when that group is also its neighbour in the order
  and their memories are within ``threshold`` (relative). A merged group's memory is the max of its
  members' (they run one after the other, so the peak is the larger one).
- *Edge elimination.* Edges between the same two groups become one edge whose tensor set is the
  union (a tensor that reaches two layers of a group is handed over once); edges inside a group
  disappear.

Both repeat until nothing changes. The order is fixed: the leftmost group that can be merged is
merged first, with the group before it when both neighbours qualify.

Read in this order: `simplify`, `Simplified`, then the private helpers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Edge", "Simplified", "simplify"]

#: One edge: (producer index, consumer index, the tensors on it as ``(name, nbytes)``).
Edge = tuple[int, int, frozenset[tuple[str, int]]]


@dataclass(frozen=True, kw_only=True)
class Simplified:
    """The result of `simplify`: a chain of contiguous layer groups.

    Attributes:
        n_layers: number of layers of the original graph.
        groups: half-open layer ranges ``(lo, hi)``, in order, covering 0..n_layers exactly.
        group_of: the group index of each layer.
        memory_mb: predicted memory of each group, MB (the max of its layers').
        edges: one edge per connected pair of groups, ``(producer group, consumer group,
            tensors)``, sorted; the model inputs come from -1, the outputs go to ``len(groups)``.
        threshold: the relative memory tolerance the groups were merged with.
        modified: True when any layers or any parallel edges were merged.
    """

    n_layers: int
    groups: tuple[tuple[int, int], ...]
    group_of: tuple[int, ...]
    memory_mb: tuple[float, ...]
    edges: tuple[Edge, ...]
    threshold: float
    modified: bool


def simplify(
    n: int, memory_mb: Sequence[float], edges: Iterable[Edge], threshold: float = 0.05
) -> Simplified:
    """Merge similar neighbouring layers of a chain-like run, and parallel edges, until stable.

    Args:
        n: number of layers (>= 1).
        memory_mb: predicted memory of each layer, MB (finite, >= 0).
        edges: ``(producer, consumer, tensors)`` with ``-1 <= producer < consumer <= n``; -1 is
            the model input and n the model output. Several edges may join the same two layers.
        threshold: relative tolerance: memories a and b are similar when
            ``|a - b| <= threshold * max(a, b)`` (0 merges equal memories only).

    Returns:
        The groups, their memories and the edges between them.

    Raises:
        ValueError: a malformed argument (a bug in the caller: these come from the LayerGraph).
    """
    edges = tuple(edges)
    _check(n, memory_mb, edges, threshold)
    g = _Graph(n, memory_mb, edges)
    merged_edges = len(edges) != sum(len(out) for out in g.succ.values())
    start = 0
    while start < n:
        merged_into = g.try_merge(start, threshold)
        start = g.nxt[start] if merged_into is None else g.restart_point(merged_into)
    return g.result(threshold, modified=merged_edges or len(g.hi) < n)


def _check(n: int, memory_mb: Sequence[float], edges: tuple[Edge, ...], threshold: float) -> None:
    if n < 1 or len(memory_mb) != n:
        raise ValueError(
            f"need n >= 1 layers and one memory per layer, got n={n} and {len(memory_mb)} memories"
        )
    bad = [m for m in memory_mb if not (math.isfinite(m) and m >= 0)]
    if bad:
        raise ValueError(f"layer memories must be finite and >= 0 MB, got {bad[0]}")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
    for u, v, _ in edges:
        if not -1 <= u < v <= n:
            raise ValueError(
                f"edge ({u}, {v}) is not forward in topological order: "
                f"need -1 <= producer < consumer <= {n}"
            )


def _similar(a: float, b: float, threshold: float) -> bool:
    return abs(a - b) <= threshold * max(a, b)


class _Graph:
    """The mutable working state of `simplify`: groups keyed by their first layer.

    Groups form a linked list (``prv``/``nxt``, with -1 and n at the ends); ``succ``/``pred`` map
    a group to its neighbours and the tensor set of the single edge to each.
    """

    def __init__(self, n: int, memory_mb: Sequence[float], edges: tuple[Edge, ...]) -> None:
        self.n = n
        self.hi = {i: i + 1 for i in range(n)}
        self.mem = {i: float(m) for i, m in enumerate(memory_mb)}
        self.prv = {i: i - 1 for i in range(n + 1)}
        self.nxt = {i: i + 1 for i in range(-1, n)}
        self.succ: dict[int, dict[int, frozenset]] = {i: {} for i in range(-1, n + 1)}
        self.pred: dict[int, dict[int, frozenset]] = {i: {} for i in range(-1, n + 1)}
        for u, v, tensors in edges:
            self._add(u, v, frozenset(tensors))

    def _add(self, u: int, v: int, tensors: frozenset) -> None:
        union = self.succ[u].get(v, frozenset()) | tensors
        self.succ[u][v] = union
        self.pred[v][u] = union

    def try_merge(self, g: int, threshold: float) -> int | None:
        """Merge group g with a qualifying neighbour; return the merged group, or None."""
        if len(self.pred[g]) != 1 or len(self.succ[g]) != 1:
            return None
        (p,) = self.pred[g]
        (s,) = self.succ[g]
        if p == self.prv[g] and p != -1 and _similar(self.mem[p], self.mem[g], threshold):
            return self._merge(p, g)
        if s == self.nxt[g] and s != self.n and _similar(self.mem[g], self.mem[s], threshold):
            return self._merge(g, s)
        return None

    def _merge(self, a: int, b: int) -> int:
        """Fold group b into the group a just before it; edges between them vanish."""
        for h, tensors in self.succ.pop(b).items():
            del self.pred[h][b]
            self._add(a, h, tensors)
        for h, tensors in self.pred.pop(b).items():
            del self.succ[h][b]
            if h != a:
                self._add(h, a, tensors)
        self.mem[a] = max(self.mem[a], self.mem.pop(b))
        self.hi[a] = self.hi.pop(b)
        self.nxt[a] = self.nxt.pop(b)
        self.prv[self.nxt[a]] = a
        del self.prv[b]
        return a

    def restart_point(self, m: int) -> int:
        """The leftmost group whose eligibility a merge into m may have changed.

        Only m, its neighbours in the graph and the group before it in the order can change;
        groups after m are reached by the scan anyway.
        """
        return min([h for h in (*self.pred[m], self.prv[m]) if h >= 0] + [m])

    def result(self, threshold: float, *, modified: bool) -> Simplified:
        starts = sorted(self.hi)
        index = {lo: k for k, lo in enumerate(starts)}
        index[-1], index[self.n] = -1, len(starts)
        group_of = [0] * self.n
        for k, lo in enumerate(starts):
            group_of[lo : self.hi[lo]] = [k] * (self.hi[lo] - lo)
        edges = sorted(
            (
                (index[u], index[v], tensors)
                for u, out in self.succ.items()
                for v, tensors in out.items()
            ),
            key=lambda e: (e[0], e[1]),
        )
        return Simplified(
            n_layers=self.n,
            groups=tuple((lo, self.hi[lo]) for lo in starts),
            group_of=tuple(group_of),
            memory_mb=tuple(self.mem[lo] for lo in starts),
            edges=tuple(edges),
            threshold=threshold,
            modified=modified,
        )
