"""ONNX translations of operators that torch.onnx does not translate itself.

A slice that calls such an operator would fail to export. Each translation here is an ONNX Script
function, handed to ``torch.onnx.export(custom_translation_table=...)``; the slice's torch module
keeps the operator, so torch and ONNX both run the same graph. Translations are exact: they do
the same arithmetic as the operator, never an approximation.

Operators are named by their qualified schema name (``transformers::grouped_mm_fallback``), so
this module never imports the library that defines them: `translation_table` picks the entries
for the operators a graph actually calls.

Read in this order: `KNOWN_TRANSLATIONS`, `translation_table`, then one function per operator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from onnxscript import INT64
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.tensor_typing import TReal

__all__ = ["KNOWN_TRANSLATIONS", "translation_table", "qualified_name"]


def qualified_name(target: Any) -> str:
    """``ns::op`` for a torch ``OpOverload`` (``aten::_grouped_mm``); "" for anything else."""
    schema = getattr(target, "_schema", None)
    return str(schema.name) if schema is not None else ""


def grouped_mm_fallback(input: TReal, weight: TReal, offs: INT64) -> TReal:
    """``transformers::grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor``.

    transformers 5's grouped expert matmul (`transformers.integrations.moe`): ``input`` (S, K)
    holds rows sorted by expert, ``weight`` (E, K, N) one matrix per expert, ``offs`` (E,) the
    cumulative row count per expert. Row r < offs[-1] of the (S, N) result is
    ``input[r] @ weight[e]`` for the expert e whose rows hold r; rows from offs[-1] on stay zero.
    """
    return _grouped_rows(input, weight, offs, None)


def aten_grouped_mm(
    self: TReal,
    mat2: TReal,
    offs: INT64 | None = None,
    bias: TReal | None = None,
    out_dtype: int = -1,
) -> TReal:
    """``aten::_grouped_mm``: torchlib translates it only without ``offs``; with ``offs`` and a
    2-D ``self`` against a 3-D ``mat2`` it is the grouped expert matmul above (plus a bias per
    group), and without ``offs`` a batched matmul."""
    if offs is None:
        result = op.MatMul(self, mat2)
        if bias is not None:
            result = op.Add(result, bias)
    elif len(self.shape) == 2 and len(mat2.shape) == 3:
        result = _grouped_rows(self, mat2, offs, bias)
    else:
        raise NotImplementedError(
            f"aten::_grouped_mm with offs is translated for a 2-D input and 3-D weights only, got "
            f"{len(self.shape)}-D and {len(mat2.shape)}-D"
        )
    if out_dtype is not None and out_dtype != -1:
        result = op.Cast(result, to=out_dtype)
    return result


def _grouped_rows(rows_in, weights, offs, bias):
    """One MatMul per group on its rows (a Gather of a Range), concatenated, then zero rows for
    the tail past ``offs[-1]``. The group count must be static: it is the unrolling factor."""
    groups = weights.shape[0]
    if not isinstance(groups, int):
        raise NotImplementedError(
            "grouped matmul: the number of groups (weight.shape[0]) must be "
            f"static to unroll, got {groups!r}"
        )
    axis0 = op.Constant(value_ints=[0])

    def per_group(x):  # one Split, not a Slice per group
        return op.Split(x, axis=0, num_outputs=groups) if groups > 1 else [x]

    ends, mats = per_group(op.Cast(offs, to=INT64.dtype)), per_group(weights)
    biases = per_group(bias) if bias is not None else None
    one = op.Constant(value_int=1)
    start = op.Constant(value_int=0)
    parts = []
    for g in range(groups):
        end = op.Squeeze(ends[g], axis0)
        part = op.MatMul(
            op.Gather(rows_in, op.Range(start, end, one), axis=0), op.Squeeze(mats[g], axis0)
        )
        if biases is not None:
            part = op.Add(part, op.Squeeze(biases[g], axis0))
        parts.append(part)
        start = end
    tail = op.Sub(op.Shape(rows_in, start=0, end=1), op.Unsqueeze(start, axis0))
    width = op.Shape(weights, start=2, end=3)
    zero = op.CastLike(op.Constant(value_float=0.0), rows_in)
    parts.append(op.Expand(zero, op.Concat(tail, width, axis=0)))
    return op.Concat(*parts, axis=0)


KNOWN_TRANSLATIONS: Mapping[str, Callable[..., Any]] = MappingProxyType(
    {"transformers::grouped_mm_fallback": grouped_mm_fallback, "aten::_grouped_mm": aten_grouped_mm}
)
"""ONNX Script translation of each operator, by qualified name."""


def translation_table(targets: Iterable[Any]) -> dict[Any, Callable[..., Any]]:
    """The ``custom_translation_table`` for a graph calling ``targets`` (FX node targets): every
    `OpOverload` among them with a known translation, mapped to it."""
    table = {}
    for target in targets:
        fn = KNOWN_TRANSLATIONS.get(qualified_name(target))
        if fn is not None:
            table[target] = fn
    return table
