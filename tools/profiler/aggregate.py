"""Layer and service aggregation: the paper's rules, as pure functions over numbers.

Read in this order: `Aggregate`; the three rules `chain`, `parallel` and `hybrid`; `LayerStructure`
and `structure_of` (how a layer's internal DAG splits into a chain and parallel regions);
`aggregate_layer`, `service_profile` and `slice_profile`; last `layer_structure`, the adapter
from a LayerGraph layer to a `structure_of` input.

The rules (memory ``m`` in MB, time ``t`` in ms):

- chain of ops i: M = max_i m_i, t = sum_i t_i;
- parallel branches i, each a sequence of positions j: M = max_j sum_i m_ij, t = sum_j max_i t_ij;
- hybrid, a chain and parallel regions in series: M = max(M_c, M_b), t = t_c + t_b.

How a layer's structure is read (`structure_of`): a node every other node reaches or is reached
from lies on the layer's *chain* (nothing runs beside it). The other nodes fall between two
consecutive chain nodes (or before the first, or after the last); the nodes of one such interval
form a *parallel region*, whose branches are the weakly connected components of the interval and
whose positions are each branch's topological generations, counted from the fork. No parallel
region: a chain. No chain node: parallel. Both: hybrid.

Two simplifications, both documented where they act: branches of unequal length are padded with
zeros (a finished branch holds nothing at later positions), and nodes that share a generation
inside one branch (a knot that is not series-parallel) add their memory and take the slowest time
at that position, as if they were branches of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import networkx as nx

from mopar.profile.features import ALIAS_OPS

if TYPE_CHECKING:
    from mopar.ir import Layer, LayerGraph

__all__ = [
    "Aggregate",
    "chain",
    "parallel",
    "hybrid",
    "ParallelRegion",
    "LayerStructure",
    "structure_of",
    "aggregate_layer",
    "ServiceProfile",
    "service_profile",
    "slice_profile",
    "layer_structure",
]

# Ops that make a constant tensor from nothing (an LSTM's zero initial state): no input, no work.
FACTORY_OPS = frozenset(
    {
        "zeros",
        "ones",
        "full",
        "empty",
        "arange",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "scalar_tensor",
        "lift_fresh_copy",
    }
)


@dataclass(frozen=True, kw_only=True)
class Aggregate:
    """Memory and time of a group of ops (a layer, a region, a slice).

    Attributes:
        memory_mb: peak memory, MB.
        time_ms: execution time, ms.
    """

    memory_mb: float
    time_ms: float


# --- the three rules ------------------------------------------------------------------------------


def chain(memory_mb: Sequence[float], time_ms: Sequence[float]) -> Aggregate:
    """Ops run one after another: M = max m_i, t = sum t_i (an empty chain is 0, 0).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(memory_mb) != len(time_ms):
        raise ValueError(f"memory has {len(memory_mb)} ops but time has {len(time_ms)}")
    return Aggregate(memory_mb=float(max(memory_mb, default=0.0)), time_ms=float(sum(time_ms)))


def parallel(memory_mb: Sequence[Sequence[float]], time_ms: Sequence[Sequence[float]]) -> Aggregate:
    """Parallel branches: M = max over positions j of sum_i m_ij; t = sum over j of max_i t_ij.

    Args:
        memory_mb: one row per branch i, one entry per position j (MB). Rows may differ in
            length: a shorter branch counts 0 at the positions after its end.
        time_ms: the same layout, in ms.

    Raises:
        ValueError: the two matrices differ in layout.
    """
    if [len(r) for r in memory_mb] != [len(r) for r in time_ms]:
        raise ValueError(
            f"memory and time differ in layout: branch lengths {[len(r) for r in memory_mb]} "
            f"vs {[len(r) for r in time_ms]}"
        )
    positions = max((len(r) for r in memory_mb), default=0)

    def column(rows: Sequence[Sequence[float]], j: int) -> list[float]:
        return [row[j] if j < len(row) else 0.0 for row in rows]

    return Aggregate(
        memory_mb=float(max((sum(column(memory_mb, j)) for j in range(positions)), default=0.0)),
        time_ms=float(sum(max(column(time_ms, j)) for j in range(positions))),
    )


def hybrid(*parts: Aggregate) -> Aggregate:
    """A chain part and parallel parts in series: M = max(M_c, M_b, ...), t = t_c + t_b + ..."""
    return Aggregate(
        memory_mb=float(max((p.memory_mb for p in parts), default=0.0)),
        time_ms=float(sum(p.time_ms for p in parts)),
    )


# --- a layer's structure -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ParallelRegion:
    """Parallel branches between two chain nodes.

    Attributes:
        branches: ``branches[i][j]`` holds the node names of branch i at position j.
    """

    branches: tuple[tuple[tuple[str, ...], ...], ...]


@dataclass(frozen=True, kw_only=True)
class LayerStructure:
    """How a layer's ops combine: a chain and the parallel regions between its nodes.

    Attributes:
        name: the layer's name (``""`` for a bare graph).
        chain: nodes nothing runs beside, in topological order.
        regions: parallel regions, in topological order.
    """

    name: str = ""
    chain: tuple[str, ...]
    regions: tuple[ParallelRegion, ...]

    @property
    def kind(self) -> str:
        """``chain``, ``parallel`` (branches only) or ``hybrid`` (a chain and branches)."""
        if not self.regions:
            return "chain"
        return "hybrid" if self.chain else "parallel"


