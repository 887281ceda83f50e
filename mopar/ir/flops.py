"""Forward FLOPs of one ATen node, from the shapes torch.export recorded.

Counts multiply-adds as two FLOPs. Ops without a formula count one FLOP per output element, a fair
stand-in for elementwise work; views and metadata ops count zero. A data-dependent dimension
(after ``torch.nonzero``, a boolean mask) counts at its upper bound (`mopar.ir.sizes`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from mopar.ir import sizes

__all__ = ["DataDependent", "data_dependent", "node_flops", "op_name"]

_ZERO_COST = {
    "view",
    "reshape",
    "_unsafe_view",
    "permute",
    "transpose",
    "t",
    "expand",
    "unsqueeze",
    "squeeze",
    "flatten",
    "contiguous",
    "clone",
    "getitem",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "alias",
    "detach",
    "lift_fresh_copy",
    "_to_copy",
    "to",
    "type_as",
    "sym_size",
    "size",
    "dropout",
    "native_dropout",
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "cat",
    "stack",
    "index_select",
    "embedding",
    "expand_as",
    "_assert_tensor_metadata",
    "_assert_scalar",
    "sym_constrain_range_for_size",
    "copy",
}


def _shape(v: object) -> tuple[int, ...]:
    return sizes.shape(v) if isinstance(v, torch.Tensor) else ()


def _val(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _conv(node: fx.Node, out: tuple[int, ...]) -> int:
    w = _shape(_val(node.args[1]))
    # weight: (C_out, C_in / groups, *kernel); each output element needs C_in/groups * kernel MACs.
    return 2 * _numel(out) * _numel(w[1:])


def _contract(arg: int) -> Callable[[fx.Node, tuple[int, ...]], int]:
    """A product's FLOPs: one multiply-add per output element and term of ``args[arg]``'s last
    dimension (the contracted one)."""

    def flops(node: fx.Node, out: tuple[int, ...]) -> int:
        a = _shape(_val(node.args[arg]))
        return 2 * _numel(out) * (a[-1] if a else 1)

    return flops


def _sdpa(node: fx.Node, out: tuple[int, ...]) -> int:
    q = _shape(_val(node.args[0]))
    k = _shape(_val(node.args[1]))
    if len(q) < 2 or len(k) < 2:
        return _numel(out)
    batch = _numel(q[:-2])
    # Q @ K^T then P @ V: two matmuls of (Lq x E) by (E x Lk) and (Lq x Lk) by (Lk x Ev).
    return 2 * batch * q[-2] * k[-2] * (q[-1] + out[-1])


def _rnn(node: fx.Node, out: tuple[int, ...], gates: int) -> int:
    x = _shape(_val(node.args[0]))
    params = node.args[2] if len(node.args) > 2 else ()
    weights = [_shape(_val(p)) for p in params if isinstance(p, fx.Node)]
    mats = [w for w in weights if len(w) == 2]
    steps = _numel(x[:-1]) if x else 1
    # Each step multiplies the input and the hidden state by every weight matrix.
    return 2 * steps * sum(r * c for r, c in mats) if mats else gates * _numel(out)


_FORMULAS: dict[str, Callable[[fx.Node, tuple[int, ...]], int]] = {
    "conv1d": _conv,
    "conv2d": _conv,
    "conv3d": _conv,
    "convolution": _conv,
    "_convolution": _conv,
    "linear": _contract(0),
    "mm": _contract(0),
    "bmm": _contract(0),
    "matmul": _contract(0),
    "addmm": _contract(1),
    "baddbmm": _contract(1),
    "scaled_dot_product_attention": _sdpa,
    "lstm": lambda n, o: _rnn(n, o, 4),
    "gru": lambda n, o: _rnn(n, o, 3),
}


def op_name(node: fx.Node) -> str:
    """The ATen op's short name (``aten.conv2d.default`` -> ``conv2d``), or the target's name."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__.rstrip("_") or packet.__name__
    return getattr(target, "__name__", str(target))


def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of a call_function node (0 for placeholders, views and metadata ops)."""
    if node.op != "call_function":
        return 0
    name = op_name(node)
    if name in _ZERO_COST:
        return 0
    out = _shape(_first_tensor(node.meta.get("val")))
    formula = _FORMULAS.get(name)
    try:
        return int(formula(node, out)) if formula else _numel(out)
    except (IndexError, TypeError, AttributeError):
        return _numel(out)


# --- data-dependent sizes -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DataDependent:
    """A node whose output size depends on the values of its inputs.

    Attributes:
        node: the FX node's name.
        op: its ATen op (``nonzero``; ``index`` for a boolean mask ``x[x > 0]``).
        source: the line of the model's code that made it, as ``file.py:LINE: code`` ("" where
            torch.export recorded none).
        shape: its output's shape as counted (`mopar.ir.sizes.shape`): data-dependent
            dimensions at their upper bound, or `mopar.ir.sizes.UNBOUNDED_DIM`.
        bounded: whether every such dimension had an upper bound.
    """

    node: str
    op: str
    source: str
    shape: tuple[int, ...]
    bounded: bool


def data_dependent(nodes: Iterable[fx.Node]) -> list[DataDependent]:
    """The nodes among ``nodes`` that create a data-dependent size (torch.export records the
    symbols such a node binds in ``meta["unbacked_bindings"]``), in graph order."""
    found = []
    for node in nodes:
        if not node.meta.get("unbacked_bindings"):
            continue
        val = _first_tensor(node.meta.get("val"))
        found.append(
            DataDependent(
                node=node.name,
                op=op_name(node),
                source=_source(node),
                shape=_shape(val),
                bounded=val is None or sizes.is_bounded(val),
            )
        )
    return found


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Sequence) and not isinstance(value, str):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)')


def _source(node: fx.Node) -> str:
    """``file.py:LINE: code`` of the innermost frame of ``node``'s recorded stack trace."""
    frames = _FRAME_RE.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line, code = frames[-1]
    code = code.split("#")[0].strip()
    return (
        f"{os.path.basename(path)}:{line}: {code}" if code else f"{os.path.basename(path)}:{line}"
    )
