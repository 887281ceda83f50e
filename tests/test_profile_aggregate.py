"""The paper's aggregation rules on hand-built chain, parallel and hybrid layers."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mopar import api
from tools.profiler.aggregate import (
    Aggregate,
    LayerStructure,
    ParallelRegion,
    aggregate_layer,
    chain,
    hybrid,
    layer_structure,
    parallel,
    service_profile,
    slice_profile,
    structure_of,
)


def dag(*edges: str, nodes: str = "") -> nx.DiGraph:
    """``dag("ab", "bc")`` is a -> b -> c; ``nodes`` adds lone nodes (one letter each)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from(tuple(e) for e in edges)
    return graph


# --- the rules -----------------------------------------------------------------------------------


def test_chain_takes_the_largest_memory_and_the_summed_time():
    assert chain([1.0, 3.0, 2.0], [1.0, 2.0, 3.0]) == Aggregate(memory_mb=3.0, time_ms=6.0)


def test_parallel_sums_memory_across_branches_and_takes_the_slowest_branch_per_position():
    # M = max(1 + 3, 2 + 4) = 6; t = max(1, 2) + max(5, 1) = 7
    got = parallel([[1.0, 2.0], [3.0, 4.0]], [[1.0, 5.0], [2.0, 1.0]])
    assert got == Aggregate(memory_mb=6.0, time_ms=7.0)


def test_a_shorter_branch_holds_nothing_after_its_end():
    # positions: (1 + 5, 4 + 0) -> M = 6; t = max(2, 1) + max(3, 0) = 5
    got = parallel([[1.0, 4.0], [5.0]], [[2.0, 3.0], [1.0]])
    assert got == Aggregate(memory_mb=6.0, time_ms=5.0)


def test_hybrid_takes_the_larger_memory_and_adds_the_times():
    got = hybrid(Aggregate(memory_mb=2.0, time_ms=3.0), Aggregate(memory_mb=6.0, time_ms=7.0))
    assert got == Aggregate(memory_mb=6.0, time_ms=10.0)


def test_mismatched_layouts_are_refused():
    with pytest.raises(ValueError, match="memory has 2 ops"):
        chain([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="layout"):
        parallel([[1.0, 2.0]], [[1.0]])


def test_empty_inputs_aggregate_to_zero():
    zero = Aggregate(memory_mb=0.0, time_ms=0.0)
    assert chain([], []) == parallel([], []) == hybrid() == slice_profile([], []) == zero


def test_slice_profile_is_the_chain_rule_over_its_layers():
    got = slice_profile([100.0, 250.0, 80.0], [4.0, 9.5, 1.5])
    assert got == Aggregate(memory_mb=250.0, time_ms=15.0)


floats = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(st.lists(st.tuples(floats, floats), max_size=8))
def test_a_single_branch_is_a_chain(ops):
    m, t = [o[0] for o in ops], [o[1] for o in ops]
    assert parallel([m], [t]) == chain(m, t)


@given(st.lists(st.tuples(floats, floats), max_size=8), st.integers(min_value=0, max_value=8))
def test_a_chain_cut_in_two_is_the_hybrid_of_its_parts(ops, cut):
    m, t = [o[0] for o in ops], [o[1] for o in ops]
    whole = chain(m, t)
    parts = hybrid(chain(m[:cut], t[:cut]), chain(m[cut:], t[cut:]))
    assert parts.memory_mb == whole.memory_mb
    assert parts.time_ms == pytest.approx(whole.time_ms)


# --- structure -----------------------------------------------------------------------------------


def test_a_path_is_a_chain():
    s = structure_of(dag("ab", "bc"))
    assert (s.kind, s.chain, s.regions) == ("chain", ("a", "b", "c"), ())


def test_a_skip_edge_beside_a_node_keeps_it_on_the_chain():
    # a -> b -> c and a -> c: b runs alone; the skip edge carries a tensor, not an op.
    assert structure_of(dag("ab", "bc", "ac")).kind == "chain"


def test_a_diamond_is_a_hybrid_of_its_ends_and_two_branches():
    s = structure_of(dag("ab", "ac", "bd", "cd"))
    assert s.kind == "hybrid"
    assert s.chain == ("a", "d")
    assert s.regions == (ParallelRegion(branches=((("b",),), (("c",),))),)


def test_independent_paths_are_parallel_with_positions_by_generation():
    s = structure_of(dag("xy", "pq", "qr"))
    assert s.kind == "parallel" and s.chain == ()
    assert s.regions == (ParallelRegion(branches=((("x",), ("y",)), (("p",), ("q",), ("r",)))),)


def test_an_inception_like_block_has_branches_of_unequal_depth_between_fork_and_join():
    # s -> {a -> A, b, c -> C -> D} -> j -> k
    s = structure_of(dag("sa", "aA", "sb", "sc", "cC", "CD", "Aj", "bj", "Dj", "jk"))
    assert s.kind == "hybrid" and s.chain == ("s", "j", "k")
    (region,) = s.regions
    assert region.branches == ((("a",), ("A",)), (("b",),), (("c",), ("C",), ("D",)))


def test_aggregate_a_hand_built_hybrid_layer_exactly():
    s = structure_of(dag("ab", "ac", "bd", "cd"))
    memory = {"a": 2.0, "b": 3.0, "c": 4.0, "d": 1.0}
    time = {"a": 1.0, "b": 2.0, "c": 5.0, "d": 1.0}
    # chain (a, d): M = 2, t = 2; branches b | c: M = 3 + 4 = 7, t = max(2, 5) = 5
    assert aggregate_layer(s, memory, time) == Aggregate(memory_mb=7.0, time_ms=7.0)


def test_aggregate_the_parallel_example_from_its_structure():
    s = structure_of(dag("xy", "pq"))  # branches (x, y) and (p, q)
    memory = {"x": 1.0, "y": 2.0, "p": 3.0, "q": 4.0}
    time = {"x": 1.0, "y": 5.0, "p": 2.0, "q": 1.0}
    assert aggregate_layer(s, memory, time) == Aggregate(memory_mb=6.0, time_ms=7.0)


def test_ops_without_a_prediction_count_zero():
    s = structure_of(dag("ab", "bc"))
    assert aggregate_layer(s, {"b": 5.0}, {"b": 2.0}) == Aggregate(memory_mb=5.0, time_ms=2.0)


def test_ops_sharing_a_position_in_one_branch_add_memory_and_take_the_slowest_time():
    # A knot: u, v both feed w and z; no node but k is comparable to all, so one region whose
    # single branch has generations (u, v), (w, z).
    s = structure_of(dag("uw", "uz", "vw", "vz", "wk", "zk"))
    assert s.chain == ("k",)
    assert s.regions[0].branches == ((("u", "v"), ("w", "z")),)
    memory = {"u": 1.0, "v": 2.0, "w": 4.0, "z": 4.0, "k": 1.0}
    time = {"u": 1.0, "v": 3.0, "w": 2.0, "z": 1.0, "k": 1.0}
    assert aggregate_layer(s, memory, time) == Aggregate(memory_mb=8.0, time_ms=6.0)


def test_service_profile_gives_one_memory_and_time_per_layer():
    layers = [
        LayerStructure(name="l0", chain=("a", "b"), regions=()),
        structure_of(dag("cd", "ce", "df", "ef"), name="l1"),
    ]
    memory = {"a": 1.0, "b": 3.0, "c": 1.0, "d": 2.0, "e": 2.0, "f": 1.0}
    time = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 4.0, "e": 3.0, "f": 1.0}
    profile = service_profile(layers, memory, time)
    assert profile.layers == ("l0", "l1")
    assert profile.memory_mb == (3.0, 4.0)
    assert profile.time_ms == (2.0, 6.0)


