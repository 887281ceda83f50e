"""Sizes of tensors whose shapes torch.export left symbolic, as numbers to count with.

Read `dim` first (one dimension), then `shape`, `numel` and `nbytes` (a tensor).

A data-dependent op (``torch.nonzero``, a boolean mask ``x[x > 0]``, ``torch.unique``) gives its
output an *unbacked* size: torch.export knows a range for it, not a value, and ``int()`` on it
raises. Counting FLOPs and bytes needs a number, so such a dimension counts at the upper bound of
its range where torch knows one below `MAX_BOUND` (``nonzero`` of a [4, 6] tensor: at most 24
rows), and as `UNBOUNDED_DIM` where it does not. Sizes are therefore an upper estimate after a
data-dependent op. A dynamic dimension torch.export has an example of (``torch.export.Dim``)
counts at the example's size, exactly as a static one.
"""

from __future__ import annotations

import math
from typing import Any

from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

__all__ = [
    "MAX_BOUND",
    "UNBOUNDED_DIM",
    "dim",
    "is_bounded",
    "is_exact",
    "nbytes",
    "numel",
    "shape",
]

#: an upper bound at or above this is no bound (torch gives ``sys.maxsize - 1`` where it has none)
MAX_BOUND = 2**31
#: how a data-dependent dimension without a usable bound counts, elements
UNBOUNDED_DIM = 1


_EXACT, _BOUND, _UNBOUNDED = "exact", "bound", "unbounded"


def _estimate(d: Any) -> tuple[int, str]:
    """(``d`` as a number, how it was found: `_EXACT`, `_BOUND` or `_UNBOUNDED`)."""
    if isinstance(d, int):
        return d, _EXACT
    node = getattr(d, "node", None)
    env = getattr(node, "shape_env", None)
    if env is None:  # a plain integer type, or a SymInt with no shape environment
        return int(d), _EXACT
    constant = node.maybe_as_int()
    if constant is not None:
        return int(constant), _EXACT
    if not free_unbacked_symbols(node.expr):  # backed: the example's size, read without a guard
        return int(env.optimization_hint(node.expr)), _EXACT
    upper = env.bound_sympy(node.expr).upper
    try:
        bound = int(upper)
    except (TypeError, ValueError, OverflowError):  # int_oo
        bound = MAX_BOUND
    return (bound, _BOUND) if 0 <= bound < MAX_BOUND else (UNBOUNDED_DIM, _UNBOUNDED)


def dim(d: Any) -> int:
    """One dimension as a number: itself, its example size, or (data-dependent) its upper
    bound, else `UNBOUNDED_DIM`."""
    return _estimate(d)[0]


def is_exact(t: Any) -> bool:
    """Whether every dimension of tensor ``t`` (or the one dimension ``t``) is known, not an
    estimate."""
    dims = t.shape if hasattr(t, "shape") else (t,)
    return all(_estimate(d)[1] == _EXACT for d in dims)


def is_bounded(t: Any) -> bool:
    """Whether every dimension of tensor ``t`` (or the one dimension ``t``) is known or has an
    upper bound below `MAX_BOUND`."""
    dims = t.shape if hasattr(t, "shape") else (t,)
    return all(_estimate(d)[1] != _UNBOUNDED for d in dims)


def shape(t: Any) -> tuple[int, ...]:
    """``t.shape`` as numbers (`dim`); () for anything that is not a tensor."""
    return tuple(dim(d) for d in t.shape) if hasattr(t, "shape") else ()


def numel(t: Any) -> int:
    """Elements of tensor ``t``, counted with `dim`."""
    return math.prod(shape(t))


def nbytes(t: Any) -> int:
    """Bytes of tensor ``t``, counted with `dim`."""
    return numel(t) * t.element_size()