def structure_of(graph: nx.DiGraph, *, name: str = "") -> LayerStructure:
    """Split a layer's op DAG into its chain and its parallel regions (see the module doc).

    Nodes are taken in topological order, ties broken by the order they were added to ``graph``,
    so the result is deterministic.
    """
    rank = {v: i for i, v in enumerate(graph.nodes)}
    order = list(nx.lexicographical_topological_sort(graph, key=rank.__getitem__))
    index = {v: i for i, v in enumerate(order)}
    below = _reach(order, graph.predecessors, index)  # ancestors, as bit sets over `order`
    above = _reach(order[::-1], graph.successors, index)  # descendants
    everyone = (1 << len(order)) - 1
    spine = [v for v in order if below[v] | above[v] | (1 << index[v]) == everyone]
    spine_bits = sum(1 << index[v] for v in spine)
    intervals: dict[int, list[str]] = {}
    for v in order:
        if v not in spine:  # its interval: how many chain nodes come before it
            intervals.setdefault((below[v] & spine_bits).bit_count(), []).append(v)
    regions = tuple(_region(graph.subgraph(vs), index) for _, vs in sorted(intervals.items()))
    return LayerStructure(name=name, chain=tuple(spine), regions=regions)


def _reach(
    sweep: list[str], step: Callable[[str], Iterable[str]], index: Mapping[str, int]
) -> dict[str, int]:
    # Ancestor (or descendant) sets as Python ints, bit index[v] for node v, built in one sweep
    # over a topological order (or its reverse): one big-int OR per edge, where nx.ancestors per
    # node would walk the graph once per node.
    reach: dict[str, int] = {}
    for v in sweep:
        acc = 0
        for u in step(v):
            acc |= reach[u] | (1 << index[u])
        reach[v] = acc
    return reach


def _region(sub: nx.DiGraph, index: Mapping[str, int]) -> ParallelRegion:
    components = sorted(nx.weakly_connected_components(sub), key=lambda c: min(index[v] for v in c))
    branches = tuple(
        tuple(
            tuple(sorted(gen, key=index.__getitem__))
            for gen in nx.topological_generations(sub.subgraph(c))
        )
        for c in components
    )
    return ParallelRegion(branches=branches)


# --- aggregation ----------------------------------------------------------------------------------


def aggregate_layer(
    structure: LayerStructure, memory_mb: Mapping[str, float], time_ms: Mapping[str, float]
) -> Aggregate:
    """A layer's memory and time from its ops' (hybrid of its chain and regions).

    Ops absent from the mappings count 0: as in the paper, only dominant operators need a
    prediction.
    """
    parts = [
        chain(
            [memory_mb.get(v, 0.0) for v in structure.chain],
            [time_ms.get(v, 0.0) for v in structure.chain],
        )
    ]
    for region in structure.regions:
        # Nodes sharing a position inside one branch run side by side: their memory adds up and
        # the slowest sets the time, as across branches.
        m = [[sum(memory_mb.get(v, 0.0) for v in pos) for pos in b] for b in region.branches]
        t = [[max(time_ms.get(v, 0.0) for v in pos) for pos in b] for b in region.branches]
        parts.append(parallel(m, t))
    return hybrid(*parts)


@dataclass(frozen=True, kw_only=True)
class ServiceProfile:
    """The paper's service profile: per-layer memory and time vectors.

    Attributes:
        layers: layer names, in order.
        memory_mb: M, each layer's memory, MB.
        time_ms: T, each layer's time, ms.
    """

    layers: tuple[str, ...]
    memory_mb: tuple[float, ...]
    time_ms: tuple[float, ...]


def service_profile(
    structures: Sequence[LayerStructure],
    memory_mb: Mapping[str, float],
    time_ms: Mapping[str, float],
) -> ServiceProfile:
    """M and T of a model: every layer aggregated from its ops' memory (MB) and time (ms).

    Args:
        structures: each layer's structure, in layer order.
        memory_mb: op (node) name -> predicted memory, MB; node names are unique in a model.
        time_ms: op name -> predicted time, ms.
    """
    parts = [aggregate_layer(s, memory_mb, time_ms) for s in structures]
    return ServiceProfile(
        layers=tuple(s.name for s in structures),
        memory_mb=tuple(p.memory_mb for p in parts),
        time_ms=tuple(p.time_ms for p in parts),
    )


def slice_profile(memory_mb: Sequence[float], time_ms: Sequence[float]) -> Aggregate:
    """A slice's peak memory (MB) and total time (ms) from its layers': the chain rule."""
    return chain(memory_mb, time_ms)


# --- from a LayerGraph ----------------------------------------------------------------------------


def layer_structure(
    layer: Layer, lg: LayerGraph, *, keep: Iterable[str] | None = None
) -> LayerStructure:
    """The structure of ``layer``'s ops in ``lg``.

    Args:
        layer: a layer of ``lg``.
        lg: the layer graph; its FX graph gives the data flow between the layer's nodes.
        keep: node names to structure over (e.g. the dominant ops); the default keeps every node
            but views, getitem and constant factories (an LSTM's zero state), which would
            otherwise show up as spurious parallel branches. Two kept nodes are linked when data
            flows from one to the other through dropped nodes only.
    """
    from mopar.ir.flops import op_name

    inside = {n.name: n for n in lg.gm.graph.nodes if n.name in set(layer.nodes)}
    if keep is None:
        kept = [v for v, n in inside.items() if op_name(n) not in ALIAS_OPS | FACTORY_OPS]
    else:
        wanted = set(keep)
        kept = [v for v in inside if v in wanted]
    graph = nx.DiGraph()
    graph.add_nodes_from(kept)
    for v in kept:
        stack, seen = list(inside[v].users), set()
        while stack:
            user = stack.pop()
            if user.name in seen or user.name not in inside:
                continue
            seen.add(user.name)
            if user.name in graph:
                graph.add_edge(v, user.name)
            else:
                stack.extend(user.users)
    return structure_of(graph, name=layer.name)
