"""Dynamic dimensions at capture: which input dimensions stay symbolic, and over what range.

A bundle takes a dynamic dimension at any size in its range (`mopar.config.DynamicDim`). The
capture keeps two graphs of the same program: the *static* one, every size at the example's
(what the planner analyses and prices: the representative shape), and the *program*, whose
dynamic dimensions stay symbolic (what each slice is exported from, `mopar.ir.dynamic`). Their
tensor nodes have the same names.

Read in this order: `check_dims` (the user's dimensions against the example), `resized` (the
example at another size of its dynamic dimensions), `program_ranges` (which of a .pt2's own
symbolic dimensions stay dynamic), `module_shapes` (torch.export's ``dynamic_shapes`` for a
module), then `split_static` (the two graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import fx

from mopar.config import DynamicDim
from mopar.errors import CaptureError, InputSpecError, Option

__all__ = ["check_dims", "module_shapes", "program_ranges", "resized", "sizes_at"]

PICKS = ("min", "mid", "max")
"""The sizes of each dynamic dimension a bundle is verified at."""


def sizes_at(dim: DynamicDim, pick: str) -> int:
    """``dim``'s size at ``pick``: ``min``, ``max``, or ``mid`` (halfway, at least 2: a size of
    1 would let torch.export fix the dimension)."""
    if pick == "min":
        return dim.min
    if pick == "max":
        return dim.max
    return min(dim.max, max(2, (dim.min + dim.max) // 2))


def resized(
    arrays: dict[str, np.ndarray], dims: Sequence[DynamicDim], pick: str
) -> dict[str, np.ndarray]:
    """``arrays`` with each of ``dims`` at its ``pick`` size (`sizes_at`): cut to the first
    rows along the axis, or the example repeated along it (token ids stay valid ids)."""
    out = dict(arrays)
    for d in dims:
        a, size = out[d.input], sizes_at(d, pick)
        out[d.input] = np.ascontiguousarray(np.take(a, np.arange(size) % a.shape[d.axis], d.axis))
    return out


def check_dims(dims: Sequence[DynamicDim], arrays: dict[str, np.ndarray]) -> None:
    """Raise `InputSpecError` where a dimension names no input, an axis the input lacks, the
    same dimension twice, or a range its example size lies outside."""
    seen: set[tuple[str, int]] = set()
    for d in dims:
        if d.input not in arrays:
            raise InputSpecError(
                f"dynamic dimension {d} names input {d.input!r}, but the model's inputs are "
                f"{sorted(arrays)}; name one of those in ",
                Option("dynamic"),
            )
        shape = arrays[d.input].shape
        if d.axis >= len(shape):
            raise InputSpecError(
                f"dynamic dimension {d}: input {d.input!r} has {len(shape)} dimensions "
                f"{list(shape)}, so axis {d.axis} does not exist; give an axis below {len(shape)} "
                "in ",
                Option("dynamic"),
            )
        if (d.input, d.axis) in seen:
            raise InputSpecError(
                f"dynamic dimension {d.input}:{d.axis} is given twice; give each once in ",
                Option("dynamic"),
            )
        seen.add((d.input, d.axis))
        if not d.min <= shape[d.axis] <= d.max:
            raise InputSpecError(
                f"dynamic dimension {d}: the example's {d.input!r} has size {shape[d.axis]} on "
                f"axis {d.axis}, outside {d.min}..{d.max}; widen the range in ",
                Option("dynamic"),
                " or pass an example inside it",
            )


def module_shapes(dims: Sequence[DynamicDim], names: Sequence[str]) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes`` for a module called with inputs ``names``: each of
    ``dims`` free within its range; torch.export finds which of them are equal."""
    shapes: dict[str, Any] = {name: None for name in names}
    for d in dims:
        axes = shapes[d.input] or {}
        axes[d.axis] = torch.export.Dim.DYNAMIC(min=d.min, max=d.max)
        shapes[d.input] = axes
    return shapes