def test_structure_is_deterministic_whatever_the_edge_order():
    edges = ["sa", "aA", "sb", "sc", "cC", "CD", "Aj", "bj", "Dj", "jk"]
    first = structure_of(dag(*edges, nodes="saAbcCDjk"))
    again = structure_of(dag(*reversed(edges), nodes="saAbcCDjk"))
    assert first == again


# --- structure of real layers ---------------------------------------------------------------------


class Inception(nn.Module):
    """conv1x1 | conv3x3 | maxpool side by side, concatenated: one layer at depth 1."""

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Conv2d(4, 4, 1)
        self.three = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.one(x), self.three(x), self.pool(x)], dim=1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Inception()
        self.rnn = nn.LSTM(12, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x).flatten(2).transpose(1, 2)  # (batch, 16 steps, 12 features)
        return self.rnn(y)[0]


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return api.analyze(Net().eval(), {"x": torch.randn(1, 4, 4, 4)}, depth=1).layers


def test_an_inception_block_is_parallel_branches_joined_by_its_concat(net):
    block = next(la for la in net.layers if la.name == "block")
    s = layer_structure(block, net)
    assert s.kind == "hybrid" and s.name == "block"
    assert s.chain[0].startswith("cat")
    (region,) = s.regions
    ops = sorted(name.rstrip("_0123456789") for b in region.branches for pos in b for name in pos)
    assert ops == ["conv2d", "conv2d", "max_pool2d"]


def test_an_lstm_layer_is_a_chain_once_its_zero_state_and_getitems_are_dropped(net):
    rnn = next(la for la in net.layers if la.name == "rnn")
    s = layer_structure(rnn, net)
    assert s.kind == "chain" and [n.rstrip("_0123456789") for n in s.chain][-1] == "lstm"


def test_keep_restricts_the_structure_to_the_given_ops(net):
    block = next(la for la in net.layers if la.name == "block")
    convs = [n for n in block.nodes if n.startswith("conv2d")]
    s = layer_structure(block, net, keep=convs)
    assert s.kind == "parallel"
    assert sorted(n for b in s.regions[0].branches for pos in b for n in pos) == sorted(convs)
