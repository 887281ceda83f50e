"""Simplify: node and edge elimination on hand-built layer DAGs, and its invariants on random ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopar.planner.simplify import simplify


def _t(*names: str, nbytes: int = 4) -> frozenset[tuple[str, int]]:
    return frozenset((name, nbytes) for name in names)


def _chain(memory_mb):
    """Edges of a chain -1 -> 0 -> 1 -> ... -> n, layer i producing tensor ``t{i}``."""
    n = len(memory_mb)
    return [(i - 1, i, _t("x" if i == 0 else f"t{i - 1}")) for i in range(n + 1)]


# --- hand-built graphs ----------------------------------------------------------------------------


def test_chain_merges_similar_neighbours_and_keeps_different_ones_apart():
    memory = [100.0, 103.0, 300.0, 302.0, 50.0]
    result = simplify(5, memory, _chain(memory))
    assert result.groups == ((0, 2), (2, 4), (4, 5))
    assert result.group_of == (0, 0, 1, 1, 2)
    assert result.memory_mb == (103.0, 302.0, 50.0)
    assert result.edges == ((-1, 0, _t("x")), (0, 1, _t("t1")), (1, 2, _t("t3")), (2, 3, _t("t4")))
    assert result.modified


def test_merged_group_memory_is_the_max_and_the_chain_rule_repeats():
    memory = [10.0, 10.4, 10.8, 11.2]  # each within 5% of the running max
    result = simplify(4, memory, _chain(memory))
    assert result.groups == ((0, 4),)
    assert result.memory_mb == (11.2,)
    assert result.edges == ((-1, 0, _t("x")), (0, 1, _t("t3")))


def test_a_chain_of_different_memories_is_unchanged_and_says_so():
    memory = [1.0, 2.0, 4.0]
    result = simplify(3, memory, _chain(memory))
    assert result.groups == ((0, 1), (1, 2), (2, 3))
    assert not result.modified


def test_fork_and_join_with_two_edges_are_not_eliminated_but_a_branch_is_merged():
    # Two residual blocks, fork 0 / join 3 and fork 4 / join 6, with branches 1-2 and 5. The join 3
    # and the fork 4 have equal memories, are neighbours and are connected, but each has two edges
    # on one side, so they stay apart; the branch layers 1 and 2 are similar and merge.
    edges = [
        (-1, 0, _t("x")),
        (0, 1, _t("a")),
        (0, 3, _t("a")),
        (1, 2, _t("b")),
        (2, 3, _t("c")),
        (3, 4, _t("d")),
        (4, 5, _t("e")),
        (4, 6, _t("e")),
        (5, 6, _t("f")),
        (6, 7, _t("g")),
    ]
    result = simplify(7, [5.0, 50.0, 51.0, 5.0, 5.0, 60.0, 5.0], edges)
    assert result.groups == ((0, 1), (1, 3), (3, 4), (4, 5), (5, 6), (6, 7))
    assert result.memory_mb == (5.0, 51.0, 5.0, 5.0, 60.0, 5.0)
    assert result.edges[:4] == (
        (-1, 0, _t("x")),
        (0, 1, _t("a")),
        (0, 2, _t("a")),
        (1, 2, _t("c")),
    )


def test_equal_memories_collapse_a_diamond_through_its_branches():
    # 0 -> {1, 2} -> 3. Branch 1 merges into the fork 0 (its only input, and its neighbour); then
    # {0, 1} feeds 2 through one edge, 2 merges, and the join follows. The fork itself never
    # starts a merge: it has two outputs.
    edges = [
        (-1, 0, _t("x")),
        (0, 1, _t("a")),
        (0, 2, _t("a")),
        (1, 3, _t("b")),
        (2, 3, _t("c")),
        (3, 4, _t("d")),
    ]
    assert simplify(4, [7.0] * 4, edges).groups == ((0, 4),)
    assert simplify(4, [7.0, 1.0, 2.0, 7.0], edges).groups == ((0, 1), (1, 2), (2, 3), (3, 4))


def test_parallel_edges_are_merged_with_the_union_of_their_tensors():
    edges = [(-1, 0, _t("x")), (0, 1, _t("a")), (0, 1, _t("a", "b")), (1, 2, _t("c"))]
    result = simplify(2, [1.0, 50.0], edges)
    assert result.groups == ((0, 1), (1, 2))
    assert result.edges == ((-1, 0, _t("x")), (0, 1, _t("a", "b")), (1, 2, _t("c")))
    assert result.modified  # the parallel edges were merged, even though no layer was


def test_merging_makes_parallel_edges_that_are_merged_in_turn():
    # 0 feeds 1 and 2 the same tensor; once 1 and 2 merge, 0 has one out-edge and merges too.
    edges = [(-1, 0, _t("x")), (0, 1, _t("a")), (0, 2, _t("a")), (1, 2, _t("b")), (2, 3, _t("c"))]
    result = simplify(3, [8.0] * 3, edges)
    assert result.groups == ((0, 3),)
    assert result.edges == ((-1, 0, _t("x")), (0, 1, _t("c")))


def test_threshold_zero_merges_only_equal_memories():
    memory = [4.0, 4.0, 4.01, 4.01]
    assert simplify(4, memory, _chain(memory), threshold=0).groups == ((0, 2), (2, 4))
    assert simplify(4, memory, _chain(memory), threshold=0.01).groups == ((0, 4),)


def test_pseudo_input_and_output_are_never_merged():
    memory = [3.0]
    result = simplify(1, memory, _chain(memory), threshold=10.0)
    assert result.groups == ((0, 1),)
    assert result.edges == ((-1, 0, _t("x")), (0, 1, _t("t0")))


@pytest.mark.parametrize(
    ("n", "memory", "edges", "match"),
    [
        (2, [1.0], [], "one memory per layer"),
        (1, [-1.0], [], "finite and >= 0"),
        (2, [1.0, 1.0], [(1, 0, frozenset())], "not forward"),
        (2, [1.0, 1.0], [(0, 3, frozenset())], "not forward"),
    ],
)
def test_malformed_arguments_are_refused(n, memory, edges, match):
    with pytest.raises(ValueError, match=match):
        simplify(n, memory, edges)


# --- properties on random DAGs --------------------------------------------------------------------


@st.composite
def dags(draw):
    n = draw(st.integers(1, 12))
    # Few distinct memories, and mostly a chain plus a few skips, so that merges happen often.
    memory = draw(st.lists(st.sampled_from([1.0, 1.02, 1.5, 10.0, 10.3]), min_size=n, max_size=n))
    tensors = st.frozensets(st.tuples(st.sampled_from("abcdefgh"), st.just(8)), max_size=3)
    chain = [(i - 1, i) for i in range(n + 1) if draw(st.integers(0, 9)) > 0]
    pairs = st.tuples(st.integers(-1, n - 1), st.integers(0, n)).filter(lambda p: p[0] < p[1])
    skips = draw(st.lists(pairs, max_size=draw(st.sampled_from([0, 3, 12]))))
    edges = [(u, v, draw(tensors)) for u, v in chain + skips]
    threshold = draw(st.sampled_from([0.0, 0.05, 0.5]))
    return n, memory, edges, threshold


def _boundary_bytes(edges, b: int) -> int:
    """Bytes of distinct tensors on edges that cross the boundary before node b."""
    crossing = set().union(*(t for u, v, t in edges if u < b <= v))
    return sum(nbytes for _, nbytes in crossing)


@settings(max_examples=300, deadline=None)
@given(dags())
def test_simplify_invariants_on_random_dags(dag):
    n, memory, edges, threshold = dag
    result = simplify(n, memory, edges, threshold)
    # Contiguous groups that cover every layer, each layer in exactly one group.
    assert result.groups[0][0] == 0 and result.groups[-1][1] == n
    assert all(lo < hi for lo, hi in result.groups)
    assert all(a[1] == b[0] for a, b in zip(result.groups, result.groups[1:]))
    assert result.group_of == tuple(
        k for k, (lo, hi) in enumerate(result.groups) for _ in range(lo, hi)
    )
    assert result.memory_mb == tuple(max(memory[lo:hi]) for lo, hi in result.groups)
    # Idempotent: a second pass keeps every group and changes nothing.
    again = simplify(len(result.groups), result.memory_mb, result.edges, result.threshold)
    assert again.groups == tuple((k, k + 1) for k in range(len(result.groups)))
    assert again.edges == result.edges and not again.modified
    # Every cut between groups hands over exactly the bytes the same layer cut would.
    for k, (lo, _) in enumerate(result.groups):
        assert _boundary_bytes(result.edges, k) == _boundary_bytes(edges, lo)