def symbol_ranges(
    gm: fx.GraphModule, names: Sequence[str], dims: Sequence[DynamicDim]
) -> dict[str, tuple[int, int]]:
    """The range of each symbol that stands for one of ``dims`` in ``gm``'s placeholders (the
    inputs ``names``, in order): the intersection where several dimensions share one."""
    ranges: dict[str, tuple[int, int]] = {}
    for d in dims:
        size = _placeholder_dim(gm, names, d)
        symbol = _symbol(size)
        if symbol is None:
            raise CaptureError(
                f"the model fixes dynamic dimension {d} at {int(size)}: its forward() needs "
                "that exact size. Fix: leave it out of ",
                Option("dynamic"),
                ", or make the model accept other sizes",
            )
        lo, hi = ranges.get(symbol, (d.min, d.max))
        ranges[symbol] = (max(lo, d.min), min(hi, d.max))
    return ranges


def program_ranges(
    gm: fx.GraphModule,
    names: Sequence[str],
    arrays: dict[str, np.ndarray],
    dims: Sequence[DynamicDim],
    bound_of: Callable[[Any], tuple[int, int] | None],
) -> tuple[tuple[DynamicDim, ...], dict[str, tuple[int, int]], tuple[str, ...]]:
    """The dynamic dimensions of a .pt2's program ``gm`` (its user inputs ``names``): those the
    user named in ``dims``, and the program's own symbolic ones with a finite range
    (``bound_of(size)``: its (min, max), None where unbounded). Returns them, their symbols'
    ranges, and a note for each symbolic dimension that is frozen at the example's size.

    Raises:
        InputSpecError: a named dimension is static in the program, or reaches past the range
            the program was exported for.
    """
    check_dims(dims, arrays)
    named = {(d.input, d.axis): d for d in dims}
    kept: list[DynamicDim] = []
    notes: list[str] = []
    for name in names:
        for axis, size in enumerate(_placeholder_shape(gm, names, name)):
            d = named.get((name, axis))
            symbol = _symbol(size)
            if symbol is None:
                if d is not None:
                    raise InputSpecError(
                        f"dynamic dimension {d}: the .pt2 was exported with {name!r} fixed at "
                        f"{int(size)} on axis {axis}; export it again with dynamic_shapes for "
                        "that dimension, or leave it out of ",
                        Option("dynamic"),
                    )
                continue
            bound = bound_of(size)
            if d is not None:
                if bound is not None and not (bound[0] <= d.min and d.max <= bound[1]):
                    raise InputSpecError(
                        f"dynamic dimension {d} reaches past the range {bound[0]}..{bound[1]} "
                        f"the .pt2 was exported for; narrow it in ",
                        Option("dynamic"),
                    )
                kept.append(d)
            elif bound is not None and bound[1] > max(bound[0], 1):
                kept.append(DynamicDim(input=name, axis=axis, min=max(1, bound[0]), max=bound[1]))
            else:
                size_now = arrays[name].shape[axis]
                notes.append(
                    f"{name!r} axis {axis} is dynamic in the .pt2 without an upper bound, so it "
                    f"is frozen at the example's {size_now}; to keep it dynamic, give its range "
                    f"as a dynamic dimension, {name}:{axis}=MIN..MAX"
                )
    check_dims(kept, arrays)
    return tuple(kept), symbol_ranges(gm, names, kept), tuple(notes)


def _placeholder_shape(gm: fx.GraphModule, names: Sequence[str], name: str) -> tuple:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    val = phs[list(names).index(name)].meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _placeholder_dim(gm: fx.GraphModule, names: Sequence[str], d: DynamicDim) -> Any:
    return _placeholder_shape(gm, names, d.input)[d.axis]


def _symbol(size: Any) -> str | None:
    """The symbol a dimension is, or None where it is a number (or an expression)."""
    node = getattr(size, "node", None)
    if node is None or node.maybe_as_int() is not None or not node.expr.is_Symbol:
        return None
    return str(node.expr)
