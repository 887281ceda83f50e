"""Apply a Plan: split the exported graph into one GraphModule per slice.

The extraction itself is the IR's (`mopar.ir.subgraph.extract_slices`), so the planner analyses
the very modules this hands to the rest of the rewrite; see there for what a slice's inputs and
outputs are.
"""

from __future__ import annotations

from typing import Any

from mopar.ir import LayerGraph
from mopar.ir.subgraph import SliceModule, extract_slices, output_nodes

__all__ = ["SliceModule", "split_by_plan", "output_values"]


def output_values(lg: LayerGraph) -> tuple[str, ...]:
    """Value name of each flat model output, in output order."""
    return tuple(lg.value_names[n.name] for n in output_nodes(lg.gm.graph))


def split_by_plan(lg: LayerGraph, plan: Any) -> tuple[SliceModule, ...]:
    """Build one `SliceModule` per slice of ``plan``'s vertical cut (sub-slices aside)."""
    vertical = plan.vertical()
    return extract_slices(lg, getattr(vertical, "slices", vertical))
